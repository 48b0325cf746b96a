"""Steps 4 and 5: the routes by which the towers' gradients meet.

Each tower's gradients are of its share of the batch's loss (flight.Flight),
so steps 4-5 add them up. All routes give the same sum on the main device;
they differ in which device adds what, and so in how many bytes cross
between devices:

- "main": every tower sends its gradients to the main device, which adds them
  (aggregate.gather + aggregate.sum_gradients).
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

`route` picks one, once. Across workers
(mean_across_workers, step 5 of a cluster) the dense values are all-reduced
packed, and sparse gradients are all-gathered (collectives.py keys the ops).
"""

import functools
import itertools

import tensorflow as tf

from towers.data_parallel import aggregate, collectives

AGGREGATIONS = ("main", "tree", "collective", "nccl")


def route(aggregation="main", pack=False):
    """Steps 4-5 by `aggregation`, chosen once (StepSetup holds it):
    fn(tower_grads, devices, main_device) -> one sum per variable on main_device.

    tower_grads holds one list of gradients per tower, on that tower's device of
    `devices`; the sum is None where no tower has a gradient. Each tower's
    gradients are of its share of the batch's loss, so the sum is the batch's
    mean gradient. pack: exchange dense gradients as one flat buffer per tower.
    """
    if aggregation == "main" and not pack:
        return _gather_and_sum
    sum_dense = {"main": _gather_and_sum, "tree": _tree_sum,
                 "collective": functools.partial(_all_reduce_sum, hint="auto"),
                 "nccl": functools.partial(_all_reduce_sum, hint="nccl")}[aggregation]
    return functools.partial(_sum_dense_by, sum_dense, pack)


def _gather_and_sum(tower_grads, devices, main_device):
    """The "main" route: every tower's gradients copied to the main device and added."""
    del devices  # each gradient already names its own
    if not tower_grads[0]:
        return []  # a stage without trainable variables
    with tf.name_scope("gather"):
        tower_grads = aggregate.gather(tower_grads, main_device)                       # 4
    with tf.name_scope("reduce"):
        return aggregate.sum_gradients(tower_grads, main_device)                       # 5


def _sum_dense_by(sum_dense, pack, tower_grads, devices, main_device):
    """The dense gradients summed by `sum_dense` (packed first if `pack`); the sparse
    ones (tf.IndexedSlices: rows differ per tower, no all-reduce fits) by "main"."""
    if not tower_grads[0]:
        return []
    with tf.name_scope("reduce"):
        sparse = [any(isinstance(g[v], tf.IndexedSlices) for g in tower_grads)
                  for v in range(len(tower_grads[0]))]
        dense_grads = [[None if s else g for g, s in zip(grads, sparse)] for grads in tower_grads]
        sparse_grads = [[g if s else None for g, s in zip(grads, sparse)] for grads in tower_grads]
        if pack:
            dense_grads, unpack = _pack(dense_grads, devices)
        summed = sum_dense(dense_grads, devices, main_device)                          # 4, 5
        with tf.device(main_device):
            dense_sum = [None if g is None else tf.identity(g) for g in summed]
            if pack:
                dense_sum = unpack(dense_sum)
        sparse_sum = _gather_and_sum(sparse_grads, devices, main_device)
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


def _tree_sum(tower_grads, devices, main_device):
    """Pairwise sums, log2(N) rounds; the total lands on devices[0]."""
    del main_device  # the caller copies the total there
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


def _all_reduce_sum(tower_grads, devices, main_device, hint):
    """CollectiveReduceV2 sums on every tower; returns tower 0's sums."""
    if len(set(devices)) < len(devices):
        # Towers that all ran a split layer's part on its one device: nothing to
        # exchange between devices, and an all-reduce has one member per device.
        return _gather_and_sum(tower_grads, devices, main_device)
    del main_device  # the caller copies tower 0's sums there
    # This worker's task is part of the key: other workers have devices of the same names.
    group_key = collectives.group_key((tf.config.list_logical_devices()[0].name, tuple(devices)))
    summed = []
    for per_tower in zip(*tower_grads):
        if all(g is None for g in per_tower):
            summed.append(None)
            continue
        template = next(g for g in per_tower if g is not None)
        instance_key = collectives.instance_key(group_key)
        results = []
        for device, grad in zip(devices, per_tower):
            with tf.device(device):
                results.append(tf.raw_ops.CollectiveReduceV2(
                    input=tf.zeros_like(template) if grad is None else grad,
                    group_size=len(devices), group_key=group_key, instance_key=instance_key,
                    ordering_token=[collectives.ordering_token(device)], merge_op="Add",
                    final_op="Id",
                    communication_hint=hint))
        summed.append(results[0])
    return summed


