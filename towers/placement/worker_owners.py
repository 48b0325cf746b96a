"""variable_placement="spread" in a cluster: each worker holds 1/W of the optimizer state
(ZeRO-2's partition, by rows, across workers).

Columns (columns.py, _worker_owners) lays the model's variables end to end over the W
workers (spread_owners, as for towers), the same on every worker; a variable across a
worker's run is held as slabs on each worker, so that each worker's rows are a variable
of their own. Every worker keeps the whole weights (its towers read them as without
spread); each worker's optimizer is built on the held entries it owns only
(Columns.owned_variables), so it holds 1/W of the slots. A step, across workers:

  steps 4-5 (means_on_owners): the dense gradients, packed in owner order, each worker's
    block padded to one size, are summed so that each worker gets only its own block:
    the global batch's weighted mean of its own entries (weights: examples, as
    exchange.mean_across_workers). A sparse gradient is gathered as before.
  step 6 (apply_owned): each worker applies its own entries, then the updated values,
    packed and padded alike, are all-gathered and each worker writes the entries it does
    not own: every worker's weights stay identical.

The sum is one reduce-scatter per dtype (collectives.reduce_scatter_across_workers).
"""

import math

import tensorflow as tf

from towers.data_parallel import aggregate, collectives, exchange


def means_on_owners(result, setup, state_rules, old_state):
    """Steps 4-5 across workers with the state spread over them: as exchange.across_workers
    for the loss, loss terms and state; each gradient (a step.TowerResult's, per
    setup.columns.held_variables() entry, this worker's mean) becomes the global
    batch's mean on its owner only, None on the other workers."""
    cluster, device, columns = setup.cluster, setup.main_device, setup.columns
    merged = exchange.across_workers(result._replace(grads=[]), cluster, device,
                                     state_rules, old_state)
    owners, mine = columns.held_owners(), cluster.task_index
    sparse = [g if isinstance(g, tf.IndexedSlices) else None for g in result.grads]
    if any(g is not None for g in sparse):
        sparse, _ = exchange.mean_across_workers(sparse, result.examples, cluster, device)
    with tf.device(device), tf.name_scope("across_workers"):
        weight = tf.cast(result.examples, tf.float32)
        dense = [None if g is None or isinstance(g, tf.IndexedSlices) else
                 aggregate.scale(g, weight) for g in result.grads]
        summed = _reduce_scatter(dense, columns.held_variables(), owners, cluster, device)
        # sum_w examples_w * mean_w / sum_w examples_w: the global batch's mean
        means = [None if s is None else tf.math.divide_no_nan(
            s, tf.cast(merged.examples, s.dtype)) for s in summed]
        grads = [None if owner != mine else mean if mean is not None else gathered
                 for mean, gathered, owner in zip(means, sparse, owners)]
    return merged._replace(grads=grads)


def finite_on_every_worker(finite, cluster, device):
    """Whether every worker's own gradients are finite (`finite`: this worker's, a bool
    scalar on `device`): the workers decide alike whether to apply the step, whose
    all-gather needs them all."""
    [finite_workers] = collectives.all_reduce_across_workers(
        [tf.cast(finite, tf.int32)], cluster, device)
    return tf.equal(finite_workers, cluster.num_workers)


def apply_owned(optimizer, grads, columns, device):
    """Step 6 with the state spread over the workers: this worker's optimizer applies
    its own entries' gradients (None elsewhere: means_on_owners'), then every entry is
    written on every worker from its owner's updated value."""
    held, owners = columns.held_variables(), columns.held_owners()
    mine = columns.cluster.task_index
    own = [(g, v) for g, v, owner in zip(grads, held, owners) if owner == mine and g is not None]
    with tf.device(device), tf.name_scope("apply"):
        if own:
            optimizer.apply_gradients(own)
        else:  # Keras applies no gradients without counting the step; the others count it
            optimizer.iterations.assign_add(1)
    with tf.device(device), tf.name_scope("gather_weights"):
        values = [v.value if owner == mine else None for v, owner in zip(held, owners)]
        gathered = _all_gather(values, held, owners, columns.cluster, device)
    for variable, value, owner in zip(held, gathered, owners):
        if owner != mine:
            with tf.device(variable.value.device):
                variable.assign(value)


def _blocks(variables, owners, num_workers, present):
    """Per dtype, per worker, the positions of its entries in `variables` where
    present[i], and the elements of the longest worker's block."""
    layout = {}
    for i, (variable, owner) in enumerate(zip(variables, owners)):
        if present[i]:
            blocks = layout.setdefault(tf.as_dtype(variable.dtype), [[] for _ in range(
                num_workers)])
            blocks[owner].append(i)
    sizes = {dtype: max(1, max(sum(_elements(variables[i]) for i in block)
                               for block in blocks)) for dtype, blocks in layout.items()}
    return layout, sizes


def _packed(values, variables, block, size, dtype):
    """`values` at the positions `block` (None: zeros of the variable's shape), flat,
    concatenated and padded with zeros of `dtype` to `size` elements."""
    flat = [tf.reshape(tf.zeros(variables[i].shape, dtype)
                       if values[i] is None else values[i], [-1]) for i in block]
    buffer = tf.concat(flat, 0) if flat else tf.zeros([0], dtype)
    return tf.pad(buffer, [[0, size - sum(_elements(variables[i]) for i in block)]])


def _unpacked(buffer, variables, block):
    """The entries `block` of a worker's block `buffer`, each of its variable's shape."""
    sizes = [_elements(variables[i]) for i in block]
    pieces = tf.split(buffer[:sum(sizes)], sizes) if block else []
    return {i: tf.reshape(piece, variables[i].shape) for i, piece in zip(block, pieces)}


def _reduce_scatter(values, variables, owners, cluster, device):
    """Per dense value (None elsewhere), its sum over the workers where this worker owns
    it, else None: one reduce-scatter per dtype of the blocks laid end to end."""
    mine, result = cluster.task_index, [None] * len(values)
    layout, sizes = _blocks(variables, owners, cluster.num_workers,
                             [v is not None for v in values])
    for dtype, blocks in layout.items():
        buffer = tf.concat([_packed(values, variables, block, sizes[dtype], dtype)
                            for block in blocks], 0)
        own = collectives.reduce_scatter_across_workers(buffer, cluster, device)
        for i, value in _unpacked(own, variables, blocks[mine]).items():
            result[i] = value
    return result


def _all_gather(values, variables, owners, cluster, device):
    """Every entry's value from its owner (`values`: this worker's own, None elsewhere):
    one all-gather per dtype of the workers' blocks, each padded to one size."""
    mine, result = cluster.task_index, [None] * len(values)
    layout, sizes = _blocks(variables, owners, cluster.num_workers, [True] * len(values))
    for dtype, blocks in layout.items():
        [gathered] = collectives.all_gather_across_workers(
            [_packed(values, variables, blocks[mine], sizes[dtype], dtype)], 0, cluster, device)
        for worker, block in enumerate(blocks):
            buffer = gathered[worker * sizes[dtype]:(worker + 1) * sizes[dtype]]
            for i, value in _unpacked(buffer, variables, block).items():
                result[i] = value
    return result


def _elements(variable):
    return math.prod(variable.shape)
