"""The towers algorithm in seven steps, in plain TensorFlow and Keras (no towers import).

Split the global batch into one shard per tower, give every tower the same
weights, run forward and backward on each, gather and sum the gradients on a
main device, apply them once, repeat: exactly one device's update on the whole
batch, which `main` checks.

Run: python examples/seven_steps.py
"""

import keras
import numpy as np
import tensorflow as tf

NUM_TOWERS = 4
NUM_FEATURES = 4
NUM_CLASSES = 3


def split_cpu(num_towers):
    """One logical CPU device per tower; returns their names, e.g. "/device:CPU:0".

    Call it before TensorFlow creates any tensor: the runtime fixes the layout.
    """
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0],
        [tf.config.LogicalDeviceConfiguration()] * num_towers)
    return [d.name for d in tf.config.list_logical_devices("CPU")]


def make_model(seed=0):
    """Dense 8 -> relu -> Dense NUM_CLASSES logits; the same weights for the same seed."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((NUM_FEATURES,)),
                             keras.layers.Dense(8, activation="relu"),
                             keras.layers.Dense(NUM_CLASSES)])


def make_batches(global_batch_size, num_steps=5, seed=1):
    """`num_steps` batches (x (B, NUM_FEATURES) float32, y (B,) int64 class ids)."""
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(global_batch_size, NUM_FEATURES)).astype("float32"),
             rng.integers(0, NUM_CLASSES, size=(global_batch_size,)))
            for _ in range(num_steps)]


def shard_sizes(global_batch_size, num_towers):
    """Rows per tower, larger first, differing by at most one, as numpy.array_split."""
    base, extra = divmod(global_batch_size, num_towers)
    return [base + (1 if i < extra else 0) for i in range(num_towers)]


def per_example_loss(y, logits):
    """(B,) int and (B, NUM_CLASSES) logits -> (B,) cross-entropy losses."""
    return keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)


def train(model, optimizer, batches, devices, main_device=None):
    """Trains `model` on `batches`, one step per batch, with one tower per device.

    model: a built keras.Model; its non-trainable state (BatchNorm
      statistics) is read but not updated, to keep the steps plain.
    batches: (x (B, F), y (B,)) pairs; each batch size B >= 1 traces once.
    devices: tower device names; main_device: where gradients meet
      (None: devices[0]). Returns `model`, trained.
    """
    main_device = main_device or devices[0]
    # Its variables made now: a tf.function may create some on its first trace only.
    optimizer.build(model.trainable_variables)

    @tf.function
    def step(x, y):
        global_batch_size = x.shape[0]
        if not global_batch_size:
            raise ValueError(f"a batch needs at least one row, got x of shape {x.shape}.")

        # 1. 数据划分 split the data: tower i gets the next sizes[i] rows.
        sizes = shard_sizes(global_batch_size, len(devices))
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        weights = [v.value for v in model.trainable_variables]
        state = [v.value for v in model.non_trainable_variables]

        tower_grads = []
        for i, (device, start, size) in enumerate(zip(devices, starts, sizes)):
            if size == 0:
                # A batch smaller than the tower count: nothing to run, and a
                # gradient of zero weighs nothing in the sum. Skipping is exact.
                continue
            with tf.device(device), tf.name_scope(f"tower_{i}"):
                # 2. 模型复制 copy the model: every tower reads the same weights; one
                # copy per step moves them, then forward and backward read local memory.
                tower_weights = [tf.identity(w) for w in weights]
                tower_state = [tf.identity(s) for s in state]

                # 3. 前向传播 forward, on this tower's shard only.
                x_shard, y_shard = x[start:start + size], y[start:start + size]
                with tf.GradientTape() as tape:
                    tape.watch(tower_weights)
                    # stateless_call: the copies, not the variables, are the weights used.
                    logits, _ = model.stateless_call(
                        tower_weights, tower_state, x_shard, training=True)  # (size, C)
                    # Summed and divided by the *global* batch size, not the shard's
                    # mean: the towers' losses then add up to the whole batch's mean,
                    # and so do their gradients, whatever the shard sizes.
                    tower_loss = tf.reduce_sum(
                        per_example_loss(y_shard, logits)) / global_batch_size

                # 4. 梯度计算 gradients, computed on the tower, then to the main device.
                grads = tape.gradient(tower_loss, tower_weights)
            with tf.device(main_device):
                tower_grads.append([tf.identity(g) for g in grads])

        with tf.device(main_device):
            # 5. 梯度累加 accumulate: a sum, already weighted by shard size in
            # step 3. The sync point: it waits for every tower's gradients.
            grads = [tf.add_n(g) for g in zip(*tower_grads)]

            # 6. 参数更新 update, once per global batch, on the main device.
            optimizer.apply_gradients(zip(grads, model.trainable_variables))

    # 7. 重复 repeat: the next batch starts from the updated weights.
    for x, y in batches:
        step(tf.convert_to_tensor(x), tf.convert_to_tensor(y))
    return model


def train_one_device(model, optimizer, batches):
    """The reference: a plain GradientTape step on each whole batch, on one device."""
    for x, y in batches:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(per_example_loss(y, model(x, training=True)))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return model


def main():
    devices = split_cpu(NUM_TOWERS)  # first, before TensorFlow starts
    global_batch_size = 30  # not a multiple of 4: uneven shards
    batches = make_batches(global_batch_size)
    on_towers = train(make_model(), keras.optimizers.SGD(0.1), batches, devices)
    on_one = train_one_device(make_model(), keras.optimizers.SGD(0.1), batches)
    difference = max(float(np.max(np.abs(a - b)))
                     for a, b in zip(on_towers.get_weights(), on_one.get_weights()))
    print(f"{len(devices)} towers, shards of {shard_sizes(global_batch_size, len(devices))} rows")
    print(f"largest weight difference from one device: {difference:.1e}")


if __name__ == "__main__":
    main()
