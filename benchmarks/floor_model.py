"""The model the floor of benchmarks/RESULTS.md is measured on, given as a user's model.

    python benchmarks/compare_strategies.py --models=benchmarks.floor_model:mlp \\
        --input_shape=16,16,1 --num_classes=10 ...

An MLP 256-512-512-10: small enough that the machinery around its matrix
products shows, as in issue 16's measurements. It is loaded through `--models`
like any user's PACKAGE.MODULE:FUNCTION. `transformer` is the first step's (issue 39)
2-block transformer, for an A/B of a step of many small ops:

    python benchmarks/compare_strategies.py --models=benchmarks.floor_model:transformer \\
        --input_shape=16 --num_classes=10 --global_batch_size=64 ...
"""

import keras


def mlp(input_shape, num_classes):
    """(B, *input_shape) -> Flatten -> Dense 512 relu -> Dense 512 relu -> (B, num_classes) logits."""
    inputs = keras.Input(input_shape)
    x = keras.layers.Flatten()(inputs)                          # (B, 256) for 16x16x1
    x = keras.layers.Dense(512, activation="relu")(x)
    x = keras.layers.Dense(512, activation="relu")(x)
    return keras.Model(inputs, keras.layers.Dense(num_classes)(x), name="mlp_256_512_512")


def transformer(input_shape, num_classes):
    """The 2-block transformer of benchmarks/first_step.py: (B, length) token ids in
    [0, 1000) -> (B, 10) logits; a step of many small ops (issue 39's floor A/B)."""
    from benchmarks.harness import first_step
    if num_classes != first_step.NUM_CLASSES:
        raise ValueError(f"this transformer has {first_step.NUM_CLASSES} classes; "
                         f"pass --num_classes={first_step.NUM_CLASSES}.")
    return first_step.transformer(length=input_shape[0])
