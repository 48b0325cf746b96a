"""Your own loop over the towers: one function per tower, any models, any losses.

`tower_step(fn, batch, devices, wrt)` is steps 1-6 for a research loop (a GAN's
two optimizers, gradient surgery, a contrastive loss over the whole batch):

1. `batch` is split into one shard per tower (split.shards_of);
2. `fn(tower, shard)` runs once per tower under its device; `tower(model, ...)`
   calls a model on the tower's copies of its weights, copied there the first
   time the tower reads them (replicas.broadcast_weights), with any arguments;
3. the call writes nothing: state updates (BatchNorm statistics, counters, a
   metric updated in `call`) are kept per tower and merged after the step by
   each variable's rule (aggregate.state_rules);
4. each named loss is differentiated on the tower with respect to its own
   variables (`wrt`); a loss over the whole batch (`batch_losses`) is computed
   on the main device from every tower's auxiliary outputs, and its gradient
   with respect to them goes back to the towers, whose backward starts from it:
   one forward per tower either way;
5-6. each loss's gradients meet on the main device and are added
   (exchange.route), the global batch's mean.

Step 7 is yours: apply the gradients with your optimizers.
"""

import collections

import tensorflow as tf

from towers import devices as devices_lib
from towers.data_parallel import aggregate, exchange, forward, model_losses, replicas, split
from towers.data_parallel import tower

StepOutput = collections.namedtuple("StepOutput", ["grads", "losses", "aux"])
StepOutput.__doc__ = """What tower_step computed, on the main device.

grads: {name: one gradient per variable of wrt[name]} (None where the loss does not
  depend on it): the gradient of the global batch's mean of a per-example loss, plus
  that of its batch loss where batch_losses names it.
losses: {name: float32 scalar}: the global batch's mean of each per-example loss, plus
  its batch loss (or the batch loss alone).
aux: fn's auxiliary outputs of every tower, rows in batch order (None where fn gave None).
"""


def tower_step(fn, batch, devices, wrt, main_device=None, *, batch_losses=None):
    """Steps 1-6 of your own loop: `fn` once per tower, each loss's mean gradient.

    Call it inside your own tf.function, then apply out.grads with your optimizers.

    Args:
      fn: fn(tower, shard) -> (losses, aux), run once per tower under its device.
        shard: that tower's rows of `batch` (its structure). tower(model, *args,
        **kwargs) calls `model` on the tower's copies of its weights with the
        arguments given (training=... as given, else Keras's default) and returns
        its outputs; state the call updates is kept on the tower and merged after
        the step. tower.losses: the regularisation (model.losses) of the calls so
        far, a float32 scalar (0.0 for none). losses: {name: per-example losses,
        shape (n,)} for the shard's n rows; aux: any nested structure of (n, ...)
        tensors, or None.
      batch: a Tensor or a nested structure of Tensors sharing dim 0 (the global
        batch); its rows need not divide by the number of towers.
      devices: tower device names, one shard each.
      wrt: {name: list of variables}: each named loss is differentiated with respect
        to its own variables (a GAN's discriminator loss w.r.t. D's alone).
      main_device: where gradients, losses and aux meet; None = devices[0].
      batch_losses: None, or {name: callable(aux) -> scalar}: a loss of the whole
        global batch's aux (rows in batch order), computed on the main device.

    Returns:
      a StepOutput (grads, losses, aux), on main_device.

    Raises:
      ValueError: in one line, before anything runs: no devices or one that does not
        exist, a batch of no rows, `wrt` naming no loss, fn returning something
        other than per-example losses, a batch loss that is not a scalar, a model
        call that assigns a variable the step would lose.
    """
    devices = devices_lib.device_grid(devices_lib.device_list(devices))
    devices = [row[0] for row in devices]
    main_device = devices_lib.canonical_name(main_device or devices[0])
    devices_lib.check_devices_exist(devices + [main_device])
    wrt, batch_losses = _checked_wrt(wrt), _checked_batch_losses(batch_losses)
    split.check_not_empty(batch)
    shards, sizes, rows = split.shards_of(batch, len(devices))                      # 1
    batch_rows = tf.cast(rows, tf.float32)
    watched = {id(v) for variables in wrt.values() for v in variables}
    towers = [Tower(device, i, watched, persistent=len(wrt) > 1)
              for i, device in enumerate(devices)]
    for i, (handle, shard) in enumerate(zip(towers, shards)):
        with tf.name_scope(f"tower_{i}"):
            handle.run(fn, shard, sizes[i], batch_rows, set(wrt) - set(batch_losses))  # 2, 3
    aux, whole = _whole_batch(batch_losses, towers, sizes, main_device, wrt)
    for i, handle in enumerate(towers):
        with tf.name_scope(f"tower_{i}"):
            handle.backward(wrt, {name: cotangents[i]
                                  for name, (_, cotangents, _) in whole.items()})    # 4
    route = exchange.route()
    grads = {}
    for name, variables in wrt.items():
        summed = route([handle.grads[name] for handle in towers], devices, main_device)  # 5, 6
        direct = whole[name][2] if name in whole else [None] * len(variables)
        with tf.device(main_device):
            grads[name] = [_add(g, d) for g, d in zip(summed, direct)]
    _assign_state(towers, sizes, main_device)
    return StepOutput(grads, _losses(towers, whole, main_device), aux)


