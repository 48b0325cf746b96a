"""TowerTrainer.predict against keras.Model.predict on one device: every tower predicts its
shard of each batch, the outputs come back in row order and structure, within 1e-5, on
1 and 3 towers with uneven batches and empty shards, a dict of inputs and of outputs,
BatchNorm and Dropout (inference mode), a pipeline grid (its weights in place or spread)
before and after training, a grid of split-layer parts and a masked GRU; from arrays, a
tf.data.Dataset and a keras.utils.PyDataset (its hooks as Keras calls them), with steps
and callbacks as Keras's; bad arguments in one line."""

import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import towers
from tests import reference

CPU = [f"/device:CPU:{i}" for i in range(4)]
TOLERANCE = 1e-5


def _x(rows, seed=0):
    return np.random.default_rng(seed).normal(
        size=(rows, reference.NUM_FEATURES)).astype("float32")


def _trainer(model, devices, **options):
    return towers.TowerTrainer(model, reference.make_loss(), keras.optimizers.SGD(0.1),
                               devices=devices, **options)


def _two_in_two_out(seed=0):
    """Inputs {"a": (3,), "b": (2,)} -> outputs {"score": (1,), "classes": (3,)}."""
    keras.utils.set_random_seed(seed)
    a, b = keras.Input((3,), name="a"), keras.Input((2,), name="b")
    hidden = keras.layers.Dense(4, activation="tanh")(keras.layers.Concatenate()([a, b]))
    return keras.Model({"a": a, "b": b}, {"score": keras.layers.Dense(1, name="score")(hidden),
                                          "classes": keras.layers.Dense(3, name="classes")(b)})


def _normalised(seed=0):
    """Dense -> BatchNormalization -> Dropout(0.5) -> Dense."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((reference.NUM_FEATURES,)), keras.layers.Dense(6),
        keras.layers.BatchNormalization(), keras.layers.Dropout(0.5),
        keras.layers.Dense(reference.NUM_CLASSES)])


def _masked_gru(seed=0):
    """Token ids (0 masked) -> Embedding(mask_zero) -> GRU -> logits."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((5,), dtype="int32"), keras.layers.Embedding(8, 3, mask_zero=True),
        keras.layers.GRU(4), keras.layers.Dense(reference.NUM_CLASSES)])


class Batches(keras.utils.PyDataset):
    """Batches of 4 rows of (x, y), the last of 2; `calls` records the epoch hooks."""

    def __init__(self):
        super().__init__()
        self.x, self.calls = _x(10, seed=5), []

    def __len__(self):
        return 3

    def __getitem__(self, index):
        rows = self.x[index * 4:(index + 1) * 4]
        return rows, np.zeros(len(rows), np.int32)

    def on_epoch_begin(self):
        self.calls.append("begin")

    def on_epoch_end(self):
        self.calls.append("end")


