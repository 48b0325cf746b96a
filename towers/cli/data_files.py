"""Where dataset arrays come from on disk: the Keras dataset cache (downloaded when
online) and a user's .npz file, read without unpickling.

Both return raw NumPy arrays; data.py and arrays.py check and convert them.
"""

import os
import socket
import tempfile
import threading
import urllib.parse
import zipfile

import keras
import numpy as np

from towers import compat

NPZ_KEYS = ("x_train", "y_train", "x_test", "y_test")

# (origin, path under <keras home>/datasets) of each file keras.datasets.<name>.load_data()
# reads, as Keras 3.15 names them; cifar10 keeps its downloaded tar.gz under a new name.
_GCS = "https://storage.googleapis.com/tensorflow/tf-keras-datasets/"
_KERAS_FILES = {
    "mnist": [(_GCS + "mnist.npz", "mnist.npz")],
    "fashion_mnist": [(_GCS + f, os.path.join("fashion-mnist", f)) for f in (
        "train-labels-idx1-ubyte.gz", "train-images-idx3-ubyte.gz",
        "t10k-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz")],
    "cifar10": [("https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
                 "cifar-10-batches-py-target_archive")],
}
KERAS_DATASETS = tuple(_KERAS_FILES)


def keras_arrays(name):
    """x_train, y_train, x_test, y_test of keras.datasets.<name>.load_data(), failing fast
    and in one line when offline; images (N, H, W[, C]) channels last."""
    files = [(url, os.path.join(_keras_datasets_dir(), f)) for url, f in _KERAS_FILES[name]]
    missing = [(url, path) for url, path in files if not os.path.exists(path)]
    hint = (f"{name} is not in the Keras cache and could not be downloaded: copy "
            + "; ".join(f"{url} to {path}" for url, path in missing or files)
            + ", or pass data_npz=PATH with your own arrays.")
    if missing and not _online(missing[0][0]):
        raise ValueError(hint)
    try:
        (x_train, y_train), (x_test, y_test) = getattr(keras.datasets, name).load_data()
    except Exception as error:  # a failed download, or a cached file that fails its hash
        said = str(error).strip().splitlines() or [type(error).__name__]
        raise ValueError(f"{hint} (Keras: {said[0]})") from None
    if x_train.ndim == 4 and keras.config.image_data_format() == "channels_first":
        x_train, x_test = x_train.transpose(0, 2, 3, 1), x_test.transpose(0, 2, 3, 1)
    return x_train, y_train, x_test, y_test


def _keras_datasets_dir():
    """<keras home>/datasets, the folder keras.utils.get_file caches datasets in."""
    root = os.path.expanduser(compat.keras_home_dir())
    if not os.access(root, os.W_OK):  # get_file falls back like this
        root = os.path.join("/tmp" if os.path.isdir("/tmp") else tempfile.gettempdir(),
                            ".keras")
    return os.path.join(root, "datasets")


def _online(url, timeout_s=3.0):
    """True if the host of `url` takes a TCP connection within timeout_s seconds."""
    reachable = []

    def probe():
        try:
            socket.create_connection((urllib.parse.urlsplit(url).hostname, 443),
                                     timeout=timeout_s).close()
            reachable.append(True)
        except OSError:
            pass

    # In a daemon thread because name lookup ignores socket timeouts and can hang offline.
    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return bool(reachable)


def read_npz(path):
    """x_train, y_train, x_test, y_test from an .npz file, never unpickling.

    x_test and y_test are None when the file has neither.
    """
    path = os.path.expanduser(os.fspath(path))
    if not os.path.isfile(path):
        raise ValueError(f"data_npz file {path!r} does not exist; give an .npz with arrays "
                         f"{', '.join(NPZ_KEYS)} (e.g. written by numpy.savez).")
    try:
        arrays = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError, zipfile.BadZipFile):
        raise ValueError(f"data_npz file {path!r} is not a NumPy .npz archive; write one "
                         f"with numpy.savez(path, {'=..., '.join(NPZ_KEYS)}=...).") from None
    if not isinstance(arrays, np.lib.npyio.NpzFile):
        raise ValueError(f"data_npz file {path!r} holds one array (.npy), not an .npz with "
                         f"arrays {', '.join(NPZ_KEYS)}; write it with numpy.savez.")
    with arrays:
        missing = [key for key in NPZ_KEYS if key not in arrays.files]
        if missing in ([], ["x_test", "y_test"]):
            keys = [key for key in NPZ_KEYS if key not in missing]
        else:
            raise ValueError(f"data_npz file {path!r} lacks {', '.join(missing)}; it has "
                             f"{', '.join(arrays.files) or 'no arrays'}, and needs x_train, "
                             "y_train, and x_test, y_test both or neither (without them 10% "
                             "of the training examples is held out).")
        loaded = []
        for key in keys:
            try:
                loaded.append(arrays[key])
            except ValueError:
                raise ValueError(f"data_npz file {path!r}: {key} holds Python objects, which "
                                 "are not unpickled; save numeric arrays.") from None
    return loaded + [None] * (len(NPZ_KEYS) - len(loaded))
