"""Checkpoints that survive a crash: model, optimizer, step and the position in the data.

A save writes the checkpoint files first and only then, atomically, the
`checkpoint` index that names the newest one (tf.train.CheckpointManager), so
a process killed mid-save leaves the index on the previous, complete
checkpoint: a half-written checkpoint is never loaded.
"""

import os
import tempfile

import tensorflow as tf
from absl import logging

from towers.op_parallel import joined, plan as op_plan


class Checkpointer:
    """Saves and restores a training run in `directory`.

    Attributes:
      directory: where the checkpoints go.
      every_steps: save after every this many batches (None = only when asked).
      writer: False on every worker but the chief of a cluster: it restores
        the chief's checkpoints and never writes (fit saves on the chief only
        anyway), so `directory` need not be writable there.
      epoch, batch_in_epoch: int64 tf.Variables, the position in the data of
        the next batch to train on; saved with the model and optimizer.
    """

    def __init__(self, directory, model, optimizer, every_steps=None, max_to_keep=3,
                 writer=True):
        if every_steps is not None and (isinstance(every_steps, bool)
                                        or not isinstance(every_steps, int) or every_steps < 1):
            raise ValueError(f"every_steps must be a positive integer or None, got {every_steps!r}.")
        if writer:
            _check_writable(directory)
        self.directory = directory
        self.writer = writer
        self.every_steps = every_steps
        self.epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch")
        self.batch_in_epoch = tf.Variable(0, dtype=tf.int64, trainable=False,
                                          name="batch_in_epoch")
        # A split model is saved as its unsplit twin: its checkpoints restore with any
        # number of parts, with none, and into join_layers' model.
        self._twin = joined.JoinedTwin(model, optimizer) if op_plan.is_split(model) else None
        if self._twin is not None:
            model, optimizer = self._twin.model, self._twin.optimizer
        self._checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer,
                                               epoch=self.epoch,
                                               batch_in_epoch=self.batch_in_epoch)
        self._manager = tf.train.CheckpointManager(self._checkpoint, directory, max_to_keep)
        self._batches_since_save = 0

    def restore(self):
        """Loads the newest readable checkpoint, if any; returns its path or None.

        The model and optimizer must be built. A checkpoint whose files are
        unreadable is skipped for the one before it, with a warning.

        Raises:
          ValueError: the checkpoint holds a different model or optimizer.
        """
        for path in reversed(self._manager.checkpoints):
            try:
                status = self._checkpoint.restore(path)
                status.assert_existing_objects_matched()
            except (tf.errors.OpError, IndexError) as error:  # IndexError: a truncated file
                logging.warning("checkpoint %s is unreadable (%s); trying the one before.",
                                path, str(getattr(error, "message", error)).splitlines()[0])
                continue
            except (AssertionError, ValueError) as error:
                detail = str(error).strip().splitlines()[0]
                raise ValueError(
                    f"the checkpoint {path} does not match this model and optimizer "
                    f"({detail}); use another --checkpoint_dir, or delete this one to start "
                    "over. Nothing was overwritten.") from None
            if self._twin is not None:
                self._twin.split()
            logging.info("restored %s: epoch %d, batch %d of that epoch", path,
                         int(self.epoch), int(self.batch_in_epoch))
            return path
        return None

    def batch_done(self, epoch, batch_in_epoch, batches=1):
        """Records the position after `batches` more batches (an execution of several steps
        counts them all); saves when `every_steps` batches have passed since the last save."""
        self._batches_since_save += batches
        if self.every_steps and self._batches_since_save >= self.every_steps:
            self.save(epoch, batch_in_epoch)

    def save(self, epoch, batch_in_epoch):
        """Saves now, recording that training continues at (epoch, batch_in_epoch).

        Returns the checkpoint's path, or None when this is not the writer.
        """
        if not self.writer:
            return None
        self.epoch.assign(epoch)
        self.batch_in_epoch.assign(batch_in_epoch)
        if self._twin is not None:
            self._twin.join()
        path = self._manager.save()
        self._batches_since_save = 0
        logging.info("saved checkpoint %s", path)
        return path


def _check_writable(directory):
    """Raises ValueError, before any training, if `directory` cannot hold checkpoints."""
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-test"):
            pass
    except OSError as error:
        raise ValueError(
            f"cannot write checkpoints to {directory!r}: {error.strerror or error}; choose a "
            "writable --checkpoint_dir.") from None
