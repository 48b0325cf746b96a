""""heads" for keras_hub's attention classes (issue 37). Grouped-query attention split by
key/value groups, each part the layer's own class with fewer heads on its device
(towers/op_parallel/grouped.py): Mistral's, Mixtral's, Llama's, Qwen's, Qwen-MoE's,
Qwen3's, Qwen3-MoE's, Phi-3's, Gemma's, Gemma 3's and SmolLM3's, their norms or rotary
frequencies shared by every head one sublayer all parts hold. 4 query heads, 2
key/value heads, 2 parts: the split LM's outputs equal the unsplit one's, greedy
generation through the split cache gives its tokens, one step on 1 tower x 2 parts
equals Keras's on one device. Whisper's attention, a CachedMultiHeadAttention whose own
build drops the key's bias, splits by heads as that one does. Classes it does not split
are refused in one line with their reason."""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf
from absl.testing import parameterized
from keras import ops

import towers
from tests import test_hub_layouts as layouts, test_hub_models as hub
from towers.op_parallel import grouped_classes
from towers.op_parallel.grouped import GroupedHeadsAttention
from towers.op_parallel.plan import parallel_forms

keras_hub = pytest.importorskip("keras_hub")  # the [hub] extra (scripts/test installs it)

PARTS = ["/device:CPU:0", "/device:CPU:1"]
SPARSE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
# transformer_layer_0/self_attention; Phi-3's .../attention, Gemma's decoder_block_0/attention,
# SmolLM3's transformer_layer_0/self_attn (not a self_attention_layernorm, ending in m)
PLAN = {"*/*_*/*att*n": "heads"}


# What each tiny grouped-query LM here has: 1 layer of 4 query heads (2 key/value heads)
# of 4, width 16.
_TINY = {"vocabulary_size": hub.VOCABULARY, "num_layers": 1, "num_query_heads": 4,
         "num_key_value_heads": 2, "hidden_dim": hub.WIDTH, "intermediate_dim": 32}


def _causal_lm(family, seed=0, **config):
    """keras_hub's <family>CausalLM on a <family>Backbone of _TINY and `config`, its
    weights drawn from `seed`, without a preprocessor."""
    keras.utils.set_random_seed(seed)
    backbone = getattr(keras_hub.models, family + "Backbone")(**{**_TINY, **config})
    return getattr(keras_hub.models, family + "CausalLM")(backbone=backbone, preprocessor=None)


_mistral = functools.partial(_causal_lm, "Mistral", num_layers=2)
_mixtral = functools.partial(_causal_lm, "Mixtral", num_experts=2)
_qwen = functools.partial(_causal_lm, "Qwen")  # query, key and value biases
# Its feed-forward dense: its experts' router adds a loss in training, a load balance
# over the batch's rows, which the trainer refuses (no tower can compute its share of it).
_qwen_moe = functools.partial(_causal_lm, "QwenMoe", moe_intermediate_dim=8,
                              shared_expert_intermediate_dim=8, num_experts=2, top_k=1,
                              mlp_only_layers=[0])
_qwen3 = functools.partial(_causal_lm, "Qwen3", head_dim=4)  # query and key norms
_qwen3_moe = functools.partial(_causal_lm, "Qwen3Moe", head_dim=4, moe_intermediate_dim=8,
                               num_experts=2, top_k=1,
                               router_aux_loss_coefficient=0.0)  # as Qwen-MoE's
_phi3 = functools.partial(_causal_lm, "Phi3")
# Text only; query and key norms, a sliding window of 3.
_gemma3 = functools.partial(_causal_lm, "Gemma3", image_size=16, head_dim=4,
                            use_sliding_window_attention=True, sliding_window_size=3)
# Biases, sinks, 2 experts, a sliding window of 3.
_gpt_oss = functools.partial(_causal_lm, "GptOss", num_experts=2, head_dim=4,
                             sliding_window=3)


def _smollm3(seed=0):
    """SmolLM3CausalLM: 1 layer of 4 query heads (2 key/value heads) of 4, width 16; Dense
    query, key and value projections with biases."""
    keras.utils.set_random_seed(seed)
    return keras_hub.models.SmolLM3CausalLM(keras_hub.models.SmolLM3Backbone(
        vocabulary_size=hub.VOCABULARY, hidden_dim=hub.WIDTH, intermediate_dim=32,
        num_layers=1, num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
        attention_dropout=0.0, rope_layer_enabled_list=[True], layer_types=["attention"],
        mlp_bias=False, layer_norm_epsilon=1e-6, max_position_embeddings=32,
        rope_theta=10000.0, partial_rotary_factor=1.0), preprocessor=None)


