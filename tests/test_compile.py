"""What keras.Model.compile and fit accept, against Keras itself on one device.

Each test trains the same model with `model.compile(...)` + `train_on_batch` (or
`fit`, `evaluate`) on one device, and with TowerTrainer over towers, micro-batches,
pipeline stages or split layers, and compares the weights and the logs by name:
masked sequences (a Keras mask on the outputs), per-output losses in dicts and
lists with loss_weights and per-output metrics, sample and class weights.
"""

import functools

import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import towers
from tests import reference

DEVICES = [f"/device:CPU:{i}" for i in range(4)]
TOLERANCE = 1e-5
VOCABULARY, TOKENS, TAGS, CLASSES = 20, 6, 5, 3


def _sce(reduction="sum_over_batch_size"):
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)


def _tokens(rows, rng):
    """Token ids (rows, TOKENS), each row padded with 0 after a length of 1..TOKENS."""
    x = rng.integers(1, VOCABULARY, (rows, TOKENS))
    lengths = rng.integers(1, TOKENS + 1, rows)
    x[np.arange(TOKENS)[None] >= lengths[:, None]] = 0
    return x.astype("int32")


def _encoder(kind, inputs):
    """Token ids -> masked (batch, TOKENS, 8) features: an LSTM or self-attention."""
    h = keras.layers.Embedding(VOCABULARY, 8, mask_zero=True, name="embedding")(inputs)
    if kind == "lstm":
        return keras.layers.LSTM(8, return_sequences=True, unroll=True, name="encoder")(h)
    return keras.layers.MultiHeadAttention(2, 4, name="encoder")(h, h)


def masked_model(kind, labels):
    """A padded-sequence model: per-token tags (the output carries the mask) or one class
    per sequence (the mask consumed by a pooling LSTM or average)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((TOKENS,), dtype="int32")
    h = _encoder(kind, inputs)
    if labels == "sequence":
        h = (keras.layers.LSTM(8, unroll=True, name="pool") if kind == "lstm"
             else keras.layers.GlobalAveragePooling1D(name="pool"))(h)
    return keras.Model(inputs, keras.layers.Dense(TAGS if labels == "tokens" else CLASSES,
                                                  name="head")(h))


def _linear_model():
    """Four features -> CLASSES logits, one Dense layer, the same weights every call."""
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(CLASSES)])


def two_heads_model():
    """Per-token tags (masked) and a class per sequence (not masked, L2-regularised): a
    loss term counted over the batch's tokens beside one over its rows."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((TOKENS,), dtype="int32")
    h = _encoder("attention", inputs)
    tags = keras.layers.Dense(TAGS, name="tags")(h)
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(h)
    cls = keras.layers.Dense(CLASSES, kernel_regularizer=keras.regularizers.L2(0.01),
                             name="cls")(pooled)
    return keras.Model(inputs, {"tags": tags, "cls": cls})


def _batches(rows, labels, steps=3, token_weights=False, seed=1):
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(steps):
        x = _tokens(rows, rng)
        tags = rng.integers(0, TAGS, (rows, TOKENS))
        classes = rng.integers(0, CLASSES, rows)
        y = {"tokens": tags, "sequence": classes, "both": {"tags": tags, "cls": classes}}[labels]
        batch = (x, y)
        if token_weights:
            batch += (rng.uniform(0.5, 2.0, (rows, TOKENS)).astype("float32"),)
        batches.append(batch)
    return batches


_keras_logs = functools.partial(reference.keras_step_logs, learning_rate=0.5)


