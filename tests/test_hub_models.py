"""keras_hub's transformers, as users bring them (built from a small config, random
weights, nothing downloaded), each step against Keras's compile + train_on_batch on
one device."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import towers

keras_hub = pytest.importorskip("keras_hub")  # the [hub] extra (scripts/test installs it)

DEVICES = [f"/device:CPU:{i}" for i in range(4)]
TOLERANCE = 1e-5
SEQUENCE, WIDTH, VOCABULARY = 6, 16, 40


def _gpt2(seed=0):
    """GPT2Backbone, 2 layers of 2 heads, width 16: token ids and padding mask in, one
    vector per token out."""
    keras.utils.set_random_seed(seed)
    return keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCABULARY, num_layers=2, num_heads=2, hidden_dim=WIDTH,
        intermediate_dim=32, max_sequence_length=SEQUENCE, dropout=0.0)


def _batches(rows=(7, 5), seed=0):
    """Per step: (token ids and a padding mask with padded tails, per-token targets)."""
    rng = np.random.default_rng(seed)
    batches = []
    for n in rows:
        lengths = rng.integers(2, SEQUENCE + 1, n)
        mask = np.arange(SEQUENCE)[None] < lengths[:, None]
        ids = np.where(mask, rng.integers(1, VOCABULARY, (n, SEQUENCE)), 0).astype("int32")
        x = {"token_ids": ids, "padding_mask": mask.astype("int32")}
        batches.append((x, rng.normal(size=(n, SEQUENCE, WIDTH)).astype("float32")))
    return batches


class GPT2Test(tf.test.TestCase):

    def _keras_weights(self, batches):
        model = _gpt2()
        model.compile(keras.optimizers.Adam(0.01), "mse")
        for x, y in batches:
            model.train_on_batch(x, y)
        return model.get_weights()

    def test_towers_and_pipeline_stages_train_as_one_device(self):
        batches = _batches()  # 7 rows on 3 towers: 3, 2, 2; 5 rows on 2: 3, 2
        want = self._keras_weights(batches)
        on_towers = towers.TowerTrainer(_gpt2(), "mse", keras.optimizers.Adam(0.01),
                                        devices=DEVICES[:3])
        staged = towers.TowerTrainer(_gpt2(), "mse", keras.optimizers.Adam(0.01),
                                     devices=[DEVICES[:2], DEVICES[2:]],
                                     pipeline_cuts=["transformer_layer_0"], micro_batches=2)
        for x, y in batches:
            on_towers.train_step((x, y))
            staged.train_step((x, y))
        for trainer in (on_towers, staged):
            for expected, got in zip(want, trainer.model.get_weights()):
                self.assertAllClose(expected, got, atol=TOLERANCE, rtol=0)
