"""TowerTrainer: failed steps change nothing, bad input gets a clear error, one trace."""

import collections
import re
import subprocess
import sys

import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import towers
from towers import compat
from towers.devices import canonical_name
from towers.training import graph_rewrites
from benchmarks.harness import transfers
from tests import reference

DEVICES = [f"/device:CPU:{i}" for i in range(4)]
# 2 towers x 2 stages x 2 parts, tower 1 on tower 0's devices with its stages swapped.
SWAPPED_GRID = [[DEVICES[0:2], DEVICES[2:4]], [DEVICES[2:4], DEVICES[0:2]]]


def _trainer(model=None, loss=None, **kwargs):
    kwargs.setdefault("devices", DEVICES)
    return towers.TowerTrainer(model or reference.make_model(), loss or reference.make_loss(),
                               keras.optimizers.Adam(0.01), **kwargs)


def _state(trainer):
    """Every model weight and optimizer variable, as numpy arrays."""
    return [v.numpy() for v in trainer.model.weights + trainer.optimizer.variables]


class FailedStepTest(tf.test.TestCase, parameterized.TestCase):

    def _trained_once(self, **kwargs):
        trainer = _trainer(**kwargs)
        self.batches = reference.make_batches(10, num_steps=2)
        trainer.train_step(self.batches[0])
        return trainer

    def assertUnchanged(self, before, trainer):
        for want, got in zip(before, _state(trainer)):
            self.assertAllEqual(want, got)

    def test_nan_raises_and_applies_nothing(self):
        trainer = self._trained_once()
        before = _state(trainer)
        x, y, w = self.batches[1]
        x = x.copy()
        x[7, 2] = np.nan  # lands on tower 2 of 4
        with self.assertRaisesRegex(towers.NonFiniteError, "step 2: .*NaN or Inf"):
            trainer.train_step((x, y, w))
        self.assertUnchanged(before, trainer)
        self.assertEqual(trainer.step, 1)

    def test_nan_skip_is_counted_and_training_goes_on(self):
        trainer = self._trained_once(on_nonfinite="skip")
        before = _state(trainer)
        x, y, w = self.batches[1]
        logs = trainer.train_step((np.full_like(x, np.inf), y, w))
        self.assertEqual(logs["skipped_steps"], 1)
        self.assertUnchanged(before, trainer)
        logs = trainer.train_step(self.batches[1])
        self.assertEqual((trainer.step, logs["skipped_steps"]), (2, 1))

    @parameterized.named_parameters(
        ("extra_feature", lambda b: (np.ones((10, 6), np.float32),) + b[1:]),
        ("dict_batch", lambda b: {"x": b[0], "y": b[1]}),
        ("four_parts", lambda b: b + (b[2],)),
        ("parts_disagree_on_batch_size", lambda b: (b[0], b[1][:7], b[2])),
        ("empty_batch", lambda b: tuple(part[:0] for part in b)),
    )
    def test_bad_batch_raises_value_error_and_changes_nothing(self, corrupt):
        trainer = self._trained_once()
        # Tensors shaped as a batch seen before skip the full checks; these must not.
        tensors = tuple(tf.constant(part) for part in self.batches[1])
        trainer.train_step(tensors)
        before = _state(trainer)
        for batch in (self.batches[1], tensors):
            with self.assertRaises(ValueError):
                trainer.train_step(corrupt(batch))
            self.assertUnchanged(before, trainer)


    def test_sample_weights_may_come_and_go(self):
        batches = reference.make_batches(10, num_steps=2)
        batches[1] = batches[1][:2]  # the second batch has no sample weights
        expected = reference.single_device_weights(
            reference.make_model(), keras.optimizers.Adam(0.01), reference.make_loss(), batches)
        trainer = _trainer()
        for batch in batches:
            trainer.train_step(batch)
        for want, got in zip(expected, trainer.model.weights):
            self.assertAllClose(want, got, atol=1e-5)


