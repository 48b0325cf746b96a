"""Pipeline cuts by layer path: a cut inside a nested functional model (a keras_hub task
model's backbone) cuts the model there, with the same layers and weights, and trains as
Keras on one device; a layer called in two stages (GPT-2's tied token embedding and LM
head, ALBERT's one transformer layer called once per layer) keeps its weights with the
first, and trains as Keras too."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from absl.testing import parameterized

import towers
from towers import layer_paths
from towers.cli import models

keras_hub = pytest.importorskip("keras_hub")  # the [hub] extra (scripts/test installs it)

DEVICES = [f"/device:CPU:{i}" for i in range(4)]
GRID = [DEVICES[:2], DEVICES[2:]]  # 2 towers x 2 stages
TOLERANCE = 1e-5
SEQUENCE, VOCABULARY, CLASSES = 6, 30, 3
CUT = "bert_backbone*/transformer_layer_0"


def _classifier(seed=0):
    """BertTextClassifier on a BertBackbone of 2 layers, 2 heads, width 8: token ids,
    segment ids and padding mask in, 3 logits out; its backbone a nested functional
    model."""
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=VOCABULARY, num_layers=2, num_heads=2, hidden_dim=8,
        intermediate_dim=16, max_sequence_length=SEQUENCE, dropout=0.0)
    return keras_hub.models.BertTextClassifier(backbone, CLASSES, preprocessor=None,
                                               dropout=0.0)


def _batches(rows=(8, 6), seed=0):
    """Per step: (token ids, segment ids and a padding mask with padded tails, labels)."""
    rng = np.random.default_rng(seed)
    batches = []
    for n in rows:
        lengths = rng.integers(2, SEQUENCE + 1, n)
        mask = np.arange(SEQUENCE)[None] < lengths[:, None]
        x = {"token_ids": np.where(mask, rng.integers(1, VOCABULARY, (n, SEQUENCE)), 0),
             "segment_ids": (np.arange(SEQUENCE)[None] >= 3) & mask,
             "padding_mask": mask}
        x = {key: value.astype("int32") for key, value in x.items()}
        batches.append((x, rng.integers(0, CLASSES, n).astype("int32")))
    return batches


def _albert_classifier(seed=0):
    """AlbertTextClassifier on an AlbertBackbone of 2 layers sharing one transformer layer
    (num_groups=1), 2 heads, width 8 over embeddings of 4: the inputs of _classifier."""
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.AlbertBackbone(
        vocabulary_size=VOCABULARY, num_layers=2, num_heads=2, embedding_dim=4, hidden_dim=8,
        intermediate_dim=16, max_sequence_length=SEQUENCE)
    return keras_hub.models.AlbertTextClassifier(backbone, CLASSES, preprocessor=None,
                                                 dropout=0.0)


def _device(variable):
    """The short name ("/device:CPU:1") of the device `variable` lives on."""
    spec = tf.DeviceSpec.from_string(variable.value.device)
    return f"/device:{spec.device_type}:{spec.device_index}"


def _gpt2_lm(seed=0):
    """GPT2CausalLM on a GPT2Backbone of 2 layers, 2 heads, width 16: its token embedding
    looks tokens up in the backbone and, reversed, is the LM head."""
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=40, num_layers=2, num_heads=2, hidden_dim=16, intermediate_dim=32,
        max_sequence_length=SEQUENCE, dropout=0.0)
    return keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)


def _lm_batches(rows=(8, 6), seed=1):
    """Per step: (token ids and padding mask, next-token targets, the mask as sample
    weights), as GPT2CausalLM's preprocessor gives them."""
    rng = np.random.default_rng(seed)
    batches = []
    for n in rows:
        mask = np.arange(SEQUENCE)[None] < rng.integers(2, SEQUENCE + 1, n)[:, None]
        ids = np.where(mask, rng.integers(1, 40, (n, SEQUENCE)), 0).astype("int32")
        batches.append(({"token_ids": ids, "padding_mask": mask.astype("int32")},
                        np.roll(ids, -1, axis=1), mask.astype("int32")))
    return batches


