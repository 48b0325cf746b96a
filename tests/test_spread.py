"""variable_placement="spread" (issue 27, part 2): each variable, its optimizer slots and
its gradients' sum on one of the towers, balanced by bytes; a step equals Keras's
compile + train_on_batch on one device."""

import keras
import numpy as np
import tensorflow as tf

import towers
from towers.data_parallel import columns

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
            # Each variable's slots (Adam's two) live with it, on its owner tower.
            variables = trainer.model.trainable_variables
            owners = columns.spread_owners(trainer.model.variables, num_towers)
            slots = {v.path.split("/", 1)[1]: v for v in trainer.optimizer.variables}
            held = [0] * num_towers
            for variable in variables:
                tower = DEVICES[owners[id(variable)]]
                self.assertEqual(_device(variable), tower, variable.path)
                for kind in ("momentum", "velocity"):
                    slot = slots[variable.path.replace("/", "_") + "_" + kind]
                    self.assertEqual(_device(slot), tower, slot.path)
                held[owners[id(variable)]] += 3 * variable.numpy().nbytes
            # Balanced by bytes: no tower over 1/N of the state plus the largest variable.
            largest = max(v.numpy().nbytes for v in variables)
            self.assertLessEqual(max(held), sum(held) / num_towers + 3 * largest)
            self.assertEqual(sorted({_device(v) for v in variables}), DEVICES[:num_towers])

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
        self.assertLen({_device(v) for v in trainers[1].model.non_trainable_variables}, 2)

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
        slots = {v.path.split("/", 1)[1]: v for v in trainer.optimizer.variables}
        stage_of = {"table": 0, "conv": 0, "hidden": 1, "logits": 1}
        placed = {}
        for variable in trainer.model.trainable_variables:
            device = _device(variable)
            self.assertIn(device, [row[stage_of[variable.path.split("/")[0]]] for row in grid])
            self.assertEqual(_device(slots[variable.path.replace("/", "_") + "_momentum"]),
                             device)
            placed[variable.path] = device
        # Largest first within each stage: the table (30 x 8) and the conv kernel
        # (3 x 8 x 12) on stage 0's two towers; the hidden kernel (12 x 16) and the
        # logits kernel (16 x 4) on stage 1's.
        self.assertEqual(placed["conv/kernel"], DEVICES[0])
        self.assertEqual(placed["table/embeddings"], DEVICES[2])
        self.assertEqual(placed["hidden/kernel"], DEVICES[1])
        self.assertEqual(placed["logits/kernel"], DEVICES[3])

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
        placed = {v.path: _device(v) for v in parted.trainable_variables}
        self.assertEqual({path: device for path, device in placed.items() if "part_" in path},
                         {"hidden/part_0/kernel": DEVICES[0], "hidden/part_0/bias": DEVICES[2],
                          "hidden/part_1/kernel": DEVICES[1], "hidden/part_1/bias": DEVICES[3],
                          "logits/part_0/kernel": DEVICES[2], "logits/part_0/bias": DEVICES[2],
                          "logits/part_1/kernel": DEVICES[3]})
        self.assertEqual({placed["table/embeddings"], placed["conv/kernel"]},
                         {DEVICES[0], DEVICES[2]})

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

    def test_what_it_cannot_do_yet_is_refused_in_one_line(self):
        built = keras.optimizers.Adam(0.01)
        model = _model()
        built.build(model.trainable_variables)
        for make, message in (
                (lambda: towers.TowerTrainer(model, _loss(), built, devices=DEVICES[:2],
                                             variable_placement="spread"),
                 r"the optimizer was built before the variables were placed"),
                (lambda: towers.TowerTrainer(_model(), _loss(), keras.optimizers.Adam(),
                                             devices=DEVICES[:2], variable_placement="spred"),
                 r"variable_placement must be one of \('main', 'replicated', 'spread'\)")):
            with self.assertRaisesRegex(ValueError, message) as caught:
                make()
            self.assertNotIn("\n", str(caught.exception))
        self.assertEqual({_device(v) for v in model.variables}, {"/device:CPU:0"})


if __name__ == "__main__":
    tf.test.main()