class BadInputTest(tf.test.TestCase, parameterized.TestCase):

    def test_no_trainable_weights(self):
        model = reference.make_model()
        model.trainable = False
        with self.assertRaisesRegex(ValueError, "no trainable weights"):
            _trainer(model)

    def test_device_that_does_not_exist(self):
        with self.assertRaisesRegex(ValueError, r"CPU:7'\] do not exist"):
            _trainer(devices=DEVICES + ["/device:CPU:7"])

    def test_empty_devices(self):
        with self.assertRaisesRegex(ValueError, "devices is empty"):
            _trainer(devices=[])

    @parameterized.named_parameters(
        ("not_a_model", dict(model=lambda: "mlp"), "keras.Model"),
        ("not_a_loss", dict(loss=lambda: 3), "callable"),
        ("bad_on_nonfinite", dict(on_nonfinite="ignore"), "on_nonfinite must be one of"),
        ("bad_metric", dict(metrics=["no_such_metric"]), "not a keras.metrics.Metric"),
        ("options_not_tower_options", dict(options={"accum_steps": 2}),
         "options must be a towers.TowerOptions"),
        ("options_set_twice", dict(options=towers.TowerOptions(accum_steps=2), accum_steps=3),
         "accum_steps given both as keyword options and in options="),
    )
    def test_bad_constructor_argument(self, kwargs, message):
        kwargs = {k: (v() if callable(v) and k in ("model", "loss") else v)
                  for k, v in kwargs.items()}
        with self.assertRaisesRegex(ValueError, message):
            _trainer(**kwargs)

    def test_a_subclass_built_by_shape_trains_as_keras_fit(self):
        # model.build((None, 4)) builds none of a subclass's layers: they build on the
        # first batch, in Keras's fit as here.
        class Linear(keras.Model):
            def __init__(self):
                super().__init__()
                self.dense = keras.layers.Dense(3)

            def call(self, x):
                return self.dense(x)

        def built():
            keras.utils.set_random_seed(0)
            model = Linear()
            model.build((None, 4))
            return model

        rng = np.random.default_rng(0)
        x, y = rng.normal(size=(7, 4)).astype("float32"), np.arange(7) % 3
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        keras_model = built()
        keras_model.compile(optimizer=keras.optimizers.SGD(0.5), loss=loss)
        expected = [keras_model.train_on_batch(x, y) for _ in range(2)]
        trainer = towers.TowerTrainer(built(), loss, keras.optimizers.SGD(0.5),
                                      devices=DEVICES[:3])
        self.assertAllClose([trainer.train_step((x, y))["loss"] for _ in range(2)], expected,
                            atol=1e-5)
        for want, got in zip(keras_model.get_weights(), trainer.model.get_weights()):
            self.assertAllClose(want, got, atol=1e-5)

    def test_optimizer_that_is_not_keras(self):
        with self.assertRaisesRegex(ValueError, "keras.optimizers.Optimizer, got float"):
            towers.TowerTrainer(reference.make_model(), reference.make_loss(), 0.1,
                                devices=DEVICES)

    @parameterized.named_parameters(
        ("integer_result", lambda y, p: tf.cast(y, tf.int32), "int32"),
        ("scalar_result", lambda y, p: tf.reduce_mean(p), "scalar"),
        ("one_value_for_the_batch", lambda y, p: tf.reduce_mean(p, 0), "shape \\(3,\\)"),
        ("not_a_tensor", lambda y, p: "loss", "per-example losses"),
    )
    def test_loss_with_wrong_result(self, loss, message):
        trainer = _trainer(loss=loss)
        before = _state(trainer)
        with self.assertRaisesRegex(ValueError, message):
            trainer.train_step(reference.make_batches(10, num_steps=1)[0])
        for want, got in zip(before, _state(trainer)):
            self.assertAllEqual(want, got)

    def test_data_ended_without_a_cluster(self):
        with self.assertRaisesRegex(ValueError, "data_ended=True is for a worker of a cluster"):
            _trainer().train_step(reference.make_batches(10, num_steps=1)[0], data_ended=True)

    def test_targets_that_do_not_fit_the_model(self):
        trainer = _trainer()
        x, y, _ = reference.make_batches(10, num_steps=1)[0]
        with self.assertRaisesRegex(ValueError, r"^y, shape \(10,\), does not fit the loss"):
            trainer.train_step((x, y + 7))


