"""split_layers with a keras.distribution.LayoutMap: each weight's layout along the mesh's
model axis read as the exact split, against the same plan written by hand."""

import functools
import tempfile

import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import towers
from towers.cli import plans
from towers.op_parallel import dense, forms, layouts

DEVICES = [f"/device:CPU:{i}" for i in range(4)]


def _device_of(variable):
    return towers.devices.canonical_name(variable.value.device)


def _mesh(parts=2, axes=("data", "model")):
    return keras.distribution.DeviceMesh(shape=(1, parts), axis_names=list(axes),
                                         devices=[f"cpu:{i}" for i in range(parts)])


def _layout(entries, parts=2, axes=("data", "model")):
    layout_map = keras.distribution.LayoutMap(_mesh(parts, axes))
    for key, value in entries.items():
        layout_map[key] = value
    return layout_map


def _model():
    """Token ids -> Embedding "table" -> self-attention "att" -> Dense "up" (relu) ->
    Dense "down" -> LayerNorm -> pooled logits."""
    keras.utils.set_random_seed(0)
    ids = keras.Input((4,), dtype="int32")
    h = keras.layers.Embedding(20, 8, name="table")(ids)
    h = keras.layers.MultiHeadAttention(2, 4, name="att")(h, h)
    h = keras.layers.Dense(16, activation="relu", name="up")(h)
    h = keras.layers.Dense(8, name="down")(h)
    h = keras.layers.LayerNormalization(name="norm")(h)
    return keras.Model(ids, keras.layers.Dense(3, name="logits")(
        keras.layers.GlobalAveragePooling1D()(h)))


# Megatron's layout, as keras_hub's get_layout_map writes it: regex keys over variable paths.
MEGATRON = {"table/embeddings": ("model", None),
            "att/(query|key|value)/kernel": (None, "model", None),
            "att/attention_output/kernel": ("model", None, None),
            "up/kernel": ("data", "model"), "up/bias": ("model",),
            "down/kernel": ("model", "data")}


class LayoutMapTest(tf.test.TestCase, parameterized.TestCase):

    def test_each_layout_is_the_split_a_plan_names(self):
        model, x = _model(), np.arange(12).reshape(3, 4) % 20
        split = towers.split_layers(model, _layout(MEGATRON), DEVICES[:2])
        self.assertIsInstance(split.get_layer("table"), forms.VocabEmbedding)
        self.assertIsInstance(split.get_layer("att"), forms.HeadsAttention)
        self.assertIsInstance(split.get_layer("up"), dense.ColumnDense)
        self.assertIsInstance(split.get_layer("down"), dense.RowDense)
        self.assertIsInstance(split.get_layer("norm"), keras.layers.LayerNormalization)
        by_hand = towers.split_layers(model, {"table": "vocab", "att": "heads", "up": "column",
                                              "down": "row"}, DEVICES[:2])
        self.assertAllClose(split(x), model(x), atol=1e-5)
        for a, b in zip(split.get_weights(), by_hand.get_weights()):
            self.assertAllEqual(a, b)

    def test_another_axis_name_and_three_parts(self):
        layout_map = _layout({"up/kernel": (None, "tp"), "down/kernel": ("tp", None)}, parts=3,
                             axes=("batch", "tp"))
        split = towers.split_layers(_model(), layout_map, DEVICES[:3], model_axis="tp")
        self.assertEqual(len(split.get_layer("up").parts), 3)
        self.assertIsInstance(split.get_layer("down"), dense.RowDense)

    @parameterized.named_parameters(
        ("a_bias_alone", {"up/bias": ("model",)},
         r"shards up/bias \(16,\) along 'model' \(dim 0\), which no split computes"),
        ("a_norm_scale", {"norm/gamma": ("model",)}, r"shards norm/gamma \(8,\)"),
        ("a_row_bias", {"down/kernel": ("model", None), "down/bias": ("model",)},
         "a row split keeps the bias whole on part 0"),
        ("an_embedding_by_width", {"table/embeddings": (None, "model")},
         r"an Embedding table is split by its vocabulary only"),
        ("attention_by_key_width", {"att/query/kernel": (None, None, "model")},
         "a MultiHeadAttention is split by heads"),
        ("nothing_split", {"up/kernel": ("data", None)}, "shards no weight of model"),
        ("a_mesh_without_the_axis", {"up/kernel": (None, "tp")},
         r"mesh has axes \['data', 'tp'\], not model_axis='model'"),
        ("another_part_count", {"up/kernel": (None, "model")},
         "mesh has 3 devices along 'model' but split_layers was given 2"))
    def test_a_layout_with_no_exact_split_is_one_line(self, entries, message):
        parts = 3 if "part_count" in self._testMethodName else 2
        axes = ("data", "tp") if "without_the_axis" in self._testMethodName else ("data", "model")
        with self.assertRaisesRegex(ValueError, message) as caught:
            towers.split_layers(_model(), _layout(entries, parts, axes), DEVICES[:2])
        self.assertNotIn("\n", str(caught.exception))

    def test_trains_as_one_device(self):
        keras_model = _model()
        keras_model.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(
            from_logits=True))
        split = towers.split_layers(_model(), _layout(MEGATRON), DEVICES[:2])
        trainer = towers.TowerTrainer(split, keras.losses.SparseCategoricalCrossentropy(
            from_logits=True), keras.optimizers.SGD(0.1), devices=[DEVICES[:2], DEVICES[2:]])
        rng = np.random.default_rng(0)
        for _ in range(2):
            x, y = rng.integers(0, 20, (5, 4)).astype("int32"), rng.integers(0, 3, 5)
            keras_model.train_on_batch(x, y)
            trainer.train_step((x, y))
        for want, got in zip(keras_model.get_weights(), towers.join_layers(split).get_weights()):
            self.assertAllClose(want, got, atol=1e-5)


