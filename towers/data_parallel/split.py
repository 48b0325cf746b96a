"""Step 1: splitting the global batch into one shard per tower."""

import contextlib
import threading

import keras
import tensorflow as tf

EMPTY_BATCH = "the batch is empty (batch size 0); give at least one example."


def unpack_batch(batch):
    """(x, y) or (x, y, sample_weight) -> (x, y, sample_weight or None)."""
    if not isinstance(batch, (tuple, list)) or len(batch) not in (2, 3):
        kind = f"a {type(batch).__name__}" + (f" of length {len(batch)}"
                                               if isinstance(batch, (tuple, list)) else "")
        raise ValueError(f"a batch must be (x, y) or (x, y, sample_weight), got {kind}.")
    return batch[0], batch[1], batch[2] if len(batch) == 3 else None


def as_tensor(value):
    """One field of a batch as a Tensor; float64 (NumPy's default) becomes Keras's floatx."""
    tensor = tf.convert_to_tensor(value)
    # A float64 batch would make a float64 graph; Keras models compute in floatx.
    return tf.cast(tensor, keras.config.floatx()) if tensor.dtype == tf.float64 else tensor


def as_batch(batch):
    """(x, y[, sample_weight]) as a tuple of Tensors (nested parts kept), through as_tensor.

    Raises:
      ValueError: a part that is (or holds) None, ragged or sparse, or a Python list of
        numbers (which would be read as one input per number), in one line naming it.
    """
    for name, part in zip(("x", "y", "sample_weight"), batch):
        leaves = tf.nest.flatten(part)
        if any(leaf is None for leaf in leaves):
            raise ValueError(
                f"{name} {'is' if part is None else 'holds'} None; every field of a batch "
                "(x, y[, sample_weight]) is an array or Tensor with one row per example.")
        composite = [leaf for leaf in leaves
                     if isinstance(leaf, (tf.RaggedTensor, tf.SparseTensor))]
        if composite:
            raise ValueError(
                f"{name} holds a {type(composite[0]).__name__}: the towers split dense "
                f"batches only; make it a dense Tensor first ({name}.to_tensor()).")
        if isinstance(part, list) and all(isinstance(leaf, (int, float)) for leaf in leaves):
            raise ValueError(
                f"{name} is a Python list of {len(leaves)} numbers, which would be read as "
                f"that many inputs; give it as an array or Tensor (np.asarray({name})).")
    return tuple(tf.nest.map_structure(as_tensor, tuple(batch)))


def checked_batch(batch):
    """A batch as given (x, y[, sample_weight]: arrays, Tensors, nests of them), its form
    checked (unpack_batch) and its parts made Tensors (as_batch); ValueError in one line."""
    unpack_batch(batch)
    return as_batch(batch)


def no_rows(like):
    """A Tensor of 0 rows shaped and typed like `like`, a Tensor or a tf.TensorSpec
    (its unknown dims 0)."""
    return tf.zeros([0] + [d or 0 for d in like.shape.as_list()[1:]], like.dtype)


def empty_like(like):
    """A batch of no rows with the structure of `like` (its unknown dims 0): a cluster
    worker's batch of a step once its data has ended.

    `like`: a batch (or its Shards: then one empty shard each), or a nest of
    tf.TensorSpec such as a tf.data element_spec, dim 0 its batch dimension.
    """
    if isinstance(like, Shards):
        return Shards(empty_like(shard) for shard in like)
    return tuple(tf.nest.map_structure(lambda leaf: as_tensor(no_rows(
        leaf if isinstance(leaf, tf.TensorSpec) else tf.convert_to_tensor(leaf))), tuple(like)))


# Called inside a user's tf.function: plain graph code with no Python control flow
# on tensors, which autograph need not convert (converting it cost a first call 0.25 s).
@tf.autograph.experimental.do_not_convert
def split_batch(batch, num_shards):
    """Splits every tensor of `batch` along dim 0 into `num_shards` shards.

    Shard sizes differ by at most one, larger shards first, as in
    `numpy.array_split`; a batch smaller than `num_shards` gives empty shards.

    Args:
      batch: a Tensor (or array) or a nested tuple/list/dict of them, all with
        the same size B in dim 0; B may be known only at run time.
      num_shards: int >= 1.

    Returns:
      list of `num_shards` structures shaped like `batch`; shard i holds rows
      [offset_i, offset_i + size_i) of every tensor, on the device it came from.
    """
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
        raise ValueError(f"num_shards must be an integer >= 1, got {num_shards!r}.")
    return split_rows(batch, shard_sizes(batch_size(batch), num_shards))


