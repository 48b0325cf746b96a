"""Exceptions that towers raises for problems a user can fix, and TensorFlow's errors in one line."""

import numbers
import re

# Lines of a TensorFlow graph error (or of a Keras layer's call) that say where, not what.
_WHERE = re.compile(r"(Graph execution error:|Detected at node|<stack traces|File |\[\[|"
                    r"\d+ root error\(s\) found|Exception encountered when calling)")

# Keras's bold type in a terminal, and an eager op's "{{function_node ...}}" label.
_STYLES = re.compile(r"\x1b\[[0-9;]*m")
_FUNCTION_NODE = re.compile(r"\{\{function_node [^}]*\}\}\s*")
_ASSERTION = "assertion failed: "


class DeviceConfigError(RuntimeError):
    """The requested tower layout cannot be set up (too late, or no such devices)."""


class LossMismatch(ValueError):
    """The loss itself does not fit the model's outputs: it returns other than one
    floating-point loss per example, or cannot take them. The loss is at fault, not y."""


class NonFiniteError(FloatingPointError):
    """A training step produced a NaN or Inf loss or gradient; nothing was applied."""


class WorkerLostError(RuntimeError):
    """Another worker of the cluster stopped answering during a step; nothing was applied."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (the disk full, the folder read-only): the
    newest complete checkpoint is kept, nothing unfinished is left, training stopped."""


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


def positive_integer(name, value):
    """`value` as a Python int where it is an integer >= 1 (any integral number,
    np.int64(3) too); ValueError naming `name` for anything else (a float, a bool, 0)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
    return int(value)


def root_cause(error):
    """What a TensorFlow error (or any exception) says went wrong, in one line.

    A graph error's message starts with where it happened ("Graph execution
    error", "Detected at node", a stack); this is its first line that says
    what, without the "(0) INVALID_ARGUMENT:" label and the node names; a failed
    tf.debugging.Assert's "assertion failed: [message] [3] [4]" as "message 3 4".
    """
    text = _STYLES.sub("", str(getattr(error, "message", error))).strip()
    for line in text.splitlines():
        line = line.strip()
        if line and not _WHERE.match(line):
            line = re.sub(r"^\(\d+\) [A-Z_]+:\s*", "", line)
            line = _FUNCTION_NODE.sub("", line)
            line = re.split(r"\s*(?:\{\{node|\[\[|\[Op:)", line)[0].rstrip(".")
            if line.startswith(_ASSERTION):
                line = " ".join(re.findall(r"\[([^\[\]]*)\]", line[len(_ASSERTION):]))
            return line
    return text.splitlines()[0] if text else type(error).__name__


def is_compile_error(error):
    """Whether a TensorFlow error is XLA failing to compile a function (not a run-time one)."""
    return "compil" in root_cause(error).lower()
