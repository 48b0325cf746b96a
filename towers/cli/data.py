"""Datasets in host memory, and the tf.data pipelines that feed them in global batches.

Every dataset becomes one `Data`: images (N, H, W, C) float32 and int32 class
ids. Training order is a NumPy permutation seeded by (seed, epoch), so a run
resumed mid-epoch can rebuild exactly the batches it had not yet seen.
"""

import dataclasses
import functools
import math

import numpy as np
import tensorflow as tf
from absl import logging

from towers.cli import arrays as arrays_lib, data_files
from towers.data_parallel import split

DATASETS = ("digits", "synthetic", "mnist", "fashion_mnist", "cifar10")
HOLDOUT_FRACTION = 0.1  # of an .npz's training examples, when it has no test split

# Fixed, so the test set is the same whatever the training seed.
_DIGITS_SPLIT_SEED = 0
_HOLDOUT_SEED = 0
_SYNTHETIC_SHAPE, _SYNTHETIC_CLASSES = (32, 32, 3), 10
_SYNTHETIC_TRAIN, _SYNTHETIC_TEST = 2048, 512


@dataclasses.dataclass(frozen=True, eq=False)
class Data:
    """Arrays of one dataset in host memory.

    Attributes:
      x_train: (N, H, W, C) float32, in [0, 1] for the built-in datasets and for
        integer arrays from an .npz (float .npz arrays are kept as given).
      y_train: (N,) int32 class ids in [0, num_classes).
      x_test, y_test: the same for the test split, (M, H, W, C) and (M,).
      num_classes: int, the number of classes.
      name: str, the dataset's name (a label only).
    """
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    name: str

    @property
    def input_shape(self):
        """(H, W, C) of one example."""
        return tuple(self.x_train.shape[1:])

    @functools.cached_property
    def _host_tensors(self):
        # Converted once, not once per epoch; pinned to the host so that tf.data's
        # gathers never pull a whole dataset onto an accelerator.
        with tf.device("/cpu:0"):
            return {split: (tf.constant(getattr(self, f"x_{split}")),
                            tf.constant(getattr(self, f"y_{split}")))
                    for split in ("train", "test")}


def load_data(name, data_npz=None, seed=0):
    """Loads a dataset into host memory (files: towers.data_files); returns a Data.

    Args:
      name: one of DATASETS. With data_npz, any string: it only names the Data.
      data_npz: path of an .npz with arrays x_train, y_train, x_test, y_test,
        read without unpickling. x may be (N, H, W, C), (N, H, W) (a channel
        is added) or (N, D) (a column image (N, D, 1, 1)); integer x is taken
        as 0..255 pixels and divided by 255. y: integer class ids (integral
        floats and (N, 1) are accepted); num_classes = y_train's largest
        label + 1 (arrays.num_classes: at least two classes, y_test's labels
        among them, not far more classes than y_train has labels). Without
        x_test and y_test, `holdout_split` keeps a fixed, stratified 10% of
        the training examples apart as the test split (one log line says so).
      seed: non-negative int; draws the "synthetic" arrays. The "digits"
        train/test split is fixed and does not depend on it.

    Raises:
      ValueError: unknown name, bad arrays, or a Keras dataset that is neither
        cached nor downloadable (the message names the file to place).
      ImportError: "digits" without scikit-learn installed.
    """
    _check_int("seed", seed, minimum=0)
    if data_npz is not None:
        x_train, y_train, x_test, y_test = data_files.read_npz(data_npz)
        source = f"data_npz file {str(data_npz)!r}"  # names the file in error messages
        if x_test is None:
            return _with_holdout(str(name), x_train, y_train, source)
        return _from_arrays(str(name), x_train, y_train, x_test, y_test, source=source)
    if name == "digits":
        return _load_digits()
    if name == "synthetic":
        return _load_synthetic(seed)
    if name in data_files.KERAS_DATASETS:
        return _from_arrays(name, *data_files.keras_arrays(name), num_classes=10)
    raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}, "
                     "or pass data_npz=PATH with your own arrays.")


