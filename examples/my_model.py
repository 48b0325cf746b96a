"""A model of your own for towers-train, in the form --model=PACKAGE.MODULE:FUNCTION takes.

    towers-train --model=examples.my_model:small_cnn --num_towers=2 --epochs=3

towers-train imports this module (from the current directory, here the
repository root) and calls small_cnn(input_shape, num_classes) with the
shape of one example of the data, e.g. (8, 8, 1) for digits, and its number
of classes. Any function of that signature works, as long as it returns a
keras.Model that outputs logits (B, num_classes), no softmax.
"""

import keras
from keras import layers


def small_cnn(input_shape, num_classes):
    """conv 16 -> pool -> conv 32 -> global average -> logits; a functional keras.Model.

    input_shape: (H, W, C) of one example; num_classes: the width of the logits.
    Keras's global seed (towers-train sets it from --seed) draws the weights.
    """
    images = keras.Input(input_shape, name="images")                      # (B, H, W, C)
    x = layers.Conv2D(16, 3, padding="same", activation="relu")(images)  # (B, H, W, 16)
    x = layers.MaxPooling2D(2, padding="same")(x)                         # (B, H/2, W/2, 16)
    x = layers.Conv2D(32, 3, padding="same", activation="relu")(x)      # (B, H/2, W/2, 32)
    x = layers.GlobalAveragePooling2D()(x)                                # (B, 32)
    # float32 logits even under --mixed_precision, so the loss is taken in full precision.
    logits = layers.Dense(num_classes, dtype="float32", name="logits")(x)  # (B, num_classes)
    return keras.Model(images, logits, name="small_cnn")
