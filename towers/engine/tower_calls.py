"""`tower(model, ...)` traced once for every tower of a tower_step, not once per tower.

Inside the caller's tf.function each tower runs fn, and each `tower(model, ...)` call
would trace the model's forward again: N copies of the model's Python in the first
call (a 2-block transformer's: 1.87 s at 4 towers against 0.70 s at 1). A model's
call on the tower's values names no device, so one trace serves every tower, called
under its device, as the trainer's tower work does (engine/traced_tower.py,
compiled_tower); the tape's gradient of the call is TensorFlow's gradient of the
traced function, made once too. Masks cross the trace's edges as extra values.

Not shared, each tower tracing its own calls as before: one tower (SharedCalls);
called eagerly; a model with BatchNormalization(synchronized=True) layers, which meet
the other towers inside the call; arguments other than tensors, arrays and plain
Python values; a trace that captures a tensor of the caller's graph (what it reads
may be one tower's own).
"""

import keras
import numpy as np
import tensorflow as tf

from towers.data_parallel import batch_statistics
from towers.engine import forward, losses, tower_trace

_PLAIN = (bool, int, float, str, bytes, type(None))


class SharedCalls:
    """The traced calls of one tower_step: `run` gives a model's call on a tower's values,
    traced the first time for every tower that calls it with arguments of the same
    structure, shapes and Python values.

    num_towers: the step's towers. One tower traces its own calls: a traced function's
    call and its gradient cost about what a second tower's trace saves (that
    transformer's first call: 0.70 s plain, 0.83 s through a traced function; at 2
    towers 1.1 s either way, at 4 towers 1.87 s plain, 1.58 s shared).
    """

    def __init__(self, num_towers):
        # (id(model), its variables' ids) -> a tf.function, or None: each tower traces
        self._functions = {}
        self._shared = num_towers > 1

    def run(self, model, variables, values, args, kwargs):
        """forward.stateless_run(model, variables, values, model(*args, **kwargs))'s
        (outputs, new_values, regularization), on the current device; the outputs carry
        their Keras masks as the call's do."""
        inputs = (args, kwargs)
        key = (id(model), tuple(map(id, variables)))
        if key not in self._functions:
            # Layers built synchronized=True meet the other towers inside the call.
            meets = batch_statistics.global_layers(model, batch_statistics.PER_TOWER)
            self._functions[key] = (None if not self._shared or tf.executing_eagerly() or meets
                                    else _traced_call(model, variables))
        function = self._functions[key]
        if function is None or not _shareable(inputs):
            return _stateless_call(model, variables, values, inputs)
        masks = losses.output_masks(inputs)
        if not tower_trace.copyable(function.get_concrete_function(values, inputs, masks)):
            self._functions[key] = None
            return _stateless_call(model, variables, values, inputs)
        outputs, output_masks, new_values, regularization = function(values, inputs, masks)
        return losses.with_masks((outputs, output_masks)), new_values, regularization


def _traced_call(model, variables):
    """A tf.function(values, inputs, masks) -> (outputs, their masks, new_values,
    regularization) of `model` called on inputs = (args, kwargs) with `variables` read
    as `values`, each mask ({index in tf.nest.flatten(inputs): mask}) attached again
    inside: a tf.function's inputs and outputs carry no Keras mask."""
    def call(values, inputs, masks):
        outputs, new_values, regularization = _stateless_call(
            model, variables, values, losses.with_masks((inputs, masks)))
        return outputs, losses.output_masks(outputs), new_values, regularization

    return tf.function(call, autograph=False)


def _stateless_call(model, variables, values, inputs):
    args, kwargs = inputs
    return forward.stateless_run(model, variables, values, lambda: model(*args, **kwargs))


def _shareable(inputs):
    """Whether a call's (args, kwargs) are what a tf.function takes as it takes them from
    every tower: tensors (not variables), arrays and plain Python values."""
    return all(isinstance(leaf, _PLAIN + (np.ndarray,)) or (
        tf.is_tensor(leaf) and not isinstance(leaf, (tf.Variable, keras.Variable)))
        for leaf in tf.nest.flatten(inputs))
