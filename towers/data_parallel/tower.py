"""Steps 3 and 4: what one tower does with its shard, on its own device(s).

`start_tower` takes the shard's micro-batches forward (forward.py) and back
(GradientTape) through the tower's pipeline stages in the schedule's order, as
a flight.Flight, up to where the batch's counts are needed; its `finish` runs
the rest. With one stage and one micro-batch that is one forward and one
backward. Nothing here writes a variable.
"""

import functools

import tensorflow as tf

from towers.data_parallel import aggregate, split
from towers.data_parallel.flight import Flight
from towers.data_parallel.forward import forward, shard_loss


def start_tower(stages, objective, shard, rows, batch_rows, weights, state, row, tower_index,
                micro_batches=1, schedule_name="1f1b", loss_scale=None, forwards=None,
                may_be_empty=True, count_first=True, recompute_stages=False):
    """Steps 3-4 on one tower, up to where the batch's counts are needed: a started
    flight.Flight (its `terms`, then `finish(scales, densify)` -> a TowerOutput).

    The shard is split into `micro_batches` micro-batches. Each stage runs on
    its own device of `row`, in the order the schedule gives it (a control
    dependency orders each stage's actions); activations flow forward from
    stage to stage, and their gradients flow back. Each micro-batch's backward
    starts from its part of the batch's loss (its loss times its rows over the
    batch's: Keras's mean, as MirroredStrategy's loss over the global batch),
    so the micro-batches' and the towers' gradients only need adding up.
    Non-trainable state flows from one micro-batch to the next (an empty
    micro-batch leaves it as it was). With one stage this is gradient
    accumulation (accum_steps). A loss term whose denominator is counted (a
    Keras mask) is scaled by the batch's count, which every tower's forward
    gives (see flight.py).

    Args:
      stages: a stages.Stages; one stage = the whole model.
      objective: a losses.Objective (the loss, as compile takes it).
      shard: this tower's (x, y[, sample_weight]), `rows` rows (may be 0).
      rows: the shard's rows, an int or int32 scalar.
      batch_rows: the rows of the batch the gradients are the mean over (this
        worker's), a float32 scalar.
      weights, state: model.trainable_variables / non_trainable_variables
        values in model order, each already on its stage's device of `row`.
      row: one device per stage.
      tower_index: int; offsets the RNG seeds so towers draw different dropout masks.
      micro_batches: micro-batches per shard (int >= 1).
      schedule_name: one of schedule.SCHEDULES.
      loss_scale: None or float32 scalar; gradients are of loss * loss_scale.
      forwards: None, or per stage fn(weights, state, x) -> forward's result in
        training mode (compiled_tower's XLA functions); None = forward itself.
      may_be_empty: whether a micro-batch may have no rows; then each one runs
        the model only where it has some (unless_empty). False where the batch
        is known to give every micro-batch a row: no tf.cond is built.
      count_first: whether the batch's counts may come before the backwards
        (they cannot inside one XLA computation, which holds one tower only).
      recompute_stages: whether each stage's forward is rerun in its backward,
        keeping only its inputs (recompute="stages").

    Returns:
      the Flight; its TowerOutput has each gradient and state value on its
      stage's device, the loss and y_pred on the last stage's.
    """
    forwards = forwards or [functools.partial(forward, model, training=True)
                            for model in stages.models]
    return Flight(stages, shard, rows, batch_rows, weights,
                  _offset_seeds(stages.model, state, tower_index), row, micro_batches,
                  schedule_name, objective, loss_scale, forwards, may_be_empty,
                  count_first, recompute_stages).start()


def run_tower(stages, objective, shard, rows, batch_rows, weights, state, row, tower_index,
              micro_batches=1, schedule_name="1f1b", loss_scale=None, densify=None,
              forwards=None, may_be_empty=True):
    """Steps 3-4 on one tower, whole: start_tower's flight, its counted terms each
    differentiated on its own (TowerOutput.term_grads: denominators.fold scales them)."""
    return start_tower(stages, objective, shard, rows, batch_rows, weights, state, row,
                       tower_index, micro_batches, schedule_name, loss_scale, forwards,
                       may_be_empty, count_first=False).finish(None, densify)


