"""Steps 5 and 6: the routes by which the towers' gradients meet.

Each tower's gradients are of its part of the batch's loss (tower.run_tower),
so steps 5-6 add them up. All routes give the same sum on the main device;
they differ in which device adds what, and so in how many bytes cross
between devices:

- "main": every tower sends its gradients to the main device, which adds them
  (aggregate.gather_gradients + aggregate.sum_gradients).
- "tree": towers add pairwise, log2(N) rounds, each sum on the first device
  of its pair; the total ends on tower 0 and is copied to the main device.
- "collective": TensorFlow's collective all-reduce (CollectiveReduceV2, the op
  MultiWorkerMirroredStrategy uses) sums on every tower at once; tower 0's
  result is copied to the main device. Works on CPU and GPU.
- "nccl": the same collective op told to use NCCL; GPUs only.

`pack=True` first concatenates each tower's dense gradients into one flat
buffer, exchanges that, and splits it again: one large transfer instead of
one per variable (Horovod's tensor fusion, tf_cnn_benchmarks' repacking).
Sparse gradients (tf.IndexedSlices) travel the "main" route in every mode:
an all-reduce needs equal shapes on every tower, and rows looked up differ.

Across workers (mean_across_workers, step 6 of a cluster) the dense values
are all-reduced packed, and sparse gradients are all-gathered.
"""

import collections
import contextlib
import itertools
import zlib

import tensorflow as tf

from towers import aggregate

AGGREGATIONS = ("main", "tree", "collective", "nccl")

# Collective ops find their peers by (group key, instance key): one group per
# set of devices, one instance per collective op in a traced function. Across
# workers both must come out the same on every worker. Group keys are derived
# from the members. Instance keys inside `instance_keys(name)` are derived from
# (name, group, the op's place among the group's ops traced there), so what one
# worker traces elsewhere cannot shift them; outside any (eager calls, a user's
# own tf.function) they are counted per group in this process, which stays alike
# across workers only while every worker traces and runs the same in order.
_counted_keys = collections.defaultdict(lambda: itertools.count(1))
_key_scope = None  # (name, per group an itertools.count) inside instance_keys
_ordering_tokens = {}  # device -> tf.Variable
_SHAPE_KEYS = 64  # gathered tensors of up to 2**63 rows
_SCOPED_KEYS = 1 << 30  # derived keys lie above every counted one


def sum_gradients(tower_grads, devices, main_device, aggregation="main", pack=False):
    """Steps 5-6 by `aggregation`: the sum of the towers' gradients, on main_device.

    Each tower's gradients are of its part of the batch's loss, so the sum is
    the batch's mean gradient.

    Args:
      tower_grads: one list of gradients per tower, on that tower.
      devices: the tower devices, in the order of tower_grads.
      main_device: where the result goes.
      aggregation: one of AGGREGATIONS.
      pack: exchange dense gradients as one flat buffer per tower.

    Returns:
      one gradient per variable on main_device (None where no tower has one).
    """
    if aggregation == "main" and not pack:
        with tf.name_scope("gather"):
            tower_grads = aggregate.gather_gradients(tower_grads, main_device)         # 5
        with tf.name_scope("reduce"):
            return aggregate.sum_gradients(tower_grads, main_device)                   # 6
    with tf.name_scope("reduce"):
        sparse = [any(isinstance(g[v], tf.IndexedSlices) for g in tower_grads)
                  for v in range(len(tower_grads[0]))]
        dense_grads = [[None if s else g for g, s in zip(grads, sparse)] for grads in tower_grads]
        sparse_grads = [[g if s else None for g, s in zip(grads, sparse)] for grads in tower_grads]
        if pack:
            dense_grads, unpack = _pack(dense_grads, devices)
        if aggregation == "main":
            summed = aggregate.sum_gradients(
                aggregate.gather_gradients(dense_grads, main_device), main_device)     # 5, 6
        elif aggregation == "tree":
            summed = _tree_sum(dense_grads, devices)                                   # 5, 6
        else:
            summed = _all_reduce_sum(dense_grads, devices, aggregation)                # 5, 6
        with tf.device(main_device):
            dense_sum = [None if g is None else tf.identity(g) for g in summed]
            if pack:
                dense_sum = unpack(dense_sum)
            sparse_sum = aggregate.sum_gradients(
                aggregate.gather_gradients(sparse_grads, main_device), main_device)
        return [s if d is None else d for d, s in zip(dense_sum, sparse_sum)]


