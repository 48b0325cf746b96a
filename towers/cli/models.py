"""Small image classifiers for `--model=mlp|cnn|resnet|text`.

Every model takes images (B, H, W, C) float32 in [0, 1] and returns logits
(B, num_classes), no softmax (train with from_logits=True). They are plain
Functional Keras models, built at construction, so TowerTrainer can run them
with model.stateless_call on each tower.

    mlp     Flatten -> Dense 128 -> Dense 64 -> logits.
    cnn     two conv + max-pool stages (32, 64 filters) -> Dense 128 -> logits.
    resnet  stem conv + three residual blocks (16, 32, 64) with BatchNormalization;
            the only model with non-trainable state (moving mean and variance).
    text    each pixel becomes a token, Embedding -> mean over tokens -> logits;
            the embedding gradient is a tf.IndexedSlices (sparse), not a Tensor.
"""

import collections
import math

import keras
import numpy as np
from absl import logging
from keras import layers, ops

from towers.model_parallel import cut_paths, stages

MODELS = ("mlp", "cnn", "resnet", "text")

TEXT_LEVELS = 16         # intensity bins per pixel in the text model
TEXT_EMBEDDING_DIM = 32
# Batch statistics of a short run (a few hundred steps) are stale at Keras's
# default momentum of 0.99; 0.9 lets the moving averages catch up in ~20 steps.
BATCH_NORM_MOMENTUM = 0.9


def build_model(name, input_shape, num_classes, seed=None):
    """Builds model `name` for images of `input_shape`; returns a keras.Model.

    Args:
      name: one of MODELS.
      input_shape: (H, W, C), positive ints, e.g. (8, 8, 1) for digits,
        (32, 32, 3) for cifar10.
      num_classes: >= 2; the width of the logits.
      seed: None or an int >= 0. With an int, every layer gets its own seeded
        initializer derived from it, so the same seed gives the same weights in
        any process, whatever the global RNG state (keras.utils.set_random_seed
        is not called and not needed). None: Keras's default random init.

    Returns:
      A built Functional keras.Model named `name`: (B, H, W, C) float32 ->
      (B, num_classes) float32 logits. The logits layer computes in float32
      even under a mixed-precision policy, so the loss is taken in full precision.

    Raises:
      ValueError: an unknown name or a bad input_shape, num_classes or seed.
    """
    input_shape, num_classes, seed = _check_arguments(name, input_shape, num_classes, seed)
    initializers = _Initializers(seed)
    images = keras.Input(input_shape, name="images")                      # (B, H, W, C)
    features = _BODIES[name](images, initializers)
    logits = layers.Dense(num_classes, kernel_initializer=initializers.glorot(),
                          dtype="float32", name="logits")(features)       # (B, num_classes)
    return keras.Model(images, logits, name=name)


def _mlp(images, initializers):
    x = layers.Flatten()(images)                                          # (B, H*W*C)
    x = layers.Dense(128, activation="relu", kernel_initializer=initializers.glorot())(x)
    return layers.Dense(64, activation="relu", kernel_initializer=initializers.glorot())(x)


def _cnn(images, initializers):
    x = images
    for filters in (32, 64):
        x = layers.Conv2D(filters, 3, padding="same", activation="relu",
                          kernel_initializer=initializers.glorot())(x)
        # "same" pooling rounds up, so any size works: 8 -> 4 -> 2, 28 -> 14 -> 7.
        x = layers.MaxPooling2D(2, padding="same")(x)
    x = layers.Flatten()(x)                                   # (B, ceil(H/4) * ceil(W/4) * 64)
    return layers.Dense(128, activation="relu", kernel_initializer=initializers.glorot())(x)


def _resnet(images, initializers):
    x = _conv_bn(images, 16, 3, 1, initializers, "stem")
    x = layers.Activation("relu", name="stem_relu")(x)                    # (B, H, W, 16)
    for i, (filters, stride) in enumerate([(16, 1), (32, 2), (64, 2)]):
        x = _residual_block(x, filters, stride, initializers, f"block{i + 1}")
    return layers.GlobalAveragePooling2D()(x)                             # (B, 64)


