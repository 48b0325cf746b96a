"""A data set's raw arrays checked and converted: images to (N, H, W, C) float32 in
[0, 1], labels to (N,) int32 class ids, the number of classes from the training
labels; anything else is a one-line ValueError."""

import numpy as np
from absl import logging

# More classes than this many per distinct training label means labels that are not class
# ids (raw ids, measured values): the model would get an output per id up to the largest,
# nearly all of them never trained.
MAX_CLASSES_PER_LABEL = 10
_SHOWN_LABELS = 5  # of the unknown test labels an error message lists


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
    if y.max() > np.iinfo(np.int32).max:  # astype would wrap it around
        raise ValueError(f"{name}: {what} has the label {int(y.max())}; class ids are "
                         "0..num_classes-1, renumber the labels from 0.")
    return y.astype(np.int32)


def num_classes(name, y_train, y_test):
    """The number of classes: y_train's largest label + 1, after checking that the labels
    are those of a classifier. y_train, y_test: (N,) and (M,) int32 class ids.

    Raises:
      ValueError: fewer than two classes in y_train, a largest label far beyond the
        labels y_train holds, or test labels beyond the training classes.
    """
    seen = np.unique(y_train)
    if len(seen) < 2:
        raise ValueError(f"{name}: y_train holds one class only ({seen[0]}); a classifier "
                         "needs training examples of at least two classes, labelled "
                         "0..num_classes-1.")
    count = int(seen[-1]) + 1
    if count > MAX_CLASSES_PER_LABEL * len(seen):
        raise ValueError(f"{name}: y_train's largest label, {seen[-1]}, would make {count} "
                         f"classes, but y_train holds only {len(seen)} different labels; "
                         f"class ids are 0..num_classes-1, renumber the labels 0..{len(seen) - 1} "
                         "(e.g. numpy.unique(labels, return_inverse=True)).")
    unknown = np.unique(y_test[y_test >= count])
    if len(unknown):
        shown = ", ".join(str(label) for label in unknown[:_SHOWN_LABELS])
        raise ValueError(f"{name}: y_test holds label{'s' if len(unknown) > 1 else ''} "
                         f"{shown}{', ...' if len(unknown) > _SHOWN_LABELS else ''} beyond "
                         f"y_train's classes 0..{count - 1} (the classes come from the "
                         "training labels); give test labels among them, or training "
                         "examples of every class.")
    return count
