"""towers.data: the datasets' arrays and the order and content of their batches."""

import logging
import os
import sys

import keras
import numpy as np
import pytest
from keras.src.backend import config as keras_config
from keras.src.utils import file_utils

from towers.cli import data as data_lib, data_files

NUM_TRAIN, NUM_TEST = 10, 7


def _small_data():
    """10 training and 7 test examples of shape (2, 3, 1); x encodes the row index."""
    x_train = (np.arange(NUM_TRAIN * 6, dtype=np.float32).reshape(NUM_TRAIN, 2, 3, 1)
               / (NUM_TRAIN * 6))
    x_test = np.arange(NUM_TEST * 6, dtype=np.float32).reshape(NUM_TEST, 2, 3, 1) / 100
    return data_lib.Data(x_train, np.arange(NUM_TRAIN, dtype=np.int32), x_test,
                         np.arange(NUM_TEST, dtype=np.int32) % 3, num_classes=10, name="small")


def _batches(dataset):
    return [(x.numpy(), y.numpy()) for x, y in dataset]


def _labels(batches):
    return np.concatenate([y for _, y in batches])


# --- digits and synthetic -------------------------------------------------------------------


def test_digits_shapes_ranges_classes_and_fixed_split():
    from sklearn.datasets import load_digits
    digits = load_digits()
    data = data_lib.load_data("digits")

    assert data.name == "digits" and data.num_classes == 10 and data.input_shape == (8, 8, 1)
    assert data.x_train.shape == (1437, 8, 8, 1) and data.x_test.shape == (360, 8, 8, 1)
    assert data.x_train.dtype == np.float32 and data.y_train.dtype == np.int32
    assert data.x_train.min() == 0.0 and data.x_train.max() == 1.0
    # Train and test together are exactly the 1797 digits, pixels / 16, each label kept.
    rows = np.concatenate([
        np.concatenate([data.x_train.reshape(-1, 64) * 16, data.y_train[:, None]], axis=1),
        np.concatenate([data.x_test.reshape(-1, 64) * 16, data.y_test[:, None]], axis=1)])
    expected = np.concatenate([digits.data, digits.target[:, None]], axis=1)
    np.testing.assert_array_equal(np.unique(rows, axis=0), np.unique(expected, axis=0))
    assert len(rows) == len(expected)
    # Stratified: every class is 20% of the test split, to within one example.
    np.testing.assert_allclose(np.bincount(data.y_test, minlength=10),
                               0.2 * np.bincount(digits.target), atol=1)
    # Fixed: the same split every time, whatever the seed.
    again = data_lib.load_data("digits", seed=7)
    np.testing.assert_array_equal(again.x_test, data.x_test)
    np.testing.assert_array_equal(again.y_train, data.y_train)


def test_synthetic_is_deterministic_for_a_seed():
    data = data_lib.load_data("synthetic", seed=3)
    assert data.x_train.shape == (2048, 32, 32, 3) and data.x_test.shape == (512, 32, 32, 3)
    assert data.x_train.dtype == np.float32 and data.y_train.dtype == np.int32
    assert data.num_classes == 10 and data.input_shape == (32, 32, 3)
    assert 0.0 <= data.x_train.min() and data.x_train.max() < 1.0
    assert abs(float(data.x_train.mean()) - 0.5) < 0.01  # uniform pixels
    np.testing.assert_array_equal(np.unique(data.y_train), np.arange(10))

    same = data_lib.load_data("synthetic", seed=3)
    np.testing.assert_array_equal(same.x_train, data.x_train)
    np.testing.assert_array_equal(same.y_test, data.y_test)
    other = data_lib.load_data("synthetic", seed=4)
    assert not np.array_equal(other.x_train, data.x_train)
    assert not np.array_equal(other.y_train, data.y_train)


def test_digits_without_sklearn_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn", None)  # makes `import sklearn` fail
    with pytest.raises(ImportError, match="pip install scikit-learn$"):
        data_lib.load_data("digits")


def test_unknown_dataset_lists_the_choices():
    with pytest.raises(ValueError, match="imagenet.*digits, synthetic, mnist, fashion_mnist, "
                                         "cifar10"):
        data_lib.load_data("imagenet")


# --- train_dataset, eval_dataset, steps_per_epoch -------------------------------------------