def check_aggregation(aggregation, devices):
    """Raises ValueError if `aggregation` is unknown or cannot run on `devices`."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}.")
    if aggregation == "nccl" and not all(":GPU:" in d for d in devices):
        raise ValueError(
            f"aggregation='nccl' needs every tower on a GPU, but devices are {devices}; use "
            "'collective' (CPU and GPU), 'tree' or 'main'.")
    if aggregation in ("collective", "nccl") and len(set(devices)) != len(devices):
        raise ValueError(
            f"aggregation={aggregation!r} needs distinct tower devices, got {devices}; an "
            "all-reduce has one member per device. Use 'main' or 'tree'.")


def _scale(value, weight):
    # multiply_no_nan: a worker of weight 0 (no examples) adds exactly 0, even over NaN.
    return tf.math.multiply_no_nan(value, tf.cast(weight, value.dtype))


def _tree_sum(tower_grads, devices):
    """Pairwise sums, log2(N) rounds; the total lands on devices[0]."""
    level = list(zip(devices, tower_grads))
    while len(level) > 1:
        paired = []
        for first, second in itertools.zip_longest(level[::2], level[1::2]):
            if second is None:
                paired.append(first)
                continue
            with tf.device(first[0]):
                paired.append((first[0], [_add(a, b) for a, b in zip(first[1], second[1])]))
        level = paired
    return level[0][1]


def _add(a, b):
    if a is None or b is None:
        return b if a is None else a
    return a + b


def _all_reduce_sum(tower_grads, devices, aggregation):
    """CollectiveReduceV2 sums on every tower; returns tower 0's sums."""
    # This worker's task is part of the key: other workers have devices of the same names.
    group_key = _group_key((tf.config.list_logical_devices()[0].name, tuple(devices)))
    hint = "nccl" if aggregation == "nccl" else "auto"
    summed = []
    for per_tower in zip(*tower_grads):
        if all(g is None for g in per_tower):
            summed.append(None)
            continue
        template = next(g for g in per_tower if g is not None)
        instance_key = _instance_key(group_key)
        results = []
        for device, grad in zip(devices, per_tower):
            with tf.device(device):
                results.append(tf.raw_ops.CollectiveReduceV2(
                    input=tf.zeros_like(template) if grad is None else grad,
                    group_size=len(devices), group_key=group_key, instance_key=instance_key,
                    ordering_token=[_ordering_token(device)], merge_op="Add", final_op="Id",
                    communication_hint=hint))
        summed.append(results[0])
    return summed


def mean_across_workers(values, weight, cluster, device):
    """Step 6 across workers: per value, sum_w weight_w * value_w / sum_w weight_w.

    Every worker calls it with its own values (gradients averaged over its
    towers, its loss, its state) and weight (its example count, so the result
    is the mean over the global batch); every worker gets the same result.
    Integer values (counters, seed states) are the chief's. Dense values
    travel packed in one buffer per dtype, one all-reduce each. A
    tf.IndexedSlices stays one: the workers' rows are gathered, in worker
    order, as one device would have them for the whole batch.

    Args:
      values: Tensors, tf.IndexedSlices or None, on `device`.
      weight: this worker's weight, a number or scalar Tensor (0: adds nothing).
      cluster: a towers.cluster.Cluster.
      device: this worker's main device; the same device type on every worker.

    Returns:
      (means, total): one Tensor, tf.IndexedSlices or None per value, and
      sum_w weight_w as a float32 scalar, on `device`.
    """
    if cluster.num_workers == 1 or all(v is None for v in values):
        return list(values), tf.cast(weight, tf.float32)
    with tf.device(device), tf.name_scope("across_workers"):
        weight = tf.cast(weight, tf.float32)
        sparse = [isinstance(v, tf.IndexedSlices) for v in values]
        scaled = [None if v is None or s else
                  _scale(v, weight) if v.dtype.is_floating else
                  v * tf.constant(int(cluster.is_chief), v.dtype)
                  for v, s in zip(values, sparse)]
        summed = sum_across_workers(scaled + [weight], cluster, device)
        total = summed.pop()
        for i, v in enumerate(values):
            if sparse[i]:
                summed[i] = _gather_slices(
                    tf.IndexedSlices(_scale(v.values, weight), v.indices, v.dense_shape),
                    cluster, device)
        return [_divide(s, total) if s is not None and s.dtype.is_floating else s
                for s in summed], total


def sum_across_workers(values, cluster, device):
    """Per value (Tensor or None), its sum over workers: one all-reduce per dtype, packed."""
    [buffers], unpack = _pack([values], [device])
    return unpack(all_reduce_across_workers(buffers, cluster, device))


def all_reduce_across_workers(tensors, cluster, device, merge_op="Add", timeout_s=0):
    """One CollectiveReduceV2 per tensor over the workers' `device`s; same result on each.

    timeout_s: 0 = wait for the others as long as it takes (a step relies on
    cluster.Watchdog instead); else DeadlineExceededError after that long.
    """
    if cluster.num_workers == 1:
        return list(tensors)
    group_key = _workers_group_key(device)
    with tf.device(device):
        return [tf.raw_ops.CollectiveReduceV2(
            input=tensor, group_size=cluster.num_workers, group_key=group_key,
            instance_key=_instance_key(group_key),
            ordering_token=[_ordering_token(device)], merge_op=merge_op, final_op="Id",
            timeout_seconds=float(timeout_s)) for tensor in tensors]


