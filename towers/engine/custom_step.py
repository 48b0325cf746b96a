"""Your own loop over the towers: one function per tower, any models, any losses.

`tower_step(fn, batch, devices, wrt)` is steps 1-5 for a research loop (a GAN's
two optimizers, gradient surgery, a contrastive loss over the whole batch):

1. `batch` is split into one shard per tower (split.shards_of);
2. `fn(tower, shard)` runs once per tower under its device; every variable it
   reads is the tower's copy, copied there the first time the tower reads it
   (replicas.broadcast_weights): through `tower(model, ...)`, which calls a
   model with any arguments, or directly (a penalty over the weights, a model
   called directly, a MAML inner step on `v.value`; tower_handle.py);
3. fn writes nothing: state updates (BatchNorm statistics, counters, a
   metric updated in `call`) are kept per tower and merged after the step by
   each variable's rule (aggregate.state_rules);
4. each named loss is differentiated on the tower with respect to its own
   variables (`wrt`); a loss over the whole batch (`batch_losses`) is computed
   on the main device from every tower's auxiliary outputs, and its gradient
   with respect to them goes back to the towers, whose backward starts from it:
   one forward per tower either way; the gradients meet on the main device
   (exchange.route);
5. and are added there: the global batch's mean.

Step 6 is yours: apply the gradients with your optimizers.
"""

import collections

import tensorflow as tf

from towers import compat
from towers import devices as devices_lib
from towers.data_parallel import aggregate, batch_statistics, exchange, split
from towers.engine import forward, tower_calls, tower_handle

StepOutput = collections.namedtuple("StepOutput", ["grads", "losses", "aux", "rows"])
StepOutput.__doc__ = """What tower_step computed, on the main device.

grads: {name: one gradient per variable of wrt[name]} (None where the loss does not
  depend on it): the gradient of the global batch's mean of a per-example loss, plus
  that of its batch loss where batch_losses names it.
losses: {name: float32 scalar}: the global batch's mean of each per-example loss, plus
  its batch loss (or the batch loss alone).
aux: fn's auxiliary outputs of every tower, rows in batch order (None where fn gave None).
rows: the global batch's rows, an int32 scalar: what each mean is over, so a loop that
  accumulates several calls weights each by its rows without counting them.
"""


def tower_step(fn, batch, devices, wrt, main_device=None, *, batch_losses=None):
    """Steps 1-5 of your own loop: `fn` once per tower, each loss's mean gradient.

    Call it inside your own tf.function, then apply out.grads with your optimizers.

    Args:
      fn: fn(tower, shard) -> (losses, aux), run once per tower under its device.
        shard: that tower's rows of `batch` (its structure). tower(model, *args,
        **kwargs) calls `model` on the tower's copies of its weights with the
        arguments given (training=... as given, else Keras's default) and returns
        its outputs (a call on no rows is skipped). Every other read of a Keras
        variable inside fn is the tower's copy too (model.trainable_variables in a
        penalty, a model called directly, `v.value` for a MAML inner step: take
        inner gradients with respect to those values), each with its exact
        gradient; state fn or a call updates is kept on the tower and merged after
        the step. tower.losses: the regularisation (model.losses) of the tower(...)
        calls so far, a float32 scalar (0.0 for none). losses: {name: per-example
        losses, shape (n,)} for the shard's n rows; aux: any nested structure of
        (n, ...) tensors, or None.
      batch: a Tensor or a nested structure of Tensors sharing dim 0 (the global
        batch); its rows need not divide by the number of towers.
      devices: tower device names, one shard each.
      wrt: {name: list of variables}: each named loss is differentiated with respect
        to its own variables (a GAN's discriminator loss w.r.t. D's alone).
      main_device: where gradients, losses and aux meet; None = devices[0].
      batch_losses: None, or {name: callable(aux) -> scalar}: a loss of the whole
        global batch's aux (rows in batch order), computed on the main device.

    Returns:
      a StepOutput (grads, losses, aux, rows), on main_device.

    Raises:
      ValueError: in one line, before anything runs: no devices or one that does not
        exist, a batch of no rows, `wrt` naming no loss, fn returning something
        other than per-example losses, a batch loss that is not a scalar, a model
        call that assigns a variable the step would lose, a loss that reads none of
        its wrt list's variables, fn differentiating with respect to a variable
        itself (not its value).
    """
    # Autograph converts fn and the batch losses as it converts the caller's own code
    # (a Python `if` on a tensor works in them where it works there). The library's
    # own code is plain graph code, left unconverted: converting it was most of the
    # first call's seconds.
    return _tower_step(compat.autograph_context(), fn, batch, devices, wrt, main_device,
                       batch_losses)


