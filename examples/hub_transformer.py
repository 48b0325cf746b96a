"""A keras_hub transformer for towers-train, split by layer paths (the [hub] extra).

    towers-train --model=examples.hub_transformer:gpt2_classifier --num_towers=2 \
        --num_parts=2 --split_plan='*/token_embedding:vocab,*/transformer_layer_*/self_attention:heads,*/transformer_layer_*/feedforward_intermediate_dense:column,*/transformer_layer_*/feedforward_output_dense:row'

Each pixel of an image becomes a token (its intensity in one of LEVELS bins), a
keras_hub GPT2Backbone (random weights from a small config; nothing is
downloaded) reads the sequence, and the mean of its outputs gives the logits.
The plan's paths reach inside the backbone: its tied token embedding by rows,
each block's attention (keras_hub's CachedMultiHeadAttention) by heads, its
feed-forward pair column -> row; 2 towers x 2 parts run on 4 devices.
"""

import keras
import keras_hub
import numpy as np
from keras import layers, ops

LEVELS = 16  # intensity bins: the vocabulary


def gpt2_classifier(input_shape, num_classes):
    """pixels -> tokens (B, T), T = H*W*C -> GPT2Backbone (B, T, 32) -> mean -> logits.

    input_shape: (H, W, C) of one example, intensities in [0, 1]; num_classes: the
    width of the logits. Keras's global seed (towers-train's --seed) draws the weights.
    """
    images = keras.Input(input_shape, name="images")
    pixels = layers.Reshape((-1,))(images)                                   # (B, T)
    tokens = layers.Discretization(
        bin_boundaries=list(np.linspace(0, 1, LEVELS + 1)[1:-1]), name="tokens")(pixels)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=LEVELS, num_layers=2, num_heads=4, hidden_dim=32,
        intermediate_dim=64, max_sequence_length=pixels.shape[-1], dropout=0.0)
    sequence = backbone({"token_ids": tokens,
                         "padding_mask": ops.ones_like(tokens)})              # (B, T, 32)
    pooled = layers.GlobalAveragePooling1D()(sequence)                        # (B, 32)
    logits = layers.Dense(num_classes, dtype="float32", name="logits")(pooled)
    return keras.Model(images, logits, name="gpt2_classifier")
