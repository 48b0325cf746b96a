"""Private Keras names about models, layers and variables, each beside the public
alternative it stands in for (towers/compat/__init__.py says why they live here)."""

import contextlib
import copy
import functools

import keras
import tensorflow as tf
from keras.src.backend.common import global_state, masking, stateless_scope
from keras.src.losses import loss as loss_module
from keras.src.trainers import compile_utils

from towers.compat.keras_graphs import functional_graph

# ---------------------------------------------------------------------------------------
# Keras: models and layers


def keras_mask(tensor):
    """The Keras mask attached to `tensor` (a bool Tensor), or None.

    Public alternative: `layer.compute_mask(inputs, previous_mask)` per layer;
    Keras attaches the result to each output itself, and a model's outputs
    carry it only as this attribute.
    """
    return masking.get_keras_mask(tensor)


def set_keras_mask(tensor, mask):
    """Attaches `mask` to `tensor` in place, as a Keras layer's call does."""
    masking.set_keras_mask(tensor, mask)


def same_rank(values, weight):
    """(values, weight) with ranks that differ by one matched as Keras's losses match
    them: a last dim of 1 dropped, or one added to a rank-1 tensor.

    Public alternative: none; Keras applies it inside Loss.__call__, which also
    reduces, and towers needs the unreduced sum of each shard.
    """
    return loss_module.squeeze_or_expand_to_same_rank(values, weight)


class CompileLoss(compile_utils.CompileLoss):
    """Keras's container for what `keras.Model.compile` takes as `loss` and `loss_weights`.

    Public alternative: `model.compile(loss=..., loss_weights=...)` then
    `model.compute_loss(...)`, which returns the batch's reduced loss only, and
    compiling would change the user's model. This class resolves every form
    exactly as compile does (single, list, dict by output name, nested,
    strings, None for an output without a loss) and matches y_true and the
    sample weights to the outputs as Keras's train_step does; then, where Keras
    calls each term's loss, it calls `term_fn(loss, y_true, y_pred, sample_weight)`
    (which may return anything Keras can add up).

    `flat_losses`: Keras's `_flat_losses`, one (path, loss, loss_weights, name)
    per term, after the first call. Keras's per-term Mean trackers are not
    updated (`metrics` is one None per term): the trainer keeps its own logs.
    """

    def __init__(self, loss, loss_weights, output_names, term_fn):
        super().__init__(loss, loss_weights, output_names=output_names)
        self._term_fn = term_fn

    def build(self, y_true, y_pred):
        # Keras makes a Mean tracker per term here, as variables: outside any
        # trace, so a tf.function that builds it can trace again.
        with tf.init_scope():
            super().build(y_true, y_pred)
        self._flat_losses = [
            term._replace(loss=functools.partial(self._term_fn, term.loss))
            for term in self._flat_losses]

    @property
    def flat_losses(self):
        return [term._replace(loss=term.loss.args[0]) for term in self._flat_losses or []]

    @property
    def metrics(self):
        return [None] * len(self._flat_losses or [])

    @property
    def variables(self):
        return []


CompileMetrics = compile_utils.CompileMetrics
# Keras's container for `compile(metrics=..., weighted_metrics=...)`: per-output metrics,
# names such as "cls_accuracy", "accuracy" picked by the targets' shape. Public alternative:
# `model.compile(metrics=...)` + `model.compute_metrics`, which would compile the user's model.


def stateless_value(variable):
    """The value the innermost keras.StatelessScope maps `variable` to (the tower's copy
    in a stateless_call), or None outside one or where it maps none.

    Public alternative: none; a StatelessScope takes the mapping and does not show it
    (Keras's own layers read it this way).
    """
    scope = stateless_scope.get_stateless_scope()
    return None if scope is None else scope.get_current_value(variable)


def keras_call_state():
    """The Keras state a layer's call reads besides its arguments and variables, as it
    is now, as fn() -> a context manager that puts it back: the call context (the
    `training` of an outer call, which a sublayer not given one takes; inside one, a
    sublayer's call does not clear its losses) and the autocast scope (mixed
    precision's compute dtype). A recomputation's rerun runs in the backward, outside
    both.

    Public alternative: none; Keras's Layer.__call__ enters both, in its global state.
    """
    saved = {key: global_state.get_global_attribute(key)
             for key in ("current_call_ctx", "autocast_scope")}
    saved["current_call_ctx"] = copy.copy(saved["current_call_ctx"])  # calls write into it

    @contextlib.contextmanager
    def put_back():
        outer = {key: global_state.get_global_attribute(key) for key in saved}
        for key, value in saved.items():
            global_state.set_global_attribute(key, copy.copy(value))
        try:
            yield
        finally:
            for key, value in outer.items():
                global_state.set_global_attribute(key, value)

    return put_back