def _loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _nested(name="outer"):
    """A plain Keras model two functional levels deep: outer -> block (functional) ->
    core (functional) -> dense layers; a wildcard reaches the innermost."""
    keras.utils.set_random_seed(1)
    inner_in = keras.Input((4,))
    core = keras.Model(inner_in, keras.layers.Dense(3, name="b")(
        keras.layers.Dense(5, activation="tanh", name="a")(inner_in)), name="core")
    block_in = keras.Input((4,))
    block = keras.Model(block_in, keras.layers.Dense(2, name="c")(core(block_in)),
                        name="block_7")
    x = keras.Input((4,), name="features")
    outputs = keras.layers.Dense(1, name="head")(block(keras.layers.Dense(4, name="d")(x)))
    return keras.Model(x, outputs, name=name)


class SplitByPathTest(tf.test.TestCase, parameterized.TestCase):

    def test_cut_inside_the_backbone_chains_to_the_model_with_its_weights(self):
        model = _classifier()
        first, second = towers.split_model(model, [CUT])
        self.assertIn("transformer_layer_0", [layer.name for layer in first.layers])
        self.assertIn("transformer_layer_1", [layer.name for layer in second.layers])
        x = _batches()[0][0]
        self.assertAllClose(model(x), second(first(x)), atol=1e-6, rtol=0)
        owned = [id(v) for stage in (first, second) for v in stage.weights]
        self.assertCountEqual(owned, [id(v) for v in model.weights])  # each once, no copy

    def test_two_levels_deep_and_a_top_level_name(self):
        model = _nested()
        x = np.random.default_rng(0).normal(size=(3, 4)).astype("float32")
        for cuts in (["block_*/core/a"], ["d", "block_*/core/a"], ["block_7/core/b"]):
            values = x
            for stage in towers.split_model(model, cuts):
                values = stage(values)
            self.assertAllClose(model(x), values, atol=1e-6, rtol=0)

    @parameterized.named_parameters(
        ("no_match", ["bert_backbone*/nope"], r"^pipeline cut 'bert_backbone\*/nope' matches "
                                              r"no layer of model .*; its layer paths at "
                                              r"that depth are \['bert_backbone\w*/token_"),
        ("several", ["bert_backbone*/transformer_layer_*"],
         r"^pipeline cut .* matches 2 layers of model .*; name one\.$"),
        ("inside_a_layer", ["bert_backbone*/transformer_layer_0/self_attention_layer"],
         r"^pipeline cut .* lies inside 'bert_backbone\w*/transformer_layer_0', a "
         r"TransformerEncoder whose call\(\) is not a functional graph"),
        ("nested_by_name", ["transformer_layer_0"],
         r"^pipeline cut 'transformer_layer_0' is not the name of a layer .*; a nested "
         r"layer is cut by its path, as 'bert_backbone\w*/transformer_layer_0'\.$"),
        ("out_of_order", ["bert_backbone*/transformer_layer_1", CUT],
         r"are not in the order of the model's layers"))
    def test_bad_paths(self, cuts, message):
        with self.assertRaisesRegex(ValueError, message):
            towers.split_model(_classifier(), cuts)


class TrainsAsKerasTest(tf.test.TestCase):

    def test_two_towers_two_stages_inside_the_backbone(self):
        batches = _batches()  # 8 rows: 4 per tower; 6: 3 per tower
        expected = _classifier()
        expected.compile(keras.optimizers.Adam(1e-3), _loss())
        for x, y in batches:
            expected.train_on_batch(x, y)
        # Largest difference measured: 3.7e-9 with 1 micro-batch and with 2.
        for micro_batches in (1, 2):
            model = _classifier()
            trainer = towers.TowerTrainer(model, _loss(), keras.optimizers.Adam(1e-3),
                                          devices=GRID, pipeline_cuts=[CUT],
                                          micro_batches=micro_batches)
            self.assertEqual(trainer.num_stages, 2)
            for batch in batches:
                trainer.train_step(batch)
            for k in range(2):  # stage k's weights on the first tower's k-th device
                self.assertEqual({_device(v) for v in trainer.setup.stages.variables(k)},
                                 {GRID[0][k]})
            for want, got in zip(expected.get_weights(), model.get_weights(), strict=True):
                self.assertAllClose(want, got, atol=TOLERANCE, rtol=0)


