"""What fit shows and writes as it goes: a progress bar or log lines per epoch
(`Progress`), and TensorBoard scalars (`Summaries`)."""

import sys

import keras
import tensorflow as tf
from absl import logging

from towers import errors


class Progress:
    """A keras.utils.Progbar on a terminal, else an absl log line every ~10% of an epoch."""

    def __init__(self, epoch, epochs, steps, verbose):
        self._header = f"epoch {epoch + 1}/{epochs}"
        auto = verbose == "auto"  # else 0, 1 or 2 (False and True are 0 and 1)
        show_bar = sys.stdout.isatty() if auto else verbose == 1
        self._log_lines = not show_bar if auto else verbose == 2
        self._log_every = max(1, steps // 10) if steps else 10
        self._bar = None
        if show_bar:
            print(self._header)
            self._bar = keras.utils.Progbar(steps, stateful_metrics=["examples_per_sec"])

    def update(self, batch_index, logs):
        if self._bar is not None:
            self._bar.update(batch_index, _bar_values(logs))
        elif self._log_lines and batch_index % self._log_every == 0:
            logging.info("%s, batch %d: %s", self._header, batch_index, _format(logs))

    def finish(self, batch_index, epoch_logs):
        if self._bar is not None:
            self._bar.update(batch_index, _bar_values(epoch_logs), finalize=True)
        elif self._log_lines:
            logging.info("%s done: %s", self._header, _format(epoch_logs))


class Summaries:
    """TensorBoard scalars: train/* every step, eval/* after each evaluation."""

    def __init__(self, log_dir):
        """Raises ValueError, in one line, for a log_dir that cannot hold summaries."""
        try:
            self._writer = tf.summary.create_file_writer(log_dir) if log_dir else None
        except (tf.errors.OpError, TypeError) as error:
            raise ValueError(f"log_dir={log_dir!r} cannot hold TensorBoard summaries: "
                             f"{errors.root_cause(error)}; give a folder that can be made "
                             "and written.") from None

    def train(self, trainer, logs):
        if self._writer is None:  # reading the step and learning rate costs host syncs
            return
        learning_rate = float(keras.ops.convert_to_numpy(trainer.optimizer.learning_rate))
        self._write("train", trainer.step, {**logs, "learning_rate": learning_rate})

    def evaluation(self, trainer, logs):
        self._write("eval", trainer.step, logs)

    def _write(self, prefix, step, logs):
        if self._writer is None:
            return
        with self._writer.as_default(step=step):
            for name, value in logs.items():
                tf.summary.scalar(f"{prefix}/{name}", value)
        self._writer.flush()


def _bar_values(logs):
    return [(name, value) for name, value in logs.items() if name != "skipped_steps"]


def _format(logs):
    """'loss=0.1234, accuracy=0.9' for a log line; skipped_steps only once there are some."""
    return ", ".join(f"{k}={v:.4g}" for k, v in logs.items()
                     if k != "skipped_steps" or v)
