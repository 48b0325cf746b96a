"""Private TensorFlow names only the benchmarks use, each beside the public alternative it
stands in for: the harness's own, so that towers/compat holds only what towers runs on.
Checked on TensorFlow 2.21.0 (constraints.txt)."""

import contextlib

from tensorflow.python.debug.lib import debug_events_reader
from tensorflow.python.eager import context as eager_context
from tensorflow.python.framework import op_def_registry

# The reader of a tfdbg dump (tf.debugging.experimental.enable_dump_debug_info's files),
# for benchmarks/harness/transfers.py. Public alternative: none (TensorBoard's debugger
# plugin reads it internally).
DebugDataReader = debug_events_reader.DebugDataReader


@contextlib.contextmanager
def partitioned_graphs():
    """While inside, TensorFlow collects the graphs each function call ran as
    partitioned per device; yields fn() -> the run metadata (its function_graphs), to
    be called before leaving.

    Public alternative: none; tf.profiler traces ops but not the partitioned graphs.
    """
    eager_context.enable_graph_collection()
    try:
        yield eager_context.export_run_metadata
    finally:
        eager_context.disable_graph_collection()


def op_def(op_type):
    """The registered OpDef of `op_type` (is_stateful, ...); AttributeError for a name
    that is not an op's (a function's).

    Public alternative: none.
    """
    return op_def_registry.get(op_type)


def untraced_copy(function):
    """A copy of tf.function `function` with none of its traces, to trace apart from it.

    Public alternative: tf.function(function.python_function, ...) with each of its
    options given again by hand.
    """
    return function._clone(None)
