"""split_layers with a keras.distribution.LayoutMap: each weight's layout along the mesh's
model axis read as the exact split, against the same plan written by hand."""

import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import towers
from towers.op_parallel import dense, layers

DEVICES = [f"/device:CPU:{i}" for i in range(4)]


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
        self.assertIsInstance(split.get_layer("table"), layers.VocabEmbedding)
        self.assertIsInstance(split.get_layer("att"), layers.HeadsAttention)
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
         r"an Embedding table is split by its rows \(dim 0\) only"),
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