class CompileFormsTest(reference.SameTraining, tf.test.TestCase,
                       parameterized.TestCase):

    @parameterized.named_parameters(
        ("lstm_tokens", "lstm", "tokens", 3, {}),
        ("attention_tokens_token_weights", "attention", "tokens", 3, {}, True),
        # Keras divides by the batch's sum of (masked) weights: counted as the mask is.
        ("attention_tokens_mean_with_sample_weight", "attention", "tokens", 3, {}, True,
         "mean_with_sample_weight"),
        ("lstm_sequence", "lstm", "sequence", 2, {}),
        ("attention_sequence", "attention", "sequence", 3, {}),
        ("attention_tokens_micro_batches", "attention", "tokens", 2, {"accum_steps": 3}, True),
        ("lstm_tokens_pipeline", "lstm", "tokens", 2,
         {"pipeline_cuts": ["embedding"], "micro_batches": 2}),
    )
    def test_masked_sequences_equal_keras(self, kind, labels, num_towers, options,
                                          token_weights=False,
                                          reduction="sum_over_batch_size"):
        batches = _batches(7, labels, token_weights=token_weights)
        keras_model = masked_model(kind, labels)
        keras_logs = _keras_logs(keras_model, batches, loss=_sce(reduction),
                                 metrics=["accuracy"])
        devices = DEVICES[:num_towers]
        if "pipeline_cuts" in options:
            devices = [DEVICES[2 * i:2 * i + 2] for i in range(num_towers)]
        trainer = towers.TowerTrainer(masked_model(kind, labels), _sce(reduction),
                                      keras.optimizers.SGD(0.5), devices=devices,
                                      metrics=["accuracy"], **options)
        self.assert_same_training(keras_model, keras_logs, trainer, batches)

    @parameterized.named_parameters(
        ("one_tower", 1, {}),
        ("three_towers", 3, {}),
        ("micro_batches", 3, {"accum_steps": 2}),
        ("pipeline_gpipe", 2, {"pipeline_cuts": ["encoder"], "micro_batches": 2}),
        ("pipeline_1f1b", 2, {"pipeline_cuts": ["encoder"], "micro_batches": 3,
                              "pipeline_schedule": "1f1b"}),
    )
    def test_dict_losses_with_a_masked_output_equal_keras(self, num_towers, options):
        batches = _batches(7, "both")
        compile_args = dict(loss={"tags": _sce(), "cls": _sce()},
                            loss_weights={"tags": 1.0, "cls": 0.3},
                            metrics={"tags": ["accuracy"], "cls": ["accuracy"]})
        keras_model = two_heads_model()
        keras_logs = _keras_logs(keras_model, batches, **compile_args)
        self.assertIn("tags_loss", keras_logs[0])
        devices = DEVICES[:num_towers]
        if "pipeline_cuts" in options:
            devices = [DEVICES[2 * i:2 * i + 2] for i in range(num_towers)]
        trainer = towers.TowerTrainer(two_heads_model(), optimizer=keras.optimizers.SGD(0.5),
                                      devices=devices, **compile_args, **options)
        self.assert_same_training(keras_model, keras_logs, trainer, batches)

    def test_split_layers_with_a_masked_output_equal_keras(self):
        batches = _batches(7, "both")
        compile_args = dict(loss={"tags": _sce(), "cls": _sce()}, loss_weights=[0.5, 2.0],
                            metrics={"tags": ["accuracy"]})
        keras_model = two_heads_model()
        keras_logs = _keras_logs(keras_model, batches, **compile_args)
        parted = towers.split_layers(two_heads_model(), {"tags": "column"}, DEVICES[:2])
        trainer = towers.TowerTrainer(parted, optimizer=keras.optimizers.SGD(0.5),
                                      devices=[DEVICES[:2], DEVICES[2:]], **compile_args)
        self.assert_same_training(keras_model, keras_logs, trainer, batches,
                                  towers.join_layers)

    def test_list_losses_names_and_per_output_metrics_equal_keras(self):
        def model():
            keras.utils.set_random_seed(0)
            inputs = keras.Input((4,))
            h = keras.layers.Dense(6, activation="relu", name="d1")(inputs)
            return keras.Model(inputs, [keras.layers.Dense(CLASSES, name="cls")(h),
                                        keras.layers.Dense(2, name="reg")(h)])

        rng = np.random.default_rng(3)
        batches = [(rng.normal(size=(7, 4)).astype("float32"),
                    [rng.integers(0, CLASSES, 7), rng.normal(size=(7, 2)).astype("float32")])
                   for _ in range(3)]
        compile_args = dict(loss=["sparse_categorical_crossentropy", "mse"],
                            loss_weights=[1.0, 0.5], metrics=[["accuracy"], ["mae", "mse"]])
        keras_model = model()
        keras_logs = _keras_logs(keras_model, batches, **compile_args)
        self.assertEqual(sorted(keras_logs[0]), ["cls_accuracy", "cls_loss", "loss", "reg_loss",
                                                 "reg_mae", "reg_mse"])
        trainer = towers.TowerTrainer(model(), optimizer=keras.optimizers.SGD(0.5),
                                      devices=DEVICES[:3], **compile_args)
        self.assert_same_training(keras_model, keras_logs, trainer, batches)

    def test_fit_and_evaluate_logs_equal_keras(self):
        # Per-output losses and metrics over an epoch and in evaluate: each batch's loss
        # weighed by its rows, as Keras's trackers weigh them.
        batches = _batches(5, "both", steps=4)
        data = tf.data.Dataset.from_tensor_slices(
            (np.concatenate([b[0] for b in batches]),
             {name: np.concatenate([b[1][name] for b in batches]) for name in ("tags", "cls")}))
        train, test = data.take(14).batch(5), data.skip(14).batch(4)  # 5, 5, 4 and 4, 2
        def compile_args():
            return dict(loss={"tags": _sce(), "cls": _sce()},
                        metrics={"tags": ["accuracy"], "cls": ["accuracy"]},
                        weighted_metrics={"cls": [keras.metrics.SparseCategoricalAccuracy(
                            name="weighted_acc")]})

        keras_model = two_heads_model()
        keras_model.compile(optimizer=keras.optimizers.SGD(0.5), **compile_args())
        expected = keras_model.fit(train, epochs=2, validation_data=test, verbose=0).history
        trainer = towers.TowerTrainer(two_heads_model(), optimizer=keras.optimizers.SGD(0.5),
                                      devices=DEVICES[:3], **compile_args())
        history = trainer.fit(train, epochs=2, validation_data=test, verbose=False).history
        for name, values in expected.items():
            self.assertAllClose(history[name], values, atol=TOLERANCE, msg=name)
        evaluated = trainer.evaluate(test)
        for name, value in keras_model.evaluate(test, return_dict=True, verbose=0).items():
            self.assertAllClose(evaluated[name], value, atol=TOLERANCE, msg=name)

    def test_class_weight_equals_keras_fit(self):
        batches = _batches(7, "sequence", steps=2)
        data = tf.data.Dataset.from_tensor_slices(
            (np.concatenate([b[0] for b in batches]), np.concatenate([b[1] for b in batches])))
        class_weight = {0: 0.5, 1: 2.0, 2: 1.5}
        keras_model = masked_model("attention", "sequence")
        keras_model.compile(optimizer=keras.optimizers.SGD(0.5), loss=_sce(),
                            metrics=["accuracy"])
        expected = keras_model.fit(data.batch(7), class_weight=class_weight, verbose=0).history
        for steps_per_execution in (1, 2):
            trainer = towers.TowerTrainer(masked_model("attention", "sequence"), _sce(),
                                          keras.optimizers.SGD(0.5), devices=DEVICES[:3],
                                          metrics=["accuracy"],
                                          steps_per_execution=steps_per_execution)
            history = trainer.fit(data.batch(7), class_weight=class_weight,
                                  verbose=False).history
            for name, values in expected.items():
                self.assertAllClose(history[name], values, atol=TOLERANCE, msg=name)
            for want, got in zip(keras_model.get_weights(), trainer.model.get_weights()):
                self.assertAllClose(want, got, atol=TOLERANCE)

    def test_class_weight_weighs_missing_classes_1_as_keras_fit_on_arrays(self):
        rng = np.random.default_rng(0)
        x = rng.normal(size=(16, 4)).astype("float32")
        y = np.arange(16) % CLASSES
        class_weight = {0: 0.5, 1: 3.0}  # class 2 not in it: Keras weighs it 1
        keras_model = _linear_model()
        keras_model.compile(optimizer=keras.optimizers.SGD(0.5), loss=_sce())
        expected = keras_model.fit(x, y, batch_size=8, shuffle=False, class_weight=class_weight,
                                   verbose=0).history
        for batches in ([(x[:8], y[:8]), (x[8:], y[8:])],  # a list of NumPy batches
                        tf.data.Dataset.from_tensor_slices((x, y)).batch(8)):
            trainer = towers.TowerTrainer(_linear_model(), _sce(), keras.optimizers.SGD(0.5),
                                          devices=DEVICES[:3])
            history = trainer.fit(batches, class_weight=class_weight, verbose=False).history
            self.assertAllClose(history["loss"], expected["loss"], atol=TOLERANCE)
            for want, got in zip(keras_model.get_weights(), trainer.model.get_weights()):
                self.assertAllClose(want, got, atol=TOLERANCE)

    def test_sample_weights_as_a_column_equal_keras(self):
        # (rows, 1) weights make Keras's (rows,) loss values a column, not a square.
        rng = np.random.default_rng(0)
        x = rng.normal(size=(8, 4)).astype("float32")
        y, weights = np.arange(8) % CLASSES, rng.uniform(0.5, 2.0, (8, 1)).astype("float32")
        keras_model = _linear_model()
        keras_model.compile(optimizer=keras.optimizers.SGD(0.5), loss=_sce())
        expected = keras_model.train_on_batch(x, y, sample_weight=weights)
        trainer = towers.TowerTrainer(_linear_model(), _sce(), keras.optimizers.SGD(0.5),
                                      devices=DEVICES[:3])
        self.assertAllClose(trainer.train_step((x, y, weights))["loss"], expected,
                            atol=TOLERANCE)
        for want, got in zip(keras_model.get_weights(), trainer.model.get_weights()):
            self.assertAllClose(want, got, atol=TOLERANCE)


    def test_an_optimizer_by_name_equals_keras_compile(self):
        rng = np.random.default_rng(0)
        batches = [(rng.normal(size=(7, 4)).astype("float32"), np.arange(7) % CLASSES)
                   for _ in range(3)]
        keras_model = _linear_model()
        keras_model.compile(optimizer="adam", loss=_sce())
        expected = [keras_model.train_on_batch(*batch) for batch in batches]
        trainer = towers.TowerTrainer(_linear_model(), _sce(), "adam", devices=DEVICES[:3])
        self.assertIsInstance(trainer.optimizer, keras.optimizers.Adam)
        for batch, want in zip(batches, expected):
            self.assertAllClose(trainer.train_step(batch)["loss"], want, atol=TOLERANCE)
        for want, got in zip(keras_model.get_weights(), trainer.model.get_weights()):
            self.assertAllClose(want, got, atol=TOLERANCE)


    def test_a_compiled_model_gives_its_loss_optimizer_and_metrics(self):
        rng = np.random.default_rng(0)
        x, y = rng.normal(size=(22, 4)).astype("float32"), np.arange(22) % CLASSES
        batches = [(x[i:i + 10], y[i:i + 10]) for i in range(0, 22, 10)]  # 10, 10, 2 rows

        def compiled():
            model = _linear_model()
            model.compile(optimizer=keras.optimizers.SGD(0.5), loss=_sce(),
                          metrics=["accuracy",
                                   keras.metrics.SparseTopKCategoricalAccuracy(k=2)],
                          loss_weights=0.5)
            return model

        keras_model = compiled()
        expected = keras_model.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0)
        trainer = towers.TowerTrainer(compiled(), devices=DEVICES[:3])
        history = trainer.fit(batches, epochs=2, verbose=0)
        self.assertEqual(sorted(history.history),
                         sorted([*expected.history, "examples_per_sec"]))
        for name, values in expected.history.items():
            self.assertAllClose(history.history[name], values, atol=TOLERANCE, msg=name)
        for want, got in zip(keras_model.get_weights(), trainer.model.get_weights()):
            self.assertAllClose(want, got, atol=TOLERANCE)