def loss_adders(layer, losses):
    """Per loss in `losses`, added by add_loss inside a stateless call of `layer`, the
    layer that added it: `layer` or one nested in it (the same order in model.losses).

    Public alternative: none; `layer.losses` gives the losses, and only Keras's own
    record (Layer._loss_ids) says which layer added each.
    """
    adders = {}
    for nested in layer._flatten_layers():
        for loss in losses:
            if id(loss) in nested._loss_ids:
                adders.setdefault(id(loss), nested)
    return [adders.get(id(loss), layer) for loss in losses]


def nested_layers(model):
    """Every layer inside `model`, nested ones too (not `model` itself).

    Public alternative: `model.layers`, the top level only; Keras 3 has no public
    recursive walk.
    """
    return model._flatten_layers(include_self=False)


@contextlib.contextmanager
def batch_norm_moments(layer, moments):
    """Inside, BatchNormalization `layer` in training takes its batch's (mean, variance)
    from moments(layer, inputs, mask), each of shape (channels,).

    Private: Keras's `_moments`. Public alternative: `synchronized=True`, whose moments
    ask tf.distribute's replica context to all-reduce; the towers run in none.
    """
    layer._moments = functools.partial(moments, layer)  # an instance attribute, shadowing
    try:
        yield
    finally:
        del layer._moments


@contextlib.contextmanager
def every_batch_norm_moments(moments):
    """Inside, every BatchNormalization in training, of any model, takes its batch's
    (mean, variance) from moments(layer, inputs, mask, own_moments), own_moments(inputs,
    mask) being Keras's (a layer's own batch_norm_moments still comes first).

    Private: Keras's `_moments`, replaced on the class while inside. Public
    alternative: as batch_norm_moments'.
    """
    keras_moments = keras.layers.BatchNormalization._moments
    keras.layers.BatchNormalization._moments = lambda layer, inputs, mask: moments(
        layer, inputs, mask, functools.partial(keras_moments, layer))
    try:
        yield
    finally:
        keras.layers.BatchNormalization._moments = keras_moments


def is_seed_state(variable):
    """Whether `variable` is a keras.random.SeedGenerator's state (a Dropout's, a noise
    layer's): Keras names every one "seed_generator_state", its path ending so.

    Public alternative: none; a model's non_trainable_variables list the states among
    the rest, and which layer holds a SeedGenerator only Layer._seed_generators says.
    """
    return variable.path.endswith("seed_generator_state")


def sublayers(layer):
    """The layers `layer` holds directly (its attributes' and its graph's), in the order
    `layer.weights` lists their weights after its own.

    Public alternative: `model.layers` for a keras.Model; a plain Layer has none.
    """
    return list(layer._layers)


def own_weights(layer):
    """The weights `layer` creates itself, not its sublayers': the first of
    `layer.weights`, in that order.

    Public alternative: none; `layer.weights` lists its sublayers' too.
    """
    weights, seen = [], set()
    for weight in layer._trainable_variables + layer._non_trainable_variables:
        if id(weight) not in seen:
            seen.add(id(weight))
            weights.append(weight)
    return weights


def replace_sublayer(parent, old, new):
    """Puts layer `new` wherever `parent` holds layer `old`: its attributes (directly or
    in a list, tuple or dict), its tracked sublayers (at `old`'s place, so
    `parent.weights` keeps its order and drops `old`'s) and, where `parent` runs a
    functional graph (Functional, Sequential), the graph's nodes, so that `parent`'s
    own call runs `new`. `old` is left untracked by `parent`.

    Public alternative: none. `setattr(parent, name, new)` tracks `new` last (or is
    refused: a built layer's state is locked) and keeps `old` tracked, its variables
    among `parent.weights`; a graph's nodes cannot be changed at all.
    """
    tracker = parent._tracker
    store = tracker.config["layers"][1]
    lists = {id(store): store, id(parent._layers): parent._layers}
    places = [(layers, _index_of(layers, old)) for layers in lists.values()
              if _index_of(layers, old) is not None]
    was_locked = tracker.locked
    tracker.unlock()
    try:
        for name, value in list(vars(parent).items()):
            if name == "_layers":  # put in order below
                continue
            if value is old:  # Keras tracks `new` (at the end), TensorFlow's checkpoint follows
                setattr(parent, name, new)
            elif isinstance(value, list):
                for i, item in enumerate(list(value)):
                    if item is old:
                        value[i] = new
            elif isinstance(value, tuple) and any(item is old for item in value):
                setattr(parent, name, type(value)(new if item is old else item
                                                  for item in value))
            elif isinstance(value, dict):
                for key, item in list(value.items()):
                    if item is old:
                        value[key] = new
    finally:
        if was_locked:
            tracker.lock()
    for layers, index in places:  # `new` at `old`'s place, once
        while _index_of(layers, new) is not None:
            list.pop(layers, _index_of(layers, new))
        list.__setitem__(layers, _index_of(layers, old), new)
    tracker.stored_ids["layers"].discard(id(old))
    tracker.stored_ids["layers"].add(id(new))
    graph = functional_graph(parent)
    if graph is not None:
        _replace_in_graph(graph, old, new)
        if graph is not parent:  # a Sequential's inner Functional tracks it too
            replace_sublayer(graph, old, new)


