"""A pipelined step seen from a tf.profiler trace: each stage device's idle share and boxes.

`idle_shares` is the measured bubble: per device, 1 - (time some op ran on
it) / (the step's span). `micro_batch_boxes` gives, per stage device, one box
per micro-batch's forward and backward: the span of that device's ops of the
action. `draw_timeline` draws those boxes as a Gantt chart, next to the ideal
timetable of towers.schedule.

Which device ran an op is not in a CPU trace: logical CPU devices share one
thread pool, and an op event names only the op ("scope/name:Type"). So each
op's device comes from the graph TensorFlow ran: `record_op_devices` turns on
tf.summary's graph collection while the step is compiled (its first call),
which records the step's partition graphs (one per device, after Grappler,
with the _Send/_Recv ops between them), and maps every node name to its device.
Busy time is read from the host's op events, which on a CPU are the ops'
work; on a GPU they would be kernel launches, with the kernels on the GPU
planes of the trace, which this module does not read yet.

Which action an op belongs to comes from its name: the tower step runs stage
k's forward of micro-batch m under tf.name_scope("tower_t/stage_k_forward_m")
and its backward under "tower_t/stage_k_backward_m". The gradient tape names
the gradient ops it creates after the forward op they differentiate, under
"gradient_tape/tower_t/stage_k_forward_m/", whatever scope they are built in;
that prefix marks them as the backward of (k, m). The last stage's forward and
backward are one call, made under "tower_t/stage_k_forward_m": inside it, the
tape's "gradient_tape/" after that scope marks its backward's ops.
"""

import collections
import glob
import os
import re
import time

import tensorflow as tf

from benchmarks.harness import traces
from towers import devices as devices_lib
from towers.model_parallel import schedule

OpRun = collections.namedtuple("OpRun", ["name", "type", "device", "start_ps", "end_ps"])
OpRun.__doc__ = "One op run in a trace: node name, op type, device (None: unknown), times in ps."

# "gradient_tape/" (grappler may put its own prefix before it) marks a backward op.
ACTION_SCOPE = re.compile(r"(?P<gradient>gradient_tape/)?tower_(?P<tower>\d+)/stage_(?P<stage>\d+)"
                          r"_(?P<kind>forward|backward)_(?P<micro_batch>\d+)/")
_RUN_METADATA_PLUGIN = "graph_run_metadata_graph"  # what tf.summary.trace_export writes
_COPY_OPS = ("_Send", "_Recv", "_HostSend", "_HostRecv")
# Ops of an action shorter than this share of its op time are left out of its box.
BOX_MIN_OP_SHARE = 0.01


def record_op_devices(first_step, log_dir):
    """Runs `first_step()`, the call that compiles the step, collecting the graphs it runs.

    The partition graphs are recorded only when a function is instantiated,
    so this must wrap the step's first call. They are also left in `log_dir`
    for TensorBoard's graph view. Returns {node name: canonical device name}.
    """
    started = time.time()
    writer = tf.summary.create_file_writer(log_dir)
    tf.summary.trace_on(graph=True, profiler=False)
    try:
        first_step()
    except BaseException:
        tf.summary.trace_off()
        raise
    with writer.as_default():
        tf.summary.trace_export("compiled_step", step=0)
    writer.close()
    return read_op_devices(log_dir, since=started)


def read_op_devices(log_dir, since=0.0):
    """{node name: canonical device} from the run metadata that tf.summary wrote to log_dir.

    Only event files written after `since` (a time.time()) are read, not an
    earlier run's. Several functions may have been compiled (the model's first
    build too); their small graphs reuse node names, so the largest graph, the
    step's, wins.
    """
    graphs = []
    for path in glob.glob(os.path.join(log_dir, "events.out.tfevents.*")):
        if os.path.getmtime(path) < since - 1:
            continue
        for record in tf.data.TFRecordDataset(path):
            event = tf.compat.v1.Event.FromString(record.numpy())
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name != _RUN_METADATA_PLUGIN:
                    continue
                run_metadata = tf.compat.v1.RunMetadata.FromString(value.tensor.string_val[0])
                graphs += [{node.name: devices_lib.canonical_name(node.device)
                            for partition in function.partition_graphs for node in partition.node}
                           for function in run_metadata.function_graphs]
    op_devices = {}
    for graph in sorted(graphs, key=len):
        op_devices.update(graph)
    return op_devices


