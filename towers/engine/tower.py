"""Steps 3 and 4: what one tower does with its shard, on its own device(s).

`start_flight` gives a model_parallel.flight.Flight the tower's work: a `StepWork`
(what every tower of the step shares) and a `TowerWork` (this tower's), and
`StageWork`, what each stage computes (the forward, forward.py, and the shard's
share of the batch's loss). The flight takes the shard's micro-batches forward and
back (GradientTape) through the tower's pipeline stages in the schedule's order,
up to where the batch's counts are needed; its `finish` runs the rest. With one
stage and one micro-batch that is one forward and one backward. Nothing here
writes a variable.
"""

import dataclasses
import functools
from typing import Callable, Optional

import tensorflow as tf

from towers import compat
from towers.data_parallel import split
from towers.engine import losses
from towers.engine.forward import concat_rows, cross_cut, forward, regularization_share, shard_loss
from towers.engine.forward import unless_empty
from towers.model_parallel import flight
from towers.op_parallel import layers as op_layers


@dataclasses.dataclass(frozen=True, eq=False)
class StepWork:
    """What every tower of one step shares.

    stages: a stages.Stages; one stage = the whole model.
    objective: a losses.Objective (the loss, as compile takes it).
    batch_rows: the rows of the batch the gradients are the mean over (this
      worker's), a float32 scalar.
    loss_scale: None or a float32 scalar; gradients are of loss * loss_scale.
    micro_batches: micro-batches per shard (int >= 1); schedule: one of
      schedule.SCHEDULES.
    may_be_empty: whether a micro-batch may have no rows; then each one runs the
      model only where it has some (unless_empty). False where the batch is known
      to give every micro-batch a row: no tf.cond is built.
    count_first, recompute_stages: as flight.Plan's count_first and recompute.
    forwards: None, or per stage fn(weights, state, x) -> forward's result in
      training mode (traced_tower.forwards_traced_once's tf.functions); None = forward itself.
    sum_scale: None, or what a sum term's sum is multiplied by in a share
      (denominators.sum_scale: with a cluster).
    last_stage: None, or fn(weights, state, inputs, targets, rows, (batch_rows,
      loss_scale, sum_scale, may_be_empty), persistent) -> flight.last_stage_at_once's
      result for a micro-batch of `rows` rows whose (y[, sample_weight]) is `targets`
      (traced_tower.traced_last_stage's tf.function); None: the flight records the last
      stage's forward and differentiates it later, as every other stage's.
    """
    stages: object
    objective: losses.Objective
    batch_rows: tf.Tensor
    loss_scale: Optional[tf.Tensor] = None
    micro_batches: int = 1
    schedule: str = "1f1b"
    may_be_empty: bool = True
    count_first: bool = True
    recompute_stages: bool = False
    forwards: Optional[tuple] = None
    sum_scale: Optional[tf.Tensor] = None
    last_stage: Optional[Callable] = None


@dataclasses.dataclass(frozen=True, eq=False)
class TowerWork:
    """What is one tower's in a step.

    shard: its (x, y[, sample_weight]), `rows` rows (an int or int32 scalar; may be 0).
    weights, state: model.trainable_variables / non_trainable_variables values in
      model order, each already on its stage's device of `devices`.
    devices: the tower's device per stage (devices.Mesh.tower).
    index: the tower's index (int, or int scalar Tensor inside XLA): offsets the RNG
      seeds so towers draw different dropout masks.
    """
    shard: tuple
    rows: object
    weights: list
    state: list
    devices: list
    index: object


def start_flight(step, tower):
    """Steps 3-4 on one tower, up to where the batch's counts are needed: a started
    flight.Flight (its `terms`, then `finish(scales, densify)` -> a TowerOutput).

    The shard is split into step.micro_batches micro-batches. Each stage runs on
    its own device of tower.devices, in the order the schedule gives it (a control
    dependency orders each stage's actions); activations flow forward from
    stage to stage, and their gradients flow back. Each micro-batch's backward
    starts from its share of the batch's loss (its loss times its rows over the
    batch's: Keras's mean, as MirroredStrategy's loss over the global batch),
    so the micro-batches' and the towers' gradients only need adding up.
    Non-trainable state flows from one micro-batch to the next (an empty
    micro-batch leaves it as it was). With one stage this is gradient
    accumulation (accum_steps). A loss term whose denominator is counted (a
    Keras mask) is scaled by the batch's count, which every tower's forward
    gives (see flight.py).

    Returns:
      the Flight; its TowerOutput has each gradient and state value on its
      stage's device, the loss and y_pred on the last stage's.
    """
    state = _offset_seeds(step.stages.model, tower.state, tower.index)
    plan = flight.Plan(step.schedule, step.count_first, step.recompute_stages)
    return flight.Flight(step.stages, StageWork(step, tower), tower.weights, state,
                         tower.devices, plan).start()


def run_tower(step, tower, densify=None):
    """Steps 3-4 on one tower, whole: start_flight's flight, its counted terms each
    differentiated on its own (TowerOutput.term_grads: denominators.fold scales them)."""
    whole = dataclasses.replace(step, count_first=False)
    return start_flight(whole, tower).finish(None, densify)


