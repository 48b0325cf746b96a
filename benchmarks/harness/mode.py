"""The one small interface every benchmarked set-up is behind: a Mode, built and ready
to time, and what every mode of one model shares (Setup, the optimizer, the loss)."""

import dataclasses
import functools
import time
from typing import Callable

import keras
import numpy as np
import tensorflow as tf

from benchmarks.harness import measure
from towers.data_parallel import split

LEARNING_RATE = 0.01
MOMENTUM = 0.9


class Unsupported(Exception):
    """The library does not (yet) offer what a mode asks for; the message says what."""


@dataclasses.dataclass(frozen=True)
class Setup:
    """What every mode of one model shares.

    Attributes:
      make_model: callable() -> a built keras.Model, identical weights every call;
        its variables go to the current device or strategy scope.
      x, y: the global batch in host memory, (B, H, W, C) float32 and (B,) int32.
    """
    make_model: Callable[[], keras.Model]
    x: np.ndarray
    y: np.ndarray

    @property
    def global_batch_size(self):
        return len(self.x)

    def shards(self, num_towers):
        """The batch split like towers.split_batch: sizes differ by at most one, larger first."""
        sizes = split.shard_sizes(self.global_batch_size, num_towers)
        bounds = np.cumsum([0] + sizes)
        return [(self.x[a:b], self.y[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]

    def dataset(self):
        """The whole batch as one tf.data element, repeated forever (no copy per step)."""
        return tf.data.Dataset.from_tensors((self.x, self.y)).repeat()


class Mode:
    """One way of training, built and ready to time.

    Attributes:
      name: e.g. "plain", "towers", "mirrored_custom".
      num_towers: how many devices it trains on.
      model: the keras.Model it trains (for independent: tower 0's copy).
      info: extra facts for results.json (options, cross-device ops).
    """

    def __init__(self, name, num_towers, step, model, info=None):
        self.name, self.num_towers, self.info = name, num_towers, dict(info or {})
        self.model, self._step = model, step

    def run(self, num_steps):
        """Runs `num_steps` training steps; returns each one's wall time in seconds."""
        return measure.wall_times(self._step, num_steps)  # the loss as a float: the sync

    def weights(self):
        """The weights now, as a list of NumPy arrays (for independent: tower 0's copy)."""
        return self.model.get_weights()


class ExecutionMode(Mode):
    """A mode that runs several steps per call: execute(max_steps) runs up to max_steps in one
    call (one host sync) and returns how many ran.

    Each sample is one call's time divided by its steps, as FitMode's, so such a
    mode has fewer samples.
    """

    def __init__(self, name, num_towers, execute, model, info=None):
        super().__init__(name, num_towers, None, model, info)
        self._execute = execute

    def run(self, num_steps):
        times, left = [], num_steps
        while left > 0:
            start = time.perf_counter()
            steps = self._execute(left)
            times.append((time.perf_counter() - start) / steps)
            left -= steps
        return times


class FitMode(Mode):
    """A mode trained by a fit method, keras.Model.fit (the default) or TowerTrainer.fit;
    steps are timed by a callback.

    With steps_per_execution=K fit calls back once per K steps, so each sample
    is one call's time divided by its steps: such a mode has fewer samples.
    """

    def __init__(self, name, num_towers, model, dataset, info=None, fit=None):
        super().__init__(name, num_towers, None, model, info)
        # shuffle=False: Keras's default True warns on every call that a Dataset ignores it.
        self._dataset = dataset
        self._fit = fit or functools.partial(model.fit, shuffle=False)

    def run(self, num_steps):
        timer = _StepTimer(num_steps)
        # Exactly num_steps batches: fit's in-graph loop stops at their end, so a last call
        # of fewer than K steps runs only those (as steps_per_epoch would not).
        self._fit(self._dataset.take(num_steps), epochs=1, verbose=False, callbacks=[timer])
        return timer.times


class _StepTimer(keras.callbacks.Callback):
    """Wall time per step of each call of fit's step function, from one call's end to the
    next (the first from its begin), divided by the steps the call ran.

    Both fits hand on_train_batch_end the logs as Python floats, every call
    (Keras converts them because the method is defined; TowerTrainer.fit always
    does): one host sync per call, as in the other modes (which make one call
    per step). Fit's set-up before the first call is not counted.
    """

    def __init__(self, num_steps):
        super().__init__()
        self.times, self._num_steps, self._first_step, self._last = [], num_steps, 0, None

    def on_train_batch_begin(self, batch, logs=None):
        self._first_step = batch  # the call's first step
        if self._last is None:
            self._last = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        # batch: the call's last step, first + K - 1 even where the data ended sooner.
        now = time.perf_counter()
        steps = min(batch + 1, self._num_steps) - self._first_step
        self.times.append((now - self._last) / steps)
        self._last = now


def make_optimizer():
    return keras.optimizers.SGD(LEARNING_RATE, momentum=MOMENTUM)


def make_loss(reduction="sum_over_batch_size"):
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)


def regularization(model):
    """The sum of the model's regularisation losses (0.0 without any)."""
    return tf.add_n(model.losses) if model.losses else 0.0
