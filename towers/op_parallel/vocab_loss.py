"""The softmax cross-entropy of logits kept in parts along the vocabulary (Megatron's
vocab-parallel cross-entropy).

A split layer computes its output units as parts, part j's (..., V_j) on its own
device: a vocab-split LM head (op_parallel's VocabEmbedding, reverse=True) or a
column-split output layer. Its joined output is a concatenation on the tower;
gathering it there moves every part's logits, and their gradient back, each step.
The loss needs less: per example log Z = log sum_v exp(logit_v) and the target's
logit. So each part sends its largest logit, its sum of exponentials and its share
of the target's logit, three (...,) tensors, and receives their gradients, from
which it computes its logits' gradient, softmax - one_hot, where they live: 5
floats per example and part, whatever V_j is (benchmarks/RESULTS.md: 20 KiB
instead of 32-192 MiB per part, 0.73-0.77x the time on CPU).

`per_example_losses` does that for Keras's SparseCategoricalCrossentropy(
from_logits=True) (axis -1, no ignored class) on logits a split layer marked
(`mark_parts`); anything else is the loss's own call.
"""

import keras
import tensorflow as tf

from towers import compat

_PARTS = "_towers_parts"  # where a split layer's joined output keeps its parts (compat.attach)


def mark_parts(joined, parts):
    """Records on `joined`, a split layer's output, the parts it is the concatenation
    of: a layer next (a row split) or the loss may take them as they are."""
    return compat.attach(joined, _PARTS, list(parts))


def parts_of(tensor):
    """The parts `tensor` was joined from (mark_parts), or None."""
    return compat.attached(tensor, _PARTS)


def per_example_losses(loss, y_true, y_pred):
    """Keras's per-example values of `loss` (loss.call), computed with the logits kept
    in their parts; None where that does not apply (another loss, or logits not
    joined from parts along their last axis): the caller calls the loss.

    y_true: class ids (n, ...) or (n, ..., 1); y_pred: logits (n, ..., V) joined
    from parts (n, ..., V_j), each on its part's device. -> (n, ...) float32.
    """
    parts = parts_of(y_pred)
    if parts is None or len(parts) < 2 or not _is_sparse_cross_entropy(loss):
        return None
    widths = [part.shape[-1] for part in parts]
    if None in widths or sum(widths) != y_pred.shape[-1]:
        return None  # joined along another axis
    targets = y_true
    if targets.shape.rank == y_pred.shape.rank:  # Keras's (n, ..., 1) class ids
        targets = tf.squeeze(targets, -1)
    targets = tf.cast(targets, tf.int32)
    maxima, sums, target_logits, start = [], [], [], 0
    for part, width in zip(parts, widths):
        with tf.device(part.device):
            maximum, total, target = _reductions(part, targets - start, part.device)
        maxima.append(maximum)
        sums.append(total)
        target_logits.append(target)
        start += width
    largest = tf.reduce_max(tf.stack(maxima), axis=0)
    log_z = largest + tf.math.log(tf.add_n([s * tf.exp(m - largest)
                                            for s, m in zip(sums, maxima)]))
    return log_z - tf.add_n(target_logits)


def _is_sparse_cross_entropy(loss):
    if not isinstance(loss, keras.losses.SparseCategoricalCrossentropy):
        return False
    config = loss.get_config()
    return config.get("from_logits") and config.get("ignore_class") is None and \
        config.get("axis", -1) == -1


def _reductions(logits, local_targets, device):
    """(largest logit, sum of exp(logit - largest), the target's logit or 0 where the
    target is another part's), each (n, ...), of one part's logits (n, ..., V_j); its
    gradient, computed on `device`, is d_sum * exp(logits - largest) + d_target *
    one_hot. The largest logit carries none: log Z does not depend on the shift."""

    @tf.custom_gradient
    def reductions(logits):
        largest = tf.reduce_max(logits, axis=-1)
        exps = tf.exp(logits - largest[..., None])
        # An id outside [0, V_j) is another part's: a row of zeros.
        one_hot = tf.one_hot(local_targets, tf.shape(logits)[-1], dtype=logits.dtype)
        target = tf.reduce_sum(logits * one_hot, axis=-1)

        def gradient(unused_d_largest, d_sum, d_target):
            with tf.device(device):
                return d_sum[..., None] * exps + d_target[..., None] * one_hot

        return (tf.stop_gradient(largest), tf.reduce_sum(exps, axis=-1), target), gradient

    return reductions(logits)
