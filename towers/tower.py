"""Steps 3 and 4: what one tower does with its shard, on its own device.

Every function here runs under `tf.device(tower)` and writes no variable: the
model runs through Keras 3 `stateless_call` on the tower's copies of the
weights, so towers never race to update BatchNorm statistics or RNG state.
"""

import collections
import inspect

import tensorflow as tf

from towers import aggregate, losses, schedule, split

TowerOutput = collections.namedtuple("TowerOutput", ["grads", "loss", "state", "y_pred"])
TowerOutput.__doc__ = """What one tower computed, on that tower.

grads: per trainable variable, d(loss * loss_scale)/d(weight), None where unused.
loss: float32 scalar, the shard's mean loss plus regularisation (unscaled).
state: per non-trainable variable, its new value, None where unchanged.
y_pred: model outputs for the shard's rows.
"""

# Keras names the state variable of every keras.random.SeedGenerator this way.
_SEED_STATE_SUFFIX = "seed_generator_state"


def run_tower(stages, loss, shard, weights, state, row, tower_index, micro_batches=1,
              schedule_name="1f1b", loss_scale=None, densify=None):
    """Steps 3-4 on one tower: its shard's micro-batches forward and back through the stages.

    The shard is split into `micro_batches` micro-batches. Each stage runs on
    its own device of `row`, in the order the schedule gives it (a control
    dependency orders each stage's actions); activations flow forward from
    stage to stage, and their gradients flow back. Gradients of the
    micro-batches are averaged weighted by micro-batch size, which equals the
    gradient of the whole shard. Non-trainable state flows from one
    micro-batch to the next (an empty micro-batch leaves it as it was). With
    one stage this is gradient accumulation (accum_steps).

    Args:
      stages: a stages.Stages; one stage = the whole model.
      shard: this tower's (x, y[, sample_weight]), n rows (may be 0).
      weights, state: model.trainable_variables / non_trainable_variables
        values in model order, each already on its stage's device of `row`.
      row: one device per stage.
      tower_index: int; offsets the RNG seeds so towers draw different dropout masks.
      micro_batches: micro-batches per shard (int >= 1).
      schedule_name: one of schedule.SCHEDULES.
      loss_scale: None or float32 scalar; gradients are of loss * loss_scale.
      densify: None or one bool per trainable variable: turn that variable's
        tf.IndexedSlices gradient into a dense Tensor here, before the gather.

    Returns:
      a TowerOutput; each gradient and state value on its stage's device, the
      loss and y_pred on the last stage's.
    """
    flight = _Flight(stages, shard, weights, _offset_seeds(stages.model, state, tower_index),
                     micro_batches, loss, loss_scale)
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
    grads = stages.merge(per_stage)
    if densify is not None:
        grads = [aggregate.to_dense(g) if dense else g for g, dense in zip(grads, densify)]
    with tf.device(row[-1]):
        tower_loss, y_pred = flight.loss_and_outputs()
    return TowerOutput(grads, tower_loss, stages.merge(flight.changed, trainable=False), y_pred)