def mean_across_workers(values, weight, cluster, device):
    """Step 5 across workers: per value, sum_w weight_w * value_w / sum_w weight_w.

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
      cluster: a towers.Cluster.
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
                  aggregate.scale(v, weight) if v.dtype.is_floating else
                  v * tf.constant(int(cluster.is_chief), v.dtype)
                  for v, s in zip(values, sparse)]
        summed = sum_across_workers(scaled + [weight], cluster, device)
        total = summed.pop()
        for i, v in enumerate(values):
            if sparse[i]:
                summed[i] = _gather_slices(
                    aggregate.scale(v, weight),
                    cluster, device)
        return [_divide(s, total) if s is not None and s.dtype.is_floating else s
                for s in summed], total


def across_workers(result, cluster, main_device, state_rules, old_state):
    """Step 5 across workers: this worker's step.TowerResult -> the global batch's.

    Gradients, loss and loss terms are averaged weighted by each worker's example
    count; each state value merges by its rule (aggregate.state_rules): "mean"
    weighted by examples, "sum" adds every worker's change to `old_state`,
    "first" is the chief's (an integer rides with the means: mean_across_workers
    gives the chief's). y_pred stays this worker's own rows.
    """
    num_grads, num_terms = len(result.grads), len(result.term_losses)
    by_rule = {rule: [value if r == rule else None for value, r in zip(result.state, state_rules)]
               for rule in aggregate.STATE_RULES}
    chiefs = [None if v is None or v.dtype.is_floating else v for v in by_rule["first"]]
    shared = list(result.grads) + [result.loss] + list(result.term_losses)
    merged, examples = mean_across_workers(
        shared + [m if m is not None else c for m, c in zip(by_rule["mean"], chiefs)],
        result.examples, cluster, main_device)
    grads, loss = merged[:num_grads], merged[num_grads]
    term_losses = merged[num_grads + 1:num_grads + 1 + num_terms]
    state = merged[num_grads + 1 + num_terms:]
    float_firsts = [v if v is not None and v.dtype.is_floating else None
                    for v in by_rule["first"]]
    if any(v is not None for v in float_firsts):
        chief_values, _ = mean_across_workers(float_firsts, float(cluster.is_chief),
                                                       cluster, main_device)
        state = [c if c is not None else v for c, v in zip(chief_values, state)]
    if any(v is not None for v in by_rule["sum"]):
        with tf.device(main_device):
            changes = [None if v is None else v - old for v, old in zip(by_rule["sum"], old_state)]
        added = sum_across_workers(changes, cluster, main_device)
        with tf.device(main_device):
            state = [v if change is None else old + change
                     for v, change, old in zip(state, added, old_state)]
    return result._replace(grads=grads, loss=loss, state=state, examples=examples,
                           term_losses=term_losses)


def sum_across_workers(values, cluster, device):
    """Per value (Tensor or None), its sum over workers: one all-reduce per dtype, packed."""
    [buffers], unpack = _pack([values], [device])
    return unpack(collectives.all_reduce_across_workers(buffers, cluster, device))


def _gather_slices(slices, cluster, device):
    """Every worker's rows of a tf.IndexedSlices, concatenated in worker order.

    CollectiveGatherV2 needs equal shapes on every worker, and an instance
    key keeps the shape it first ran with. So each worker pads its rows to
    the longest worker's rounded up to a power of two, that power picks the
    instance key, and the padding is dropped after the gather.
    """
    rows = tf.shape(slices.indices, out_type=tf.int64)[0]
    [sizes] = collectives.all_reduce_across_workers(
        [tf.one_hot(cluster.task_index, cluster.num_workers, dtype=tf.int64) * rows],
        cluster, device)
    longest = tf.cast(tf.maximum(tf.reduce_max(sizes), 1), tf.float64)
    power = tf.math.ceil(tf.math.log(longest) / tf.math.log(tf.constant(2.0, tf.float64)))
    padded = tf.cast(2.0 ** power, tf.int64)
    values_padding = [[0, padded - rows]] + [[0, 0]] * (slices.values.shape.rank - 1)
    indices, values = collectives.all_gather_across_workers(
        [tf.pad(slices.indices, [[0, padded - rows]]), tf.pad(slices.values, values_padding)],
        tf.cast(power, tf.int32), cluster, device)
    real = tf.reshape(tf.sequence_mask(sizes, padded), [-1])
    return tf.IndexedSlices(tf.boolean_mask(values, real), tf.boolean_mask(indices, real),
                            slices.dense_shape)


def _divide(value, total):
    if isinstance(value, tf.IndexedSlices):
        return tf.IndexedSlices(_divide(value.values, total), value.indices, value.dense_shape)
    return tf.math.divide_no_nan(value, tf.cast(total, value.dtype))


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
                tf.zeros(_shape(t), t.dtype) if g is None else g, [-1])
                for g, t in zip(grads, template)]
            packed.append([tf.concat([flat[i] for i in members], 0)
                           for members in groups.values()])

    def unpack(buffers):
        flat = [None] * len(template)
        for buffer, members in zip(buffers, groups.values()):
            pieces = tf.split(buffer, [_size(template[i]) for i in members], num=len(members))
            for i, piece in zip(members, pieces):
                flat[i] = tf.reshape(piece, _shape(template[i]))
        return flat

    return packed, unpack


def _size(tensor):
    """Elements of `tensor`: an int where its shape is known when traced, else a Tensor
    (a gradient's static shape may be partly unknown, as behind a broadcasting matmul)."""
    size = tensor.shape.num_elements()
    return tf.size(tensor) if size is None else size


def _shape(tensor):
    return tensor.shape if tensor.shape.is_fully_defined() else tf.shape(tensor)
