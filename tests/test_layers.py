"""Any batch on every layer: towers left empty by a small batch never run the model.

A batch of 2 on 3 towers leaves tower 2 without an example, and a shard of 1
split into 2 micro-batches leaves one empty. Some kernels mishandle 0 rows
(TensorFlow's oneDNN convolutions return the input's shape; conftest turns
oneDNN on), so an empty tower or micro-batch must skip the model. Each layer
family below trains on 3 towers with batches smaller than the towers and must
equal one device within 1e-5 (BatchNorm: the per-shard reference the docs
describe), then evaluate a batch of 2. (Batches that fill every tower run a
step of their own, without the skip, which every other test runs.)
"""

import itertools

import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import towers
from tests import reference

DEVICES = [f"/device:CPU:{i}" for i in range(4)]
FAMILY_DEVICES = DEVICES[:3]
TOLERANCE = 1e-5
BATCH_SIZES = (2, 1, 2)  # shards of 1, 1, 0 and 1, 0, 0

# name -> (input shape, input dtype, the layers between the input and Flatten -> logits)
FAMILIES = {
    "dense": ((6,), "float32", lambda: [keras.layers.Dense(4, activation="tanh")]),
    "conv1d": ((8, 2), "float32", lambda: [keras.layers.Conv1D(3, 3)]),
    "conv2d_valid": ((5, 5, 2), "float32", lambda: [keras.layers.Conv2D(3, 3)]),
    "conv2d_same": ((5, 5, 2), "float32", lambda: [keras.layers.Conv2D(3, 3, padding="same")]),
    "conv3d": ((4, 4, 4, 1), "float32", lambda: [keras.layers.Conv3D(2, 2)]),
    "separable_conv1d": ((8, 2), "float32", lambda: [keras.layers.SeparableConv1D(3, 3)]),
    "separable_conv2d": ((5, 5, 2), "float32", lambda: [keras.layers.SeparableConv2D(3, 3)]),
    "depthwise_conv2d": ((5, 5, 2), "float32", lambda: [keras.layers.DepthwiseConv2D(3)]),
    "conv1d_transpose": ((4, 2), "float32", lambda: [keras.layers.Conv1DTranspose(3, 3)]),
    "conv2d_transpose": ((3, 3, 2), "float32", lambda: [keras.layers.Conv2DTranspose(2, 2)]),
    "conv3d_transpose": ((2, 2, 2, 1), "float32", lambda: [keras.layers.Conv3DTranspose(2, 2)]),
    "lstm": ((4, 3), "float32", lambda: [keras.layers.LSTM(4, return_sequences=True)]),
    "gru": ((4, 3), "float32", lambda: [keras.layers.GRU(4)]),
    "bidirectional": ((4, 3), "float32",
                      lambda: [keras.layers.Bidirectional(keras.layers.LSTM(2))]),
    "attention": ((4, 6), "float32", None),  # self-attention: a functional model, below
    "layer_norm": ((6,), "float32", lambda: [keras.layers.Dense(4),
                                             keras.layers.LayerNormalization()]),
    "group_norm": ((4, 4), "float32", lambda: [keras.layers.GroupNormalization(2)]),
    "batch_norm": ((5, 5, 2), "float32", lambda: [keras.layers.Conv2D(3, 2),
                                                  keras.layers.BatchNormalization(momentum=0.8)]),
    "pooling": ((6, 6, 2), "float32", lambda: [keras.layers.MaxPooling2D(2),
                                               keras.layers.AveragePooling2D(2, padding="same")]),
    "global_pooling": ((6, 3), "float32", lambda: [keras.layers.Conv1D(4, 2),
                                                   keras.layers.GlobalMaxPooling1D()]),
    "embedding": ((5,), "int32", lambda: [keras.layers.Embedding(10, 4)]),
}


def _model(family, seed=0):
    shape, dtype, body = FAMILIES[family]
    keras.utils.set_random_seed(seed)
    inputs = keras.Input(shape, dtype=dtype)
    if body is None:
        features = keras.layers.MultiHeadAttention(num_heads=2, key_dim=3)(inputs, inputs)
    else:
        features = inputs
        for layer in body():
            features = layer(features)
    logits = keras.layers.Dense(reference.NUM_CLASSES)(keras.layers.Flatten()(features))
    return keras.Model(inputs, logits)


def _batches(family, sizes=BATCH_SIZES, seed=1):
    shape, dtype, _ = FAMILIES[family]
    rng = np.random.default_rng(seed)
    batches = []
    for size in sizes:
        x = (rng.integers(0, 10, (size, *shape)) if dtype == "int32"
             else rng.normal(size=(size, *shape))).astype(dtype)
        batches.append((x, rng.integers(0, reference.NUM_CLASSES, size),
                        rng.uniform(0.5, 2.0, size).astype("float32")))
    return batches


def _expected_weights(family, batches, num_towers=len(FAMILY_DEVICES)):
    model, optimizer = _model(family), reference.OPTIMIZERS["sgd"]()
    if family == "batch_norm":  # statistics per tower, averaged by shard size
        return reference.per_shard_weights(model, optimizer, reference.make_loss(), batches,
                                           num_towers), model
    return reference.single_device_weights(model, optimizer, reference.make_loss(),
                                           batches), model


def _assert_all_close(test, expected, actual):
    test.assertLen(actual, len(expected))
    for want, got in zip(expected, actual):
        test.assertAllClose(want, got, atol=TOLERANCE, rtol=TOLERANCE)


class EveryLayerFamilyTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.named_parameters((family, family) for family in FAMILIES)
    def test_batches_smaller_than_the_towers_equal_one_device(self, family):
        batches = _batches(family)
        expected, reference_model = _expected_weights(family, batches)
        model = _model(family)
        trainer = towers.TowerTrainer(model, reference.make_loss(),
                                      reference.OPTIMIZERS["sgd"](), devices=FAMILY_DEVICES)
        for batch in batches:
            trainer.train_step(batch)
        _assert_all_close(self, expected, [v.numpy() for v in model.weights])

        x, y, w = _batches(family, sizes=(2,), seed=2)[0]  # tower 2 empty
        want = (reference.make_loss()(y, reference_model(x, training=False), sample_weight=w)
                + (tf.add_n(reference_model.losses) if reference_model.losses else 0.0))
        self.assertAllClose(want, trainer.evaluate((x, y, w))["loss"], atol=TOLERANCE)


def _conv_trainer(devices, cut=False, **options):
    """The conv1d family's model on `devices`; cut: into 2 stages after the convolution."""
    model = _model("conv1d")
    if cut:
        options["pipeline_cuts"] = [model.layers[1].name]
    return towers.TowerTrainer(model, reference.make_loss(), reference.OPTIMIZERS["sgd"](),
                               devices=devices, **options)


def _evaluation_loss(model, batch):
    x, y, w = batch
    return reference.make_loss()(y, model(x, training=False), sample_weight=w)


class EmptyPartsOfEveryFeatureTest(tf.test.TestCase, parameterized.TestCase):
    """The same skip under every feature that splits a batch further or runs it elsewhere."""

    @parameterized.named_parameters(
        # shards of 5: 2, 1, 1, 1 -> micro-batches 1, 1 / 1, 0 / ...; of 3: tower 3 empty
        ("accumulation", DEVICES, {"accum_steps": 2}),
        ("xla", DEVICES, {"jit_compile": True}),
        ("pipeline_2x2_gpipe", [DEVICES[:2], DEVICES[2:]], {"cut": True, "micro_batches": 2}),
        ("pipeline_2x2_1f1b_xla", [DEVICES[:2], DEVICES[2:]],
         {"cut": True, "micro_batches": 3, "pipeline_schedule": "1f1b", "jit_compile": True}),
    )
    def test_train_step_and_evaluate(self, devices, options):
        batches = _batches("conv1d", sizes=(5, 3, 1, 2))
        expected, reference_model = _expected_weights("conv1d", batches)
        trainer = _conv_trainer(devices, **options)
        for batch in batches:
            trainer.train_step(batch)
        _assert_all_close(self, expected, [v.numpy() for v in trainer.model.weights])
        batch = _batches("conv1d", sizes=(1,), seed=2)[0]
        self.assertAllClose(_evaluation_loss(reference_model, batch),
                            trainer.evaluate(batch)["loss"], atol=TOLERANCE)

    @parameterized.named_parameters(
        (f"{spe}_steps_per_call_{'staged' if staged else 'split_in_step'}", spe, staged)
        for spe, staged in itertools.product((1, 3), (False, True)))
    def test_fit(self, steps_per_execution, staged):
        # 7 examples in batches of 3: 3, 3, 1 per epoch, two epochs.
        (x, y, w), = _batches("conv1d", sizes=(7,))
        expected, _ = _expected_weights(
            "conv1d", [(x[i:i + 3], y[i:i + 3], w[i:i + 3]) for i in (0, 3, 6)] * 2)
        trainer = _conv_trainer(DEVICES, steps_per_execution=steps_per_execution,
                                prefetch_to_devices=staged)
        trainer.fit(tf.data.Dataset.from_tensor_slices((x, y, w)).batch(3), epochs=2,
                    verbose=False)
        self.assertEqual(trainer.step, 6)
        _assert_all_close(self, expected, [v.numpy() for v in trainer.model.weights])

    def test_evaluate_counts_the_regularisation_when_the_last_tower_is_empty(self):
        model = reference.make_model()  # L2 on its hidden layer
        x, y, w = reference.make_batches(2, num_steps=1)[0]
        want = (reference.make_loss()(y, model(x, training=False), sample_weight=w)
                + tf.add_n(model.losses))
        trainer = towers.TowerTrainer(model, reference.make_loss(),
                                      reference.OPTIMIZERS["sgd"](), devices=DEVICES)
        self.assertAllClose(want, trainer.evaluate((x, y, w))["loss"], atol=1e-6)

    @parameterized.named_parameters(("in_a_tf_function", True), ("eagerly", False))
    def test_tower_gradients_with_a_fixed_batch_shape(self, compiled):
        # A batch of 2 with a static shape: towers 2 and 3 are known empty when traced.
        (x, y, w), = _batches("conv1d", sizes=(2,))
        model, loss = _model("conv1d"), reference.make_loss()
        with tf.GradientTape() as tape:
            value = loss(y, model(x, training=True), sample_weight=w)
        expected = tape.gradient(value, model.trainable_variables)

        def research_step(batch):
            return towers.tower_gradients(model, loss, batch, DEVICES)

        grads, logs = (tf.function(research_step) if compiled else research_step)((x, y, w))
        self.assertAllClose(value, logs["loss"], atol=TOLERANCE)
        _assert_all_close(self, expected, grads)


if __name__ == "__main__":
    tf.test.main()
