"""Keras metrics on the towers' outputs: checked, built on the first batch, updated
on the main device every step (summed across workers with a cluster)."""

import keras
import tensorflow as tf

from towers.data_parallel import exchange, split

_ACCURACY_NAMES = ("accuracy", "acc")


def resolve(metrics):
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


def build(metrics, y, y_pred):
    """Replaces "accuracy" in `metrics` (in place) by the accuracy that fits y and y_pred."""
    for i, metric in enumerate(metrics):
        if isinstance(metric, str):
            metrics[i] = _accuracy_for(y, y_pred)


def update(metrics, batch, y_pred, device, cluster=None):
    """Updates every metric with the whole batch on `device`; returns their results.

    With a cluster (`batch` is this worker's part) the workers' updates are
    added up, so every worker holds the global batch's metrics. That is
    right for metrics whose state variables are sums (counts, totals,
    confusion matrices), as Keras's built-in metrics are.
    """
    variables = [v for metric in metrics for v in metric.variables] if cluster else []
    before = [tf.identity(v.value) for v in variables]  # .value is the variable itself
    with tf.device(device):
        y, sample_weight = split.targets(batch)
        for metric in metrics:
            metric.update_state(y, y_pred, sample_weight=sample_weight)
        if variables:
            added = exchange.sum_across_workers(
                [v.value - old for v, old in zip(variables, before)], cluster, device)
            for variable, old, update in zip(variables, before, added):
                variable.assign(old + update)
        return {metric.name: metric.result() for metric in metrics}


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


def reset(metrics):
    """Resets every built metric (an unbuilt \"accuracy\" has nothing to reset)."""
    for metric in metrics:
        if isinstance(metric, keras.metrics.Metric):
            metric.reset_state()
