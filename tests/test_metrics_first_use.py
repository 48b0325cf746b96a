"""Metrics that create their variables on their first update, against Keras on one device.

F1Score, FBetaScore and R2Score make their state when they first see a batch (its
number of classes or outputs), as does a user's metric that builds itself in its first
`update_state`. TowerTrainer builds them once, eagerly, on the first batch, before the
step is traced; each test trains with Keras's `compile` + `fit` on one device and with
TowerTrainer on 1 and 3 towers (10 rows: shards of 4, 3 and 3; the main device not
the default one), in `metrics` lists,
per-output dicts and `weighted_metrics`, and compares fit's and evaluate's logs by name.
"""

import itertools

import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized
from keras import ops

import towers

DEVICES = [f"/device:CPU:{i}" for i in range(4)]
TOLERANCE = 1e-5
FEATURES, CLASSES, TARGETS = 4, 3, 2


class SquaredErrorPerColumn(keras.metrics.Metric):
    """A user's metric that makes its variables in `build`, called by its first
    `update_state`, with one entry per output column: the (weighted) mean squared error
    of each column, summed over the columns."""

    def __init__(self, name="squared_error_per_column", **kwargs):
        super().__init__(name=name, **kwargs)
        self.total = None

    def build(self, y_true_shape, y_pred_shape):
        self.total = self.add_variable(shape=(y_pred_shape[-1],), initializer="zeros",
                                       name="total")
        self.count = self.add_variable(shape=(), initializer="zeros", name="count")

    def update_state(self, y_true, y_pred, sample_weight=None):
        if self.total is None:
            self.build(y_true.shape, y_pred.shape)
        weights = (ops.ones_like(y_pred[:, 0]) if sample_weight is None
                   else ops.cast(sample_weight, y_pred.dtype))
        squares = ops.square(ops.cast(y_true, y_pred.dtype) - y_pred)  # (rows, columns)
        self.total.assign(self.total + ops.sum(squares * weights[:, None], axis=0))
        self.count.assign(self.count + ops.sum(weights))

    def result(self):
        return ops.sum(self.total) / self.count


def _model(form):
    """Four features -> CLASSES probabilities; for "per_output_dict" also TARGETS values."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((FEATURES,))
    h = keras.layers.Dense(6, activation="relu", name="hidden")(inputs)
    cls = keras.layers.Dense(CLASSES, activation="softmax", name="cls")(h)
    if form != "per_output_dict":
        return keras.Model(inputs, cls)
    return keras.Model(inputs, {"cls": cls, "reg": keras.layers.Dense(TARGETS, name="reg")(h)})


def _compile_args(form):
    """compile's loss and metrics for `form`, fresh metric objects every call."""
    if form == "metrics_list":
        return dict(loss="categorical_crossentropy",
                    metrics=[keras.metrics.F1Score(average="macro"),
                             keras.metrics.FBetaScore(beta=0.5, average="weighted"),
                             SquaredErrorPerColumn()])
    if form == "weighted_metrics":  # the same name in both: Keras's "weighted_f1_score"
        return dict(loss="categorical_crossentropy",
                    metrics=[keras.metrics.F1Score(average="macro")],
                    weighted_metrics=[keras.metrics.F1Score(average="macro"),
                                      keras.metrics.FBetaScore(beta=2.0, average="micro",
                                                               threshold=0.4),
                                      SquaredErrorPerColumn()])
    return dict(loss={"cls": "categorical_crossentropy", "reg": "mse"},
                metrics={"cls": [keras.metrics.F1Score(average="macro")],
                         "reg": [keras.metrics.R2Score(), SquaredErrorPerColumn()]})


