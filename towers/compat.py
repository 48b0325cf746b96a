"""Every private Keras and TensorFlow name towers uses, each beside the public one it stands in for.

Checked on Keras 3.15.1 and TensorFlow 2.21.0 (constraints.txt). A Keras or
TensorFlow upgrade that moves one of these breaks this file only; each entry
says what it does, the public alternative, and why that does not serve.
"""

import functools

import tensorflow as tf
from keras.src.backend.common import masking
from keras.src.losses import loss as loss_module
from keras.src.trainers import compile_utils
from keras.src.trainers.data_adapters import tf_dataset_adapter


def keras_mask(tensor):
    """The Keras mask attached to `tensor` (a bool Tensor), or None.

    Public alternative: `layer.compute_mask(inputs, previous_mask)` per layer;
    Keras attaches the result to each output itself, and a model's outputs
    carry it only as this attribute.
    """
    return masking.get_keras_mask(tensor)


def set_keras_mask(tensor, mask):
    """Attaches `mask` to `tensor` in place, as a Keras layer's call does."""
    masking.set_keras_mask(tensor, mask)


def same_rank(values, weight):
    """(values, weight) with ranks that differ by one matched as Keras's losses match
    them: a last dim of 1 dropped, or one added to a rank-1 tensor.

    Public alternative: none; Keras applies it inside Loss.__call__, which also
    reduces, and towers needs the unreduced sum of each shard.
    """
    return loss_module.squeeze_or_expand_to_same_rank(values, weight)


class CompileLoss(compile_utils.CompileLoss):
    """Keras's container for what `keras.Model.compile` takes as `loss` and `loss_weights`.

    Public alternative: `model.compile(loss=..., loss_weights=...)` then
    `model.compute_loss(...)`, which returns the batch's reduced loss only, and
    compiling would change the user's model. This class resolves every form
    exactly as compile does (single, list, dict by output name, nested,
    strings, None for an output without a loss) and matches y_true and the
    sample weights to the outputs as Keras's train_step does; then, where Keras
    calls each term's loss, it calls `term_fn(loss, y_true, y_pred, sample_weight)`
    (which may return anything Keras can add up).

    `flat_losses`: Keras's `_flat_losses`, one (path, loss, loss_weights, name)
    per term, after the first call. Keras's per-term Mean trackers are not
    updated (`metrics` is one None per term): the trainer keeps its own logs.
    """

    def __init__(self, loss, loss_weights, output_names, term_fn):
        super().__init__(loss, loss_weights, output_names=output_names)
        self._term_fn = term_fn

    def build(self, y_true, y_pred):
        # Keras makes a Mean tracker per term here, as variables: outside any
        # trace, so a tf.function that builds it can trace again.
        with tf.init_scope():
            super().build(y_true, y_pred)
        self._flat_losses = [
            term._replace(loss=functools.partial(self._term_fn, term.loss))
            for term in self._flat_losses]

    @property
    def flat_losses(self):
        return [term._replace(loss=term.loss.args[0]) for term in self._flat_losses or []]

    @property
    def metrics(self):
        return [None] * len(self._flat_losses or [])

    @property
    def variables(self):
        return []


CompileMetrics = compile_utils.CompileMetrics
# Keras's container for `compile(metrics=..., weighted_metrics=...)`: per-output metrics,
# names such as "cls_accuracy", "accuracy" picked by the targets' shape. Public alternative:
# `model.compile(metrics=...)` + `model.compute_metrics`, which would compile the user's model.


def class_weight_map_fn(class_weight):
    """Keras's fn(x, y[, sample_weight]) -> (x, y, class weights) that keras.Model.fit
    maps over a tf.data.Dataset for `class_weight`, with its checks (ValueError for
    sample weights given too, or labels of several outputs).

    Public alternative: `model.fit(..., class_weight=...)` only.
    """
    return tf_dataset_adapter.make_class_weight_map_fn(class_weight)
