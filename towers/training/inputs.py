"""fit's and evaluate's data as keras.Model's take it: x, y, sample_weight, batch_size.

`x` may be:
- arrays: a NumPy array or Tensor, or a dict or list of them (one per input), with
  `y` (and `sample_weight`) alike. They are batched as keras.Model.fit batches them,
  by Keras's own code (compat.array_batches): `batch_size` rows (32 if None), the last
  batch partial, in a new order each epoch where `shuffle` says so;
- a tuple (x, y) or (x, y, sample_weight) of arrays with y=None: the same arrays
  (the form Keras's validation_data takes);
- a tf.data.Dataset, a keras.utils.PyDataset or any iterable of (x, y[, sample_weight])
  batches, used as they are: their batches carry y and the weights, so y,
  sample_weight and batch_size must be None, as Keras's fit refuses them;
- for fit, a callable epoch -> one of those (towers' own: each epoch its own order,
  so a checkpoint resumes in the middle of an epoch).
"""

import collections
import inspect
import numbers

import keras
import tensorflow as tf

from towers import compat, errors

_BATCHES = "a tf.data.Dataset or an iterable of (x, y[, sample_weight]) batches"
FORMS = f"arrays with y, {_BATCHES}"
PREDICT_FORMS = ("an array or Tensor with a row per example (or a list or dict of them), a "
                 "tf.data.Dataset, a keras.utils.PyDataset or an iterable of batches")

Data = collections.namedtuple("Data", ["batches", "num_batches"])
Data.__doc__ = """What a loop iterates: `batches` (a tf.data.Dataset, an iterable of
batches, or fit's callable epoch -> one of those) and `num_batches` (batches in one
pass, or None where unknown until they end: a generator, a filtered Dataset)."""


def data(name, x, y=None, sample_weight=None, *, batch_size=None, shuffle=False,
         forms=FORMS):
    """`x` (and y, sample_weight) as a Data; a ValueError in one line naming `name` for
    what is none of the forms above (listed in `forms`).

    shuffle: as keras.Model.fit takes it (False, True, "batch"); arrays only.
    """
    x, y, sample_weight = _unpacked(x, y, sample_weight)
    if not _carries_batches(x):
        return _arrays(name, x, y, sample_weight, batch_size, shuffle, forms)
    for argument, value in (("y", y), ("sample_weight", sample_weight),
                            ("batch_size", batch_size)):
        if value is not None:
            raise ValueError(_carried(argument, value, name, x))
    if callable(x) and not isinstance(x, keras.utils.PyDataset):
        _check_takes_epoch(name, x)
        return Data(x, None)
    return Data(x, num_batches(x))


def _check_takes_epoch(name, x):
    """Raises ValueError where fit's callable `x` cannot be called as x(epoch): a
    generator function of no argument, say, whose TypeError would blame its call."""
    try:
        inspect.signature(x).bind(0)
    except TypeError:
        raise ValueError(
            f"{name} is a callable that takes no epoch: fit calls {name}(epoch) for each "
            f"epoch's batches; pass {name}() (a generator's batches, for one epoch), or "
            f"a function of the epoch, e.g. lambda epoch: {name}().") from None
    except ValueError:  # no signature to read (a builtin): called as it is
        pass


def predict_data(x, batch_size=None, steps=None):
    """predict's x as a Data, as keras.Model.predict takes it: arrays (a list, tuple or
    dict of them per input too) in batches of `batch_size` rows (None: the rows over
    `steps` batches, or 32); a tf.data.Dataset, a PyDataset or an iterable of batches
    as they are, each batch x, (x,) or (x, y[, sample_weight]) (batch_size refused)."""
    if not _carries_batches(x) or isinstance(x, list):
        return _arrays("x", x, None, None, batch_size, False, PREDICT_FORMS, steps)
    if callable(x) and not isinstance(x, keras.utils.PyDataset):
        raise ValueError(f"x must be {PREDICT_FORMS}; got a {type(x).__name__}.")
    if batch_size is not None:
        raise ValueError(_carried("batch_size", batch_size, "x", x))
    return Data(x, num_batches(x))


def validation(validation_data, batch_size):
    """fit's validation_data as a Data: arrays, a (x, y[, sample_weight]) tuple of them
    included, batched by `batch_size` (fit's validation_batch_size or batch_size; 32 if
    None), in order; anything else as it is, as keras.Model.fit takes them."""
    if _is_batch_of_arrays(validation_data):
        return data("validation_data", validation_data, batch_size=batch_size)
    return data("validation_data", validation_data)


