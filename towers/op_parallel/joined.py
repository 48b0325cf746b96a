"""A split model's checkpoints in the unsplit layout, so they move between part counts.

Checkpointer saves a split model through its twin: join_layers' model, and an
optimizer like the trainer's built on it. Before a save the parts' weights and
optimizer slots are joined into the twin's; after a restore they are cut from
the twin's. The files are what training the unsplit model writes, so they
restore with any number of parts, with none, and into join_layers' model.
"""

import tensorflow as tf

from towers.op_parallel import plan


class JoinedTwin:
    """The unsplit twin of a split model and of its optimizer, on the host.

    Attributes:
      model: join_layers(parted): the original layer types, full weights.
      optimizer: an optimizer of the same class and config, built on model.
    """

    def __init__(self, parted, optimizer):
        self._parted, self._optimizer = parted, optimizer
        with tf.device("/device:CPU:0"):
            self.model = plan.join_layers(parted)
            self.optimizer = optimizer.__class__.from_config(optimizer.get_config())
            self.optimizer.build(self.model.trainable_variables)

    def join(self):
        """The twin takes the split model's weights and optimizer state (before a save)."""
        self._copy(to_twin=True)

    def split(self):
        """The split model takes the twin's weights and optimizer state (after a restore)."""
        if not self._optimizer.built:
            self._optimizer.build(self._parted.trainable_variables)
        self._copy(to_twin=False)

    def _copy(self, to_twin):
        parted_slots, twin_slots = _by_name(self._optimizer), _by_name(self.optimizer)
        # join_layers keeps each top-level layer's place (a subclassed model's rebuilt
        # layers may have new names).
        for twin_layer, parted in zip(self.model.layers, self._parted.layers):
            if not twin_layer.weights:
                continue
            for kind in [None] + _slot_kinds(twin_layer, twin_slots):
                def variable(weight, slots, kind=kind):
                    """The weight, or its slot of `kind` (None for a weight without slots)."""
                    return weight if kind is None else slots.get(_slot_prefix(weight) + kind)

                twins = [variable(weight, twin_slots) for weight in twin_layer.weights]
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
