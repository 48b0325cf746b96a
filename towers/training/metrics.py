"""The trainer's metrics, as keras.Model.compile takes them: checked, built on the first
batch, updated on the main device every step (summed across workers with a cluster)."""

import inspect

import keras
import tensorflow as tf

from towers import compat, errors
from towers.data_parallel import exchange, split
from towers.engine import losses

_ALIASES = ("accuracy", "acc")  # compile picks binary, categorical or sparse by shape


class Metrics:
    """`metrics` and `weighted_metrics` in every form keras.Model.compile takes them
    (a list for the outputs together, a list or dict per output, names or objects),
    computed by Keras's own container with Keras's names ("accuracy",
    "cls_accuracy", ...): `metrics` see masks but not sample weights,
    `weighted_metrics` both.

    Attributes:
      names: the names of the results, in order (known after `build`).
      variables: every metric's state variables (after `build`).
    """

    def __init__(self, metrics=(), weighted_metrics=None, output_names=None):
        """Raises ValueError, in one line, for a form or a name compile would not take."""
        for argument, given in (("metrics", metrics), ("weighted_metrics", weighted_metrics)):
            if given is None:
                continue
            if not isinstance(given, (list, tuple, dict)):
                raise ValueError(
                    f"{argument} must be a list (or a dict by output name) of metrics, as "
                    f"keras.Model.compile takes it, got {given!r}; e.g. {argument}=['accuracy'].")
            for metric in tf.nest.flatten(given):
                _check_metric(argument, metric)
        self._keras = compat.CompileMetrics(metrics or None, weighted_metrics,
                                            output_names=output_names)
        self.names = []

    @property
    def variables(self):
        return self._keras.variables

    # A sequence of the Keras metric objects (after build), as the trainer's metrics
    # were before compile's forms: trainer.metrics[0].result().
    def __iter__(self):
        return iter(self._keras.metrics)

    def __len__(self):
        return len(self._keras.metrics)

    def __getitem__(self, index):
        return self._keras.metrics[index]

    def build(self, y, outputs, sample_weight=None):
        """Builds every metric for targets `y` and (y_pred, masks) `outputs` (a batch's
        first examples, and their `sample_weight`); eagerly, on the device the metrics'
        variables should live on, before a step is traced.

        Keras's container makes the metric objects; a metric that creates its variables
        on its first update (F1Score, FBetaScore, R2Score, a user's) gets them from one
        update on these examples, as Keras's fit builds its metrics on the first batch
        before its step is traced. The update's assignments are dropped (StatelessScope:
        the new variables start at their initial values, on leaving it).

        Raises:
          ValueError: a metric that does not fit the model's outputs, in one line.
        """
        try:
            self._keras.build(y, losses.with_masks(outputs))
            with keras.StatelessScope():
                self._keras.update_state(y, losses.with_masks(outputs), sample_weight)
        except (ValueError, TypeError, KeyError, tf.errors.OpError) as error:
            raise ValueError(f"the metrics do not fit the model's outputs: "
                             f"{self._which_fails(y, outputs)}{errors.root_cause(error)}"
                             ) from None
        self.names = list(self._keras.result())
        self._keras.reset_state()  # a metric object given with a state of its own starts afresh

    def update(self, batch, outputs, device, cluster=None, keep_if=None):
        """Updates every metric with the whole batch on `device`; returns their results.

        outputs: (y_pred, masks) of the batch's rows, forward.forward's form.
        keep_if: None, or a bool scalar: where False, the metrics stay as they
          were (a step whose loss or gradients are not finite enters no log).

        With a cluster (`batch` is this worker's batch) the workers' updates are
        added up, so every worker holds the global batch's metrics. That is
        right for metrics whose state variables are sums (counts, totals,
        confusion matrices), as Keras's built-in metrics are.
        """
        variables = self.variables if cluster is not None or keep_if is not None else []
        before = [tf.identity(v.value) for v in variables]  # .value is the variable itself
        with tf.device(device):
            y, sample_weight = split.targets(batch)
            self._keras.update_state(y, losses.with_masks(outputs), sample_weight)
            values = [tf.identity(v.value) for v in variables]
            if cluster is not None and variables:
                added = exchange.sum_across_workers(
                    [value - old for value, old in zip(values, before)], cluster, device)
                values = [old + update for old, update in zip(before, added)]
            for variable, old, value in zip(variables, before, values):
                variable.assign(value if keep_if is None else tf.where(keep_if, value, old))
            return self.results()

    def _which_fails(self, y, outputs):
        """For a model of one output: 'metric NAME (CLASS) on labels of shape ... and
        outputs of shape ... per example: ' of the first metric that fails alone on
        them, with a hint for AUC; else ''."""
        y_pred = tf.nest.flatten(outputs[0])
        if len(y_pred) != 1 or not tf.is_tensor(y):
            return ""
        for metric in getattr(self._keras, "metrics", []):
            try:
                with keras.StatelessScope():
                    metric.update_state(y, y_pred[0])
            except (ValueError, TypeError, KeyError, tf.errors.OpError):
                hint = (" (AUC takes one probability per label, of the labels' shape: a "
                        "binary output, or multi_label=True with one-hot labels)"
                        if isinstance(metric, keras.metrics.AUC) else "")
                return (f"metric {metric.name!r} ({type(metric).__name__}) on labels of "
                        f"shape {tuple(y.shape[1:])} and outputs of shape "
                        f"{tuple(y_pred[0].shape[1:])} per example{hint}: ")
        return ""

    def results(self):
        """{name: result Tensor} of every metric."""
        if not self.names:
            return {}
        return dict(self._keras.result())

    def reset(self):
        """Resets every metric's state."""
        self._keras.reset_state()


def _check_metric(argument, metric):
    if isinstance(metric, keras.metrics.Metric) and not _takes_targets(metric):
        raise ValueError(
            f"{argument} entry {type(metric).__name__} is a metric of one value "
            "(update_state(values)); compile's metrics are called with (y_true, y_pred): "
            "pass keras.metrics.MeanMetricWrapper(fn) of a function (y_true, y_pred), or "
            "update it in a callback.")
    if metric is None or isinstance(metric, keras.metrics.Metric) or (
            callable(metric) and not isinstance(metric, str)):
        return
    if isinstance(metric, str) and (metric.lower() in _ALIASES or _known_metric(metric)):
        return
    raise ValueError(
        f"{argument} entry {metric!r} is not a keras.metrics.Metric, a metric function or "
        "a known metric name; pass e.g. 'accuracy' or keras.metrics.SparseCategoricalAccuracy().")


def _takes_targets(metric):
    """Whether metric.update_state takes (y_true, y_pred) by position, as compile calls
    it (Mean, Sum take one value: `values`)."""
    try:
        parameters = inspect.signature(metric.update_state).parameters.values()
    except (TypeError, ValueError):
        return True
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY,
                                                       p.POSITIONAL_OR_KEYWORD)]
    if any(p.kind == p.VAR_POSITIONAL for p in parameters):
        return True
    return len(positional) >= 2 and positional[1].name != "sample_weight"


def _known_metric(name):
    try:
        return keras.metrics.get(name) is not None
    except ValueError:
        return False
