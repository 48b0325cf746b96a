"""recompute=: stages and named layers rerun in the backward, equal to keeping their
activations (dropout included: each rerun draws the first run's mask) and to Keras on one
device, split layers too; the rerun is real (counted in the traced step); misuse refused
in one line."""

import collections
import re

import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import towers
from benchmarks.harness import transfers
from tests import reference
from towers.engine import forward

CPU = [f"/device:CPU:{i}" for i in range(4)]
EXACT = 1e-6  # recompute against no recompute: the same ops on the same values
KERAS = 1e-5  # against Keras on one device: another order of the sums
STEPS = 2


def _stages_model(rate, seed=0):
    """Dense "hidden" -> Dropout "drop_0" | (cut) Dense "middle" -> Dropout "drop_1" ->
    Dense "logits": a Dropout in each of the two stages."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((reference.NUM_FEATURES,))
    hidden = keras.layers.Dense(8, activation="tanh", name="hidden")(inputs)
    hidden = keras.layers.Dropout(rate, name="drop_0")(hidden)
    hidden = keras.layers.Dense(8, activation="tanh", name="middle")(hidden)
    hidden = keras.layers.Dropout(rate, name="drop_1")(hidden)
    return keras.Model(inputs, keras.layers.Dense(reference.NUM_CLASSES, name="logits")(hidden))


def _nested_model(rate, seed=0):
    """Dense "first" -> Sequential "block" (Dense "inner", Dropout "inner_drop", Dense
    "inner_out") -> Dropout "drop" -> Dense "logits"."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((reference.NUM_FEATURES,))
    hidden = keras.layers.Dense(8, activation="tanh", name="first")(inputs)
    block = keras.Sequential([keras.layers.Dense(8, activation="tanh", name="inner"),
                              keras.layers.Dropout(rate, name="inner_drop"),
                              keras.layers.Dense(8, activation="tanh", name="inner_out")],
                             name="block")
    hidden = keras.layers.Dropout(rate, name="drop")(block(hidden))
    return keras.Model(inputs, keras.layers.Dense(reference.NUM_CLASSES, name="logits")(hidden))


# A column split, and a column -> row pair inside a block, over 2 parts.
SPLIT_PLAN = {"first": "column", "block/up": "column", "block/down": "row"}
# 2 towers x 2 stages (cut after "first") x 2 parts on 4 devices: tower 1 runs each
# stage on the devices tower 0 runs the other on.
SPLIT_GRID = [[CPU[:2], CPU[2:]], [CPU[2:], CPU[:2]]]


def _split_model(rate, seed=0):
    """split_layers(SPLIT_PLAN) of Dense "first" -> Sequential "block" (Dense "up" with
    an L2 penalty, Dropout "inner_drop", Dense "down") -> Dropout "drop" -> Dense
    "logits", its parts on CPU:0 and CPU:1."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((reference.NUM_FEATURES,))
    hidden = keras.layers.Dense(8, activation="tanh", name="first")(inputs)
    block = keras.Sequential([keras.layers.Dense(16, activation="relu", name="up",
                                                 kernel_regularizer=keras.regularizers.L2(0.01)),
                              keras.layers.Dropout(rate, name="inner_drop"),
                              keras.layers.Dense(8, activation="tanh", name="down")],
                             name="block")
    hidden = keras.layers.Dropout(rate, name="drop")(block(hidden))
    model = keras.Model(inputs, keras.layers.Dense(reference.NUM_CLASSES, name="logits")(hidden))
    return towers.split_layers(model, SPLIT_PLAN, CPU[:2])


def _split_home(path, pipeline):
    """Where _split_model's variable `path` lives: part j of a split layer on its
    stage's device j, any other variable on its stage's first (SPLIT_GRID[0][k])."""
    stage = 1 if pipeline and not path.startswith("first/") else 0
    part = re.search(r"/part_(\d)/", path)
    return CPU[2 * stage + (int(part.group(1)) if part else 0)]


def _batches():
    return reference.make_batches(16, STEPS, seed=5)


def _train(model, optimizer="adam", batches=None, **options):
    """(weights, logs of every step, trainer) after TowerTrainer(**options) trained on
    `batches` (None: _batches())."""
    trainer = towers.TowerTrainer(model, reference.make_loss(),
                                  reference.OPTIMIZERS[optimizer](), **options)
    logs = [trainer.train_step(batch) for batch in batches or _batches()]
    return [v.numpy() for v in model.weights], logs, trainer


def _keras(model, optimizer="adam"):
    """Weights after Keras's compile + train_on_batch on one device, the same batches."""
    model.compile(optimizer=reference.OPTIMIZERS[optimizer](), loss=reference.make_loss())
    for x, y, w in _batches():
        model.train_on_batch(x, y, sample_weight=w)
    return [v.numpy() for v in model.weights]


