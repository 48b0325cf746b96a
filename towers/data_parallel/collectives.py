"""TensorFlow's collective ops, keyed so that every worker's and device's calls meet.

Collective ops find their peers by (group key, instance key): one group per set
of devices, one instance per collective op in a traced function. Across
workers both must come out the same on every worker. Group keys are derived
from the members. Instance keys inside `instance_keys(name)` are derived from
(name, group, the op's place among the group's ops traced there), so what one
worker traces elsewhere cannot shift them; outside any (eager calls, a user's
own tf.function) they are counted per group in this process, which stays alike
across workers only while every worker traces and runs the same in order.
"""

import collections
import contextlib
import itertools
import zlib

import tensorflow as tf

_counted_keys = collections.defaultdict(lambda: itertools.count(1))
_key_scope = None  # (name, per group an itertools.count) inside instance_keys
_ordering_tokens = {}  # device -> tf.Variable
SHAPE_KEYS = 64  # gathered tensors of up to 2**63 rows
_SCOPED_KEYS = 1 << 30  # derived keys lie above every counted one


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
    """The collective ops traced inside take instance keys derived from `name`.

    `name` names one traced function alike on every worker (TowerTrainer's
    step is "train_step"); its k-th op of a group gets the same key on every
    worker, whatever else each worker traced before. Two traces under one name
    must make the same ops (shapes and types) in the same order.
    """
    global _key_scope
    outer, _key_scope = _key_scope, (name, collections.defaultdict(itertools.count))
    try:
        yield
    finally:
        _key_scope = outer


def instance_key(group_key, slots=1):
    """The next instance key of `group_key`, with `slots` - 1 keys after it kept free."""
    if _key_scope is None:
        first = next(_counted_keys[group_key])
        for _ in range(slots - 1):
            next(_counted_keys[group_key])
        return first
    name, places = _key_scope
    place = next(places[group_key])
    digest = zlib.crc32(repr((name, group_key, place)).encode()) & 0xFFFFFF
    return _SCOPED_KEYS | digest * SHAPE_KEYS  # SHAPE_KEYS slots for each


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
