"""Steps 3 and 4: what one tower does with its shard, on its own device(s).

`run_tower` takes the shard's micro-batches forward (forward.py) and back
(GradientTape) through the tower's pipeline stages in the schedule's order;
with one stage and one micro-batch that is one forward and one backward.
Nothing here writes a variable.
"""

import collections
import functools

import tensorflow as tf

from towers.data_parallel import aggregate, losses, split
from towers.data_parallel.forward import batch_share, concat_rows, cross_cut, forward
from towers.data_parallel.forward import shard_loss, unless_empty
from towers.model_parallel import schedule

TowerOutput = collections.namedtuple(
    "TowerOutput", ["grads", "loss", "state", "y_pred", "terms", "term_grads"])
TowerOutput.__doc__ = """What one tower computed, on that tower.

grads: per trainable variable, d(part * loss_scale)/d(weight), None where unused.
loss: float32 scalar, `part`: the shard's part of the batch's loss, its mean loss
    plus regularisation times rows / the batch's rows (unscaled); the terms whose
    denominator is counted are not in it (see term_grads).
state: per non-trainable variable, its new value, None where unchanged.
y_pred: (outputs, masks) for the shard's rows, as forward.forward returns them.
terms: per loss term of the objective, its losses.Term over the shard's rows.
term_grads: per term whose denominator is counted (a Keras mask), in term order,
    the gradients of weight * its sum * loss_scale; denominators.fold_counted
    scales them by the batch's count and adds them to grads. Then, summed over
    the towers, the grads are the batch's mean gradient and the losses its loss.
"""

# Keras names the state variable of every keras.random.SeedGenerator this way.
_SEED_STATE_SUFFIX = "seed_generator_state"


def run_tower(stages, objective, shard, rows, batch_rows, weights, state, row, tower_index,
              micro_batches=1, schedule_name="1f1b", loss_scale=None, densify=None,
              forwards=None, may_be_empty=True):
    """Steps 3-4 on one tower: its shard's micro-batches forward and back through the stages.

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
    Keras mask) gets a backward of its own from the last stage back, its
    gradients scaled once every tower is counted (TowerOutput.term_grads).

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
      densify: None or one bool per trainable variable: turn that variable's
        tf.IndexedSlices gradient into a dense Tensor here, before the gather.
      forwards: None, or per stage fn(weights, state, x) -> forward's result in
        training mode (compiled_tower's XLA functions); None = forward itself.
      may_be_empty: whether a micro-batch may have no rows; then each one runs
        the model only where it has some (unless_empty). False where the batch
        is known to give every micro-batch a row: no tf.cond is built.

    Returns:
      a TowerOutput; each gradient and state value on its stage's device, the
      loss and y_pred on the last stage's.
    """
    forwards = forwards or [functools.partial(forward, model, training=True)
                            for model in stages.models]
    flight = _Flight(stages, shard, rows, batch_rows, weights,
                     _offset_seeds(stages.model, state, tower_index), micro_batches, objective,
                     loss_scale, forwards, may_be_empty)
    previous = [[] for _ in row]  # per stage: what its last action produced
    for action in schedule.build_order(
            schedule.make(schedule_name, stages.num_stages, micro_batches)):
        kind, k, m = action
        name = "forward" if kind == schedule.FORWARD else "backward"
        with tf.device(row[k]), tf.name_scope(f"stage_{k}_{name}_{m}"), \
                tf.control_dependencies(previous[k]):
            previous[k] = (flight.forward(k, m) if kind == schedule.FORWARD
                           else flight.backward(k, m))
    per_stage = []
    for k, device in enumerate(row):
        with tf.device(device):
            per_stage.append(flight.stage_gradients(k))
    grads = [stages.merge(group) for group in zip(*per_stage)]  # per group: model order
    if densify is not None:
        grads = [[aggregate.to_dense(g) if dense else g for g, dense in zip(group, densify)]
                 for group in grads]
    with tf.device(row[-1]):
        tower_loss, y_pred, terms = flight.loss_and_outputs()
    return TowerOutput(grads[0], tower_loss, stages.merge(flight.changed, trainable=False),
                       y_pred, terms, grads[1:])


