"""The handle `tower_step`'s function gets for one tower, and what fn reads through it.

While fn runs on a tower, every Keras variable it reads is the tower's copy and
every one it assigns is kept on the tower (`_TowerReads`, a keras.StatelessScope
over all variables): a penalty over `model.trainable_variables`, a model called
directly, a MAML inner step on `v.value` all read the copies the tower's
GradientTape watches. `tower(model, ...)` calls a model on the same copies
inside a nested StatelessScope of its own (forward.stateless_run), which also
skips a call on no rows. A read that bypasses both (a variable read inside a
StatelessScope of the user's that does not map it) reads the main variable,
unchanged during the step: its gradient is taken there and added (`backward`).
"""

import contextlib

import keras
import tensorflow as tf

from towers.data_parallel import replicas
from towers.engine import forward, model_losses, tower


class Tower:
    """The handle `fn` gets for one tower: `tower(model, ...)` calls a model on this
    tower's copies of its weights, writing no variable.

    Attributes:
      device: the tower's device name.
      index: the tower's index (its RNG seeds are offset by it: dropout masks differ).
      losses: the sum of the regularisation losses (model.losses) of the calls made
        on this tower so far, a float32 scalar (0.0 before any).
    """

    def __init__(self, device, index, watched, persistent, meeting, shared_calls):
        self.device, self.index, self._meeting = device, index, meeting
        self._shared_calls = shared_calls  # a tower_calls.SharedCalls, every tower's
        self._watched, self._persistent = watched, persistent
        self._values = {}  # id(variable) -> its current value on this tower
        self._sources = {}  # id(variable) -> the copy the tape watches, for wrt
        self._variables = {}  # id(variable) -> variable, for every one changed
        self._changed = {}  # id(variable) -> its new value after the calls
        self._regularization = []
        self._tape, self._running, self._rows = None, False, None
        self._calls = 0  # tower(...) calls running now: they skip a shard of no rows
        self._graph = None  # fn's graph: copies are made there, not in a branch of it
        self._copying = False  # while a copy reads the main value through the scope
        self._outside_calls = False  # whether fn read or wrote a variable itself
        self.grads, self.shares, self.aux = {}, {}, None

    @property
    def losses(self):
        with tf.device(self.device):
            return tf.add_n(self._regularization) if self._regularization else tf.constant(0.0)

    @tf.autograph.experimental.do_not_convert  # fn is converted, the library is not
    def __call__(self, model, *args, **kwargs):
        """model(*args, **kwargs) on this tower's copies of its weights and state: its
        outputs. A call on no rows returns outputs of no rows and changes nothing."""
        if not self._running:
            raise ValueError("a tower handle calls models only while tower_step runs fn.")
        variables = list({id(v): v for v in model.trainable_variables +
                          model.non_trainable_variables + model.metrics_variables}.values())
        with tf.device(self.device):
            values = [self._read(v) for v in variables]

            def call(weights, state, x):
                del weights, x  # every value is in state, the call's arguments in args
                return self._shared_calls.run(model, variables, state, args, kwargs)

            self._calls += 1
            try:
                outputs, new_values, regularization = forward.unless_empty(
                    _rows(args, kwargs), call, [], values, None)
            finally:
                self._calls -= 1
        for variable, value in zip(variables, new_values):
            if value is not None:
                self._keep(variable, value)
        if regularization:
            self._regularization.append(model_losses.total(regularization))
        return outputs

    def run(self, fn, shard, rows, batch_rows, required):
        """Steps 2-3: fn(self, shard) under this tower's device, a GradientTape and
        _TowerReads; keeps its aux and per named loss the tower's share of the batch's
        mean (their sum / batch_rows), checked (`required`: the loss names fn must give)."""
        self._rows = rows
        with tf.device(self.device), tf.GradientTape(persistent=self._persistent) as tape:
            self._tape, self._running = tape, True
            self._graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
            try:
                with _TowerReads(self), self._meeting.synchronized_on_tower(
                        self.index, skips_empty=lambda: self._calls > 0):
                    result = fn(self, shard)
            except AttributeError as error:
                if "attribute 'handle'" not in str(error):
                    raise
                raise ValueError(
                    "fn took a gradient with respect to a variable, which inside fn reads "
                    "as the tower's copy (a tensor): differentiate with respect to the "
                    "copies, weights = [v.value for v in variables] (tape.watch(weights))."
                ) from None
            finally:
                self._running = False
            losses, self.aux = _checked_result(result, rows, required)
            self.shares = {name: tf.reduce_sum(values) / batch_rows
                          for name, values in losses.items()}

    def backward(self, wrt, cotangents):
        """Step 4 on this tower: per name in wrt, the gradient of its share of the batch's
        mean and of the aux times the cotangents a batch loss sent back
        (cotangents[name]: per aux leaf, or None): through the tower's copies, plus
        through any read of the main variables that bypassed them."""
        aux_leaves = tf.nest.flatten(self.aux)
        with tf.device(self.device):
            for name, variables in wrt.items():
                targets, starts = [], []
                if name in self.shares:
                    targets.append(self.shares[name])
                    starts.append(tf.ones([]))
                for leaf, cotangent in zip(aux_leaves, cotangents.get(name) or ()):
                    if cotangent is not None:
                        targets.append(leaf)
                        starts.append(tf.identity(cotangent))  # to this tower's device
                if not targets:
                    self.grads[name] = [None] * len(variables)
                    continue
                copies = [self._sources[id(v)] for v in variables if id(v) in self._sources]
                grads = self._tape.gradient(targets, copies + list(variables),
                                            output_gradients=starts)
                through_copies = iter(grads[:len(copies)])
                self.grads[name] = [self._unless_empty(
                    add_gradients(next(through_copies) if id(v) in self._sources else None,
                                  direct), tf.zeros_like)
                    for v, direct in zip(variables, grads[len(copies):])]
        self._tape = None  # the activations may now be freed

    def changed_state(self):
        """{id(variable): (variable, its new value on this tower)} for every one changed."""
        return {key: (self._variables[key],
                      self._unless_empty(value, lambda _, v=self._variables[key]: v.value))
                for key, value in self._changed.items()}

    def _unless_empty(self, value, empty_value):
        """`value`, or empty_value(value) where the shard has no rows and fn read a
        variable outside tower(...): a model called directly on no rows gives NaN
        (BatchNorm's mean of nothing), where an empty shard's gradient is 0 and its
        state unchanged. tower(...) skips a call on no rows: its values need no help."""
        if (not self._outside_calls or not isinstance(value, tf.Tensor)
                or isinstance(self._rows, int) and self._rows > 0):
            return value
        with tf.device(self.device):
            return tf.where(tf.greater(self._rows, 0), value, empty_value(value))

    def _read(self, variable):
        """Step 2 for one variable: its value on this tower, copied the first time
        (a seed state offset by the tower's index), the latest after a call. The copy
        is made in fn's graph (the first read may be inside a tf.cond or a loop's body),
        from the main value with no gradient: the tape's gradient through it is the
        copy's, watched where `wrt` lists the variable."""
        key = id(variable)
        if key not in self._values:
            self._copying = True  # variable.value below is the main value
            try:
                with self._graph.as_default() if self._graph else contextlib.nullcontext():
                    [copy] = replicas.broadcast_weights([tf.stop_gradient(variable.value)],
                                                        self.device)
                    copy = tower.offset_seed(variable, copy, self.index)
                    if key in self._watched:
                        self._tape.watch(copy)
                        self._sources[key] = copy
            finally:
                self._copying = False
            self._values[key] = copy
        return self._values[key]

    def _keep(self, variable, value):
        """A new value of `variable` on this tower: later reads see it, and it is
        merged with the other towers' after the step."""
        key = id(variable)
        self._values[key] = self._changed[key] = value
        self._variables[key] = variable