class Recorder(keras.callbacks.Callback):
    """The on_predict_* calls: (hook, batch index, the outputs' shape)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def on_predict_begin(self, logs=None):
        self.calls.append(("begin",))

    def on_predict_batch_begin(self, batch, logs=None):
        self.calls.append(("batch_begin", batch))

    def on_predict_batch_end(self, batch, logs=None):
        self.calls.append(("batch_end", batch, tuple(logs["outputs"].shape)))

    def on_predict_end(self, logs=None):
        self.calls.append(("end",))


class PredictTest(tf.test.TestCase, parameterized.TestCase):

    def assertSameOutputs(self, expected, actual):
        """Same structure (type, keys), NumPy arrays within TOLERANCE; returns the
        largest difference."""
        self.assertEqual(type(expected), type(actual))
        tf.nest.assert_same_structure(expected, actual)
        differences = []
        for want, got in zip(tf.nest.flatten(expected), tf.nest.flatten(actual)):
            self.assertIsInstance(got, np.ndarray)
            self.assertEqual(want.shape, got.shape)
            self.assertAllClose(want, got, atol=TOLERANCE, rtol=0)
            differences.append(float(np.max(np.abs(want - got))))
        return max(differences)

    @parameterized.parameters(1, 3)
    def test_uneven_batches_and_empty_shards(self, num_towers):
        # 10 rows in batches of 4: shards 2/1/1, 1/1/1+1, and 1/1/0 on 3 towers.
        model = reference.make_up_down_model()
        trainer = _trainer(model, CPU[:num_towers])
        x = _x(10)
        self.assertSameOutputs(model.predict(x, batch_size=4, verbose=0),
                               trainer.predict(x, batch_size=4, verbose=0))
        # Default batch_size (32): one batch of 10; a Tensor; steps cut arrays in steps.
        self.assertSameOutputs(model.predict(x, verbose=0),
                               trainer.predict(tf.constant(x), verbose=0))
        self.assertSameOutputs(model.predict(x, steps=4, verbose=0),
                               trainer.predict(x, steps=4, verbose=0))  # batches of 3
        self.assertSameOutputs(model.predict(x[:2], verbose=0),  # one row per tower or none
                               trainer.predict(x[:2], verbose=0))
        # Each tower multiplies its own shard on its own device (inside the forward traced
        # once for every tower, where there are several: placed as its call is; grappler,
        # which optimised it once, fuses the MatMul with its bias).
        devices = {tf.DeviceSpec.from_string(node.device).device_index
                   for node in reference.traced_nodes(trainer)
                   if node.op in ("MatMul", "_FusedMatMul")}
        self.assertEqual(devices, set(range(num_towers)))

    def test_dict_inputs_and_outputs_from_arrays_and_a_dataset(self):
        model = _two_in_two_out()
        trainer = towers.TowerTrainer(model, {"score": "mse", "classes": "mse"}, "sgd",
                                      devices=CPU[:3])
        rng = np.random.default_rng(2)
        x = {"a": rng.normal(size=(7, 3)).astype("float32"),
             "b": rng.normal(size=(7, 2))}  # float64: cast as Keras casts it
        expected = model.predict(x, batch_size=3, verbose=0)
        self.assertEqual(sorted(expected), ["classes", "score"])
        self.assertSameOutputs(expected, trainer.predict(x, batch_size=3, verbose=0))
        y = {"score": np.zeros((7, 1)), "classes": np.zeros((7, 3))}
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(3)  # (x, y): y ignored
        self.assertSameOutputs(model.predict(dataset, verbose=0),
                               trainer.predict(dataset, verbose=0))

    def test_batch_normalization_and_dropout_predict_in_inference_mode(self):
        model = _normalised()
        trainer = _trainer(model, CPU[:3])
        for batch in reference.make_batches(9, num_steps=2):  # moving statistics moved
            trainer.train_step(batch)
        self.assertNotAllClose(model.layers[1].moving_mean.numpy(), np.zeros(6))
        x = _x(11)
        self.assertSameOutputs(model.predict(x, batch_size=5, verbose=0),
                               trainer.predict(x, batch_size=5, verbose=0))

    @parameterized.parameters("main", "spread")
    def test_pipeline_grid_before_and_after_training(self, variable_placement):
        model = reference.make_up_down_model()
        trainer = _trainer(model, [CPU[:2], CPU[2:]], pipeline_cuts=["up"], micro_batches=2,
                           variable_placement=variable_placement)
        x = _x(9)  # batches 4, 4, 1: shards 2/2, 2/2, 1/0
        # Before the first step, and after it (the steps traced before it still reading
        # the weights where the first step left them).
        for _ in range(2):
            self.assertSameOutputs(model.predict(x, batch_size=4, verbose=0),
                                   trainer.predict(x, batch_size=4, verbose=0))
            trainer.train_step(reference.make_batches(6, num_steps=1)[0])

    def test_grid_of_split_layer_parts(self):
        model = reference.make_up_down_model()
        parted = towers.split_layers(model, {"up": "column", "down": "row"}, CPU[:2])
        trainer = _trainer(parted, [CPU[:2], CPU[2:]])
        x = _x(7)  # batches 4, 3: shards 2/2, 2/1
        self.assertSameOutputs(model.predict(x, batch_size=4, verbose=0),
                               trainer.predict(x, batch_size=4, verbose=0))

    def test_masked_gru(self):
        model = _masked_gru()
        trainer = _trainer(model, CPU[:3])
        ids = np.random.default_rng(3).integers(0, 8, (8, 5)).astype(np.int32)
        ids[:, 3:] = 0  # padding
        ids[1] = 0  # a row wholly masked
        self.assertSameOutputs(model.predict(ids, batch_size=4, verbose=0),
                               trainer.predict(ids, batch_size=4, verbose=0))

    def test_py_dataset_hooks_steps_and_callbacks_as_keras(self):
        model = reference.make_model()
        trainer = _trainer(model, CPU[:3])
        keras_data, towers_data = Batches(), Batches()
        keras_calls, towers_calls = Recorder(), Recorder()
        expected = model.predict(keras_data, verbose=0, callbacks=[keras_calls])
        self.assertSameOutputs(expected, trainer.predict(towers_data, verbose=0,
                                                         callbacks=[towers_calls]))
        self.assertEqual(keras_data.calls, ["begin", "end"])
        self.assertEqual(towers_data.calls, keras_data.calls)
        self.assertEqual(towers_calls.calls, keras_calls.calls)
        self.assertLen(towers_calls.calls, 8)  # begin, 3 x (batch_begin, batch_end), end
        # steps: at most that many batches of a PyDataset or a dataset.
        keras_data, towers_data = Batches(), Batches()
        expected = model.predict(keras_data, steps=2, verbose=0)
        self.assertSameOutputs(expected, trainer.predict(towers_data, steps=2, verbose=0))
        self.assertEqual(towers_data.calls, keras_data.calls)
        dataset = tf.data.Dataset.from_tensor_slices(_x(10)).batch(4)  # elements x
        self.assertSameOutputs(model.predict(dataset, steps=2, verbose=0),
                               trainer.predict(dataset, steps=2, verbose=0))

    def test_an_unbuilt_model_predicts_first_then_trains(self):
        class Mlp(keras.Model):
            def __init__(self):
                super().__init__()
                self.hidden = keras.layers.Dense(4, activation="tanh")
                self.out = keras.layers.Dense(reference.NUM_CLASSES)

            def call(self, x):
                return self.out(self.hidden(x))

        model = Mlp()
        trainer = _trainer(model, CPU[:3])
        x = _x(5)
        predicted = trainer.predict(x, batch_size=4, verbose=0)  # builds the model
        self.assertSameOutputs(model.predict(x, batch_size=4, verbose=0), predicted)
        trainer.train_step(reference.make_batches(5, num_steps=1)[0])
        self.assertEqual(trainer.step, 1)
        self.assertSameOutputs(model.predict(x, verbose=0), trainer.predict(x, verbose=0))

    def test_a_layer_frozen_before_the_first_step(self):
        model = reference.make_up_down_model()
        trainer = _trainer(model, [CPU[:2], CPU[2:]], pipeline_cuts=["up"])
        model.get_layer("up").trainable = False  # moves its variables out of the stage's
        x = _x(5)
        self.assertSameOutputs(model.predict(x, verbose=0), trainer.predict(x, verbose=0))

    def test_refused_in_one_line(self):
        trainer = _trainer(reference.make_model(), CPU[:2])
        dataset = tf.data.Dataset.from_tensor_slices(_x(4)).batch(2)
        for call, message in (
                (lambda: trainer.predict(dataset, batch_size=2),
                 "batch_size must be None when x is a _BatchDataset: its batches carry"),
                (lambda: trainer.predict(Batches(), batch_size=2),
                 "batch_size must be None when x is a Batches"),
                (lambda: trainer.predict(_x(4), verbose=3), "verbose must be"),
                (lambda: trainer.predict(_x(4), steps=0), "steps must be an integer >= 1"),
                (lambda: trainer.predict(_x(4), batch_size=0), "batch_size must be"),
                (lambda: trainer.predict(_x(0)), "x has no rows"),
                (lambda: trainer.predict(None), "x must be an array .*; got x=None"),
                (lambda: trainer.predict(dataset.take(0), verbose=0), "predict got no batches"),
                (lambda: trainer.predict(_x(4), callbacks=Recorder()), "callbacks must be"),
                (lambda: trainer.predict(np.zeros((4, 2))), r"x has shape \(4, 2\)")):
            with self.assertRaisesRegex(ValueError, message) as raised:
                call()
            self.assertNotIn("\n", str(raised.exception))


if __name__ == "__main__":
    tf.test.main()
