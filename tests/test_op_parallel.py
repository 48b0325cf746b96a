"""Op parallelism: split layers compute what the original does, train as one device
does, sit on the devices the plan names, and join back exactly (issue 18, first part)."""

import collections
import re

import keras
import numpy as np
import tensorflow as tf
from absl import flags
from absl.testing import flagsaver, parameterized

import towers
from benchmarks.harness import op_parallel, transfers
from tests import reference
from towers.cli import train

if not flags.FLAGS.is_parsed():  # the command line's tests run train.train() in-process
    flags.FLAGS.mark_as_parsed()

DEVICES = [f"/device:CPU:{i}" for i in range(4)]
PARTS = DEVICES[1:]  # three parts: 8 units split 3, 3, 2
TOLERANCE = 1e-5


def _branches(seed=0):
    """Two independent branches (a recommender's user and item towers) joined at the end."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((reference.NUM_FEATURES,))
    left = keras.layers.Dense(4, activation="relu", name="left")(inputs)
    right = keras.layers.Dense(5, activation="relu", name="right")(inputs)
    joined = keras.layers.Concatenate(name="join")([left, right])
    return keras.Model(inputs, keras.layers.Dense(reference.NUM_CLASSES, name="out")(joined))


def _text(seed=0):
    """A transformer block: token ids -> an Embedding of 11 rows (id 0 masked) ->
    self-attention with 4 heads (3 parts: 2, 1, 1) + residual -> LayerNorm -> a
    feed-forward Dense pair -> mean -> logits.

    Takes reference batches' features as ids: |x| * 3, rounded, lies in 0..10."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((reference.NUM_FEATURES,))
    ids = keras.layers.Lambda(lambda x: keras.ops.cast(
        keras.ops.minimum(keras.ops.round(keras.ops.abs(x) * 3), 10), "int32"))(inputs)
    vectors = keras.layers.Embedding(11, 6, mask_zero=True, name="table")(ids)
    attended = keras.layers.MultiHeadAttention(4, 3, name="att")(vectors, vectors)
    x = keras.layers.LayerNormalization()(keras.layers.Add()([vectors, attended]))
    x = keras.layers.Dense(8, activation="relu", name="up")(x)
    x = keras.layers.Dense(6, name="down")(x)
    pooled = keras.layers.GlobalAveragePooling1D()(x)  # honours the mask
    return keras.Model(inputs, keras.layers.Dense(reference.NUM_CLASSES, name="out")(pooled))