def _einsum_model():
    """(B, 3, 6) -> "btd,ndh->btnh" (4 heads of 3, relu) -> "btnh,nhd->btd" ->
    "...d,ndh->...nh" -> "...nh,nhd->...d": heads on a non-last letter, with "..."
    and without; biases along the heads."""
    keras.utils.set_random_seed(0)
    x = keras.Input((3, 6))
    dense = functools.partial(keras.layers.EinsumDense, bias_initializer="random_normal")
    h = dense("btd,ndh->btnh", (None, 4, 3), bias_axes="nh", activation="relu",
              name="heads_in")(x)
    h = dense("btnh,nhd->btd", (None, 6), bias_axes="d", name="heads_out")(h)
    h = dense("...d,ndh->...nh", (4, 3), bias_axes="nh", name="elided_in")(h)
    return keras.Model(x, dense("...nh,nhd->...d", 6, bias_axes="d", name="elided_out")(h))


# Each kernel sharded along its heads letter n (dim 0), which is not the last letter of
# its kind (h): "column:n" for the projections into heads, "row:n" for those out of them.
BY_HEADS = {"(heads_in|elided_in)/kernel": ("model", None, None),
            "(heads_in|elided_in)/bias": ("model", None),
            "(heads_out|elided_out)/kernel": ("model", None, None)}
HEADS_PLAN = {"heads_in": "column:n", "heads_out": "row:n", "elided_in": "column:n",
              "elided_out": "row:n"}


