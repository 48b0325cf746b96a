"""Pipeline stages: cutting a model, the schedules, and a grid of towers x stages
that updates the weights exactly as one device does on the whole batch."""

import functools

import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import towers
from benchmarks.harness import transfers
from tests import reference
from towers.engine import losses, tower
from towers.model_parallel import schedule, stages as stages_lib
from towers.training.checkpoint import Checkpointer

CPU = [f"/device:CPU:{i}" for i in range(4)]
TOLERANCE = 1e-5
VOCAB, TOKENS = 12, 3
# (name, grid of devices: one row per tower, one column per stage, cuts)
GRIDS = {
    "1x2": ([CPU[:2]], ["hidden"]),
    "1x3": ([CPU[:3]], ["hidden", "middle"]),    # "hidden" skips over stage 1 to stage 2
    "2x2": ([CPU[:2], CPU[2:]], ["hidden"]),
}


def _model(seed=0):
    """Features and tokens -> logits: an embedding first, an L2 layer, a skip connection.

    Layers in order: features, tokens, embedding, flat, join, hidden (L2),
    middle, skip (hidden + middle), logits.
    """
    keras.utils.set_random_seed(seed)
    features = keras.Input((reference.NUM_FEATURES,), name="features")
    tokens = keras.Input((TOKENS,), dtype="int32", name="tokens")
    embedded = keras.layers.Flatten(name="flat")(
        keras.layers.Embedding(VOCAB, 2, name="embedding")(tokens))
    joined = keras.layers.Concatenate(name="join")([features, embedded])
    hidden = keras.layers.Dense(6, activation="tanh", name="hidden",
                                kernel_regularizer=keras.regularizers.L2(0.01))(joined)
    middle = keras.layers.Dense(6, activation="tanh", name="middle")(hidden)
    skip = keras.layers.Add(name="skip")([hidden, middle])
    logits = keras.layers.Dense(reference.NUM_CLASSES, name="logits")(skip)
    return keras.Model([features, tokens], logits)


def _batches(global_batch_size, num_steps=5):
    rng = np.random.default_rng(global_batch_size)
    return [((x, rng.integers(0, VOCAB, (global_batch_size, TOKENS)).astype(np.int32)), y, w)
            for x, y, w in reference.make_batches(global_batch_size, num_steps, seed=3)]


@functools.lru_cache(maxsize=None)
def _one_device(optimizer_name, global_batch_size):
    """Weights after a plain GradientTape loop on whole batches (computed once per case)."""
    return reference.single_device_weights(_model(), reference.OPTIMIZERS[optimizer_name](),
                                           reference.make_loss(), _batches(global_batch_size))


def _trainer(grid_name, optimizer_name="sgd", model=None, **options):
    devices, cuts = GRIDS[grid_name]
    return towers.TowerTrainer(model or _model(), reference.make_loss(),
                               reference.OPTIMIZERS[optimizer_name](), devices=devices,
                               pipeline_cuts=cuts, **options)


class SplitModelTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.parameters(["hidden"], ["hidden", "middle"], ["flat", "join", "skip"])
    def test_chained_stages_compute_the_model(self, *cuts):
        model = _model()
        x, _, _ = _batches(4)[0]
        stages = towers.split_model(model, list(cuts))
        self.assertLen(stages, len(cuts) + 1)
        values = x
        for stage in stages:
            values = stage(values)
        self.assertAllClose(model(x), values, atol=1e-6)
        shared = {id(v) for stage in stages for v in stage.weights}
        self.assertEqual(shared, {id(v) for v in model.weights})

    def test_sequential(self):
        model = reference.make_model()
        first, second = towers.split_model(model, [model.layers[0].name])
        x = reference.make_batches(3)[0][0]
        self.assertAllClose(model(x), second(first(x)), atol=1e-6)

    @parameterized.named_parameters(
        ("unknown", ["nope"], "'nope' is not the name of a layer"),
        ("repeated", ["hidden", "hidden"], "name a layer twice"),
        ("out_of_order", ["middle", "hidden"], "not in the order of the model's layers"),
        ("empty_last_stage", ["logits"], "leave stage 1 .* without layers"),
        ("after_an_input", ["features"], "'features' is an input"))
    def test_bad_cuts(self, cuts, message):
        with self.assertRaisesRegex(ValueError, message):
            towers.split_model(_model(), cuts)

    def test_subclassed_model_is_refused(self):
        model = reference.subclassed_model()
        with self.assertRaisesRegex(ValueError, "subclassed keras.Model.*no graph of layers"):
            towers.split_model(model, ["dense"])


