"""The --model zoo: shapes, parameter counts, one gradient step, seeds and errors; and
the other forms --model takes (towers.model_spec)."""

import itertools
import json
import os
import sys
import tempfile
from unittest import mock

import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import towers
from towers.cli import model_spec, models

DIGITS, CIFAR = (8, 8, 1), (32, 32, 3)
NUM_CLASSES = 10
BATCH_SIZE = 4

# Every weight, trainable or not, for 10 classes; the arithmetic is the architecture.
EXPECTED_PARAMS = {
    # Flatten -> 128 -> 64 -> 10.
    ("mlp", DIGITS): (64 * 128 + 128) + (128 * 64 + 64) + (64 * 10 + 10),              # 17,226
    ("mlp", CIFAR): (3072 * 128 + 128) + (128 * 64 + 64) + (64 * 10 + 10),             # 402,250
    # conv 3x3x32, pool, conv 3x3x64, pool, flatten (H/4 * W/4 * 64) -> 128 -> 10.
    ("cnn", DIGITS): (9 * 1 * 32 + 32) + (9 * 32 * 64 + 64) + (2 * 2 * 64 * 128 + 128)
                     + (128 * 10 + 10),                                                # 53,002
    ("cnn", CIFAR): (9 * 3 * 32 + 32) + (9 * 32 * 64 + 64) + (8 * 8 * 64 * 128 + 128)
                    + (128 * 10 + 10),                                                 # 545,098
    # stem conv (no bias) + BN (4 numbers per channel); blocks 16, 32, 64, the last
    # two with a 1x1 projection + BN; logits 64 -> 10. Independent of H and W.
    ("resnet", DIGITS): (9 * 1 * 16 + 4 * 16) + 2 * (9 * 16 * 16 + 4 * 16)
                        + (9 * 16 * 32 + 9 * 32 * 32 + 16 * 32 + 3 * 4 * 32)
                        + (9 * 32 * 64 + 9 * 64 * 64 + 32 * 64 + 3 * 4 * 64)
                        + (64 * 10 + 10),                                              # 78,426
    ("resnet", CIFAR): (9 * 3 * 16 + 4 * 16) + 2 * (9 * 16 * 16 + 4 * 16)
                       + (9 * 16 * 32 + 9 * 32 * 32 + 16 * 32 + 3 * 4 * 32)
                       + (9 * 32 * 64 + 9 * 64 * 64 + 32 * 64 + 3 * 4 * 64)
                       + (64 * 10 + 10),                                               # 78,714
    # Embedding (H*W*C*16 tokens) x 32 -> 10.
    ("text", DIGITS): 64 * 16 * 32 + (32 * 10 + 10),                                   # 33,098
    ("text", CIFAR): 3072 * 16 * 32 + (32 * 10 + 10),                                  # 1,573,194
}
# Moving mean + variance of the 9 BatchNormalization layers: stem 16, block1 2x16,
# block2 3x32, block3 3x64 channels.
RESNET_BN_LAYERS = 9
RESNET_NON_TRAINABLE = 2 * (16 + 2 * 16 + 3 * 32 + 3 * 64)                             # 672

SHAPES = {"digits": DIGITS, "cifar": CIFAR}
MODEL_AND_SHAPE = [
    (f"{name}_{shape_name}", name, shape)
    for name, (shape_name, shape) in itertools.product(models.MODELS, SHAPES.items())]


