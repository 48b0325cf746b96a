"""The outer loop around the tower step: epochs and evaluation.

The trainer owns the step; this module only decides which batches to feed it
and how to summarise what comes back.
"""

import itertools
import numbers
import time

import keras
from absl import logging

from towers import errors
from towers.errors import Preempted
from towers.training import callbacks as callbacks_lib, class_weights, executions, first_batch
from towers.training import inputs, preemption, progress, py_datasets, resume

def evaluate(trainer, data, steps=None, callbacks=None):
    """The loss over every example of `data` (+ regularisation), each loss term's, and the
    metrics, as keras.Model.evaluate computes them (each batch's loss weighed by its rows).

    `data`: an inputs.Data. `steps`: at most this many batches (None = until the data
    ends; fewer there are is warned of, as Keras does). `callbacks`: None or a
    keras.callbacks.CallbackList, whose on_test_* hooks are called as
    keras.Model.evaluate calls them.
    """
    callbacks = callbacks or keras.callbacks.CallbackList()
    trainer.row_counts.from_source("eval", data.batches)
    epoch_hooks = py_datasets.EpochHooks(data.batches)
    trainer.metrics.reset()
    callbacks.on_test_begin()
    epoch_hooks.before_fit()
    epoch_hooks.epoch_begins()
    means, logs, index = _LossMeans(trainer.objective), {}, -1
    for index, batch in enumerate(itertools.islice(data.batches, steps)):
        callbacks.on_test_batch_begin(index)
        batch_logs = trainer.eval_step(batch)
        means.add(batch_logs, steps=1)
        logs = _logs(trainer, means, batch_logs)
        callbacks.on_test_batch_end(index, logs)
    if not means.examples:
        raise ValueError("evaluate got no batches; pass a batch or a non-empty dataset.")
    if steps is not None and index + 1 < steps:
        executions.warn_ran_out()
    epoch_hooks.epoch_ends()
    callbacks.on_test_end(logs)
    return logs


def keras_logs(trainer, logs, return_dict):
    """What keras.Model.evaluate and *_on_batch return: "loss", each loss term's and the
    metrics (not towers' own "examples", "skipped_steps", ...), by name, or without
    return_dict as a list in that order (one number alone as it)."""
    names = ["loss", *trainer.objective.names, *trainer.metrics.names]
    if return_dict:
        return {name: logs[name] for name in names}
    return logs[names[0]] if len(names) == 1 else [logs[name] for name in names]


