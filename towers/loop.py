"""The outer loop around the tower step: epochs, evaluation and metrics.

The trainer owns the step; this module only decides which batches to feed it
and how to summarise what comes back.
"""

import itertools
import time

import keras
import tensorflow as tf
from absl import logging

from towers import split

_ACCURACY_NAMES = ("accuracy", "acc")


class History:
    """What `fit` returns, like keras.callbacks.History.

    Attributes:
      epoch: list of epoch indices run, from 0.
      history: dict metric name -> list with one value per epoch.
    """

    def __init__(self):
        self.epoch = []
        self.history = {}

    def append(self, epoch, logs):
        self.epoch.append(epoch)
        for name, value in logs.items():
            self.history.setdefault(name, []).append(value)


def resolve_metrics(metrics):
    """Checks `metrics`: keras.metrics.Metric objects, or "accuracy" (resolved on first batch)."""
    resolved = []
    for metric in metrics:
        if isinstance(metric, keras.metrics.Metric) or metric in _ACCURACY_NAMES:
            resolved.append(metric)
        elif isinstance(metric, str) and isinstance(_get_metric(metric), keras.metrics.Metric):
            resolved.append(_get_metric(metric))
        else:
            raise ValueError(
                f"metric {metric!r} is not a keras.metrics.Metric object or a known metric "
                "name; pass e.g. 'accuracy' or keras.metrics.SparseCategoricalAccuracy().")
    return resolved


def build_metrics(metrics, y, y_pred):
    """Replaces "accuracy" in `metrics` (in place) by the accuracy that fits y and y_pred."""
    for i, metric in enumerate(metrics):
        if isinstance(metric, str):
            metrics[i] = _accuracy_for(y, y_pred)


def update_metrics(metrics, batch, y_pred, device):
    """Updates every metric with the whole batch on `device`; returns their results."""
    _, y, sample_weight = split.unpack_batch(batch)
    with tf.device(device):
        for metric in metrics:
            metric.update_state(y, y_pred, sample_weight=sample_weight)
        return {metric.name: metric.result() for metric in metrics}


def evaluate(trainer, data):
    """Mean loss over every example of `data` (+ regularisation) and the metrics.

    `data`: one batch as a tuple (x, y[, sample_weight]), a tf.data.Dataset or
    any iterable of such batches.
    """
    _reset(trainer.metrics)
    batches = [data] if isinstance(data, tuple) else data
    loss_sum, examples, regularization = 0.0, 0.0, 0.0
    for batch in batches:
        batch_loss_sum, batch_examples, regularization = trainer.eval_step(batch)
        loss_sum += float(batch_loss_sum)
        examples += float(batch_examples)
    if not examples:
        raise ValueError("evaluate got no batches; pass a batch or a non-empty dataset.")
    logs = {"loss": loss_sum / examples + float(regularization)}
    logs.update({m.name: float(m.result()) for m in trainer.metrics})
    return logs


def fit(trainer, dataset, epochs=1, steps_per_epoch=None, validation_data=None):
    """Runs `epochs` epochs of tower steps; returns a History.

    An epoch is one pass over `dataset`, or `steps_per_epoch` batches drawn
    from one iterator that continues across epochs (then the dataset should
    repeat; training stops early, with a warning, if it runs out).
    """
    for name, value in (("epochs", epochs), ("steps_per_epoch", steps_per_epoch)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    history = History()
    iterator = iter(dataset) if steps_per_epoch else None
    for epoch in range(epochs):
        _reset(trainer.metrics)
        batches = itertools.islice(iterator, steps_per_epoch) if iterator else iter(dataset)
        start, loss_sum, examples, steps, logs = time.perf_counter(), 0.0, 0, 0, {}
        for batch in batches:
            logs = trainer.train_step(batch)
            size = int(tf.nest.flatten(batch)[0].shape[0])
            loss_sum, examples, steps = loss_sum + logs["loss"] * size, examples + size, steps + 1
        if not steps:
            logging.warning("epoch %d got no batches; stopping: the dataset ran out.", epoch + 1)
            break
        epoch_logs = {**logs, "loss": loss_sum / examples,
                      "examples_per_sec": examples / (time.perf_counter() - start)}
        if validation_data is not None:
            val_logs = trainer.evaluate(validation_data)
            epoch_logs.update({f"val_{name}": value for name, value in val_logs.items()})
        history.append(epoch, epoch_logs)
        logging.info("epoch %d/%d: %s", epoch + 1, epochs,
                     ", ".join(f"{k}={v:.4g}" for k, v in epoch_logs.items()))
        if steps_per_epoch and steps < steps_per_epoch:
            logging.warning("the dataset ran out after %d of %d steps in epoch %d; stopping.",
                            steps, steps_per_epoch, epoch + 1)
            break
    return history


def _accuracy_for(y, y_pred):
    """Binary, categorical (one-hot y) or sparse categorical accuracy, as Keras's compile picks."""
    y_pred, y = tf.nest.flatten(y_pred)[0], tf.nest.flatten(y)[0]
    if y_pred.shape.rank < 2 or y_pred.shape[-1] == 1:
        return keras.metrics.BinaryAccuracy(name="accuracy")
    if y.shape.rank == y_pred.shape.rank and y.shape[-1] == y_pred.shape[-1]:
        return keras.metrics.CategoricalAccuracy(name="accuracy")
    return keras.metrics.SparseCategoricalAccuracy(name="accuracy")


def _get_metric(name):
    try:
        return keras.metrics.get(name)
    except ValueError:
        return None


def _reset(metrics):
    for metric in metrics:
        if isinstance(metric, keras.metrics.Metric):
            metric.reset_state()
