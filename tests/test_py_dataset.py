"""A keras.utils.PyDataset in fit against Keras's own fit on one device: its epoch hooks
called as Keras calls them (a dataset that reshuffles in on_epoch_end trains on the same
orders), and parallel loading refused in one line."""

import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import towers

DEVICES = [f"/device:CPU:{i}" for i in range(4)]
CLASSES = 3


class Reshuffled(keras.utils.PyDataset):
    """Batches of 10 rows (the last of 8) of fixed examples, in an order drawn anew in
    on_epoch_end from the dataset's own generator; `calls` records the hooks."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        data = np.random.default_rng(0)
        self.x = data.normal(size=(38, 4)).astype("float32")
        self.y = np.arange(38) % CLASSES
        self.order, self.rng, self.calls = np.arange(38), np.random.default_rng(1), []

    def __len__(self):
        return 4

    def __getitem__(self, index):
        rows = self.order[index * 10:(index + 1) * 10]
        return self.x[rows], self.y[rows]

    def on_epoch_begin(self):
        self.calls.append("begin")

    def on_epoch_end(self):
        self.calls.append("end")
        self.order = self.rng.permutation(38)


def _model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(CLASSES)])


def _loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


class PyDatasetTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.parameters(1, 3)
    def test_epoch_hooks_and_weights_equal_keras_fit(self, num_towers):
        keras_data, towers_data = Reshuffled(), Reshuffled()
        keras_model = _model()
        keras_model.compile(optimizer=keras.optimizers.SGD(0.5), loss=_loss())
        expected = keras_model.fit(keras_data, epochs=3, shuffle=False, verbose=0)
        trainer = towers.TowerTrainer(_model(), _loss(), keras.optimizers.SGD(0.5),
                                      devices=DEVICES[:num_towers])
        history = trainer.fit(towers_data, epochs=3, verbose=0)
        self.assertEqual(towers_data.calls, keras_data.calls)
        self.assertEqual(towers_data.calls[:3], ["end", "begin", "end"])
        self.assertAllClose(history.history["loss"], expected.history["loss"], atol=1e-5)
        for want, got in zip(keras_model.get_weights(), trainer.model.get_weights()):
            self.assertAllClose(want, got, atol=1e-5)

    def test_as_validation_data_and_in_evaluate_as_keras(self):
        # Keras's evaluate (fit's validation too) resets its iterator (on_epoch_end), then
        # runs one epoch of at most `steps` batches between on_epoch_begin and on_epoch_end.
        keras_train, keras_val, towers_train, towers_val = (Reshuffled() for _ in range(4))
        keras_model = _model()
        keras_model.compile(optimizer=keras.optimizers.SGD(0.5), loss=_loss(),
                            metrics=["accuracy"])
        expected = keras_model.fit(keras_train, epochs=2, validation_data=keras_val,
                                   validation_steps=3, shuffle=False, verbose=0)
        expected_logs = keras_model.evaluate(keras_val, steps=2, verbose=0, return_dict=True)
        trainer = towers.TowerTrainer(_model(), _loss(), keras.optimizers.SGD(0.5),
                                      devices=DEVICES[:3], metrics=["accuracy"])
        history = trainer.fit(towers_train, epochs=2, validation_data=towers_val,
                              validation_steps=3, verbose=0)
        logs = trainer.evaluate(towers_val, steps=2)
        self.assertEqual(towers_val.calls, keras_val.calls)
        self.assertEqual(towers_train.calls, keras_train.calls)
        for name, values in expected.history.items():
            self.assertAllClose(history.history[name], values, atol=1e-5, msg=name)
        self.assertAllClose(logs, expected_logs, atol=1e-5)

    @parameterized.parameters(dict(workers=2), dict(use_multiprocessing=True))
    def test_parallel_loading_refused_in_one_line(self, **loading):
        trainer = towers.TowerTrainer(_model(), _loss(), keras.optimizers.SGD(0.5),
                                      devices=DEVICES[:2])
        with self.assertRaisesRegex(ValueError, r"^dataset Reshuffled asks for workers=.*"
                                                r"build it with workers=1") as raised:
            trainer.fit(Reshuffled(**loading), epochs=1, verbose=0)
        self.assertNotIn("\n", str(raised.exception))
        self.assertEqual(trainer.step, 0)


if __name__ == "__main__":
    tf.test.main()
