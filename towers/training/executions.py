"""Several training steps per call of one compiled function (steps_per_execution).

fit runs an epoch as `EpochSteps`: executions of up to steps_per_execution steps, never
past the epoch's end or max_steps (`limit`), each a call of train_step or of the
in-graph loop (training/in_graph_loop.py: TowerTrainer.train_steps).
"""

import itertools

import tensorflow as tf
from absl import logging

from towers import errors
from towers.data_parallel import split
from towers.training import prefetch


class EpochSteps:
    """One epoch's batches from batch number `skip` on, run one step per call of the
    trainer, or trainer.steps_per_execution steps per call when they come from a
    tf.data.Dataset (other iterables run a step at a time). A Dataset's batches
    come split, each shard on its tower's device, with trainer.prefetch_to_devices;
    the compiled loop then reads them even at one step per call, which saves
    reading the devices' iterators one by one from Python.

    With a cluster, a worker whose batches end first takes part in the other
    workers' steps with an empty part; the epoch ends on every worker after the
    last step any worker had a batch for (docs/multi_worker.md).
    """

    def __init__(self, trainer, dataset, epoch, steps_per_epoch, skip, shared_iterator):
        self._trainer, self._epoch, self._position = trainer, epoch, skip
        data, first = shared_iterator, 0  # first: batches to skip here, not in tf.data
        if data is None:
            data = dataset(epoch) if callable(dataset) else dataset
            if not isinstance(data, tf.data.Dataset):
                first = skip
            elif trainer.prefetch_to_devices:
                data = trainer.shard_iterator(data.skip(skip))
            else:
                data = data.skip(skip)
        trainer.row_counts.from_source("train", data)
        self._in_graph = isinstance(data, prefetch.ShardIterator) or (
            trainer.steps_per_execution > 1
            and isinstance(data, (tf.data.Dataset, tf.data.Iterator)))
        self._iterator = iter(data)
        # With a cluster, what this worker's empty part is shaped like once its data has
        # ended: the last batch skipped or run here, else a Dataset's element_spec, else
        # (None) the last batch the trainer trained on.
        self._like = getattr(data, "element_spec", None)
        for batch in itertools.islice(self._iterator, first):
            self._like = batch
        self._every_data_ended = False  # with a cluster: the epoch is over for all
        self._said_data_ended = False

    def run(self, before_step, limit):
        """Runs the next execution of at most `limit` steps (an int, see _limit).

        Calls before_step() first. Returns (logs, steps run, steps in the logs),
        the logs with "examples" (those they cover), or None when the epoch's
        batches or `limit` ran out.
        """
        if limit == 0 or self._every_data_ended:
            return None
        if self._in_graph:
            before_step()
            logs = self._trainer.train_steps(self._iterator, limit)
            steps = logs.pop("steps")
        else:
            batch = next(self._iterator, None)
            if batch is None and self._trainer.cluster is None:
                return None
            before_step()
            if batch is None:  # this worker's data has ended, maybe not the others'
                empty = None if self._like is None else split.empty_like(self._like)
                logs = self._trainer.train_step(empty, data_ended=True)
                logs["worker_batches"] = 0
            else:
                self._like = batch
                logs = self._trainer.train_step(batch)
            steps = 0 if logs.get("data_ended") else 1
        self._every_data_ended = bool(logs.pop("data_ended", False))
        if not steps:
            return None
        self._say_if_data_ended(steps, logs.pop("worker_batches", steps))
        self._position += steps
        # With a cluster the batch is this worker's; its "examples" count them all.
        return logs, steps, int(logs.pop("logged_steps", logs["examples"] > 0))

    def _say_if_data_ended(self, steps, worker_batches):
        """Logs once an epoch that this worker's data ended before another worker's."""
        if worker_batches < steps and not self._said_data_ended:
            self._said_data_ended = True
            logging.warning(
                "worker %d has no batches left in epoch %d after batch %d, while another "
                "worker still has: it takes part in their steps with an empty part until "
                "every worker's data has ended.", self._trainer.cluster.task_index,
                self._epoch + 1, self._position + worker_batches)


class SharedBatches:
    """fit's batches where steps_per_epoch is given and the data is not a callable: one
    iterator read on from epoch to epoch and started again where the data ends, as
    keras.Model.fit's epoch iterator does it. Data that ends inside an epoch ends that
    epoch early, with Keras's warning, and the next epoch starts it again; data of a
    known length (inputs.Data.num_batches) that ends with an epoch starts again with the
    next one, without a word. Data of an unknown length (a generator) that ends with an
    epoch is found out by the next one, which gets no batch (so Keras's does too) and
    starts it again after.

    One difference, warned of: with steps_per_execution > 1, Keras runs a fixed number
    of calls per epoch and finds the end of data of an unknown length only at a call
    that gets no batch, which can be the next epoch's (an epoch without a step); here a
    call that ends short is followed by another, which finds the end in this epoch.
    """

    def __init__(self, data):
        """data: an inputs.Data that is not a callable."""
        self._batches, self._num_batches = data
        self.iterator, self._seen = iter(self._batches), 0

    def epoch_ended(self, steps, ran_out):
        """After an epoch of `steps` steps; ran_out: the data ended before its last step."""
        self._seen += steps
        if ran_out:
            warn_ran_out()
        if ran_out or self._num_batches is not None and self._seen >= self._num_batches:
            self.iterator, self._seen = iter(self._batches), 0


def warn_ran_out():
    """Keras's warning, word for word, for data that ended before the steps asked of it."""
    logging.warning(
        "Your input ran out of data; interrupting training. Make sure that your dataset or "
        "generator can generate at least `steps_per_epoch * epochs` batches. You may need "
        "to use the `.repeat()` function when building your dataset.")


def limit(trainer, batch_index, steps_per_epoch, max_steps):
    """Steps the next execution may run: what is left of the epoch and of max_steps."""
    limits = [trainer.steps_per_execution]
    if steps_per_epoch is not None:
        limits.append(steps_per_epoch - batch_index)
    if max_steps is not None:
        limits.append(max_steps - trainer.step)
    return max(min(limits), 0)


def check_steps_per_execution(steps_per_execution):
    """steps_per_execution, checked: an integer >= 1."""
    return errors.positive_integer("steps_per_execution", steps_per_execution)
