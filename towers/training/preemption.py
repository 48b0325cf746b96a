"""Stopping cleanly on SIGTERM or SIGINT: finish the running step, save, stop.

Kubernetes, Slurm and spot instances stop a job with SIGTERM (Ctrl-C sends
SIGINT). While `fit` runs, these signals only set a flag; fit checks it after
every step, writes a checkpoint at the exact position in the data and raises
towers.Preempted. Further signals while it saves are recorded and ignored, so
a second Ctrl-C cannot stop a checkpoint halfway (SIGKILL still can, and the
checkpoint index is written last so a half-written one is never loaded).
"""

import signal
import threading

from absl import logging

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """A context in which SIGTERM and SIGINT are recorded instead of acted on.

    Attributes:
      received: None, or the name of the first stop signal that came.
    """

    def __init__(self):
        self.received = None
        self._previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for number in STOP_SIGNALS:
                self._previous[number] = signal.signal(number, self._record)
        else:  # Python delivers signals to the main thread only.
            logging.warning("fit runs outside the main thread, so SIGTERM and SIGINT cannot "
                            "stop it cleanly after a step.")
        return self

    def __exit__(self, *exc_info):
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        return False

    def _record(self, number, frame):
        del frame
        if self.received is None:
            self.received = signal.Signals(number).name
            logging.warning("got %s: stopping after the running step.", self.received)


# What a KeyboardInterrupt raised by a callback is recorded as (Preempted names it).
CALLBACK_INTERRUPT = "KeyboardInterrupt from a callback"


class InterruptibleCallbacks:
    """A keras.callbacks.CallbackList whose hooks may raise KeyboardInterrupt (a callback
    stopping the run as Ctrl-C would): it is recorded in `signals` as a stop signal is,
    so fit stops as on SIGINT, after the step, with a checkpoint at the exact position
    and towers.Preempted, instead of leaving the run unsaved."""

    def __init__(self, callbacks, signals):
        self._callbacks, self._signals = callbacks, signals

    def __getattr__(self, name):
        hook = getattr(self._callbacks, name)
        if not name.startswith("on_") or name == "on_train_end":  # nothing left to stop
            return hook

        def called(*args, **kwargs):
            try:
                return hook(*args, **kwargs)
            except KeyboardInterrupt:
                if self._signals.received is None:
                    self._signals.received = CALLBACK_INTERRUPT
                    logging.warning("a callback raised KeyboardInterrupt in %s: stopping "
                                    "after the running step, as on SIGINT.", name)
        return called
