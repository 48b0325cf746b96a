"""Step 1 in the input pipeline: each tower's shard of the next batch waits on its device.

ShardIterator splits every global batch of a tf.data.Dataset on the host with
the step's own split (split.split_batch), and a multi-device iterator copies
shard i to tower i's device `buffer_size` batches ahead of the step. On a GPU
the host-to-device copy of the next batch so overlaps the running step, as
MirroredStrategy's per-replica prefetch and tf_cnn_benchmarks' staging areas
do. The step receives split.Shards and skips its own split.
"""

import functools

import tensorflow as tf

from towers import compat
from towers.data_parallel import split


class ShardIterator:
    """Iterates a tf.data.Dataset of global batches as split.Shards, shard i on devices[i].

    Args:
      dataset: a tf.data.Dataset of (x, y) or (x, y, sample_weight) batches,
        dim 0 = the global batch; the last batch may be short.
      devices: one device per tower (with pipeline stages, its first stage's).
      source_device: the host device the dataset runs on.
      buffer_size: batches each device holds ready ahead of the step (>= 1).
    """

    def __init__(self, dataset, devices, source_device="/device:CPU:0", buffer_size=1):
        if not isinstance(dataset, tf.data.Dataset):
            raise ValueError(f"ShardIterator needs a tf.data.Dataset, got "
                             f"{type(dataset).__name__}.")
        split.unpack_batch(dataset.element_spec)
        self.element_spec = dataset.element_spec  # a global batch's
        if isinstance(buffer_size, bool) or not isinstance(buffer_size, int) or buffer_size < 1:
            raise ValueError(f"buffer_size must be an integer >= 1, got {buffer_size!r}.")
        self.devices = list(devices)
        num_shards = len(self.devices)

        def to_shards(*batch):  # one element per tower, in tower order
            batch = split.as_batch(batch)
            return functools.reduce(tf.data.Dataset.concatenate, [
                tf.data.Dataset.from_tensors(shard)
                for shard in split.split_batch(batch, num_shards)])

        # Hands out elements round-robin: element i of each batch goes to devices[i].
        self.multi_device_iterator = compat.OwnedMultiDeviceIterator(
            dataset.flat_map(to_shards), self.devices, prefetch_buffer_size=buffer_size,
            source_device=source_device)

    def __iter__(self):
        return self

    def __next__(self):
        return split.Shards(tuple(shard) for shard in next(self.multi_device_iterator))


def get_next_as_optional(iterator, devices, or_empty=False):
    """In a tf.function: (has_value, get_value) for the next batch of `iterator`.

    `iterator`: a tf.data iterator, whose get_value() gives a batch of Tensors,
    or a ShardIterator's multi_device_iterator, whose get_value() gives
    split.Shards with shard i on devices[i].
    `or_empty`: once the data has ended, get_value() gives a batch of no rows of
    its structure (one empty shard on each device) instead of failing: a cluster
    worker's batches of the steps the other workers still have data for.
    """
    def or_no_rows(has_value, get_value):
        if not or_empty:
            return get_value()
        return tf.cond(has_value, get_value, lambda: split.empty_like(iterator.element_spec))

    if not isinstance(iterator, compat.OwnedMultiDeviceIterator):
        element = iterator.get_next_as_optional()
        return element.has_value(), lambda: or_no_rows(
            element.has_value(), lambda: split.as_batch(element.get_value()))
    optionals = iterator.get_next_as_optional()

    def shards():
        values = []
        for device, optional in zip(devices, optionals):
            with tf.device(device):
                values.append(or_no_rows(optional.has_value(),
                                         functools.partial(_value_here, optional)))
        return split.Shards(values)

    return optionals[0].has_value(), shards


def _value_here(optional):
    """An optional's value on the current device: get_value is only colocated with its
    iterator (an argument of the function, no device in the graph); the identity
    states the device."""
    return tuple(tf.nest.map_structure(tf.identity, optional.get_value()))


def no_batch_yet(iterator, devices):
    """In a tf.function: empty_batch(iterator, devices) whose dims are unknown as it is
    traced, so that a batch of the iterator's may take its place (a loop variable)."""
    return tf.nest.map_structure(
        lambda t: tf.compat.v1.placeholder_with_default(t, [None] * t.shape.rank),
        empty_batch(iterator, devices))


def empty_batch(iterator, devices):
    """A batch of no rows of the structure of `iterator` (a tf.data iterator, or a
    ShardIterator or its multi_device_iterator: then split.Shards, one empty shard on
    each of `devices`)."""
    if isinstance(iterator, ShardIterator):
        iterator = iterator.multi_device_iterator
    if not isinstance(iterator, compat.OwnedMultiDeviceIterator):
        return split.empty_like(iterator.element_spec)
    shards = []
    for device in devices:
        with tf.device(device):
            shards.append(split.empty_like(iterator.element_spec))
    return split.Shards(shards)


def resolved(prefetch_to_devices, input_devices):
    """prefetch_to_devices as a bool: "auto" is True where an input device is not a CPU."""
    if not (isinstance(prefetch_to_devices, bool) or prefetch_to_devices == "auto"):
        raise ValueError(f"prefetch_to_devices must be True, False or 'auto', got "
                         f"{prefetch_to_devices!r}.")
    if prefetch_to_devices != "auto":
        return prefetch_to_devices
    # Logical CPU devices share the host's memory: staging copies nothing there and
    # only adds host work (benchmarks/RESULTS.md, issue 12).
    return any(tf.DeviceSpec.from_string(d).device_type != "CPU" for d in input_devices)
