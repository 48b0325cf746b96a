"""Step 2: every tower sees the same weights, as a copy on its own device.

`broadcast_weights` copies the main device's values to a tower each step
(variable_placement="main"), or each value from the tower that holds it
("spread": columns.spread_owners; a slab of a slabbed variable from each tower holding
one, joined on the tower: columns.join_slabs); `Replicas` keeps a variable per tower
instead, written from the main values before the towers read ("replicated").
"""

import tensorflow as tf


def broadcast_weights(values, tower, kept=None):
    """Step 2: copies `values` (the main device's variables or tensors) to `tower`.

    Every tower then reads an identical local copy; the copy is also what the
    tower's GradientTape differentiates with respect to. A value `kept` (per value,
    a bool) is passed on as it is, not copied: an embedding table the tower looks up
    where it lives, reading only its rows (op_parallel.tables).
    """
    kept = kept or [False] * len(values)
    with tf.device(tower):
        return [value if keep else tf.identity(value) for value, keep in zip(values, kept)]


VARIABLE_PLACEMENTS = ("main", "replicated", "spread")


class Replicas:
    """A copy of every model variable on every tower (variable_placement="replicated").

    At the start of each step every tower's copy is written from the model's
    (main) values, and the tower reads its weights from it. Writing before the
    towers read, not after the update, moves the same bytes per step, and a
    change made outside the step (set_weights, a restored checkpoint, a
    callback) can never leave a tower training on stale weights.
    """

    def __init__(self, model, devices):
        self._variables = model.trainable_variables + model.non_trainable_variables
        self._num_trainable = len(model.trainable_variables)
        self._copies, self._devices = [], list(devices)
        for i, device in enumerate(devices):
            with tf.device(device):
                self._copies.append([tf.Variable(v.value, trainable=False,
                                                 name=f"tower_{i}_replica")
                                     for v in self._variables])

    def read(self, tower_index):
        """Step 2, replicated: (weights, state) of tower `tower_index`, its copies first
        written from the model's values, then read on it."""
        values = []
        # On the tower: read_value's Identity would otherwise go where the placer puts
        # an op without a device (device 0), and the copy with it.
        with tf.device(self._devices[tower_index]):
            for copy, variable in zip(self._copies[tower_index], self._variables):
                copy.assign(variable.value)  # ordered before the read: the same resource
                values.append(copy.read_value())
        return values[:self._num_trainable], values[self._num_trainable:]