class ScheduleTest(tf.test.TestCase, parameterized.TestCase):

    def test_timetables_read_like_the_papers(self):
        def text(orders):
            return [" ".join(f"{a.kind}{a.micro_batch}" for a in order) for order in orders]

        self.assertEqual(text(schedule.gpipe(2, 3)), ["F0 F1 F2 B0 B1 B2"] * 2)
        self.assertEqual(text(schedule.one_f_one_b(2, 3)),
                         ["F0 F1 B0 F2 B1 B2", "F0 B0 F1 B1 F2 B2"])

    @parameterized.product(name=schedule.SCHEDULES, num_stages=[1, 2, 4], micro_batches=[1, 4, 8])
    def test_bubble_and_memory(self, name, num_stages, micro_batches):
        orders = schedule.make(name, num_stages, micro_batches)
        ticks = schedule.timetable(orders)
        # Ideal length: 2 (M + K - 1) ticks, so the idle share is (K - 1) / (M + K - 1).
        self.assertLen(ticks, 2 * (micro_batches + num_stages - 1))
        for k, order in enumerate(orders):
            in_flight = np.cumsum([1 if a.kind == schedule.FORWARD else -1 for a in order])
            bound = micro_batches if name == "gpipe" else min(micro_batches, num_stages - k)
            self.assertEqual(in_flight.max(), bound)

    def test_unknown_schedule(self):
        with self.assertRaisesRegex(ValueError, "pipeline_schedule must be one of"):
            _trainer("1x2", pipeline_schedule="zigzag")


class PipelineEquivalenceTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.named_parameters(
        (f"{grid}_m{m}_batch{b}_{opt}_{name}", grid, m, b, opt, name)
        for name in schedule.SCHEDULES
        for grid, m, b, opt in [("1x2", 1, 12, "sgd"), ("1x2", 3, 10, "adam"),
                                ("1x3", 4, 12, "adam"), ("1x3", 3, 7, "sgd"),
                                ("2x2", 4, 10, "adam"), ("2x2", 3, 12, "sgd"),
                                ("1x2", 4, 3, "adam")])
    def test_five_steps_match_one_device(self, grid, micro_batches, global_batch_size,
                                         optimizer_name, schedule_name):
        # 10 over 2 towers x 4 micro-batches: micro-batches of 2, 1, 1, 1; 7 over 3: 3, 2, 2;
        # 3 over 4: 1, 1, 1 and an empty one.
        model = _model()
        trainer = _trainer(grid, optimizer_name, model, micro_batches=micro_batches,
                           pipeline_schedule=schedule_name)
        for batch in _batches(global_batch_size):
            trainer.train_step(batch)
        self.assertEqual(trainer.step, 5)
        for want, got in zip(_one_device(optimizer_name, global_batch_size), model.weights):
            self.assertAllClose(want, got, atol=TOLERANCE, rtol=TOLERANCE, msg=got.path)

    def test_an_in_graph_loop_of_batches_leaving_micro_batches_empty_equals_single_steps(self):
        """3 rows over 2 towers x 2 micro-batches (1, 1, 1 and an empty one), two steps a
        call against one: the loop's step, whose stage forward returns rows of unknown
        size (a recurrent layer's), checks each loss against its labels' rows; as Keras's."""
        model = reference.make_conv_lstm_model
        rng = np.random.default_rng(0)
        x = rng.normal(size=(3, 6, 4)).astype(np.float32)
        y = rng.integers(0, reference.NUM_CLASSES, size=(3,))
        trained = []
        for steps_per_execution in (1, 2):
            trainer = towers.TowerTrainer(
                model(), reference.make_loss(), keras.optimizers.SGD(0.1),
                devices=GRIDS["2x2"][0], pipeline_cuts=["conv"], micro_batches=2,
                steps_per_execution=steps_per_execution)
            trainer.fit(x, y, batch_size=3, epochs=3, verbose=0)
            trained.append(trainer.model.get_weights())
        keras_model = model()
        keras_model.compile(keras.optimizers.SGD(0.1), reference.make_loss())
        keras_model.fit(x, y, batch_size=3, epochs=3, verbose=0)
        for single, looped, want in zip(*trained, keras_model.get_weights()):
            self.assertAllEqual(single, looped)
            self.assertAllClose(want, looped, atol=TOLERANCE, rtol=TOLERANCE)

    @parameterized.parameters(("tree", False), ("collective", True), ("main", True))
    def test_aggregations_per_stage(self, aggregation, pack_gradients):
        model = _model()
        trainer = _trainer("2x2", "adam", model, micro_batches=2, aggregation=aggregation,
                           pack_gradients=pack_gradients)
        for batch in _batches(10):
            trainer.train_step(batch)
        for want, got in zip(_one_device("adam", 10), model.weights):
            self.assertAllClose(want, got, atol=TOLERANCE, rtol=TOLERANCE, msg=got.path)

    def test_clip_global_norm_over_all_stages(self):
        batches = _batches(8, num_steps=3)
        expected, optimizer, loss = _model(), keras.optimizers.SGD(0.5), reference.make_loss()
        for x, y, w in batches:
            with tf.GradientTape() as tape:
                value = loss(y, expected(x, training=True), sample_weight=w) \
                    + tf.add_n(expected.losses)
            # The dense gradients: tf.clip_by_global_norm would square an embedding's
            # IndexedSlices row by row, repeated ids apart.
            grads, norm = tf.clip_by_global_norm(
                [tf.convert_to_tensor(g)
                 for g in tape.gradient(value, expected.trainable_variables)], 0.05)
            self.assertGreater(float(norm), 0.05)  # the clip really bites
            optimizer.apply_gradients(zip(grads, expected.trainable_variables))
        model = _model()
        trainer = towers.TowerTrainer(model, loss, keras.optimizers.SGD(0.5),
                                      devices=GRIDS["1x3"][0], pipeline_cuts=GRIDS["1x3"][1],
                                      micro_batches=2, clip_global_norm=0.05)
        for batch in batches:
            trainer.train_step(batch)
        for want, got in zip(expected.weights, model.weights):
            self.assertAllClose(want, got, atol=TOLERANCE, rtol=TOLERANCE, msg=got.path)

    def test_batchnorm_statistics_per_micro_batch(self):
        # The reference does what the pipeline does: each micro-batch's forward
        # in turn (BatchNorm normalises with that micro-batch's statistics and
        # moves its averages), gradients weighted by micro-batch size.
        def bn_model():
            keras.utils.set_random_seed(0)
            x = keras.Input((reference.NUM_FEATURES,))
            h = keras.layers.Dense(6, name="first")(x)
            h = keras.layers.BatchNormalization(momentum=0.5, name="bn")(h)
            h = keras.layers.Activation("relu", name="relu")(h)
            return keras.Model(x, keras.layers.Dense(reference.NUM_CLASSES)(h))

        batches = reference.make_batches(10, num_steps=3)
        expected, optimizer, loss = bn_model(), keras.optimizers.SGD(0.1), reference.make_loss()
        for x, y, w in batches:
            grads = None
            for rows in np.array_split(np.arange(10), 3):  # micro-batches of 4, 3, 3
                with tf.GradientTape() as tape:
                    value = loss(y[rows], expected(x[rows], training=True),
                                 sample_weight=w[rows]) * len(rows) / 10
                micro = tape.gradient(value, expected.trainable_variables)
                grads = micro if grads is None else [a + b for a, b in zip(grads, micro)]
            optimizer.apply_gradients(zip(grads, expected.trainable_variables))
        model = bn_model()
        trainer = towers.TowerTrainer(model, loss, keras.optimizers.SGD(0.1), devices=[CPU[:2]],
                                      pipeline_cuts=["first"], micro_batches=3,
                                      pipeline_schedule="1f1b")
        for batch in batches:
            trainer.train_step(batch)
        for want, got in zip(expected.weights, model.weights):
            self.assertAllClose(want, got, atol=TOLERANCE, rtol=TOLERANCE, msg=got.path)

    def test_mixed_float16_one_loss_scale(self):
        keras.mixed_precision.set_global_policy("mixed_float16")
        self.addCleanup(keras.mixed_precision.set_global_policy, "float32")
        batches, loss = _batches(8, num_steps=3), reference.make_loss()
        expected = _model()
        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
        for x, y, w in batches:
            with tf.GradientTape() as tape:
                value = loss(y, expected(x, training=True), sample_weight=w) \
                    + tf.add_n(expected.losses)
                scaled = optimizer.scale_loss(value)
            optimizer.apply_gradients(zip(tape.gradient(scaled, expected.trainable_variables),
                                          expected.trainable_variables))
        model = _model()
        trainer = towers.TowerTrainer(model, loss, keras.optimizers.SGD(0.1), devices=[CPU[:2]],
                                      pipeline_cuts=["hidden"], micro_batches=2)
        for batch in batches:
            logs = trainer.train_step(batch)
        self.assertIsInstance(trainer.optimizer, keras.optimizers.LossScaleOptimizer)
        self.assertEqual(logs["loss_scale"], float(optimizer.dynamic_scale))
        for want, got in zip(expected.weights, model.weights):
            self.assertAllClose(want, got, atol=2e-3, rtol=2e-3, msg=got.path)