def traced_steps(space, op_devices):
    """The ops of each step that traces.trace_steps recorded: one list of OpRuns per step.

    An op belongs to the step whose annotation it starts in.
    """
    steps, ops = [], []
    for event in traces.events(space):
        interval = (event.start_ps, event.start_ps + event.duration_ps)
        if event.name == traces.STEP_ANNOTATION and event.plane.startswith("/host:CPU"):
            steps.append(interval)
        elif event.line.startswith("tf_Compute") and traces.OP_NAME.match(event.name):
            op_name, op_type = event.name.rsplit(":", 1)
            ops.append(OpRun(op_name, op_type, op_devices.get(op_name), *interval))
    steps.sort()
    return [[op for op in ops if begin <= op.start_ps <= end] for begin, end in steps]


def step_span_ps(step_ops):
    """(first op start, last op end) of one step, on any device."""
    return min(op.start_ps for op in step_ops), max(op.end_ps for op in step_ops)


def idle_shares(step_ops, devices):
    """Per device, the share of the step's span in which no op ran on it (0..1).

    The span runs from the step's first op to its last, on any device: the
    step without the Python around it. Ops that overlap on one device (it has
    several threads) count once: busy time is the union of their intervals.
    """
    first, last = step_span_ps(step_ops)
    return {device: 1.0 - _union_ps([(op.start_ps, op.end_ps) for op in step_ops
                                     if op.device == device]) / (last - first)
            for device in devices}


def unattributed_share(step_ops):
    """The share of op time whose op's device is unknown (not in the recorded graphs)."""
    total = sum(op.end_ps - op.start_ps for op in step_ops)
    unknown = sum(op.end_ps - op.start_ps for op in step_ops if op.device is None)
    return unknown / total if total else 0.0


def micro_batch_boxes(step_ops, grid):
    """One box per (tower, stage, F/B, micro-batch); start and end in ms from the step's first op.

    A box spans its action's ops on its stage device, leaving out the copies to
    and from other devices (_Send/_Recv) and ops under BOX_MIN_OP_SHARE of the
    action's op time: those run whenever their inputs allow (shape arithmetic
    at the step's start, sends of finished gradients at its end)
    and would stretch the box over its neighbours'. grid: one row of stage
    devices per tower. Returns a list of dicts: tower, stage, kind ("F"/"B"),
    micro_batch, start, end, ordered by start.
    """
    first, _ = step_span_ps(step_ops)
    actions = collections.defaultdict(list)
    for op in step_ops:
        match = ACTION_SCOPE.search(op.name)
        if not match or op.type in _COPY_OPS:
            continue
        tower, stage = int(match["tower"]), int(match["stage"])
        if op.device == grid[tower][stage]:
            backward = (match["gradient"] or match["kind"] == "backward"
                        or "gradient_tape/" in op.name[match.end():])
            actions[tower, stage, schedule.BACKWARD if backward else schedule.FORWARD,
                    int(match["micro_batch"])].append(op)
    boxes = []
    for (tower, stage, kind, micro_batch), ops in actions.items():
        least = BOX_MIN_OP_SHARE * sum(op.end_ps - op.start_ps for op in ops)
        kept = [op for op in ops if op.end_ps - op.start_ps >= least]
        boxes.append({"tower": tower, "stage": stage, "kind": kind, "micro_batch": micro_batch,
                      "start": (min(op.start_ps for op in kept) - first) / 1e9,
                      "end": (max(op.end_ps for op in kept) - first) / 1e9})
    return sorted(boxes, key=lambda box: box["start"])


def ideal_boxes(schedule_name, num_stages, micro_batches):
    """The boxes of towers.schedule.timetable: every action one tick long; start and end in ticks."""
    ticks = schedule.timetable(schedule.make(schedule_name, num_stages, micro_batches))
    return [{"tower": 0, "stage": action.stage, "kind": action.kind,
             "micro_batch": action.micro_batch, "start": tick, "end": tick + 1}
            for tick, actions in enumerate(ticks) for action in actions]


