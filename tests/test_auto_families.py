"""plan="auto" (issue 37) on each keras_hub family users bring, built from a tiny config
(random weights, nothing downloaded): the plan equals the one a Megatron user writes by
hand (the token embedding by vocab; attention by heads where towers splits its class,
else its query, key and value projections by column along their heads and its output
projection by row; each feed-forward column then row); a representative few are split
and one step on 1 tower x 2 parts equals Keras's on one device. For the backbones that
define get_layout_map (Llama, Qwen, Gemma, Qwen-MoE), "auto" splits every weight as that
map shards it."""

from unittest import mock

import keras
import numpy as np
import pytest
import tensorflow as tf
from absl.testing import parameterized

import towers
from tests import test_auto_plan as auto_test, test_gqa_heads as gqa
from tests import test_hub_layouts as layouts_test, test_hub_models as hub
from towers.op_parallel import layouts
from towers.op_parallel.plan import _layout

keras_hub = pytest.importorskip("keras_hub")  # the [hub] extra (scripts/test installs it)

PARTS = auto_test.PARTS
TOLERANCE = 1e-5
models = keras_hub.models
# Each family's smallest shape: 2 layers of 2 heads of 8, width 16, feed-forward 32.
TINY = dict(vocabulary_size=hub.VOCABULARY, num_layers=2, num_heads=2, hidden_dim=hub.WIDTH,
            intermediate_dim=32)
TEXT = dict(TINY, max_sequence_length=hub.SEQUENCE, dropout=0.0)


def _built(build):
    def seeded(seed=0):
        keras.utils.set_random_seed(seed)
        return build()
    return seeded


BUILDS = {
    "distil_bert": _built(lambda: models.DistilBertBackbone(**TEXT)),
    "roberta": _built(lambda: models.RobertaBackbone(**TEXT)),
    "albert": _built(lambda: models.AlbertBackbone(**TEXT, embedding_dim=8)),
    "electra": _built(lambda: models.ElectraBackbone(
        vocab_size=hub.VOCABULARY, embedding_dim=hub.WIDTH,
        **{k: v for k, v in TEXT.items() if k != "vocabulary_size"})),
    "deberta_v3": _built(lambda: models.DebertaV3Backbone(**TEXT, bucket_size=4)),
    "vit": _built(lambda: models.ViTBackbone(
        image_shape=(8, 8, 3), patch_size=4, num_layers=2, num_heads=2,
        hidden_dim=hub.WIDTH, mlp_dim=32)),
    "opt": _built(lambda: models.OPTBackbone(**TEXT)),
    "bloom": _built(lambda: models.BloomBackbone(**TINY)),
    "falcon": _built(lambda: models.FalconBackbone(
        num_attention_heads=2, **{k: v for k, v in TINY.items() if k != "num_heads"})),
    "t5": _built(lambda: models.T5Backbone(**TINY, dropout=0.0)),
    "phi3": gqa._phi3,  # Phi3CausalLM, 1 layer
    "whisper": _built(lambda: models.WhisperBackbone(
        **TINY, num_mels=8, max_encoder_sequence_length=8,
        max_decoder_sequence_length=hub.SEQUENCE)),
}

ENCODER = {"transformer_layer_*/self_attention_layer": "heads",
           "transformer_layer_*/feedforward_intermediate_dense": "column",
           "transformer_layer_*/feedforward_output_dense": "row"}


def _projections(attention, query="column", output="row", names=("query", "key", "value",
                                                                   "attention_output")):
    """The plan of an attention layer "heads" does not split: query, key and value by
    `query`, the output projection by `output`."""
    return {f"{attention}/{name}": output if name == names[-1] else query for name in names}


def _feedforward(block, up, down, gate=None):
    return {f"{block}/{up}": "column", **({f"{block}/{gate}": "column"} if gate else {}),
            f"{block}/{down}": "row"}


