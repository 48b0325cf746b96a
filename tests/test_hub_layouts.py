"""keras_hub's own layout maps (LlamaBackbone.get_layout_map, GemmaBackbone.get_layout_map),
unchanged, as split_layers' plan for the causal LM: 2 towers x 2 parts, each step against
Keras's compile + train_on_batch on one device. Their attention projections are
EinsumDense layers split along letters other than the last ("row:u", "column:n"); their
token embedding is split by vocab for its look-up and its LM head (Llama's reverse table
untied, Gemma's tied)."""

import keras
import pytest
from absl.testing import parameterized
import tensorflow as tf

import towers
from tests import test_hub_models as hub
from towers.op_parallel import layouts
from towers.op_parallel.plan import parallel_forms

keras_hub = pytest.importorskip("keras_hub")  # the [hub] extra (scripts/test installs it)

DEVICES = [f"/device:CPU:{i}" for i in range(4)]
TOLERANCE = 1e-5


def _llama(seed=0):
    """LlamaCausalLM: 1 layer of 4 query heads (2 key/value heads) of 4, width 16."""
    keras.utils.set_random_seed(seed)
    return keras_hub.models.LlamaCausalLM(keras_hub.models.LlamaBackbone(
        vocabulary_size=hub.VOCABULARY, num_layers=1, num_query_heads=4, num_key_value_heads=2,
        hidden_dim=hub.WIDTH, intermediate_dim=32), preprocessor=None)


def _gemma(seed=0, num_query_heads=4, num_key_value_heads=2):
    """GemmaCausalLM: 1 layer of 4 query heads (2 key/value heads; or as given) of 4,
    width 16."""
    keras.utils.set_random_seed(seed)
    return keras_hub.models.GemmaCausalLM(keras_hub.models.GemmaBackbone(
        vocabulary_size=hub.VOCABULARY, num_layers=1, num_query_heads=num_query_heads,
        num_key_value_heads=num_key_value_heads, hidden_dim=hub.WIDTH, intermediate_dim=32,
        head_dim=4), preprocessor=None)


def _layout_map(lm):
    """The LM's backbone's own layout map over a (1 batch, 2 model) mesh."""
    mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"], devices=["cpu:0", "cpu:1"])
    return lm.backbone.get_layout_map(mesh)


def _device_of(variable):
    return towers.devices.canonical_name(variable.value.device)


class HubLayoutMapTest(tf.test.TestCase, parameterized.TestCase):

    def _trains_as_one_device(self, build):
        batches = hub._lm_batches()  # padded tails, the padding mask as sample weights
        keras_model = build()
        keras_model.compile(keras.optimizers.Adam(0.01),
                            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                            weighted_metrics=[])
        for x, y, weights in batches:
            keras_model.train_on_batch(x, y, sample_weight=weights)
        lm = build()
        parted = towers.split_layers(lm, _layout_map(lm), DEVICES[:2])
        # The table, 4 projections, 3 feed-forward layers.
        self.assertLen(parallel_forms(parted), 8)
        for form in parallel_forms(parted):
            for j, part in enumerate(form.parts):
                self.assertEqual({_device_of(w) for w in part.weights}, {DEVICES[j]}, form.path)
        trainer = hub._lm_trainer(parted, [DEVICES[:2], DEVICES[2:4]])
        for batch in batches:
            trainer.train_step(batch)
        want = keras_model.get_weights()
        got = towers.join_layers(parted).get_weights()
        self.assertEqual(len(want), len(got))
        for expected, value in zip(want, got):
            self.assertAllClose(expected, value, atol=TOLERANCE, rtol=0)

    @parameterized.named_parameters(
        ("llama", _llama, "transformer_layer_0",
         {"self_attention/query": "row", "self_attention/key": "row",
          "self_attention/value": "row", "self_attention/attention_output": "row:u",
          "feedforward_intermediate_dense": "column", "feedforward_gate_dense": "column",
          "feedforward_output_dense": "row"}),
        ("gemma", _gemma, "decoder_block_0",
         {"attention/query": "column:n", "attention/key": "column:k",
          "attention/value": "column:k", "attention/attention_output": "row:n",
          "ffw_gating": "column", "ffw_gating_2": "column", "ffw_linear": "row"}))
    def test_layout_map_trains_as_one_device(self, build, block, kinds):
        lm = build()
        plan = layouts.plan_of(lm, _layout_map(lm), 2)
        self.assertEqual([how for path, how in plan.items()
                          if path.endswith("/token_embedding")], ["vocab"])
        self.assertEqual({path.split(f"/{block}/", 1)[1]: how for path, how in plan.items()
                          if f"/{block}/" in path}, kinds)
        self._trains_as_one_device(build)

    def test_an_untied_reverse_table_is_split_by_its_vocabulary_columns(self):
        lm = _llama()
        layout_map = _layout_map(lm)
        layout_map["token_embedding/reverse_embeddings"] = (None, "model")  # (D, V)
        plan = layouts.plan_of(lm, layout_map, 2)
        self.assertEqual([how for path, how in plan.items()
                          if path.endswith("/token_embedding")], ["vocab"])
        del layout_map["token_embedding/reverse_embeddings"]
        layout_map["token_embedding/reverse_embeddings"] = ("model", None)
        with self.assertRaisesRegex(ValueError, r"token_embedding/reverse_embeddings dim 0, "
                                    r".*split by its vocabulary only") as caught:
            layouts.plan_of(lm, layout_map, 2)
        self.assertNotIn("\n", str(caught.exception))

if __name__ == "__main__":
    tf.test.main()
