"""keras_hub's own layout maps (LlamaBackbone.get_layout_map, GemmaBackbone.get_layout_map),
unchanged, as split_layers' plan: 2 towers x 2 parts, each step against Keras's compile +
train_on_batch on one device. Their attention projections are EinsumDense layers cut
along letters other than the last ("row:u", "column:n")."""

import keras
import pytest
import tensorflow as tf

import towers
from tests import test_hub_models as hub
from towers.op_parallel import layouts
from towers.op_parallel.plan import parallel_forms

keras_hub = pytest.importorskip("keras_hub")  # the [hub] extra (scripts/test installs it)

DEVICES = [f"/device:CPU:{i}" for i in range(4)]
TOLERANCE = 1e-5


def _llama(seed=0):
    """LlamaBackbone, 1 layer of 4 query heads (2 key/value heads) of 4, width 16."""
    keras.utils.set_random_seed(seed)
    return keras_hub.models.LlamaBackbone(
        vocabulary_size=hub.VOCABULARY, num_layers=1, num_query_heads=4, num_key_value_heads=2,
        hidden_dim=hub.WIDTH, intermediate_dim=32)


def _gemma(seed=0):
    """GemmaBackbone, 1 layer of 4 query heads (2 key/value heads) of 4, width 16."""
    keras.utils.set_random_seed(seed)
    return keras_hub.models.GemmaBackbone(
        vocabulary_size=hub.VOCABULARY, num_layers=1, num_query_heads=4, num_key_value_heads=2,
        hidden_dim=hub.WIDTH, intermediate_dim=32, head_dim=4)


def _layout_map(backbone):
    """The backbone's own layout map over a (1 batch, 2 model) mesh."""
    mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"], devices=["cpu:0", "cpu:1"])
    layout_map = backbone.get_layout_map(mesh)
    del layout_map["token_embedding/embeddings"]  # until ReversibleEmbedding splits (lead's branch)
    return layout_map


def _device_of(variable):
    return towers.devices.canonical_name(variable.value.device)


class HubLayoutMapTest(tf.test.TestCase):

    def _trains_as_one_device(self, build):
        batches = hub._batches()
        keras_model = build()
        keras_model.compile(keras.optimizers.Adam(0.01), "mse")
        for x, y in batches:
            keras_model.train_on_batch(x, y)
        backbone = build()
        parted = towers.split_layers(backbone, _layout_map(backbone), DEVICES[:2])
        self.assertLen(parallel_forms(parted), 7)  # 4 projections, 3 feed-forward layers
        for form in parallel_forms(parted):
            for j, part in enumerate(form.parts):
                self.assertEqual({_device_of(w) for w in part.weights}, {DEVICES[j]}, form.path)
        trainer = towers.TowerTrainer(parted, "mse", keras.optimizers.Adam(0.01),
                                      devices=[DEVICES[:2], DEVICES[2:4]])
        for x, y in batches:
            trainer.train_step((x, y))
        want = keras_model.get_weights()
        got = towers.join_layers(parted).get_weights()
        self.assertEqual(len(want), len(got))
        for expected, value in zip(want, got):
            self.assertAllClose(expected, value, atol=TOLERANCE, rtol=0)

    def test_llama_layout_map_trains_as_one_device(self):
        backbone = _llama()
        plan = layouts.plan_of(backbone, _layout_map(backbone), 2)
        block = "transformer_layer_0/self_attention"
        self.assertEqual({k: v for k, v in plan.items() if k.startswith("transformer_layer_0/")},
                         {f"{block}/query": "row", f"{block}/key": "row",
                          f"{block}/value": "row", f"{block}/attention_output": "row:u",
                          "transformer_layer_0/feedforward_intermediate_dense": "column",
                          "transformer_layer_0/feedforward_gate_dense": "column",
                          "transformer_layer_0/feedforward_output_dense": "row"})
        self._trains_as_one_device(_llama)

    def test_gemma_layout_map_trains_as_one_device(self):
        backbone = _gemma()
        plan = layouts.plan_of(backbone, _layout_map(backbone), 2)
        block = "decoder_block_0/attention"
        self.assertEqual({k: v for k, v in plan.items() if k.startswith("decoder_block_0/")},
                         {f"{block}/query": "column:n", f"{block}/key": "column:k",
                          f"{block}/value": "column:k", f"{block}/attention_output": "row:n",
                          "decoder_block_0/ffw_gating": "column",
                          "decoder_block_0/ffw_gating_2": "column",
                          "decoder_block_0/ffw_linear": "row"})
        self._trains_as_one_device(_gemma)


if __name__ == "__main__":
    tf.test.main()