def _batch(input_shape, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.uniform(size=(BATCH_SIZE, *input_shape)).astype("float32")
    y = np.arange(BATCH_SIZE) % NUM_CLASSES
    return x, y


def _max_difference(a, b):
    return float(np.abs(np.asarray(a) - np.asarray(b)).max())


def _stateless_loss(model, trainable, non_trainable, x, y):
    """Mean cross-entropy of one stateless training-mode call; returns (loss, new state)."""
    logits, new_state = model.stateless_call(trainable, non_trainable, x, training=True)
    per_example = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
    return tf.reduce_mean(per_example), new_state


def _loss_and_gradients(model, x, y):
    """Gradients as TowerTrainer takes them: a tape watching plain tensors, not variables."""
    trainable = [tf.identity(v.value) for v in model.trainable_variables]
    non_trainable = [tf.identity(v.value) for v in model.non_trainable_variables]
    with tf.GradientTape() as tape:
        tape.watch(trainable)
        loss, new_state = _stateless_loss(model, trainable, non_trainable, x, y)
    return loss, tape.gradient(loss, trainable), trainable, non_trainable, new_state


class BuildModelTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.named_parameters(MODEL_AND_SHAPE)
    def test_output_shape_and_parameter_count(self, name, input_shape):
        model = models.build_model(name, input_shape, NUM_CLASSES, seed=0)
        self.assertTrue(model.built)
        self.assertEqual(model.name, name)
        self.assertEqual(tuple(model.input_shape), (None, *input_shape))
        self.assertEqual(tuple(model.output_shape), (None, NUM_CLASSES))
        self.assertEqual(model.count_params(), EXPECTED_PARAMS[(name, input_shape)])
        logits = model(_batch(input_shape)[0], training=False)
        self.assertEqual(logits.shape, (BATCH_SIZE, NUM_CLASSES))
        self.assertEqual(logits.dtype, tf.float32)

    @parameterized.named_parameters(MODEL_AND_SHAPE)
    def test_one_gradient_step_lowers_the_loss_as_predicted(self, name, input_shape):
        model = models.build_model(name, input_shape, NUM_CLASSES, seed=0)
        x, y = _batch(input_shape)
        loss, grads, trainable, non_trainable, _ = _loss_and_gradients(model, x, y)
        # Fresh init, 10 classes: the loss is near log(10) = 2.30.
        self.assertBetween(float(loss), 1.5, 3.5)
        self.assertLen(grads, len(model.trainable_variables))
        grads = [tf.convert_to_tensor(g) for g in grads]  # IndexedSlices -> dense
        for variable, grad in zip(model.trainable_variables, grads):
            self.assertAllEqual(tf.math.is_finite(grad), np.ones(variable.shape, bool),
                                msg=variable.path)
        # Gradient descent with step lr lowers the loss by lr * |g|^2 to first
        # order; pick lr so that is 0.01, well above float32 round-off of the loss.
        squared_norm = float(tf.add_n([tf.reduce_sum(g * g) for g in grads]))
        self.assertGreater(squared_norm, 1e-6)
        lr = 0.01 / squared_norm
        stepped = [w - lr * g for w, g in zip(trainable, grads)]
        new_loss, _ = _stateless_loss(model, stepped, non_trainable, x, y)
        self.assertAllClose(float(loss) - float(new_loss), 0.01, rtol=0.1)

    @parameterized.named_parameters(("mlp", "mlp"), ("cnn", "cnn"), ("resnet", "resnet"))
    def test_dense_models_have_dense_gradients(self, name):
        model = models.build_model(name, DIGITS, NUM_CLASSES, seed=0)
        _, grads, *_ = _loss_and_gradients(model, *_batch(DIGITS))
        self.assertEqual([type(g).__name__ for g in grads if isinstance(g, tf.IndexedSlices)], [])

    @parameterized.named_parameters(("mlp", "mlp"), ("cnn", "cnn"), ("text", "text"))
    def test_only_resnet_has_state(self, name):
        model = models.build_model(name, DIGITS, NUM_CLASSES, seed=0)
        self.assertEqual(model.non_trainable_variables, [])

    def test_resnet_batch_norm_statistics_update_in_training_only(self):
        model = models.build_model("resnet", DIGITS, NUM_CLASSES, seed=0)
        names = sorted(v.name for v in model.non_trainable_variables)
        self.assertEqual(names, sorted(["moving_mean", "moving_variance"] * RESNET_BN_LAYERS))
        self.assertEqual(sum(int(np.prod(v.shape)) for v in model.non_trainable_variables),
                         RESNET_NON_TRAINABLE)
        *_, old_state, new_state = _loss_and_gradients(model, *_batch(DIGITS))
        for variable, old, new in zip(model.non_trainable_variables, old_state, new_state):
            # Fresh statistics are 0 (mean) and 1 (variance); one batch moves them 10%.
            self.assertAllEqual(old, np.zeros(variable.shape) if variable.name == "moving_mean"
                                else np.ones(variable.shape))
            self.assertGreater(float(tf.reduce_max(tf.abs(new - old))), 1e-4, msg=variable.path)
        x = _batch(DIGITS)[0]
        _, eval_state = model.stateless_call(
            model.trainable_variables, model.non_trainable_variables, x, training=False)
        for old, new in zip(old_state, eval_state):
            self.assertAllEqual(old, new)

    def test_same_seed_same_weights_whatever_the_global_seed(self):
        for name in models.MODELS:
            keras.utils.set_random_seed(1)
            first = models.build_model(name, DIGITS, NUM_CLASSES, seed=7)
            keras.utils.set_random_seed(2)
            second = models.build_model(name, DIGITS, NUM_CLASSES, seed=7)
            other = models.build_model(name, DIGITS, NUM_CLASSES, seed=8)
            for a, b in zip(first.weights, second.weights):
                self.assertAllEqual(a, b, msg=f"{name} {a.path}")
            # The first conv/dense kernel or the embedding table.
            self.assertGreater(_max_difference(first.trainable_variables[0],
                                               other.trainable_variables[0]), 1e-3, msg=name)

    def test_no_seed_gives_fresh_weights(self):
        first = models.build_model("mlp", DIGITS, NUM_CLASSES)
        second = models.build_model("mlp", DIGITS, NUM_CLASSES)
        self.assertGreater(_max_difference(first.weights[0], second.weights[0]), 1e-3)

    def test_layers_get_different_seeds(self):
        # Two equal-shaped kernels from one model seed must not be copies of each other.
        model = models.build_model("resnet", DIGITS, NUM_CLASSES, seed=0)
        a = model.get_layer("block1_1_conv").kernel
        b = model.get_layer("block1_2_conv").kernel
        self.assertEqual(a.shape, b.shape)
        self.assertGreater(_max_difference(a, b), 1e-3)

    def test_logits_stay_float32_under_mixed_precision(self):
        try:
            keras.mixed_precision.set_global_policy("mixed_float16")
            for name in ("mlp", "text"):
                model = models.build_model(name, DIGITS, NUM_CLASSES, seed=0)
                logits = model(_batch(DIGITS)[0])
                self.assertEqual(logits.dtype, tf.float32, msg=name)
                self.assertAllEqual(tf.math.is_finite(logits), np.ones(logits.shape, bool))
        finally:
            keras.mixed_precision.set_global_policy("float32")

    @parameterized.named_parameters(
        ("unknown_name", dict(name="vgg"),
         r"unknown model 'vgg'; choose one of mlp, cnn, resnet, text"),
        ("two_dims", dict(input_shape=(8, 8)), r"three positive ints, got \(8, 8\)"),
        ("zero_dim", dict(input_shape=(8, 0, 1)), r"got \(8, 0, 1\)"),
        ("float_dim", dict(input_shape=(8, 8.0, 1)), r"got \(8, 8.0, 1\)"),
        ("not_a_shape", dict(input_shape=8), r"got 8\."),
        ("one_class", dict(num_classes=1), r"num_classes must be an int >= 2, got 1"),
        ("float_classes", dict(num_classes=10.0), r"got 10.0"),
        ("negative_seed", dict(seed=-1), r"seed must be None or an int >= 0, got -1"),
    )
    def test_bad_arguments(self, overrides, message):
        kwargs = dict(name="mlp", input_shape=DIGITS, num_classes=NUM_CLASSES, seed=0)
        kwargs.update(overrides)
        with self.assertRaisesRegex(ValueError, message):
            models.build_model(**kwargs)

    def test_numpy_ints_are_accepted(self):
        model = models.build_model("cnn", np.array(DIGITS), np.int64(3), seed=np.int64(0))
        self.assertEqual(tuple(model.output_shape), (None, 3))


class TextModelTest(tf.test.TestCase):

    def test_pixel_tokens(self):
        layer = models.PixelTokens(levels=16)
        # Positions 0..5; values at and around the bin edges, and outside [0, 1].
        images = np.array([0.0, 0.5, 0.999, 1.0, -0.2, 1.7], "float32").reshape(1, 2, 3, 1)
        tokens = layer(images)
        self.assertEqual(tokens.dtype, tf.int32)
        self.assertAllEqual(tokens, [[0 * 16 + 0, 1 * 16 + 8, 2 * 16 + 15,
                                      3 * 16 + 15, 4 * 16 + 0, 5 * 16 + 15]])
        with self.assertRaisesRegex(ValueError, "levels must be >= 2, got 1"):
            models.PixelTokens(levels=1)

    def test_embedding_gradient_is_indexed_slices(self):
        model = models.build_model("text", DIGITS, NUM_CLASSES, seed=0)
        embedding = model.get_layer("embedding").embeddings
        index = [v.path for v in model.trainable_variables].index(embedding.path)
        x, y = _batch(DIGITS)
        _, grads, trainable, *_ = _loss_and_gradients(model, x, y)
        self.assertNotIsInstance(trainable[index], tf.Variable)
        grad = grads[index]
        self.assertIsInstance(grad, tf.IndexedSlices)
        self.assertAllEqual(grad.dense_shape, [64 * 16, 32])
        # One row per token of the batch, and exactly the batch's tokens.
        tokens = model.get_layer("tokens")(x).numpy()
        self.assertEqual(grad.values.shape, (BATCH_SIZE * 64, 32))
        self.assertAllEqual(np.unique(grad.indices.numpy()), np.unique(tokens))
        self.assertGreater(float(tf.reduce_max(tf.abs(grad.values))), 0.0)
        self.assertNotIsInstance(grads[index + 1], tf.IndexedSlices)  # the logits kernel


class TowerTrainerSmokeTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.named_parameters((name, name) for name in models.MODELS)
    def test_one_train_step_on_two_towers(self, name):
        model = models.build_model(name, DIGITS, NUM_CLASSES, seed=0)
        trainer = towers.TowerTrainer(
            model, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            keras.optimizers.SGD(0.05), devices=["/device:CPU:0", "/device:CPU:1"])
        before = [v.numpy() for v in model.trainable_variables]
        x, y = _batch(DIGITS)
        logs = trainer.train_step((x[:3], y[:3]))  # uneven shards of 2 and 1
        self.assertBetween(logs["loss"], 1.5, 3.5)
        self.assertEqual(trainer.step, 1)
        moved = [_max_difference(v, b) for v, b in zip(model.trainable_variables, before)]
        self.assertGreater(min(moved), 0.0)


def _stage_layers(model, cuts):
    """The model's own layers in each stage of `model` cut after `cuts` (inputs and
    the stages' pass-through layers left out)."""
    own = {id(layer) for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)}
    return [[layer for layer in stage.layers if id(layer) in own]
            for stage in towers.stages.Stages(model, cuts).models]


