"""BatchNormalization over the global batch (batch_statistics="global", synchronized=True)
against Keras's compile + train_on_batch on one device.

Per tower, BatchNorm normalises a shard by the shard's statistics, which one device never
does; with global statistics every tower normalises by the whole batch's, forward and
backward, and the moving statistics follow: the weights after a few steps are one
device's. Uneven shards, empty ones, every aggregation route, placements, pipeline stages,
recompute and split layers are compared; what cannot meet is refused in one line.
"""

import keras
import numpy as np
import tensorflow as tf
from absl import logging
from absl.testing import parameterized

import towers
from towers.cli import models

DEVICES = [f"/device:CPU:{i}" for i in range(4)]
TOLERANCE = 1e-5
CLASSES = 3


def conv_model(synchronized=False):
    """Conv -> BatchNorm -> relu -> Dense -> BatchNorm -> logits; no bias before a BatchNorm
    (its gradient is 0 up to round-off, which Adam would magnify)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6, 6, 2))
    h = keras.layers.Conv2D(4, 3, use_bias=False, name="conv")(inputs)
    h = keras.layers.BatchNormalization(synchronized=synchronized, name="bn_conv")(h)
    h = keras.layers.Activation("relu", name="relu")(h)
    h = keras.layers.Flatten(name="flatten")(h)
    h = keras.layers.Dense(8, use_bias=False, name="dense")(h)
    h = keras.layers.BatchNormalization(synchronized=synchronized, name="bn_dense")(h)
    return keras.Model(inputs, keras.layers.Dense(CLASSES, name="logits")(h))


def masked_model():
    """Token ids -> Embedding(mask_zero) -> BatchNorm over the unmasked tokens -> pooled."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,), dtype="int32")
    h = keras.layers.Embedding(12, 4, mask_zero=True, name="embedding")(inputs)
    h = keras.layers.BatchNormalization(name="bn_tokens")(h)
    h = keras.layers.GlobalAveragePooling1D(name="pool")(h)
    return keras.Model(inputs, keras.layers.Dense(CLASSES, name="logits")(h))


def images(rows, shape=(6, 6, 2), seed=1):
    """Images far from mean 0 (a variance taken in one pass would lose digits), labels."""
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(rows, *shape)) * 2 + 3).astype("float32")
    return x, rng.integers(0, CLASSES, rows)


def _sce():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


_OPTIMIZERS = {"sgd": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
               "adam": lambda: keras.optimizers.Adam(1e-3),
               # Where statistics are ill-conditioned (MobileNetV3Small's 34 BatchNorms, a
               # batch of 3 rows) a rate of 0.1 magnifies float32 round-off past 1e-5 in a
               # few steps, one tower's too (MobileNet: 3.8e-6 from Keras, 3 rows: 1.4e-5).
               "sgd_gentle": lambda: keras.optimizers.SGD(0.01, momentum=0.9)}
_keras_weights = {}


def keras_weights(build, batch, optimizer, steps=3):
    """The weights (moving statistics too) after `steps` of Keras's train_on_batch."""
    key = (build, batch[0].shape, optimizer, steps)
    if key not in _keras_weights:
        model = build()
        model.compile(_OPTIMIZERS[optimizer](), _sce())
        for _ in range(steps):
            model.train_on_batch(*batch)
        _keras_weights[key] = model.get_weights()
    return _keras_weights[key]


def assert_weights_close(test, expected, actual, tolerance=TOLERANCE):
    test.assertEqual(len(expected), len(actual))
    for e, a in zip(expected, actual):
        np.testing.assert_allclose(a, e, atol=tolerance, rtol=0)


class GlobalStatisticsTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.named_parameters(
        ("3_towers_uneven", 7, {}),
        # 3 rows on 4 towers: one shard empty (2 rows would do on 3 towers, but a BatchNorm
        # of 2 rows magnifies float32 round-off to 1e-4 in 3 steps; exact in float64).
        ("4_towers_one_empty", 3, {"num_towers": 4}),
        ("synchronized_layers", 7, {"synchronized": True, "batch_statistics": "per_tower"}),
        ("collective", 7, {"aggregation": "collective"}),
        ("replicated", 3, {"variable_placement": "replicated", "num_towers": 4}),
        ("spread", 7, {"variable_placement": "spread"}),
        ("recompute_stages", 7, {"recompute": "stages"}),
        ("recompute_named", 3, {"recompute": ["bn_dense"], "num_towers": 4}),
    )
    def test_towers_equal_keras(self, rows, options):
        options = dict(options)
        devices = DEVICES[:options.pop("num_towers", 3)]
        synchronized = options.pop("synchronized", False)
        batch = images(rows)
        for optimizer in ("sgd", "adam"):
            model = conv_model(synchronized)
            trainer = towers.TowerTrainer(model, _sce(), _OPTIMIZERS[optimizer](),
                                          devices=devices,
                                          **{"batch_statistics": "global", **options})
            for _ in range(3):
                trainer.train_step(batch)
            assert_weights_close(self, keras_weights(conv_model, batch, optimizer),
                                 model.get_weights())

    def test_per_tower_differs(self):
        """Without global statistics the towers normalise their shards: not one device's
        numbers (what batch_statistics="global" is for)."""
        batch = images(7)
        model = conv_model()
        trainer = towers.TowerTrainer(model, _sce(), _OPTIMIZERS["sgd"](), devices=DEVICES[:3])
        for _ in range(3):
            trainer.train_step(batch)
        difference = max(np.abs(e - a).max() for e, a in zip(
            keras_weights(conv_model, batch, "sgd"), model.get_weights()))
        self.assertGreater(difference, 1e-2)

    def test_pipeline_stages_and_split_layers(self):
        """2 towers x 2 pipeline stages (one micro-batch), and 2 towers x 2 parts of a
        column-split Dense: each BatchNorm meets the same stage's or part's devices."""
        batch = images(5)
        expected = keras_weights(conv_model, batch, "sgd")
        model = conv_model()
        trainer = towers.TowerTrainer(model, _sce(), _OPTIMIZERS["sgd"](),
                                      devices=[DEVICES[:2], DEVICES[2:]], pipeline_cuts=["relu"],
                                      batch_statistics="global")
        for _ in range(3):
            trainer.train_step(batch)
        assert_weights_close(self, expected, model.get_weights())
        parted = towers.split_layers(conv_model(), {"dense": "column"}, DEVICES[:2])
        trainer = towers.TowerTrainer(parted, _sce(), _OPTIMIZERS["sgd"](),
                                      devices=[DEVICES[:2], DEVICES[2:]],
                                      batch_statistics="global")
        for _ in range(3):
            trainer.train_step(batch)
        assert_weights_close(self, expected, towers.join_layers(parted).get_weights())

    def test_fit_with_steps_per_execution_and_staged_shards(self):
        """fit's in-graph loop of 2 steps per call, the shards staged on their towers by
        the input pipeline: the global moments are met inside the loop's body."""
        x, y = images(14)
        expected = conv_model()
        expected.compile(_OPTIMIZERS["sgd"](), _sce())
        expected.fit(x, y, batch_size=7, shuffle=False, verbose=0)
        model = conv_model()
        trainer = towers.TowerTrainer(model, _sce(), _OPTIMIZERS["sgd"](), devices=DEVICES[:3],
                                      batch_statistics="global", steps_per_execution=2,
                                      prefetch_to_devices=True)
        trainer.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(7), verbose=0)
        assert_weights_close(self, expected.get_weights(), model.get_weights())

    def test_masked_inputs(self):
        """A BatchNorm fed a Keras mask takes its statistics over the unmasked tokens of the
        whole batch, as Keras's masked moments do."""
        rng = np.random.default_rng(2)
        x = rng.integers(1, 12, (7, 5)).astype("int32")
        x[np.arange(5)[None] >= rng.integers(1, 6, 7)[:, None]] = 0
        batch = (x, rng.integers(0, CLASSES, 7))
        model = masked_model()
        trainer = towers.TowerTrainer(model, _sce(), _OPTIMIZERS["sgd"](), devices=DEVICES[:3],
                                      batch_statistics="global")
        for _ in range(3):
            trainer.train_step(batch)
        assert_weights_close(self, keras_weights(masked_model, batch, "sgd"), model.get_weights())

    def test_tower_gradients_synchronized(self):
        """towers.tower_gradients in your own tf.function: a synchronized=True layer's
        statistics are the whole batch's, as a one-device GradientTape's."""
        x, y = images(7)
        reference, model = conv_model(True), conv_model(True)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(_sce()(y, reference(x, training=True)))
        expected = tape.gradient(loss, reference.trainable_variables)

        @tf.function
        def gradients(x, y):
            return towers.tower_gradients(model, _sce(), (x, y), DEVICES[:3])

        grads, logs = gradients(tf.constant(x), tf.constant(y))
        self.assertAllClose(float(loss), float(logs["loss"]), atol=TOLERANCE)
        for e, g in zip(expected, grads):
            self.assertAllClose(e, g, atol=TOLERANCE)
        for e, a in zip(reference.non_trainable_variables, model.non_trainable_variables):
            self.assertAllClose(e, a, atol=TOLERANCE)  # the moving statistics

    def test_tower_gradients_refuses_accumulation_in_one_line(self):
        model = conv_model(True)
        with self.assertRaisesRegex(ValueError, "^global batch statistics .*micro_batches=2"):
            towers.tower_gradients(model, _sce(), images(4), DEVICES[:2], accum_steps=2)

    @parameterized.named_parameters(
        ("micro_batches", {"micro_batches": 2}, "micro_batches=2"),
        ("jit_compile", {"jit_compile": True}, "jit_compile=True"),
        ("shared_device", {"devices": [DEVICES[0], DEVICES[0]]}, "share the device"),
    )
    def test_refused_in_one_line(self, options, says):
        model = conv_model()
        before = model.get_weights()
        with self.assertRaisesRegex(ValueError, says) as raised:
            trainer = towers.TowerTrainer(
                model, _sce(), _OPTIMIZERS["sgd"](),
                **{"devices": DEVICES[:2], "batch_statistics": "global", **options})
            trainer.train_step(images(4))
        message = str(raised.exception)
        self.assertNotIn("\n", message)
        self.assertIn("bn_conv", message)
        self.assertIn("batch_statistics='per_tower'", message)
        assert_weights_close(self, before, model.get_weights(), 0)

    def test_single_row_warns_once(self):
        """Per-tower statistics over one row make the layer output beta: one warning
        naming the layer and the option, once."""
        trainer = towers.TowerTrainer(conv_model(), _sce(), _OPTIMIZERS["sgd"](),
                                      devices=DEVICES[:3])
        with self.assertLogs(logging.get_absl_logger(), "WARNING") as logs:
            trainer.train_step(images(4))  # shards of 2, 1 and 1 rows
            trainer.train_step(images(5))  # 2, 2, 1
        warnings = [record.getMessage() for record in logs.records
                    if "single row" in record.getMessage()]
        self.assertLen(warnings, 1)
        self.assertIn("bn_conv", warnings[0])
        self.assertIn("batch_statistics='global'", warnings[0])