class EinsumAxisTest(tf.test.TestCase, parameterized.TestCase):
    """EinsumDense split along a letter other than the last of its kind."""

    def test_layout_names_the_letter_and_trains_as_one_device(self):
        self.assertEqual(layouts.plan_of(_einsum_model(), _layout(BY_HEADS), 2), HEADS_PLAN)
        keras_model = _einsum_model()
        keras_model.compile(keras.optimizers.Adam(0.01), "mse")
        split = towers.split_layers(_einsum_model(), _layout(BY_HEADS), DEVICES[:2])
        x = np.random.default_rng(0).normal(size=(5, 3, 6)).astype("float32")
        self.assertAllClose(split(x), keras_model(x), atol=1e-5)
        for name in HEADS_PLAN:
            form = split.get_layer(name)
            self.assertEqual(form.get_config()["letter"], "n")
            self.assertEqual([part.kernel.shape[0] for part in form.parts], [2, 2])
            self.assertEqual([_device_of(part.kernel) for part in form.parts], DEVICES[:2])
        trainer = towers.TowerTrainer(split, "mse", keras.optimizers.Adam(0.01),
                                      devices=[DEVICES[:2], DEVICES[2:]])
        rng = np.random.default_rng(1)
        for rows in (5, 4):
            x, y = rng.normal(size=(rows, 3, 6)), rng.normal(size=(rows, 3, 6))
            keras_model.train_on_batch(x.astype("float32"), y.astype("float32"))
            trainer.train_step((x.astype("float32"), y.astype("float32")))
        for want, got in zip(keras_model.get_weights(), towers.join_layers(split).get_weights()):
            self.assertAllClose(want, got, atol=1e-5, rtol=0)
        # The letter survives a checkpoint into another part count.
        three = towers.split_layers(_einsum_model(), HEADS_PLAN, DEVICES[:3])
        with tempfile.TemporaryDirectory() as directory:
            towers.Checkpointer(directory, split, trainer.optimizer).save(0, 2)
            self.assertIsNotNone(
                towers.Checkpointer(directory, three, keras.optimizers.Adam(0.01)).restore())
        self.assertEqual([p.kernel.shape[0] for p in three.get_layer("elided_out").parts],
                         [2, 1, 1])
        for want, got in zip(keras_model.get_weights(), towers.join_layers(three).get_weights()):
            self.assertAllClose(want, got, atol=1e-5, rtol=0)

    @parameterized.named_parameters(
        ("a_letter_not_in_the_equation", {"heads_in": "column:x"},
         r"plan\['heads_in'\] = 'column:x': a 'column' split of 'btd,ndh->btnh' is along an "
         r"output-only letter .*: 'n' or 'h', not 'x'"),
        ("a_contracted_letter_for_a_column", {"heads_out": "column:n"},
         r"'btnh,nhd->btd' is along an output-only letter .*: 'd', not 'n'"),
        ("an_output_letter_for_a_row", {"heads_in": "row:h"},
         r"'row:h': a 'row' split of 'btd,ndh->btnh' is along a contracted letter .*: 'd', "
         "not 'h'"),
        ("a_dense_input_letter_for_a_column", {"dense": "column:i"},
         r"a 'column' split of '...i,io->...o' is along an output-only letter .*: 'o', not 'i'"),
        ("no_letter", {"heads_in": "column:"}, r"'n' or 'h', not ''"),
        ("a_letter_on_another_kind", {"heads_in": "vocab:n"}, r"'vocab:n' is not a kind"))
    def test_a_wrong_letter_is_one_line(self, plan, message):
        model = _einsum_model()
        if "dense" in plan:
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="dense")])
        with self.assertRaisesRegex(ValueError, message) as caught:
            towers.split_layers(model, plan, DEVICES[:2])
        self.assertNotIn("\n", str(caught.exception))

    def test_a_dense_takes_its_own_letters(self):
        model = _model()
        x = np.arange(12).reshape(3, 4) % 20
        split = towers.split_layers(model, {"up": "column:o", "down": "row:i"}, DEVICES[:2])
        self.assertAllClose(split(x), model(x), atol=1e-5)
        self.assertIsInstance(split.get_layer("down"), dense.RowDense)

    def test_a_kernel_letter_of_neither_kind_is_one_line(self):
        # "bnd,ndh->bnh": n runs through input, kernel and output (one kernel per head).
        x = keras.Input((4, 3))
        model = keras.Model(x, keras.layers.EinsumDense("bnd,ndh->bnh", (4, 2), name="per_head")(x))
        with self.assertRaisesRegex(
                ValueError, r"shards per_head/kernel dim 0, which no split computes exactly: "
                r"EinsumDense 'per_head': kernel dim 0 is 'n' in 'bnd,ndh->bnh', "
                "but a column split is along an output-only letter") as caught:
            towers.split_layers(model, _layout({"per_head/kernel": ("model", None, None)}),
                                DEVICES[:2])
        self.assertNotIn("\n", str(caught.exception))

    def test_split_plan_takes_a_letter_after_the_kind(self):
        self.assertEqual(plans.parse(["block_*/attention_output:row:u", "up:column", "out:1"]),
                         {"block_*/attention_output": "row:u", "up": "column", "out": 1})


class NestedLayoutTest(tf.test.TestCase):

    def test_regex_keys_reach_layers_inside_custom_blocks(self):
        from tests import test_nested_plans as nested
        model = nested._functional()
        layout_map = _layout({
            ".*token_emb/embeddings": ("model", None),
            ".*att/(query|key|value)/kernel": (None, "model", None),
            ".*att/attention_output/kernel": ("model", None, None),
            ".*ffn/up/kernel": (None, "model"), ".*ffn/up/bias": ("model",),
            ".*ffn/down/kernel": ("model", None)})
        split = towers.split_layers(model, layout_map, DEVICES[:2])
        by_hand = towers.split_layers(model, {k: v for k, v in nested.PLAN.items() if k != "out"},
                                      DEVICES[:2])
        x, _ = nested._batch(0)
        self.assertAllClose(split(x), model(x), atol=1e-5)
        # The same parts (auto-named nested layers take new names in each copy).
        self.assertEqual([v.path for v in split.weights if "part_" in v.path],
                         [v.path for v in by_hand.weights if "part_" in v.path])
        for a, b in zip(split.get_weights(), by_hand.get_weights()):
            self.assertAllEqual(a, b)