class _Flight:
    """What is in flight on one tower during a step: every micro-batch's tensors per stage.

    Its backwards come in groups: group 0 starts from the parts of the loss whose
    denominator is known (and the regularisation), group 1 + c from the c-th
    counted term; each has its own gradients, and its own gradients of a stage's
    outputs sent back to the stage before. Without counted terms there is one.
    """

    def __init__(self, stages, shard, rows, batch_rows, weights, state, micro_batches,
                 objective, loss_scale, forwards, may_be_empty):
        self.stages, self.objective = stages, objective
        self.loss_scale, self.forwards, self.may_be_empty = loss_scale, forwards, may_be_empty
        self.micro, self.sizes = [shard], [rows]
        if micro_batches > 1:
            sizes = split.shard_sizes(rows, micro_batches)
            self.micro, self.sizes = split.split_rows(shard, sizes), split.row_counts(sizes)
        self.batch_rows = batch_rows
        self.weights = [stages.select(weights, k) for k in range(stages.num_stages)]
        self.state = [stages.select(state, k, trainable=False) for k in range(stages.num_stages)]
        self.changed = [[None] * len(s) for s in self.state]
        self.num_groups = 1  # 1 + the counted terms, known at the last stage's forward
        shape = (stages.num_stages, len(self.micro))
        # Per (stage, micro-batch): the tape, the stage's inputs it watched (None
        # where not differentiable), what it returned and their Keras masks, per
        # group what its backward starts from (None: nothing here), its part of the
        # batch's loss (unscaled), per group its weight gradients and the gradients
        # of what it returned (sent back by the next stage).
        self.tapes, self.inputs, self.outputs, self.masks = (_table(shape) for _ in range(4))
        self.targets, self.parts, self.grads, self.cotangents = (_table(shape) for _ in range(4))
        self.y_pred, self.terms = [None] * len(self.micro), [None] * len(self.micro)

    def forward(self, k, m):
        """Stage k's forward on micro-batch m (step 3), recorded for its backward."""
        last = k == self.stages.num_stages - 1
        if k == 0:
            inputs, watched = self.micro[m][0], []
        else:  # the copy to this stage's device: what crosses the cut
            inputs = cross_cut((self.outputs[k - 1][m], self.masks[k - 1][m]))
            watched = [t if t.dtype.is_floating else None for t in inputs]
        # Persistent: each group's backward reads the tape (in a traced step that
        # costs nothing at run time; the tape is dropped after the backwards).
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(self.weights[k] + [t for t in watched if t is not None])
            outputs, new_state, regularization = unless_empty(
                self.sizes[m], self.forwards[k], self.weights[k], self.state[k], inputs,
                self.may_be_empty)
            counted = []
            if last:
                self.y_pred[m] = outputs
                part, self.terms[m] = shard_loss(self.objective, self.micro[m], outputs,
                                                 regularization, self.sizes[m], self.batch_rows)
                counted = [weight * term.sum for term, weight
                           in zip(self.terms[m], self.objective.weights) if term.per_row is None]
                self.num_groups = 1 + len(counted)
            else:
                outputs, self.masks[k][m] = tf.nest.flatten(outputs[0]), outputs[1]
                part = (None if regularization is None
                        else regularization * batch_share(self.sizes[m], self.batch_rows))
            targets = [t if t is None or self.loss_scale is None else t * self.loss_scale
                       for t in [part] + counted]
        self.tapes[k][m], self.inputs[k][m], self.targets[k][m] = tape, watched, targets
        self.outputs[k][m], self.parts[k][m] = outputs, part
        for i, new in enumerate(new_state):
            if new is not None:
                self.state[k][i] = self.changed[k][i] = new
        return tf.nest.flatten(outputs) + [t for t in targets if t is not None]

    def backward(self, k, m):
        """Stage k's backward on micro-batch m (step 4), group by group: weight and input
        gradients."""
        watched = self.inputs[k][m]
        sources = self.weights[k] + [t for t in watched if t is not None]
        sent, self.grads[k][m] = [], []  # sent: input gradients, for the stage before
        if k > 0:
            self.cotangents[k - 1][m] = []
        for g in range(self.num_groups):
            targets, output_gradients = [], []
            local = self.targets[k][m][g] if g < len(self.targets[k][m]) else None
            if local is not None:
                targets, output_gradients = [local], [tf.ones_like(local)]
            if k < self.stages.num_stages - 1:
                for output, cotangent in zip(self.outputs[k][m], self.cotangents[k][m][g]):
                    if cotangent is not None:
                        targets.append(output)
                        output_gradients.append(tf.identity(cotangent))  # to this device
            gradients = (self.tapes[k][m].gradient(targets, sources,
                                                   output_gradients=output_gradients)
                         if targets else [None] * len(sources))
            self.grads[k][m].append(gradients[:len(self.weights[k])])
            if k > 0:
                input_grads = iter(gradients[len(self.weights[k]):])
                cotangents = [None if t is None else _dense_or_none(next(input_grads))
                              for t in watched]
                self.cotangents[k - 1][m].append(cotangents)
                sent += [c for c in cotangents if c is not None]
        self.tapes[k][m] = None  # the activations of (k, m) may now be freed
        return [aggregate.dense_part(g) for group in self.grads[k][m] for g in group
                if g is not None] + sent

    def stage_gradients(self, k):
        """Stage k's gradients per group: its micro-batches' sums."""
        per_micro_batch = self.grads[k]
        if len(self.micro) == 1:
            return per_micro_batch[0]
        return [aggregate.sum_gradients(list(group)) for group in zip(*per_micro_batch)]

    def loss_and_outputs(self):
        """The shard's part of the batch's loss (every stage's, every micro-batch's), its
        outputs, and its loss terms (each the micro-batches' sum)."""
        parts = [part for stage_parts in self.parts for part in stage_parts if part is not None]
        loss = (tf.constant(0.0) if not parts else parts[0] if len(parts) == 1
                else tf.add_n([tf.identity(part) for part in parts]))  # here, on the last stage
        if len(self.micro) == 1:
            return loss, self.y_pred[0], self.terms[0]
        terms = [losses.Term(tf.add_n([t.sum for t in per_micro]),
                             tf.add_n([t.units for t in per_micro]), per_micro[0].per_row)
                 for per_micro in zip(*self.terms)]
        return loss, concat_rows(self.y_pred), terms


def _dense_or_none(grad):
    return None if grad is None else tf.convert_to_tensor(grad)


def _table(shape):
    rows, columns = shape
    return [[None] * columns for _ in range(rows)]


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
                                jit_compile=True) for model in stages.models]
        return functools.partial(_run_stages_compiled, stages, objective, micro_batches,
                                 schedule_name, densify, forwards)

    @tf.function(jit_compile=True)
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
    """Tower i's RNG seed states: seed + i, so dropout masks differ between towers.

    Tower 0 keeps the model's own seeds, and its advanced state is the one
    written back, so the model's random stream moves on as on one device.
    `tower_index` is an int, or an int scalar Tensor (one XLA computation for
    every tower).
    """
    if isinstance(tower_index, int) and tower_index == 0:
        return state
    offset = tf.stack([tf.cast(tower_index, tf.int64), tf.constant(0, tf.int64)])
    return [value + tf.cast(offset, value.dtype) if variable.path.endswith(_SEED_STATE_SUFFIX)
            else value for variable, value in zip(model.non_trainable_variables, state)]