def simclr_encoder(synchronized=True):
    """SimCLR's encoder and projection head in miniature: BatchNorm between them."""
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((6,)), keras.layers.Dense(8, use_bias=False),
        keras.layers.BatchNormalization(synchronized=synchronized, name="bn_encoder"),
        keras.layers.Activation("relu"), keras.layers.Dense(4)])


def nt_xent(embeddings, temperature=0.5):
    """SimCLR's NT-Xent: each view's positive is the other view of its row, the negatives
    every other row of the whole batch (both views)."""
    a, b = (tf.math.l2_normalize(e, -1) for e in embeddings)
    both = tf.concat([a, b], 0)                                       # (2B, D)
    rows = tf.shape(a)[0]
    logits = tf.matmul(both, both, transpose_b=True) / temperature    # (2B, 2B)
    logits -= 1e9 * tf.eye(2 * rows)                                  # not itself
    positives = tf.concat([tf.range(rows) + rows, tf.range(rows)], 0)
    return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
        positives, logits, from_logits=True))


class TowerStepTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.named_parameters(
        ("through_tower", 7, 3, True), ("called_directly", 7, 3, False),
        ("through_tower_one_shard_empty", 3, 4, True),
        ("called_directly_one_shard_empty", 3, 4, False))
    def test_simclr_synchronized_encoder(self, rows, num_towers, through_tower):
        """NT-Xent over the global batch (batch_losses) with a synchronized=True encoder,
        run through tower(...) (a shard of no rows skips it) or called directly (every
        tower meets, one with no rows too), 3 SGD steps, against one device's
        GradientTape loop: the weights and the moving statistics."""
        rng = np.random.default_rng(3)
        x = rng.normal(size=(rows, 6)).astype("float32") + 2
        views = (tf.constant(x), tf.constant(x + rng.normal(0, 0.3, x.shape).astype("float32")))
        reference, encoder = simclr_encoder(), simclr_encoder()
        reference_optimizer, optimizer = _OPTIMIZERS["sgd_gentle"](), _OPTIMIZERS["sgd_gentle"]()

        @tf.function
        def reference_step(a, b):
            with tf.GradientTape() as tape:
                loss = nt_xent((reference(a, training=True), reference(b, training=True)))
            variables = reference.trainable_variables
            reference_optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
            return loss

        @tf.function
        def tower_step(a, b):
            call = (lambda tower, view: tower(encoder, view, training=True)) if through_tower \
                else (lambda tower, view: encoder(view, training=True))
            out = towers.tower_step(
                lambda tower, s: ({}, (call(tower, s[0]), call(tower, s[1]))),
                (a, b), DEVICES[:num_towers], {"nt_xent": encoder.trainable_variables},
                batch_losses={"nt_xent": nt_xent})
            optimizer.apply_gradients(zip(out.grads["nt_xent"], encoder.trainable_variables))
            return out.losses["nt_xent"]

        for _ in range(3):
            self.assertAllClose(float(reference_step(*views)), float(tower_step(*views)),
                                atol=TOLERANCE)
        assert_weights_close(self, reference.get_weights(), encoder.get_weights())


