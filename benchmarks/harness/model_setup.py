"""One model to benchmark, as `--models` names it, and a synthetic batch it takes.

A model comes in the forms `towers-train --model` takes (towers/model_spec.py):

    mlp | cnn | resnet | text     built-in; examples of input_shape, num_classes classes
    PACKAGE.MODULE:FUNCTION       FUNCTION(input_shape, num_classes), under Keras's global seed
    PATH.keras                    a saved model; its own input shape, dtype and output width

Every mode builds the model again (`Setup.make_model`), so each gets the same
weights: a built-in seeds its own initializers, a FUNCTION is called right after
keras.utils.set_random_seed(seed), and a file is loaded again.

The synthetic batch: x of the model's input shape and dtype, floats uniform in
[0, 1); integer inputs (token ids) uniform in [0, input_dim) of the model's
first Embedding layer, or in {0, 1} when it has none among its layers, since a
vocabulary of any size takes those. y: class ids uniform in [0, num_classes),
num_classes the width of the logits.
"""

import functools

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from benchmarks.harness import mode as mode_lib
from towers.cli import model_spec

# Ids drawn for an integer input whose vocabulary the model does not show: 0 and 1.
DEFAULT_ID_RANGE = 2


class ModelError(ValueError):
    """A model that does not load or cannot be benchmarked; the message says why, in one line."""


def setup_for(spec, global_batch_size, input_shape, num_classes, seed):
    """The modes' Setup for model `spec` and what its synthetic data is.

    Args:
      spec: a --models entry (see the module docstring).
      global_batch_size: rows of the synthetic batch.
      input_shape, num_classes: one example's shape and the number of classes,
        for a built-in model or a FUNCTION; a .keras file's own shapes are used.
      seed: seeds the weights (except a file's) and the batch.

    Returns:
      (mode_lib.Setup, description): description is a dict for results.json:
      input_shape, input_dtype, num_classes, x_range ([low, high) of x) and
      x_values (the same in words, with where high comes from).

    Raises:
      ModelError: a spec of none of the forms, or a model that does not load,
        does not fit the shapes, or takes inputs that are not numbers.
    """
    try:
        form = model_spec.form_of(spec)
        if form == "file":
            input_shape, num_classes = _declared_shapes(spec, model_spec.load_file(spec))
            logging.info("%s: input %s, %d classes, from the file (--input_shape and "
                         "--num_classes do not apply)", spec, input_shape, num_classes)
        make_model = functools.partial(_build, spec, form, tuple(input_shape), num_classes, seed)
        model = make_model()  # a model that does not fit the shapes fails here, before any mode
    except ValueError as error:  # model_spec's one-line messages
        raise ModelError(str(error)) from None
    rng = np.random.default_rng(seed)
    x, x_range, x_values = _synthetic_x(model, (global_batch_size, *input_shape), rng)
    y = rng.integers(0, num_classes, size=global_batch_size).astype(np.int32)
    description = {"input_shape": list(input_shape), "input_dtype": x.dtype.name,
                   "num_classes": num_classes, "x_range": x_range, "x_values": x_values}
    return mode_lib.Setup(make_model=make_model, x=x, y=y), description


def _build(spec, form, input_shape, num_classes, seed):
    """spec's model, with the same weights on every call."""
    if form == "function":  # its layers draw from Keras's global seed
        keras.utils.set_random_seed(seed)
    return model_spec.load_model(spec, input_shape, num_classes, seed=seed)


def _declared_shapes(path, model):
    """(input_shape, num_classes) of a saved model; ModelError where it leaves one open."""
    try:
        (inputs,), (outputs,) = model.inputs, model.outputs
    except (AttributeError, ValueError, TypeError):
        raise ModelError(f"model file {path!r} does not declare one input and one output; "
                         "save a functional or Sequential model built on one keras.Input."
                         ) from None
    input_shape, num_classes = tuple(inputs.shape[1:]), outputs.shape[-1]
    if None in input_shape or num_classes is None or len(outputs.shape) != 2:
        raise ModelError(f"model file {path!r} takes {tuple(inputs.shape)} and outputs "
                         f"{tuple(outputs.shape)}; the benchmark needs a fixed example shape "
                         "and logits (None, num_classes): save it built on keras.Input(shape=) "
                         "of fixed sizes.")
    return input_shape, int(num_classes)


def _synthetic_x(model, shape, rng):
    """x of `shape` for `model`'s input dtype: (array, [low, high), those values in words)."""
    try:
        dtype = tf.as_dtype(model.inputs[0].dtype)
    except (AttributeError, ValueError, TypeError):  # a subclassed model declares none
        dtype = tf.as_dtype(keras.config.floatx())
    if dtype.is_floating:
        low, high, words = 0, 1, "uniform in [0, 1)"
        x = rng.uniform(low, high, size=shape)
    elif dtype.is_integer or dtype.is_bool:
        input_dim = next((layer.input_dim for layer in model.layers
                          if isinstance(layer, keras.layers.Embedding)), None)
        low, high = 0, input_dim or DEFAULT_ID_RANGE
        words = f"ids in [0, {high}): " + ("the first Embedding's input_dim" if input_dim
                                            else "no Embedding layer tells the vocabulary")
        x = rng.integers(low, high, size=shape)
    else:
        raise ModelError(f"the model takes {dtype.name} inputs; the benchmark draws numbers.")
    return x.astype(dtype.as_numpy_dtype), [low, high], words