def _whisper(seed=0):
    """WhisperBackbone's decoder output as a model: 1 encoder and 1 decoder layer of 2
    heads of 8, width 16, 4 mel bins."""
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.WhisperBackbone(
        vocabulary_size=hub.VOCABULARY, num_layers=1, num_heads=2, hidden_dim=hub.WIDTH,
        intermediate_dim=32, num_mels=4, max_encoder_sequence_length=8,
        max_decoder_sequence_length=4)
    return keras.Model(backbone.input, backbone.output["decoder_sequence_output"])


BUILDS = {"mistral": (_mistral, "CachedMistralAttention", 2),
          "mixtral": (_mixtral, "CachedMixtralAttention", 1),
          "llama": (layouts._llama, "LlamaAttention", 1),
          "qwen": (_qwen, "QwenAttention", 1),
          "qwen_moe": (_qwen_moe, "QwenMoeAttention", 1),
          "qwen3": (_qwen3, "Qwen3Attention", 1),
          "qwen3_moe": (_qwen3_moe, "Qwen3MoeAttention", 1),
          "phi3": (_phi3, "Phi3Attention", 1),
          "gemma": (layouts._gemma, "CachedGemmaAttention", 1),
          "gemma3": (_gemma3, "CachedGemma3Attention", 1),
          "smollm3": (_smollm3, "SmolLM3Attention", 1),
          "gpt_oss": (_gpt_oss, "GptOssAttention", 1)}


def _batch():
    x, _ = hub._batches(rows=(5,))[0]
    y = np.random.default_rng(3).integers(0, hub.VOCABULARY, x["token_ids"].shape)
    return x, y.astype("int32"), x["padding_mask"].astype("float32")


class GroupedHeadsTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.named_parameters(*[(name, *how) for name, how in BUILDS.items()])
    def test_outputs_equal_the_unsplit_models(self, build, class_name, layers):
        lm = build()
        parted = towers.split_layers(lm, PLAN, PARTS)
        forms = parallel_forms(parted)
        self.assertLen(forms, layers)
        for form in forms:
            self.assertIsInstance(form, GroupedHeadsAttention)
            self.assertEqual([type(p).__name__ for p in form.parts], [class_name] * 2)
            # each part's 2 query heads as wide as the layer's (Llama's build would widen
            # them, SmolLM3's narrow them), its 1 key head too
            self.assertEqual([[w.shape.num_elements() for w in p.weights
                               if w.path.endswith(("/query/kernel", "/q_proj/kernel"))]
                              for p in form.parts], [[16 * 2 * 4]] * 2)
            heads = form.checked.heads_argument  # CachedMistralAttention's is private
            self.assertEqual([vars(p).get(heads, vars(p).get("_" + heads))
                              for p in form.parts], [2, 2])
            self.assertEqual([[w.shape.num_elements() for w in p.weights
                               if w.path.endswith(("/key/kernel", "/k_proj/kernel"))]
                              for p in form.parts], [[16 * 1 * 4]] * 2)
            # Qwen3's and Gemma 3's query and key norms, SmolLM3's rotary embedding: one
            # sublayer every part holds, its weight on part 0's device and once among
            # the model's weights.
            shared = [w for w in form.parts[0].weights
                      if any(w is v for v in form.parts[1].weights)]
            self.assertLen(shared, len(form.checked.shared))
            self.assertEqual([sum(w is v for v in parted.weights) for w in shared],
                             [1] * len(shared))
            for device, part in zip(PARTS, form.parts):
                for weight in part.weights:
                    self.assertEqual(towers.devices.canonical_name(weight.value.device),
                                     PARTS[0] if any(weight is w for w in shared) else device)
        x, _, _ = _batch()
        self.assertAllClose(parted(x), lm(x), atol=1e-6, rtol=0)
        joined = towers.join_layers(parted)  # the original class, the weights as they were
        for got, want in zip(joined.get_weights(), lm.get_weights(), strict=True):
            self.assertAllEqual(got, want)

    @parameterized.named_parameters(*[(name, *how) for name, how in BUILDS.items()])
    def test_generates_with_its_cache_split_by_key_value_heads(self, build, *_):
        lm = build()
        parted = towers.split_layers(lm, PLAN, PARTS)
        prompt = {"token_ids": np.array([[5, 7, 9, 0, 0, 0], [3, 0, 0, 0, 0, 0]], "int32"),
                  "padding_mask": np.array([[1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0]], "int32")}
        if build is _gemma3:  # it returns the images given, which keras_hub cannot return as None
            prompt["images"] = np.zeros((2, 0, 16, 16, 3), "float32")  # text only
        for model in (lm, parted):
            model.compile(sampler="greedy")
        want = lm.generate(prompt, stop_token_ids=None)["token_ids"]
        self.assertAllEqual(parted.generate(prompt, stop_token_ids=None)["token_ids"], want)
        self.assertFalse(np.all(want[:, 3:] == 0))  # it generated tokens

    @parameterized.named_parameters(*[(name, *how) for name, how in BUILDS.items()])
    def test_one_step_equals_keras_on_one_device(self, build, *_):
        self._one_step_equals_keras(build, PLAN, *_batch())

    def _one_step_equals_keras(self, build, plan, x, y, weights):
        expected = build()
        expected.compile(keras.optimizers.SGD(0.5), SPARSE, weighted_metrics=[])
        expected.train_on_batch(x, y, sample_weight=weights)
        model = build()
        parted = towers.split_layers(model, plan, PARTS)
        trainer = towers.TowerTrainer(parted, SPARSE, keras.optimizers.SGD(0.5),
                                      devices=[PARTS])  # 1 tower x 2 parts
        trainer.train_step((x, y, weights))
        moved = 0.0
        for got, want, before in zip(towers.join_layers(parted).get_weights(),
                                     expected.get_weights(), model.get_weights(), strict=True):
            self.assertAllClose(got, want, atol=1e-5, rtol=0)
            moved = max(moved, float(np.max(np.abs(want - before), initial=0.0)))
        self.assertGreater(moved, 1e-3)  # the step changed the weights

    def test_a_shared_norm_checkpoints_as_one_weight(self):
        # Qwen3's query and key norms, one variable all parts read: trained on 2 towers x
        # 2 parts, saved with Adam's slots, restored into the unsplit LM, trained on:
        # Keras's 2nd step.
        batches = hub._lm_batches(rows=(5, 4))
        expected = _qwen3()
        expected.compile(keras.optimizers.Adam(0.01), SPARSE, weighted_metrics=[])
        for x, y, weights in batches:
            expected.train_on_batch(x, y, sample_weight=weights)
        parted = towers.split_layers(_qwen3(), PLAN, PARTS)
        trainer = hub._lm_trainer(parted, hub.GRID)
        checkpointer = towers.Checkpointer(self.get_temp_dir(), parted, trainer.optimizer)
        trainer.train_step(batches[0])
        checkpointer.save(epoch=0, batch_in_epoch=1)
        unsplit = _qwen3(seed=1)
        restoring = hub._lm_trainer(unsplit, PARTS[:1])
        restoring.optimizer.build(unsplit.trainable_variables)
        self.assertIsNotNone(towers.Checkpointer(
            checkpointer.directory, unsplit, restoring.optimizer).restore())
        restoring.train_step(batches[1])
        for got, want in zip(unsplit.get_weights(), expected.get_weights(), strict=True):
            self.assertAllClose(got, want, atol=1e-5, rtol=0)

    def test_whisper_attention_splits_by_heads(self):
        # WhisperCachedMultiHeadAttention (its key without a bias): the encoder's self
        # attention, the decoder's self and cross attention; keras_hub has no Whisper
        # task that generates.
        x = {"encoder_features": np.random.default_rng(0).normal(size=(2, 8, 4)),
             "decoder_token_ids": np.array([[5, 7, 9, 2], [3, 1, 0, 0]], "int32"),
             "decoder_padding_mask": np.array([[1, 1, 1, 1], [1, 1, 0, 0]], "int32")}
        y = np.random.default_rng(1).integers(0, hub.WIDTH, (2, 4)).astype("int32")
        plan = {"transformer_encoder_layer_0/self_attention_layer": "heads",
                "transformer_decoder_layer_0/*_attention": "heads"}
        model = _whisper()
        parted = towers.split_layers(model, plan, PARTS)
        self.assertEqual([type(form.parts[1]).__name__ for form in parallel_forms(parted)],
                         ["WhisperCachedMultiHeadAttention"] * 3)
        self.assertAllClose(parted(x), model(x), atol=1e-6, rtol=0)
        self._one_step_equals_keras(_whisper, plan, x, y, x["decoder_padding_mask"])
        auto = towers.auto_plan(model, 2)
        self.assertEqual({how for key, how in auto.items()
                          if key.endswith(("_attention", "_attention_layer"))}, {"heads"})
        self.assertFalse([key for key in auto if "attention/" in key or "layer/" in key])

    def test_fewer_key_value_heads_than_parts_is_refused_in_one_line(self):
        with self.assertRaisesRegex(ValueError, "CachedMistralAttention has 2 key/value "
                                    "heads, and each of 3 parts needs a whole group; give "
                                    "at most 2 devices, or split its query, key and value "
                                    "projections by 'column'"):
            towers.split_layers(_mistral(), PLAN, PARTS + ["/device:CPU:2"])


    def test_auto_plan_splits_them_by_heads(self):
        # Llama's, Qwen's and the MoE backbones' layout maps split their projections
        # otherwise, and "auto" follows a map (test_auto_families.FollowsLayoutMapTest).
        followed = ("llama", "qwen", "qwen_moe", "qwen3_moe")
        for family, (build, *_) in BUILDS.items():
            if family in followed:
                continue
            plan = towers.auto_plan(build(), 2)
            attention = [how for key, how in plan.items()
                         if key.endswith(("attention", "self_attn"))]
            self.assertEqual(attention, ["heads"], msg=family)  # one key, not its projections

    def test_query_scale_by_the_layers_head_width_is_kept(self):
        # query_head_dim_normalize=False scales by hidden_dim // num_query_heads (16 // 4),
        # not head_dim (8): a part's 2 query heads would make it 16 // 2. (Gemma's and
        # Gemma 3's decoder blocks always pass True; a model of one's own may not.)
        keras.utils.set_random_seed(0)
        attention = keras_hub.src.models.gemma.gemma_attention.CachedGemmaAttention(
            head_dim=8, num_query_heads=4, num_key_value_heads=2,
            query_head_dim_normalize=False, name="attention")
        x = keras.Input((6, hub.WIDTH))
        model = keras.Model(x, attention(x, attention_mask=ops.ones((1, 6, 6), "bool")))
        x = np.random.default_rng(0).normal(size=(2, 6, hub.WIDTH)).astype("float32")
        parted = towers.split_layers(model, {"attention": "heads"}, PARTS)
        self.assertAllClose(parted(x), model(x), atol=1e-6, rtol=0)

    @parameterized.named_parameters(
        ("bloom", "bloom.bloom_attention.BloomAttention", {"num_heads": 4},
         "its ALiBi slopes are computed from each head's index"),
        ("falcon", "falcon.falcon_attention.FalconAttention",
         {"num_heads": 4, "attention_dropout_rate": 0.0},
         "its call adds the ALiBi bias its decoder computes for all its heads"),
        ("gpt_neo_x", "gpt_neo_x.gpt_neo_x_attention.GPTNeoXAttention",
         {"num_heads": 4, "hidden_dim": 16}, "it sets its head width to hidden_dim // num_heads"),
        ("t5", "t5.t5_multi_head_attention.T5MultiHeadAttention",
         {"is_decoder": True, "hidden_dim": 16, "key_value_dim": 4, "num_heads": 4,
          "dropout": 0.0}, "its relative position bias, a (buckets, heads) table"))
    def test_other_attention_classes_are_refused_with_their_reason(self, path, config, why):
        layer = grouped_classes.class_named("keras_hub.src.models." + path)(**config)
        said = grouped_classes.refusal(layer, 2)
        self.assertNotIn("\n", said)
        self.assertIn(f"{type(layer).__name__} is not split by heads: {why}", said)
        self.assertIn("by 'column' and its output projection by 'row'", said)

    def test_phi3_with_su_rope_scaling_is_refused_in_one_line(self):
        su = _phi3(rope_scaling_type="su", rope_scaling_short_factor=[1.0, 1.5],
                   rope_scaling_long_factor=[2.0, 3.0])
        with self.assertRaisesRegex(ValueError, r"^plan\[.*\] = 'heads': Phi3Attention is not "
                                    "split by heads: with rope_scaling_type='su'"):
            towers.split_layers(su, PLAN, PARTS)


if __name__ == "__main__":
    tf.test.main()