def test_train_dataset_covers_every_example_once_in_the_seeded_order():
    data = _small_data()
    batches = _batches(data_lib.train_dataset(data, global_batch_size=4, epoch=2, seed=5))

    assert [len(y) for _, y in batches] == [4, 4, 2]  # last batch partial
    labels = _labels(batches)
    np.testing.assert_array_equal(np.sort(labels), np.arange(NUM_TRAIN))
    # The documented order, and x stays paired with its y.
    np.testing.assert_array_equal(labels, np.random.default_rng([5, 2]).permutation(NUM_TRAIN))
    np.testing.assert_array_equal(np.concatenate([x for x, _ in batches]), data.x_train[labels])
    x, y = batches[0]
    assert x.dtype == np.float32 and x.shape == (4, 2, 3, 1)
    assert y.dtype == np.int32 and y.shape == (4,)


def test_train_dataset_order_per_epoch_and_seed():
    data = _small_data()

    def order(epoch, seed):
        return _labels(_batches(data_lib.train_dataset(data, 4, epoch=epoch, seed=seed)))

    np.testing.assert_array_equal(order(0, 0), order(0, 0))
    np.testing.assert_array_equal(order(3, 1), order(3, 1))
    assert not np.array_equal(order(0, 0), order(1, 0))
    assert not np.array_equal(order(0, 0), order(0, 1))


@pytest.mark.parametrize("skip_batches", [0, 1, 2, 3])
def test_skip_batches_gives_the_tail_of_the_epoch(skip_batches):
    data = _small_data()
    full = _batches(data_lib.train_dataset(data, 4, epoch=1, seed=2))
    resumed = _batches(data_lib.train_dataset(data, 4, epoch=1, seed=2,
                                              skip_batches=skip_batches))
    assert len(resumed) == len(full) - skip_batches
    for (x, y), (x_full, y_full) in zip(resumed, full[skip_batches:]):
        np.testing.assert_array_equal(x, x_full)
        np.testing.assert_array_equal(y, y_full)


@pytest.mark.parametrize("num_workers", [2, 3, 5])
def test_workers_read_their_parts_of_every_global_batch(num_workers):
    # NUM_TRAIN = 10 in batches of 4: the last batch (2) leaves 3 and 5 workers some empty parts.
    data = _small_data()
    full = _batches(data_lib.train_dataset(data, 4, epoch=1, seed=2, skip_batches=1))
    parts = [_batches(data_lib.train_dataset(data, 4, epoch=1, seed=2, skip_batches=1,
                                             worker_index=i, num_workers=num_workers))
             for i in range(num_workers)]
    for step, (x_full, y_full) in enumerate(full):
        sizes = [len(worker[step][1]) for worker in parts]
        assert sizes == [len(p) for p in np.array_split(y_full, num_workers)]
        np.testing.assert_array_equal(np.concatenate([w[step][1] for w in parts]), y_full)
        np.testing.assert_array_equal(np.concatenate([w[step][0] for w in parts]), x_full)


def test_worker_index_must_be_below_num_workers():
    with pytest.raises(ValueError, match="worker_index=2 is not below num_workers=2"):
        data_lib.train_dataset(_small_data(), 4, epoch=0, worker_index=2, num_workers=2)


def test_skip_more_than_an_epoch_is_an_error():
    with pytest.raises(ValueError, match="skip_batches=4 is more than the 3 batches"):
        data_lib.train_dataset(_small_data(), 4, epoch=0, skip_batches=4)


def test_eval_dataset_is_the_test_split_in_order():
    data = _small_data()
    batches = _batches(data_lib.eval_dataset(data, global_batch_size=3))
    assert [len(y) for _, y in batches] == [3, 3, 1]
    np.testing.assert_array_equal(np.concatenate([x for x, _ in batches]), data.x_test)
    np.testing.assert_array_equal(_labels(batches), np.arange(NUM_TEST) % 3)


@pytest.mark.parametrize("global_batch_size, steps", [(1, 10), (4, 3), (5, 2), (10, 1), (64, 1)])
def test_steps_per_epoch(global_batch_size, steps):
    data = _small_data()
    assert data_lib.steps_per_epoch(data, global_batch_size) == steps
    assert len(list(data_lib.train_dataset(data, global_batch_size, epoch=0))) == steps


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_bad_global_batch_size(bad):
    data = _small_data()
    for make in (lambda: data_lib.train_dataset(data, bad, epoch=0),
                 lambda: data_lib.eval_dataset(data, bad),
                 lambda: data_lib.steps_per_epoch(data, bad)):
        with pytest.raises(ValueError, match=f"global_batch_size must be an integer >= 1, "
                                             f"got {bad!r}"):
            make()


# --- data_npz -------------------------------------------------------------------------------


