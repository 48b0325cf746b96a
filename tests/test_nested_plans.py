"""Plans that reach nested layers (issue 26, part 1): paths with wildcards, a layer
replaced inside its parent (a keras-io style TransformerBlock), on functional and
subclassed models; exact against the unsplit model and Keras on one device."""

import shutil
import tempfile

import keras
import numpy as np
import tensorflow as tf

import towers

DEVICES = [f"/device:CPU:{i}" for i in range(4)]
PARTS = DEVICES[:2]
GRID = [DEVICES[:2], DEVICES[2:]]  # 2 towers x 2 parts
VOCAB, WIDTH, HEADS, FFN, SEQUENCE, CLASSES = 20, 8, 2, 16, 4, 3
TOLERANCE = 1e-5

# Every splittable layer of the model below, reached by paths and wildcards.
PLAN = {"token_and_position_embedding/token_emb": "vocab",
        "transformer_block/att": "heads",
        "transformer_*/ffn/up": "column",
        "transformer_block/f?n/d*": "row",
        "out": 1}
SUBCLASSED_PLAN = {"embed/token_emb": "vocab", "block/att": "heads", "block/ffn/up": "column",
                   "block/ffn/down": "row", "out": 1}


class PlainDense(keras.layers.Dense):
    """A user's Dense subclass that adds nothing to call: split as a Dense."""


class OwnCallDense(keras.layers.Dense):
    """A user's Dense subclass with its own call: refused."""

    def call(self, inputs):
        return super().call(inputs) * 2.0


class TokenAndPositionEmbedding(keras.layers.Layer):
    """keras-io's "Text classification with Transformer" embedding: tokens + positions."""

    def __init__(self, maxlen, vocab_size, embed_dim, **kwargs):
        super().__init__(**kwargs)
        self.token_emb = keras.layers.Embedding(vocab_size, embed_dim, name="token_emb")
        self.pos_emb = keras.layers.Embedding(maxlen, embed_dim, name="pos_emb")

    def call(self, x):
        positions = keras.ops.arange(0, keras.ops.shape(x)[-1], 1)
        return self.token_emb(x) + self.pos_emb(positions)


class TransformerBlock(keras.layers.Layer):
    """keras-io's block (its sublayers named, dropout 0 so that runs compare): attention
    and a feed-forward Sequential held as attributes, run by this layer's own call."""

    def __init__(self, embed_dim, num_heads, ff_dim, up_class="PlainDense", **kwargs):
        super().__init__(**kwargs)
        self.att = keras.layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim,
                                                   name="att")
        up = {"PlainDense": PlainDense, "OwnCallDense": OwnCallDense}[up_class]
        self.ffn = keras.Sequential([up(ff_dim, activation="relu", name="up"),
                                     keras.layers.Dense(embed_dim, name="down")], name="ffn")
        self.layernorm1 = keras.layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = keras.layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = keras.layers.Dropout(0.0)
        self.dropout2 = keras.layers.Dropout(0.0)

    def call(self, inputs, training=False):
        attended = self.dropout1(self.att(inputs, inputs), training=training)
        out1 = self.layernorm1(inputs + attended)
        return self.layernorm2(out1 + self.dropout2(self.ffn(out1), training=training))


def _functional(seed=0, up_class="PlainDense"):
    keras.utils.set_random_seed(seed)
    ids = keras.Input((SEQUENCE,), dtype="int32")
    x = TokenAndPositionEmbedding(SEQUENCE, VOCAB, WIDTH,
                                  name="token_and_position_embedding")(ids)
    x = TransformerBlock(WIDTH, HEADS, FFN, up_class, name="transformer_block")(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(ids, keras.layers.Dense(CLASSES, name="out")(x))


class Classifier(keras.Model):
    """The same network as a subclassed model."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embed = TokenAndPositionEmbedding(SEQUENCE, VOCAB, WIDTH, name="embed")
        self.block = TransformerBlock(WIDTH, HEADS, FFN, name="block")
        self.out = keras.layers.Dense(CLASSES, name="out")

    def call(self, ids):
        return self.out(keras.ops.mean(self.block(self.embed(ids)), axis=1))


def _subclassed(seed=0):
    keras.utils.set_random_seed(seed)
    model = Classifier()
    model(np.zeros((1, SEQUENCE), np.int32))
    return model


class FunctionalClassifier(keras.Model):
    """The same network as a Functional subclass (as keras_hub's backbones are), its
    config its constructor's arguments."""

    def __init__(self, **kwargs):
        ids = keras.Input((SEQUENCE,), dtype="int32")
        x = TokenAndPositionEmbedding(SEQUENCE, VOCAB, WIDTH, name="embed")(ids)
        x = TransformerBlock(WIDTH, HEADS, FFN, name="block")(x)
        x = keras.layers.GlobalAveragePooling1D()(x)
        super().__init__(ids, keras.layers.Dense(CLASSES, name="head")(x), **kwargs)

    def get_config(self):
        return {"name": self.name}

    @classmethod
    def from_config(cls, config):
        return cls(**config)


def _batch(seed, rows=6):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, VOCAB, (rows, SEQUENCE)).astype("int32"),
            rng.integers(0, CLASSES, rows).astype("int32"))