def _einsum(seed=0):
    """EinsumDense layers: a two-axis projection (5, 1) -> (5, 2, 4), then a relu column ->
    row pair over the sequence of 5, with ellipsis on the second."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((reference.NUM_FEATURES,))
    x = keras.layers.Reshape((reference.NUM_FEATURES, 1))(inputs)
    x = keras.layers.EinsumDense("abc,cde->abde", (None, 2, 4), bias_axes="de", name="proj")(x)
    x = keras.layers.Reshape((reference.NUM_FEATURES, 8))(x)
    x = keras.layers.EinsumDense("abc,cd->abd", (None, 7), bias_axes="d", activation="relu",
                                 name="up")(x)
    x = keras.layers.EinsumDense("...d,de->...e", 6, bias_axes="e", name="down")(x)
    pooled = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(inputs, keras.layers.Dense(reference.NUM_CLASSES, name="out")(pooled))


MLP_PLAN = {"up": "column", "down": "row", "out": 0}
EINSUM_PLAN = {"proj": "column", "up": "column", "down": "row"}
TEXT_PLAN = {"table": "vocab", "att": "heads", "up": "column", "down": "row"}
BRANCH_PLAN = {"left": 1, "right": 2}


def _device_of(variable):
    return towers.devices.canonical_name(variable.value.device)


class SplitLayersTest(tf.test.TestCase, parameterized.TestCase):

    def test_computes_what_the_model_computes_with_each_part_on_its_device(self):
        model = reference.make_up_down_model()
        x = reference.make_batches(6, num_steps=1)[0][0]
        parted = towers.split_layers(model, MLP_PLAN, PARTS)
        self.assertAllClose(parted(x), model(x), atol=1e-6, rtol=0)
        devices = {v.path: _device_of(v) for v in parted.weights}
        self.assertEqual([devices[f"up/part_{j}/kernel"] for j in range(3)], PARTS)
        self.assertEqual([devices[f"down/part_{j}/kernel"] for j in range(3)], PARTS)
        self.assertEqual(devices["down/part_0/bias"], PARTS[0])  # the one bias, added once
        self.assertNotIn("down/part_1/bias", devices)
        self.assertEqual(devices["out/out/kernel"], PARTS[0])
        # Parts of 8 units on 3 devices: 3, 3, 2 (larger first, as shards are).
        self.assertEqual([parted.get_layer("up").parts[j].kernel.shape[1] for j in range(3)],
                         [3, 3, 2])
        # L2 on a split kernel is counted once: the parts' terms add up to the whole's.
        self.assertAllClose(tf.add_n(parted.losses), tf.add_n(model.losses), atol=1e-7, rtol=0)

    def test_optimizer_slots_live_with_their_parts(self):
        # One step builds Adam's slots; each sits on its variable's device, so a device
        # holds 1/T of a split layer's weights and of their slots.
        trainer = towers.TowerTrainer(towers.split_layers(_text(), TEXT_PLAN, PARTS),
                                      reference.make_loss(), keras.optimizers.Adam(0.01),
                                      devices=DEVICES[:1])
        trainer.train_step(reference.make_batches(6, num_steps=1)[0])
        devices = {v.path: _device_of(v) for v in trainer.model.weights}
        slots = [v for v in trainer.optimizer.variables if v.path.split("/")[-1] in (
            *(f"{p.replace('/', '_')}_momentum" for p in devices),
            *(f"{p.replace('/', '_')}_velocity" for p in devices))]
        self.assertLen(slots, 2 * len(trainer.model.trainable_weights))
        for slot in slots:
            variable = slot.path.split("/")[-1].rsplit("_", 1)[0]
            owner = next(d for p, d in devices.items() if p.replace("/", "_") == variable)
            self.assertEqual(_device_of(slot), owner, slot.path)

    def test_benchmark_bytes_per_device_and_per_step(self):
        results = op_parallel.run_op_parallel_benchmark(
            [1, 3], DEVICES, self.create_tempdir().full_path, vocab=30, width=6, heads=3,
            hidden=9, length=4, global_batch_size=5, steps=1, rounds=1, embedding_rows=50,
            embedding_towers=2)
        self.assertEqual([(row["mode"], row["towers"]) for row in results["embedding"]["rows"]],
                         [("keras_one_device", 1), ("towers_table", 1), ("towers_table", 2),
                          ("towers_copy", 2)])
        whole, parted = (row["bytes_per_device"] for row in results["rows"])
        # The same weights (attention's output bias once, on part 0).
        self.assertEqual(sum(v for v, _ in parted.values()), sum(v for v, _ in whole.values()))
        self.assertLen(parted, 3)  # every part's device holds its share
        # Measured as TensorFlow sends them: each split's activations and their gradients,
        # the learning rate to each part's variables, nothing else (no gradient through
        # the main device on its way to the update, no gather in a column -> row pair).
        self.assertEqual({row["kind"]: row["measured"] for row in results["bytes"]},
                         {row["kind"]: row["formula"] for row in results["bytes"]})

    def test_split_logits_stay_in_parts_into_the_loss(self):
        # Megatron's vocab-parallel cross-entropy: a column-split output layer's logits
        # are not gathered on the tower; each part sends 3 reductions per example.
        def build():
            keras.utils.set_random_seed(0)
            inputs = keras.Input((5,))
            hidden = keras.layers.Dense(8, activation="tanh", name="hidden")(inputs)
            return keras.Model(inputs, keras.layers.Dense(64, name="logits")(hidden))

        rng = np.random.default_rng(0)
        x = rng.normal(size=(12, 5)).astype("float32")
        y = rng.integers(0, 64, (12, 1)).astype("int32")  # Keras's (n, 1) class ids too
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        expected = build()
        expected.compile(keras.optimizers.SGD(0.1), loss)
        trainer = towers.TowerTrainer(towers.split_layers(build(), {"logits": "column"},
                                                          PARTS[:2]),
                                      loss, keras.optimizers.SGD(0.1), devices=PARTS[:1])
        for _ in range(2):
            expected.train_on_batch(x, y)
            trainer.train_step((x, y))
        for got, want in zip(towers.join_layers(trainer.model).get_weights(),
                             expected.get_weights()):
            self.assertAllClose(got, want, atol=1e-6, rtol=0)
        sent = [(shape, size) for source, destination, _, _, shape, size in
                transfers.trainer_step_bytes(trainer, (x, y))["tensors"]
                if (source, destination) == (PARTS[1], PARTS[0])]
        # The max, the sum of exponentials and the target's logit per example, and the
        # hidden state's gradient: no (12, 32) logits.
        self.assertCountEqual(sent, [((12,), 48)] * 3 + [((12, 8), 384)])

    def test_column_row_pair_gathers_nothing_between(self):
        # Megatron's pairing: the row layer takes the column's parts where they are, so
        # nothing slices the column's output; after a softmax (which mixes units) it must.
        for activation, slices in (("relu", 0), ("softmax", 1)):
            keras.utils.set_random_seed(0)
            inputs = keras.Input((reference.NUM_FEATURES,))
            hidden = keras.layers.Dense(8, activation=activation, name="up")(inputs)
            model = keras.Model(inputs, keras.layers.Dense(3, name="down")(hidden))
            parted = towers.split_layers(model, {"up": "column", "down": "row"}, PARTS)
            x = reference.make_batches(4, num_steps=1)[0][0]
            graph = tf.function(parted).get_concrete_function(tf.constant(x)).graph
            self.assertLen([op for op in graph.get_operations()
                            if op.type in ("Split", "SplitV") and "down" in op.name], slices)
            self.assertAllClose(parted(x), model(x), atol=1e-6, rtol=0)

    def test_einsum_splits_run_along_the_right_axes(self):
        model = _einsum()
        x = reference.make_batches(6, num_steps=1)[0][0]
        parted = towers.split_layers(model, EINSUM_PLAN, PARTS)
        self.assertAllClose(parted(x), model(x), atol=1e-6, rtol=0)
        proj, up, down = (parted.get_layer(name) for name in ("proj", "up", "down"))
        self.assertEqual([p.kernel.shape for p in proj.parts], [(1, 2, 2), (1, 2, 1), (1, 2, 1)])
        self.assertEqual([p.bias.shape for p in proj.parts], [(2, 2), (2, 1), (2, 1)])
        self.assertEqual([p.kernel.shape for p in up.parts], [(8, 3), (8, 2), (8, 2)])
        self.assertEqual([p.kernel.shape for p in down.parts], [(3, 6), (2, 6), (2, 6)])
        self.assertEqual([p.bias is not None for p in down.parts], [True, False, False])
        for want, got in zip(model.get_weights(), towers.join_layers(parted).get_weights()):
            self.assertAllEqual(got, want)
        keras.utils.set_random_seed(0)
        inputs = keras.Input((4, 6))
        bias_across = keras.Model(inputs, keras.layers.EinsumDense(
            "abc,cd->abd", (4, 5), bias_axes="b", name="seq")(inputs))
        with self.assertRaisesRegex(ValueError, "is along axis 'd', which its bias"):
            towers.split_layers(bias_across, {"seq": "column"}, PARTS)
        with self.assertRaisesRegex(ValueError,
                                    "needs a contracted letter .*'abc,d->abcd' has none"):
            towers.split_layers(keras.Model(inputs, keras.layers.EinsumDense(
                "abc,d->abcd", (4, 6, 2), name="outer")(inputs)), {"outer": "row"}, PARTS)

    def test_join_gives_the_original_layers_and_weights_back(self):
        model = reference.make_up_down_model()
        before = [w.copy() for w in model.get_weights()]
        joined = towers.join_layers(towers.split_layers(model, MLP_PLAN, PARTS))
        self.assertEqual([type(layer) for layer in joined.layers],
                         [type(layer) for layer in model.layers])
        for expected, actual in zip(model.get_weights(), joined.get_weights()):
            self.assertAllEqual(expected, actual)
        for expected, actual in zip(before, model.get_weights()):  # the original untouched
            self.assertAllEqual(expected, actual)

    def _split_text(self):
        """The transformer block split by TEXT_PLAN, checked to compute what it did."""
        model = _text()
        x = reference.make_batches(6, num_steps=1)[0][0]
        parted = towers.split_layers(model, TEXT_PLAN, PARTS)
        self.assertAllClose(parted(x), model(x), atol=1e-6, rtol=0)
        return parted

    def test_vocab_parts_look_up_their_own_rows(self):
        table = self._split_text().get_layer("table")
        self.assertEqual([part.embeddings.shape[0] for part in table.parts], [4, 4, 3])
        self.assertEqual([_device_of(part.embeddings) for part in table.parts], PARTS)
        ids = np.array([[0, 3, 4, 10]])
        self.assertAllEqual(table.compute_mask(ids), ids != 0)
        # Each part's gradient holds only rows it looked up, as an IndexedSlices.
        with tf.GradientTape() as tape:
            total = tf.reduce_sum(table(ids))
        grads = tape.gradient(total, [part.embeddings for part in table.parts])
        self.assertTrue(all(isinstance(g, tf.IndexedSlices) for g in grads))
        whole = np.concatenate([tf.convert_to_tensor(g).numpy() for g in grads])
        self.assertAllEqual(whole.sum(axis=1) != 0, np.isin(np.arange(11), ids))

    def test_heads_parts_hold_their_heads(self):
        split = self._split_text()
        attention = split.get_layer("att")
        self.assertEqual([part.num_heads for part in attention.parts], [2, 1, 1])
        for j, part in enumerate(attention.parts):
            self.assertEqual({_device_of(v) for v in part.weights}, {PARTS[j]})
        # The output bias is added once: part 0 holds it, the others have none, so that
        # making the model trainable again cannot train a second one.
        self.assertEqual([part.output_dense.bias is None for part in attention.parts],
                         [False, True, True])
        before = len(split.trainable_variables)
        split.trainable = False
        split.trainable = True
        self.assertLen(split.trainable_variables, before)

    def test_heads_parts_attend_from_padded_rows_as_keras(self):
        # Keras's MultiHeadAttention reads the query's mask from the query itself: a
        # padded row attends to every key alike. Each part reads a copy of the query
        # on its device, which must carry that mask too (the Add after it drops the
        # mask, so a loss sees the padded rows).
        keras.utils.set_random_seed(0)
        ids = keras.Input((6,), dtype="int32")
        vectors = keras.layers.Embedding(11, 6, mask_zero=True, name="table")(ids)
        attended = keras.layers.MultiHeadAttention(4, 3, name="att")(vectors, vectors)
        model = keras.Model(ids, keras.layers.Add()([vectors, attended]))
        split = towers.split_layers(model, {"att": "heads"}, PARTS)
        x = np.array([[3, 4, 0, 0, 0, 0], [5, 1, 2, 7, 9, 0]], "int32")
        self.assertAllClose(split(x), model(x), atol=1e-6, rtol=0)

    def test_heads_parts_ignore_a_query_mask_passed_by_hand_as_keras(self):
        # MultiHeadAttention.call reads the query's own mask and ignores its query_mask
        # argument: a flag passed by hand changes nothing, on an unmasked query and on
        # a padded one alike.
        keras.utils.set_random_seed(0)
        ids = keras.Input((6,), dtype="int32")
        flags = keras.Input((6,), dtype="bool")
        padded = keras.layers.Embedding(11, 6, mask_zero=True, name="table")(ids)
        unmasked = keras.layers.Embedding(11, 6, name="plain")(ids)
        outputs = [keras.layers.MultiHeadAttention(4, 3, name=f"att_{i}")(
            query, query, query_mask=flags) for i, query in enumerate((unmasked, padded))]
        model = keras.Model([ids, flags], [outputs[0], keras.layers.Add()([padded, outputs[1]])])
        split = towers.split_layers(model, {"att_0": "heads", "att_1": "heads"}, PARTS)
        x = [np.array([[3, 4, 0, 0, 0, 0], [5, 1, 2, 7, 9, 0]], "int32"),
             np.array([[1, 0, 1, 0, 1, 0], [0, 0, 0, 0, 0, 1]], bool)]
        for actual, expected in zip(split(x), model(x)):
            self.assertAllClose(actual, expected, atol=1e-6, rtol=0)

    def test_heads_parts_draw_their_own_dropout_streams(self):
        # As the layer's heads do: a given seed is offset by the part, so the parts'
        # dropout masks differ (one seed for all would drop the same entries).
        keras.utils.set_random_seed(0)
        inputs = keras.Input((3, 4))
        outputs = keras.layers.MultiHeadAttention(2, 2, dropout=0.5, seed=7, name="att")(
            inputs, inputs)
        split = towers.split_layers(keras.Model(inputs, outputs), {"att": "heads"}, PARTS[:2])
        parts = split.get_layer("att").parts
        self.assertEqual([part.seed for part in parts], [7, 8])
        masks = [part._dropout_layer(tf.ones((64,)), training=True).numpy() != 0
                 for part in parts]
        self.assertGreater(np.mean(masks[0] != masks[1]), 0.25)

    def test_branches_placed_whole(self):
        model = _branches()
        x = reference.make_batches(5, num_steps=1)[0][0]
        parted = towers.split_layers(model, BRANCH_PLAN, DEVICES[:3])
        self.assertAllClose(parted(x), model(x), atol=1e-6, rtol=0)
        devices = {v.path.split("/")[0]: _device_of(v) for v in parted.weights}
        self.assertEqual(devices, {"left": DEVICES[1], "right": DEVICES[2], "out": DEVICES[0]})

    # Each model on 1 tower with SGD, and on 2 towers with Adam (its slots on the parts'
    # devices, one tower empty at the batch of 1).
    @parameterized.named_parameters(
        (f"{name}_{num_towers}_towers_{optimizer}", build, plan, parts, num_towers, optimizer)
        for name, build, plan, parts in (("mlp", reference.make_up_down_model, MLP_PLAN, PARTS),
                                         ("text", _text, TEXT_PLAN, PARTS),
                                         ("branches", _branches, BRANCH_PLAN, DEVICES[:3]),
                                         ("einsum", _einsum, EINSUM_PLAN, PARTS))
        for num_towers, optimizer in ((1, "sgd"), (2, "adam")))
    def test_trains_as_one_device(self, build, plan, parts, num_towers, optimizer):
        # Uneven shards, then a batch of 1: on 2 towers, one of them empty.
        batches = [reference.make_batches(size, num_steps=1, seed=i)[0]  # sample-weighted
                   for i, size in enumerate((7, 1, 6))]
        expected_model = build()
        reference.single_device_weights(expected_model, reference.OPTIMIZERS[optimizer](),
                                        reference.make_loss(), batches)
        trainer = towers.TowerTrainer(towers.split_layers(build(), plan, parts),
                                      reference.make_loss(), reference.OPTIMIZERS[optimizer](),
                                      devices=DEVICES[:num_towers])
        for batch in batches:
            trainer.train_step(batch)
        joined = towers.join_layers(trainer.model)
        for expected, actual in zip(expected_model.get_weights(), joined.get_weights()):
            self.assertAllClose(actual, expected, atol=TOLERANCE, rtol=0)


class GridTest(tf.test.TestCase, parameterized.TestCase):
    """Towers x parts: tower i runs part j on devices[i][j]; part j's variables and slots
    stay on devices[0][j], where its gradients meet."""

    @parameterized.named_parameters(
        ("text_2x2", _text, TEXT_PLAN, [[0, 1], [2, 3]]),
        # Rows may share devices with each other: tower 1's part 0 runs on tower 0's part 2.
        ("mlp_2x3", reference.make_up_down_model, MLP_PLAN, [[1, 2, 3], [0, 3, 1]]),
        ("branches_2x3", _branches, BRANCH_PLAN, [[0, 1, 2], [3, 2, 1]]))
    def test_trains_as_one_device_with_each_part_on_its_row(self, build, plan, rows):
        rows = [[DEVICES[d] for d in row] for row in rows]
        batches = [reference.make_batches(size, num_steps=1, seed=i)[0]
                   for i, size in enumerate((7, 1, 6))]
        expected_model = build()
        reference.single_device_weights(expected_model, reference.OPTIMIZERS["adam"](),
                                        reference.make_loss(), batches)
        trainer = towers.TowerTrainer(towers.split_layers(build(), plan, rows[0]),
                                      reference.make_loss(), reference.OPTIMIZERS["adam"](),
                                      devices=rows)
        for batch in batches:
            trainer.train_step(batch)
        joined = towers.join_layers(trainer.model)
        for expected, actual in zip(expected_model.get_weights(), joined.get_weights()):
            self.assertAllClose(actual, expected, atol=TOLERANCE, rtol=0)
        self.assertEqual(trainer.devices, [row[0] for row in rows])
        # Variables and Adam's slots where split_layers put them: row 0.
        homes = {v.path: _device_of(v) for v in trainer.model.weights}
        for slot in trainer.optimizer.variables[2:]:  # after iterations and learning rate
            owner = next(p for p in homes if p.replace("/", "_") in slot.path)
            self.assertEqual(_device_of(slot), homes[owner], slot.path)
        # Every multiply of tower i's part j (a split layer's part_j, or a layer placed
        # whole on j) runs on rows[i][j], forward and backward (tape.gradient alone would
        # put the backward on the tower's device).
        placed, wholes = collections.defaultdict(set), {
            name: j for name, j in plan.items() if isinstance(j, int)}
        for node in reference.traced_nodes(trainer):  # the towers' work, in each copy
            tower = re.search(r"tower_(\d+)/", node.name)
            part = re.search(r"/part_(\d+)(_\d+)?/", node.name) or next(
                (j for name, j in wholes.items()
                 if re.search(f"/{name}(_\\d+)?/", node.name)), None)
            if tower and part is not None and node.op in reference.MATMUL_OPS:
                j = part if isinstance(part, int) else int(part[1])
                backward = "gradient_tape/" in node.name
                placed[int(tower[1]), j, backward].add(towers.devices.canonical_name(node.device))
        parts = set(wholes.values()) if len(wholes) == len(plan) else range(len(rows[0]))
        self.assertEqual(set(placed), {(i, j, backward) for i in range(2) for j in parts
                                       for backward in (False, True)})
        for (i, j, _), devices in placed.items():
            self.assertEqual(devices, {rows[i][j]}, (i, j))

    def test_bad_grid_is_refused_in_one_line(self):
        parted = towers.split_layers(reference.make_up_down_model(), MLP_PLAN, DEVICES[:2])
        for devices, message in (
                ([DEVICES[:2], DEVICES[2:3]], "a grid of rows of 2 devices"),
                ([DEVICES[2:4], DEVICES[:2]], "must be the devices split_layers put")):
            with self.assertRaisesRegex(ValueError, message) as caught:
                towers.TowerTrainer(parted, reference.make_loss(),
                                    reference.OPTIMIZERS["sgd"](), devices=devices)
            self.assertNotIn("\n", str(caught.exception))
        for options, message in ((dict(pipeline_cuts=["up"]),
                                  r"must be a grid of towers x stages x parts: per tower 2 "
                                  r"rows \(one per stage\) of 2 devices"),
                                 (dict(variable_placement="replicated"), "'replicated' cannot")):
            with self.assertRaisesRegex(ValueError, message):
                towers.TowerTrainer(parted, reference.make_loss(),
                                    reference.OPTIMIZERS["sgd"](), devices=DEVICES[:2],
                                    **options)


class CheckpointTest(tf.test.TestCase, parameterized.TestCase):
    """A split model's checkpoint is the unsplit model's: it restores with another
    number of parts, with none, and into join_layers' model; training goes on as if
    one device had trained all along (Adam's slots and step count moved too)."""

    @parameterized.named_parameters(("2_to_3", 2, 3), ("2_to_none", 2, None),
                                    ("none_to_3", None, 3), ("3_to_2", 3, 2))
    def test_moves_between_part_counts(self, saved_parts, restored_parts):
        batches = [reference.make_batches(size, num_steps=1, seed=i)[0]
                   for i, size in enumerate((6, 5, 7))]
        expected = _text()
        reference.single_device_weights(expected, reference.OPTIMIZERS["adam"](),
                                        reference.make_loss(), batches)
        directory = self.create_tempdir().full_path

        def trainer_with(parts, seed):
            model = _text(seed) if parts is None else towers.split_layers(
                _text(seed), TEXT_PLAN, DEVICES[:parts])
            trainer = towers.TowerTrainer(model, reference.make_loss(),
                                          reference.OPTIMIZERS["adam"](), devices=DEVICES[:2])
            trainer.optimizer.build(model.trainable_variables)
            return trainer, towers.Checkpointer(directory, model, trainer.optimizer)

        saving, checkpointer = trainer_with(saved_parts, seed=0)
        for batch in batches[:2]:
            saving.train_step(batch)
        checkpointer.save(epoch=0, batch_in_epoch=2)
        restoring, checkpointer = trainer_with(restored_parts, seed=1)  # restored over
        self.assertIsNotNone(checkpointer.restore())
        self.assertEqual(restoring.step, 2)
        restoring.train_step(batches[2])
        model = restoring.model if restored_parts is None else towers.join_layers(restoring.model)
        for want, got in zip(expected.get_weights(), model.get_weights()):
            self.assertAllClose(got, want, atol=TOLERANCE, rtol=0)

    def test_loss_scale_and_step_count_move_too(self):
        directory = self.create_tempdir().full_path

        def trainer_with(parts, seed):
            model = towers.split_layers(_text(seed), TEXT_PLAN, DEVICES[:parts])
            optimizer = keras.optimizers.LossScaleOptimizer(reference.OPTIMIZERS["adam"](), 64.0)
            optimizer.build(model.trainable_variables)
            return (towers.TowerTrainer(model, reference.make_loss(), optimizer,
                                        devices=DEVICES[:1]),
                    towers.Checkpointer(directory, model, optimizer))

        saving, checkpointer = trainer_with(2, seed=0)
        saving.optimizer.dynamic_scale.assign(8.0)  # as if some steps had overflowed
        for batch in reference.make_batches(6, num_steps=3):
            saving.train_step(batch)
        checkpointer.save(0, 3)
        restoring, checkpointer = trainer_with(3, seed=1)
        self.assertIsNotNone(checkpointer.restore())
        for variable in ("iterations", "dynamic_scale", "step_counter"):
            self.assertEqual(getattr(restoring.optimizer, variable).numpy(),
                             getattr(saving.optimizer, variable).numpy(), variable)
        self.assertEqual(restoring.step, 3)

    def test_restores_into_join_layers_model(self):
        parted = towers.split_layers(_text(), TEXT_PLAN, PARTS)
        trainer = towers.TowerTrainer(parted, reference.make_loss(),
                                      reference.OPTIMIZERS["sgd"](), devices=DEVICES[:1])
        trainer.train_step(reference.make_batches(6, num_steps=1)[0])
        directory = self.create_tempdir().full_path
        towers.Checkpointer(directory, parted, trainer.optimizer).save(0, 1)
        whole = towers.join_layers(towers.split_layers(_text(seed=1), TEXT_PLAN, PARTS[:2]))
        tf.train.Checkpoint(model=whole).restore(
            tf.train.latest_checkpoint(directory)).expect_partial()
        for want, got in zip(towers.join_layers(parted).get_weights(), whole.get_weights()):
            self.assertAllEqual(got, want)


class OptionsTest(tf.test.TestCase, parameterized.TestCase):
    """What works with towers keeps working with split layers: the split transformer
    block (the MLP for fit's in-graph loop, whose trace of a split transformer takes a
    minute on 2 cores) on 2 towers against the unsplit one under the same trainer options."""

    def tearDown(self):
        keras.mixed_precision.set_global_policy("float32")
        super().tearDown()

    @parameterized.named_parameters(
        ("global_norm_clipping", dict(clip_global_norm=0.05), TOLERANCE),
        ("fit_3_steps_per_execution", dict(steps_per_execution=3, model="mlp"), TOLERANCE),
        # bfloat16 sums in another order: the two agree to bfloat16's precision.
        ("mixed_bfloat16", dict(policy="mixed_bfloat16"), 2e-2),
        # float16 with dynamic loss scaling, from a scale the first steps do not overflow;
        # Adam magnifies float16 noise in tiny gradients (the attention query kernel's).
        ("mixed_float16", dict(policy="mixed_float16", initial_scale=64.0), 1e-2))
    def test_options_work_as_on_the_unsplit_model(self, options, tolerance):
        options = dict(options)
        keras.mixed_precision.set_global_policy(options.pop("policy", "float32"))
        initial_scale = options.pop("initial_scale", None)
        make_model, plan = ((reference.make_up_down_model, MLP_PLAN)
                            if options.pop("model", "text") == "mlp" else (_text, TEXT_PLAN))
        batches = reference.make_batches(6, num_steps=3)
        weights = []
        for split in (False, True):
            model = towers.split_layers(make_model(), plan, PARTS) if split else make_model()
            optimizer = reference.OPTIMIZERS["adam"]()
            if initial_scale is not None:
                optimizer = keras.optimizers.LossScaleOptimizer(optimizer, initial_scale)
            trainer = towers.TowerTrainer(model, reference.make_loss(), optimizer,
                                          devices=DEVICES[:2], **options)
            if "steps_per_execution" in options:
                arrays = [np.concatenate(parts) for parts in zip(*batches)]
                trainer.fit(tf.data.Dataset.from_tensor_slices(tuple(arrays)).batch(6),
                            verbose=False)
            else:
                for batch in batches:
                    trainer.train_step(batch)
            self.assertEqual(trainer.step, 3)
            weights.append(towers.join_layers(trainer.model).get_weights())
        for expected, actual in zip(*weights):
            self.assertAllClose(actual, expected, atol=tolerance, rtol=0)


class BadPlanTest(tf.test.TestCase, parameterized.TestCase):

    def test_xla_is_refused_in_one_line(self):
        with self.assertRaisesRegex(ValueError, "jit_compile=True cannot compile split layers"):
            split = towers.split_layers(reference.make_up_down_model(), MLP_PLAN, PARTS)
            towers.TowerTrainer(split, reference.make_loss(), reference.OPTIMIZERS["sgd"](),
                                devices=DEVICES[:1], jit_compile=True)

    @parameterized.named_parameters(
        ("unknown_layer", {"nope": "column"}, "does not have; its layers are"),
        ("kind_for_another_layer", {"join": "column"}, "splits Dense or EinsumDense layers, but 'join' is "
                                                       "Concatenate"),
        ("unknown_kind", {"left": "diagonal"}, "is not a kind"),
        ("heads_on_a_dense", {"left": "heads"}, "splits MultiHeadAttention layers, but "
                                                "'left' is Dense"),
        ("vocab_on_a_dense", {"left": "vocab"}, "splits Embedding layers, but 'left' is Dense"),
        ("index_out_of_range", {"left": 3}, "is not a device index: there are 3 devices"),
        ("more_parts_than_units", {"left": "column"}, "splits 4 output units into 5 parts"),
        ("empty_plan", {}, "plan must be a non-empty dict"),
        ("lora", {"left": "column"}, "has LoRA or is quantized"))
    def test_one_line_value_error(self, plan, message):
        devices = DEVICES + ["/device:CPU:0"] if "more_parts" in self._testMethodName else \
            DEVICES[:3]
        model = _branches()
        if "lora" in self._testMethodName:
            model.get_layer("left").enable_lora(2)
        with self.assertRaisesRegex(ValueError, message) as caught:
            towers.split_layers(model, plan, devices)
        self.assertNotIn("\n", str(caught.exception))

    def test_a_subclassed_model_its_config_cannot_rebuild_is_refused(self):
        # A subclassed model is split on a copy rebuilt from its config (tests/
        # test_nested_plans.py splits one); this one's constructor takes no config.
        model = reference.subclassed_model()
        with self.assertRaisesRegex(ValueError, "give Subclassed a get_config") as caught:
            towers.split_layers(model, {model.dense.name: "column"}, DEVICES[:2])
        self.assertNotIn("\n", str(caught.exception))

    def test_a_copy_that_unties_a_shared_layer_is_refused_naming_the_weight(self):
        # A tied layer its config rebuilds as two (Whisper's tied head was refused in a
        # line of 1,054 characters listing every shape, naming no layer).
        class Tied(keras.Model):
            def __init__(self, tied=True, **kwargs):
                super().__init__(**kwargs)
                self.a = keras.layers.Dense(4, name="a")
                self.b = self.a if tied else keras.layers.Dense(4, name="b")

            def call(self, x):
                return self.b(self.a(x))

            def get_config(self):
                return {**super().get_config(), "tied": False}

        model = Tied()
        model(np.zeros((1, 4), "float32"))
        with self.assertRaisesRegex(ValueError, r"does not hold its weights: 4 weights where "
                                    r"the model has 2, .* 'b/kernel'; give Tied a "
                                    r"get_config\(\)") as caught:
            towers.split_layers(model, {"a": "column"}, DEVICES[:2])
        self.assertNotIn("\n", str(caught.exception))
        self.assertLess(len(str(caught.exception)), 400)


def _constrained(seed=0, **dense_options):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(6, name="up", **dense_options),
                             keras.layers.Dense(3, name="out")])