def _write_npz(tmp_path, **arrays):
    path = tmp_path / "arrays.npz"
    np.savez(path, **arrays)
    return str(path)


def test_npz_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    arrays = dict(x_train=rng.random((6, 4, 5, 2), dtype=np.float32),
                  y_train=np.array([0, 1, 2, 3, 0, 1]),  # int64
                  x_test=rng.random((3, 4, 5, 2), dtype=np.float32),
                  y_test=np.array([3.0, 0.0, 1.0]))  # integral floats
    data = data_lib.load_data("npz", data_npz=_write_npz(tmp_path, **arrays))

    assert data.name == "npz" and data.num_classes == 4 and data.input_shape == (4, 5, 2)
    np.testing.assert_array_equal(data.x_train, arrays["x_train"])
    np.testing.assert_array_equal(data.x_test, arrays["x_test"])
    assert data.y_train.dtype == np.int32 and data.y_test.dtype == np.int32
    np.testing.assert_array_equal(data.y_train, [0, 1, 2, 3, 0, 1])
    np.testing.assert_array_equal(data.y_test, [3, 0, 1])


def test_npz_uint8_images_are_scaled_and_get_a_channel(tmp_path):
    x = np.array([[[0, 255], [51, 102]]] * 4, dtype=np.uint8)  # (4, 2, 2)
    path = _write_npz(tmp_path, x_train=x, y_train=np.arange(4)[:, None],  # (N, 1) labels
                      x_test=x[:2], y_test=np.array([1, 1], dtype=np.uint8))
    data = data_lib.load_data("digits", data_npz=path)
    assert data.x_train.dtype == np.float32 and data.x_train.shape == (4, 2, 2, 1)
    np.testing.assert_allclose(data.x_train[0, :, :, 0], [[0.0, 1.0], [0.2, 0.4]], rtol=1e-6)
    np.testing.assert_array_equal(data.y_train, [0, 1, 2, 3])
    assert data.num_classes == 4


def test_npz_feature_vectors_become_column_images(tmp_path):
    x = np.linspace(0, 1, 15, dtype=np.float32).reshape(5, 3)
    path = _write_npz(tmp_path, x_train=x, y_train=np.arange(5) % 2,
                      x_test=x, y_test=np.ones(5, int))
    data = data_lib.load_data("npz", data_npz=path)
    assert data.input_shape == (3, 1, 1)
    np.testing.assert_array_equal(data.x_train[:, :, 0, 0], x)


def test_npz_missing_file(tmp_path):
    path = str(tmp_path / "nowhere.npz")
    with pytest.raises(ValueError, match=f"{path}' does not exist"):
        data_lib.load_data("npz", data_npz=path)


def test_npz_that_is_not_an_npz(tmp_path):
    (tmp_path / "notes.npz").write_text("x_train = [1, 2]")
    np.save(tmp_path / "one.npy", np.zeros(3))
    with pytest.raises(ValueError, match="notes.npz' is not a NumPy .npz archive"):
        data_lib.load_data("npz", data_npz=tmp_path / "notes.npz")
    with pytest.raises(ValueError, match="one.npy' holds one array"):
        data_lib.load_data("npz", data_npz=tmp_path / "one.npy")


def test_npz_missing_key_names_it_and_the_keys_present(tmp_path):
    path = _write_npz(tmp_path, x_train=np.zeros((2, 3)), y_train=np.zeros(2, int),
                      x_test=np.zeros((2, 3)), labels=np.zeros(2, int))
    with pytest.raises(ValueError, match="lacks y_test; it has x_train, y_train, x_test, "
                                         "labels"):
        data_lib.load_data("npz", data_npz=path)


def test_npz_mismatched_lengths_show_the_shapes(tmp_path):
    path = _write_npz(tmp_path, x_train=np.zeros((5, 2, 2)), y_train=np.zeros(4, int),
                      x_test=np.zeros((2, 2, 2)), y_test=np.zeros(2, int))
    with pytest.raises(ValueError, match=r"x_train has shape \(5, 2, 2\) but y_train has "
                                         r"shape \(4,\)"):
        data_lib.load_data("npz", data_npz=path)