class SharedAcrossStagesTest(tf.test.TestCase):
    """GPT2CausalLM cut inside its backbone: its token embedding is looked up in stage 0
    and, reversed, is the LM head in stage 1."""

    def test_the_first_stage_owns_a_layer_both_call(self):
        lm = _gpt2_lm()
        stages = towers.model_parallel.stages.Stages(lm, ["gpt2_backbone*/transformer_layer_0"])
        table = id(lm.backbone.token_embedding.embeddings)
        self.assertIn(table, [id(v) for v in stages.models[1].weights])  # the LM head reads it
        self.assertIn(table, [id(v) for v in stages.variables(0)])
        self.assertNotIn(table, [id(v) for v in stages.variables(1)])
        owned = [id(v) for k in range(2) for v in stages.variables(k)]
        self.assertCountEqual(owned, [id(v) for v in lm.variables])  # each once

    def test_trains_as_keras_on_one_device(self):
        batches = _lm_batches()
        expected = _gpt2_lm()
        expected.compile(keras.optimizers.Adam(1e-3), _loss(), weighted_metrics=[])
        for x, y, weights in batches:
            expected.train_on_batch(x, y, sample_weight=weights)
        # Largest difference measured: 8.4e-8 with 1 micro-batch, 5.3e-8 with 2 under
        # 1F1B, each stage recomputed (without the LM head's gradient the embedding
        # would be off by about Adam's rate, 1e-3).
        for options in ({}, {"micro_batches": 2, "pipeline_schedule": "1f1b",
                             "recompute": "stages"}):
            lm = _gpt2_lm()
            trainer = towers.TowerTrainer(lm, _loss(), keras.optimizers.Adam(1e-3),
                                          devices=GRID, **options,
                                          pipeline_cuts=["gpt2_backbone*/transformer_layer_0"])
            for batch in batches:
                trainer.train_step(batch)
            self.assertEqual(_device(lm.backbone.token_embedding.embeddings), GRID[0][0])
            for want, got in zip(expected.get_weights(), lm.get_weights(), strict=True):
                self.assertAllClose(want, got, atol=TOLERANCE, rtol=0)

    def test_a_grouped_query_attention_lm_trains_as_keras(self):
        # MistralCausalLM (4 query heads over 2 key/value heads): its token embedding (a
        # ReversibleEmbedding, its reverse table untied) in both stages. Measured 5.6e-9.
        def mistral_lm():
            keras.utils.set_random_seed(0)
            return keras_hub.models.MistralCausalLM(keras_hub.models.MistralBackbone(
                vocabulary_size=40, num_layers=2, num_query_heads=4, num_key_value_heads=2,
                hidden_dim=16, intermediate_dim=32, sliding_window=SEQUENCE),
                preprocessor=None)

        batches = _lm_batches()
        expected = mistral_lm()
        expected.compile(keras.optimizers.Adam(1e-3), _loss(), weighted_metrics=[])
        for x, y, weights in batches:
            expected.train_on_batch(x, y, sample_weight=weights)
        lm = mistral_lm()
        trainer = towers.TowerTrainer(lm, _loss(), keras.optimizers.Adam(1e-3), devices=GRID,
                                      pipeline_cuts=["mistral_backbone*/transformer_layer_0"])
        for batch in batches:
            trainer.train_step(batch)
        for want, got in zip(expected.get_weights(), lm.get_weights(), strict=True):
            self.assertAllClose(want, got, atol=TOLERANCE, rtol=0)

    def test_albert_s_shared_layer_in_both_stages_trains_as_keras(self):
        # A cut after a layer called twice cuts after its first call: ALBERT's one
        # transformer layer runs in stage 0, then again in stage 1, reading its weights
        # from stage 0, where its gradients from both calls meet. Measured 3.7e-9.
        cut = "albert_backbone*/group_0_inner_layer_0"
        batches = _batches()
        expected = _albert_classifier()
        expected.compile(keras.optimizers.Adam(1e-3), _loss())
        for x, y in batches:
            expected.train_on_batch(x, y)
        model = _albert_classifier()
        trainer = towers.TowerTrainer(model, _loss(), keras.optimizers.Adam(1e-3), devices=GRID,
                                      pipeline_cuts=[cut], micro_batches=2)
        stages = trainer.setup.stages
        shared = [id(v) for v in model.backbone.get_layer("group_0_inner_layer_0").weights]
        for k in range(2):  # both stages call it; its weights are stage 0's
            self.assertContainsSubset(shared, [id(v) for v in stages.models[k].weights])
        self.assertContainsSubset(shared, [id(v) for v in stages.variables(0)])
        self.assertNoCommonElements(shared, [id(v) for v in stages.variables(1)])
        for batch in batches:
            trainer.train_step(batch)
        for want, got in zip(expected.get_weights(), model.get_weights(), strict=True):
            self.assertAllClose(want, got, atol=TOLERANCE, rtol=0)

    def test_state_or_a_regularizer_in_two_stages_is_refused(self):
        for shared, why in ((keras.layers.BatchNormalization(name="shared"), "holds state"),
                            (keras.layers.Dense(4, kernel_regularizer="l2", name="shared"),
                             "has a regularizer on 'shared/kernel'")):
            x = keras.Input((4,))
            y = shared(keras.layers.Dense(4, name="middle")(shared(x)))
            model = keras.Model(x, keras.layers.Dense(1, name="out")(y))
            with self.assertRaisesRegex(ValueError, rf"^layer 'shared' is called in stages 0 "
                                                    rf"and 1 and {why}.*trainable weights"):
                towers.split_model(model, ["middle"])
        x = keras.Input((4,))  # a plain shared Dense is cut
        shared = keras.layers.Dense(4, name="shared")
        model = keras.Model(x, shared(keras.layers.Dense(4, name="middle")(shared(x))))
        first, second = towers.split_model(model, ["middle"])
        x = np.ones((2, 4), "float32")
        self.assertAllClose(model(x), second(first(x)), atol=1e-6, rtol=0)

    def test_a_sublayer_with_state_shared_by_two_stages_layers_is_refused(self):
        # Two layers, one per stage, that hold one BatchNormalization between them: its
        # statistics would be updated in both stages. Refused where the stages are set up.
        class Wrapped(keras.layers.Layer):
            def __init__(self, inner, **kwargs):
                super().__init__(**kwargs)
                self.inner = inner

            def call(self, x, training=None):
                return self.inner(x, training=training)

        norm = keras.layers.BatchNormalization(name="norm")
        x = keras.Input((4,))
        first = Wrapped(norm, name="first")(keras.layers.Dense(4, name="middle")(x))
        model = keras.Model(x, keras.layers.Dense(1, name="out")(Wrapped(norm, name="second")(
            keras.layers.Dense(4, name="cut")(first))))
        with self.assertRaisesRegex(ValueError, r"^variable 'first/norm/moving_mean' is read "
                                                r"by 2 stages of model .* holds state") as caught:
            towers.TowerTrainer(model, "mse", "sgd", devices=GRID, pipeline_cuts=["cut"])
        self.assertNotIn("\n", str(caught.exception))


