"""N towers update the weights exactly as one device does on the whole batch."""

import itertools

import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import towers
from tests import reference

DEVICES = [f"/device:CPU:{i}" for i in range(4)]
TOLERANCE = 1e-5


def _tower_weights(num_towers, optimizer_name, batches, **trainer_kwargs):
    model = reference.make_model()
    trainer = towers.TowerTrainer(
        model, reference.make_loss(), reference.OPTIMIZERS[optimizer_name](),
        devices=DEVICES[:num_towers], **trainer_kwargs)
    for batch in batches:
        trainer.train_step(batch)
    assert trainer.step == len(batches)
    return [v.numpy() for v in model.weights]


def _single_device(optimizer_name, batches):
    return reference.single_device_weights(
        reference.make_model(), reference.OPTIMIZERS[optimizer_name](),
        reference.make_loss(), batches)


class SingleDeviceEquivalenceTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.named_parameters(
        (f"{n}towers_batch{b}_{opt}", n, b, opt)
        for n, b, opt in itertools.product([1, 2, 3, 4], [12, 10, 3], ["sgd", "adam"]))
    def test_five_steps_match_one_device(self, num_towers, global_batch_size, optimizer_name):
        # 12 divides evenly by 1-4 towers, 10 does not (3 and 4 towers), 3 leaves
        # a tower empty on 4.
        batches = reference.make_batches(global_batch_size)
        expected = _single_device(optimizer_name, batches)
        actual = _tower_weights(num_towers, optimizer_name, batches)
        for want, got in zip(expected, actual):
            self.assertAllClose(want, got, atol=TOLERANCE, rtol=TOLERANCE)

    def test_batch_size_changing_every_step(self):
        batches = [b for size in (10, 3, 7, 1, 4) for b in reference.make_batches(size, 1)]
        expected = _single_device("adam", batches)
        actual = _tower_weights(4, "adam", batches)
        for want, got in zip(expected, actual):
            self.assertAllClose(want, got, atol=TOLERANCE, rtol=TOLERANCE)

    def test_without_sample_weights(self):
        batches = reference.make_batches(10, sample_weights=False)
        expected = _single_device("sgd", batches)
        actual = _tower_weights(3, "sgd", batches)
        for want, got in zip(expected, actual):
            self.assertAllClose(want, got, atol=TOLERANCE, rtol=TOLERANCE)

    @parameterized.named_parameters(
        ("host_parameter_server", DEVICES[1:], "/cpu:0"),
        ("main_is_last_tower", DEVICES[:3], DEVICES[2]),
    )
    def test_main_device_choice_does_not_change_result(self, devices, main_device):
        batches = reference.make_batches(10)
        expected = _single_device("adam", batches)
        model = reference.make_model()
        trainer = towers.TowerTrainer(model, reference.make_loss(),
                                      reference.OPTIMIZERS["adam"](), devices=devices,
                                      main_device=main_device)
        for batch in batches:
            trainer.train_step(batch)
        for want, got in zip(expected, model.weights):
            self.assertAllClose(want, got.numpy(), atol=TOLERANCE, rtol=TOLERANCE)

    def test_logged_loss_is_global_batch_mean_plus_regularisation(self):
        (batch,) = reference.make_batches(10, num_steps=1)
        model = reference.make_model()
        x, y, w = batch
        expected = float(reference.make_loss()(y, model(x), sample_weight=w)
                         + tf.add_n(model.losses))
        trainer = towers.TowerTrainer(model, reference.make_loss(),
                                      reference.OPTIMIZERS["sgd"](), devices=DEVICES)
        self.assertAllClose(expected, trainer.train_step(batch)["loss"], atol=1e-6)


class MirroredStrategyEquivalenceTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.named_parameters(
        (f"{n}towers_batch{b}_{opt}", n, b, opt)
        for n, b, opt in itertools.product([2, 4], [12, 10], ["sgd", "adam"]))
    def test_five_steps_match_mirrored_strategy(self, num_towers, global_batch_size,
                                                optimizer_name):
        batches = reference.make_batches(global_batch_size)
        expected = reference.mirrored_weights(
            reference.make_model, reference.OPTIMIZERS[optimizer_name],
            DEVICES[:num_towers], batches)
        actual = _tower_weights(num_towers, optimizer_name, batches)
        for want, got in zip(expected, actual):
            self.assertAllClose(want, got, atol=TOLERANCE, rtol=TOLERANCE)


class TowerGradientsTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.parameters(1, 2, 4)
    def test_matches_single_device_gradients_inside_user_function(self, num_towers):
        (batch,) = reference.make_batches(10, num_steps=1)
        model = reference.make_model()
        loss = reference.make_loss()
        x, y, w = batch
        with tf.GradientTape() as tape:
            value = loss(y, model(x, training=True), sample_weight=w) + tf.add_n(model.losses)
        expected = tape.gradient(value, model.trainable_variables)

        @tf.function
        def research_step(batch):
            return towers.tower_gradients(model, loss, batch, DEVICES[:num_towers])

        grads, logs = research_step(batch)
        self.assertLen(grads, len(model.trainable_variables))
        for want, got in zip(expected, grads):
            self.assertAllClose(want, got, atol=1e-6)
            self.assertIn("CPU:0", got.device)
        self.assertAllClose(value, logs["loss"], atol=1e-6)

    def test_masked_recurrent_model_traced_once_per_micro_batch_shape_as_keras(self):
        """Inside your tf.function the model's forward is traced once for micro-batches of
        any rows, not once per tower and micro-batch, and the gradients are Keras's: a
        masked loss (its denominator counted over the towers), an LSTM inside a nested
        layer that adds a loss, 10 rows over 4 towers of 2 micro-batches each."""
        keras.utils.set_random_seed(5)
        calls = []
        model = keras.Sequential([keras.Input((6,), dtype="int32"),
                                  keras.layers.Embedding(20, 8, mask_zero=True),
                                  _CalledBlock(calls.append), keras.layers.Dense(3)])
        model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        rng = np.random.default_rng(5)
        x = rng.integers(1, 20, size=(10, 6)).astype("int32")
        x[:, 4:] = 0  # padding: masked steps
        y = rng.integers(0, 3, size=(10, 6))
        with tf.GradientTape() as tape:
            value = model.compute_loss(x, y, model(x, training=True))
        expected = tape.gradient(value, model.trainable_variables)
        del calls[:]

        @tf.function
        def research_step(x, y):
            return towers.tower_gradients(model, model.loss, (x, y), DEVICES, accum_steps=2)

        grads, logs = research_step(x, y)
        # Shards of 3, 3, 2, 2 rows, micro-batches of 2 and 1: one trace, its rows
        # unknown, where each tower's micro-batches traced their own made eight.
        self.assertLen(calls, 1)
        self.assertAllClose(value, logs["loss"], atol=1e-6)
        for want, got in zip(expected, grads):
            self.assertAllClose(tf.convert_to_tensor(want), tf.convert_to_tensor(got),
                                atol=1e-6)


class _CalledBlock(keras.layers.Layer):
    """An LSTM and a Dense that pass the mask on, adding an activity loss; each call of
    its Python code tells `on_call`."""

    def __init__(self, on_call, **kwargs):
        super().__init__(**kwargs)
        self.on_call, self.supports_masking = on_call, True
        self.lstm = keras.layers.LSTM(5, return_sequences=True)
        self.dense = keras.layers.Dense(4, activation="tanh")

    def call(self, x, mask=None):
        self.on_call(None)
        h = self.dense(self.lstm(x, mask=mask))
        self.add_loss(0.01 * tf.reduce_mean(tf.square(h)))
        return h


if __name__ == "__main__":
    tf.test.main()