@tf.autograph.experimental.do_not_convert
def _tower_step(autograph, fn, batch, devices, wrt, main_device, batch_losses):
    """tower_step's work, with fn and the batch losses converted as `autograph` (the
    caller's compat.autograph_context()) says."""
    mesh = devices_lib.mesh_of(devices_lib.device_list(devices), main_device=main_device)
    devices, main_device = mesh.stage(0), mesh.main_device
    wrt, batch_losses = _checked_wrt(wrt), _checked_batch_losses(batch_losses)
    fn = compat.converted_as(fn, autograph)
    batch_losses = {name: compat.converted_as(loss, autograph)
                    for name, loss in batch_losses.items()}
    split.check_not_empty(batch)
    shards, sizes, rows = split.shards_of(batch, len(devices))                      # 1
    batch_rows = tf.cast(rows, tf.float32)
    watched = {id(v) for variables in wrt.values() for v in variables}
    # A model's BatchNormalization(synchronized=True) layers meet over the towers.
    meeting = batch_statistics.Meeting([[device] for device in devices])
    meeting.start_step(sizes)
    shared_calls = tower_calls.SharedCalls(len(devices))  # tower(model, ...) traced once
    towers = [tower_handle.Tower(device, i, watched, persistent=len(wrt) > 1, meeting=meeting,
                                 shared_calls=shared_calls)
              for i, device in enumerate(devices)]
    required = set(wrt) - set(batch_losses)
    for i, (handle, shard) in enumerate(zip(towers, shards)):
        with tf.name_scope(f"tower_{i}"):
            handle.run(fn, shard, sizes[i], batch_rows, required)                   # 2, 3
    aux, whole = _whole_batch(batch_losses, towers, sizes, main_device, wrt)
    for i, handle in enumerate(towers):
        with tf.name_scope(f"tower_{i}"):
            handle.backward(wrt, {name: cotangents[i]
                                  for name, (_, cotangents, _) in whole.items()})    # 4
    route = exchange.route()
    grads = {}
    for name, variables in wrt.items():
        summed = route([handle.grads[name] for handle in towers], devices, main_device)  # 4, 5
        direct = whole[name][2] if name in whole else [None] * len(variables)
        with tf.device(main_device):
            grads[name] = [tower_handle.add_gradients(g, d) for g, d in zip(summed, direct)]
        _check_read(name, variables, grads[name])
    _assign_state(towers, sizes, main_device)
    with tf.device(main_device):
        rows = tf.convert_to_tensor(rows, tf.int32)
    return StepOutput(grads, _losses(towers, whole, main_device), aux, rows)


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
        copies = [tf.nest.map_structure(tf.identity, handle.aux) for handle in towers]
        aux = forward.concat_rows(copies)
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
        for name in towers[0].shares:
            losses[name] = tf.add_n([tf.identity(h.shares[name]) for h in towers])
        for name, (value, _, _) in whole.items():
            losses[name] = value if name not in losses else losses[name] + value
        return losses


def _assign_state(towers, sizes, main_device):
    """Step 5 for state: every variable a call changed, merged over the towers by its
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


def _check_read(name, variables, grads):
    """Refuses a wrt list none of whose variables loss `name` reads: every gradient
    None in the traced graph (a tower on no rows still traces its forward)."""
    if variables and all(g is None for g in grads):
        raise ValueError(
            f"loss {name!r} reads none of the {len(variables)} variables wrt[{name!r}] "
            "lists (every gradient is None); list the variables of the models fn runs "
            f"for {name!r} (e.g. model.trainable_variables).")


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


def _checked_scalar(name, value):
    value = tf.convert_to_tensor(value)
    if value.shape.rank != 0:
        raise ValueError(f"batch_losses[{name!r}] returned shape {tuple(value.shape)}; a loss "
                         "over the whole batch is a scalar.")
    return tf.cast(value, tf.float32)
