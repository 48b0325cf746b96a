"""Exceptions that towers raises for problems a user can fix."""


class DeviceConfigError(RuntimeError):
    """The requested tower layout cannot be set up (too late, or no such devices)."""


class NonFiniteError(FloatingPointError):
    """A training step produced a NaN or Inf loss or gradient; nothing was applied."""


class WorkerLostError(RuntimeError):
    """Another worker of the cluster stopped answering during a step; nothing was applied."""