class _Flight:
    """What is in flight on one tower during a step: every micro-batch's tensors per stage."""

    def __init__(self, stages, shard, weights, state, micro_batches, loss, loss_scale):
        self.stages, self.loss, self.loss_scale = stages, loss, loss_scale
        self.micro = split.split_batch(shard, micro_batches) if micro_batches > 1 else [shard]
        self.sizes = [split.batch_size(micro) for micro in self.micro]
        self.weights = [stages.select(weights, k) for k in range(stages.num_stages)]
        self.state = [stages.select(state, k, trainable=False) for k in range(stages.num_stages)]
        self.changed = [[None] * len(s) for s in self.state]
        num = (stages.num_stages, len(self.micro))
        self.tapes, self.inputs, self.targets = _table(num), _table(num), _table(num)
        self.grads, self.regularization = _table(num), _table(num)
        self.values = [{} for _ in self.micro]  # per micro-batch: tensor key -> Tensor
        self.cotangents = [collections.defaultdict(list) for _ in self.micro]
        self.losses, self.outputs = [None] * len(self.micro), [None] * len(self.micro)

    def forward(self, k, m):
        """Stage k's forward on micro-batch m (step 3), recorded for its backward."""
        stages, last = self.stages, k == self.stages.num_stages - 1
        x = self.micro[m][0]
        inputs = stages.stage_inputs(k, x, self.values[m])
        watched = ([] if stages.num_stages == 1 else
                   [t if k > 0 and t.dtype.is_floating else None for t in inputs])
        with tf.GradientTape() as tape:
            tape.watch(self.weights[k] + [t for t in watched if t is not None])
            outputs, new_state, regularization = forward(
                stages.models[k], self.weights[k], self.state[k], inputs, training=True)
            scale = (lambda value: value) if self.loss_scale is None else (
                lambda value: value * self.loss_scale)
            outputs = stages.stage_outputs(k, outputs, self.values[m])
            if last:
                self.outputs[m] = outputs
                self.losses[m] = shard_loss(self.loss, self.micro[m], outputs, regularization)
                targets = [scale(self.losses[m])]
            else:
                targets = [scale(regularization)]
        self.regularization[k][m] = regularization
        self.tapes[k][m], self.inputs[k][m], self.targets[k][m] = tape, watched, targets
        kept = self.sizes[m] > 0  # an empty micro-batch's statistics are NaN: keep the old
        for i, new in enumerate(new_state):
            if new is not None:
                self.state[k][i] = tf.where(kept, new, self.state[k][i])
                self.changed[k][i] = self.state[k][i]
        return tf.nest.flatten(outputs) + targets

    def backward(self, k, m):
        """Stage k's backward on micro-batch m (step 4): weight and input gradients."""
        stages, last = self.stages, k == self.stages.num_stages - 1
        targets, output_gradients = list(self.targets[k][m]), None
        if not last:
            output_gradients = [tf.ones_like(targets[0])]
            for key in stages.output_keys[k]:
                contributions = self.cotangents[m].pop(key, [])
                if contributions:
                    targets.append(self.values[m][key])
                    output_gradients.append(
                        tf.add_n([tf.identity(c) for c in contributions]))
        watched = self.inputs[k][m]
        sources = self.weights[k] + [t for t in watched if t is not None]
        gradients = self.tapes[k][m].gradient(targets, sources, output_gradients=output_gradients)
        self.tapes[k][m] = None  # the activations of (k, m) may now be freed
        weight_grads = gradients[:len(self.weights[k])]
        input_grads = iter(gradients[len(self.weights[k]):])
        sent = []  # gradients of this stage's inputs, for the stages that computed them
        for key, tensor in zip(stages.input_keys[k] or [], watched):
            grad = None if tensor is None else next(input_grads)
            if grad is not None:
                sent.append(tf.convert_to_tensor(grad))
                self.cotangents[m][key].append(sent[-1])
        self.grads[k][m] = weight_grads
        return [aggregate.dense_part(g) for g in weight_grads if g is not None] + sent

    def stage_gradients(self, k):
        """Stage k's gradients of the whole shard: the micro-batches' mean by size."""
        if len(self.micro) == 1:
            return self.grads[k][0]
        return aggregate.average_gradients(self.grads[k], self.sizes)

    def loss_and_outputs(self):
        """The shard's mean loss plus every stage's regularisation, and its outputs."""
        totals = [loss + tf.add_n([tf.identity(r[m]) for r in self.regularization[:-1]])
                  if self.stages.num_stages > 1 else loss
                  for m, loss in enumerate(self.losses)]
        if len(self.micro) == 1:
            return totals[0], self.outputs[0]
        return (aggregate.average_gradients([[t] for t in totals], self.sizes)[0],
                concat_rows(self.outputs))


def _table(shape):
    rows, columns = shape
    return [[None] * columns for _ in range(rows)]


