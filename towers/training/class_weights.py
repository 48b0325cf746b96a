"""fit's class_weight: each batch's sample weights from its labels, as keras.Model.fit
makes them (Keras's own map function, with its checks: one output, no sample weights)."""

import tensorflow as tf

from towers import compat


def weighted(dataset, class_weight):
    """`dataset` (fit's: a tf.data.Dataset, an iterable of batches or a callable
    epoch -> one of those) with each batch (x, y) turned into (x, y, class weights).

    class_weight: None (dataset as it is), or {class index: weight}; classes not
    in it weigh 1. A class is y itself, or argmax(y) for one-hot labels.

    Raises:
      ValueError: what keras.Model.fit refuses: a class_weight that is not a dict
        of numbers, batches that carry sample weights, labels of several outputs.
    """
    if class_weight is None:
        return dataset
    if not isinstance(class_weight, dict) or not class_weight or not all(
            isinstance(k, int) and isinstance(v, (int, float)) for k, v in class_weight.items()):
        raise ValueError(f"class_weight must be a dict of class index -> weight, e.g. "
                         f"{{0: 1.0, 1: 2.5}}, got {class_weight!r}.")
    to_weights = compat.class_weight_map_fn(class_weight)
    if callable(dataset) and not isinstance(dataset, tf.data.Dataset):
        return lambda epoch: weighted(dataset(epoch), class_weight)
    if isinstance(dataset, tf.data.Dataset):
        return dataset.map(to_weights)
    return _Weighted(dataset, to_weights)


class _Weighted:
    """An iterable of batches whose labels give their sample weights, batch by batch."""

    def __init__(self, batches, to_weights):
        self._batches, self._to_weights = batches, to_weights

    def __iter__(self):
        return (self._to_weights(*batch) for batch in self._batches)