class AutomaticCutsTest(tf.test.TestCase):
    """towers.models.pipeline_cuts (--pipeline_stages=K) on keras_hub task models: their
    backbones count as their layers, so the stages are balanced among the transformer
    layers, cut at their paths."""

    def test_the_cuts_fall_among_the_backbone_s_transformer_layers(self):
        for model, backbone in ((_gpt2_lm(), "gpt2_backbone*"),
                                (_classifier(), "bert_backbone*")):
            for num_stages, layers in ((2, [0]), (3, [0, 1])):
                cuts = models.pipeline_cuts(model, num_stages)
                self.assertLen(cuts, len(layers))
                for cut, k in zip(cuts, layers):
                    self.assertTrue(layer_paths.matches(
                        cut, f"{backbone}/transformer_layer_{k}"), cuts)

    def test_the_chosen_stages_train_as_keras_on_one_device(self):
        # Largest difference measured: 8.4e-8 (GPT2CausalLM, its tied embedding in both
        # stages), 3.7e-9 (BertTextClassifier).
        for build, batches, compile_options in (
                (_gpt2_lm, _lm_batches(), {"weighted_metrics": []}),
                (_classifier, _batches(), {})):
            expected = build()
            expected.compile(keras.optimizers.Adam(1e-3), _loss(), **compile_options)
            for batch in batches:
                expected.train_on_batch(*batch[:2], sample_weight=(batch[2:] or [None])[0])
            model = build()
            trainer = towers.TowerTrainer(model, _loss(), keras.optimizers.Adam(1e-3),
                                          devices=GRID,
                                          pipeline_cuts=models.pipeline_cuts(model, 2))
            self.assertEqual(trainer.num_stages, 2)
            for batch in batches:
                trainer.train_step(batch)
            for want, got in zip(expected.get_weights(), model.get_weights(), strict=True):
                self.assertAllClose(want, got, atol=TOLERANCE, rtol=0)