def _gather_slices(slices, cluster, device):
    """Every worker's rows of a tf.IndexedSlices, concatenated in worker order.

    CollectiveGatherV2 needs equal shapes on every worker, and an instance
    key keeps the shape it first ran with. So each worker pads its rows to
    the longest worker's rounded up to a power of two, that power picks the
    instance key, and the padding is dropped after the gather.
    """
    rows = tf.shape(slices.indices, out_type=tf.int64)[0]
    [sizes] = all_reduce_across_workers(
        [tf.one_hot(cluster.task_index, cluster.num_workers, dtype=tf.int64) * rows],
        cluster, device)
    longest = tf.cast(tf.maximum(tf.reduce_max(sizes), 1), tf.float64)
    power = tf.math.ceil(tf.math.log(longest) / tf.math.log(tf.constant(2.0, tf.float64)))
    padded = tf.cast(2.0 ** power, tf.int64)
    values_padding = [[0, padded - rows]] + [[0, 0]] * (slices.values.shape.rank - 1)
    indices, values = _all_gather_across_workers(
        [tf.pad(slices.indices, [[0, padded - rows]]), tf.pad(slices.values, values_padding)],
        tf.cast(power, tf.int32), cluster, device)
    real = tf.reshape(tf.sequence_mask(sizes, padded), [-1])
    return tf.IndexedSlices(tf.boolean_mask(values, real), tf.boolean_mask(indices, real),
                            slices.dense_shape)


def _all_gather_across_workers(tensors, shape_key, cluster, device):
    """One CollectiveGatherV2 per tensor: every worker's tensor, concatenated on dim 0.

    shape_key: an int32 scalar in [0, _SHAPE_KEYS), the same on every worker,
    that changes whenever the tensors' shapes do.
    """
    group_key = _workers_group_key(device)
    gathered = []
    with tf.device(device):
        for tensor in tensors:
            first_key = _instance_key(group_key, _SHAPE_KEYS)  # one per shape
            gathered.append(tf.raw_ops.CollectiveGatherV2(
                input=tensor, group_size=cluster.num_workers, group_key=group_key,
                instance_key=first_key + shape_key, ordering_token=[_ordering_token(device)]))
    return gathered


def _divide(value, total):
    if isinstance(value, tf.IndexedSlices):
        return tf.IndexedSlices(_divide(value.values, total), value.indices, value.dense_shape)
    return tf.math.divide_no_nan(value, tf.cast(total, value.dtype))


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


def _instance_key(group_key, slots=1):
    """The next instance key of `group_key`, with `slots` - 1 keys after it kept free."""
    if _key_scope is None:
        first = next(_counted_keys[group_key])
        for _ in range(slots - 1):
            next(_counted_keys[group_key])
        return first
    name, places = _key_scope
    place = next(places[group_key])
    digest = zlib.crc32(repr((name, group_key, place)).encode()) & 0xFFFFFF
    return _SCOPED_KEYS | digest * _SHAPE_KEYS  # _SHAPE_KEYS slots for each


def _workers_group_key(device):
    """The group of every worker's `device`."""
    # Not keyed by the addresses: workers that list them differently must still
    # meet, for cluster.check_same to tell them so.
    return _group_key(("workers", tf.DeviceSpec.from_string(device).device_type))


def _group_key(members):
    """A group key every process derives alike from the group's members."""
    return zlib.crc32(repr(members).encode()) & 0x3FFFFFFF


def _ordering_token(device):
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


def _pack(tower_grads, devices):
    """Each tower's dense gradients as one flat buffer per dtype; returns (packed, unpack)."""
    template = [next((g for g in grads if g is not None), None) for grads in zip(*tower_grads)]
    groups = {}
    for i, grad in enumerate(template):
        if grad is not None:
            groups.setdefault(grad.dtype, []).append(i)
    packed = []
    for device, grads in zip(devices, tower_grads):
        with tf.device(device):
            flat = [None if t is None else tf.reshape(
                tf.zeros(t.shape, t.dtype) if g is None else g, [-1])
                for g, t in zip(grads, template)]
            packed.append([tf.concat([flat[i] for i in members], 0)
                           for members in groups.values()])

    def unpack(buffers):
        flat = [None] * len(template)
        for buffer, members in zip(buffers, groups.values()):
            pieces = tf.split(buffer, [template[i].shape.num_elements() for i in members])
            for i, piece in zip(members, pieces):
                flat[i] = tf.reshape(piece, template[i].shape)
        return flat

    return packed, unpack
