"""Where one towers step spends its time: a tf.profiler trace, split into phases.

`phase_table` sorts the TensorFlow ops of steps recorded by traces.trace_steps
into the phases of the tower algorithm by their names.

The phases come from op names: the library runs each tower under
tf.name_scope("tower_i"), and the gradient tape prefixes that tower's backward
ops with "gradient_tape/" (inside the tower's call, where its work is traced once
for every tower: "tower_i/.../gradient_tape/"). The other phases are recognised by the names of the
ops they use (split and the batch-size arithmetic for the split, _Send/_Recv
for copies between devices, multiply_no_nan for the weighted mean, IsFinite
for the non-finite check, the optimizer's ops inside its tf.cond for the
update); whatever matches nothing is "other".
A name scope "split", "broadcast", "gather", "reduce" or "apply" in the
library would be recognised first, and exactly.
"""

import collections
import re

from benchmarks.harness import traces

# (phase, pattern on the op's name "scope/op_name:OpType"), first match wins;
# "{tower}" in a phase name is replaced by the tower number the pattern captures.
PHASE_PATTERNS = (
    ("{scope}", re.compile(r"^(?:.*/)?(?P<scope>split|broadcast|gather|reduce|apply)/")),
    ("gather", re.compile(r"^gradient_tape/tower_\d+/.*:_(Send|Recv)$")),
    ("tower {tower} broadcast", re.compile(r"^tower_(?P<tower>\d+)/Identity[^/]*/")),
    ("tower {tower} backward", re.compile(r"^gradient_tape/tower_(?P<tower>\d+)/")),
    # The tower's work traced once and called on each tower: its tape inside the call.
    ("tower {tower} backward", re.compile(r"^tower_(?P<tower>\d+)/(?:.*/)?gradient_tape/")),
    ("tower {tower} forward", re.compile(r"^tower_(?P<tower>\d+)/")),
    ("split", re.compile(r"^(split|floordiv|mod|Less|assert_equal|strided_slice)(_\d+)?[/:]")),
    ("finite check", re.compile(r"^(IsFinite|All|and)(_\d+)?:")),
    ("apply", re.compile(r"(^|/)cond/|(^|/)(sgd|SGD|adam|Adam)/")),
    ("reduce", re.compile(r"^(multiply_no_nan|AddN|add_n|div_no_nan|stack|unstack)")),
    ("gather", re.compile(r":_(Send|Recv|HostSend|HostRecv)$")),
)


def phase_table(space, num_steps):
    """Per-phase op time of the traced steps.

    Args:
      space: the XSpace of traces.trace_steps.
      num_steps: how many steps it recorded.

    Returns:
      {"step_ms": mean wall time of a traced step (profiler on, so slower than
      untraced), "busy_ms": all ops' time per step, "phases": [{"phase",
      "ops", "busy_ms"}] with ops per step, busy_ms being the sum
      of the phase's op durations per step, across all threads and devices (so
      the phases can add up to more than step_ms when ops run concurrently)}.
    """
    ops, busy_ps = collections.Counter(), collections.Counter()
    for name, duration_ps in traces.op_events(space):
        phase = classify(name)
        ops[phase] += 1
        busy_ps[phase] += duration_ps
    steps = [event.duration_ps for event in traces.events(space, host_only=True)
             if event.name == traces.STEP_ANNOTATION]
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


def _phase_order(phase):
    order = ("split", "broadcast", "tower", "gather", "reduce", "finite", "apply", "other")
    rank = next(i for i, prefix in enumerate(order) if phase.startswith(prefix) or prefix == "other")
    number = re.search(r"\d+", phase)
    return rank, int(number.group()) if number else 0, "backward" in phase, phase