@pytest.mark.parametrize("key, value, message", [
    ("y_train", np.array([0.0, 1.5]), "y_train .* is not integer class ids"),
    ("y_train", np.array([0, -1]), "y_train has a negative label"),
    ("y_train", np.array([0, 2**40]), "y_train has the label 1099511627776; class ids are"),
    ("y_train", np.eye(2), r"y_train has shape \(2, 2\)"),
    ("x_train", np.array([[0, 300], [1, 2]]), "x_train holds integers from 0 to 300"),
    ("x_train", np.array([[0.0, np.nan], [1.0, 0.5]]), "x_train contains NaN"),
    ("x_test", np.zeros((1, 3)), r"x_train examples have shape \(2, 1, 1\) but x_test"),
])
def test_npz_bad_arrays(tmp_path, key, value, message):
    arrays = dict(x_train=np.zeros((2, 2)), y_train=np.array([0, 1]),
                  x_test=np.zeros((1, 2)), y_test=np.array([1]))
    arrays[key] = value
    with pytest.raises(ValueError, match=message):
        data_lib.load_data("npz", data_npz=_write_npz(tmp_path, **arrays))


def test_npz_is_never_unpickled(tmp_path):
    path = _write_npz(tmp_path, x_train=np.array([{"a": 1}, {"b": 2}], dtype=object),
                      y_train=np.array([0, 1]), x_test=np.zeros((1, 2)), y_test=np.array([1]))
    with pytest.raises(ValueError, match="x_train holds Python objects"):
        data_lib.load_data("npz", data_npz=path)


def test_holdout_split_is_stratified_fixed_and_disjoint():
    # 10 classes of 10..100 examples (550 in all), in a shuffled order.
    labels = np.repeat(np.arange(10), np.arange(10, 101, 10))
    labels = np.random.default_rng(1).permutation(labels)
    train_index, holdout_index = data_lib.holdout_split(labels)

    assert len(holdout_index) == 55  # 10%
    np.testing.assert_array_equal(np.sort(np.concatenate([train_index, holdout_index])),
                                  np.arange(len(labels)))  # disjoint, and together all
    # Stratified: every class holds out 10% of its examples, to within one.
    np.testing.assert_allclose(np.bincount(labels[holdout_index], minlength=10),
                               0.1 * np.bincount(labels), atol=1)
    # Fixed: the same examples on every call; another seed draws others.
    again = data_lib.holdout_split(labels)
    np.testing.assert_array_equal(again[1], holdout_index)
    assert not np.array_equal(data_lib.holdout_split(labels, seed=1)[1], holdout_index)


@pytest.mark.parametrize("sizes, held_out", [
    ([14], 1),            # 1.4 rounds down
    ([25], 3),            # 2.5 rounds up (Python's round() would give 2)
    ([3, 1, 1], 1),       # 0.5 -> at least one, from the class that can spare it
    ([1, 1, 2], 1),
    ([2] * 30, 6),        # 6 classes give one each, every class keeps one
])
def test_holdout_split_rounds_and_keeps_a_training_example_per_class(sizes, held_out):
    labels = np.repeat(np.arange(len(sizes)), sizes)
    train_index, holdout_index = data_lib.holdout_split(labels)
    assert len(holdout_index) == held_out
    assert set(labels[train_index]) == set(labels)


def test_holdout_split_needs_a_class_with_two_examples():
    with pytest.raises(ValueError, match="no class has two; add x_test and y_test"):
        data_lib.holdout_split(np.arange(5))


def test_npz_without_test_split_holds_out_10_percent(tmp_path, caplog):
    # 60 examples of 3 classes (10, 20, 30); pixel (0, 0) numbers the example.
    x = np.zeros((60, 2, 2), np.uint8)
    x[:, 0, 0] = np.arange(60)
    y = np.random.default_rng(0).permutation(np.repeat([0, 1, 2], [10, 20, 30]))
    path = _write_npz(tmp_path, x_train=x, y_train=y)
    with caplog.at_level(logging.INFO, logger="absl"):
        data = data_lib.load_data("npz", data_npz=path, seed=0)
    assert "holding out 6 of the 60 training examples" in caplog.text

    train_ids = np.round(data.x_train[:, 0, 0, 0] * 255).astype(int)
    test_ids = np.round(data.x_test[:, 0, 0, 0] * 255).astype(int)
    assert len(test_ids) == 6 and len(train_ids) == 54
    assert not set(train_ids) & set(test_ids)
    np.testing.assert_array_equal(data.y_test, y[test_ids])  # labels stay with their images
    np.testing.assert_array_equal(data.y_train, y[train_ids])
    np.testing.assert_array_equal(np.bincount(data.y_test), [1, 2, 3])  # stratified
    assert data.num_classes == 3 and data.input_shape == (2, 2, 1)
    # The training seed does not move the split.
    other = data_lib.load_data("npz", data_npz=path, seed=5)
    np.testing.assert_array_equal(other.x_test, data.x_test)


