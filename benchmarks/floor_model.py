"""The model the floor of benchmarks/RESULTS.md is measured on, given as a user's model.

    python benchmarks/compare_strategies.py --models=benchmarks.floor_model:mlp \\
        --input_shape=16,16,1 --num_classes=10 ...

An MLP 256-512-512-10: small enough that the machinery around its matrix
products shows, as in issue 16's measurements. It is loaded through `--models`
like any user's PACKAGE.MODULE:FUNCTION.
"""

import keras


def mlp(input_shape, num_classes):
    """(B, *input_shape) -> Flatten -> Dense 512 relu -> Dense 512 relu -> (B, num_classes) logits."""
    inputs = keras.Input(input_shape)
    x = keras.layers.Flatten()(inputs)                          # (B, 256) for 16x16x1
    x = keras.layers.Dense(512, activation="relu")(x)
    x = keras.layers.Dense(512, activation="relu")(x)
    return keras.Model(inputs, keras.layers.Dense(num_classes)(x), name="mlp_256_512_512")