class Tower:
    """The handle `fn` gets for one tower: `tower(model, ...)` calls a model on this
    tower's copies of its weights, writing no variable.

    Attributes:
      device: the tower's device name.
      index: the tower's index (its RNG seeds are offset by it: dropout masks differ).
      losses: the sum of the regularisation losses (model.losses) of the calls made
        on this tower so far, a float32 scalar (0.0 before any).
    """

    def __init__(self, device, index, watched, persistent):
        self.device, self.index = device, index
        self._watched, self._persistent = watched, persistent
        self._values = {}  # id(variable) -> its current value on this tower
        self._sources = {}  # id(variable) -> the copy the tape watches, for wrt
        self._variables = {}  # id(variable) -> variable, for every one changed
        self._changed = {}  # id(variable) -> its new value after the calls
        self._regularization = []
        self._tape, self._running = None, False
        self.grads, self.parts, self.aux = {}, {}, None

    @property
    def losses(self):
        with tf.device(self.device):
            return tf.add_n(self._regularization) if self._regularization else tf.constant(0.0)

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
                return forward.stateless_run(model, variables, state,
                                             lambda: model(*args, **kwargs))

            outputs, new_values, regularization = forward.unless_empty(
                _rows(args, kwargs), call, [], values, None)
        for variable, value in zip(variables, new_values):
            if value is not None:
                self._values[id(variable)] = self._changed[id(variable)] = value
                self._variables[id(variable)] = variable
        if regularization:
            self._regularization.append(model_losses.total(regularization))
        return outputs

    def run(self, fn, shard, rows, batch_rows, required):
        """Steps 2-3: fn(self, shard) under this tower's device and a GradientTape; keeps
        its aux and per named loss the tower's part of the batch's mean (their sum /
        batch_rows), checked (`required`: the loss names fn must give)."""
        with tf.device(self.device), tf.GradientTape(persistent=self._persistent) as tape:
            self._tape, self._running = tape, True
            try:
                result = fn(self, shard)
            finally:
                self._running = False
            losses, self.aux = _checked_result(result, rows, required)
            self.parts = {name: tf.reduce_sum(values) / batch_rows
                          for name, values in losses.items()}

    def backward(self, wrt, cotangents):
        """Step 4 on this tower: per name in wrt, the gradient of its part of the batch's
        mean and of the aux times the cotangents a batch loss sent back
        (cotangents[name]: per aux leaf, or None)."""
        aux_leaves = tf.nest.flatten(self.aux)
        with tf.device(self.device):
            for name, variables in wrt.items():
                targets, starts = [], []
                if name in self.parts:
                    targets.append(self.parts[name])
                    starts.append(tf.ones([]))
                for leaf, cotangent in zip(aux_leaves, cotangents.get(name) or ()):
                    if cotangent is not None:
                        targets.append(leaf)
                        starts.append(tf.identity(cotangent))  # to this tower's device
                sources = [self._sources.get(id(v), v) for v in variables]
                self.grads[name] = (self._tape.gradient(targets, sources,
                                                        output_gradients=starts)
                                    if targets else [None] * len(variables))
        self._tape = None  # the activations may now be freed

    def changed_state(self):
        """{id(variable): (variable, its new value on this tower)} for every one changed."""
        return {key: (self._variables[key], value) for key, value in self._changed.items()}

    def _read(self, variable):
        """Step 2 for one variable: its value on this tower, copied the first time
        (a seed state offset by the tower's index), the latest after a call."""
        key = id(variable)
        if key not in self._values:
            [copy] = replicas.broadcast_weights([variable.value], self.device)
            copy = tower.offset_seed(variable, copy, self.index)
            if key in self._watched:
                self._tape.watch(copy)
                self._sources[key] = copy
            self._values[key] = copy
        return self._values[key]


