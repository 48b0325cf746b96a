"""The class ids of a sparse categorical crossentropy term, checked: float labels that are
not whole numbers, which Keras would cast to class ids silently (1.7 -> 1), are refused
(losses.Objective.sparse_targets says which targets such terms read)."""

import tensorflow as tf


def check_sparse_labels(objective, y_true):
    """Raises ValueError if a sparse categorical crossentropy term's labels are floats
    that are not whole numbers, which Keras would cast to class ids silently (1.7 -> 1).

    Eager, once per batch structure (its first batch: nothing per step), after
    `objective.terms` was called with targets of y_true's structure. Whole-number
    floats are class ids.
    """
    count = len(tf.nest.flatten(y_true))
    for index, dtype, not_whole in _not_whole_labels(objective, [y_true]):
        if tf.size(not_whole):
            which = f" (target {index} of {count})" if count > 1 else ""
            raise ValueError(
                f"the labels{which} of a sparse categorical crossentropy loss are "
                f"{dtype.name} and hold {float(not_whole[0]):g}, not a class id; give "
                "whole-number class ids 0..num_classes-1 (integers), or one-hot targets with "
                "categorical_crossentropy.")


def first_fractional_label(objective, y_trues):
    """check_sparse_labels for labels read only when a step runs, in its graph: the
    first float label of a sparse categorical crossentropy term in `y_trues` (one y_true
    per shard, of one structure) that is not a whole number, as a float32 scalar, NaN
    where every one is; None where no such term reads float labels (nothing to check).
    A step's labels after the first batch of their structure are checked so, at the
    cost of a comparison of the labels."""
    fractional = [tf.cast(not_whole, tf.float32)
                  for _, _, not_whole in _not_whole_labels(objective, y_trues)]
    if not fractional:
        return None
    return tf.concat(fractional + [[float("nan")]], 0)[0]


def _not_whole_labels(objective, y_trues):
    """Per sparse categorical crossentropy term whose labels are floats: (its index in
    tf.nest.flatten(y_true), their dtype, those of every y_true in `y_trues` that are not
    whole numbers, flat)."""
    for index in objective.sparse_targets or ():
        labels = [tf.convert_to_tensor(tf.nest.flatten(y_true)[index]) for y_true in y_trues]
        if labels[0].dtype.is_floating:
            flat = tf.concat([tf.reshape(part, [-1]) for part in labels], 0)
            not_whole = tf.boolean_mask(flat, tf.not_equal(flat, tf.round(flat)))
            yield index, labels[0].dtype, not_whole


def fractional_label_error(value):
    """check_sparse_labels' error for a label `value` found by first_fractional_label."""
    return ValueError(
        f"the labels of a sparse categorical crossentropy loss hold {value:g}, not a class "
        "id; give whole-number class ids 0..num_classes-1 (integers), or one-hot targets "
        "with categorical_crossentropy. Nothing of that batch was applied.")
