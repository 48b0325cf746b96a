"""The floor: the seven steps of the tower algorithm and nothing else.

Written from the algorithm, not from towers' step code, so that the `bare...`
rows of the benchmark show what the steps cost without the library's options,
checks and logs:

    1     tf.split of the global batch on the main device, larger shards first
    2     per tower, a copy of the weights and state (tf.identity under tf.device)
    3, 4  per tower, model.stateless_call and a GradientTape for the shard's mean loss
    5, 6  on the main device, the towers' gradients averaged, weighted by shard size
    7     a finite check choosing, in a tf.cond, whether the optimizer applies them

Sparse gradients (an Embedding's) are made dense on their tower. The new
non-trainable state (only resnet's BatchNorm statistics among the built-in
models) is tower 0's, as in the classic tutorials: averaging would need a
weighted mean per variable and could not take integer state (a dropout
layer's seed).
"""

import tensorflow as tf

from towers.data_parallel import split


def train_step_fn(model, loss_fn, optimizer, devices, global_batch_size, jit_compile=False):
    """fn(x, y) -> the global batch's mean loss (float32 scalar on devices[0]); call it in a
    tf.function. One call is one step on every tower.

    Args:
      model: a built keras.Model whose variables live on devices[0], the main device.
      loss_fn: a Keras loss with the mean reduction, (y, logits) -> scalar.
      optimizer: a Keras optimizer built on model.trainable_variables.
      devices: the tower devices, in order.
      global_batch_size: B, the rows of every x and y, so the shard sizes are Python ints.
      jit_compile: each tower's forward and backward as one XLA computation on its device.
    """
    sizes = split.shard_sizes(global_batch_size, len(devices))  # only the sizes: larger first
    fractions = [size / global_batch_size for size in sizes]

    def weighted_mean(per_tower):
        return tf.add_n([fraction * value for fraction, value in zip(fractions, per_tower)])

    def forward_backward(weights, state, x, y):
        with tf.GradientTape() as tape:
            tape.watch(weights)  # plain tensors, not variables: the tape must be told
            y_pred, new_state, losses = model.stateless_call(
                weights, state, x, training=True, return_losses=True)
            loss = loss_fn(y, y_pred) + sum(losses, 0.0)  # shard mean + regularisation
        return [tf.convert_to_tensor(g) for g in tape.gradient(loss, weights)], loss, new_state

    if jit_compile:
        forward_backward = tf.function(forward_backward, jit_compile=True)

    def step(x, y):
        with tf.device(devices[0]):
            x_shards, y_shards = tf.split(x, sizes), tf.split(y, sizes)              # 1
        tower_grads, tower_losses, tower_states = [], [], []
        for i, device in enumerate(devices):
            with tf.device(device), tf.name_scope(f"tower_{i}"):
                weights = [tf.identity(v.value) for v in model.trainable_variables]  # 2
                state = [tf.identity(v.value) for v in model.non_trainable_variables]
                grads, loss, new_state = forward_backward(                           # 3, 4
                    weights, state, x_shards[i], y_shards[i])
            tower_grads.append(grads)
            tower_losses.append(loss)
            tower_states.append(new_state)
        with tf.device(devices[0]):
            # 5, 6: every tower's gradients copied here and averaged: the towers meet here.
            grads = [weighted_mean(per_tower) for per_tower in zip(*tower_grads)]
            loss = weighted_mean(tower_losses)
            finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(t)) for t in [loss, *grads]])

            def apply():                                                             # 7
                optimizer.apply_gradients(zip(grads, model.trainable_variables))
                for variable, value in zip(model.non_trainable_variables, tower_states[0]):
                    variable.assign(value)

            tf.cond(finite, apply, lambda: None)
            return loss

    return step