class Finished:
    """A tower already run whole (an XLA computation), as a started flight: its `terms`
    known, `finish` giving its TowerOutput."""

    def __init__(self, output):
        self.output, self.terms = output, output.terms

    def finish(self, scales, densify=None):
        del scales, densify  # its counted terms came apart (term_grads), densified inside
        return self.output


def compiled_tower(stages, objective, micro_batches, schedule_name, densify):
    """run_tower with XLA: fn(shard, rows, batch_rows, weights, state, row, tower_index,
    loss_scale, may_be_empty) -> TowerOutput.

    One stage: the tower's forward and backward, all its micro-batches, are one
    XLA computation on row[0]. With pipeline stages a tower spans several
    devices and XLA compiles for one, so each stage's forward on a micro-batch
    is one XLA computation on its device of the row, and so is its backward
    (the gradient of a compiled function is compiled too); the copies between
    stages stay outside.

    One tf.function(jit_compile=True) (per stage) serves every tower: the tower
    index is an argument and no device is named inside, so a call runs on the
    device it is called on. XLA compiles once per shape and may_be_empty:
    split_batch gives at most two shard (and micro-batch) sizes per global
    batch size, so uneven and last batches add a few compilations, not one
    per step. Nothing is padded, since padding rows would change BatchNorm's
    statistics.
    """
    if stages.num_stages > 1:
        forwards = [tf.function(functools.partial(forward, model, training=True),
                                jit_compile=True, autograph=False)
                    for model in stages.models]
        return functools.partial(_run_stages_compiled, stages, objective, micro_batches,
                                 schedule_name, densify, forwards)

    @tf.function(jit_compile=True, autograph=False)
    def run_compiled_tower(shard, batch_rows, weights, state, tower_index, loss_scale,
                           may_be_empty):
        # The rows from the shard's shape, which XLA knows: it needs split sizes it can
        # fold to constants. (It does not fold unless_empty's cond away: a cnn ran 20x
        # slower with it, so full batches get the variant without, as outside XLA.)
        return run_tower(stages, objective, shard, split.batch_size(shard), batch_rows, weights,
                         state, [None], tower_index, micro_batches, schedule_name, loss_scale,
                         densify, may_be_empty=may_be_empty)

    def run_on_its_device(shard, rows, batch_rows, weights, state, row, tower_index,
                          loss_scale, may_be_empty):
        del rows  # counted inside, from the shape
        with tf.device(row[0]):
            return run_compiled_tower(shard, batch_rows, weights, state, tower_index,
                                      loss_scale, may_be_empty)

    return run_on_its_device


def _run_stages_compiled(stages, objective, micro_batches, schedule_name, densify, forwards,
                         shard, rows, batch_rows, weights, state, row, tower_index, loss_scale,
                         may_be_empty):
    """compiled_tower's function for pipeline stages: run_tower with XLA forwards."""
    return run_tower(stages, objective, shard, rows, batch_rows, weights, state, row, tower_index,
                     micro_batches, schedule_name, loss_scale, densify, forwards, may_be_empty)


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
        part, terms = shard_loss(objective, shard, outputs, regularization, rows,
                                 tf.cast(rows, tf.float32))
        # Every term, counted or not: only which rows the gradients touch matters here.
        value = tf.add_n([term.sum for term in terms] + ([] if part is None else [part]))
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
    if not variable.path.endswith(aggregate.SEED_STATE_SUFFIX) or (
            isinstance(tower_index, int) and tower_index == 0):
        return value
    offset = tf.stack([tf.cast(tower_index, tf.int64), tf.constant(0, tf.int64)])
    return value + tf.cast(offset, value.dtype)