class StageWork:
    """What a tower's stages compute, as a flight.Flight runs them (flight.py's `work`):
    the forward (forward.py), the shard's share of the batch's loss and its terms."""

    def __init__(self, step, tower):
        self.step, self.micro, self.sizes = step, [tower.shard], [tower.rows]
        if step.micro_batches > 1:
            sizes = split.shard_sizes(tower.rows, step.micro_batches)
            self.micro, self.sizes = split.split_rows(tower.shard, sizes), split.row_counts(sizes)
        self.forwards = step.forwards or [functools.partial(forward, model, training=True)
                                          for model in step.stages.models]
        self.micro_batches = len(self.micro)
        self.last_stage = None if step.last_stage is None else self._last_stage_at_once

    @property
    def counted(self):
        # The objective knows them once a forward gave its terms (None before).
        return self.step.objective.counted

    def inputs(self, m):
        return self.micro[m][0]

    def forward(self, k, m, weights, state, inputs, several_backwards):
        with op_layers.backwards_once(not several_backwards):
            return unless_empty(self.sizes[m], self.forwards[k], weights, state, inputs,
                                self.step.may_be_empty)

    def _last_stage_at_once(self, m, weights, state, inputs, persistent):
        step = self.step
        return step.last_stage(weights, state, inputs, self.micro[m][1:], self.sizes[m],
                               (step.batch_rows, step.loss_scale, step.sum_scale,
                                step.may_be_empty), persistent)

    def targets(self, k, m, outputs, regularization):
        step, terms, counted = self.step, None, []
        if k == step.stages.num_stages - 1:
            share, terms = shard_loss(step.objective, self.micro[m], outputs, regularization,
                                     self.sizes[m], step.batch_rows, step.sum_scale)
            counted = [weight * term.sum for term, weight
                       in zip(terms, step.objective.weights) if term.per_row is None]
        else:
            share = regularization_share(step.objective, regularization, self.sizes[m],
                                       step.batch_rows)
        targets = [t if t is None or step.loss_scale is None else t * step.loss_scale
                   for t in [share] + counted]
        return share, terms, targets

    def total(self, per_micro_terms):
        if len(per_micro_terms) == 1:
            return per_micro_terms[0]
        return [losses.Term(tf.add_n([t.sum for t in per_micro]),
                            tf.add_n([t.units for t in per_micro]), per_micro[0].per_row)
                for per_micro in zip(*per_micro_terms)]

    def counted_losses(self, scales, terms):
        weights = self.step.objective.weights
        return [weights[i] * scale * terms[i].sum for i, scale in zip(self.counted, scales)]

    def cross_cut(self, values, masks=None):
        return cross_cut((values, losses.output_masks(values) if masks is None else masks))

    def join(self, y_preds):
        return y_preds[0] if len(y_preds) == 1 else concat_rows(y_preds)


def choose_dense_gradients(model, objective, shard, sparse_policy):
    """Whether to densify each variable's sparse gradient on the tower: {id(variable):
    bool} for every variable of `model`, trainable or frozen (a layer unfrozen later
    keeps this choice).

    "keep": never; "dense": always; a float threshold: where the gradient of
    `shard` (one tower's first shard, run eagerly once) looks up more than
    that fraction of the variable's rows.
    """
    variables = model.trainable_variables + model.non_trainable_variables
    if sparse_policy in ("keep", "dense"):
        return {id(v): sparse_policy == "dense" for v in variables}
    weights = [v.value for v in model.trainable_variables]
    state = [v.value for v in model.non_trainable_variables]
    differentiable = [value for value in weights + state if value.dtype.is_floating]
    with tf.GradientTape() as tape:
        tape.watch(differentiable)
        outputs, _, regularization = forward(model, weights, state, shard[0], True)
        rows = split.batch_size(shard)
        share, terms = shard_loss(objective, shard, outputs, regularization, rows,
                                 tf.cast(rows, tf.float32))
        # Every term, counted or not: only which rows the gradients touch matters here.
        value = tf.add_n([term.sum for term in terms] + ([] if share is None else [share]))
    grads = iter(tape.gradient(value, differentiable))
    choices = {}
    for variable, value in zip(variables, weights + state):
        grad = next(grads) if value.dtype.is_floating else None
        choices[id(variable)] = isinstance(grad, tf.IndexedSlices) and int(
            tf.shape(grad.values)[0]) > sparse_policy * int(grad.dense_shape[0])
    return choices


def _offset_seeds(model, state, tower_index):
    """Tower i's values of model.non_trainable_variables: offset_seed of each."""
    return [offset_seed(variable, value, tower_index)
            for variable, value in zip(model.non_trainable_variables, state)]


def offset_seed(variable, value, tower_index):
    """Tower i's value of `variable`: seed + i for an RNG seed state, so dropout masks
    differ between towers; any other value as it is.

    Tower 0 keeps the model's own seeds, and its advanced state is the one
    written back, so the model's random stream moves on as on one device.
    `tower_index` is an int, or an int scalar Tensor (one XLA computation for
    every tower).
    """
    if not compat.is_seed_state(variable) or (
            isinstance(tower_index, int) and tower_index == 0):
        return value
    offset = tf.stack([tf.cast(tower_index, tf.int64), tf.constant(0, tf.int64)])
    return value + tf.cast(offset, value.dtype)
