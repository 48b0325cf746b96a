"""Checkpoints that survive a crash: model, optimizer, step and the position in the data.

A save writes the checkpoint files first and only then, atomically, the
`checkpoint` index that names the newest one (tf.train.CheckpointManager), so
a process killed mid-save leaves the index on the previous, complete
checkpoint: a half-written checkpoint is never loaded.

A folder belongs to one run: its record (run_record) says which, its lock
(folder_lock) lets one live process write it, and one whose checkpoints cannot be
read is refused rather than started again from step 0 (checkpoint_folder).
"""

import contextlib
import os
import shutil
import tempfile

import keras
import tensorflow as tf
from absl import logging

from towers import errors
from towers.training import (checkpoint_folder, checkpoint_match, checkpoint_twin,
                             folder_lock, run_record)

OPTIMIZER_CLASS = "optimizer_class"  # the checkpoint's record of the optimizer's class


class Checkpointer:
    """Saves and restores a training run in `directory`.

    Attributes:
      directory: where the checkpoints go.
      model, optimizer: what it saves and restores, as given (fit refuses a
        checkpointer bound to another model or optimizer than its trainer's).
      every_steps: save after every this many batches (None = only when asked).
      writer: False on every worker but the chief of a cluster: it restores
        the chief's checkpoints and never writes (fit saves on the chief only
        anyway), so `directory` need not be writable there.
      epoch, batch_in_epoch: int64 tf.Variables, the position in the data of
        the next batch to train on; saved with the model and optimizer.
      run: a run_record.RunIdentity (towers.RunIdentity): the data order a resume must
        keep and the settings it may change, recorded with the first checkpoint.
    """

    def __init__(self, directory, model, optimizer, every_steps=None, max_to_keep=3,
                 writer=True, run=None):
        if not isinstance(directory, (str, os.PathLike)):
            raise ValueError(f"directory must be a folder path (a str), got "
                             f"{type(directory).__name__}.")
        if not isinstance(model, keras.Model):
            raise ValueError(f"model must be a keras.Model, got {type(model).__name__}.")
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise ValueError(f"optimizer must be a keras.optimizers.Optimizer, got "
                             f"{type(optimizer).__name__}.")
        if every_steps is not None:
            every_steps = errors.positive_integer("every_steps", every_steps)
        if run is not None and not isinstance(run, run_record.RunIdentity):
            raise ValueError(f"run must be a towers.RunIdentity(data_order=..., settings=...), "
                             f"got {type(run).__name__}.")
        if writer:
            _check_writable(directory)
        checkpoint_folder.check_index(directory)  # before the manager reads the index
        self.directory = directory
        self.run = run or run_record.RunIdentity()
        self._settings = run_record.given_settings(optimizer, self.run)
        self.model, self.optimizer = model, optimizer
        self.writer = writer
        self.every_steps = every_steps
        self.epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch")
        self.batch_in_epoch = tf.Variable(0, dtype=tf.int64, trainable=False,
                                          name="batch_in_epoch")
        self._directory, self._max_to_keep = directory, max_to_keep
        self._twin = None
        self._locked = False
        self._bind()
        self._batches_since_save = 0
        self._check_readable()

    def _bind(self):
        """Makes what tf.train.Checkpoint saves: the model and optimizer, or, for a model
        that holds weights or slots in pieces (split layers, spread placement's slabs),
        their whole twin (checkpoint_twin), so that its checkpoints restore with any
        number of parts or towers, with none, and into join_layers' model. Called again
        before a save or restore: spread placement holds a model's variables as slabs
        when its trainer first sees it built."""
        model, optimizer = self.model, self.optimizer
        if checkpoint_twin.needs_twin(model):
            self._twin = checkpoint_twin.WholeTwin(model, optimizer)
            model, optimizer = self._twin.model, self._twin.optimizer
        self._optimizer_class = optimizer_class(optimizer)
        with tf.device("/device:CPU:0"):  # a string lives on the host
            class_record = tf.Variable(self._optimizer_class, trainable=False,
                                       name=OPTIMIZER_CLASS)
        self._checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer,
                                               epoch=self.epoch,
                                               batch_in_epoch=self.batch_in_epoch,
                                               **{OPTIMIZER_CLASS: class_record})
        self._manager = tf.train.CheckpointManager(self._checkpoint, self._directory,
                                                   self._max_to_keep)

    def _as_saved(self):
        """While inside, the objects are tracked as the checkpoint names them (the twin's)."""
        return contextlib.nullcontext() if self._twin is None else self._twin.tracked()

    def _bind_twin_if_needed(self):
        if self._twin is None and checkpoint_twin.needs_twin(self.model):
            self._bind()

    def has_checkpoint(self):
        """Whether the directory holds a checkpoint for restore() to load."""
        return bool(self._paths())

    def lock(self):
        """Makes this process the folder's one live writer while this Checkpointer lives
        (folder_lock); fit calls it on the chief, save() on any writer. Raises ValueError,
        in one line, while another live process holds it."""
        if self.writer and not self._locked:
            folder_lock.acquire(self._directory, owner=self)
            self._locked = True

    def _paths(self):
        """The checkpoints restore() tries, newest first: the index's; without an index,
        the complete ones the folder holds (checkpoint_folder)."""
        paths = self._manager.checkpoints
        if not paths and not os.path.exists(os.path.join(self._directory,
                                                         checkpoint_folder.INDEX_FILE)):
            paths = checkpoint_folder.unindexed(self._directory)
        return list(reversed(paths))

    def _check_readable(self):
        """Raises ValueError, in one line, when the folder holds checkpoints and none can
        be read."""
        paths, reason = self._paths(), None
        for path in paths:
            try:
                tf.train.load_checkpoint(path)
                return
            except (tf.errors.OpError, IndexError) as error:
                reason = reason or _phrase(error)
        if paths:
            raise checkpoint_folder.none_readable(self._directory, paths[::-1], reason)

    def _record(self):
        """This run as the folder records it (run_record.describe)."""
        return run_record.describe(self._checkpoint.model, self._optimizer_class, self.run,
                                   self._settings)

    def restore(self):
        """Loads the newest readable checkpoint, if any, whole; returns its path or None.

        Before anything is assigned, the checkpoint is compared with the model
        and optimizer: every variable of theirs must have a value of its shape
        and dtype there, every table of theirs (that saves its own keys and
        values) its values, every value there must be one of theirs, and the
        optimizer must be of the class that wrote it. Model and optimizer must
        be built (fit builds them). A checkpoint whose files are unreadable is
        skipped for the one before it, with a warning. The run is compared with the
        folder's record (run_record): another model, optimizer class or data order is
        refused; the learning rate this run was given is applied where it changed, and
        changed settings are said in one log line.

        Raises:
          ValueError: the model or optimizer is not built, the checkpoint holds
            another model or optimizer, the folder's record another run, or no
            checkpoint is readable; nothing is restored and nothing written.
        """
        paths = self._paths()
        if not paths:
            return None
        self._check_built()
        self._bind_twin_if_needed()
        recorded, reason = run_record.read(self._directory), None
        for path in paths:
            try:
                reader = tf.train.load_checkpoint(path)
                with self._as_saved():
                    mismatch = self._difference(reader)
                    if mismatch is None:
                        current = self._record()
                        if recorded is not None:
                            run_record.check(recorded, current, self._directory,
                                             self.run.flag_prefix)
                        self._checkpoint.restore(path)
            except (tf.errors.OpError, IndexError) as error:  # IndexError: a truncated file
                reason = reason or _phrase(error)
                logging.warning("checkpoint %s is unreadable (%s); trying the one before.",
                                path, _phrase(error))
                continue
            if mismatch is not None:
                raise ValueError(
                    f"the checkpoint {path} does not match this model and optimizer: "
                    f"{mismatch}. Build them as the run that wrote it did, use another "
                    "checkpoint directory, or delete this one to start over. Nothing was "
                    "restored or overwritten.")
            if self._twin is not None:
                self._twin.split()
            if recorded is not None:
                run_record.apply_learning_rate(self.optimizer, recorded, self._settings)
            if not self._manager.checkpoints:
                logging.warning("the folder %s has no checkpoint index (a run stopped before "
                                "its first index was written leaves none); restored %s, the "
                                "newest readable checkpoint file.", self._directory, path)
            logging.info("restored %s: epoch %d, batch %d of that epoch", path,
                         int(self.epoch), int(self.batch_in_epoch))
            if recorded is not None:
                run_record.log_changes(path, run_record.changes(recorded, current,
                                                                self.run.flag_prefix))
            return path
        raise checkpoint_folder.none_readable(self._directory, paths[::-1], reason)

    def _check_built(self):
        """Raises ValueError unless every variable a restore fills exists (a split
        model's twin is built with it)."""
        model, optimizer = self._checkpoint.model, self._checkpoint.optimizer
        unbuilt = [name for name, built in (("model", model.built),
                                            ("optimizer", optimizer.built)) if not built]
        if unbuilt:
            raise ValueError(
                f"cannot restore into an unbuilt {' and '.join(unbuilt)}: the variables do "
                "not exist yet, so the checkpoint cannot be matched with them. Call the "
                "model on a batch and optimizer.build(trainer.optimized_variables) first "
                "(fit does both).")

    def _difference(self, reader):
        """What differs between the checkpoint `reader` reads and the objects restored,
        in one phrase (the optimizer's class first); None if nothing does."""
        key = OPTIMIZER_CLASS + checkpoint_match.VALUE_SUFFIX
        saved = checkpoint_match.saved_state(self._checkpoint)
        if reader.has_tensor(key):
            written_with = reader.get_tensor(key).decode()
            if written_with != self._optimizer_class:
                return (f"it was written with optimizer {written_with}, and this one is "
                        f"{self._optimizer_class}")
        else:  # written before the class was recorded: the variables alone decide
            del saved.variables[key]
        return checkpoint_match.difference(reader, saved,
                                           named_first=self._checkpoint.model.weights)

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
        self.lock()
        self.epoch.assign(epoch)
        self.batch_in_epoch.assign(batch_in_epoch)
        self._bind_twin_if_needed()
        if self._twin is not None:
            self._twin.join()
        # The record is checked before the folder's checkpoints are added to, and written
        # first where none of them is this run's yet, after the save too (its settings
        # are those of the run that wrote the newest checkpoint).
        current, recorded = self._record(), run_record.read(self._directory)
        ours = recorded is not None and self._paths()
        if ours:
            run_record.check(recorded, current, self._directory, self.run.flag_prefix)
        with self._as_saved():
            path = self._save_or_keep_the_newest(current, record_first=not ours)
        self._batches_since_save = 0
        logging.info("saved checkpoint %s", path)
        return path

    def _save_or_keep_the_newest(self, record, record_first):
        """Saves, with the folder's `record` written after (and before, where
        record_first); returns the new checkpoint's path. Where it cannot be written,
        CheckpointWriteError in one line, its unfinished files removed and the index
        still on the newest complete checkpoint (CheckpointManager writes the index
        last; the record is replaced whole or not at all)."""
        try:
            if record_first:
                run_record.write(self._directory, record)
            path = self._manager.save()
            run_record.write(self._directory, record)
            return path
        except (tf.errors.OpError, OSError) as error:
            _remove_unfinished(self.directory)
            kept = self._manager.latest_checkpoint
            raise errors.CheckpointWriteError(
                f"cannot save the checkpoint of step {int(self.optimizer.iterations)} in "
                f"{os.fspath(self.directory)!r} ({_why(error)}): "
                + (f"the newest complete one, {os.path.basename(kept)}, is kept" if kept else
                   "no checkpoint was complete yet") +
                "; free space or make the folder writable (or give another checkpoint "
                "directory), then run again to resume.") from None


def _why(error):
    """What went wrong in a failed write, without the file's path: TensorFlow's file
    errors read "<path>; No space left on device"."""
    return errors.root_cause(error).rpartition("; ")[2]


def _remove_unfinished(directory):
    """Removes what a failed save leaves in `directory`: TensorFlow's `<prefix>_temp`
    folder of the unmerged shards, and a `checkpoint.tmp*` index never renamed."""
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if name.endswith("_temp") and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        elif name.startswith("checkpoint.tmp"):
            with contextlib.suppress(OSError):
                os.remove(path)


def optimizer_class(optimizer):
    """The optimizer's class as a checkpoint records it: "Adam", "LossScaleOptimizer(SGD)"."""
    inner = getattr(optimizer, "inner_optimizer", None)
    name = type(optimizer).__name__
    return name if inner is None else f"{name}({optimizer_class(inner)})"


def _phrase(error):
    """An error's first line."""
    return str(getattr(error, "message", error)).splitlines()[0]


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