class PipelineEvaluateTest(tf.test.TestCase):

    def test_evaluate_and_metrics_equal_the_whole_model(self):
        model = _model()
        trainer = _trainer("2x2", model=model, micro_batches=2, metrics=["accuracy"])
        trainer.train_step(_batches(10)[0])
        x, y, w = _batches(9)[1]
        logs = trainer.evaluate((x, y, w))
        logits = model(x, training=False)
        expected = reference.make_loss()(y, logits, sample_weight=w) + tf.add_n(model.losses)
        self.assertAllClose(logs["loss"], expected, atol=TOLERANCE)
        # As keras.Model.compile's `metrics`: masked, not sample-weighted.
        self.assertAllClose(logs["accuracy"], np.mean(np.argmax(logits, -1) == y))


class PipelineDropoutTest(tf.test.TestCase):

    def test_each_tower_and_micro_batch_draws_its_own_reproducible_mask(self):
        keras.utils.set_random_seed(0)
        x = keras.Input((8,))
        h = keras.layers.Dense(8, kernel_initializer="ones", name="first")(x)
        model = keras.Model(x, keras.layers.Dropout(0.5, seed=1, name="drop")(h))
        stages = stages_lib.Stages(model, ["first"])
        shard = (np.ones((2, 8), np.float32), np.zeros((2, 8), np.float32))

        def outputs(tower_index):  # two micro-batches of one identical row each
            step = tower.StepWork(stages, losses.Objective(keras.losses.MeanSquaredError()),
                                  tf.constant(2.0), micro_batches=2)
            result = tower.run_tower(step, tower.TowerWork(
                shard, 2, [v.value for v in model.trainable_variables],
                [v.value for v in model.non_trainable_variables], CPU[:2], tower_index))
            return result.y_pred[0].numpy()  # (outputs, masks)

        tower_0, tower_1 = outputs(0), outputs(1)
        masks = [row != 0 for row in np.concatenate([tower_0, tower_1])]
        for i in range(4):
            for j in range(i):  # (tower, micro-batch) pairs: no two masks alike
                self.assertNotAllEqual(masks[i], masks[j])
        self.assertGreater(np.mean(tower_0 == 0), 0.2)  # dropout really dropped units
        self.assertAllEqual(tower_0, outputs(0))