def split_rows(batch, sizes):
    """`batch` split along dim 0 into consecutive pieces of `sizes` rows, in order.

    sizes: a list of ints or int32 scalar Tensors, or an int32 Tensor of shape
    (pieces,), adding up to the batch size (not checked again here).
    """
    leaves = [tf.convert_to_tensor(leaf) for leaf in tf.nest.flatten(batch)]
    if isinstance(sizes, list) and not all(isinstance(s, int) for s in sizes):
        sizes = tf.stack(sizes)
    count = len(sizes) if isinstance(sizes, list) else int(sizes.shape[0])
    split_leaves = [tf.split(leaf, sizes, num=count) for leaf in leaves]
    return [tf.nest.pack_sequence_as(batch, [pieces[i] for pieces in split_leaves])
            for i in range(count)]


class Shards(list):
    """A global batch already split into one shard per tower, in tower order.

    prefetch.ShardIterator yields these with shard i on tower i's device; the
    step then skips step 1 (see shards_of).
    """


def shards_of(batch, num_shards):
    """Step 1: (shards, rows of each, rows in all): `batch` split into `num_shards`
    shards, or its shards if it is Shards. Rows are ints where known statically,
    else int32 scalars; the batch's parts are checked to agree on their rows once."""
    if not isinstance(batch, Shards):
        rows = batch_size(batch)
        sizes = shard_sizes(rows, num_shards)
        return split_rows(batch, sizes), row_counts(sizes), rows
    if len(batch) != num_shards:
        raise ValueError(f"the batch comes in {len(batch)} shards but the step has "
                         f"{num_shards} towers; split it for {num_shards}.")
    sizes = [batch_size(shard) for shard in batch]
    return list(batch), sizes, sum(sizes)


def smallest_shard_rows(batch, num_shards):
    """The rows of the smallest of `batch`'s shards (Shards, or as shards_of splits it):
    an int where dim 0 is known statically, else an int32 scalar. Read from each
    part's first tensor, unchecked (the step checks that a batch's parts agree)."""
    if isinstance(batch, Shards):
        rows = [_first_rows(shard) for shard in batch]
        return min(rows) if all(isinstance(r, int) for r in rows) else tf.reduce_min(rows)
    return _first_rows(batch) // num_shards


def _first_rows(batch):
    first = tf.convert_to_tensor(tf.nest.flatten(batch)[0])
    return first.shape[0] if first.shape[0] is not None else tf.shape(first)[0]


def row_counts(sizes):
    """shard_sizes' result as a list: of ints, or of int32 scalar Tensors."""
    return sizes if isinstance(sizes, list) else tf.unstack(sizes)


def targets(batch):
    """(y, sample_weight or None) of the whole batch; Shards' rows are concatenated."""
    if not isinstance(batch, Shards):
        return unpack_batch(batch)[1:]
    y, *sample_weight = [tf.nest.map_structure(lambda *rows: tf.concat(rows, 0), *part)
                         for part in list(zip(*batch))[1:]]  # each part: one per shard
    return y, sample_weight[0] if sample_weight else None


def check_not_empty(batch):
    """Raises ValueError for a batch (or its Shards) known to have no rows; one whose
    rows are known only when it runs passes (a graph asserts it where it matters)."""
    if known_empty(batch_size(batch)):
        raise ValueError(EMPTY_BATCH)


def any_rows(batch):
    """`batch`'s tf.TensorSpec nest, dim 0 unknown (a scalar's as it is): what a function
    is traced for so that one trace serves batches of any rows (a shard, a micro-batch)."""
    return tf.nest.map_structure(
        lambda t: tf.TensorSpec([None] + t.shape[1:].as_list() if t.shape.rank else [],
                                t.dtype), batch)


def rows_vary(spec):
    """Whether a batch's tf.TensorSpec nest (a dataset's element_spec) leaves some part's
    rows unknown: its batches may differ in rows (a scalar has none)."""
    return any(s.shape.rank and s.shape[0] is None for s in tf.nest.flatten(spec))