@pytest.mark.parametrize("present", ["x_test", "y_test"])
def test_npz_with_one_test_array_is_an_error(tmp_path, present):
    arrays = dict(x_train=np.zeros((4, 2)), y_train=np.array([0, 1, 0, 1]))
    arrays[present] = arrays[present.replace("test", "train")]
    missing = "y_test" if present == "x_test" else "x_test"
    with pytest.raises(ValueError, match=f"lacks {missing};.*x_test, y_test both or neither"):
        data_lib.load_data("npz", data_npz=_write_npz(tmp_path, **arrays))


# --- Keras datasets, offline ----------------------------------------------------------------

KERAS_FILES = {  # what keras.datasets.<name>.load_data() reads, under <keras home>/datasets
    "mnist": ["mnist.npz"],
    "fashion_mnist": [os.path.join("fashion-mnist", name) for name in (
        "train-labels-idx1-ubyte.gz", "train-images-idx3-ubyte.gz",
        "t10k-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz")],
    "cifar10": ["cifar-10-batches-py-target_archive"],
}


@pytest.fixture
def keras_home(tmp_path, monkeypatch):
    """An empty Keras cache, no network, and a record of calls into keras.datasets."""
    home = tmp_path / "keras_home"
    home.mkdir()
    # Keras reads $KERAS_HOME once at import; get_file reads this global at call time.
    monkeypatch.setattr(keras_config, "_KERAS_DIR", str(home))
    monkeypatch.setattr(data_files, "_online", lambda url: False)

    def no_download(*args, **kwargs):
        raise AssertionError("the test tried to download")

    monkeypatch.setattr(file_utils, "urlretrieve", no_download)
    calls = []
    for name in KERAS_FILES:
        monkeypatch.setattr(getattr(keras.datasets, name), "load_data",
                            lambda name=name: calls.append(name))
    return home, calls


@pytest.mark.parametrize("name", sorted(KERAS_FILES))
def test_keras_dataset_offline_names_the_files_to_place(keras_home, name):
    home, calls = keras_home
    with pytest.raises(ValueError) as error:
        data_lib.load_data(name)
    message = str(error.value)
    assert "\n" not in message
    for file in KERAS_FILES[name]:
        assert str(home / "datasets" / file) in message
    assert calls == []  # failed before Keras, so no download was attempted


def test_keras_dataset_failed_download_is_one_line(keras_home, monkeypatch):
    home, _ = keras_home
    monkeypatch.setattr(data_files, "_online", lambda url: True)

    def failing_download():
        raise Exception("URL fetch failure on https://example/mnist.npz: None -- timed out\n"
                        "more detail")

    monkeypatch.setattr(keras.datasets.mnist, "load_data", failing_download)
    with pytest.raises(ValueError, match=r"Keras: URL fetch failure .* timed out\)$") as error:
        data_lib.load_data("mnist")
    assert str(home / "datasets" / "mnist.npz") in str(error.value)


@pytest.mark.parametrize("name, x_shape, y_shape, input_shape", [
    ("mnist", (5, 28, 28), (5,), (28, 28, 1)),
    ("fashion_mnist", (5, 28, 28), (5,), (28, 28, 1)),
    ("cifar10", (5, 32, 32, 3), (5, 1), (32, 32, 3)),
])
def test_keras_dataset_cached_is_scaled_and_shaped(keras_home, monkeypatch, name, x_shape,
                                                   y_shape, input_shape):
    home, _ = keras_home
    for file in KERAS_FILES[name]:  # present in the cache; the loader below stands for Keras
        (home / "datasets" / file).parent.mkdir(parents=True, exist_ok=True)
        (home / "datasets" / file).touch()
    x = np.arange(np.prod(x_shape)).reshape(x_shape).astype(np.uint8)
    y = np.arange(5).reshape(y_shape).astype(np.uint8) * 2
    monkeypatch.setattr(getattr(keras.datasets, name), "load_data",
                        lambda: ((x, y), (x[:2], y[:2])))

    data = data_lib.load_data(name)
    assert data.name == name and data.num_classes == 10 and data.input_shape == input_shape
    np.testing.assert_allclose(data.x_train.reshape(x_shape), x / 255.0, rtol=1e-6)
    assert data.y_train.dtype == np.int32
    np.testing.assert_array_equal(data.y_train, [0, 2, 4, 6, 8])
    np.testing.assert_array_equal(data.y_test, [0, 2])