# The plan each family gets by hand. Its attention "heads" where towers splits its class
# (Keras's MultiHeadAttention, keras_hub's CachedMultiHeadAttention and Whisper's
# subclass of it); Bloom's, Falcon's, DeBERTa's and T5's own classes by their
# projections, along the heads letter of each equation.
HAND_PLANS = {
    "distil_bert": {"token_and_position_embedding/token_embedding": "vocab", **ENCODER},
    "roberta": {"embeddings/token_embedding": "vocab", **ENCODER},
    # ALBERT's one shared layer: its own path.
    "albert": {"token_embedding": "vocab", "group_0_inner_layer_0/self_attention_layer": "heads",
               **_feedforward("group_0_inner_layer_0", "feedforward_intermediate_dense",
                              "feedforward_output_dense")},
    "electra": {"token_embedding": "vocab", **ENCODER},
    "deberta_v3": {"token_embedding": "vocab",
                   **_projections("disentangled_attention_encoder_layer_*/self_attention_layer",
                                  query="column:d"),
                   **_feedforward("disentangled_attention_encoder_layer_*",
                                  "feedforward_intermediate_dense", "feedforward_output_dense")},
    # No vocabulary: its patches are embedded by a convolution, its positions looked up.
    "vit": {"vit_encoder/transformer_block_*/mha": "heads",
            **_feedforward("vit_encoder/transformer_block_*/mlp", "dense_1", "dense_2")},
    "opt": {"embeddings/token_embedding": "vocab",
            "transformer_layer_*/self_attention": "heads",
            **_feedforward("transformer_layer_*", "feedforward_intermediate_dense",
                           "feedforward_output_dense")},
    "bloom": {"token_embedding": "vocab",
              **_projections("transformer_layer_*/self_attention", query="column:n",
                             names=("query_dense", "key_dense", "value_dense", "output_dense")),
              **_feedforward("transformer_layer_*", "mlp_intermediate_dense", "mlp_output_dense")},
    "falcon": {"token_embedding": "vocab",
               **_projections("transformer_layer_*/attention", query="column:n",
                              names=("query_dense", "key_dense", "value_dense", "output_dense")),
               **_feedforward("transformer_layer_*", "dense_h_to_4h", "dense_4h_to_h")},
    "t5": {"token_embedding": "vocab",
           **{key: how for stack, attentions in (("encoder", ("self_attention",)),
                                                 ("decoder", ("self_attention", "cross_attention")))
              for attention in attentions
              for key, how in _projections(
                  f"transformer_{stack}_layer_*/{attention}",
                  names=("query_projector", "key_projector", "value_projector",
                         "output_projector")).items()},
           **_feedforward("transformer_encoder_layer_*", "input_projector", "output_projector",
                          gate="gate_projector"),
           **_feedforward("transformer_decoder_layer_*", "input_projector", "output_projector",
                          gate="gate_projector")},
    # Its untied reverse table split by vocab with the table; grouped-query heads.
    "phi3": {"{}/token_embedding": "vocab", "{}/transformer_layer_0/attention": "heads",
             **_feedforward("{}/transformer_layer_0", "feedforward_intermediate_dense",
                            "feedforward_output_dense", gate="feedforward_gate_dense")},
    "whisper": {"decoder_token_and_position_embedding/token_embedding": "vocab",
                "transformer_encoder_layer_*/self_attention_layer": "heads",
                "transformer_decoder_layer_*/self_attention": "heads",
                "transformer_decoder_layer_*/cross_attention": "heads",
                **_feedforward("transformer_encoder_layer_*", "feedforward_intermediate_dense",
                               "feedforward_output_dense"),
                **_feedforward("transformer_decoder_layer_*", "feedforward_intermediate_dense",
                               "feedforward_output_dense")},
}


def _text_batch():
    """(token ids and padding mask, (B, S, width) targets, None) for a backbone and mse."""
    x, y = hub._batches(rows=(5,))[0]
    return x, y, None


# Split and trained one step as Keras (mse on the backbone's outputs): DeBERTa (its
# query and key projections applied again to its relative embeddings), Bloom (ALiBi,
# its attention core on the joined heads).
TRAINED = {"deberta_v3": _text_batch, "bloom": _text_batch}


def _inputs(name):
    """ViT's images; T5's and Whisper's inputs: an encoder's (token ids or 8 mel features
    per frame) and a decoder's token ids, each with its padding mask."""
    if name == "vit":  # 8x8 images
        return np.random.default_rng(4).normal(size=(3, 8, 8, 3)).astype("float32")
    x = hub._batches(rows=(3,))[0][0]
    decoder = {"decoder_token_ids": x["token_ids"], "decoder_padding_mask": x["padding_mask"]}
    if name == "t5":
        return {"encoder_token_ids": x["token_ids"], "encoder_padding_mask": x["padding_mask"],
                **decoder}
    features = np.random.default_rng(5).normal(size=(3, 8, 8)).astype("float32")
    return {"encoder_features": features, **decoder}


