"""Spread placement's slabs: a variable larger than a tower's share, held in blocks of rows.

Under variable_placement="spread" the towers hold the variables in turn, each tower filled
to 1/N of the bytes (columns.spread_owners); a variable that does not fit in the tower being
filled is held as slabs along dim 0, its rows filling that tower and the next (ZeRO's
partition of the state, by rows): each slab a keras.Variable on its tower, and the optimizer
updates the slabs, each with its own slots, where they live. The
model's variable keeps its place in its layer; it reads as its slabs' rows joined (`value`,
`numpy()`, a checkpoint, a save) and writes into them (`assign`), so nothing of it is held
twice (compat.hold_in_slabs).

In a step (engine/step.py), step 2 copies each slab to every tower and joins them
there (an all-gather); after a tower's backward its gradient of the variable is divided
into the slabs' rows (`slab_rows`), and steps 4-5 sum each slab's rows where the slab lives
(a reduce-scatter). An optimizer that updates every element on its own (Adam, SGD, ...) then
updates the slabs exactly as the whole variable; others are refused (check_slab_updates).
"""

import keras
import tensorflow as tf

from towers import compat

# Keras's optimizers whose update of an element reads only that element's gradient, slots
# and the step count: applied to slabs, each row is updated as in the whole variable. Not
# here: Adafactor (factored over rows and columns), Lamb (a per-variable trust ratio),
# Muon (orthogonalises a whole matrix).
ELEMENTWISE_OPTIMIZERS = (
    keras.optimizers.SGD, keras.optimizers.Adam, keras.optimizers.AdamW,
    keras.optimizers.Adamax, keras.optimizers.Nadam, keras.optimizers.RMSprop,
    keras.optimizers.Adagrad, keras.optimizers.Adadelta, keras.optimizers.Ftrl,
    keras.optimizers.Lion)


class Slabs:
    """A variable's rows held as slabs: what hold_in_slabs puts in the variable's place.

    Attributes:
      variables: the slabs, keras.Variables: slab t rows [sum(sizes[:t]),
        sum(sizes[:t + 1])) of the variable, on devices[t]; named and trainable as the
        variable, slab t's path the variable's + f"_slab_{t}/" + its name.
      sizes: rows per slab.
      devices: each slab's device.
    """

    def __init__(self, variable, devices, sizes):
        self.sizes, self.devices, self.dtype = list(sizes), list(devices), variable.dtype
        rows = tf.split(tf.convert_to_tensor(variable.value), self.sizes)
        self.variables, parent = [], variable.path.rpartition("/")[0]
        for t, (device, value) in enumerate(zip(self.devices, rows)):
            # Named as the variable (an optimizer's exclude_from_weight_decay matches
            # names), with a path of its own.
            with tf.init_scope(), tf.device(device), keras.name_scope(
                    f"{variable.name}_slab_{t}", override_parent=parent or None):
                self.variables.append(keras.Variable(value, dtype=variable.dtype,
                                                     trainable=variable.trainable,
                                                     name=variable.name))

    def read(self):
        """The variable's value: its slabs' rows joined (where the caller's scope puts it)."""
        return tf.concat([slab.value for slab in self.variables], 0)

    def assign(self, value):
        """Writes `value`, the whole variable's, into the slabs, each its rows on its device."""
        for slab, rows in zip(self.variables, tf.split(value, self.sizes)):
            with tf.device(slab.value.device):
                slab.assign(rows)
        return value


def can_hold(variable):
    """Whether `variable` can be held as slabs: a trainable keras.Variable of 2 rows or more."""
    return variable.trainable and len(variable.shape) >= 1 and variable.shape[0] >= 2 and \
        compat.can_hold_in_slabs(variable)


def is_held_on(variable, devices, sizes):
    """Whether `variable` is held as slabs of `sizes` rows on `devices` (hold's) already."""
    held = compat.held_slabs(variable)
    return held is not None and (held.devices, held.sizes) == (list(devices), list(sizes))


