"""Every reduction a keras.losses.Loss takes, against Keras itself on one device.

Beside the means (test_compile): reduction="sum", a *sum term* (no denominator: each
shard's share is its sum, whole; a mask only zeroes the masked entries), and
reduction=None / "none", whose values compile adds up entry by entry, logging their
mean and differentiating their sum. Each test trains the same model with
`model.compile(...)` + `train_on_batch` (or `fit`) on one device and with TowerTrainer on 1
and 3 towers, uneven batches and one smaller than the towers, micro-batches, pipeline
stages and XLA towers, and compares the logs by name and value and the weights.
"""

import functools

import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import towers
from tests import reference
from towers import errors

DEVICES = [f"/device:CPU:{i}" for i in range(4)]
TOLERANCE = 1e-5
FEATURES, CLASSES, VOCABULARY, TOKENS, TAGS = 4, 3, 12, 5, 4
SIZES = (7, 2, 7)  # uneven over 3 towers, then fewer rows than towers


def _sce(reduction="sum_over_batch_size"):
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)


def _mlp(l2=0.01):
    """Features -> CLASSES logits, its hidden layer L2-regularised (l2=0: not)."""
    keras.utils.set_random_seed(0)
    regularizer = keras.regularizers.L2(l2) if l2 else None
    return keras.Sequential([keras.Input((FEATURES,)),
                             keras.layers.Dense(5, activation="tanh", name="hidden",
                                                kernel_regularizer=regularizer),
                             keras.layers.Dense(CLASSES, name="logits")])