class FamiliesTest(auto_test.SplitsAsKeras, tf.test.TestCase, parameterized.TestCase):

    @parameterized.named_parameters(*[(name, name) for name in HAND_PLANS])
    def test_auto_is_the_hand_written_plan(self, name):
        if name in TRAINED:  # the plan and one step
            self._splits_and_trains_as_keras(BUILDS[name], HAND_PLANS[name], TRAINED[name](),
                                             loss="mse")
            return
        model = BUILDS[name]()
        backbone = getattr(model, "backbone", model)  # a task model's keys start with its name
        self.assertEqual(towers.auto_plan(model, num_parts=2),
                         {key.format(backbone.name): how for key, how in HAND_PLANS[name].items()})
        if name in ("vit", "t5", "whisper"):  # no token embedding, encoder-decoders: outputs
            x = _inputs(name)
            parted = towers.split_layers(model, "auto", PARTS)
            self.assertAllClose(parted(x), model(x), atol=TOLERANCE, rtol=0)


def _weight_splits(model, plan):
    """{weight path: (the axis it is split along, its parts' shapes)} of `model` split
    by `plan` (None: whole)."""
    parted = towers.split_layers(model, plan, PARTS)
    return {weight.path: (axis, [tuple(v.shape) for v in variables] if axis is not None
                          else None)
            for weight, (axis, variables) in zip(model.weights, _layout(parted), strict=True)}


def _qwen_moe(seed=0):
    """QwenMoeBackbone: 1 layer of 4 query heads (2 key/value heads), 4 experts of 8 and a
    shared one of 32, width 16."""
    keras.utils.set_random_seed(seed)
    return models.QwenMoeBackbone(
        vocabulary_size=hub.VOCABULARY, num_layers=1, num_query_heads=4, num_key_value_heads=2,
        hidden_dim=hub.WIDTH, intermediate_dim=32, moe_intermediate_dim=8,
        shared_expert_intermediate_dim=32, num_experts=4, top_k=2)


class FollowsLayoutMapTest(tf.test.TestCase, parameterized.TestCase):
    """Each weight the backbone's get_layout_map shards is split by "auto" along the same
    axis into the same parts, and each weight it leaves whole stays whole."""

    @parameterized.named_parameters(
        ("llama", layouts_test._llama, "row"),  # its query, key and value along the width
        ("qwen", gqa._qwen, "row"),
        ("qwen_moe", _qwen_moe, "row"),
        ("gemma", layouts_test._gemma, "heads"),  # Gemma's split them by heads: kept
        # 6 query heads over 3 key/value heads: the map splits the query heads 3 + 3,
        # "heads" whole groups, 4 + 2: the map's projections instead.
        ("gemma_uneven", lambda: layouts_test._gemma(num_query_heads=6, num_key_value_heads=3),
         "column:n"))
    def test_auto_splits_each_weight_as_the_layout_map(self, build, attention):
        model = build()
        backbone = getattr(model, "backbone", model)
        mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"], ["cpu:0", "cpu:1"])
        by_map = layouts.plan_of(model, backbone.get_layout_map(mesh), 2)
        with self.assertLogs("absl", "INFO") as logged:
            plan = towers.auto_plan(model, num_parts=2)
        self.assertIn(f"plan='auto': follows {type(backbone).__name__}.get_layout_map: ",
                      "\n".join(r.getMessage() for r in logged.records))
        self.assertIn(attention, {how for key, how in plan.items() if "attention" in key})
        self.assertEqual(_weight_splits(model, plan), _weight_splits(model, by_map))

    def test_a_map_that_is_no_exact_plan_is_not_followed_said_in_one_line(self):
        def bias_alone(device_mesh, **_):
            layout_map = keras.distribution.LayoutMap(device_mesh)
            layout_map[".*feedforward_output_dense/bias"] = ("model",)  # no form splits it alone
            return layout_map

        gpt2 = hub._gpt2()
        with mock.patch.object(type(gpt2), "get_layout_map", staticmethod(bias_alone),
                               create=True):
            with self.assertLogs("absl", "INFO") as logged:
                plan = towers.auto_plan(gpt2, num_parts=2)
        said = [r.getMessage() for r in logged.records if "not followed" in r.getMessage()]
        self.assertLen(said, 1)
        self.assertRegex(said[0], r"^plan='auto': the layout map is not followed: the layout "
                                  r"map shards .*feedforward_output_dense/bias")
        self.assertEqual(plan["transformer_layer_*/self_attention"], "heads")  # the rules'


if __name__ == "__main__":
    tf.test.main()
