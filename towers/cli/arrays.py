"""A data set's raw arrays checked and converted: images to (N, H, W, C) float32 in
[0, 1], labels to (N,) int32 class ids; anything else is a one-line ValueError."""

import numpy as np
from absl import logging


def images(name, what, x):
    """x as (N, H, W, C) float32; integers are 0..255 pixels, scaled to [0, 1]."""
    if np.issubdtype(x.dtype, np.integer) or x.dtype == np.bool_:
        low, high = int(x.min()), int(x.max())
        if low < 0 or high > 255:
            raise ValueError(f"{name}: {what} holds integers from {low} to {high}; integer "
                             "images must be 0..255 pixels, else save floats in [0, 1].")
        x = x.astype(np.float32)
        x /= 255.0  # in place: cifar10 is 600 MB as float32
    elif np.issubdtype(x.dtype, np.floating):
        x = x.astype(np.float32, copy=False)
        if not np.isfinite(x).all():
            raise ValueError(f"{name}: {what} contains NaN or Inf; every input must be finite.")
        if x.min() < 0.0 or x.max() > 1.0:
            logging.warning("%s: %s ranges over [%g, %g], not [0, 1]; using it as given.",
                            name, what, x.min(), x.max())
    else:
        raise ValueError(f"{name}: {what} has dtype {x.dtype}; give uint8 pixels (0..255) "
                         "or floats in [0, 1].")
    if x.ndim == 2:
        return x.reshape(x.shape + (1, 1))  # (N, D) -> a column image (N, D, 1, 1)
    return x[..., np.newaxis] if x.ndim == 3 else x


def labels(name, what, y):
    """y as (N,) int32 class ids; integral floats are accepted."""
    integral = np.issubdtype(y.dtype, np.integer) or (
        np.issubdtype(y.dtype, np.floating) and np.isfinite(y).all() and (y == np.round(y)).all())
    if not integral:
        raise ValueError(f"{name}: {what} (dtype {y.dtype}) is not integer class ids; "
                         "labels must be whole numbers 0..num_classes-1.")
    if y.min() < 0:
        raise ValueError(f"{name}: {what} has a negative label ({int(y.min())}); class ids "
                         "start at 0.")
    return y.astype(np.int32)
