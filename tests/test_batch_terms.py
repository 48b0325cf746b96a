"""Losses a model adds in its call (add_loss, activity_regularizer), against Keras on one
device: a mean over rows, a sum over rows, a term of the weights only and a KL summed
over the batch are exact on 3 towers with uneven shards; a term that couples rows is
refused in one line, naming its layer, before any weight changes."""

import keras
import numpy as np
import tensorflow as tf
from absl import logging
from absl.testing import parameterized
from keras import ops

import towers

DEVICES = [f"/device:CPU:{i}" for i in range(3)]
TOLERANCE = 1e-5


class AddedLoss(keras.layers.Layer):
    """Passes its input on, adding one loss of it (or of its own weight) by `form`."""

    def __init__(self, form, **kwargs):
        super().__init__(**kwargs)
        self.form = form

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(), initializer="ones")

    def call(self, h):
        if self.form == "mean":
            self.add_loss(0.1 * ops.mean(ops.sum(h ** 2, axis=-1)))
        elif self.form == "sum":
            self.add_loss(0.01 * ops.sum(h ** 2))
        elif self.form == "weights":
            self.add_loss(0.1 * self.scale ** 2)
        elif self.form == "kl":  # a VAE's KL of (mean, log variance) halves, summed over rows
            mean, log_var = ops.split(h, 2, axis=-1)
            self.add_loss(-0.005 * ops.sum(1 + log_var - mean ** 2 - ops.exp(log_var)))
        elif self.form == "on_big_batches":  # present on some calls only
            if h.shape[0] is not None and h.shape[0] > 2:
                self.add_loss(0.1 * ops.mean(h ** 2))
        elif self.form == "load_balancing":  # Switch: batch mean of routing x of gates
            gates = ops.softmax(h)
            routed = ops.one_hot(ops.argmax(h, axis=-1), h.shape[-1])
            self.add_loss(ops.sum(ops.mean(routed, axis=0) * ops.mean(gates, axis=0)))
        return h * self.scale


def _model(form, batch_norm=False):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    h = keras.layers.Dense(6, name="hidden")(inputs)
    if batch_norm:
        h = keras.layers.BatchNormalization(name="norm")(h)
    if form == "activity_l2":
        h = keras.layers.Dense(6, activity_regularizer=keras.regularizers.L2(0.05),
                               name="regularized")(h)
    else:
        h = AddedLoss(form, name="added")(h)
    return keras.Model(inputs, keras.layers.Dense(3, name="head")(h))


def _batches(steps=3, rows=7):
    rng = np.random.default_rng(1)
    return [(rng.normal(size=(rows, 4)).astype("float32"), rng.integers(0, 3, rows))
            for _ in range(steps)]


_OPTIMIZERS = {"sgd": lambda: keras.optimizers.SGD(0.1),
               "adam": lambda: keras.optimizers.Adam(1e-3)}


class AddedLossFormsTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.product(
        form=["mean", "sum", "weights", "kl", "activity_l2"], optimizer=["sgd", "adam"])
    def test_equals_keras_on_one_device(self, form, optimizer):
        batches = _batches()
        expected = _model(form)
        expected.compile(_OPTIMIZERS[optimizer](), "sparse_categorical_crossentropy")
        keras_logs = [expected.train_on_batch(x, y, return_dict=True) for x, y in batches]
        trainer = towers.TowerTrainer(_model(form), "sparse_categorical_crossentropy",
                                      _OPTIMIZERS[optimizer](), devices=DEVICES)
        logs = [trainer.train_step(batch) for batch in batches]  # 7 rows: shards 3, 2, 2
        for want, got in zip(keras_logs, logs):
            self.assertAllClose(want["loss"], got["loss"], atol=TOLERANCE, rtol=0)
        for want, got in zip(expected.weights, trainer.model.weights):
            self.assertAllClose(want, got, atol=TOLERANCE, rtol=0, msg=want.path)
        x, y = batches[0]
        self.assertAllClose(expected.evaluate(x, y, batch_size=7, verbose=0),
                            trainer.evaluate((x, y))["loss"],
                            atol=TOLERANCE, rtol=0)

    def test_batch_norm_before_an_activity_regularizer_is_a_mean_equal_to_keras(self):
        # Measured in inference, where BatchNorm's moving statistics keep the term per
        # row; in training its batch statistics would make it look coupled. With global
        # batch statistics the whole step is one device's.
        batches = _batches()
        expected = _model("activity_l2", batch_norm=True)
        expected.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy")
        keras_losses = [expected.train_on_batch(x, y) for x, y in batches]
        trainer = towers.TowerTrainer(_model("activity_l2", batch_norm=True),
                                      "sparse_categorical_crossentropy",
                                      keras.optimizers.SGD(0.1), devices=DEVICES,
                                      batch_statistics="global")
        losses = [trainer.train_step(batch)["loss"] for batch in batches]
        self.assertEqual(trainer.objective.model_loss_forms, {"regularized#0": "mean"})
        self.assertAllClose(keras_losses, losses, atol=TOLERANCE, rtol=0)
        for want, got in zip(expected.weights, trainer.model.weights):
            self.assertAllClose(want, got, atol=TOLERANCE, rtol=0, msg=want.path)

    @parameterized.named_parameters(
        ("couples_rows", "load_balancing", "couples the batch's rows"),
        ("on_some_calls_only", "on_big_batches", "on some rows and not on others"))
    def test_a_loss_of_no_form_is_refused_before_any_step(self, form, why):
        model = _model(form)
        before = [w.numpy() for w in model.weights]
        trainer = towers.TowerTrainer(model, "sparse_categorical_crossentropy",
                                      keras.optimizers.SGD(0.1), devices=DEVICES)
        with self.assertRaisesRegex(ValueError, f"^layer 'added' .*{why}.*"
                                                r"tower_step\(\.\.\., batch_losses=\)"
                                    ) as raised:
            trainer.train_step(_batches(steps=1)[0])
        self.assertNotIn("\n", str(raised.exception))
        for want, got in zip(before, model.weights):
            self.assertAllEqual(want, got)

    @parameterized.named_parameters(("column", "hidden", "column"), ("row", "hidden", "row"),
                                    ("heads", "attention", "heads"))
    def test_a_split_layer_regularises_its_activity_as_the_layer(self, name, how):
        # A part's output is a share of the layer's (a slice, or a term of a sum): the
        # regulariser applies where the parts meet (and to an attention's q, k, v parts).
        keras.utils.set_random_seed(0)
        inputs = keras.Input((3, 4))
        regularizer = keras.regularizers.L2(0.05)
        h = keras.layers.Dense(6, activation="tanh", activity_regularizer=regularizer,
                               name="hidden")(inputs)
        h = keras.layers.MultiHeadAttention(2, 2, activity_regularizer=regularizer,
                                            name="attention")(h, h)
        model = keras.Model(inputs, h)
        x = np.random.default_rng(1).normal(size=(5, 3, 4)).astype("float32")
        model(x)
        expected = float(tf.add_n(model.losses))
        parted = towers.split_layers(model, {name: how}, DEVICES[:2])
        parted(x)
        self.assertAllClose(tf.add_n(parted.losses), expected, atol=1e-6, rtol=0)

    def test_tower_gradients_warns_that_it_counts_added_losses_as_means(self):
        """Inside your tf.function no batch values exist to measure a loss's form:
        tower_gradients counts it a mean over rows (exact for one), and says so once."""
        x, y = _batches(steps=1)[0]
        expected, model = _model("mean"), _model("mean")
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
                y, expected(x))) + tf.add_n(expected.losses)
        want = tape.gradient(loss, expected.trainable_variables)

        @tf.function
        def gradients(x, y):
            return towers.tower_gradients(model, "sparse_categorical_crossentropy", (x, y),
                                          DEVICES)

        with self.assertLogs(logging.get_absl_logger(), "WARNING") as logs:
            grads, _ = gradients(tf.constant(x), tf.constant(y))
        for w, g in zip(want, grads):
            self.assertAllClose(w, g, atol=TOLERANCE, rtol=0)
        warnings = [r.getMessage() for r in logs.records if "tower_gradients" in r.getMessage()]
        self.assertLen(warnings, 1)
        self.assertIn("'added'", warnings[0])
        self.assertIn("TowerTrainer", warnings[0])
