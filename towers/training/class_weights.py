"""fit's class_weight: each batch's sample weights from its labels, as keras.Model.fit
makes them for arrays (classes not in class_weight weigh 1), with its checks (one
output, no sample weights), for a tf.data.Dataset and for an iterable of batches."""

import keras
import tensorflow as tf

from towers.data_parallel import split


def weighted(dataset, class_weight):
    """`dataset` (fit's: a tf.data.Dataset, an iterable of batches or a callable
    epoch -> one of those) with each batch (x, y) turned into (x, y, class weights).

    class_weight: None (dataset as it is), or {class index: weight}; classes not
    in it weigh 1. A class is y itself (rounded), or argmax(y) for one-hot labels.

    Raises:
      ValueError: what keras.Model.fit refuses: a class_weight that is not a dict
        of numbers, batches that carry sample weights, labels of several outputs.
    """
    if class_weight is None:
        return dataset
    if not isinstance(class_weight, dict) or not class_weight or not all(
            isinstance(k, int) and k >= 0 and isinstance(v, (int, float))
            for k, v in class_weight.items()):
        raise ValueError(f"class_weight must be a dict of class index -> weight, e.g. "
                         f"{{0: 1.0, 1: 2.5}}, got {class_weight!r}.")
    if callable(dataset) and not isinstance(dataset, tf.data.Dataset):
        return lambda epoch: weighted(dataset(epoch), class_weight)
    to_weights = _ClassWeights(class_weight)
    if isinstance(dataset, tf.data.Dataset):
        return dataset.map(lambda *batch: to_weights(batch))
    return _Weighted(dataset, to_weights)


class _ClassWeights:
    """fn((x, y[, sample_weight])) -> (x, y, each row's weight): Keras's
    class_weight_to_sample_weights in TensorFlow ops, for a tf.data map or eagerly."""

    def __init__(self, class_weight):
        # Classes 0..max given; a class past it (or below 0) weighs 1, as in Keras.
        self._table = [class_weight.get(c, 1.0) for c in range(max(class_weight) + 1)]

    def __call__(self, batch):
        x, y, sample_weight = split.unpack_batch(batch)
        if sample_weight is not None:  # Keras's own lines
            raise ValueError("You cannot `class_weight` and `sample_weight` at the same time.")
        if tf.nest.is_nested(y):
            raise ValueError("`class_weight` is only supported for Models with a single "
                             "output.")
        y = tf.convert_to_tensor(y)
        if y.shape.rank >= 2:  # one-hot rows (argmax), or a column of class ids
            classes = tf.where(tf.shape(y)[-1] > 1, tf.argmax(y, axis=-1, output_type=tf.int32),
                               self._class_ids(y[..., 0]))
        else:
            classes = self._class_ids(y)
        table = tf.constant(self._table, keras.backend.floatx())
        known = (classes >= 0) & (classes < len(self._table))
        weights = tf.where(known, tf.gather(table, tf.clip_by_value(
            classes, 0, len(self._table) - 1)), tf.ones([], table.dtype))
        return x, y, weights

    @staticmethod
    def _class_ids(labels):
        if labels.dtype.is_floating:
            labels = tf.round(labels)
        return tf.cast(labels, tf.int32)


class _Weighted:
    """An iterable of batches whose labels give their sample weights, batch by batch."""

    def __init__(self, batches, to_weights):
        self._batches, self._to_weights = batches, to_weights

    def __iter__(self):
        return (self._to_weights(batch) for batch in self._batches)
