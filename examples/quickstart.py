"""The smallest complete use of towers: 4 towers train a model exactly as one device would.

Run: python examples/quickstart.py
"""

import towers

# Before anything else in TensorFlow runs: one logical device per tower.
devices = towers.configure_devices(num_towers=4)

import keras  # noqa: E402
import numpy as np  # noqa: E402


def make_model():
    """The same compiled model each call: what a Keras user already has."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def main():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1000, 20)).astype("float32")
    y = np.argmax(x[:, :10], axis=1)  # a learnable rule
    # shuffle=False only so that one device sees the same batches below.
    arguments = dict(batch_size=100, epochs=5, validation_split=0.1, shuffle=False, verbose=0)

    trainer = towers.TowerTrainer(make_model(), devices=devices)  # what compile was given
    history = trainer.fit(x, y, **arguments)
    print(f"{len(devices)} towers: loss per epoch",
          [round(v, 4) for v in history.history["loss"]],
          f"val_accuracy {history.history['val_accuracy'][-1]:.3f}")
    predicted = trainer.predict(x[:300], batch_size=64, verbose=0)  # each tower its shard

    # The same model trained by Keras itself, on one device.
    model = make_model()
    model.fit(x, y, **arguments)
    difference = max(float(np.max(np.abs(a - b))) for a, b in
                     zip(trainer.model.get_weights(), model.get_weights()))
    print(f"largest weight difference from Keras on one device: {difference:.2e}")
    print("largest prediction difference: "
          f"{np.max(np.abs(predicted - model.predict(x[:300], verbose=0))):.2e}")


if __name__ == "__main__":
    main()