def _index_of(layers, layer):
    return next((i for i, item in enumerate(layers) if item is layer), None)


def _replace_in_graph(graph, old, new):
    """Each node of `graph` that calls `old` calls `new`, its outputs' history saying so."""
    for i, operation in enumerate(graph._operations):
        if operation is old:
            graph._operations[i] = new
    for operations in graph._operations_by_depth.values():
        for i, operation in enumerate(operations):
            if operation is old:
                operations[i] = new
    for node in [node for nodes in graph._nodes_by_depth.values() for node in nodes]:
        if node.operation is old:
            node.operation = new
            new._inbound_nodes.append(node)
            for i, tensor in enumerate(node.outputs):
                tensor._keras_history = type(tensor._keras_history)(
                    new, len(new._inbound_nodes) - 1, i)


def move_variable(variable, device):
    """Puts a keras.Variable's storage on `device`, whole, keeping its value and name
    (one held in slabs, hold_in_slabs', is joined into one tf.Variable again).

    Public alternative: none; a Keras 3 variable stays on the device it was made on
    (`assign` keeps it there), so a new tf.Variable takes the place of the one it wraps.
    """
    old = variable._value
    if isinstance(variable, _HeldInSlabs):
        variable.__class__ = keras.Variable
        with tf.init_scope(), tf.device(device):
            variable._value = tf.Variable(old.read(), trainable=variable.trainable,
                                          name=variable.name)
        return
    with tf.init_scope(), tf.device(device):
        variable._value = tf.Variable(
            old.read_value(), trainable=old.trainable, name=variable.name,
            aggregation=old.aggregation, synchronization=old.synchronization)


class _HeldInSlabs(keras.Variable):
    """A keras.Variable whose storage is a data_parallel.slabs.Slabs (its rows held as
    slabs on several devices) in place of one tf.Variable: reading it joins them, assigning
    writes into them, a checkpoint saves and restores it whole.

    Public alternative: none; a Keras 3 variable wraps exactly one tf.Variable (its
    private `_value`), and tf's ShardedVariable, a composite tensor, is taken apart by
    every op it meets (tf.identity rebuilds it from tensors and fails)."""

    @property
    def value(self):
        value = super().value
        return self._value.read() if value is self._value else value

    @property
    def _shared_name(self):
        return self.name

    def _serialize_to_tensors(self):
        return {"VARIABLE_VALUE": self._value.read()}

    def _restore_from_tensors(self, restored_tensors):
        return self.assign(restored_tensors["VARIABLE_VALUE"])


def can_hold_in_slabs(variable):
    """Whether hold_in_slabs takes `variable`: a plain keras.Variable (not a subclass)."""
    return type(variable) in (keras.Variable, _HeldInSlabs)


def hold_in_slabs(variable, slabs):
    """Makes `slabs` (a data_parallel.slabs.Slabs of `variable`'s rows) the storage of the
    keras.Variable `variable` (can_hold_in_slabs), in place of its tf.Variable, which is
    dropped."""
    variable.__class__ = _HeldInSlabs
    variable._value = slabs


def held_slabs(variable):
    """The data_parallel.slabs.Slabs holding `variable`, or None where one tf.Variable does."""
    return variable._value if isinstance(variable, _HeldInSlabs) else None


def drop_weight(layer, attribute):
    """Removes the weight `layer.<attribute>` (e.g. an EinsumDense's "bias") from `layer`:
    the attribute becomes None, and the variable leaves the layer's weights.

    Public alternative: none; a Keras layer adds weights (add_weight), never drops one.
    """
    variable = getattr(layer, attribute)
    setattr(layer, attribute, None)
    layer._untrack_variable(variable)