def hold(variable, devices, sizes, optimizer):
    """Holds `variable` as slabs, slab t `sizes[t]` rows on `devices[t]`, its value kept,
    unless it is so held already (is_held_on). Where `optimizer` (not built yet) was told
    to exclude the variable from weight decay, it excludes its slabs."""
    if is_held_on(variable, devices, sizes):
        return
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    excluded = compat.held_slabs(variable) is None and \
        compat.excluded_from_weight_decay(inner, variable)
    slabs = Slabs(variable, devices, sizes)
    compat.hold_in_slabs(variable, slabs)
    if excluded:
        compat.exclude_from_weight_decay_too(inner, slabs.variables)


def whole_variables(model, device=None):
    """Holds each slabbed variable of `model` (spread placement) as one tf.Variable
    again, its value kept, on `device` (default: its first slab's device).

    For plain Keras afterwards: keras.Model.compile + fit (and a Keras optimizer) read
    each variable as one resource. The TowerTrainer that held them so cannot step again
    (its optimizer's slots are the slabs'): it refuses in one line; make a new one.
    """
    for variable in model.variables:
        held = compat.held_slabs(variable)
        if held is not None:
            compat.move_variable(variable, device or held.devices[0])


def held_variables(variables):
    """`variables` (a model's trainable ones) as an optimizer updates them: each held as
    slabs replaced by its slabs."""
    slabs_of = [compat.held_slabs(variable) for variable in variables]
    return [held for variable, slabs in zip(variables, slabs_of)
            for held in (slabs.variables if slabs is not None else [variable])]


def slab_rows(gradient, sizes):
    """`gradient` of a variable held in slabs of `sizes` rows, as one per slab (where
    the caller's scope puts them): a Tensor's rows split, a tf.IndexedSlices' rows sorted
    into the slab holding them (indices made the slab's own), None into Nones."""
    if gradient is None:
        return [None] * len(sizes)
    if not isinstance(gradient, tf.IndexedSlices):
        return tf.split(gradient, sizes)
    pieces, start = [], 0
    indices = tf.cast(gradient.indices, tf.int64)
    for size in sizes:
        mine = (indices >= start) & (indices < start + size)
        dense_shape = tf.concat([[size], tf.cast(gradient.dense_shape[1:], tf.int64)], 0)
        pieces.append(tf.IndexedSlices(tf.boolean_mask(gradient.values, mine),
                                       tf.boolean_mask(indices, mine) - start, dense_shape))
        start += size
    return pieces


def check_slab_updates(optimizer, slabbed):
    """Raises ValueError, in one line, when `optimizer` cannot update the variables `slabbed`
    holds as slabs ([(variable, devices, sizes)]: hold's arguments) slab by slab as it
    would update them whole.

    Its update of an element must read only that element (ELEMENTWISE_OPTIMIZERS), it
    must not clip each variable's gradient by that variable's own norm (clipnorm), and
    it must not be built yet where a variable is not held so already (its slots would
    be the whole variable's).
    """
    if not slabbed:
        return
    variables = [variable for variable, _, _ in slabbed]
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    names = [v.path for v in variables][:3]
    why = None
    if not isinstance(inner, ELEMENTWISE_OPTIMIZERS):
        why = (f"{type(inner).__name__} does not update each element on its own, so its "
               "slab-by-slab update would differ from the whole variable's; use one of "
               f"{[o.__name__ for o in ELEMENTWISE_OPTIMIZERS]}")
    elif inner.clipnorm is not None:
        why = ("clipnorm clips each variable's gradient by its own norm, which a slab's "
               "rows do not have; use global_clipnorm or TowerTrainer(clip_global_norm=...)")
    elif optimizer.built and not all(is_held_on(*held) for held in slabbed):
        why = ("the optimizer is built already, with slots for the whole variables; give "
               "the TowerTrainer a fresh optimizer (it is built at the first step, beside "
               "each slab)")
    if why is not None:
        raise ValueError(
            f"variable_placement='spread' holds {names} (each larger than a tower's share of "
            f"the state) as one slab of rows per tower, but {why}.")