class CompilationTest(tf.test.TestCase):

    def test_uneven_and_short_batches_do_not_retrace(self):
        trainer = _trainer()
        for size in (12, 10, 7, 3, 1, 5):
            trainer.train_step(reference.make_batches(size, num_steps=1)[0])
        # The first batch's step traced for its 12 rows, one step for the other batches
        # that give each of the 4 towers a row (10, 7, 5), and one for each batch that
        # leaves a tower without (3, 1): each traced once.
        self.assertEqual(
            [f.experimental_get_tracing_count() for f in trainer._compiled.functions()],
            [1, 1, 1, 1])

    def test_plain_callable_loss_equals_keras_loss(self):
        batches = reference.make_batches(10, num_steps=3)

        def per_example(y_true, y_pred):
            return keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)

        with_callable = _trainer(loss=per_example)
        with_object = _trainer()
        for batch in batches:
            with_callable.train_step(batch)
            with_object.train_step(batch)
        for a, b in zip(with_callable.model.weights, with_object.model.weights):
            self.assertAllClose(a, b, atol=1e-6)


class OptionsTest(tf.test.TestCase):

    def test_tower_options_train_as_the_same_keywords(self):
        """TowerTrainer(options=towers.TowerOptions(...)) is the keyword options in one
        frozen value: the same steps, the same weights."""
        options = dict(accum_steps=2, clip_global_norm=1.0, aggregation="tree")
        x = np.random.default_rng(0).normal(size=(9, reference.NUM_FEATURES)).astype("float32")
        y = np.arange(9) % reference.NUM_CLASSES
        weights = []
        for trainer in (_trainer(**options), _trainer(options=towers.TowerOptions(**options))):
            self.assertEqual(trainer.options, towers.TowerOptions(**options))
            for _ in range(2):
                trainer.train_step((x, y))
            weights.append(trainer.model.get_weights())
        for keywords, given in zip(*weights):
            self.assertAllEqual(keywords, given)


class ImportTest(tf.test.TestCase):

    def test_import_without_tensorflow_says_which_extra(self):
        script = "import sys; sys.modules['tensorflow'] = None; import towers"
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("pip install towers[cpu]", result.stderr.splitlines()[-1])



class StepBytesTest(tf.test.TestCase, parameterized.TestCase):
    """What a 2-tower step moves between devices, measured as TensorFlow sends it
    (benchmarks/harness/transfers.py): the classic algorithm's traffic and no more."""

    @parameterized.named_parameters(
        ("main", {}), ("accumulated", {"accum_steps": 2}),
        ("replicated", {"variable_placement": "replicated"}), ("packed", {"pack_gradients": True}))
    def test_each_weight_out_once_each_gradient_back_once(self, options):
        with tf.device(DEVICES[0]):
            model = reference.make_model()  # 5 -> 6 -> 3: 57 floats, 228 bytes
        trainer = towers.TowerTrainer(model, reference.make_loss(),
                                      reference.OPTIMIZERS["sgd"](), devices=DEVICES[:2],
                                      **options)
        batch = reference.make_batches(8, num_steps=1)[0]
        trainer.train_step(batch)
        moved = transfers.trainer_step_bytes(trainer, batch)["by_pair"]
        shard = 4 * (5 * 4 + 8 + 4)  # tower 1's 4 rows: features, int64 labels, weights
        self.assertEqual(moved, {(DEVICES[0], DEVICES[1]): 228 + shard,
                                 (DEVICES[1], DEVICES[0]): 228 + 4})  # gradients, loss part


if __name__ == "__main__":
    tf.test.main()


def _recording_optimisations(optimised):
    """fn(trainer) making its graph rewrites append to `optimised` the devices of each
    tower trace they optimise, then optimise it."""
    def recording(trainer):
        optimise = trainer.graph_rewrites.optimised_function
        trainer.graph_rewrites.optimised_function = lambda *args: optimised.append(
            args[2]) or optimise(*args)

    return recording


