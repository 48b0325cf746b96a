"""Steps 3 and 4: what one tower does with its shard, on its own device.

Every function here runs under `tf.device(tower)` and writes no variable: the
model runs through Keras 3 `stateless_call` on the tower's copies of the
weights, so towers never race to update BatchNorm statistics or RNG state.
"""

import collections
import inspect

import tensorflow as tf

from towers import aggregate, losses, split

TowerOutput = collections.namedtuple("TowerOutput", ["grads", "loss", "state", "y_pred"])
TowerOutput.__doc__ = """What one tower computed, on that tower.

grads: per trainable variable, d(loss * loss_scale)/d(weight), None where unused.
loss: float32 scalar, the shard's mean loss plus regularisation (unscaled).
state: per non-trainable variable, its new value, None where unchanged.
y_pred: model outputs for the shard's rows.
"""

# Keras names the state variable of every keras.random.SeedGenerator this way.
_SEED_STATE_SUFFIX = "seed_generator_state"


def run_tower(model, loss, shard, weights, state, tower_index, accum_steps=1,
              loss_scale=None, densify=None):
    """Steps 3-4 on one tower: forward and backward over `accum_steps` micro-batches.

    Micro-batches run one after another (a control dependency orders them) so
    only one micro-batch's activations are alive at a time; their gradients are
    averaged weighted by micro-batch size, which equals the gradient of the
    whole shard. Non-trainable state flows from one micro-batch to the next.

    Args:
      shard: this tower's (x, y[, sample_weight]), n rows (may be 0).
      weights, state: model.trainable_variables / non_trainable_variables
        values, already on this tower.
      tower_index: int; offsets the RNG seeds so towers draw different dropout masks.
      accum_steps: micro-batches per shard (int >= 1).
      loss_scale: None or float32 scalar; gradients are of loss * loss_scale.
      densify: None or one bool per trainable variable: turn that variable's
        tf.IndexedSlices gradient into a dense Tensor here, before the gather.

    Returns:
      a TowerOutput.
    """
    state = _offset_seeds(model, state, tower_index)
    micro_batches = split.split_batch(shard, accum_steps) if accum_steps > 1 else [shard]
    changed = [None] * len(state)
    micro_grads, micro_losses, outputs, previous = [], [], [], []
    for micro_batch in micro_batches:
        with tf.control_dependencies(previous):
            with tf.GradientTape() as tape:
                tape.watch(weights)
                y_pred, new_state, regularization = forward(
                    model, weights, state, micro_batch[0], training=True)
                micro_loss = shard_loss(loss, micro_batch, y_pred, regularization)
                scaled = micro_loss if loss_scale is None else micro_loss * loss_scale
            grads = tape.gradient(scaled, weights)
        previous = [aggregate.dense_part(g) for g in grads if g is not None]
        changed = [new if new is not None else old for new, old in zip(new_state, changed)]
        state = [new if new is not None else old for new, old in zip(new_state, state)]
        micro_grads.append(grads)
        micro_losses.append([micro_loss])
        outputs.append(y_pred)
    if accum_steps > 1:
        sizes = [split.batch_size(micro_batch) for micro_batch in micro_batches]
        grads = aggregate.average_gradients(micro_grads, sizes)
        tower_loss = aggregate.average_gradients(micro_losses, sizes)[0]
    else:
        tower_loss = micro_loss
    if densify is not None:
        grads = [aggregate.to_dense(g) if dense else g for g, dense in zip(grads, densify)]
    return TowerOutput(grads, tower_loss, changed, concat_rows(outputs))


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