def _stage_compute(model, cuts):
    """Estimated multiply-adds per example of each stage."""
    return [sum(models.layer_compute(layer) for layer in layers)
            for layers in _stage_layers(model, cuts)]


class PipelineCutsTest(tf.test.TestCase, parameterized.TestCase):

    def test_layer_compute(self):
        # conv, pool, conv, pool, flatten, dense, logits (Keras numbers the names per process).
        _, _, conv, _, flatten, _, logits = models.build_model(
            "cnn", DIGITS, NUM_CLASSES, seed=0).layers[1:]
        # A conv's weights once per output pixel (8x8 pooled to 4x4), a Dense's once,
        # a layer without weights its output size.
        self.assertEqual(models.layer_compute(conv), (9 * 32 * 64 + 64) * 4 * 4)
        self.assertEqual(models.layer_compute(logits), 128 * 10 + 10)
        self.assertEqual(models.layer_compute(flatten), 2 * 2 * 64)
        # A lookup reads one row per token, whatever the vocabulary (64 * 16 rows).
        text = models.build_model("text", DIGITS, NUM_CLASSES, seed=0)
        self.assertEqual(models.layer_compute(text.get_layer("embedding")), 64 * 32)

    @parameterized.named_parameters((name, name) for name in models.MODELS)
    def test_cuts_make_stages_at_least_as_balanced_as_the_first_layers(self, name):
        model = models.build_model(name, DIGITS, NUM_CLASSES, seed=0)
        layer_names = [layer.name for layer in model.layers
                       if not isinstance(layer, keras.layers.InputLayer)]
        total = sum(models.layer_compute(model.get_layer(n)) for n in layer_names)
        for num_stages in (2, 3, 4):
            cuts = models.pipeline_cuts(model, num_stages)
            self.assertLen(cuts, num_stages - 1)
            stage_layers = _stage_layers(model, cuts)
            self.assertLen(stage_layers, num_stages)
            for k, layers in enumerate(stage_layers):
                self.assertNotEmpty(layers, f"{name}, {num_stages} stages: stage {k}")
            compute = _stage_compute(model, cuts)
            self.assertEqual(sum(compute), total)  # every layer in exactly one stage
            # The largest stage sets a pipeline's pace; cutting after the first
            # layers (always valid) is the baseline to beat.
            first_layers = _stage_compute(model, layer_names[:num_stages - 1])
            self.assertLessEqual(max(compute), max(first_layers),
                                 f"{name}, {num_stages} stages: {cuts} {compute}")
            if num_stages == 2:  # every model's first layer is cheap
                self.assertLess(max(compute), max(first_layers), f"{name}: {cuts} {compute}")

    def test_one_stage_needs_no_cut(self):
        model = models.build_model("mlp", DIGITS, NUM_CLASSES, seed=0)
        self.assertEqual(models.pipeline_cuts(model, 1), [])

    @parameterized.named_parameters(
        ("zero", 0), ("more_than_layers", 5), ("float", 2.0), ("bool", True), ("text", "2"),
        ("none", None))
    def test_bad_num_stages(self, num_stages):
        model = models.build_model("mlp", DIGITS, NUM_CLASSES, seed=0)  # 4 layers
        with self.assertRaisesRegex(ValueError, "num_stages must be an int from 1 to 4"):
            models.pipeline_cuts(model, num_stages)