class RefusedFormsTest(tf.test.TestCase, parameterized.TestCase):
    """What compile refuses is refused in one line, before anything is applied."""

    @parameterized.named_parameters(
        ("unknown_loss_name", dict(loss="no_such_loss"), "not a Keras loss name"),
        ("loss_not_callable", dict(loss=3), "got int"),
        ("weights_not_numbers", dict(loss="mse", loss_weights={"cls": "big"}), "loss_weights"),
        ("metrics_a_string", dict(loss="mse", metrics="accuracy"), r"metrics=\['accuracy'\]"),
        ("unknown_metric", dict(loss="mse", metrics=["no_such_metric"]), "no_such_metric"),
        ("too_many_loss_weights", dict(loss=[_sce(), _sce()], loss_weights=[1.0, 2.0, 3.0]),
         r"^loss_weights holds 3 weight\(s\) but the loss 2 loss\(es\)"),
    )
    def test_bad_forms_refused_at_construction(self, arguments, message):
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        with self.assertRaisesRegex(ValueError, message):
            towers.TowerTrainer(model, optimizer=keras.optimizers.SGD(), devices=DEVICES[:2],
                                **arguments)

    @parameterized.named_parameters(
        ("loss_for_an_output_that_is_not_there", dict(loss={"tags": _sce(), "nope": _sce()})),
        ("metrics_for_an_output_that_is_not_there",
         dict(loss={"tags": _sce(), "cls": _sce()}, metrics={"nope": ["accuracy"]})),
    )
    def test_forms_that_do_not_fit_the_outputs_refused_at_the_first_step(self, arguments):
        trainer = towers.TowerTrainer(two_heads_model(), optimizer=keras.optimizers.SGD(),
                                      devices=DEVICES[:2], **arguments)
        before = [w.copy() for w in trainer.model.get_weights()]
        with self.assertRaises(ValueError) as refused:
            trainer.train_step(_batches(4, "both", steps=1)[0])
        self.assertNotIn("\n", str(refused.exception))
        for want, got in zip(before, trainer.model.get_weights()):
            self.assertAllEqual(want, got)

    def test_class_weight_refused_where_keras_refuses_it(self):
        trainer = towers.TowerTrainer(two_heads_model(), {"tags": _sce(), "cls": _sce()},
                                      keras.optimizers.SGD(), devices=DEVICES[:2])
        with self.assertRaisesRegex(ValueError, "single output"):
            trainer.fit(_batches(4, "both", steps=1), class_weight={0: 1.0}, verbose=False)
        trainer = towers.TowerTrainer(masked_model("lstm", "sequence"), _sce(),
                                      keras.optimizers.SGD(), devices=DEVICES[:2])
        with self.assertRaisesRegex(ValueError, "sample_weight"):
            trainer.fit(_batches(4, "sequence", steps=1, token_weights=True),
                        class_weight={0: 1.0}, verbose=False)
        self.assertEqual(trainer.step, 0)
