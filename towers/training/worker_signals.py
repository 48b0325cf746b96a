"""A cluster worker's two signals, which every step all-reduces (compiled_steps): a stop
request (SIGTERM/SIGINT to any worker stops every worker after the same step) and the end
of its data (a worker whose data has ended feeds empty parts until every worker's has)."""

import tensorflow as tf

from towers.data_parallel import split
from towers.multi_worker import cluster as cluster_lib


class WorkerSignals:
    """The host variables a worker's step all-reduces, and what feeds them.

    Attributes:
      stop_requested: a host variable, set to 1 by TowerTrainer.request_stop.
      data_ended: a host variable: 1 while this worker's data has ended and it
        feeds empty parts (train_step(data_ended=True), or train_steps' iterator
        ran out), else 0.
    """

    def __init__(self, cluster):
        self._cluster = cluster
        with tf.device(cluster_lib.HOST_DEVICE):
            self.stop_requested = tf.Variable(0.0, trainable=False, name="stop_requested")
            self.data_ended = tf.Variable(0.0, trainable=False, name="data_ended")
        self._data_ended_value = 0.0  # what data_ended holds; None after an in-graph loop
        self._empty_part = None  # no rows of the last batch trained on

    def trained_on(self, batch):
        """Remembers the shape of `batch` (checked Tensors): its empty part is the one a
        later step of this worker feeds once its data has ended."""
        self._empty_part = split.empty_like(batch)

    def mark_data_ended(self, batch, data_ended):
        """Sets data_ended for the next step; returns its batch (None: the empty part of
        the last batch trained on).

        Raises:
          ValueError: data_ended with a batch of rows, or before any batch.
        """
        if data_ended:
            batch = self._empty_part if batch is None else batch
            if batch is None:
                raise ValueError(
                    f"worker {self._cluster.task_index}'s data ended before it trained on a "
                    "batch, so the structure of its empty part is unknown: pass "
                    "towers.split.empty_like(a batch), or fit a tf.data.Dataset.")
            if split.batch_size(batch) != 0:  # its rows would count for nothing
                raise ValueError(f"data_ended=True takes an empty part, got a batch of "
                                 f"{split.batch_size(batch)} rows; train on it first.")
        if self._data_ended_value != float(data_ended):
            self.data_ended.assign(float(data_ended))
            self._data_ended_value = float(data_ended)
        return batch

    def looped(self):
        """After an in-graph loop, which sets data_ended itself as its iterator runs."""
        self._data_ended_value = None
