"""The smallest complete use of towers: 4 towers train a model exactly as one device would.

Run: python examples/quickstart.py
"""

import towers

# Before anything else in TensorFlow runs: one logical device per tower.
devices = towers.configure_devices(num_towers=4)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def make_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((20,)), keras.layers.Dense(64, activation="relu"),
                             keras.layers.Dense(10)])


def main():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1000, 20)).astype("float32")
    y = np.argmax(x[:, :10], axis=1)  # a learnable rule
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(100)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    trainer = towers.TowerTrainer(make_model(), loss, keras.optimizers.Adam(1e-2),
                                  devices=devices, metrics=["accuracy"])
    history = trainer.fit(dataset, epochs=5)
    print(f"{len(devices)} towers: loss per epoch",
          [round(v, 4) for v in history.history["loss"]],
          f"accuracy {trainer.evaluate((x, y))['accuracy']:.3f}")

    # The same steps on one device, with a plain GradientTape loop.
    model, optimizer = make_model(), keras.optimizers.Adam(1e-2)
    for _ in range(5):
        for batch_x, batch_y in dataset:
            with tf.GradientTape() as tape:
                value = loss(batch_y, model(batch_x, training=True))
            grads = tape.gradient(value, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
    difference = max(float(np.max(np.abs(a - b))) for a, b in
                     zip(trainer.model.get_weights(), model.get_weights()))
    print(f"largest weight difference from one device: {difference:.2e}")


if __name__ == "__main__":
    main()
