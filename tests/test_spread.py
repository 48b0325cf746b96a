"""variable_placement="spread" (issue 27, part 2): each variable, its optimizer slots and
its gradients' sum on one of the towers, balanced by bytes; a step equals Keras's
compile + train_on_batch on one device."""

import os

import keras
import numpy as np
import tensorflow as tf

import towers
from towers import compat
from towers.placement import slabs as trainer_slabs

DEVICES = [f"/device:CPU:{i}" for i in range(4)]
TOLERANCE = 1e-5
VOCAB, SEQUENCE, CLASSES = 30, 5, 4


def _model(seed=0):
    """Embedding -> Conv1D -> mean -> Dense -> logits: tables, kernels and biases of
    different sizes to spread."""
    keras.utils.set_random_seed(seed)
    ids = keras.Input((SEQUENCE,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, 8, name="table")(ids)
    x = keras.layers.Conv1D(12, 3, padding="same", activation="relu", name="conv")(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    x = keras.layers.Dense(16, activation="tanh", name="hidden")(x)
    return keras.Model(ids, keras.layers.Dense(CLASSES, name="logits")(x))


def _batches(rows=(9, 7, 3)):  # 3 rows leave a tower empty on 4
    rng = np.random.default_rng(0)
    return [(rng.integers(0, VOCAB, (n, SEQUENCE)).astype("int32"),
             rng.integers(0, CLASSES, n).astype("int32")) for n in rows]


def _loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _device(variable):
    return towers.devices.canonical_name(variable.value.device)


def _held(trainer):
    """{device: bytes of variables + Adam's two slots held there}, after asserting that
    every variable the optimizer updates (a slab of a slabbed one too) has its slots beside
    it, and that each slabbed variable reads as its slabs joined."""
    slots = {v.path.split("/", 1)[1]: v for v in trainer.optimizer.variables}
    held = {}
    for variable in trainer.setup.columns.held_variables():
        device = _device(variable)
        for kind in ("momentum", "velocity"):
            slot = slots[variable.path.replace("/", "_") + "_" + kind]
            assert _device(slot) == device, (slot.path, _device(slot), device)
        held[device] = held.get(device, 0) + 3 * variable.numpy().nbytes
    for slabbed in trainer.setup.columns.slabbed.values():
        np.testing.assert_array_equal(slabbed.variable.numpy(),
                                      np.concatenate([s.numpy() for s in _slabs(slabbed.variable)]))
        assert [_device(s) for s in _slabs(slabbed.variable)] == slabbed.devices
    return held


def _slabs(variable):
    return trainer_slabs.held_variables([variable])


def _assert_balanced(test, held, variables, num_towers):
    """No device over 1/N of the state plus what slabs round off: a row (half at each end
    of its run of bytes), with its two slots."""
    rounding = 3 * max(v.numpy().nbytes // v.shape[0] for v in variables)
    test.assertLessEqual(max(held.values()), sum(held.values()) / num_towers + rounding)


class SpreadTest(tf.test.TestCase):

    def test_trains_as_keras_on_one_device_with_state_spread_over_the_towers(self):
        expected = _model()
        expected.compile(keras.optimizers.Adam(0.01), _loss())
        for x, y in _batches():
            expected.train_on_batch(x, y)
        for num_towers in (1, 2, 3, 4):
            trainer = towers.TowerTrainer(_model(), _loss(), keras.optimizers.Adam(0.01),
                                          devices=DEVICES[:num_towers],
                                          variable_placement="spread")
            for batch in _batches():
                trainer.train_step(batch)
            for got, want in zip(trainer.model.get_weights(), expected.get_weights()):
                self.assertAllClose(got, want, atol=TOLERANCE, rtol=0)
            # Each variable's slots (Adam's two) live with it, the towers filled in turn to
            # 1/N of the bytes, largest first: a variable that does not fit in the tower
            # being filled is held as slabs of rows, filling it and the next.
            held = _held(trainer)
            self.assertEqual(sorted(held), DEVICES[:num_towers])
            _assert_balanced(self, held, trainer.model.trainable_variables, num_towers)
            slabbed = {s.variable.path: (s.devices, s.sizes)
                       for s in trainer.setup.columns.slabbed.values()}
            self.assertEqual(slabbed, {  # 816 floats: 408 per tower on 2, 204 on 4
                1: {}, 2: {"table/embeddings": (DEVICES[:2], [15, 15])},
                3: {"hidden/kernel": (DEVICES[1:3], [1, 11])},
                4: {"conv/kernel": (DEVICES[:2], [2, 1]),  # 288 floats, 96 a row
                    "table/embeddings": (DEVICES[1:3], [15, 15]),
                    "hidden/kernel": (DEVICES[2:], [5, 7])}}[num_towers])

    def test_batch_norm_state_and_jit_compile_as_main_placement(self):
        # BatchNormalization's moving statistics live on their owner and are merged there,
        # as main placement merges them (per-tower statistics: MirroredStrategy's answer);
        # each tower's forward and backward compiled by XLA.
        def model():
            keras.utils.set_random_seed(0)
            inputs = keras.Input((6,))
            x = keras.layers.Dense(16, activation="relu", name="a")(inputs)
            x = keras.layers.BatchNormalization(name="norm")(x)
            return keras.Model(inputs, keras.layers.Dense(3, name="out")(x))

        rng = np.random.default_rng(1)
        batches = [(rng.normal(size=(n, 6)).astype("float32"), rng.integers(0, 3, n))
                   for n in (9, 6)]
        trainers = [towers.TowerTrainer(model(), _loss(), keras.optimizers.Adam(0.01),
                                        devices=DEVICES[:3], variable_placement=placement,
                                        jit_compile=True)
                    for placement in ("main", "spread")]
        for batch in batches:
            for trainer in trainers:
                trainer.train_step(batch)
        main, spread = (t.model.get_weights() for t in trainers)
        for got, want in zip(spread, main):
            self.assertAllClose(got, want, atol=1e-6, rtol=0)
        # The moving statistics (not trainable: never slabs) in the run of tower 2, not on main.
        self.assertEqual({_device(v) for v in trainers[1].model.non_trainable_variables},
                         {DEVICES[2]})

    def test_each_pipeline_stage_spread_over_its_towers(self):
        # 2 towers x 2 stages, 2 micro-batches: stage k's variables, slots and gradient
        # sums on the towers' devices for stage k (grid[t][k]), by bytes within the stage.
        grid = [DEVICES[:2], DEVICES[2:]]
        expected = _model()
        expected.compile(keras.optimizers.Adam(0.01), _loss())
        trainer = towers.TowerTrainer(_model(), _loss(), keras.optimizers.Adam(0.01),
                                      devices=grid, pipeline_cuts=["conv"], micro_batches=2,
                                      variable_placement="spread")
        for batch in _batches():
            expected.train_on_batch(*batch)
            trainer.train_step(batch)
        for got, want in zip(trainer.model.get_weights(), expected.get_weights()):
            self.assertAllClose(got, want, atol=TOLERANCE, rtol=0)
        # Stage 0 on the towers' devices for it, grid[t][0] (the conv kernel on one, the
        # table on the other), stage 1 on grid[t][1] (its hidden kernel across the middle
        # of its bytes: slabbed).
        held = _held(trainer)
        self.assertEqual(sorted(held), DEVICES)
        stage_0 = ("table", "conv")
        for k in range(2):
            variables = [v for v in trainer.model.trainable_variables
                         if v.path.startswith(stage_0) == (k == 0)]
            devices = [row[k] for row in grid]
            _assert_balanced(self, {d: held[d] for d in devices}, variables, 2)
            for variable in trainer_slabs.held_variables(variables):
                self.assertIn(_device(variable), devices)
        self.assertEqual({s.variable.path: (s.devices, s.sizes)
                          for s in trainer.setup.columns.slabbed.values()},
                         {"hidden/kernel": ([DEVICES[1], DEVICES[3]], [9, 3])})

    def test_each_part_of_split_layers_spread_over_its_towers(self):
        # 2 towers x 2 parts: part j's variables on the towers' devices for part j
        # (grid[t][j]), the others on the towers' part 0 devices, by bytes in each group.
        grid = [DEVICES[:2], DEVICES[2:]]
        expected = _model()
        expected.compile(keras.optimizers.Adam(0.01), _loss())
        parted = towers.split_layers(_model(), {"hidden": "column", "logits": "row"}, grid[0])
        trainer = towers.TowerTrainer(parted, _loss(), keras.optimizers.Adam(0.01),
                                      devices=grid, variable_placement="spread")
        for batch in _batches():
            expected.train_on_batch(*batch)
            trainer.train_step(batch)
        for got, want in zip(towers.join_layers(parted).get_weights(), expected.get_weights()):
            self.assertAllClose(got, want, atol=TOLERANCE, rtol=0)
        # Part j's variables (the slabs of a slabbed one too) on the towers' devices for part j
        # (grid[t][j]), the others on the towers' part 0 devices, each group balanced.
        held = _held(trainer)
        groups = {"part_0": [], "part_1": [], None: []}
        for variable in parted.trainable_variables:
            part = next((p for p in ("part_0", "part_1") if f"/{p}/" in variable.path), None)
            groups[part].append(variable)
        for part, devices in (("part_0", DEVICES[::2]), ("part_1", DEVICES[1::2]),
                              (None, DEVICES[::2])):
            for variable in trainer_slabs.held_variables(groups[part]):
                self.assertIn(_device(variable), devices, variable.path)
            _assert_balanced(self, {d: held[d] for d in devices},
                             sum(groups.values(), []), 2)
        self.assertTrue(trainer.setup.columns.slabbed)

    def test_checkpoint_restores_into_main_placement(self):
        directory = self.get_temp_dir()
        batches = _batches()
        saving = towers.TowerTrainer(_model(), _loss(), keras.optimizers.Adam(0.01),
                                     devices=DEVICES, variable_placement="spread")
        checkpointer = towers.Checkpointer(directory, saving.model, saving.optimizer)
        for batch in batches[:2]:
            saving.train_step(batch)
        checkpointer.save(epoch=0, batch_in_epoch=2)
        expected = towers.TowerTrainer(_model(), _loss(), keras.optimizers.Adam(0.01),
                                       devices=DEVICES[:2])
        for batch in batches:
            expected.train_step(batch)
        restoring = towers.TowerTrainer(_model(seed=1), _loss(), keras.optimizers.Adam(0.01),
                                        devices=DEVICES[:2])
        restoring.optimizer.build(restoring.model.trainable_variables)
        self.assertIsNotNone(towers.Checkpointer(directory, restoring.model,
                                                 restoring.optimizer).restore())
        restoring.train_step(batches[2])
        for got, want in zip(restoring.model.get_weights(), expected.model.get_weights()):
            self.assertAllClose(got, want, atol=TOLERANCE, rtol=0)

    def test_collective_all_reduce_after_main_placement_of_the_same_model(self):
        # The collective ops' keys follow the step's layout: a spread trainer's all-reduces
        # (slabs of other shapes) do not take the keys a main-placement trainer of the same
        # model used in this process (an instance key keeps its first shape).
        results = []
        for placement in ("main", "spread"):
            trainer = towers.TowerTrainer(_model(), _loss(), keras.optimizers.Adam(0.01),
                                          devices=DEVICES, variable_placement=placement,
                                          aggregation="collective")
            for batch in _batches():
                trainer.train_step(batch)
            results.append(trainer.model.get_weights())
        for got, want in zip(*results):
            self.assertAllClose(got, want, atol=TOLERANCE, rtol=0)

    def test_a_checkpoint_moves_between_tower_counts_whole(self):
        # Written on 4 towers (three variables held as slabs), restored on 3 (others slabbed):
        # the files hold every weight and slot whole, as one device's would.
        directory = self.get_temp_dir()
        batches = _batches()
        expected = _model()
        expected.compile(keras.optimizers.Adam(0.01), _loss())
        for batch in batches:
            expected.train_on_batch(*batch)
        saving = towers.TowerTrainer(_model(), _loss(), keras.optimizers.Adam(0.01),
                                     devices=DEVICES, variable_placement="spread")
        checkpointer = towers.Checkpointer(directory, saving.model, saving.optimizer)
        for batch in batches[:2]:
            saving.train_step(batch)
        reader = tf.train.load_checkpoint(checkpointer.save(epoch=0, batch_in_epoch=2))
        self.assertEqual(reader.get_variable_to_shape_map()[
            "optimizer/_trainable_variables/0/.ATTRIBUTES/VARIABLE_VALUE"], [VOCAB, 8])
        restoring = towers.TowerTrainer(_model(seed=1), _loss(), keras.optimizers.Adam(0.01),
                                        devices=DEVICES[:3], variable_placement="spread")
        restoring.optimizer.build(restoring.optimized_variables)
        self.assertIsNotNone(towers.Checkpointer(directory, restoring.model,
                                                 restoring.optimizer).restore())
        self.assertTrue(restoring.setup.columns.slabbed)
        restoring.train_step(batches[2])
        for got, want in zip(restoring.model.get_weights(), expected.get_weights()):
            self.assertAllClose(got, want, atol=TOLERANCE, rtol=0)

    def test_slabbed_variables_frozen_evaluated_and_saved(self):
        # Three variables slabbed on 4 towers. The table's layer frozen after a step (its slabs
        # then read whole and left alone), as main placement trains it (equal to Keras:
        # tests/test_trainable.py); evaluate as Keras's; the model saves as a .keras file
        # that plain Keras loads with the same weights.
        trainers = [towers.TowerTrainer(_model(), _loss(), keras.optimizers.Adam(0.01),
                                        devices=DEVICES, variable_placement=placement)
                    for placement in ("main", "spread")]
        for i, batch in enumerate(_batches()):
            for trainer in trainers:
                trainer.model.get_layer("table").trainable = i == 0
                trainer.train_step(batch)
        main, spread = trainers
        self.assertIn("table/embeddings", [s.variable.path
                                           for s in spread.setup.columns.slabbed.values()])
        for got, want in zip(spread.model.get_weights(), main.model.get_weights()):
            self.assertAllClose(got, want, atol=TOLERANCE, rtol=0)
        keras_model = _model()
        keras_model.set_weights(spread.model.get_weights())
        keras_model.compile(loss=_loss())
        x, y = _batches()[0]
        self.assertAllClose(spread.evaluate((x, y))["loss"], keras_model.evaluate(x, y, verbose=0),
                            atol=TOLERANCE, rtol=0)
        self.assertAllClose(spread.model.predict(x, verbose=0), keras_model.predict(x, verbose=0),
                            atol=TOLERANCE, rtol=0)
        path = os.path.join(self.get_temp_dir(), "spread.keras")
        spread.model.save(path)
        for got, want in zip(keras.saving.load_model(path, safe_mode=True).get_weights(),
                             spread.model.get_weights()):
            self.assertAllEqual(got, want)

    def test_whole_variables_hands_the_model_back_to_plain_keras(self):
        # After training with slabbed variables, towers.whole_variables holds each as one
        # tf.Variable again: Keras's compile + fit trains the model as a twin of it that
        # was never slabbed; the trainer that held them so refuses another step in one line.
        trainer = towers.TowerTrainer(_model(), _loss(), keras.optimizers.Adam(0.01),
                                      devices=DEVICES, variable_placement="spread")
        batches = _batches()
        trainer.train_step(batches[0])
        twin = _model()
        twin.set_weights(trainer.model.get_weights())
        slabbed = [s.variable for s in trainer.setup.columns.slabbed.values()]
        towers.whole_variables(trainer.model, DEVICES[0])
        self.assertEqual([compat.held_slabs(v) for v in trainer.model.variables],
                         [None] * len(trainer.model.variables))
        self.assertEqual({_device(v) for v in slabbed}, {DEVICES[0]})
        for model in (trainer.model, twin):
            model.compile(keras.optimizers.SGD(0.1), _loss())
            model.train_on_batch(*batches[1])
        for got, want in zip(trainer.model.get_weights(), twin.get_weights()):
            self.assertAllClose(got, want, atol=TOLERANCE, rtol=0)
        with self.assertRaisesRegex(ValueError, r"'conv/kernel' is no longer held in the "
                                    r"slabs this trainer held it in") as caught:
            trainer.train_step(batches[2])
        self.assertNotIn("\n", str(caught.exception))

    def test_weight_decay_excluded_from_a_slabbed_variable_as_from_it_whole(self):
        # AdamW told to leave the table out of weight decay leaves out its slabs (the
        # table is slabbed on 2 towers), as Keras on one device leaves out the table.
        def optimizer(model):
            adamw = keras.optimizers.AdamW(0.01, weight_decay=0.5)
            adamw.exclude_from_weight_decay(var_list=[model.get_layer("table").embeddings])
            return adamw

        expected = _model()
        expected.compile(optimizer(expected), _loss())
        model = _model()
        trainer = towers.TowerTrainer(model, _loss(), optimizer(model), devices=DEVICES[:2],
                                      variable_placement="spread")
        self.assertIn("table/embeddings", [s.variable.path
                                           for s in trainer.setup.columns.slabbed.values()])
        for batch in _batches():
            expected.train_on_batch(*batch)
            trainer.train_step(batch)
        for got, want in zip(model.get_weights(), expected.get_weights()):
            self.assertAllClose(got, want, atol=TOLERANCE, rtol=0)

    def test_an_optimizer_that_cannot_update_slabs_is_refused_in_one_line(self):
        for optimizer, message in (
                (keras.optimizers.Lamb(0.01), r"Lamb does not update each element on its own"),
                (keras.optimizers.Adafactor(0.01), r"Adafactor does not update each element"),
                (keras.optimizers.Adam(0.01, clipnorm=1.0), r"clipnorm clips each variable")):
            model = _model()
            with self.assertRaisesRegex(ValueError, "variable_placement='spread' holds "
                                        r"\['table/embeddings'\] .*" + message) as caught:
                towers.TowerTrainer(model, _loss(), optimizer, devices=DEVICES[:2],
                                    variable_placement="spread")
            self.assertNotIn("\n", str(caught.exception))
            self.assertIsNone(compat.held_slabs(model.get_layer("table").embeddings))
        # Without slabs (one tower) they train as ever.
        towers.TowerTrainer(_model(), _loss(), keras.optimizers.Lamb(0.01),
                            devices=DEVICES[:1], variable_placement="spread").train_step(
            _batches()[0])

    def test_what_it_cannot_do_yet_is_refused_in_one_line(self):
        built = keras.optimizers.Adam(0.01)
        model = _model()
        built.build(model.trainable_variables)
        for make, message in (
                (lambda: towers.TowerTrainer(model, _loss(), built, devices=DEVICES[:2],
                                             variable_placement="spread"),
                 r"spread' holds \['table/embeddings'\] .* but the optimizer is built already"),
                (lambda: towers.TowerTrainer(_model(), _loss(), keras.optimizers.Adam(),
                                             devices=DEVICES[:2], variable_placement="spred"),
                 r"variable_placement must be one of \('main', 'replicated', 'spread'\)")):
            with self.assertRaisesRegex(ValueError, message) as caught:
                make()
            self.assertNotIn("\n", str(caught.exception))
        self.assertEqual({_device(v) for v in model.variables}, {"/device:CPU:0"})


if __name__ == "__main__":
    tf.test.main()