def _rows(args, kwargs):
    """The rows of a call's first tensor argument (an int, or an int32 scalar)."""
    leaves = [leaf for leaf in tf.nest.flatten((args, kwargs)) if tf.is_tensor(leaf)]
    if not leaves or leaves[0].shape.rank == 0:
        return 1  # nothing with rows: the call runs
    first = leaves[0]
    return first.shape[0] if first.shape[0] is not None else tf.shape(first)[0]


def _whole_batch(batch_losses, towers, sizes, main_device, wrt):
    """The towers' aux gathered on the main device in batch order, and per batch loss
    (value, per tower its cotangents (one per aux leaf, or None), its direct gradients
    w.r.t. wrt[name] (variables the loss itself reads))."""
    if towers[0].aux is None:
        if batch_losses:
            raise ValueError(f"batch_losses {sorted(batch_losses)} are computed from fn's aux, "
                             "but fn returned aux None; return the outputs they need as aux.")
        return None, {}
    with tf.device(main_device), tf.name_scope("whole_batch"):
        parts = [tf.nest.map_structure(tf.identity, handle.aux) for handle in towers]
        aux = forward.concat_rows(parts)
        if not batch_losses:
            return aux, {}
        leaves = tf.nest.flatten(aux)
        floating = [leaf for leaf in leaves if leaf.dtype.is_floating]
        with tf.GradientTape(persistent=len(batch_losses) > 1) as tape:
            tape.watch(floating)
            values = {name: _checked_scalar(name, loss(aux))
                      for name, loss in batch_losses.items()}
        whole = {}
        for name, value in values.items():
            variables = wrt.get(name, [])
            gradients = tape.gradient(value, floating + list(variables))
            by_leaf = iter(gradients[:len(floating)])
            cotangents = [next(by_leaf) if leaf.dtype.is_floating else None for leaf in leaves]
            per_tower = [[] for _ in towers]
            for cotangent in cotangents:
                pieces = ([None] * len(towers) if cotangent is None else
                          split.split_rows(tf.convert_to_tensor(cotangent), sizes))
                for i, piece in enumerate(pieces):
                    per_tower[i].append(piece)
            whole[name] = (value, per_tower, gradients[len(floating):])
        return aux, whole


def _losses(towers, whole, main_device):
    """{name: the batch's mean of each per-example loss, plus its batch loss}."""
    with tf.device(main_device):
        losses = {}
        for name in towers[0].parts:
            losses[name] = tf.add_n([tf.identity(h.parts[name]) for h in towers])
        for name, (value, _, _) in whole.items():
            losses[name] = value if name not in losses else losses[name] + value
        return losses


def _assign_state(towers, sizes, main_device):
    """Step 6 for state: every variable a call changed, merged over the towers by its
    rule (aggregate.state_rules) and written once."""
    states = [handle.changed_state() for handle in towers]
    changed = {key: variable for state in states for key, (variable, _) in state.items()}
    if not changed:
        return
    variables = list(changed.values())
    tower_states = [[state.get(key, (None, None))[1] for key in changed] for state in states]
    merged = aggregate.merge_state(tower_states, [v.value for v in variables],
                                   aggregate.state_rules(variables), sizes, main_device)
    for variable, value in zip(variables, merged):
        with tf.device(variable.value.device):
            variable.assign(value)


def _add(a, b):
    if a is None or b is None:
        return b if a is None else a
    return tf.convert_to_tensor(a) + tf.convert_to_tensor(b)


def _checked_wrt(wrt):
    if not isinstance(wrt, dict) or not wrt:
        raise ValueError(f"wrt must be a dict {{loss name: list of variables}} with at least "
                         f"one entry, got {type(wrt).__name__}.")
    for name, variables in wrt.items():
        if not isinstance(variables, (list, tuple)) or not all(
                hasattr(v, "assign") and hasattr(v, "value") for v in variables):
            raise ValueError(f"wrt[{name!r}] must be a list of variables (e.g. "
                             f"model.trainable_variables), got {type(variables).__name__}.")
    return dict(wrt)


def _checked_batch_losses(batch_losses):
    if batch_losses is None:
        return {}
    if not isinstance(batch_losses, dict) or not all(callable(f) for f in batch_losses.values()):
        raise ValueError("batch_losses must be a dict {name: callable(aux) -> scalar loss}, "
                         f"got {batch_losses!r}.")
    return dict(batch_losses)


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


def _checked_scalar(name, value):
    value = tf.convert_to_tensor(value)
    if value.shape.rank != 0:
        raise ValueError(f"batch_losses[{name!r}] returned shape {tuple(value.shape)}; a loss "
                         "over the whole batch is a scalar.")
    return tf.cast(value, tf.float32)