class ExactnessTest(tf.test.TestCase, parameterized.TestCase):
    """What a split would compute per part instead of on the whole weight: refused."""

    @parameterized.named_parameters(
        ("norm_across_a_row_split", {"kernel_constraint": keras.constraints.MaxNorm(2.0, axis=0)},
         "row", r"kernel has the constraint MaxNorm\(axis=0\), which would read the whole"),
        ("norm_across_a_column_split", {"kernel_constraint": keras.constraints.UnitNorm(axis=1)},
         "column", r"kernel has the constraint UnitNorm\(axis=1\)"),
        ("orthogonal_regularizer",
         {"kernel_regularizer": keras.regularizers.OrthogonalRegularizer()}, "column",
         "kernel has the regulariser OrthogonalRegularizer, which reads the whole weight"))
    def test_a_weight_rule_across_the_split_is_refused(self, options, how, message):
        with self.assertRaisesRegex(ValueError, message) as caught:
            towers.split_layers(_constrained(**options), {"up": how}, DEVICES[:2])
        self.assertNotIn("\n", str(caught.exception))

    @parameterized.named_parameters(
        ("lamb", lambda: keras.optimizers.Lamb(), "optimizer Lamb updates each variable"),
        ("adafactor", lambda: keras.optimizers.Adafactor(), "optimizer Adafactor updates"),
        ("loss_scaled_lamb", lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Lamb()),
         "optimizer Lamb updates"),
        ("clipnorm", lambda: keras.optimizers.SGD(0.1, clipnorm=1.0),
         "clipnorm=1.0 clips each variable by its own norm"))
    def test_an_optimizer_that_reads_a_whole_variable_is_refused(self, optimizer, message):
        split = towers.split_layers(_constrained(), {"up": "column"}, DEVICES[:2])
        with self.assertRaisesRegex(ValueError, message) as caught:
            towers.TowerTrainer(split, "mse", optimizer(), devices=[DEVICES[:2]])
        self.assertNotIn("\n", str(caught.exception))

    def test_a_norm_along_an_unsplit_axis_and_global_clipnorm_train_as_one_device(self):
        # MaxNorm(axis=0) bounds each output unit's column, whole within a column part.
        options = {"kernel_constraint": keras.constraints.MaxNorm(0.3, axis=0)}
        whole = _constrained(**options)
        whole.compile(keras.optimizers.SGD(0.5, global_clipnorm=0.5), "mse")
        split = towers.split_layers(_constrained(**options), {"up": "column"}, DEVICES[:2])
        trainer = towers.TowerTrainer(split, "mse", keras.optimizers.SGD(0.5, global_clipnorm=0.5),
                                      devices=[DEVICES[:2], DEVICES[2:]])
        rng = np.random.default_rng(0)
        for _ in range(2):
            x, y = rng.normal(size=(6, 4)).astype("float32"), rng.normal(size=(6, 3))
            whole.train_on_batch(x, y)
            trainer.train_step((x, y))
        for want, got in zip(whole.get_weights(), towers.join_layers(split).get_weights()):
            self.assertAllClose(want, got, atol=1e-5)


