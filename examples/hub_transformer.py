"""keras_hub transformers for towers-train, split by layer paths (the [hub] extra), and
a causal LM on the 3-D grid of towers x stages x parts (run this file: `python
examples/hub_transformer.py`, about half a minute on two cores).

    towers-train --model=examples.hub_transformer:gpt2_classifier --num_towers=2 \
        --num_parts=2 --split_plan='*/token_embedding:vocab,*/transformer_layer_*/self_attention:heads,*/transformer_layer_*/feedforward_intermediate_dense:column,*/transformer_layer_*/feedforward_output_dense:row'

Each pixel of an image becomes a token (its intensity in one of LEVELS bins), a
keras_hub GPT2Backbone (random weights from a small config; nothing is
downloaded) reads the sequence, and the mean of its outputs gives the logits.
The plan's paths reach inside the backbone: its tied token embedding by rows,
each block's attention (keras_hub's CachedMultiHeadAttention) by heads, its
feed-forward pair column -> row; 2 towers x 2 parts run on 4 devices.

`causal_lm` is a keras_hub GPT2CausalLM for towers-train: it reads an image's pixel
tokens and predicts the class as the next token. --pipeline_stages=2 cuts it inside
its backbone, by estimated compute, and --split_plan=auto splits each stage:

    towers-train --model=examples.hub_transformer:causal_lm --num_towers=2 \
        --pipeline_stages=2 --num_parts=2 --split_plan=auto

Run as a script, the same GPT2CausalLM on token sequences trains from Python on 2
towers x 2 stages x 2 parts (8 logical CPU devices) and is compared with Keras on
one device.
"""

import sys

import keras
import keras_hub
import numpy as np
from keras import layers, ops

import towers

LEVELS = 16  # intensity bins: the vocabulary


def _pixel_tokens(input_shape):
    """(images input (B, H, W, C), their tokens (B, T = H*W*C)): each intensity in [0, 1]
    binned into one of LEVELS tokens."""
    images = keras.Input(input_shape, name="images")
    pixels = layers.Reshape((-1,))(images)
    return images, layers.Discretization(
        bin_boundaries=list(np.linspace(0, 1, LEVELS + 1)[1:-1]), name="tokens")(pixels)


def gpt2_classifier(input_shape, num_classes):
    """pixels -> tokens (B, T), T = H*W*C -> GPT2Backbone (B, T, 32) -> mean -> logits.

    input_shape: (H, W, C) of one example, intensities in [0, 1]; num_classes: the
    width of the logits. Keras's global seed (towers-train's --seed) draws the weights.
    """
    images, tokens = _pixel_tokens(input_shape)                              # (B, T)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=LEVELS, num_layers=2, num_heads=4, hidden_dim=32,
        intermediate_dim=64, max_sequence_length=tokens.shape[-1], dropout=0.0)
    sequence = backbone({"token_ids": tokens,
                         "padding_mask": ops.ones_like(tokens)})              # (B, T, 32)
    pooled = layers.GlobalAveragePooling1D()(sequence)                        # (B, 32)
    logits = layers.Dense(num_classes, dtype="float32", name="logits")(pooled)
    return keras.Model(images, logits, name="gpt2_classifier")


def causal_lm(input_shape, num_classes):
    """pixels -> tokens (B, T) -> GPT2CausalLM (B, T, LEVELS + num_classes) -> the logits
    at the last position over the class tokens (B, num_classes): the class is the next
    token after the image's. Its token embedding is tied: looked up in the backbone,
    reversed as the LM head.

    input_shape: (H, W, C) of one example, intensities in [0, 1]; num_classes: the
    width of the logits. Keras's global seed (towers-train's --seed) draws the weights.
    """
    images, tokens = _pixel_tokens(input_shape)                              # (B, T)
    lm = tiny_gpt2_lm(LEVELS + num_classes, tokens.shape[-1])
    next_token = lm({"token_ids": tokens, "padding_mask": ops.ones_like(tokens)})
    logits = next_token[:, -1, LEVELS:]                                       # (B, classes)
    return keras.Model(images, logits, name="pixel_lm")


def tiny_gpt2_lm(vocabulary_size, sequence_length):
    """A GPT2CausalLM from a tiny config (2 layers, 2 heads, width 16), random weights,
    no preprocessor: token ids and padding mask in, next-token logits out."""
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=vocabulary_size, num_layers=2, num_heads=2, hidden_dim=16,
        intermediate_dim=32, max_sequence_length=sequence_length, dropout=0.0)
    return keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)


def _token_batches(steps=3, rows=16, length=8, vocabulary_size=40):
    """Per step: (token ids and padding mask, next-token targets, the mask as weights),
    as GPT2CausalLM's preprocessor gives them."""
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(steps):
        mask = np.arange(length)[None] < rng.integers(2, length + 1, rows)[:, None]
        ids = np.where(mask, rng.integers(1, vocabulary_size, (rows, length)), 0)
        batches.append(({"token_ids": ids.astype("int32"), "padding_mask": mask.astype("int32")},
                        np.roll(ids, -1, axis=1).astype("int32"), mask.astype("int32")))
    return batches


def main():
    """The GPT2CausalLM on 2 towers x 2 stages x 2 parts against Keras on one device."""
    devices = towers.configure_devices(8)
    grid = [[devices[t * 4 + k * 2:t * 4 + k * 2 + 2] for k in range(2)] for t in range(2)]
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    batches = _token_batches()

    keras.utils.set_random_seed(0)
    expected = tiny_gpt2_lm(40, 8)
    expected.compile(keras.optimizers.Adam(1e-3), loss, weighted_metrics=[])
    for x, y, weights in batches:
        expected.train_on_batch(x, y, sample_weight=weights)

    keras.utils.set_random_seed(0)
    lm = tiny_gpt2_lm(40, 8)
    cuts = towers.models.pipeline_cuts(lm, 2)  # by estimated compute, inside the backbone
    parted = towers.split_layers(lm, "auto", grid[0][0])  # Megatron's plan over 2 parts
    trainer = towers.TowerTrainer(parted, loss, keras.optimizers.Adam(1e-3), devices=grid,
                                  pipeline_cuts=cuts)
    for batch in batches:
        trainer.train_step(batch)
    difference = max(float(np.max(np.abs(a - b))) for a, b in zip(
        towers.join_layers(parted).get_weights(), expected.get_weights(), strict=True))
    print(f"GPT2CausalLM, 2 towers x 2 stages (cut after {cuts[0]}) x 2 parts: largest "
          f"weight difference from Keras on one device after {len(batches)} Adam steps: "
          f"{difference:.1e}")
    return difference


if __name__ == "__main__":
    sys.exit(0 if main() < 1e-5 else 1)