def work_spec(batch):
    """`batch`'s tf.TensorSpec nest as the tower's work (a tower's trace, a stage's
    forward) is traced for it: its own shapes within work_traced_for_rows(True), else
    its rows unknown (any_rows)."""
    if getattr(_work, "for_rows", False):
        return tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), batch)
    return any_rows(batch)


@contextlib.contextmanager
def work_traced_for_rows(for_rows):
    """Within it (a step as it is traced), the tower's work is traced for the rows of its
    inputs (`for_rows`: the step's batch fills every micro-batch, its rows known) or for
    any rows (work_spec)."""
    outside = getattr(_work, "for_rows", False)
    _work.for_rows = for_rows
    try:
        yield
    finally:
        _work.for_rows = outside


_work = threading.local()  # for_rows: work_traced_for_rows' in effect on this thread


def known_empty(rows):
    """Whether `rows` (batch_size's: an int, or an int32 scalar Tensor known only when
    it runs) is known to be 0."""
    return isinstance(rows, int) and rows == 0


def shard_sizes(global_batch_size, num_shards):
    """Per-shard sizes summing to `global_batch_size`, larger first.

    Returns a list of Python ints when the size is a Python int, else an int32
    Tensor of shape (num_shards,).
    """
    if isinstance(global_batch_size, int):
        base, extra = divmod(global_batch_size, num_shards)
        return [base + (1 if i < extra else 0) for i in range(num_shards)]
    base = global_batch_size // num_shards
    extra = global_batch_size % num_shards
    return base + tf.cast(tf.range(num_shards) < extra, global_batch_size.dtype)


def batch_size(batch):
    """The shared size of dim 0 of every tensor in `batch`.

    Returns a Python int when it is known statically, else an int32 scalar
    Tensor (with a run-time check that all parts agree).

    Raises:
      ValueError: a part is None or a scalar, or the parts disagree on dim 0.
    """
    if isinstance(batch, Shards):
        return sum(batch_size(shard) for shard in batch)
    if any(leaf is None for leaf in tf.nest.flatten(batch)):
        raise ValueError(f"the batch {'is' if batch is None else 'holds'} None; give arrays "
                         "or Tensors, each with the batch as dim 0.")
    leaves = [tf.convert_to_tensor(leaf) for leaf in tf.nest.flatten(batch)]
    if not leaves:
        raise ValueError("the batch holds no tensors.")
    if any(leaf.shape.rank == 0 for leaf in leaves):
        raise ValueError(
            "every field of a batch needs a batch dimension (dim 0), but "
            f"{_describe(batch)} has a scalar.")
    static = {leaf.shape[0] for leaf in leaves} - {None}
    if len(static) > 1:
        raise ValueError(
            f"the fields of the batch disagree on batch size (dim 0): {_describe(batch)}. "
            "Inputs, targets and sample weights need one row per example.")
    if len(static) == 1 and all(leaf.shape[0] is not None for leaf in leaves):
        return static.pop()
    sizes = [tf.shape(leaf, out_type=tf.int32)[0] for leaf in leaves]
    # The message names every field and, when it fails, gives each one's rows.
    check = tf.debugging.Assert(tf.reduce_all(tf.equal(tf.stack(sizes), sizes[0])), [
        f"the fields of the batch disagree on batch size (dim 0); rows of "
        f"{_field_names(batch)}:", *sizes])
    with tf.control_dependencies([check]):
        return tf.identity(sizes[0])


def _field_names(batch):
    """'x, y' (or "x/ids, x/mask, y, sample_weight"): the paths of a batch's leaves, for
    messages; of another structure its leaves' paths ("0", "1/a", ...)."""
    paths = [list(path) for path, _ in keras.tree.flatten_with_path(batch)]
    if isinstance(batch, (tuple, list)) and len(batch) in (2, 3):
        for path in paths:
            path[0] = ("x", "y", "sample_weight")[path[0]]
    return ", ".join("/".join(str(key) for key in path) for path in paths)


def _describe(batch):
    """Shapes of the fields of `batch`, for error messages."""
    return str(tf.nest.map_structure(
        lambda leaf: tuple(tf.convert_to_tensor(leaf).shape), batch))