class ApplicationsTest(tf.test.TestCase):
    """Models users bring, with batch_statistics="global" on uneven towers against Keras."""

    def _compare(self, build, batch, steps=2, num_towers=3):
        model = build()
        trainer = towers.TowerTrainer(model, _sce(), _OPTIMIZERS["sgd_gentle"](),
                                      devices=DEVICES[:num_towers], batch_statistics="global")
        for _ in range(steps):
            trainer.train_step(batch)
        assert_weights_close(self, keras_weights(build, batch, "sgd_gentle", steps),
                             model.get_weights())

    def test_mobilenet_v3_small(self):
        # 2 towers (4 rows and 3): each tower's trace of its 50-odd BatchNorms is most
        # of this test's time.
        self._compare(_mobilenet, images(7, (32, 32, 3)), num_towers=2)

    def test_command_line_models(self):
        """The command line's resnet (BatchNorm in every block) and cnn (none)."""
        for name in ("resnet", "cnn"):
            self._compare(lambda: models.build_model(name, (8, 8, 1), CLASSES, seed=0),
                          images(7, (8, 8, 1)))


def _mobilenet():
    keras.utils.set_random_seed(0)
    return keras.applications.MobileNetV3Small(
        input_shape=(32, 32, 3), weights=None, classes=CLASSES, include_preprocessing=False,
        dropout_rate=0.0,  # dropout masks are drawn per tower: not one device's
        classifier_activation=None)