def fit(trainer, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None,
        validation_split=0.0, validation_data=None, shuffle=True, class_weight=None,
        sample_weight=None, initial_epoch=0, steps_per_epoch=None, validation_steps=None,
        validation_batch_size=None, validation_freq=1, *, max_steps=None, checkpointer=None,
        log_dir=None):
    """Runs epochs of tower steps; returns a keras.callbacks.History.

    The arguments up to validation_freq are keras.Model.fit's, meant as it means them:
      x, y, sample_weight, batch_size, shuffle: the data, in any form inputs.py lists:
        arrays (with y) batched as Keras batches them, a tf.data.Dataset, a
        keras.utils.PyDataset, an iterable of (x, y[, sample_weight]) batches, or (towers'
        own) a callable epoch -> one of those. A callable gives each epoch its own
        reproducible order, which is what lets a checkpoint resume in the middle of an
        epoch.
      epochs: the epoch to end at (counting epochs already done in a restored run, and
        initial_epoch, the one to start at).
      steps_per_epoch: batches per epoch; None = one pass over the data. Otherwise one
        iterator continues across epochs, and data that ends starts again as Keras's
        does (executions.SharedBatches).
      validation_split: the last fraction of the arrays' rows held out to validate on.
      validation_data: evaluated after each epoch whose number (from 1) validation_freq
        (an int: every that many; a list: those) names, "val_" logs; at most
        validation_steps batches; arrays batched by validation_batch_size or batch_size.
      verbose: "auto" (a progress bar on a terminal, else log lines), 0 or False
        (nothing), 1 or True (a progress bar), 2 (log lines).
      callbacks: keras.callbacks.Callback objects, called as keras.Model.fit
        calls them (see callbacks.py); a keras.callbacks.ProgbarLogger among
        them replaces the trainer's own progress output.
      class_weight: None, or {class index: weight}: each training batch's sample
        weights from its labels, as keras.Model.fit makes them (one output only,
        not with sample weights; validation is not weighted).
    towers' own, keyword-only:
      max_steps: stop once trainer.step reaches this many optimizer steps.
      checkpointer: a towers.Checkpointer of the trainer's model and optimizer
        (another is refused before any step); the run first resumes from its
        newest checkpoint (building an unbuilt model on the first batch first),
        saves as it goes and once at the end; the chief first takes its folder's
        lock (Checkpointer.lock: another live writer is refused before any step).
      log_dir: where TensorBoard summaries go (None = none).
      With a cluster only the chief saves checkpoints and writes summaries;
      every worker restores. A worker whose data ends before the others' takes
      part in their steps with an empty part; every worker's epoch ends after
      the last step any worker had a batch for (docs/multi_worker.md).

    The logs the callbacks and the History see are Keras's: "loss" (the mean
    over the epoch's examples so far) and the metrics, then "val_" ones; the
    epoch logs add "examples_per_sec" (all towers together, since the epoch
    began), and "loss_scale" with loss scaling.
    """
    if epochs is None:
        raise ValueError("epochs must be an integer >= 1, got None.")
    epochs, steps_per_epoch, max_steps, validation_steps = _positive_integers(
        epochs=epochs, steps_per_epoch=steps_per_epoch, max_steps=max_steps,
        validation_steps=validation_steps)
    initial_epoch = _epoch_number("initial_epoch", initial_epoch)
    should_validate = _validation_epochs(validation_freq)
    if verbose not in ("auto", 0, 1, 2):  # True and False are 1 and 0
        raise ValueError(f"verbose must be 'auto', 0 (silent), 1 (a progress bar) or 2 (log "
                         f"lines), as keras.Model.fit takes it, got {verbose!r}.")
    if validation_split and validation_data is None:
        (x, y, sample_weight), validation_data = inputs.split_for_validation(
            x, y, sample_weight, validation_split)
    train = inputs.data("x", x, y, sample_weight, batch_size=batch_size, shuffle=shuffle,
                        forms=f"{inputs.FORMS}, or a callable epoch -> one of those")
    if validation_data is not None:
        validation_data = inputs.validation(validation_data,
                                            validation_batch_size or batch_size)
    epoch_hooks = py_datasets.EpochHooks(train.batches)
    dataset = class_weights.weighted(train.batches, class_weight)
    if checkpointer is not None:
        if trainer.cluster is not None and trainer.options.variable_placement == "spread":
            raise ValueError("a checkpointer cannot save variable_placement='spread' in a "
                             "cluster yet: the chief writes, and each worker holds only its "
                             "own optimizer slots; use 'main'.")
        resume.check_binding(trainer, checkpointer)
    chief = trainer.cluster is None or trainer.cluster.is_chief
    saver = checkpointer if chief else None
    if saver is not None:  # one live writer per folder: a second run refused before any step
        saver.lock()
    summaries = progress.Summaries(log_dir if chief else None)  # a bad log_dir: before any work
    epoch, skip = initial_epoch, 0
    if checkpointer is not None:
        dataset = resume.build_for_restore(trainer, checkpointer, dataset)
        if checkpointer.restore():
            epoch, skip = int(checkpointer.epoch), int(checkpointer.batch_in_epoch)
    if validation_data is not None:  # refused before the first epoch, not after it
        dataset = first_batch.set_up_before_fit(trainer, dataset, "to check validation_data")
        validation_data = validation_data._replace(
            batches=first_batch.check_validation(trainer, validation_data.batches))
    history, callbacks, own_progress = callbacks_lib.callback_list(
        trainer, callbacks, epochs, steps_per_epoch, verbose)
    shared = (executions.SharedBatches(train._replace(batches=dataset))
              if steps_per_epoch and not callable(dataset) else None)
    callbacks.on_train_begin()
    epoch_hooks.before_fit()
    epoch_logs = None
    with preemption.StopSignals() as signals:
        callbacks = preemption.InterruptibleCallbacks(callbacks, signals)
        while epoch < epochs and not _reached(trainer, max_steps):
            if signals.received and trainer.cluster is None:  # between epochs
                _stop(trainer, checkpointer, saver, signals, (epoch, skip))
            trainer.metrics.reset()
            callbacks.on_epoch_begin(epoch)
            epoch_hooks.epoch_begins()
            steps = executions.EpochSteps(trainer, dataset, epoch, steps_per_epoch, skip,
                                           shared and shared.iterator)
            shown = progress.Progress(epoch, epochs, steps_per_epoch,
                                      verbose if own_progress else False)
            start, means, batch_index, logs = time.perf_counter(), _LossMeans(trainer.objective), skip, {}
            broke_off = False

            def before_step():
                callbacks.on_train_batch_begin(batch_index)
                if signals.received:
                    trainer.request_stop()  # with a cluster, every worker stops after this step

            while (execution := steps.run(before_step, executions.limit(
                    trainer, batch_index, steps_per_epoch, max_steps))) is not None:
                logs, ran, logged_steps = execution
                batch_index += ran
                means.add(logs, logged_steps)
                logs["examples_per_sec"] = means.examples / (time.perf_counter() - start)
                shown.update(batch_index, logs)
                summaries.train(trainer, logs)
                if saver is not None:
                    saver.batch_done(epoch, batch_index, ran)
                callbacks.on_train_batch_end(batch_index - 1, _logs(trainer, means, logs))
                if logs.pop("stop_requested", signals.received):
                    _stop(trainer, checkpointer, saver, signals,
                          _next_position(epoch, batch_index, steps_per_epoch))
                if _reached(trainer, max_steps) or trainer.model.stop_training:
                    broke_off = True
                    break
            if not broke_off:
                epoch_hooks.epoch_ends()
            if shared is not None:
                shared.epoch_ended(batch_index - skip,
                                   ran_out=not broke_off and batch_index < steps_per_epoch)
            elif batch_index == skip:
                if skip:  # resumed after the last batch of an epoch of unknown length
                    epoch, skip = epoch + 1, 0
                    continue
                logging.warning("epoch %d got no batches: the dataset ran out; stopping.",
                                epoch + 1)
                break
            epoch_logs = _logs(trainer, means)
            epoch_logs.update({name: logs[name] for name in ("examples_per_sec", "loss_scale")
                               if name in logs})
            if validation_data is not None and should_validate(epoch + 1):
                val_logs = evaluate(trainer, validation_data, validation_steps, callbacks)
                epoch_logs.update({f"val_{name}": value for name, value in val_logs.items()})
                summaries.evaluation(trainer, val_logs)
            shown.finish(batch_index, {**epoch_logs,
                                       "skipped_steps": logs.get("skipped_steps", 0)})
            callbacks.on_epoch_end(epoch, epoch_logs)
            epoch, skip = (_next_position(epoch, batch_index, steps_per_epoch) if broke_off
                           else (epoch + 1, 0))
            if trainer.model.stop_training:
                break
        if saver is not None:
            saver.save(epoch, skip)
    callbacks.on_train_end(logs=epoch_logs)
    return history


