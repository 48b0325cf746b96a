"""Where one towers step spends its time: a tf.profiler trace, split into phases.

`trace_steps` records a few steps with tf.profiler, `phase_table` sorts the
recorded TensorFlow ops into the phases of the tower algorithm by their names,
and `write_chrome_trace` turns the whole recording into a Chrome trace file
(open it in chrome://tracing or https://ui.perfetto.dev).

The phases come from op names: the library runs each tower under
tf.name_scope("tower_i"), and the gradient tape prefixes that tower's backward
ops with "gradient_tape/". The other phases are recognised by the names of the
ops they use (split and the batch-size arithmetic for the split, _Send/_Recv
for copies between devices, multiply_no_nan for the weighted mean, IsFinite
for the non-finite check, the optimizer's ops inside its tf.cond for the
update); whatever matches nothing is "other".
A name scope "split", "broadcast", "gather", "reduce" or "apply" in the
library would be recognised first, and exactly.
"""

import collections
import glob
import json
import os
import re
import time

import tensorflow as tf

STEP_ANNOTATION = "towers_step"
_OP_NAME = re.compile(r"^[^:]+:\w+$")  # "scope/op_name:OpType"

# (phase, pattern on the op's name "scope/op_name:OpType"), first match wins;
# "{tower}" in a phase name is replaced by the tower number the pattern captures.
PHASE_PATTERNS = (
    ("{scope}", re.compile(r"^(?:.*/)?(?P<scope>split|broadcast|gather|reduce|apply)/")),
    ("gather", re.compile(r"^gradient_tape/tower_\d+/.*:_(Send|Recv)$")),
    ("tower {tower} broadcast", re.compile(r"^tower_(?P<tower>\d+)/Identity[^/]*/")),
    ("tower {tower} backward", re.compile(r"^gradient_tape/tower_(?P<tower>\d+)/")),
    ("tower {tower} forward", re.compile(r"^tower_(?P<tower>\d+)/")),
    ("split", re.compile(r"^(split|floordiv|mod|Less|assert_equal|strided_slice)(_\d+)?[/:]")),
    ("finite check", re.compile(r"^(IsFinite|All|and)(_\d+)?:")),
    ("apply", re.compile(r"(^|/)cond/|(^|/)(sgd|SGD|adam|Adam)/")),
    ("reduce", re.compile(r"^(multiply_no_nan|AddN|add_n|div_no_nan|stack|unstack)")),
    ("gather", re.compile(r":_(Send|Recv|HostSend|HostRecv)$")),
)


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


def phase_table(space, num_steps):
    """Per-phase op time of the traced steps.

    Args:
      space: the XSpace of `trace_steps`.
      num_steps: how many steps it recorded.

    Returns:
      {"step_ms": mean wall time of a traced step (profiler on, so slower than
      untraced), "busy_ms": all ops' time per step, "phases": [{"phase",
      "ops", "busy_ms"}] with ops per step, busy_ms being the sum
      of the phase's op durations per step, across all threads and devices (so
      the phases can add up to more than step_ms when ops run concurrently)}.
    """
    ops, busy_ps = collections.Counter(), collections.Counter()
    for name, duration_ps in _op_events(space):
        phase = classify(name)
        ops[phase] += 1
        busy_ps[phase] += duration_ps
    steps = [d for name, d in _named_events(space, host_only=True) if name == STEP_ANNOTATION]
    phases = [{"phase": p, "ops": ops[p] / num_steps, "busy_ms": busy_ps[p] / num_steps / 1e9}
              for p in sorted(busy_ps, key=_phase_order)]
    return {"step_ms": sum(steps) / max(len(steps), 1) / 1e9,
            "busy_ms": sum(busy_ps.values()) / num_steps / 1e9, "phases": phases}


def classify(op_name):
    """The phase of the op named `op_name` ("scope/name:Type"); "other" if none fits."""
    for phase, pattern in PHASE_PATTERNS:
        match = pattern.search(op_name)
        if match:
            return phase.format(**match.groupdict())
    return "other"


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


def _op_events(space):
    """(op name, duration in ps) of every TensorFlow op: from the GPU planes when they
    name any (kernels, by their "tf_op" stat), else from the host's compute threads."""
    on_gpus = [(_stat(plane, event, "tf_op"), event.duration_ps)
               for plane in space.planes if plane.name.startswith("/device:GPU")
               for line in plane.lines for event in line.events]
    on_gpus = [(name, duration) for name, duration in on_gpus if name]
    if on_gpus:
        return on_gpus
    return [(name, duration)
            for name, duration in _named_events(space, host_only=True, line_prefix="tf_Compute")
            if _OP_NAME.match(name)]  # not the executor's own events ("ExecutorState::Process")


def _named_events(space, host_only, line_prefix=""):
    for plane in space.planes:
        if host_only and not plane.name.startswith("/host:CPU"):
            continue
        for line in plane.lines:
            if line.name.startswith(line_prefix):
                for event in line.events:
                    yield plane.event_metadata[event.metadata_id].name, event.duration_ps


def _stat(plane, event, stat_name):
    """The string value of `event`'s stat named `stat_name`, or None."""
    for stat in event.stats:
        if plane.stat_metadata[stat.metadata_id].name == stat_name:
            if stat.HasField("ref_value"):
                return plane.stat_metadata[stat.ref_value].name
            return stat.str_value or None
    return None


def _phase_order(phase):
    order = ("split", "broadcast", "tower", "gather", "reduce", "finite", "apply", "other")
    rank = next(i for i, prefix in enumerate(order) if phase.startswith(prefix) or prefix == "other")
    number = re.search(r"\d+", phase)
    return rank, int(number.group()) if number else 0, "backward" in phase, phase