class _TowerReads(keras.StatelessScope):
    """fn's view of every Keras variable on one tower: a read is the tower's value
    (Tower._read), an assignment is kept on the tower (Tower._keep); losses a layer
    adds are collected, so model.losses inside fn sees them as outside a scope."""

    def __init__(self, handle):
        super().__init__(collect_losses=True)
        self._handle = handle

    def get_current_value(self, variable):
        if self._handle._copying:
            return None
        self._handle._outside_calls = True
        return self._handle._read(variable)

    def add_update(self, update):
        self._handle._outside_calls = True
        self._handle._keep(*update)


def _checked_result(result, rows, required):
    """fn's (losses, aux), checked: per-example losses of the shard's rows."""
    if not isinstance(result, (tuple, list)) or len(result) != 2 or not isinstance(
            result[0], dict):
        raise ValueError("fn must return (losses, aux): losses a dict {name: per-example "
                         "losses, shape (n,)} and aux a structure or None, got "
                         f"{type(result).__name__}.")
    losses, aux = result
    for name, values in losses.items():
        values = tf.convert_to_tensor(values)
        if values.shape.rank != 1 or (isinstance(rows, int) and values.shape[0] is not None
                                      and values.shape[0] != rows):
            raise ValueError(
                f"fn's loss {name!r} has shape {tuple(values.shape)} for a shard of {rows} "
                "rows; it must be per-example, shape (rows,): each row's loss depending on "
                "its row alone. For a loss over the whole batch use batch_losses=.")
        if not values.dtype.is_floating:
            raise ValueError(f"fn's loss {name!r} is {values.dtype.name}; losses are floats.")
    missing = sorted(required - set(losses))
    if missing:
        raise ValueError(f"wrt names {missing}, which neither fn's losses (it returned "
                         f"{sorted(losses)}) nor batch_losses have; give each named loss.")
    return {name: tf.cast(values, tf.float32) for name, values in losses.items()}, aux


def _rows(args, kwargs):
    """The rows of a call's first tensor argument (an int, or an int32 scalar)."""
    leaves = [leaf for leaf in tf.nest.flatten((args, kwargs)) if tf.is_tensor(leaf)]
    if not leaves or leaves[0].shape.rank == 0:
        return 1  # nothing with rows: the call runs
    first = leaves[0]
    return first.shape[0] if first.shape[0] is not None else tf.shape(first)[0]


def add_gradients(a, b):
    """a + b where either may be None (no gradient)."""
    if a is None or b is None:
        return b if a is None else a
    return tf.convert_to_tensor(a) + tf.convert_to_tensor(b)
