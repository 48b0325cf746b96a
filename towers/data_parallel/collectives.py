"""TensorFlow's collective ops, keyed so that every worker's and device's calls meet.

Collective ops find their peers by (group key, instance key): one group per set
of devices, one instance per collective op in a traced function. Across
workers both must come out the same on every worker. Group keys are derived
from the members.

TensorFlow keeps the shape and type each (group, instance key) first ran with
for the life of the process, so no two different ops of a process share a key:
each takes its keys from a range of its group, and ranges never overlap.
Outside any `instance_keys(name)` (eager calls, a user's own tf.function) keys
are counted per group from 1, which stays alike across workers only while every
worker traces and runs the same in order. Inside, the k-th op of a group takes
the next keys of (name, group)'s range above every counted key, picked by a
hash of (name, group), so what one worker traces elsewhere cannot shift it.
Where two names of one process hash to one range, the later takes the next free
range: alike on workers that first use their names in the same order, as
towers' steps do (each is traced when it first runs, on every worker in turn)."""

import collections
import contextlib
import zlib

import tensorflow as tf

SHAPE_KEYS = 64  # gathered tensors of up to 2**63 rows
_NAMED_KEYS = 1 << 30  # keys below are counted, keys from here on are named ranges'
_NAMED_RANGES = 1 << 12  # functions with collective ops per group and process
_KEYS_PER_NAME = (1 << 30) // _NAMED_RANGES  # the last range ends at int32's largest
_counted_ranges = {}  # group key -> its _KeyRange outside any instance_keys
_named_ranges = collections.defaultdict(dict)  # group key -> {repr(name): its range's index}
_key_scope = None  # inside instance_keys: (repr(name), group key -> its _KeyRange)
_ordering_tokens = {}  # device -> tf.Variable


def all_reduce_across_workers(tensors, cluster, device, merge_op="Add", timeout_s=0):
    """One CollectiveReduceV2 per tensor over the workers' `device`s; same result on each.

    timeout_s: 0 = wait for the others as long as it takes (a step relies on
    watchdog.Watchdog instead); else DeadlineExceededError after that long.
    """
    if cluster.num_workers == 1:
        return list(tensors)
    group_key = workers_group_key(device)
    with tf.device(device):
        return [tf.raw_ops.CollectiveReduceV2(
            input=tensor, group_size=cluster.num_workers, group_key=group_key,
            instance_key=instance_key(group_key),
            ordering_token=[ordering_token(device)], merge_op=merge_op, final_op="Id",
            timeout_seconds=float(timeout_s)) for tensor in tensors]


def reduce_scatter_across_workers(tensor, cluster, device):
    """This worker's part of the workers' sum of `tensor` (a vector of W parts of one
    size, W workers): its task_index-th part, summed over the workers.

    One CollectiveReduceScatterV2 on GPUs (NCCL's). TensorFlow has no reduce-scatter on
    CPUs ("did not find collective implementation"): there one CollectiveReduceV2 of the
    whole vector, of which each worker keeps its part: the same sums, W times the bytes.
    """
    if cluster.num_workers == 1:
        return tensor
    if tf.DeviceSpec.from_string(device).device_type != "GPU":
        [total] = all_reduce_across_workers([tensor], cluster, device)
        with tf.device(device):
            part = tf.shape(tensor)[0] // cluster.num_workers
            return total[cluster.task_index * part:(cluster.task_index + 1) * part]
    group_key = workers_group_key(device)
    with tf.device(device):
        return tf.raw_ops.CollectiveReduceScatterV2(
            input=tensor, group_size=cluster.num_workers, group_key=group_key,
            instance_key=instance_key(group_key), ordering_token=[ordering_token(device)],
            merge_op="Add", final_op="Id")


def all_gather_across_workers(tensors, shape_key, cluster, device):
    """One CollectiveGatherV2 per tensor: every worker's tensor, concatenated on dim 0.

    shape_key: an int32 scalar in [0, SHAPE_KEYS), the same on every worker,
    that changes whenever the tensors' shapes do.
    """
    group_key = workers_group_key(device)
    gathered = []
    with tf.device(device):
        for tensor in tensors:
            first_key = instance_key(group_key, SHAPE_KEYS)  # one per shape
            gathered.append(tf.raw_ops.CollectiveGatherV2(
                input=tensor, group_size=cluster.num_workers, group_key=group_key,
                instance_key=first_key + shape_key, ordering_token=[ordering_token(device)]))
    return gathered


@contextlib.contextmanager
def instance_keys(name):
    """The collective ops traced inside take instance keys of `name`'s own range.

    `name` names one traced function alike on every worker (TowerTrainer's
    step is ("train_step", the model's signature)); its k-th op of a group gets
    the same key on every worker, whatever else each worker traced before. Two
    traces under one name must make the same ops (shapes and types) in the same
    order: they take the same keys.
    """
    global _key_scope
    outer, _key_scope = _key_scope, (repr(name), {})
    try:
        yield
    finally:
        _key_scope = outer


def instance_key(group_key, slots=1):
    """The next instance key of `group_key`, with `slots` - 1 keys after it kept free."""
    if _key_scope is None:
        ranges = _counted_ranges
        if group_key not in ranges:
            ranges[group_key] = _KeyRange(1, _NAMED_KEYS)
    else:
        name, ranges = _key_scope
        if group_key not in ranges:
            ranges[group_key] = _named_range(name, group_key)
    return ranges[group_key].take(slots)


class _KeyRange:
    """The instance keys [start, stop) of one group, handed out in order."""

    def __init__(self, start, stop):
        self.start, self.next, self.stop = start, start, stop

    def take(self, slots):
        first = self.next
        if first + slots > self.stop:
            raise ValueError(
                f"the collective ops of one function on one group of devices need more than "
                f"{self.stop - self.start} instance keys; pack_gradients=True all-reduces "
                "the gradients in one buffer per dtype.")
        self.next = first + slots
        return first


def _named_range(name, group_key):
    """A fresh _KeyRange over the keys of (name, group): ranges of one group never overlap."""
    indices = _named_ranges[group_key]
    if name not in indices:
        if len(indices) == _NAMED_RANGES:
            raise ValueError(
                f"this process has traced {_NAMED_RANGES} functions with collective ops on one "
                "group of devices, each with its own instance keys, and has none left; start a "
                "new process for more trainers.")
        taken = set(indices.values())
        index = zlib.crc32(repr((name, group_key)).encode()) % _NAMED_RANGES
        while index in taken:
            index = (index + 1) % _NAMED_RANGES
        indices[name] = index
    start = _NAMED_KEYS + indices[name] * _KEYS_PER_NAME
    return _KeyRange(start, start + _KEYS_PER_NAME)


def workers_group_key(device):
    """The group of every worker's `device`."""
    # Not keyed by the addresses: workers that list them differently must still
    # meet, for cluster.check_same to tell them so.
    return group_key(("workers", tf.DeviceSpec.from_string(device).device_type))


def group_key(members):
    """A group key every process derives alike from the group's members."""
    return zlib.crc32(repr(members).encode()) & 0x3FFFFFFF


def ordering_token(device):
    """A resource handle on `device` that orders its collectives.

    tf.function runs stateful ops in program order; without a per-device token
    the N members of one all-reduce would wait for each other in that order and
    never meet. A token makes collectives ordered per device only (as
    MirroredStrategy's CollectiveReplicaLauncher does).
    """
    if device not in _ordering_tokens:
        with tf.init_scope(), tf.device(device):
            _ordering_tokens[device] = tf.Variable(0.0, trainable=False, name="ordering_token")
    return _ordering_tokens[device].handle
