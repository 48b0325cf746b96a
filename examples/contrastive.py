"""Contrastive learning with in-batch negatives on four towers: towers.tower_step.

Each example's two noisy views should embed close together and far from every
other example's: InfoNCE, whose negatives are the rest of the *whole* batch. A
tower sees only its shard, so the loss cannot be computed per tower; tower_step
runs each tower's forward on its shard, meets the embeddings on the main device
for the loss, and sends each tower its rows' gradient for the backward: one
forward per tower, the same update as one device on the whole batch, which
`main` checks against a plain GradientTape loop.

Run: python examples/contrastive.py
"""

import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

import towers

NUM_TOWERS = 4
GLOBAL_BATCH = 30  # shards of 8, 8, 7, 7 rows


def make_encoder(seed=0):
    """64 pixels -> Dense 32 relu -> a 16-dim embedding."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                             keras.layers.Dense(16)])


def info_nce(embeddings, temperature=0.1):
    """The InfoNCE loss of (anchors, positives), each (B, 16): row i's positive is
    positives[i], its negatives every other row of the batch. A scalar."""
    anchors, positives = (tf.math.l2_normalize(e, -1) for e in embeddings)
    logits = tf.matmul(anchors, positives, transpose_b=True) / temperature
    return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
        tf.range(tf.shape(logits)[0]), logits, from_logits=True))


def two_views(num_steps, seed=0):
    """`num_steps` batches of (view_a, view_b): digits (scaled to [0, 1]) plus noise."""
    pixels = load_digits().data.astype("float32") / 16.0
    rng = np.random.default_rng(seed)
    rows = rng.permutation(len(pixels))[:num_steps * GLOBAL_BATCH].reshape(num_steps, -1)
    return [tuple(pixels[r] + rng.normal(0, 0.1, pixels[r].shape).astype("float32")
                  for _ in range(2)) for r in rows]


def tower_train_step(encoder, optimizer, devices):
    """One compiled step on the towers: tower_step with the loss over the whole batch."""
    @tf.function
    def step(view_a, view_b):
        def fn(tower, shard):  # runs once per tower, on its device, on its rows
            return {}, (tower(encoder, shard[0]), tower(encoder, shard[1]))

        out = towers.tower_step(fn, (view_a, view_b), devices,
                                wrt={"nce": encoder.trainable_variables},
                                batch_losses={"nce": info_nce})
        optimizer.apply_gradients(zip(out.grads["nce"], encoder.trainable_variables))
        return out.losses["nce"]

    return step


def one_device_train_step(encoder, optimizer):
    """The same step on one device: a plain GradientTape over the whole batch."""
    @tf.function
    def step(view_a, view_b):
        with tf.GradientTape() as tape:
            loss = info_nce((encoder(view_a), encoder(view_b)))
        optimizer.apply_gradients(zip(tape.gradient(loss, encoder.trainable_variables),
                                      encoder.trainable_variables))
        return loss

    return step


def main(num_steps=20, devices=None):
    """Trains on the towers and on one device; prints the losses and the largest weight
    difference. Returns that difference."""
    devices = devices or towers.configure_devices(NUM_TOWERS, "cpu")
    on_towers, on_one = make_encoder(), make_encoder()
    steps = (tower_train_step(on_towers, keras.optimizers.Adam(1e-3), devices),
             one_device_train_step(on_one, keras.optimizers.Adam(1e-3)))
    for i, (view_a, view_b) in enumerate(two_views(num_steps)):
        loss_towers, loss_one = (float(step(view_a, view_b)) for step in steps)
        if i % 5 == 0 or i == num_steps - 1:
            print(f"step {i:2d}: InfoNCE on {len(devices)} towers {loss_towers:.4f}, "
                  f"on one device {loss_one:.4f}")
    difference = max(float(np.max(np.abs(a.numpy() - b.numpy())))
                     for a, b in zip(on_towers.weights, on_one.weights))
    print(f"largest weight difference after {num_steps} steps: {difference:.2e}")
    return difference


if __name__ == "__main__":
    main()