def split_for_validation(x, y, sample_weight, validation_split):
    """((x, y, sample_weight) to train on, (x, y, sample_weight) to validate on): the
    last `validation_split` of the rows held out, before any shuffle, as Keras's fit
    holds them out. Arrays only."""
    if not 0 < validation_split < 1:
        raise ValueError(f"validation_split must be a fraction between 0 and 1, got "
                         f"{validation_split!r}.")
    x, y, sample_weight = _unpacked(x, y, sample_weight)
    if y is None or not compat.can_batch_arrays((x, y, sample_weight)):
        raise ValueError(
            f"validation_split holds out the last rows of arrays, and x is a "
            f"{type(x).__name__}{'' if y is not None else ' without y'}: give x and y as "
            "arrays, or pass validation_data.")
    return compat.train_validation_split((x, y, sample_weight), validation_split)


def num_batches(batches):
    """Batches in one pass over `batches`, or None where unknown until they end."""
    if isinstance(batches, tf.data.Dataset):
        cardinality = int(batches.cardinality())
        return cardinality if cardinality >= 0 else None
    if isinstance(batches, keras.utils.PyDataset):
        try:
            return batches.num_batches
        except NotImplementedError:  # an infinite one that does not say so
            return None
    return len(batches) if hasattr(batches, "__len__") else None


def _arrays(name, x, y, sample_weight, batch_size, shuffle, forms, steps=None):
    """Arrays as a Data of Keras's batches; y None only for predict (forms=PREDICT_FORMS)."""
    if x is None or not compat.can_batch_arrays((x, y, sample_weight)):
        given = ", ".join(f"{key}={type(value).__name__}" for key, value in
                          (("x", x), ("y", y), ("sample_weight", sample_weight))
                          if value is not None) or "x=None"
        raise ValueError(f"{name} must be {forms}; got {given}.")
    if y is None and forms is not PREDICT_FORMS:
        what = "a list of arrays" if isinstance(x, list) else "arrays"
        raise ValueError(f"{name} is {what} and y is None: give y, the targets (fit(x, y)), "
                         "or batches of (x, y).")
    if batch_size is not None:
        batch_size = errors.positive_integer("batch_size", batch_size)
    try:
        arrays = Data(*compat.array_batches(x, y, sample_weight, batch_size, shuffle, steps))
    except ValueError as error:  # Keras's words, over several lines: one here
        raise ValueError(f"{name}: " + " ".join(str(error).split())) from None
    if not arrays.num_batches:
        raise ValueError(f"{name} has no rows; pass arrays with at least one row.")
    return arrays


def _carries_batches(x):
    """Whether `x` is batches (a Dataset, a PyDataset, an iterator, a list of batches,
    fit's callable) rather than arrays of rows."""
    return (isinstance(x, (tf.data.Dataset, keras.utils.PyDataset)) or callable(x)
            or hasattr(x, "__next__") or isinstance(x, list) and all(isinstance(item, (tuple, dict)) for item in x))


def _unpacked(x, y, sample_weight):
    """(x, y, sample_weight), a tuple x of arrays given alone, (x, y[, sample_weight]) as
    Keras's validation_data is, unpacked into them."""
    if y is None and sample_weight is None and _is_batch_of_arrays(x):
        return (tuple(x) + (None,))[:3]
    return x, y, sample_weight


def _is_batch_of_arrays(x):
    return (isinstance(x, tuple) and len(x) in (2, 3) and x[1] is not None
            and compat.can_batch_arrays(x))


def _is_array(value):
    return hasattr(value, "shape") and hasattr(value, "dtype")


def _carried(argument, value, name, x):
    """The one line refusing `argument` beside data `x` that comes in batches."""
    return (f"{argument} must be None when {name} is a {type(x).__name__}: its batches carry "
            f"{'their size' if argument == 'batch_size' else 'it'}, as Keras's fit takes "
            f"them; got {argument}={_short(value)}"
            + (f" (epochs is fit's fourth argument, as keras.Model.fit's: pass "
               f"epochs={value})." if argument == "y" and _is_count(value) else "."))


def _is_count(value):
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _short(value):
    return f"an array of shape {tuple(value.shape)}" if _is_array(value) else repr(value)
