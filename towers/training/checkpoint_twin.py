"""Checkpoints in the whole layout, so they move between part counts, tower counts and
placements.

A split model's weights are its parts' (op_parallel), and with spread placement a large
variable's optimizer slots are its slabs' (placement/slabs.py). Checkpointer saves
such a model through its twin, which holds them whole, on the host: for a split model
join_layers' model, and an optimizer like the trainer's built on it; for a model with
slabs only, the model itself (its variables save whole) and an optimizer like the
trainer's with whole slots. Before a save the weights and optimizer slots are joined into
the twin's; after a restore they are taken back from the twin's. The files are what training
the unsplit model on one device writes, so they restore with any number of parts or
towers, with none, with any placement, and into join_layers' model.
"""

import contextlib

import keras
import numpy as np
import tensorflow as tf

from towers import compat
from towers.op_parallel import plan
from towers.placement import slabs


def needs_twin(model):
    """Whether `model` holds weights or slots other than whole: split layers, or variables
    held as slabs."""
    return plan.is_split(model) or any(compat.held_slabs(v) is not None for v in model.variables)


class WholeTwin:
    """The whole twin of a model (needs_twin) and of its optimizer, on the host.

    Attributes:
      model: join_layers(model) for a split model, else the model itself.
      optimizer: an optimizer of the same class and config, built on the model's whole
        trainable variables (their stand-ins on the host, where the model is itself:
        checkpoint names are its own).
    """

    def __init__(self, model, optimizer):
        self._parted, self._optimizer = model, optimizer
        with tf.device("/device:CPU:0"):
            self.model = plan.join_layers(model) if plan.is_split(model) else model
            self.optimizer = optimizer.__class__.from_config(optimizer.get_config())
            if self.model is not model:
                self.optimizer.build(self.model.trainable_variables)
                return
            # The model's own variables live on their devices, and some read as their
            # slabs joined: the slots are made beside stand-ins on the host, and the
            # checkpoint then names the model's variables where it names the stand-ins.
            stand_ins = [_stand_in(v) for v in model.trainable_variables]
        self.optimizer.build(stand_ins)
        compat.track_as_optimized(self.optimizer, model.trainable_variables)

    @contextlib.contextmanager
    def tracked(self):
        """While inside, a model that is its own twin and tracks the optimizer (fit sets
        model.optimizer, as compile() does) tracks the twin's instead, so a checkpoint
        holds only the whole slots."""
        swapped = self.model is self._parted and getattr(self.model, "optimizer", None) \
            is self._optimizer
        if swapped:
            self.model.optimizer = self.optimizer
        try:
            yield
        finally:
            if swapped:
                self.model.optimizer = self._optimizer

    def join(self):
        """The twin takes the model's weights and optimizer state (before a save)."""
        self._copy(to_twin=True)

    def split(self):
        """The model takes the twin's weights and optimizer state (after a restore)."""
        if not self._optimizer.built:
            self._optimizer.build(slabs.held_variables(self._parted.trainable_variables))
        self._copy(to_twin=False)

    def _copy(self, to_twin):
        parted_slots, twin_slots = _by_name(self._optimizer), _by_name(self.optimizer)
        # join_layers keeps each top-level layer's place (a subclassed model's rebuilt
        # layers may have new names).
        for twin_layer, parted in zip(self.model.layers, self._parted.layers):
            if not twin_layer.weights:
                continue
            kinds = _slot_kinds(twin_layer, twin_slots)
            for kind in ([None] if self.model is not self._parted else []) + kinds:
                def variable(weight, slots, kind=kind):
                    """The weight, or its slot of `kind` (None for a weight without slots)."""
                    return weight if kind is None else _slot(weight, slots, kind)

                # The twin's slots are whole, under the weight's own name.
                twins = [weight if kind is None else twin_slots.get(_slot_prefix(weight) + kind)
                         for weight in twin_layer.weights]
                if to_twin:
                    values = plan.joined_values(parted, lambda w: _numpy(variable(w, parted_slots)))
                    for twin, value in zip(twins, values):
                        _assign(twin, value)
                else:
                    plan.write_split(parted, [_numpy(twin) for twin in twins],
                                     lambda w, value: _assign(variable(w, parted_slots), value))
        # What belongs to no weight (the step count, a loss scale): the twin's optimizer
        # is of the same class and config, so it holds them in the same order.
        for parted_own, twin in zip(_own_variables(self._optimizer, self._parted),
                                    _own_variables(self.optimizer, self.model)):
            source, target = (parted_own, twin) if to_twin else (twin, parted_own)
            target.assign(source)


def _stand_in(variable):
    """A host variable of `variable`'s shape, dtype and path: its slots are named as its."""
    with contextlib.ExitStack() as scopes:
        for name in variable.path.split("/")[:-1]:
            scopes.enter_context(keras.name_scope(name))
        return keras.Variable(tf.zeros(variable.shape, variable.dtype), name=variable.name)


def _slot(weight, slots, kind):
    """`weight`'s optimizer slot of `kind` in `slots` (by name), None if it has none; for a
    weight held as slabs, its slabs' slots as one (_SlabSlots)."""
    held = compat.held_slabs(weight)
    if held is None:
        return slots.get(_slot_prefix(weight) + kind)
    parts = [slots.get(_slot_prefix(slab) + kind) for slab in held.variables]
    return None if any(part is None for part in parts) else _SlabSlots(parts)


class _SlabSlots:
    """A slabbed weight's slots of one kind, read and written as the weight's whole slot."""

    def __init__(self, slots):
        self._slots = slots

    def numpy(self):
        return np.concatenate([slot.numpy() for slot in self._slots])

    def assign(self, value):
        ends = np.cumsum([slot.shape[0] for slot in self._slots])[:-1]
        for slot, rows in zip(self._slots, np.split(value, ends)):
            slot.assign(rows)


def _numpy(variable):
    return None if variable is None else variable.numpy()


def _assign(variable, value):
    if variable is not None:
        variable.assign(value)


def _slot_prefix(weight):
    """How Keras names the optimizer slots of `weight`: its path, '/' as '_', then '_'."""
    return weight.path.replace("/", "_") + "_"


def _by_name(optimizer):
    return {variable.name: variable for variable in optimizer.variables}


def _slot_kinds(layer, slots):
    """The kinds of slot ("momentum", "velocity", ...) the optimizer keeps per weight."""
    prefix = _slot_prefix(layer.trainable_weights[0]) if layer.trainable_weights else None
    return [] if prefix is None else [name[len(prefix):] for name in slots
                                       if name.startswith(prefix)]


def _own_variables(optimizer, model):
    """The optimizer's variables that are no weight's slot, in its order."""
    prefixes = tuple(_slot_prefix(weight) for weight in model.trainable_weights)
    return [variable for variable in optimizer.variables
            if not variable.name.startswith(prefixes)]