def _matmuls(trainer):
    return sum(node.op in reference.MATMUL_OPS for node in reference.traced_nodes(trainer))


def _matmuls_by_device(trainer):
    return collections.Counter(towers.devices.canonical_name(node.device)
                               for node in reference.traced_nodes(trainer)
                               if node.op in reference.MATMUL_OPS)


class RecomputeTest(tf.test.TestCase, parameterized.TestCase):

    def assertSameRun(self, expected, actual):
        (expected_weights, expected_logs, _), (weights, logs, _) = expected, actual
        for want, got in zip(expected_weights, weights):
            self.assertAllClose(want, got, atol=EXACT, rtol=0)
        for want, got in zip(expected_logs, logs):
            self.assertEqual(want.keys(), got.keys())
            self.assertAllClose([want[k] for k in want], [got[k] for k in want], atol=EXACT,
                                rtol=0)

    @parameterized.product(schedule=["gpipe", "1f1b"], micro_batches=[1, 4])
    def test_stages_with_dropout_equal_keeping_them(self, schedule, micro_batches):
        grid = dict(devices=[CPU[:2], CPU[2:]], pipeline_cuts=["drop_0"],
                    micro_batches=micro_batches, pipeline_schedule=schedule)
        kept = _train(_stages_model(0.3), **grid)
        rerun = _train(_stages_model(0.3), recompute="stages", **grid)
        self.assertSameRun(kept, rerun)
        # Dropout drew masks: the weights moved otherwise than without it.
        self.assertNotAllClose(_train(_stages_model(0.0), **grid)[0], rerun[0])

    @parameterized.parameters(
        (["block"], {}),                                          # Dropout inside it
        (["block/inner*", "drop"], {}),                           # nested paths
        (["drop_0", "middle"], dict(pipeline_cuts=["drop_0"], micro_batches=2,
                                    pipeline_schedule="1f1b")))   # in both stages
    def test_named_layers_with_dropout_equal_keeping_them(self, recompute, pipeline):
        make = _stages_model if pipeline else _nested_model
        devices = [CPU[:2], CPU[2:]] if pipeline else CPU[:2]
        kept = _train(make(0.3), devices=devices, **pipeline)
        rerun = _train(make(0.3), devices=devices, recompute=recompute, **pipeline)
        self.assertSameRun(kept, rerun)

    def test_equal_to_keras_on_one_device(self):
        expected = _keras(_stages_model(0.0))
        stages, _, _ = _train(_stages_model(0.0), devices=[CPU[:2], CPU[2:]],
                              pipeline_cuts=["drop_0"], micro_batches=4, recompute="stages")
        whole, _, _ = _train(_stages_model(0.0), devices=CPU[:2], recompute="stages")
        layers, _, _ = _train(_nested_model(0.0), devices=CPU[:2],
                              recompute=["block/inner*", "first"])
        for got in (stages, whole):
            self.assertAllClose(expected, got, atol=KERAS, rtol=0)
        self.assertAllClose(_keras(_nested_model(0.0)), layers, atol=KERAS, rtol=0)

    def test_the_forward_runs_again_in_the_step(self):
        """Each Dense's forward is a MatMul: a rerun adds one per recomputed Dense per
        tower and micro-batch to the traced step (2 towers x 2 micro-batches here). The
        last stage's forward and backward are one call, which keeps no activation past
        it: its stage is not rerun, a named layer in it is."""
        grid = dict(devices=[CPU[:2], CPU[2:]], pipeline_cuts=["drop_0"], micro_batches=2)
        kept = _matmuls(_train(_stages_model(0.3), **grid)[2])
        stages = _matmuls(_train(_stages_model(0.3), recompute="stages", **grid)[2])
        middle = _matmuls(_train(_stages_model(0.3), recompute=["middle"], **grid)[2])
        self.assertEqual(stages - kept, 1 * 2 * 2)  # hidden
        self.assertEqual(middle - kept, 1 * 2 * 2)

    def test_keras_remat_drops_the_gradients_of_captured_weights(self):
        """Why recompute has its own custom gradient: keras.remat (tf.recompute_grad)
        differentiates variables and inputs, and towers' forward reads weights as tensors."""
        x = np.ones((3, reference.NUM_FEATURES), np.float32)
        with keras.RematScope(mode="list_of_layers", layer_names=["dense"]):
            dense = keras.layers.Dense(4, name="dense")
        model = keras.Sequential([keras.Input((reference.NUM_FEATURES,)), dense])
        weights = [tf.identity(v.value) for v in model.trainable_variables]
        with tf.GradientTape() as tape:
            tape.watch(weights)
            y, _, _ = forward.stateless_run(model, model.trainable_variables, weights,
                                            lambda: model(x))
        self.assertEqual(tape.gradient(y, weights), [None, None])

    @parameterized.named_parameters(
        ("true", dict(recompute=True), r"recompute must be False, 'stages' or a non-empty list"),
        ("other_word", dict(recompute="layers"), r"recompute must be False, 'stages'"),
        ("empty", dict(recompute=[]), r"recompute must be False, 'stages'"),
        ("no_such_layer", dict(recompute=["nope"]), r"recompute=\['nope'\]: .*matches no layer"),
        ("inside_another", dict(recompute=["block", "block/inner"]), r"recompute=.*inside"),
        ("xla", dict(recompute="stages", jit_compile=True), r"recompute='stages' needs "
                                                             r"jit_compile=False"))
    def test_refused_in_one_line(self, options, message):
        model = _nested_model(0.3)
        before = [v.numpy() for v in model.weights]
        with self.assertRaisesRegex(ValueError, message) as refused:
            towers.TowerTrainer(model, reference.make_loss(), reference.OPTIMIZERS["sgd"](),
                                devices=CPU[:2], **options)
        self.assertNotIn("\n", str(refused.exception))
        for want, got in zip(before, model.weights):
            self.assertAllEqual(want, got.numpy())

    def test_a_loss_added_inside_a_named_layer_passes_the_op(self):
        # A sublayer's activity regularizer: its loss is an output of the op, its gradient
        # reaches the sublayer's weights through the rerun.
        def build():
            keras.utils.set_random_seed(0)
            block = keras.Sequential([keras.layers.Dense(
                4, name="inner", activity_regularizer=keras.regularizers.L2(0.1))],
                name="block")
            return keras.Sequential([keras.Input((reference.NUM_FEATURES,)), block,
                                     keras.layers.Dense(reference.NUM_CLASSES)])

        self.assertSameRun(_train(build(), devices=CPU[:2]),
                           _train(build(), devices=CPU[:2], recompute=["block"]))

    def test_a_variable_of_another_layer_read_inside_refused(self):
        class Tied(keras.layers.Layer):  # reads the Dense's kernel, which it does not track
            def __init__(self, dense, **kwargs):
                super().__init__(**kwargs)
                self.kernel_of = lambda: dense.kernel

            def call(self, x):
                return keras.ops.matmul(x, keras.ops.transpose(self.kernel_of()))

        keras.utils.set_random_seed(0)
        inputs = keras.Input((reference.NUM_FEATURES,))
        dense = keras.layers.Dense(3, name="dense")
        model = keras.Model(inputs, Tied(dense, name="tied")(dense(inputs)))
        before = [v.numpy() for v in model.weights]
        trainer = towers.TowerTrainer(model, "mse", reference.OPTIMIZERS["sgd"](),
                                      devices=CPU[:1], recompute=["tied"])
        x = _batches()[0][0]
        with self.assertRaisesRegex(ValueError, r"recompute: layer 'tied' reads variables of "
                                                r"other layers \(\['dense/kernel:0'\]\)"):
            trainer.train_step((x, x))
        for want, got in zip(before, model.weights):
            self.assertAllEqual(want, got.numpy())

    def test_stages_with_split_layers_as_without(self):
        # 2 towers x 2 parts, Dropout between the column and the row split, M = 1 and 2:
        # each part's custom-gradient op reruns with its stage, the same mask drawn.
        def build():
            keras.utils.set_random_seed(0)
            inputs = keras.Input((6,))
            x = keras.layers.Dense(16, activation="relu", name="up")(inputs)
            x = keras.layers.Dropout(0.3, seed=3, name="drop")(x)
            x = keras.layers.Dense(8, activation="tanh", name="down")(x)
            return keras.Model(inputs, keras.layers.Dense(3, name="out")(x))

        rng = np.random.default_rng(0)
        batches = [(rng.normal(size=(n, 6)).astype("float32"), rng.integers(0, 3, n))
                   for n in (9, 7)]
        for micro_batches in (1, 2):
            runs = []
            for recompute in (False, "stages"):
                parted = towers.split_layers(build(), {"up": "column", "down": "row"}, CPU[:2])
                trainer = towers.TowerTrainer(
                    parted, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    keras.optimizers.Adam(0.01), devices=[CPU[:2], CPU[2:]],
                    micro_batches=micro_batches, recompute=recompute)
                losses = [trainer.train_step(batch)["loss"] for batch in batches]
                runs.append((losses, towers.join_layers(parted).get_weights()))
            (losses, weights), (recomputed_losses, recomputed) = runs
            self.assertAllClose(recomputed_losses, losses, atol=1e-6, rtol=0)
            for got, want in zip(recomputed, weights):
                self.assertAllClose(got, want, atol=1e-6, rtol=0)

    @parameterized.named_parameters(
        ("a_split_layer", ["first"], False),                # its parts rerun in their ops
        ("a_block_of_split_layers", ["block"], False),      # one op, its parts inside
        ("split_and_plain_layers", ["block/up", "drop", "logits"], False),
        ("on_a_grid", ["first", "block"], True))            # towers x stages x parts
    def test_named_layers_of_a_split_model_equal_keeping_them(self, recompute, pipeline):
        # 2 towers x 2 parts, 2 micro-batches; on the grid (1F1B), 3 rows leave tower 1 an
        # empty micro-batch (its forward inside a tf.cond).
        options = dict(devices=[CPU[:2], CPU[2:]], micro_batches=2, optimizer="sgd")
        batches = None
        if pipeline:
            options.update(devices=SPLIT_GRID, pipeline_cuts=["first"], pipeline_schedule="1f1b")
            batches = [_batches()[0], tuple(t[:3] for t in _batches()[1])]
        kept = _train(_split_model(0.3), batches=batches, **options)
        rerun = _train(_split_model(0.3), batches=batches, recompute=recompute, **options)
        self.assertSameRun(kept, rerun)
        for variable in rerun[2].model.weights:
            self.assertEqual(towers.devices.canonical_name(variable.value.device),
                             _split_home(variable.path, pipeline), variable.path)

    def test_attention_split_by_heads_named_equal_keeping_it(self):
        # Each part draws its own dropout stream inside the part's op; the rerun the same.
        def build():
            keras.utils.set_random_seed(0)
            inputs = keras.Input((reference.NUM_FEATURES,))
            tokens = keras.layers.Dense(4, name="embed")(keras.layers.Reshape((-1, 1))(inputs))
            attended = keras.layers.MultiHeadAttention(2, 2, dropout=0.3, name="att")(tokens,
                                                                                       tokens)
            hidden = keras.layers.GlobalAveragePooling1D()(attended)
            model = keras.Model(inputs, keras.layers.Dense(reference.NUM_CLASSES)(hidden))
            return towers.split_layers(model, {"att": "heads"}, CPU[:2])

        options = dict(devices=[CPU[:2], CPU[2:]], optimizer="sgd")
        kept = _train(build(), **options)
        rerun = _train(build(), recompute=["att"], **options)
        self.assertSameRun(kept, rerun)
        for variable in rerun[2].model.weights:
            self.assertEqual(towers.devices.canonical_name(variable.value.device),
                             _split_home(variable.path, pipeline=False), variable.path)

    def test_named_layers_of_a_split_model_equal_to_keras_on_one_device(self):
        expected = _keras(towers.join_layers(_split_model(0.0)), "sgd")
        _, _, trainer = _train(_split_model(0.0), devices=[CPU[:2], CPU[2:]], optimizer="sgd",
                               recompute=["first", "block"])
        self.assertAllClose(expected, towers.join_layers(trainer.model).get_weights(),
                            atol=KERAS, rtol=0)

    def test_a_recomputed_split_layer_reruns_each_part_on_its_device(self):
        """A split Dense named: one more MatMul per part and tower, on the part's device
        (2 towers x 2 parts here), and no more bytes between devices than kept (each
        part's rerun reads its input where its forward did). A block holding split
        layers: its rerun sends the parts' activations again (3 rows a tower), no weight."""
        batch = tuple(t[:6] for t in _batches()[0])
        runs = {name: _train(_split_model(0.3), batches=[batch], devices=[CPU[:2], CPU[2:]],
                             recompute=recompute)[2]
                for name, recompute in (("kept", False), ("first", ["first"]),
                                        ("block", ["block"]))}
        self.assertEqual(_matmuls_by_device(runs["first"]) - _matmuls_by_device(runs["kept"]),
                         {device: 1 for device in CPU})
        moved = {name: collections.Counter(
            (source, destination, shape) for source, destination, _, _, shape, _
            in transfers.trainer_step_bytes(trainer, batch)["tensors"])
            for name, trainer in runs.items()}
        self.assertEqual(moved["first"], moved["kept"])
        again = moved["block"] - moved["kept"]
        self.assertTrue(again)
        self.assertEqual({shape[0] for _, _, shape in again}, {3}, again)

    @parameterized.named_parameters(
        ("an_outer_calls_training", ["block"]),    # read by a Dropout it is not passed to
        ("mixed_precision", ["block/up"]))         # a float16 compute of float32 weights
    def test_the_rerun_runs_in_the_keras_state_of_the_first_call(self, recompute):
        class Block(keras.layers.Layer):
            """Its call takes no `training`: its Dropout reads the outer call's."""

            def __init__(self, **kwargs):
                super().__init__(**kwargs)
                self.up = keras.layers.Dense(8, activation="relu", name="up",
                                             dtype="mixed_float16")
                self.drop = keras.layers.Dropout(0.5, name="drop")

            def call(self, x):
                return self.drop(self.up(x))

        def build():
            keras.utils.set_random_seed(0)
            inputs = keras.Input((reference.NUM_FEATURES,))
            hidden = Block(name="block")(inputs)
            return keras.Model(inputs, keras.layers.Dense(reference.NUM_CLASSES)(hidden))

        self.assertSameRun(_train(build(), devices=CPU[:2]),
                           _train(build(), devices=CPU[:2], recompute=recompute))


if __name__ == "__main__":
    tf.test.main()