def _residual_block(x, filters, stride, initializers, name):
    """relu(conv-BN-relu-conv-BN(x) + shortcut(x)), striding in the first conv.

    (B, H, W, C) -> (B, ceil(H / stride), ceil(W / stride), filters). The
    shortcut is x itself when the shape is kept, else a strided 1x1 conv + BN.
    """
    y = _conv_bn(x, filters, 3, stride, initializers, f"{name}_1")
    y = layers.Activation("relu", name=f"{name}_relu1")(y)
    y = _conv_bn(y, filters, 3, 1, initializers, f"{name}_2")
    shortcut = x
    if stride != 1 or x.shape[-1] != filters:
        shortcut = _conv_bn(x, filters, 1, stride, initializers, f"{name}_shortcut")
    y = layers.Add(name=f"{name}_add")([y, shortcut])
    return layers.Activation("relu", name=f"{name}_relu2")(y)


def _conv_bn(x, filters, kernel_size, stride, initializers, name):
    # No conv bias: BatchNormalization's beta does its job.
    x = layers.Conv2D(filters, kernel_size, strides=stride, padding="same", use_bias=False,
                      kernel_initializer=initializers.glorot(), name=f"{name}_conv")(x)
    return layers.BatchNormalization(momentum=BATCH_NORM_MOMENTUM, name=f"{name}_bn")(x)


def _text(images, initializers):
    tokens = PixelTokens(TEXT_LEVELS, name="tokens")(images)             # (B, T), T = H*W*C
    vocabulary_size = math.prod(images.shape[1:]) * TEXT_LEVELS
    x = layers.Embedding(vocabulary_size, TEXT_EMBEDDING_DIM,
                         embeddings_initializer=initializers.uniform(),
                         name="embedding")(tokens)                        # (B, T, 32)
    return layers.GlobalAveragePooling1D()(x)                             # (B, 32)


_BODIES = {"mlp": _mlp, "cnn": _cnn, "resnet": _resnet, "text": _text}


@keras.saving.register_keras_serializable(package="towers")
class PixelTokens(keras.layers.Layer):
    """Turns images into token ids, one token per pixel value; no weights.

    (B, H, W, C) float in [0, 1] -> (B, H*W*C) int32, with
    token = position * levels + bin, where bin = floor(value * levels) clipped
    to [0, levels - 1]. Each pixel position has its own `levels` ids, so the
    vocabulary is H*W*C*levels. No gradient flows back to the images.
    """

    def __init__(self, levels=TEXT_LEVELS, **kwargs):
        super().__init__(**kwargs)
        if levels < 2:
            raise ValueError(f"levels must be >= 2, got {levels}.")
        self.levels = levels

    def call(self, images):
        length = math.prod(images.shape[1:])
        bins = ops.clip(ops.floor(images * self.levels), 0, self.levels - 1)
        bins = ops.reshape(ops.cast(bins, "int32"), (-1, length))          # (B, T)
        return bins + ops.arange(length, dtype="int32") * self.levels

    def get_config(self):
        return {**super().get_config(), "levels": self.levels}


class _Initializers:
    """Hands each layer its own initializer, seeded from one model seed (or unseeded).

    Each call draws the next child of np.random.SeedSequence(seed), so layers
    get independent streams and seeds 0 and 1 share no layer seed.
    """

    def __init__(self, seed):
        self._seed = seed
        self._count = 0

    def glorot(self):
        """Keras's default kernel initializer."""
        return keras.initializers.GlorotUniform(seed=self._next_seed())

    def uniform(self):
        """Keras's default embedding initializer, U(-0.05, 0.05)."""
        return keras.initializers.RandomUniform(-0.05, 0.05, seed=self._next_seed())

    def _next_seed(self):
        if self._seed is None:
            return None
        self._count += 1
        child = np.random.SeedSequence(self._seed, spawn_key=(self._count,))
        return int(child.generate_state(1)[0])  # Keras wants a Python int, not np.uint32


