"""What a training or evaluation call's logs say beyond the numbers, raised in one
line: a step that was not finite, a batch the step refused (float class ids that are
not whole numbers, in evaluation too; in an in-graph loop, an empty batch) and weights
made NaN or Inf outside the step, which on_nonfinite="skip" would skip over forever."""

import math

import numpy as np

from towers.engine import sparse_labels
from towers.errors import NonFiniteError


def after_step(trainer, logs, finite, applied):
    """After TowerTrainer.train_step's call: pops the step's refusal from `logs` and
    raises for it; returns the steps it skipped (0 or 1)."""
    _check_labels(logs)
    if not finite and trainer.options.on_nonfinite == "raise":
        raise nonfinite_error(trainer)
    # A step of no rows (every worker's data ended) is not a skipped one.
    skipped = int(not applied and not logs.get("data_ended"))
    if skipped:
        check_weights_finite(trainer)
    return skipped


def after_eval(logs):
    """After TowerTrainer.eval_step's call: raises for fractional class ids; `logs`
    without the step's refusal."""
    _check_labels(logs)
    return logs


def after_steps(trainer, logs, steps, skipped):
    """After TowerTrainer.train_steps' call of `steps` steps (`skipped` of them skipped):
    pops the loop's refusals from `logs` and raises for them; the steps before the one
    refused are applied, it and later ones not."""
    nonfinite, empty = logs.pop("nonfinite"), logs.pop("empty_batch")
    _check_labels(logs)
    if nonfinite:
        raise nonfinite_error(trainer)
    if empty:
        raise ValueError(f"the batch is empty (batch size 0): batch {steps + 1} of this "
                         f"call of train_steps; give at least one example. The {steps} "
                         "step(s) before it were applied, nothing of it or after it.")
    if skipped:
        check_weights_finite(trainer)


def nonfinite_error(trainer):
    return NonFiniteError(
        f"step {trainer.step + 1}: the loss or the averaged gradients are NaN or "
        "Inf, so nothing was applied. Lower the learning rate, check the data, "
        "or pass on_nonfinite='skip' to skip such steps.")


def check_weights_finite(trainer):
    """Raises NonFiniteError where a weight the step trains is NaN or Inf: set so outside
    the step (a callback, set_weights; a step never applies a non-finite update), every
    later step would be skipped and a checkpoint would keep them. Read only after a
    skipped step; without a cluster (each worker reads its own weights)."""
    if trainer.cluster is not None:
        return
    bad = [v.path for v in trainer.optimized_variables
           if not np.isfinite(np.asarray(v.numpy())).all()]
    if bad:
        raise NonFiniteError(
            f"step {trainer.step + 1}: the model's weights {bad[:3]}"
            f"{' and more' if len(bad) > 3 else ''} hold NaN or Inf, set outside the step "
            "(a callback, set_weights): every step would be skipped as not finite; restore "
            "finite weights (a checkpoint) before training on.")


def _check_labels(logs):
    value = logs.pop("fractional_label", math.nan)
    if not math.isnan(value):
        raise sparse_labels.fractional_label_error(value)