def _data(form, rows, seed):
    """A dataset of `rows` examples: one-hot classes (and regression targets, or
    sample weights)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, FEATURES)).astype("float32")
    y = np.eye(CLASSES, dtype="float32")[rng.integers(0, CLASSES, rows)]
    if form == "per_output_dict":
        y = {"cls": y, "reg": (x[:, :TARGETS] * 2 + rng.normal(size=(rows, TARGETS)) * 0.1
                               ).astype("float32")}
    if form == "weighted_metrics":
        return tf.data.Dataset.from_tensor_slices(
            (x, y, rng.uniform(0.5, 2.0, rows).astype("float32")))
    return tf.data.Dataset.from_tensor_slices((x, y))


class FirstUseMetricsTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.named_parameters(
        (f"{form}_{num_towers}_towers", form, num_towers) for form, num_towers in
        itertools.product(("metrics_list", "weighted_metrics", "per_output_dict"), (1, 3)))
    def test_fit_and_evaluate_logs_equal_keras(self, form, num_towers):
        train, test = _data(form, 20, seed=1).batch(10), _data(form, 7, seed=2).batch(4)
        keras_model = _model(form)
        keras_model.compile(optimizer=keras.optimizers.SGD(0.5), **_compile_args(form))
        expected = keras_model.fit(train, epochs=2, verbose=0).history
        expected_evaluated = keras_model.evaluate(test, return_dict=True, verbose=0)

        compile_args = _compile_args(form)
        made_by_init = {id(v) for metric in tf.nest.flatten(
            [compile_args.get("metrics"), compile_args.get("weighted_metrics")])
            if metric is not None for v in metric.variables}  # R2Score's num_samples
        with tf.device(DEVICES[1]):
            model = _model(form)
        trainer = towers.TowerTrainer(model, optimizer=keras.optimizers.SGD(0.5),
                                      devices=DEVICES[1:1 + num_towers], **compile_args)
        history = trainer.fit(train, epochs=2, verbose=False).history
        evaluated = trainer.evaluate(test)

        self.assertEqual(sorted(trainer.metrics.names),
                         sorted(set(expected_evaluated) - {"loss", "cls_loss", "reg_loss"}))
        for name, values in expected.items():
            self.assertAllClose(history[name], values, atol=TOLERANCE, msg=name)
        self.assertEqual(sorted(evaluated), sorted(expected_evaluated))
        for name, value in expected_evaluated.items():
            self.assertAllClose(evaluated[name], value, atol=TOLERANCE, msg=name)
        first_use = [v for v in trainer.metrics.variables if id(v) not in made_by_init]
        self.assertNotEmpty(first_use)
        for variable in first_use:  # made on the main device, where the metrics update
            self.assertEqual(towers.devices.canonical_name(variable.value.device),
                             towers.devices.canonical_name(DEVICES[1]))

    @parameterized.named_parameters(("one_tower", 1), ("three_towers", 3))
    def test_evaluate_first_equals_keras(self, num_towers):
        # The first batch an evaluation's: the metrics built there, as fit's would be.
        test = _data("per_output_dict", 7, seed=2).batch(4)
        keras_model = _model("per_output_dict")
        keras_model.compile(**_compile_args("per_output_dict"))
        expected = keras_model.evaluate(test, return_dict=True, verbose=0)
        trainer = towers.TowerTrainer(_model("per_output_dict"),
                                      optimizer=keras.optimizers.SGD(0.5),
                                      devices=DEVICES[:num_towers],
                                      **_compile_args("per_output_dict"))
        evaluated = trainer.evaluate(test)
        self.assertEqual(sorted(evaluated), sorted(expected))
        for name, value in expected.items():
            self.assertAllClose(evaluated[name], value, atol=TOLERANCE, msg=name)

    @parameterized.named_parameters(
        # F1Score takes one-hot targets: on class ids its build fails.
        ("f1_score_on_class_ids", "sparse_categorical_crossentropy", True,
         keras.metrics.F1Score, "FBetaScore expects 2D inputs"),
        # A metric function whose update fails on the examples' values (was a trace error).
        ("a_function_on_too_few_columns", "categorical_crossentropy", False,
         lambda: lambda y_true, y_pred: y_true[:, :2] * y_pred, "Incompatible shapes"),
    )
    def test_a_metric_that_does_not_fit_refused_at_the_first_batch(self, loss, class_ids,
                                                                   metric, message):
        # In one line, before the step is traced and before anything is applied.
        rng = np.random.default_rng(0)
        y = rng.integers(0, CLASSES, 10)
        batch = (rng.normal(size=(10, FEATURES)).astype("float32"),
                 y if class_ids else np.eye(CLASSES, dtype="float32")[y])
        trainer = towers.TowerTrainer(_model("metrics_list"), loss, keras.optimizers.SGD(0.5),
                                      devices=DEVICES[:3], metrics=[metric()])
        before = trainer.model.get_weights()
        with self.assertRaisesRegex(ValueError, "^the metrics do not fit the model's "
                                    r"outputs: metric '\w+' \(\w+\) on labels of shape .* "
                                    f"per example: {message}[^\\n]*$"):
            trainer.train_step(batch)
        for want, got in zip(before, trainer.model.get_weights()):
            self.assertAllEqual(want, got)

if __name__ == "__main__":
    tf.test.main()