class CommandLineTest(tf.test.TestCase, parameterized.TestCase):
    """towers-train --num_parts / --split_plan, run in this process (train.train())."""

    QUICK = dict(num_towers=1, global_batch_size=32, steps=4, optimizer="sgd")

    def test_default_mlp_plan_trains_as_the_unsplit_model(self):
        with flagsaver.flagsaver(**self.QUICK, model="mlp"):
            whole = train.train()
        with flagsaver.flagsaver(**self.QUICK, model="mlp", num_parts=2):
            parted = train.train()
        # The mlp's two hidden Dense layers (Keras names them), as a column -> row pair.
        self.assertEqual((parted["num_parts"], list(parted["split_plan"].values())),
                         (2, ["column", "row"]))
        self.assertAllClose(parted["eval_loss"], whole["eval_loss"], atol=1e-5, rtol=0)
        self.assertEqual((whole["num_parts"], whole["split_plan"]), (1, {}))
        # --tensor_parallel, the flag's name before --num_parts, is its alias for a
        # release: typed on the command line, the same run, and the output keeps its key.
        with flagsaver.flagsaver(**self.QUICK, model="mlp"):
            flags.FLAGS(["towers-train", "--tensor_parallel=2"])
            aliased = train.train()
        self.assertEqual((aliased["num_parts"], aliased["tensor_parallel"],
                          list(aliased["split_plan"].values())), (2, 2, ["column", "row"]))
        self.assertAllClose(aliased["eval_loss"], parted["eval_loss"], atol=1e-6, rtol=0)

    def test_towers_by_parts_train_as_the_unsplit_model_on_those_towers(self):
        quick = {**self.QUICK, "num_towers": 2, "model": "mlp"}
        with flagsaver.flagsaver(**quick):
            whole = train.train()
        with flagsaver.flagsaver(**quick, num_parts=2):
            parted = train.train()
        self.assertEqual(parted["devices"], [DEVICES[:2], DEVICES[2:]])
        self.assertAllClose(parted["eval_loss"], whole["eval_loss"], atol=1e-5, rtol=0)

    def test_checkpoint_resumes_with_another_part_count(self):
        directory = self.create_tempdir().full_path
        with flagsaver.flagsaver(**{**self.QUICK, "steps": 2}, model="mlp", num_parts=2,
                                 checkpoint_dir=directory):
            self.assertEqual(train.train()["steps"], 2)
        with flagsaver.flagsaver(**self.QUICK, model="mlp", num_parts=3,
                                 checkpoint_dir=directory), \
                self.assertLogs("absl", "INFO") as logs:
            resumed = train.train()
        self.assertTrue(any("restored" in line and "batch 2" in line for line in logs.output))
        with flagsaver.flagsaver(**self.QUICK, model="mlp"):  # the same steps, unsplit
            whole = train.train()
        self.assertEqual(resumed["steps"], whole["steps"])
        self.assertAllClose(resumed["eval_loss"], whole["eval_loss"], atol=1e-5, rtol=0)

    def test_towers_stages_and_parts_train_as_the_stages_alone(self):
        # 1 tower x 2 stages x 2 parts: stage k's part j on device 2k + j.
        with flagsaver.flagsaver(**self.QUICK, model="mlp", pipeline_stages=2):
            staged = train.train()
        with flagsaver.flagsaver(**self.QUICK, model="mlp", pipeline_stages=2,
                                 num_parts=2):
            grid = train.train()
        self.assertEqual(grid["devices"], [[DEVICES[:2], DEVICES[2:]]])
        self.assertEqual(list(grid["split_plan"].values()), ["column", "row"])
        self.assertAllClose(grid["eval_loss"], staged["eval_loss"], atol=1e-5, rtol=0)

    def test_split_plan_names_any_layer(self):
        with flagsaver.flagsaver(**self.QUICK, model="text", num_parts=3,
                                 split_plan=["embedding:vocab", "logits:row"]):
            results = train.train()
        self.assertEqual(results["split_plan"], {"embedding": "vocab", "logits": "row"})

    @parameterized.named_parameters(
        ("no_default_plan", dict(model="cnn", num_parts=2),
         r"--num_parts=2 \(alias --tensor_parallel\): model 'cnn' has no default split plan"),
        ("not_layer_kind", dict(model="mlp", num_parts=2, split_plan=["dense"]),
         "--split_plan: 'dense' is not LAYER:KIND"),
        ("bad_plan", dict(model="mlp", num_parts=2, split_plan=["logits:heads"]),
         "plan\\['logits'\\] = 'heads' splits MultiHeadAttention layers"),
        ("stages_without_parts", dict(model="mlp", split_plan=["logits:column"],
                                      pipeline_stages=2),
         "--pipeline_stages=2 with --split_plan needs --num_parts=T"))
    def test_refused_in_one_line(self, options, message):
        with flagsaver.flagsaver(**{**self.QUICK, **options}):
            with self.assertRaisesRegex(ValueError, message):
                train.train()


if __name__ == "__main__":
    tf.test.main()