def _device_of(variable):
    return towers.devices.canonical_name(variable.value.device)


def _state(model):
    return [(w.path, w.numpy().copy()) for w in model.weights], [
        type(layer) for layer in towers.compat.nested_layers(model)]


class NestedPlanTest(tf.test.TestCase):

    def test_computes_what_the_model_computes_with_each_part_on_its_device(self):
        model = _functional()
        before = _state(model)
        x, _ = _batch(0)
        parted = towers.split_layers(model, PLAN, PARTS)
        self.assertAllClose(parted(x), model(x), atol=TOLERANCE, rtol=0)
        block = parted.get_layer("transformer_block")
        self.assertIsInstance(block.att, towers.op_parallel.forms.HeadsAttention)
        self.assertIsInstance(block.ffn.layers[0], towers.op_parallel.dense.ColumnDense)
        self.assertIsInstance(block.ffn.layers[1], towers.op_parallel.dense.RowDense)
        # The replaced layers' variables left the parents' weights; the parts' took their
        # place: token 2 + positions 1 + heads 2 x 8 - 1 (one output bias) + up 2 x 2 +
        # down 2 + 1 + norms 4 + out 2 (the original's 20 weights, split).
        self.assertLen(model.weights, 20)
        self.assertLen(parted.weights, 31)
        self.assertLen(set(id(w) for w in parted.weights), 31)
        devices = {w.path: _device_of(w) for w in parted.weights}
        for j, device in enumerate(PARTS):
            for path in (f"token_and_position_embedding/token_emb/part_{j}/embeddings",
                         f"transformer_block/att/part_{j}/query/kernel",
                         f"transformer_block/att/part_{j}/attention_output/kernel",
                         f"transformer_block/ffn/up/part_{j}/kernel",
                         f"transformer_block/ffn/down/part_{j}/kernel"):
                self.assertEqual(devices[path], device, path)
        self.assertEqual(devices["out/out/kernel"], PARTS[1])  # placed whole on device 1
        others = [p for p in devices if "part_" not in p and not p.startswith("out/")]
        self.assertLen(others, 5)  # positions and the two norms, on devices[0]
        self.assertEqual({devices[p] for p in others}, {PARTS[0]})
        self.assertEqual(_state(model)[1], before[1])  # the original is left as it was
        for (path, value), (path_after, value_after) in zip(before[0], _state(model)[0]):
            self.assertEqual(path, path_after)
            self.assertAllEqual(value, value_after)

    def test_wildcard_top_level_plan_equals_the_named_one(self):
        model = _functional()
        x, _ = _batch(1)
        named = towers.split_layers(model, {"out": "column"}, PARTS)  # clone_model's path
        matched = towers.split_layers(model, {"o?t": "column"}, PARTS)  # paths'
        self.assertAllClose(matched(x), named(x), atol=1e-6, rtol=0)
        self.assertEqual([w.path for w in matched.weights if "out" in w.path],
                         [w.path for w in named.weights if "out" in w.path])

    def test_trains_on_towers_by_parts_as_keras_on_one_device(self):
        batches = [_batch(seed) for seed in (2, 3)]
        for build, plan in ((_functional, PLAN), (_subclassed, SUBCLASSED_PLAN)):
            expected = build()
            expected.compile(keras.optimizers.SGD(0.1),
                             keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                             jit_compile=False)
            for x, y in batches:
                expected.train_on_batch(x, y)
            trainer = towers.TowerTrainer(
                towers.split_layers(build(), plan, PARTS),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                keras.optimizers.SGD(0.1), devices=GRID)
            for batch in batches:
                trainer.train_step(batch)
            joined = towers.join_layers(trainer.model)
            self.assertEqual([w.shape for w in joined.weights],
                             [w.shape for w in expected.weights])
            for actual, wanted in zip(joined.get_weights(), expected.get_weights()):
                self.assertAllClose(actual, wanted, atol=TOLERANCE, rtol=0)

    def test_join_gives_the_original_structure_and_weights_back(self):
        for build, plan in ((_functional, PLAN),
                            (_subclassed, SUBCLASSED_PLAN)):
            model = build()
            x, _ = _batch(4)
            parted = towers.split_layers(model, plan, PARTS)
            self.assertAllClose(parted(x), model(x), atol=TOLERANCE, rtol=0)
            joined = towers.join_layers(parted)
            self.assertIs(type(joined), type(model))
            self.assertEqual([type(layer) for layer in towers.compat.nested_layers(joined)],
                             [type(layer) for layer in towers.compat.nested_layers(model)])
            for actual, wanted in zip(joined.get_weights(), model.get_weights(), strict=True):
                self.assertAllEqual(actual, wanted)
            self.assertAllClose(joined(x), model(x), atol=1e-6, rtol=0)

    def test_functional_subclass_and_nested_sequential(self):
        keras.utils.set_random_seed(0)
        inner = keras.Sequential([keras.layers.Dense(6, activation="relu", name="a"),
                                  keras.layers.Dense(4, name="b")], name="inner")
        sequential = keras.Sequential([keras.Input((5,)), inner, keras.layers.Dense(3, name="c")])
        keras.utils.set_random_seed(0)
        for model, plan, x in (
                (FunctionalClassifier(), {"head": "column", "block/ffn/*": 0, "embed/*": "vocab",
                                          "block/att": "heads"}, _batch(5)[0]),
                (sequential, {"inner/a": "column", "inner/b": "row", "c": 1},
                 np.random.default_rng(0).normal(size=(3, 5)).astype("float32"))):
            parted = towers.split_layers(model, plan, PARTS)
            self.assertIs(type(parted), type(model))
            self.assertAllClose(parted(x), model(x), atol=TOLERANCE, rtol=0)
            joined = towers.join_layers(parted)
            self.assertIs(type(joined), type(model))
            for actual, wanted in zip(joined.get_weights(), model.get_weights(), strict=True):
                self.assertAllEqual(actual, wanted)

    def test_checkpoint_restores_unsplit(self):
        # Saved from 2 parts, restored into the unsplit model, trained on: as if the
        # unsplit model had trained all along on the same towers (momentum slots moved).
        batches = [_batch(seed) for seed in (6, 7, 8)]
        directory = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, directory)

        def trainer(model):
            trainer = towers.TowerTrainer(
                model, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                keras.optimizers.SGD(0.1, momentum=0.9), devices=DEVICES[:2])
            trainer.optimizer.build(model.trainable_variables)
            return trainer, towers.Checkpointer(directory, model, trainer.optimizer)

        expected, _ = trainer(_functional())
        for batch in batches:
            expected.train_step(batch)
        saving, checkpointer = trainer(towers.split_layers(_functional(), PLAN, PARTS))
        for batch in batches[:2]:
            saving.train_step(batch)
        checkpointer.save(epoch=0, batch_in_epoch=2)
        restoring, checkpointer = trainer(_functional(seed=1))
        self.assertIsNotNone(checkpointer.restore())
        restoring.train_step(batches[2])
        for actual, wanted in zip(restoring.model.get_weights(), expected.model.get_weights()):
            self.assertAllClose(actual, wanted, atol=TOLERANCE, rtol=0)

    def test_refused_in_one_line(self):
        model = _functional()
        before = _state(model)
        for plan, message in (
                ({"transformer_block/nope": "heads"},
                 r"^plan key 'transformer_block/nope' matches no layer of model .*its layer "
                 r"paths at that depth are \['token_and_position_embedding/token_emb'"),
                ({"transformer_block/ffn/up": "column", "transformer_block/ffn/*": "row"},
                 r"^plan keys 'transformer_block/ffn/up' and 'transformer_block/ffn/\*' both "
                 r"name layer 'transformer_block/ffn/up', as 'column' and 'row'"),
                ({"transformer_block": 1, "transformer_block/att": "heads"},
                 r"inside 'transformer_block', which plan key 'transformer_block' already"),
                ({"transformer_block/att": "column"},
                 r"splits Dense or EinsumDense layers, but 'att' is MultiHeadAttention")):
            with self.assertRaisesRegex(ValueError, message) as caught:
                towers.split_layers(model, plan, PARTS)
            self.assertNotIn("\n", str(caught.exception))
        own_call = _functional(up_class="OwnCallDense")
        with self.assertRaisesRegex(
                ValueError, r"^plan\['transformer_\*/ffn/up'\] = 'column': 'up' is a "
                            r"OwnCallDense, a Dense subclass with its own call") as caught:
            towers.split_layers(own_call, PLAN, PARTS)
        self.assertNotIn("\n", str(caught.exception))
        after = _state(model)
        self.assertEqual([p for p, _ in after[0]], [p for p, _ in before[0]])
        self.assertEqual(after[1], before[1])