class GraphRewritesTest(tf.test.TestCase, parameterized.TestCase):
    """training/graph_rewrites.py: a trainer's functions are optimised by one grappler
    pass, without the memory and layout optimisers on CPUs, and nothing else is touched;
    on CPUs the tower's work is optimised once and the training step by cheap passes."""

    def _rewrite_options(self):
        config = tf.compat.v1.ConfigProto.FromString(compat.current_call_config())
        return config.graph_options.rewrite_options

    def test_one_pass_and_no_memory_or_layout_optimiser_on_cpus_only_within_calls(self):
        RewriterConfig = graph_rewrites.RewriterConfig
        before = self._rewrite_options()
        with graph_rewrites.GraphRewrites(DEVICES, lambda: False).calls("train"):
            within = self._rewrite_options()
        self.assertEqual(within.meta_optimizer_iterations, RewriterConfig.ONE)
        self.assertEqual(within.memory_optimization, RewriterConfig.NO_MEM_OPT)
        self.assertEqual(within.layout_optimizer, RewriterConfig.OFF)
        self.assertEqual(list(within.optimizers), [])  # tower work not optimised: all passes
        self.assertEqual(self._rewrite_options(), before)  # the thread's own, back

        on_gpu = graph_rewrites.GraphRewrites(DEVICES + ["/device:GPU:0"], lambda: True)
        with on_gpu.calls("train"):
            within = self._rewrite_options()
        self.assertEqual((within.memory_optimization, within.layout_optimizer),
                         (RewriterConfig.DEFAULT_MEM_OPT, RewriterConfig.DEFAULT))
        self.assertEqual(list(within.optimizers), [])
        self.assertIsNone(on_gpu.function_optimiser())
        chosen = RewriterConfig(meta_optimizer_iterations=RewriterConfig.TWO,
                                memory_optimization=RewriterConfig.MANUAL,
                                optimizers=["constfold"])
        graph_rewrites.GraphRewrites(DEVICES, lambda: True).edit(chosen, cheap=True)  # kept
        self.assertEqual((chosen.meta_optimizer_iterations, chosen.memory_optimization,
                          list(chosen.optimizers)),
                         (RewriterConfig.TWO, RewriterConfig.MANUAL, ["constfold"]))

    @parameterized.parameters(False, True)
    def test_cheap_passes_for_steps_whose_tower_work_is_optimised(self, forwards_optimised):
        rewrites = graph_rewrites.GraphRewrites(DEVICES, lambda: True,
                                                lambda: forwards_optimised)
        inference = graph_rewrites.CHEAP_PASSES if forwards_optimised else ()
        for kind, passes in [("train", graph_rewrites.CHEAP_PASSES),
                             ("train_with_empty_parts", graph_rewrites.CHEAP_PASSES),
                             ("train_of_3_rows", graph_rewrites.CHEAP_PASSES),
                             ("steps", graph_rewrites.CHEAP_PASSES), ("eval", inference),
                             ("eval_of_3_rows", inference), ("predict", inference)]:
            with rewrites.calls(kind):
                options = self._rewrite_options()
                self.assertEqual(tuple(options.optimizers), passes, kind)
                self.assertEqual(options.disable_tfg_optimizer, bool(passes), kind)

    def test_tower_work_on_cpus_is_optimised_once_and_trains_as_keras(self):
        """Four towers call copies of one optimised trace (an LSTM's while loop and a
        convolution in it); the steps, optimised by the cheap passes, equal Keras's."""
        optimised = []
        trainer = self._assert_trains_as_keras(reference.make_conv_lstm_model, (8, 6, 4),
                                               DEVICES[:4], _recording_optimisations(optimised))
        self.assertTrue(trainer.setup.compiled_tower.optimised)
        self.assertEqual(optimised, [[DEVICES[0]]])  # once, for tower 0

    def test_a_channels_first_convolution_on_cpus_trains_as_keras(self):
        """Without the layout optimiser, which a CPU step does not need (NCHW included)."""
        def model():
            keras.utils.set_random_seed(0)
            return keras.Sequential([
                keras.Input((2, 6, 6)), keras.layers.Conv2D(3, 3, data_format="channels_first"),
                keras.layers.MaxPooling2D(data_format="channels_first"), keras.layers.Flatten(),
                keras.layers.Dense(reference.NUM_CLASSES)])

        self._assert_trains_as_keras(model, (6, 2, 6, 6), DEVICES[:2])

    def test_pipeline_stage_work_on_cpus_is_optimised_once_and_trains_as_keras(self):
        """Two towers of two stages, two micro-batches each: every stage's forward and
        backward (the last stage's: one function) is optimised once, for tower 0's device
        for the stage, whichever tower and micro-batch calls it; the steps equal Keras's, a
        batch that leaves a micro-batch empty (a tower of 1 row: one micro-batch) too."""
        for rows, optimisations in [(8, [[DEVICES[0]]] * 2 + [[DEVICES[1]]]), (3, None)]:
            optimised = []
            trainer = self._assert_trains_as_keras(
                reference.make_conv_lstm_model, (rows, 6, 4), [DEVICES[:2], DEVICES[2:4]],
                _recording_optimisations(optimised), pipeline_cuts=["conv"], micro_batches=2)
            self.assertTrue(trainer.setup.compiled_tower.optimised)
            if optimisations:  # stage 0's forward and backward on D0, stage 1's on D1
                self.assertEqual(sorted(optimised), optimisations)

    def _assert_trains_as_keras(self, model, x_shape, devices, before=lambda trainer: None,
                                **options):
        """Two batches of x_shape (rows first): a TowerTrainer of model() on `devices`
        (given `options`; before(trainer) first) ends with the weights Keras's
        train_on_batch gives on one device; returns the trainer."""
        rng = np.random.default_rng(0)
        batches = [(rng.normal(size=x_shape).astype("float32"),
                    rng.integers(0, reference.NUM_CLASSES, size=(x_shape[0],)))
                   for _ in range(2)]
        trainer = towers.TowerTrainer(model(), reference.make_loss(),
                                      keras.optimizers.SGD(0.1), devices=devices, **options)
        before(trainer)
        expected = model()
        expected.compile(keras.optimizers.SGD(0.1), reference.make_loss())
        for x, y in batches:
            trainer.train_step((x, y))
            expected.train_on_batch(x, y)
        for want, got in zip(expected.get_weights(), trainer.model.get_weights()):
            self.assertAllClose(want, got, atol=1e-6)
        return trainer

    def test_the_loop_calls_the_step_traced_before_and_equals_single_steps(self):
        """An in-graph loop calls the step the first call traced for its batches: the
        model's Python runs in no trace of the loop."""
        seen = []

        class Recording(keras.layers.Layer):
            def call(inner, x):
                if tf.is_symbolic_tensor(x):  # a trace's call, not an eager check's
                    seen.append(x)
                return x

        def model():
            keras.utils.set_random_seed(0)
            return keras.Sequential([keras.Input((reference.NUM_FEATURES,)), Recording(),
                                     keras.layers.Dense(reference.NUM_CLASSES)])

        batches = reference.make_batches(12, num_steps=3)
        looped, single = _trainer(model()), _trainer(model())
        dataset = tf.data.Dataset.from_tensor_slices(
            tuple(np.concatenate(part) for part in zip(*batches)))
        iterator = iter(dataset.batch(12))
        looped.train_steps(iterator, 2)  # the first call: one step, set up and traced
        calls_before_the_loop = len(seen)
        while looped.train_steps(iterator, 2)["steps"]:
            pass
        self.assertLen(seen, calls_before_the_loop)
        for batch in batches:
            single.train_step(batch)
        for want, got in zip(single.model.weights, looped.model.weights):
            self.assertAllClose(want, got, atol=1e-6)


