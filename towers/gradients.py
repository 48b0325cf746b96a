"""A gradient as a GradientTape returns it: a Tensor, a tf.IndexedSlices (the rows of an
embedding table a batch looked up) or None (a variable the loss does not reach).

Adding them up and turning them dense, shared by every technique: the towers' gradients
in step 5 (data_parallel/aggregate.py), a pipeline's micro-batches' in a flight
(model_parallel/flight.py).
"""

import tensorflow as tf


def add(grads):
    """One variable's gradients summed, skipping None (None where all are); where every
    one is a tf.IndexedSlices the sum stays one (rows concatenated, repeated rows adding
    up when applied)."""
    present = [grad for grad in grads if grad is not None]
    if not present:
        return None
    if all(isinstance(grad, tf.IndexedSlices) for grad in present):
        return tf.IndexedSlices(values=tf.concat([grad.values for grad in present], 0),
                                indices=tf.concat([grad.indices for grad in present], 0),
                                dense_shape=present[0].dense_shape)
    return tf.add_n([tf.convert_to_tensor(grad) for grad in present])


def dense_part(value):
    """The values Tensor of a tf.IndexedSlices, or the Tensor itself."""
    return value.values if isinstance(value, tf.IndexedSlices) else value


def to_dense(grad):
    """A tf.IndexedSlices as the dense Tensor it stands for; a Tensor as it is."""
    if not isinstance(grad, tf.IndexedSlices):
        return grad
    # unsorted_segment_sum adds repeated rows, as the sparse update would.
    return tf.math.unsorted_segment_sum(grad.values, grad.indices, grad.dense_shape[0])
