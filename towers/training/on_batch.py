"""keras.Model's train_on_batch and test_on_batch over towers: one batch, its logs as Keras's.

Keras resets the metrics before each *_on_batch call, so every log is the batch's own.
TowerTrainer.train_step is the step without that reset (its metric logs run since
reset_metrics(), as fit's run through an epoch); these two are it with the reset, and
return what Keras returns: the logs by name, or a list in Keras's order.
"""

from towers.training import class_weights, loop


def train_on_batch(trainer, x, y=None, sample_weight=None, class_weight=None,
                   return_dict=False):
    """One step on the batch (x, y[, sample_weight]), class_weight weighing its rows as
    keras.Model.train_on_batch weighs them; its logs as Keras's."""
    batch = _batch(x, y, sample_weight)
    batch = next(iter(class_weights.weighted([batch], class_weight)))
    trainer.metrics.reset()
    return loop.keras_logs(trainer, trainer.train_step(batch), return_dict)


def test_on_batch(trainer, x, y=None, sample_weight=None, return_dict=False):
    """The batch's loss and metrics, as keras.Model.test_on_batch computes them."""
    trainer.metrics.reset()
    return loop.keras_logs(trainer, trainer.eval_step(_batch(x, y, sample_weight)),
                           return_dict)


def _batch(x, y, sample_weight):
    return (x, y) if sample_weight is None else (x, y, sample_weight)