class SubclassedModel(keras.Model):
    def __init__(self, num_classes):
        super().__init__()
        self.flatten = keras.layers.Flatten()
        self.logits = keras.layers.Dense(num_classes)

    def call(self, images):
        return self.logits(self.flatten(images))


class ModelSpecTest(tf.test.TestCase, parameterized.TestCase):
    """What model_spec adds to build_model; tests/test_train.py runs each form and error."""

    def _new_directory(self):
        return self.enter_context(tempfile.TemporaryDirectory())

    @parameterized.parameters(
        ("mlp", "builtin"), ("examples.my_model:small_cnn", "function"),
        ("my_model:build", "function"), ("runs/a:b.keras", "file"), ("model.keras", "file"))
    def test_forms(self, spec, form):
        self.assertEqual(model_spec.form_of(spec), form)

    @parameterized.parameters("vgg", "my_model.py", "a.b:", ":f", "a:b.c", "1a:f", "a:f-g", None)
    def test_none_of_the_forms(self, spec):
        with self.assertRaisesRegex(ValueError, "none of the three forms"):
            model_spec.form_of(spec)

    def test_builtin_name_is_build_model(self):
        loaded = model_spec.load_model("mlp", DIGITS, NUM_CLASSES, seed=3)
        built = models.build_model("mlp", DIGITS, NUM_CLASSES, seed=3)
        for a, b in zip(loaded.weights, built.weights):
            self.assertAllEqual(a, b)

    def test_module_is_found_in_the_current_directory(self):
        directory = self._new_directory()
        with open(os.path.join(directory, "towers_test_here.py"), "w") as f:
            f.write("import keras\n"
                    "def model(input_shape, num_classes):\n"
                    "    return keras.Sequential([keras.layers.Flatten(),\n"  # unbuilt
                    "                             keras.layers.Dense(num_classes)])\n")
        self.enter_context(mock.patch.object(sys, "path", [p for p in sys.path if p]))
        self.addCleanup(sys.modules.pop, "towers_test_here", None)
        self.addCleanup(os.chdir, os.getcwd())
        os.chdir(directory)
        model = model_spec.load_model("towers_test_here:model", DIGITS, NUM_CLASSES)
        self.assertEqual(tuple(model.output_shape), (None, NUM_CLASSES))

    def test_example_model_fits_any_image_shape(self):
        model = model_spec.load_model("examples.my_model:small_cnn", (28, 28, 1), 3)
        self.assertEqual(tuple(model.input_shape), (None, 28, 28, 1))
        self.assertEqual(tuple(model.output_shape), (None, 3))

    def test_pipeline_cuts_refuse_a_subclassed_model(self):
        model = SubclassedModel(NUM_CLASSES)
        model(_batch(DIGITS)[0])
        with self.assertRaisesRegex(ValueError, "is a subclassed keras.Model: its call\\(\\) is "
                                                "Python code"):
            models.pipeline_cuts(model, 2)

    def test_checkpoint_dir_records_the_model_of_its_first_checkpoint(self):
        directory = os.path.join(self._new_directory(), "run")
        record = os.path.join(directory, model_spec.RECORD_FILE)
        model_spec.claim_checkpoint_dir(directory, "mlp", writer=False)
        self.assertFalse(os.path.exists(directory))  # a reader writes nothing
        model_spec.claim_checkpoint_dir(directory, "mlp")
        model_spec.claim_checkpoint_dir(directory, "cnn")  # no checkpoint yet: a new start
        with open(record) as f:
            self.assertEqual(json.load(f), {"model": "cnn"})

        tf.train.Checkpoint(v=tf.Variable(1.0)).save(os.path.join(directory, "ckpt"))
        model_spec.claim_checkpoint_dir(directory, "cnn")
        with self.assertRaisesRegex(ValueError, "does not match this model: it holds model "
                                                "'cnn', not 'mlp'"):
            model_spec.claim_checkpoint_dir(directory, "mlp", writer=False)
        os.remove(record)  # checkpoints from before the record: the shapes alone decide
        model_spec.claim_checkpoint_dir(directory, "mlp")
        self.assertFalse(os.path.exists(record))

    def test_a_keras_file_is_recorded_by_its_absolute_path(self):
        directory = self._new_directory()
        self.addCleanup(os.chdir, os.getcwd())
        os.chdir(directory)
        model_spec.claim_checkpoint_dir("run", "model.keras")
        tf.train.Checkpoint(v=tf.Variable(1.0)).save(os.path.join("run", "ckpt"))
        model_spec.claim_checkpoint_dir("run", os.path.join(directory, "model.keras"))
        with self.assertRaisesRegex(ValueError, "not '/.*/other/model.keras'"):
            model_spec.claim_checkpoint_dir("run", "other/model.keras")
