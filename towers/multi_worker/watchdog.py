"""The watchdog: while a step runs, the other workers are pinged; a lost one ends it,
and so does a step that runs past the cluster's step_timeout_s.

Without it a worker that died or hangs would leave its peers' all-reduce
waiting for ever, and so would workers that all answer but run steps of other
shapes. `Watchdog.step` turns either into one WorkerLostError on every
surviving worker, before the failing step applies anything.
"""

import contextlib
import threading
import time

import tensorflow as tf
from absl import logging
# Public TensorFlow has no call that aborts or health-checks collective ops of an
# eager program; MultiWorkerMirroredStrategy uses exactly these.

from towers import compat, errors
from towers.errors import WorkerLostError


class Watchdog:
    """Pings the other workers while a step runs; aborts the step when one is lost.

    A worker that died refuses connections, and its peers' all-reduce fails at
    once; one that hangs is noticed within peer_timeout_s plus one ping
    interval. A call that runs past step_timeout_s (every worker answering) is
    ended within one ping interval after. Either way every surviving worker
    raises WorkerLostError.
    """

    def __init__(self, cluster):
        self.cluster = cluster
        self._stepping = threading.Event()
        self._started = None  # time.monotonic() when the running call started
        # Why this worker aborted a step: "worker 1 (host:port) stopped answering (...)".
        self._lost = None
        self._interval_s = min(5.0, cluster.peer_timeout_s / 3, cluster.step_timeout_s / 3)
        if cluster.num_workers > 1:
            threading.Thread(target=self._watch, daemon=True, name="towers-watchdog").start()

    @contextlib.contextmanager
    def step(self, step_number):
        """Runs one step under watch; a lost worker turns its failure into WorkerLostError."""
        self._started = time.monotonic()
        self._stepping.set()
        try:
            yield
        except (tf.errors.UnavailableError, tf.errors.DeadlineExceededError,
                tf.errors.AbortedError, tf.errors.CancelledError,
                tf.errors.FailedPreconditionError) as error:
            who = (self._lost or self._find_lost() or
                   f"the all-reduce across workers failed ({errors.root_cause(error)})")
            raise WorkerLostError(
                f"step {step_number}: {who}, so worker {self.cluster.task_index} stops too; "
                "the failing step was not applied. Restart every worker with the same "
                "checkpoint directory to resume from the last checkpoint.") from None
        finally:
            self._stepping.clear()

    def _watch(self):
        while self._lost is None:
            self._stepping.wait()
            lost = self._find_lost(self.cluster.peer_timeout_s) or self._past_timeout()
            if lost and self._stepping.is_set():
                self._lost = lost
                logging.error("%s; aborting this step", lost)
                compat.eager_runtime().abort_collective_ops(tf.errors.UNAVAILABLE, lost)
                return
            time.sleep(self._interval_s)

    def _past_timeout(self):
        """Why the running call is ended where it has run past step_timeout_s, else None."""
        timeout_s = self.cluster.step_timeout_s
        if self._started is None or time.monotonic() - self._started <= timeout_s:
            return None
        return (f"no worker finished it within step_timeout_s={timeout_s:g} s, every worker "
                "answering (do they run the same flags? a longer step needs a larger "
                "--step_timeout_s)")

    def _find_lost(self, timeout_s=1.0):
        """"worker i (host:port) stopped answering (why)" for the first peer that does
        not answer, or None."""
        for index in range(self.cluster.num_workers):
            if index == self.cluster.task_index:
                continue
            try:
                compat.eager_runtime().check_collective_ops_peer_health(
                    self.cluster.task_name(index), timeout_in_ms=int(timeout_s * 1000))
            except tf.errors.OpError as error:
                return (f"worker {index} ({self.cluster.workers[index]}) stopped answering "
                        f"({errors.root_cause(error)})")
        return None
