"""Reading a tf.profiler trace: the one reader both trace parsers use.

`trace_steps` records steps under a step annotation, `load_xspace` reads the
profile back, `events` walks its events with absolute times, `op_events`
picks the TensorFlow ops out of them, and `write_chrome_trace` writes the whole
recording for chrome://tracing or https://ui.perfetto.dev. phases.py sorts the
ops into the tower algorithm's phases; pipeline_profile.py into the stages and
micro-batches of a pipeline.
"""

import collections
import glob
import json
import os
import re
import time

import tensorflow as tf

STEP_ANNOTATION = "towers_step"
OP_NAME = re.compile(r"^[^:]+:\w+$")  # "scope/op_name:OpType"

Event = collections.namedtuple("Event", ["plane", "line", "name", "start_ps", "duration_ps"])
Event.__doc__ = "One trace event: its plane's and line's names, its name, start and length in ps."


def trace_steps(step, num_steps, log_dir):
    """Runs `step()` num_steps times under tf.profiler; returns the .xplane.pb path written."""
    started = time.time()
    tf.profiler.experimental.start(log_dir)
    try:
        for i in range(num_steps):
            with tf.profiler.experimental.Trace(STEP_ANNOTATION, step_num=i, _r=1):
                step()
    finally:
        tf.profiler.experimental.stop()
    # Not a profile an earlier run left in the same log_dir.
    paths = [p for p in glob.glob(os.path.join(log_dir, "plugins", "profile", "*", "*.xplane.pb"))
             if os.path.getmtime(p) >= started - 1]
    if not paths:
        raise FileNotFoundError(f"tf.profiler wrote no new .xplane.pb under {log_dir}")
    return max(paths, key=os.path.getmtime)


def load_xspace(path):
    """Reads a profile written by tf.profiler; returns an XSpace protobuf.

    No public TensorFlow API reads a profile back (the public viewer is
    TensorBoard's profile plugin), so this is the one place that imports
    TensorFlow's own generated protobuf module.
    """
    from tensorflow.tsl.profiler.protobuf import xplane_pb2  # pylint: disable=g-import-not-at-top
    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    return space


def write_chrome_trace(space, path):
    """Writes every event of `space` as a Chrome trace JSON (one process per plane)."""
    events = []
    start_ps = min((line.timestamp_ns * 1000 + e.offset_ps for plane in space.planes
                    for line in plane.lines for e in line.events), default=0)
    for pid, plane in enumerate(space.planes):
        if not any(line.events for line in plane.lines):
            continue
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": plane.name}})
        for tid, line in enumerate(plane.lines):
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                           "args": {"name": line.display_name or line.name}})
            for event in line.events:
                start = line.timestamp_ns * 1000 + event.offset_ps - start_ps
                events.append({"ph": "X", "pid": pid, "tid": tid,
                               "name": plane.event_metadata[event.metadata_id].name,
                               "ts": start / 1e6, "dur": event.duration_ps / 1e6})  # microseconds
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


def op_events(space):
    """(op name, duration in ps) of every TensorFlow op: from the GPU planes when they
    name any (kernels, by their "tf_op" stat), else from the host's compute threads."""
    on_gpus = [(_stat(plane, event, "tf_op"), event.duration_ps)
               for plane in space.planes if plane.name.startswith("/device:GPU")
               for line in plane.lines for event in line.events]
    on_gpus = [(name, duration) for name, duration in on_gpus if name]
    if on_gpus:
        return on_gpus
    return [(event.name, event.duration_ps)
            for event in events(space, host_only=True, line_prefix="tf_Compute")
            if OP_NAME.match(event.name)]  # not the executor's own events ("ExecutorState::Process")


def events(space, host_only=False, line_prefix=""):
    """Every event of `space` as an Event: of the host's planes only if `host_only`, of
    the lines whose names start with `line_prefix`."""
    for plane in space.planes:
        if host_only and not plane.name.startswith("/host:CPU"):
            continue
        for line in plane.lines:
            if line.name.startswith(line_prefix):
                for event in line.events:
                    yield Event(plane.name, line.name, plane.event_metadata[event.metadata_id].name,
                                line.timestamp_ns * 1000 + event.offset_ps, event.duration_ps)


def _stat(plane, event, stat_name):
    """The string value of `event`'s stat named `stat_name`, or None."""
    for stat in event.stats:
        if plane.stat_metadata[stat.metadata_id].name == stat_name:
            if stat.HasField("ref_value"):
                return plane.stat_metadata[stat.ref_value].name
            return stat.str_value or None
    return None