def train_dataset(data, global_batch_size, epoch, seed=0, skip_batches=0, worker_index=0,
                  num_workers=1):
    """One epoch of training batches, in the fixed order of (seed, epoch).

    The order is np.random.default_rng([seed, epoch]).permutation(N): the same
    for the same (seed, epoch), different from epoch to epoch. The last batch
    is partial when global_batch_size does not divide N.

    Args:
      data: a Data.
      global_batch_size: examples per batch, >= 1; towers split each batch.
      epoch: int >= 0, the epoch index.
      seed: int >= 0.
      skip_batches: batches of this epoch already trained on (resuming a run),
        0..steps_per_epoch(data, global_batch_size); the rest follow unchanged.
      worker_index, num_workers: with several workers each reads only its part
        of every global batch: towers.split_batch's shard `worker_index` of
        `num_workers` (sizes differ by at most one, larger first).

    Returns:
      A tf.data.Dataset of (x, y): x (B, H, W, C) float32, y (B,) int32, with
      B the global batch size, or this worker's part of it.
    """
    steps = steps_per_epoch(data, global_batch_size)
    _check_int("num_workers", num_workers, minimum=1)
    _check_int("worker_index", worker_index, minimum=0)
    if worker_index >= num_workers:
        raise ValueError(f"worker_index={worker_index} is not below num_workers={num_workers}.")
    _check_int("epoch", epoch, minimum=0)
    _check_int("seed", seed, minimum=0)
    _check_int("skip_batches", skip_batches, minimum=0)
    if skip_batches > steps:
        raise ValueError(
            f"skip_batches={skip_batches} is more than the {steps} batches of one epoch "
            f"({len(data.y_train)} examples, global_batch_size={global_batch_size}); "
            "resume with the global_batch_size the run started with.")
    order = np.random.default_rng([seed, epoch]).permutation(len(data.y_train))
    # Skipping whole batches of the permutation is Dataset.skip(skip_batches),
    # without gathering the skipped examples.
    return _batches(data._host_tensors["train"], order[skip_batches * global_batch_size:],
                    global_batch_size, worker_index, num_workers)


def eval_dataset(data, global_batch_size):
    """The test split in order as (x, y) batches, the last one partial if need be."""
    _check_int("global_batch_size", global_batch_size, minimum=1)
    return _batches(data._host_tensors["test"], np.arange(len(data.y_test)),
                    global_batch_size)


def holdout_split(labels, fraction=HOLDOUT_FRACTION, seed=_HOLDOUT_SEED):
    """Stratified indices of a training part and a held-out part of `labels`.

    round(fraction * N) examples are held out (half up, at least one), shared
    among the classes in proportion to their sizes (largest remainders first),
    but every class keeps at least one training example. Which examples of a
    class go is drawn from `seed` alone, so the split is the same for every
    training seed.

    Args:
      labels: (N,) integer class ids.
      fraction: the share to hold out, in (0, 1).
      seed: int >= 0.

    Returns:
      (train_index, holdout_index): sorted int64 arrays that together are
      0..N-1, each example in exactly one.

    Raises:
      ValueError: a bad fraction, or no class with two examples to spare one.
    """
    labels = np.asarray(labels)
    _check_int("seed", seed, minimum=0)
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"fraction must be in (0, 1), got {fraction!r}.")
    classes, class_of, sizes = np.unique(labels, return_inverse=True, return_counts=True)
    spare = sizes - 1  # each class keeps one training example
    if not spare.sum():
        raise ValueError(f"cannot hold out a test split from {len(labels)} examples: no class "
                         "has two; add x_test and y_test.")
    wanted = min(max(1, math.floor(fraction * len(labels) + 0.5)), int(spare.sum()))
    share = sizes * (wanted / len(labels))  # each class's exact share
    take = np.minimum(np.floor(share).astype(np.int64), spare)
    # The rest go to the largest remainders among classes with examples to spare.
    for c in np.argsort(-(share - take), kind="stable"):
        if take.sum() == wanted:
            break
        if take[c] < spare[c]:
            take[c] += 1
    while take.sum() < wanted:  # only when the caps left some over: fill in class order
        c = int(np.flatnonzero(take < spare)[0])
        take[c] += 1
    rng = np.random.default_rng(seed)
    held_out = np.concatenate([
        rng.permutation(np.flatnonzero(class_of == c))[:take[c]] for c in range(len(classes))])
    is_held_out = np.zeros(len(labels), bool)
    is_held_out[held_out] = True
    return np.flatnonzero(~is_held_out), np.flatnonzero(is_held_out)


def steps_per_epoch(data, global_batch_size):
    """Batches in one training epoch: ceil(N / global_batch_size)."""
    _check_int("global_batch_size", global_batch_size, minimum=1)
    return math.ceil(len(data.y_train) / global_batch_size)