class PipelinePlacementTest(tf.test.TestCase):

    def _assert_placed(self, trainer, model, stage_devices):
        stages = stages_lib.Stages(model, trainer.pipeline_cuts)
        slots = trainer.optimizer.variables
        for stage, device in zip(stages.models, stage_devices):
            for variable in stage.trainable_variables:
                self.assertEqual(towers.devices.canonical_name(variable.value.device), device,
                                 variable.path)
                prefix = variable.path.replace("/", "_") + "_"
                own = [s for s in slots if s.name.startswith(prefix)
                       and s.name[len(prefix):] in ("momentum", "velocity")]
                self.assertNotEmpty(own, variable.path)
                for slot in own:
                    self.assertEqual(towers.devices.canonical_name(slot.value.device), device,
                                     slot.path)

    def test_a_step_moves_only_what_crosses_the_cut(self):
        # Measured as TensorFlow sends them (benchmarks/harness/transfers.py): per
        # micro-batch of 4 rows the 6 activations per row at the cut and their
        # gradients (float32), the labels (int64) and sample weights the last stage's
        # loss reads, and stage 0's scalar share of the regularisation; once, the
        # learning rate to stage 1's 2 variables (the batch's row count, known when the
        # step is traced, is a constant on each stage). Nothing of the gradients: each
        # stage's micro-batch sums and its update stay on its device.
        with tf.device(CPU[0]):
            model = reference.make_model()
        trainer = towers.TowerTrainer(model, reference.make_loss(), reference.OPTIMIZERS["sgd"](),
                                      devices=[CPU[:2]], pipeline_cuts=[model.layers[0].name],
                                      micro_batches=2)
        batch = reference.make_batches(8, num_steps=1)[0]
        trainer.train_step(batch)
        per_micro_batch = 4 * (2 * 6 * 4 + 8 + 4) + 4
        self.assertEqual(transfers.trainer_step_bytes(trainer, batch)["total"],
                         2 * per_micro_batch + 2 * 4)

    def test_each_stage_lives_on_its_main_device(self):
        with tf.device(CPU[0]):  # built on one device, as users build models
            model = _model()
        trainer = _trainer("2x2", "adam", model, micro_batches=2)
        trainer.train_step(_batches(6)[0])
        self.assertEqual(trainer.num_stages, 2)
        self._assert_placed(trainer, model, CPU[:2])

    def test_checkpoint_resumes_every_stage_on_its_device(self):
        model = _model()
        trainer = _trainer("1x3", "adam", model, micro_batches=2)
        for batch in _batches(6, num_steps=2):
            trainer.train_step(batch)
        directory = self.get_temp_dir()
        Checkpointer(directory, model, trainer.optimizer).save(0, 2)
        restored_model = _model(seed=7)
        restored = _trainer("1x3", "adam", restored_model, micro_batches=2)
        restored.optimizer.build(restored_model.trainable_variables)
        self.assertTrue(Checkpointer(directory, restored_model,
                                                       restored.optimizer).restore())
        self._assert_placed(restored, restored_model, CPU[:3])
        self.assertEqual(restored.step, 2)
        for want, got in zip(model.weights, restored_model.weights):
            self.assertAllEqual(want, got)

    def test_nonfinite_step_changes_nothing_on_any_stage(self):
        model = _model()
        trainer = _trainer("1x3", "adam", model, micro_batches=2)
        (x, tokens), y, w = _batches(6)[0]
        trainer.train_step(((x, tokens), y, w))
        before = [v.numpy() for v in model.weights + trainer.optimizer.variables]
        x = x.copy()
        x[5, 0] = np.nan  # the last micro-batch only
        with self.assertRaisesRegex(towers.NonFiniteError, "nothing was applied"):
            trainer.train_step(((x, tokens), y, w))
        for want, got in zip(before, model.weights + trainer.optimizer.variables):
            self.assertAllEqual(want, got, msg=got.path)


    def test_model_and_optimizer_handed_back_to_keras_are_as_given(self):
        # The trainer updates each stage on its device only while it traces its step:
        # afterwards plain Keras (or tf.distribute, whose all-reduce of gradients the
        # trainer skips) gets the optimizer's own methods.
        model, optimizer = _model(), reference.OPTIMIZERS["adam"]()
        trainer = towers.TowerTrainer(model, reference.make_loss(), optimizer,
                                      devices=GRIDS["1x2"][0], pipeline_cuts=GRIDS["1x2"][1])
        for batch in _batches(6, num_steps=2):
            trainer.train_step(batch)
        updated_on = {towers.devices.canonical_name(node.device)
                      for node in reference.traced_nodes(trainer)
                      if node.op == "AssignSubVariableOp"}
        self.assertEqual(updated_on, set(CPU[:2]))  # its step: each stage's on its device
        self.assertNotIn("update_step", vars(optimizer))
        self.assertNotIn("_all_reduce_sum_gradients", vars(optimizer))
        copy, copy_optimizer = reference.untouched_copy(model, optimizer, _model)
        batch = _batches(6)[0]
        for want, got in zip(
                reference.plain_keras_steps(copy, copy_optimizer, reference.make_loss(), batch),
                reference.plain_keras_steps(model, optimizer, reference.make_loss(), batch)):
            self.assertAllEqual(want, got)


class PipelineBadInputTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.named_parameters(
        ("flat_devices", dict(devices=CPU[:2]), "devices must be a grid"),
        ("ragged_rows", dict(devices=[CPU[:2], CPU[2:3]]), r"the rows have \[2, 1\] devices"),
        ("wrong_columns", dict(devices=[CPU[:3]]), r"needs 2 devices, one per pipeline stage"),
        ("no_micro_batches", dict(micro_batches=0), "micro_batches must be an integer >= 1"),
        ("with_accumulation", dict(micro_batches=2, accum_steps=2), "set one of them"),
        ("unknown_cut", dict(pipeline_cuts=["nope"]), "'nope' is not the name of a layer"),
        ("main_device", dict(main_device=CPU[3]), "main_device cannot be combined"),
        ("replicated", dict(variable_placement="replicated"), "'replicated' cannot be combined"),
        ("grid_without_cuts", dict(pipeline_cuts=None), "pass pipeline_cuts too"))
    def test_refused_with_one_clear_error(self, options, message):
        arguments = {"devices": [CPU[:2]], "pipeline_cuts": ["hidden"], **options}
        with self.assertRaisesRegex(ValueError, message):
            towers.TowerTrainer(_model(), reference.make_loss(), keras.optimizers.SGD(0.1),
                                **arguments)

    def test_optimizer_built_before_placement_is_refused(self):
        model, optimizer = _model(), keras.optimizers.Adam()
        optimizer.build(model.trainable_variables)
        with self.assertRaisesRegex(ValueError, "optimizer was built before"):
            towers.TowerTrainer(model, reference.make_loss(), optimizer, devices=[CPU[:2]],
                                pipeline_cuts=["hidden"])