def _check_arguments(name, input_shape, num_classes, seed):
    """Rejects bad arguments early, with the values; returns them as Python ints.

    NumPy ints are accepted (Keras layers are not: Dense(units=np.int64(3)) raises).
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}.")
    try:
        shape = tuple(input_shape)
    except TypeError:
        shape = None
    if shape is None or len(shape) != 3 or not all(_is_int(d) and d > 0 for d in shape):
        raise ValueError(
            f"input_shape must be (height, width, channels), three positive ints, "
            f"got {input_shape!r}.")
    if not _is_int(num_classes) or num_classes < 2:
        raise ValueError(f"num_classes must be an int >= 2, got {num_classes!r}.")
    if seed is not None and (not _is_int(seed) or seed < 0):
        raise ValueError(f"seed must be None or an int >= 0, got {seed!r}.")
    return tuple(int(d) for d in shape), int(num_classes), None if seed is None else int(seed)


def _is_int(value):
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def pipeline_cuts(model, num_stages):
    """Layers to cut `model` after, for `num_stages` stages of about equal compute.

    A layer's compute is estimated as its multiply-adds per example: its
    weights times the positions of its output (a Dense layer once, a Conv2D
    once per output pixel; a length unknown until run, a sequence's, counts
    one), or its output size for a layer without weights and for an Embedding's
    lookup (not a product; its reverse, a tied LM head, is one).
    A nested functional model (a keras_hub task model's backbone) counts as its
    layers, so the cuts may fall among them: at their paths
    ("gpt2_backbone/transformer_layer_0"); a layer called in two places (a tied
    embedding) is not cut after.
    The cuts split the running total, in model.layers order, nearest to
    1/K, 2/K, ... of the whole.

    Args:
      model: a built functional or Sequential keras.Model.
      num_stages: int >= 1, at most the number of layers with inputs.

    Returns:
      list of num_stages - 1 layer names or paths (empty for one stage).

    Raises:
      ValueError: a subclassed model (no graph of layers to cut), or a bad num_stages.
    """
    # The same refusal split_model gives, before layer.output fails on a layer
    # that a subclassed model called eagerly.
    stages.graph_of(model)
    calls = cut_paths.layer_calls(model)
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or \
            not 1 <= num_stages <= len(calls):
        raise ValueError(f"num_stages must be an int from 1 to {len(calls)} (the layers of "
                         f"model {model.name!r}), got {num_stages!r}.")
    costs = np.cumsum([_calls_compute(layer, outputs) for _, layer, outputs in calls])
    held = collections.Counter(id(layer) for _, layer, _ in calls)
    cuts, previous = [], -1
    for k in range(1, num_stages):
        # Nearest to k/K of the total, leaving a layer for each stage before and after.
        candidates = [i for i in range(previous + 1, len(calls) - (num_stages - k))
                      if held[id(calls[i][1])] == 1 and len(calls[i][2]) == 1]
        if not candidates:
            raise ValueError(f"model {model.name!r} has no layer to cut after for stage "
                             f"{k + 1} of {num_stages}.")
        previous = min(candidates, key=lambda i: abs(costs[i] - costs[-1] * k / num_stages))
        cuts.append(calls[previous][0])
    return cuts


def layer_compute(layer):
    """Multiply-adds per example of one layer, estimated from its weights and output shape."""
    return _call_compute(layer, layer.output)


def _calls_compute(layer, outputs):
    """Multiply-adds per example of `layer`'s calls, given each call's outputs."""
    return sum(_call_compute(layer, output) for output in outputs)


def _call_compute(layer, outputs):
    total = 0
    for output in keras.tree.flatten(outputs):
        shape = [d or 1 for d in output.shape[1:]]  # an unknown length counts one
        if isinstance(layer, layers.Embedding):
            # A lookup copies one row per token: its output, whatever the vocabulary
            # size; its reverse (keras_hub's tied LM head) multiplies by the table.
            lookup = shape[-1:] == [layer.output_dim]
            total += (math.prod(shape) if lookup else
                      math.prod(layer.embeddings.shape) * math.prod(shape[:-1]))
            continue
        positions = math.prod(shape[:-1]) if len(shape) > 1 else 1
        weights = sum(math.prod(w.shape) for w in layer.weights)
        total += weights * positions if weights else math.prod(shape)
    return total


def cuts_for_stages(model, num_stages):
    """The layers to cut `model` after for `num_stages` stages; logs the stages' compute."""
    if num_stages == 1:
        return []
    try:
        cuts = pipeline_cuts(model, num_stages)
    except ValueError as error:
        raise ValueError(f"--pipeline_stages={num_stages} cannot cut this model: {error}"
                         ) from None
    calls = cut_paths.layer_calls(model)
    paths = [path for path, _, _ in calls]
    ends = [paths.index(cut) + 1 for cut in cuts] + [len(calls)]
    compute = [sum(_calls_compute(layer, outputs) for _, layer, outputs in calls[start:end])
               for start, end in zip([0] + ends[:-1], ends)]
    logging.info("Pipeline: model %r cut after %s into %d stages, balanced by estimated "
                 "compute (multiply-adds per example, per stage: %s).", model.name, cuts,
                 num_stages, ", ".join(f"{c:,}" for c in compute))
    return cuts