def predict(stages, weights, state, x, row):
    """Step 3 without gradients, stage by stage along `row`: (y_pred, regularization).

    weights, state: in model order, each on its stage's device. y_pred and the
    regularisation (the sum over stages, a float32 scalar) are on row[-1].
    """
    values, regularization = {}, []
    for k, device in enumerate(row):
        with tf.device(device):
            outputs, _, stage_regularization = forward(
                stages.models[k], stages.select(weights, k),
                stages.select(state, k, trainable=False),
                stages.stage_inputs(k, x, values), training=False)
            regularization.append(tf.identity(stage_regularization))
            outputs = stages.stage_outputs(k, outputs, values)
    with tf.device(row[-1]):
        return outputs, tf.add_n([tf.identity(r) for r in regularization])


def forward(model, weights, state, x, training):
    """Step 3: the model's forward pass on the current device, writing no variable.

    Returns:
      (y_pred, new_state, regularization): outputs; the new non-trainable
      values (None where the layer did not change them); the sum of the model's
      regularisation losses, a float32 scalar (0 when it has none).
    """
    kwargs = {"training": training} if _accepts_training(model) else {}
    y_pred, new_state, extra_losses = model.stateless_call(
        weights, state, x, return_losses=True, **kwargs)
    new_state = [new if new is not old else None for new, old in zip(new_state, state)]
    regularization = tf.add_n([tf.cast(l, tf.float32) for l in extra_losses]
                              ) if extra_losses else tf.constant(0.0)
    return y_pred, new_state, regularization


def shard_loss(loss, shard, y_pred, regularization):
    """Mean per-example loss of one shard plus the regularisation, a float32 scalar.

    An empty shard gives just the regularisation; its weight in the average is 0.
    Averaging these over towers by shard size gives the global-batch mean plus
    the regularisation counted once.
    """
    _, y, sample_weight = split.unpack_batch(shard)
    per_example = losses.per_example_loss(loss, y, y_pred, sample_weight)
    count = tf.maximum(tf.cast(tf.shape(per_example)[0], tf.float32), 1.0)
    return tf.reduce_sum(per_example) / count + regularization


def choose_dense_gradients(model, loss, shard, sparse_policy):
    """One bool per trainable variable: densify its sparse gradient on the tower?

    "keep": never; "dense": always; a float threshold: where the gradient of
    `shard` (one tower's first shard, run eagerly once) looks up more than
    that fraction of the variable's rows.
    """
    variables = model.trainable_variables
    if sparse_policy in ("keep", "dense"):
        return [sparse_policy == "dense"] * len(variables)
    weights = [v.value for v in variables]
    with tf.GradientTape() as tape:
        tape.watch(weights)
        y_pred, _, regularization = forward(
            model, weights, [v.value for v in model.non_trainable_variables], shard[0], True)
        value = shard_loss(loss, shard, y_pred, regularization)
    return [isinstance(g, tf.IndexedSlices)
            and int(tf.shape(g.values)[0]) > sparse_policy * int(g.dense_shape[0])
            for g in tape.gradient(value, weights)]


def concat_rows(parts):
    """Concatenates a list of (nested) outputs along dim 0."""
    return tf.nest.map_structure(lambda *pieces: tf.concat(pieces, 0), *parts)


def _offset_seeds(model, state, tower_index):
    """Tower i's RNG seed states: seed + i, so dropout masks differ between towers.

    Tower 0 keeps the model's own seeds, and its advanced state is the one
    written back, so the model's random stream moves on as on one device.
    """
    if tower_index == 0:
        return state
    offset = tf.constant([tower_index, 0], tf.int64)
    return [value + tf.cast(offset, value.dtype) if variable.path.endswith(_SEED_STATE_SUFFIX)
            else value for variable, value in zip(model.non_trainable_variables, state)]


def _accepts_training(model):
    parameters = inspect.signature(model.call).parameters
    return "training" in parameters or any(
        p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters.values())
