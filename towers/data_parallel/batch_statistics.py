"""Where rows meet: BatchNormalization's statistics over the global batch (step 3).

One device normalises a batch by the mean and variance of all its rows; a tower
sees only its shard. With global statistics, each BatchNormalization layer's
moments meet across the towers inside the forward, as MirroredStrategy's
synchronized BatchNorm does:

    tower i:   sum_i = sum of its rows' x, count_i = its rows   (per channel)
    all:       mean  = (sum_0 + ... + sum_N-1) / (count_0 + ... + count_N-1)
    tower i:   dev_i = sum of its rows' (x - mean)**2
    all:       variance = (dev_0 + ... + dev_N-1) / count

Two all-reduces, as one device's tf.nn.moments takes two passes (a mean, then
the squared distances from it), so a channel whose mean is far from 0 keeps its
variance's digits. Each all-reduce's gradient is an all-reduce of the towers'
gradients (the towers' backwards meet there too), so every tower's backward
gets the gradient that one device's backward gives its rows. Each tower then
updates the moving statistics with the same global moments, and the step's
weighted mean of the towers' new values (aggregate.merge_state) is one device's.

The all-reduces are TensorFlow's collective ops, which meet at run time: the
towers are traced one after another as ever, and the n-th all-reduce each tower
traces takes the n-th instance key. A tower whose shard is empty skips the model
(forward.unless_empty): the group is the towers with rows (split gives those
first), its size known at run time, one group key per size.

Which layers meet: in TowerTrainer's step, every BatchNormalization with
batch_statistics="global", else those built synchronized=True (`on_tower`); in
tower_step's function, every synchronized=True layer of any model it runs
(`synchronized_on_tower`). A model tower_step's function calls directly runs on a
tower of no rows too, so there every tower meets, with nothing to add where empty.
"""

import collections
import contextlib

from absl import logging
import keras
import tensorflow as tf

from towers import compat, devices as devices_lib
from towers.data_parallel import collectives

PER_TOWER, GLOBAL = "per_tower", "global"
BATCH_STATISTICS = (PER_TOWER, GLOBAL)


def global_layers(model, batch_statistics):
    """The BatchNormalization layers of `model` whose statistics are the global batch's:
    every one with batch_statistics="global", else those built synchronized=True."""
    return [layer for layer in batch_norm_layers(model)
            if batch_statistics == GLOBAL or layer.synchronized]


def batch_norm_layers(model):
    """Every BatchNormalization layer inside `model`, nested ones too."""
    return [layer for layer in compat.nested_layers(model)
            if isinstance(layer, keras.layers.BatchNormalization)]


