"""Exceptions that towers raises for problems a user can fix."""


class DeviceConfigError(RuntimeError):
    """The requested tower layout cannot be set up (too late, or no such devices)."""


class NonFiniteError(FloatingPointError):
    """A training step produced a NaN or Inf loss or gradient; nothing was applied."""


class WorkerLostError(RuntimeError):
    """Another worker of the cluster stopped answering during a step; nothing was applied."""


class Preempted(RuntimeError):
    """fit stopped on SIGTERM or SIGINT after a whole step, having saved a checkpoint
    (if it had a checkpointer). Fitting again with the same checkpointer resumes.

    Attributes:
      signal_name: "SIGTERM" or "SIGINT" (in a cluster, where every worker stops
        alike: "SIGTERM or SIGINT to a worker").
      step: optimizer steps applied when training stopped (int).
      directory: where the checkpoint went, or None when nothing was saved.
    """

    def __init__(self, signal_name, step, directory):
        self.signal_name, self.step, self.directory = signal_name, step, directory
        saved = (f"a checkpoint is saved in {directory}; rerun the same command to resume"
                 if directory else "nothing was saved (no checkpoint directory was given)")
        super().__init__(f"stopped by {signal_name} after step {step}: {saved}.")