def _next_position(epoch, batches_done, steps_per_epoch):
    """(epoch, batch) of the next batch to train on after `batches_done` of `epoch`."""
    return (epoch + 1, 0) if batches_done == steps_per_epoch else (epoch, batches_done)


def _stop(trainer, checkpointer, saver, signals, position):
    """After a stop signal: saves the exact position (the chief) and raises Preempted."""
    if saver is not None:
        saver.save(*position)
    # Every worker of a cluster stops after the same step and says the same line.
    raise Preempted(signals.received if trainer.cluster is None else "SIGTERM or SIGINT to a "
                    "worker", trainer.step, None if checkpointer is None else checkpointer.directory)


def _logs(trainer, means, step_logs=None):
    """Keras's logs: the loss means so far (_LossMeans), then each metric's result, as floats.

    step_logs: the logs of the step just run, which hold the metric results
    already (read with the step's one device-to-host read); None = read them.
    """
    if step_logs is None:
        step_logs = {name: float(value) for name, value in trainer.metrics.results().items()}
    return {**means.means(), **{name: step_logs[name] for name in trainer.metrics.names}}


class _LossMeans:
    """Running means of the loss logs as Keras's trackers keep them: "loss" over the
    examples in the logs (each call's value weighed by its "examples"), each loss
    term's ("cls_loss", ...) over the steps in the logs (Keras weighs those by the
    batch's static size, which its traced step does not know: each batch counts
    once). A step that was not finite is in neither, so it adds nothing."""

    def __init__(self, objective):
        self._objective, self._sums, self.examples, self._steps = objective, {}, 0, 0

    def add(self, logs, steps):
        """Adds one call's logs (its "examples" popped) of `steps` logged steps."""
        examples = int(logs.pop("examples"))
        if examples:
            self._sums["loss"] = self._sums.get("loss", 0.0) + logs["loss"] * examples
            for name in self._objective.names:
                self._sums[name] = self._sums.get(name, 0.0) + logs[name] * steps
            self.examples, self._steps = self.examples + examples, self._steps + steps

    def means(self):
        """{name: mean}; 0 while nothing has entered the logs (as a Keras Mean reads)."""
        means = {"loss": self._sums.get("loss", 0.0) / max(self.examples, 1)}
        for name in self._objective.names:
            means[name] = self._sums.get(name, 0.0) / max(self._steps, 1)
        return means


def _reached(trainer, max_steps):
    return max_steps is not None and trainer.step >= max_steps


def _positive_integers(**values):
    """The values, each None or an integer >= 1 (any integral number, np.int64(3) too),
    as Python ints; ValueError, naming it, for anything else (a float, a bool, 0)."""
    return tuple(None if value is None else errors.positive_integer(name, value)
                 for name, value in values.items())


def _epoch_number(name, value):
    """`value` as a Python int where it is an integer >= 0; ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0 (an epoch's index), got {value!r}.")
    return int(value)


def _validation_epochs(validation_freq):
    """validation_freq as keras.Model.fit takes it, as a test of an epoch's number (from
    1): an integer N (every N-th epoch) or a list of epoch numbers."""
    if isinstance(validation_freq, (list, tuple)):
        epochs = {_epoch_number("validation_freq's epochs", epoch) for epoch in validation_freq}
        return epochs.__contains__
    every = errors.positive_integer("validation_freq", validation_freq)
    return lambda epoch: epoch % every == 0