def timeline_panels(rows, num_stages, micro_batches):
    """draw_timeline's panels: the rows of (K, M) with boxes, measured above their ideal timetable."""
    drawn = [row for row in rows if "boxes" in row and
             (row["num_stages"], row["micro_batches"]) == (num_stages, micro_batches)]
    if not drawn:
        return []
    measured = [{"title": f"measured, {row['schedule']}, K={num_stages}, M={micro_batches}: "
                          f"mean idle {row['bubble_measured']:.0%} (GPipe's formula "
                          f"{row['bubble_formula']:.0%})",
                 "row_labels": _row_labels(row["devices"]), "boxes": row["boxes"],
                 "num_stages": num_stages, "unit": "ms from the step's first op"}
                for row in drawn]
    ideal = [{"title": f"ideal timetable, {row['schedule']}: every action one tick",
              "row_labels": [f"stage {k}" for k in range(num_stages)],
              "boxes": ideal_boxes(row["schedule"], num_stages, micro_batches),
              "num_stages": num_stages, "unit": "ticks"} for row in drawn]
    return [measured, ideal]


def _row_labels(grid):
    if len(grid) == 1:
        return [f"stage {k}\n{device}" for k, device in enumerate(grid[0])]
    return [f"tower {t} stage {k}\n{device}" for t, row in enumerate(grid)
            for k, device in enumerate(row)]


def draw_timeline(panels, path):
    """A Gantt chart per panel: one row per stage device, one box per micro-batch's F and B.

    panels: rows of dicts {"title", "row_labels" (one per grid device, tower-major),
    "boxes" (micro_batch_boxes or ideal_boxes), "num_stages", "unit" (of start and
    end: the x axis' label)} drawn as a grid.
    Returns False (and draws nothing) without matplotlib.
    """
    try:
        import matplotlib  # pylint: disable=g-import-not-at-top
        matplotlib.use("Agg")
        from matplotlib import pyplot  # pylint: disable=g-import-not-at-top
    except ImportError:
        return False
    palette = matplotlib.colormaps["tab10"].colors  # one colour per micro-batch
    num_rows = max(len(panel["row_labels"]) for row in panels for panel in row)
    figure, axes = pyplot.subplots(len(panels), len(panels[0]), squeeze=False,
                                   figsize=(7 * len(panels[0]), (1 + 0.55 * num_rows) * len(panels)))
    for axis, panel in zip(axes.flat, (panel for row in panels for panel in row)):
        narrowest_label = 0.03 * max((box["end"] for box in panel["boxes"]), default=0)
        for box in panel["boxes"]:
            row = box["tower"] * panel["num_stages"] + box["stage"]
            width = box["end"] - box["start"]
            backward = box["kind"] == schedule.BACKWARD
            axis.barh(row, width, left=box["start"], height=0.8, edgecolor="black",
                      linewidth=0.5, color=palette[box["micro_batch"] % len(palette)],
                      alpha=0.6 if backward else 1.0, hatch="//" if backward else None)
            if width >= narrowest_label:  # a narrower box is told by its colour and hatch
                axis.text(box["start"] + width / 2, row, f"{box['kind']}{box['micro_batch']}",
                          ha="center", va="center", fontsize=7, clip_on=True)
        axis.set_yticks(range(len(panel["row_labels"])), panel["row_labels"], fontsize=8)
        axis.invert_yaxis()  # stage 0 on top, as pipelines are drawn
        axis.set(title=panel["title"], xlabel=panel["unit"])
        axis.title.set_fontsize(9)
        axis.grid(axis="x", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    pyplot.close(figure)
    return True


def _union_ps(intervals):
    """Total length covered by (start, end) intervals, overlaps counted once."""
    total, covered_to = 0, None
    for start, end in sorted(intervals):
        if covered_to is None or start > covered_to:
            total += end - start
            covered_to = end
        elif end > covered_to:
            total += end - covered_to
            covered_to = end
    return total