class Meeting:
    """The global BatchNormalization layers of one step and the all-reduces they meet by.

    Attributes:
      layers: the layers (global_layers), [] where none: nothing changes then.
      per_tower: the model's other BatchNormalization layers (each tower's statistics).
      tower_devices: per tower, its devices in one order alike for every tower (its
        stages', or its split layers' parts'): a layer run on tower i's j-th device
        meets the layers run on every tower's j-th.
    """

    def __init__(self, tower_devices, layers=(), per_tower=()):
        self.layers, self.per_tower = list(layers), list(per_tower)
        self.tower_devices = tower_devices
        self._warned = False
        self._traced = {}  # tower index -> Counter of the all-reduces it traced, by shape
        self._shard_sizes, self._graph, self._tokens = None, None, {}

    @classmethod
    def of_model(cls, model, batch_statistics, tower_devices):
        """The Meeting of `model`'s layers (global_layers) for a trainer's step."""
        layers = global_layers(model, batch_statistics)
        return cls(tower_devices, layers,
                   [layer for layer in batch_norm_layers(model) if layer not in layers])

    def check(self, micro_batches, jit_compile, cluster):
        """Raises ValueError, in one line, where the layers cannot meet as one device's:
        micro-batches (each would be normalised on its own), XLA (one computation per
        tower holds no collective), a cluster, or two towers on one device."""
        if not self.layers:
            return
        why = None
        if micro_batches > 1:
            why = (f"micro_batches={micro_batches} (or accum_steps) normalises each "
                   "micro-batch on its own; use micro_batches=1")
        elif jit_compile:
            why = "jit_compile=True compiles each tower alone, with no all-reduce inside"
        elif cluster is not None:
            why = "they do not meet across the workers of a cluster yet"
        self._refuse(self.layers, why or self._shared_device())

    def _shared_device(self):
        """Why the towers cannot meet where two share a device; None where none does."""
        for place in zip(*self.tower_devices):
            if len(set(place)) < len(place):
                return (f"towers share the device {sorted(place)[0]}, and an all-reduce needs "
                        "one device per tower")
        return None

    @staticmethod
    def _refuse(layers, why):
        if why:
            raise ValueError(
                f"global batch statistics for BatchNormalization "
                f"{[layer.name for layer in layers][:3]} cannot be computed here: {why}, or "
                "train with batch_statistics='per_tower' and layers built with "
                "synchronized=False (statistics per tower).")

    def warn_single_rows(self, micro_batch_rows):
        """Logs one warning, once, where a per-tower BatchNormalization would train on a
        micro-batch of one row: its variance is 0, so it outputs beta whatever the input.
        micro_batch_rows: the rows of each micro-batch of each tower (ints)."""
        if self.per_tower and not self._warned and 1 in micro_batch_rows:
            self._warned = True
            logging.warning(
                "BatchNormalization %s normalises each tower's rows by their own statistics, "
                "and a tower has a single row: its variance is 0 and the layer outputs its "
                "beta, whatever the input. Give every tower several rows, or train with "
                "batch_statistics='global' (one device's statistics).",
                [layer.name for layer in self.per_tower][:3])

    def start_step(self, shard_sizes):
        """A new step is traced, in the current graph: its towers' rows (int32 scalars or
        ints, larger first)."""
        self._shard_sizes, self._traced, self._tokens = shard_sizes, {}, {}
        self._graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()

    @contextlib.contextmanager
    def on_tower(self, tower_index):
        """While a tower's forward or backward is traced: each of the Meeting's layers
        takes its batch moments from the towers with rows (a tower without skips the
        model: forward.unless_empty), met by all-reduces."""
        moments = lambda layer, inputs, mask: self._moments(layer, tower_index, inputs, mask)
        with contextlib.ExitStack() as stack:
            for layer in self.layers:
                stack.enter_context(compat.batch_norm_moments(layer, moments))
            yield

    @contextlib.contextmanager
    def synchronized_on_tower(self, tower_index, skips_empty):
        """While a tower's own function is traced (tower_step's fn): every layer built
        BatchNormalization(synchronized=True), of any model, takes its batch moments
        from the towers, others their own rows'. skips_empty() says whether the call
        running now skips a tower of no rows (tower(...) does; a model called directly
        runs on them too, and then every tower meets)."""
        def moments(layer, inputs, mask, own_moments):
            if not layer.synchronized:
                return own_moments(inputs, mask)
            self._refuse([layer], self._shared_device())
            return self._moments(layer, tower_index, inputs, mask, every_tower=not skips_empty())

        with compat.every_batch_norm_moments(moments):
            yield

    def _moments(self, layer, tower_index, inputs, mask, every_tower=False):
        """(mean, variance) of `inputs` over every tower's rows, per channel (shape (C,)),
        as Keras's BatchNormalization computes them on one device (a mask: the masked
        entries left out, Keras's epsilon in the denominator). The all-reduces meet the
        towers with rows, or every tower (`every_tower`: each runs this, rows or none)."""
        axes = _reduction_axes(layer, inputs)
        weights = tf.ones_like(inputs) if mask is None else tf.cast(
            tf.broadcast_to(tf.expand_dims(mask, -1), tf.shape(inputs)), inputs.dtype)
        sums = tf.reduce_sum(inputs * weights, axes)
        counts = tf.reduce_sum(weights, axes)
        group = self._group(tower_index, sums.device, every_tower)
        total, count = tf.split(self._all_reduce(tf.concat([sums, counts], 0), group), 2)
        if mask is not None:
            count = count + keras.backend.epsilon()  # as Keras's masked moments
        mean = tf.math.divide_no_nan(total, count)
        deviations = tf.reduce_sum(tf.square(inputs - mean) * weights, axes)
        variance = tf.math.divide_no_nan(self._all_reduce(deviations, group), count)
        return mean, variance

    def _group(self, tower_index, device, every_tower):
        """(tower index, this tower's device, every tower's device at its place, whether
        every tower meets or only those with rows)."""
        device = devices_lib.canonical_name(device) if device else None
        own = self.tower_devices[tower_index]
        if device not in own:
            raise ValueError(
                f"a BatchNormalization layer runs on {device or 'no named device'}, not on "
                f"one of tower {tower_index}'s devices {own}; global batch statistics meet "
                "on the towers' own devices.")
        place = own.index(device)
        return (tower_index, device, [devices[place] for devices in self.tower_devices],
                every_tower)

    def _all_reduce(self, value, group):
        """The sum of `value` over the towers with rows, on this tower's device; its
        gradient is the towers' gradients summed alike."""
        tower_index, device, members, every_tower = group
        with_rows = len(members) if every_tower else tf.add_n(
            [tf.cast(tf.greater(size, 0), tf.int32) for size in self._shard_sizes])
        # The towers with rows are the first ones: one group per count.
        group_keys = tf.constant([collectives.group_key(("batch_statistics", tuple(members[:n])))
                                  for n in range(1, len(members) + 1)])
        forward_key = self._next_key(tower_index, members, value)

        def reduce(tensor, instance_key):
            with tf.device(device):
                return tf.raw_ops.CollectiveReduceV2(
                    input=tensor, group_size=with_rows,
                    group_key=tf.gather(group_keys, with_rows - 1), instance_key=instance_key,
                    ordering_token=[self._token(device)], merge_op="Add",
                    final_op="Id")

        @tf.custom_gradient
        def summed(tensor):
            def gradient(upstream):  # its key taken when traced: a backward may be traced twice
                return reduce(upstream, self._next_key(tower_index, members, upstream))
            return reduce(tensor, forward_key), gradient

        return summed(value)

    def _token(self, device):
        """`device`'s ordering token (collectives.ordering_token), read into the step's
        own graph once: a gradient traced inside a tf.cond's branch (an empty shard's)
        cannot capture the eager handle itself."""
        if self._graph is None:
            return collectives.ordering_token(device)
        if device not in self._tokens:
            with self._graph.as_default(), tf.control_dependencies(None), tf.device(device):
                self._tokens[device] = tf.identity(collectives.ordering_token(device))
        return self._tokens[device]

    def _next_key(self, tower_index, members, value):
        """The instance key of this tower's next all-reduce of a tensor like `value`: the
        n-th one of its shape a tower traces in a step takes the n-th key of the range
        named by the shape, whichever tower traces it first. TensorFlow holds a key to
        the shape it first ran with, for the life of the process: keyed by shape, another
        trainer's step (another model, recompute rerunning the forward in the backward)
        never meets a key of another shape."""
        like = (tuple(value.shape), value.dtype.name)
        traced = self._traced.setdefault(tower_index, collections.Counter())
        n, traced[like] = traced[like], traced[like] + 1
        with collectives.instance_keys(("batch_statistics", like)):
            return collectives.instance_key(
                collectives.group_key(("batch_statistics", tuple(members))), n + 1) + n


def _reduction_axes(layer, inputs):
    """Every axis of `inputs` but the layer's channel axis."""
    channel = layer.axis % inputs.shape.rank
    return [axis for axis in range(inputs.shape.rank) if axis != channel]