def _batches(arrays, order, global_batch_size, worker_index=0, num_workers=1):
    """(x, y) batches of the examples at `order`, a 1-D array of row indices.

    With num_workers > 1 only this worker's rows of each batch are gathered.
    """
    x, y = arrays
    options = tf.data.Options()
    # The default graph rewrites serialise the pipeline, captured arrays included:
    # about a second and a copy of cifar10 per epoch, for nothing this pipeline needs.
    options.experimental_optimization.apply_default_optimizations = False
    return (tf.data.Dataset.from_tensor_slices(order.astype(np.int64))
            .batch(global_batch_size, drop_remainder=False)
            .map(lambda i: split.split_batch(i, num_workers)[worker_index])
            .map(lambda i: (tf.gather(x, i), tf.gather(y, i)))  # one gather per batch
            .prefetch(tf.data.AUTOTUNE)
            .with_options(options))


def _load_digits():
    try:
        from sklearn import datasets, model_selection
    except ImportError:
        raise ImportError("dataset 'digits' needs scikit-learn, which ships it (no download): "
                          "pip install scikit-learn") from None
    digits = datasets.load_digits()
    x = digits.images.reshape(-1, 8, 8, 1) / 16.0  # pixels are counts 0..16
    x_train, x_test, y_train, y_test = model_selection.train_test_split(
        x, digits.target, test_size=0.2, stratify=digits.target,
        random_state=_DIGITS_SPLIT_SEED)
    return _from_arrays("digits", x_train, y_train, x_test, y_test, num_classes=10)


def _load_synthetic(seed):
    # Random pixels and labels, as tf_cnn_benchmarks feeds: measures speed, not learning.
    rng = np.random.default_rng(seed)
    arrays = []
    for size in (_SYNTHETIC_TRAIN, _SYNTHETIC_TEST):
        arrays += [rng.random((size,) + _SYNTHETIC_SHAPE, dtype=np.float32),
                   rng.integers(0, _SYNTHETIC_CLASSES, size)]
    return _from_arrays("synthetic", *arrays, num_classes=_SYNTHETIC_CLASSES)


def _with_holdout(name, x_train, y_train, source):
    """Data whose test split is holdout_split's part of the training arrays."""
    # Checked and converted first, so the split sees (N,) class ids whatever the file
    # held; the first training example stands in for the missing test split meanwhile.
    checked = _from_arrays(name, x_train, y_train, x_train[:1], y_train[:1], source=source)
    train_index, test_index = holdout_split(checked.y_train)
    logging.info("%s: no x_test, y_test; holding out %d of the %d training examples (%g%%, "
                 "stratified by class, the same whatever the seed) for evaluation.", name,
                 len(test_index), len(checked.y_train), 100 * HOLDOUT_FRACTION)
    return Data(checked.x_train[train_index], checked.y_train[train_index],
                checked.x_train[test_index], checked.y_train[test_index],
                checked.num_classes, name)


def _from_arrays(name, x_train, y_train, x_test, y_test, num_classes=None, source=None):
    """Checks raw arrays and converts them: x to (N, H, W, C) float32, y to (N,) int32.

    num_classes: None to take it from the labels (arrays.num_classes). source: where the
    arrays come from, for error messages (default: name).
    """
    source = source or name
    splits = []
    for part, x, y in (("train", x_train, y_train), ("test", x_test, y_test)):
        x, y = np.asarray(x), np.asarray(y)
        if x.ndim not in (2, 3, 4):
            raise ValueError(f"{source}: x_{part} has shape {x.shape}; give (N, H, W, C), "
                             "(N, H, W) or (N, D).")
        if y.ndim == 2 and y.shape[1] == 1:
            y = y.reshape(-1)  # (N, 1) labels, as cifar10 has
        if y.ndim != 1:
            raise ValueError(f"{source}: y_{part} has shape {y.shape}; give one class id per "
                             "example, shape (N,) (for one-hot labels: y.argmax(axis=1)).")
        if len(x) != len(y):
            raise ValueError(f"{source}: x_{part} has shape {x.shape} but y_{part} has shape "
                             f"{y.shape}; give one label per example (the same N).")
        if not len(y):
            raise ValueError(f"{source}: the {part} split is empty; give at least one example.")
        splits.append((arrays_lib.images(source, f"x_{part}", x),
                       arrays_lib.labels(source, f"y_{part}", y)))
    (x_train, y_train), (x_test, y_test) = splits
    if x_train.shape[1:] != x_test.shape[1:]:
        raise ValueError(f"{source}: x_train examples have shape {x_train.shape[1:]} but x_test "
                         f"examples {x_test.shape[1:]}; both splits need the same shape.")
    if num_classes is None:
        num_classes = arrays_lib.num_classes(source, y_train, y_test)
    return Data(x_train, y_train, x_test, y_test, num_classes, name)


def _check_int(what, value, minimum):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{what} must be an integer >= {minimum}, got {value!r}.")