class CountedCalls(keras.layers.Layer):
    """The identity, counting its Python calls: each trace of a forward calls it once."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.supports_masking, self.calls = True, 0

    def call(self, x):
        self.calls += 1
        return x


class TracedOnceTest(tf.test.TestCase, parameterized.TestCase):
    """A tower's work is traced once for every tower (engine/tower.py compiled_tower;
    with split layers, each other tower calls a copy of the trace, tower_trace.py): a
    layer is called as often at 2 towers as at 1, and the steps equal Keras's."""

    def _model(self, kind):
        keras.utils.set_random_seed(0)
        masked = "masked" in kind
        inputs = keras.Input((3, reference.NUM_FEATURES) if masked else (reference.NUM_FEATURES,))
        hidden = keras.layers.Masking()(inputs) if masked else inputs
        hidden = keras.layers.Dense(8, activation="relu", name="up")(CountedCalls()(hidden))
        hidden = keras.layers.Dense(7, activation="tanh", name="down")(hidden)
        return keras.Model(inputs, keras.layers.Dense(reference.NUM_CLASSES, name="out")(hidden))

    def _batches(self, kind):
        batches = reference.make_batches(8, num_steps=2, sample_weights=False)
        if "masked" not in kind:
            return batches
        rng = np.random.default_rng(3)
        x = rng.normal(size=(2, 8, 3, reference.NUM_FEATURES)).astype("float32")
        x[:, :, 2] = 0.0  # every row's last token masked: a counted denominator
        y = rng.integers(0, reference.NUM_CLASSES, size=(2, 8, 3))
        return list(zip(x, y))

    def _trained(self, kind, num_towers):
        model, devices, options = self._model(kind), DEVICES[:num_towers], {}
        if kind == "split_layers":  # 2 parts per tower
            devices = [DEVICES[2 * i:2 * i + 2] for i in range(num_towers)]
            model = towers.split_layers(model, {"up": "column", "down": "row"}, devices[0])
        elif kind == "pipeline":
            devices = [DEVICES[2 * i:2 * i + 2] for i in range(num_towers)]
            options = {"pipeline_cuts": ["up"], "micro_batches": 2}
        elif kind.startswith("split_pipeline"):  # 2 stages x 2 parts
            devices = SWAPPED_GRID[:num_towers]
            options = {"pipeline_cuts": ["up"], "micro_batches": 2}
            model = towers.split_layers(model, {"up": "column", "down": "row"},
                                        SWAPPED_GRID[0][0])
        trainer = towers.TowerTrainer(model, reference.make_loss(), keras.optimizers.SGD(0.1),
                                      devices=devices, **options)
        for batch in self._batches(kind):
            trainer.train_step(batch)
        counted = next(layer for layer in model.layers if isinstance(layer, CountedCalls))
        return trainer, counted.calls

    @parameterized.named_parameters(
        (kind, kind) for kind in ("plain", "split_layers", "masked_loss", "pipeline",
                                  "split_pipeline", "split_pipeline_masked_loss"))
    def test_layer_calls_do_not_grow_with_towers(self, kind):
        (_, one_tower_calls), (trainer, calls) = (self._trained(kind, n) for n in (1, 2))
        self.assertEqual(calls, one_tower_calls)
        expected = self._model(kind)
        expected.compile(keras.optimizers.SGD(0.1), reference.make_loss())
        for x, y in self._batches(kind):
            expected.train_on_batch(x, y)
        model = towers.join_layers(trainer.model) if "split" in kind else trainer.model
        for want, got in zip(expected.get_weights(), model.get_weights()):
            self.assertAllClose(want, got, atol=1e-6)
        if kind.startswith("split_pipeline"):
            self._assert_stages_on_their_parts(trainer)

    @parameterized.named_parameters(
        (kind, kind, rows, new_calls) for kind, rows, new_calls in (
            ("plain", 1, 0), ("split_layers", 1, 0), ("masked_loss", 1, 0),
            ("pipeline", 3, 0), ("split_pipeline", 3, 1), ("split_pipeline_masked_loss", 3, 0)))
    def test_a_batch_that_leaves_micro_batches_empty_skips_them_as_traced(self, kind, rows,
                                                                           new_calls):
        """2 towers (of 2 micro-batches where pipelined), a batch of other rows (the step
        for any rows), then a batch of `rows`, too few for every micro-batch: its step is
        traced for those rows, with no tf.cond. A tower of no rows is left out, one of 1
        row runs 1 micro-batch; the towers' work traced for any rows is called again (the
        layer's Python runs only where a tower is traced whole, for its 1 micro-batch),
        and the steps equal Keras's."""
        trainer, _ = self._trained(kind, 2)
        other_rows = tuple(part[:6] for part in self._batches(kind)[1])
        trainer.train_step(other_rows)  # the step for any rows: its towers' work too
        counted = next(layer for layer in trainer.model.layers
                       if isinstance(layer, CountedCalls))
        calls = counted.calls
        x, y = (part[:rows] for part in self._batches(kind)[0])
        trainer.train_step((x, y))
        self.assertEqual(counted.calls - calls, new_calls)
        conds = {key[0]: sum(node.op in ("If", "StatelessIf")
                             for node in reference.function_nodes(concrete))
                 for key, concrete in trainer._compiled._graphs.items()}
        self.assertEqual(conds, {"train_of_8_rows": 1, "train": 1,  # apply if finite
                                 f"train_of_{rows}_rows": 1})
        expected = self._model(kind)
        expected.compile(keras.optimizers.SGD(0.1), reference.make_loss())
        for batch_x, batch_y in self._batches(kind) + [other_rows, (x, y)]:
            expected.train_on_batch(batch_x, batch_y)
        model = towers.join_layers(trainer.model) if "split" in kind else trainer.model
        for want, got in zip(expected.get_weights(), model.get_weights()):
            self.assertAllClose(want, got, atol=1e-6)

    @parameterized.named_parameters(
        (kind, kind) for kind in ("plain", "split_layers", "pipeline", "split_pipeline"))
    def test_a_step_is_traced_for_its_batchs_rows_until_other_rows_come(self, kind):
        """The first batches (8 rows) take a step traced for their rows, its shapes all
        known (no Shape op left); the first batch of other rows (6) takes one for any
        rows, which a batch of 4 calls too, its Python not run again; the steps equal
        Keras's train_on_batch."""
        trainer, calls = self._trained(kind, 2)
        counted = next(layer for layer in trainer.model.layers
                       if isinstance(layer, CountedCalls))
        x, y = self._batches(kind)[0]
        new_calls = {}
        for rows in (6, 4, 8):
            trainer.train_step((x[:rows], y[:rows]))
            new_calls[rows] = counted.calls - calls
        self.assertGreater(new_calls[6], 0)
        self.assertEqual(new_calls[4], new_calls[6])
        self.assertEqual(new_calls[8], new_calls[6])
        shape_ops = {key[0]: sum(node.op == "Shape" for node in reference.function_nodes(concrete))
                     for key, concrete in trainer._compiled._graphs.items()}
        self.assertEqual(set(shape_ops), {"train_of_8_rows", "train"})
        self.assertEqual(shape_ops["train_of_8_rows"], 0)
        self.assertGreater(shape_ops["train"], 0)
        expected = self._model(kind)
        expected.compile(keras.optimizers.SGD(0.1), reference.make_loss())
        for batch_x, batch_y in self._batches(kind) + [(x[:r], y[:r]) for r in (6, 4, 8)]:
            expected.train_on_batch(batch_x, batch_y)
        model = towers.join_layers(trainer.model) if "split" in kind else trainer.model
        for want, got in zip(expected.get_weights(), model.get_weights()):
            self.assertAllClose(want, got, atol=1e-6)

    @parameterized.named_parameters(("dataset_of_a_short_last_batch", 22, False),
                                     ("arrays_in_even_batches", 24, True))
    def test_fit_traces_for_the_rows_only_where_its_data_keeps_them(self, rows, keeps):
        """fit, evaluate and predict on data whose batches keep their rows (arrays dividing
        evenly) trace their steps for them; on a dataset whose last batch is short
        (element_spec dim 0 unknown), one step for any rows from the first batch, which
        the last calls too. The weights, loss and outputs equal Keras's."""
        x, y = reference.make_batches(rows, num_steps=1, sample_weights=False)[0]
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
        data, batch_size = ((x, y), 8) if keeps else ((dataset,), None)
        trainer = towers.TowerTrainer(self._model("plain"), reference.make_loss(),
                                      keras.optimizers.SGD(0.1), devices=DEVICES[:2])
        trainer.fit(*data, batch_size=batch_size, shuffle=False, verbose=0)
        loss = trainer.evaluate(*data, batch_size=batch_size, verbose=0)["loss"]
        predicted = trainer.predict(data[0] if keeps else dataset.map(lambda x, y: x),
                                    batch_size=batch_size, verbose=0)
        kinds = ["train", "eval", "predict"]
        self.assertEqual([key[0] for key in trainer._compiled._graphs],
                         [f"{kind}_of_8_rows" for kind in kinds] if keeps else kinds)
        expected = self._model("plain")
        expected.compile(keras.optimizers.SGD(0.1), reference.make_loss())
        expected.fit(x, y, batch_size=8, shuffle=False, verbose=0)
        for want, got in zip(expected.get_weights(), trainer.model.get_weights()):
            self.assertAllClose(want, got, atol=1e-6)
        self.assertAllClose(expected.evaluate(x, y, batch_size=8, verbose=0), loss, atol=1e-6)
        self.assertAllClose(expected.predict(x, batch_size=8, verbose=0), predicted, atol=1e-6)

    @parameterized.named_parameters(
        (kind, kind) for kind in ("plain", "split_layers", "masked_loss", "pipeline",
                                  "split_pipeline"))
    def test_evaluation_and_prediction_trace_the_forward_once_and_equal_keras(self, kind):
        """An eval and a predict step trace each stage's forward once for every tower, as
        at 1 tower (split layers: each other tower calls a copy naming its own part
        devices), and give Keras's loss and outputs."""
        x, y = self._batches(kind)[1]
        new_calls = []
        for num_towers in (1, 2):
            trainer, calls = self._trained(kind, num_towers)
            logs = trainer.eval_step((x, y))
            predicted = trainer.predict_on_batch(x)
            counted = next(layer for layer in trainer.model.layers
                           if isinstance(layer, CountedCalls))
            new_calls.append(counted.calls - calls)
        self.assertEqual(new_calls[1], new_calls[0])
        if "split" in kind:  # tower 1 multiplies on its own parts' devices
            placed = {canonical_name(node.device)
                      for key, concrete in trainer._compiled._graphs.items()
                      if key[0].startswith("predict")
                      for node in reference.function_nodes(concrete)
                      if node.name.startswith("tower_1/") and "MatMul" in node.op}
            self.assertTrue(placed)
            self.assertLessEqual(placed, {canonical_name(device) for device in
                                          tf.nest.flatten(trainer.setup.mesh.parts[1])})
        expected = self._model(kind)
        expected.compile(keras.optimizers.SGD(0.1), reference.make_loss())
        for batch_x, batch_y in self._batches(kind):
            expected.train_on_batch(batch_x, batch_y)
        self.assertAllClose(expected.evaluate(x, y, verbose=0), logs["loss"], atol=1e-6)
        self.assertAllClose(expected.predict_on_batch(x), predicted, atol=1e-6)

    def _assert_stages_on_their_parts(self, trainer):
        """Each tower's stage work (what each forward and backward of its flight runs,
        inside the functions its calls call) runs on that tower's devices for the
        stage's parts: tower 1's copies renamed, not tower 0's devices."""
        placed = collections.defaultdict(set)
        for node in reference.traced_nodes(trainer):
            found = re.search(r"tower_(\d)/(?:.*/)?stage_(\d)_(?:forward|backward)_\d+/",
                              node.name)
            if found and node.device:
                placed[int(found[1]), int(found[2])].add(canonical_name(node.device))
        self.assertEqual(
            dict(placed), {(i, k): {canonical_name(d) for d in SWAPPED_GRID[i][k]}
                           for i in range(2) for k in range(2)})