def _tagger(heads=("tags",), recurrent=False):
    """Padded token ids -> per-token tags (the output carries the mask) and, with "cls"
    in `heads`, a class per sequence (the mask consumed by the pooling). The encoder is
    a GRU where `recurrent`, else a Dense layer per token (cheaper to trace)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((TOKENS,), dtype="int32")
    h = keras.layers.Embedding(VOCABULARY, 6, mask_zero=True, name="embedding")(inputs)
    h = (keras.layers.GRU(6, return_sequences=True, unroll=True, name="encoder") if recurrent
         else keras.layers.Dense(6, activation="tanh", name="encoder"))(h)
    outputs = {"tags": keras.layers.TimeDistributed(keras.layers.Dense(TAGS), name="tags")(h)}
    if "cls" in heads:
        pooled = keras.layers.GlobalAveragePooling1D(name="pool")(h)
        outputs["cls"] = keras.layers.Dense(CLASSES, name="cls")(pooled)
    return keras.Model(inputs, outputs if len(heads) > 1 else outputs["tags"])


def _rows(sizes=SIZES, seed=1):
    """(x, y, sample_weight) per size: features, classes, weights."""
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(n, FEATURES)).astype("float32"), rng.integers(0, CLASSES, n),
             rng.uniform(0.5, 2.0, n).astype("float32")) for n in sizes]


def _sequences(sizes=SIZES, heads=("tags",), token_weights=False, seed=1):
    """(x, y[, weights]) per size: rows padded with 0 after 1..TOKENS tokens, a tag per
    token (and a class per row, with "cls" in heads), weights per token."""
    rng = np.random.default_rng(seed)
    batches = []
    for n in sizes:
        x = rng.integers(1, VOCABULARY, (n, TOKENS))
        x[np.arange(TOKENS)[None] >= rng.integers(1, TOKENS + 1, n)[:, None]] = 0
        tags, classes = rng.integers(0, TAGS, (n, TOKENS)), rng.integers(0, CLASSES, n)
        batch = (x.astype("int32"), {"tags": tags, "cls": classes} if len(heads) > 1 else tags)
        if token_weights:
            batch += (rng.uniform(0.5, 2.0, (n, TOKENS)).astype("float32"),)
        batches.append(batch)
    return batches


_keras_logs = functools.partial(reference.keras_step_logs, learning_rate=0.05)


def _devices(num_towers, options):
    if "pipeline_cuts" in options:  # a grid: a row of 2 stages per tower
        return [DEVICES[2 * i:2 * i + 2] for i in range(num_towers)]
    return DEVICES[:num_towers]


class ReductionsTest(reference.SameTraining, tf.test.TestCase,
                     parameterized.TestCase):

    @parameterized.named_parameters(
        ("sum_one_tower", "sum", 1),
        ("sum_three_towers", "sum", 3),
        # Keras's train_step cannot add the L2 terms to unreduced values: no regulariser.
        ("none_one_tower", None, 1),
        ("none_string_three_towers", "none", 3),
        # One XLA computation per tower, its sum term's share as outside.
        ("sum_xla", "sum", 3, {"jit_compile": True}),
    )
    def test_one_output_with_sample_weights_equals_keras(self, reduction, num_towers,
                                                         options=None):
        batches, l2 = _rows(), 0.0 if reduction in (None, "none") else 0.01
        keras_model = _mlp(l2)
        keras_logs = _keras_logs(keras_model, batches, loss=_sce(reduction),
                                 metrics=["accuracy"])
        trainer = towers.TowerTrainer(_mlp(l2), _sce(reduction), keras.optimizers.SGD(0.05),
                                      devices=DEVICES[:num_towers], metrics=["accuracy"],
                                      **(options or {}))
        self.assert_same_training(keras_model, keras_logs, trainer, batches)

    def test_split_logits_with_a_sum_equal_keras(self):
        # The logits split by columns over 2 parts: the loss's values from the parts
        # (Megatron's vocab-parallel cross-entropy), summed over the rows.
        batches = _rows()
        keras_model = _mlp()
        keras_logs = _keras_logs(keras_model, batches, loss=_sce("sum"))
        parted = towers.split_layers(_mlp(), {"logits": "column"}, DEVICES[:2])
        trainer = towers.TowerTrainer(parted, _sce("sum"), keras.optimizers.SGD(0.05),
                                      devices=[DEVICES[:2], DEVICES[2:]])
        self.assert_same_training(keras_model, keras_logs, trainer, batches, towers.join_layers)

    @parameterized.named_parameters(
        ("sum_gru_three_towers", "sum", 3, {}, True),
        ("sum_pipeline", "sum", 2, {"pipeline_cuts": ["embedding"], "micro_batches": 2}),
        ("none_three_towers_micro_batches", None, 3, {"accum_steps": 2}),
    )
    def test_masked_tokens_with_token_weights_equal_keras(self, reduction, num_towers, options,
                                                          recurrent=False):
        # A mask only zeroes its entries: neither reduction divides by the unmasked ones.
        batches = _sequences(token_weights=True)
        keras_model = _tagger(recurrent=recurrent)
        keras_logs = _keras_logs(keras_model, batches, loss=_sce(reduction))
        trainer = towers.TowerTrainer(_tagger(recurrent=recurrent), _sce(reduction),
                                      keras.optimizers.SGD(0.05),
                                      devices=_devices(num_towers, options), **options)
        self.assert_same_training(keras_model, keras_logs, trainer, batches)

    @parameterized.named_parameters(
        # A counted (masked) mean beside a sum term: the counts come first (GPipe) ...
        ("mean_tags_sum_cls_pipeline_gpipe", "sum_over_batch_size", "sum", 2,
         {"pipeline_cuts": ["encoder"], "micro_batches": 2}),
        # ... or each counted term is differentiated on its own and folded in (1F1B).
        ("mean_tags_sum_cls_pipeline_1f1b", "sum_over_batch_size", "sum", 2,
         {"pipeline_cuts": ["encoder"], "micro_batches": 3, "pipeline_schedule": "1f1b"}),
        ("sum_tags_mean_cls_one_tower", "sum", "sum_over_batch_size", 1, {}),
        ("sum_tags_mean_cls_three_towers", "sum", "sum_over_batch_size", 3, {}),
        # Keras adds the mean over every entry of the unreduced tags: its gradient is the
        # tags' sum plus the mean times the tags' entries.
        ("none_tags_mean_cls_three_towers", None, "sum_over_batch_size", 3, {}),
    )
    def test_two_outputs_with_loss_weights_equal_keras(self, tags, cls, num_towers, options):
        batches = _sequences(heads=("tags", "cls"))
        compile_args = dict(loss={"tags": _sce(tags), "cls": _sce(cls)},
                            loss_weights={"tags": 0.5, "cls": 2.0},
                            metrics={"cls": ["accuracy"]})
        keras_model = _tagger(("tags", "cls"))
        keras_logs = _keras_logs(keras_model, batches, **compile_args)
        self.assertEqual(sorted(keras_logs[0]), ["cls_accuracy", "cls_loss", "loss", "tags_loss"])
        trainer = towers.TowerTrainer(_tagger(("tags", "cls")),
                                      optimizer=keras.optimizers.SGD(0.05),
                                      devices=_devices(num_towers, options), **compile_args,
                                      **options)
        self.assert_same_training(keras_model, keras_logs, trainer, batches)

    @parameterized.named_parameters(
        ("sum_beside_a_mean", ("tags", "cls"), {"tags": "sum", "cls": "sum_over_batch_size"}),
        ("none", ("tags",), None),
    )
    def test_fit_and_evaluate_logs_equal_keras(self, heads, reductions):
        # Keras's trackers weigh each batch's loss (a sum for a sum term) by its rows.
        (x, y), = _sequences(sizes=(20,), heads=heads)
        data = tf.data.Dataset.from_tensor_slices((x, y))
        train, test = data.take(14).batch(5), data.skip(14).batch(4)  # 5, 5, 4 and 4, 2
        loss = (_sce(reductions) if not isinstance(reductions, dict) else
                {name: _sce(reduction) for name, reduction in reductions.items()})
        keras_model = _tagger(heads)
        keras_model.compile(optimizer=keras.optimizers.SGD(0.05), loss=loss)
        expected = keras_model.fit(train, epochs=2, validation_data=test, verbose=0).history
        trainer = towers.TowerTrainer(_tagger(heads), loss, keras.optimizers.SGD(0.05),
                                      devices=DEVICES[:3])
        history = trainer.fit(train, epochs=2, validation_data=test, verbose=False).history
        for name, values in expected.items():
            self.assertAllClose(history[name], values, atol=TOLERANCE, msg=name)
        for want, got in zip(keras_model.get_weights(), trainer.model.get_weights()):
            self.assertAllClose(want, got, atol=TOLERANCE)
        evaluated = trainer.evaluate(test)
        for name, value in keras_model.evaluate(test, return_dict=True, verbose=0).items():
            self.assertAllClose(evaluated[name], value, atol=TOLERANCE, msg=name)

    def test_tower_gradients_of_a_sum_equal_keras(self):
        (x, y, w), = _rows(sizes=(7,))
        model, loss = _mlp(), _sce("sum")
        with tf.GradientTape() as tape:
            value = loss(y, model(x, training=True), sample_weight=w) + tf.add_n(model.losses)
        expected = tape.gradient(value, model.trainable_variables)
        grads, logs = tf.function(lambda batch: towers.tower_gradients(
            model, loss, batch, DEVICES[:3]))((x, y, w))
        self.assertAllClose(logs["loss"], value, atol=TOLERANCE)
        for want, got in zip(expected, grads):
            self.assertAllClose(want, got, atol=TOLERANCE)


class RefusedTest(tf.test.TestCase):
    """Where Keras's compile itself fails on an unreduced loss: one line, nothing applied."""

    def assert_refused(self, make_model, loss, batch, error, message):
        keras_model = make_model()
        keras_model.compile(optimizer=keras.optimizers.SGD(0.05), loss=loss)
        with self.assertRaises(Exception):  # Keras's own failure, in several lines
            keras_model.train_on_batch(*batch)
        trainer = towers.TowerTrainer(make_model(), loss, keras.optimizers.SGD(0.05),
                                      devices=DEVICES[:3])
        before = trainer.model.get_weights()
        with self.assertRaisesRegex(error, message) as refused:
            trainer.train_step(batch)
        self.assertNotIn("\n", str(refused.exception))
        for want, got in zip(before, trainer.model.get_weights()):
            self.assertAllEqual(want, got)
        self.assertEqual(trainer.step, 0)

    def test_an_unreduced_loss_beside_a_regularizer(self):
        self.assert_refused(_mlp, _sce(None), _rows(sizes=(7,))[0], ValueError,
                            r"reduction=None and the model adds losses of its own \(its "
                            "weights have regularizers\\)")

    def test_unreduced_losses_of_different_shapes(self):
        self.assert_refused(
            lambda: _tagger(("tags", "cls")), {"tags": _sce(None), "cls": _sce(None)},
            _sequences(sizes=(7,), heads=("tags", "cls"))[0], errors.LossMismatch,
            r"shapes \(None, 5\) and \(None,\); Keras's compile adds unreduced losses entry")
