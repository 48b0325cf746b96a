"""A tower's work traced once for every tower (`compiled_tower`), so that the time to
trace a step does not grow with the towers: by XLA, or as plain tf.functions called on
each tower's device; where a trace names its tower's part devices, each other tower
calls a copy with its own (tower_trace.py)."""

import dataclasses
from typing import Callable

import tensorflow as tf

from towers.data_parallel import split
from towers.engine import losses, tower_trace
from towers.engine.forward import forward
from towers.engine.tower import StageWork, StepWork, TowerWork, run_tower, start_flight
from towers.model_parallel import flight
from towers.op_parallel import layers as op_layers


class Finished:
    """A tower already run whole (an XLA computation), as a started flight: its `terms`
    known, `finish` giving its TowerOutput."""

    def __init__(self, output):
        self.output, self.terms = output, output.terms

    def finish(self, scales, densify=None):
        del scales, densify  # its counted terms came apart (term_grads), densified inside
        return self.output


class _CallsPointed:
    """A flight started by start() (a started flight's maker) whose finish then points
    the calls its tower made, starting and finishing, at their optimised copies
    (tower_trace.OptimisedCalls), as a started flight. Another tower's ops come between
    the two (every flight starts before any finishes), and they are not yet what they
    will be: TensorFlow points a forward call at the forward its gradient needs when
    it makes the gradient."""

    def __init__(self, start, calls):
        self.graph, self.calls = tf.compat.v1.get_default_graph(), calls
        known = len(self.graph.get_operations())
        self.flight = start()
        self.started = self.graph.get_operations()[known:]

    @property
    def terms(self):
        return self.flight.terms

    def finish(self, scales, densify=None):
        known = len(self.graph.get_operations())
        output = self.flight.finish(scales, densify)
        if not tf.executing_eagerly():
            self.calls.point(self.started + self.graph.get_operations()[known:])
        return output


def traced_once(setup, objective):
    """Whether one trace of a tower's work (compiled_tower) serves every tower of
    `setup` (a step.StepSetup, set up for the model's trainable variables) without
    XLA: no BatchNormalization meeting across the towers (it meets the others inside
    the tower's work), and the loss's counted terms known (objective.counted: the
    first batch's forward gave them). Split layers too: each other tower calls copies
    of the traces with its parts' devices renamed (tower_trace.py)."""
    return not setup.statistics.layers and objective.counted is not None


@dataclasses.dataclass(frozen=True)
class CompiledTower:
    """compiled_tower's: call(step, tower) -> a started flight. optimised: whether the
    tower's work is traced functions that grappler optimised once (TowerTrace's
    optimise: the tower's whole work, or each stage's forward and backward), so that
    the step's own graph needs only cheap passes (graph_rewrites.py)."""
    run: Callable
    optimised: bool = False

    def __call__(self, step, tower):
        return self.run(step, tower)


def compiled_tower(stages, objective, schedule, densify, jit_compile=True, optimise=None,
                   part_homes=None):
    """A tower's work traced once for every tower: a CompiledTower, fn(step, tower) -> a
    started flight (start_flight's, or a Finished one), for a StepWork of these stages,
    objective and schedule; compiled by XLA where jit_compile, else plain
    tf.functions (traced_once's set-ups), so that the time to trace the first step does
    not grow with the towers. optimise: None, or TowerTrace's, for the tower's traced
    functions without XLA (the whole work; or each stage's forward and its gradient,
    tower_trace.OptimisedCalls). part_homes: None, or for a split model the devices
    each stage's parts live on (devices.Mesh.parts[0]).

    One stage: the tower's forward and backward, all its micro-batches, are one
    function (one XLA computation) on tower.devices[0]. With pipeline stages a tower
    spans several devices and XLA compiles for one, so each stage's forward on a
    micro-batch is one function on the tower's device for it, and so is its backward
    (the gradient of a tf.function is one too), the last stage's forward, loss and
    backward one function together (traced_last_stage); the flight between the stages
    stays outside. So too, without XLA, for one stage whose loss has counted terms: the
    tower's backward starts once every tower's count is known (start_flight's
    count_first), outside the trace. A split model's pipeline tower, where no term is
    counted, is one function as one stage is, its stage k on the tower's device for
    part 0 of part_homes[k] (where Mesh.grid has the stage); where a term is counted,
    its stages' forwards name the part devices of the tower that traced them, and
    each other tower's calls, and those of their gradients, are pointed at copies with
    its own (tower_trace.OptimisedCalls).

    One tf.function (per stage) serves every tower: the tower index is an argument
    and no device is named inside, so a call runs on the device it is called on, as
    its ops without a device take their caller's; where split layers name their
    parts' devices inside, each other tower calls a copy of the trace with its own
    (tower_trace.TowerTrace). A shard is traced for its rows where the step is (a
    batch whose rows are the same every step), else with its rows unknown, so shards of
    any size share a trace (one per micro-batch count and may_be_empty); XLA compiles
    once per shape: split_batch gives at most two shard (and micro-batch) sizes per
    global batch size, so uneven and last batches add a few compilations, not one per
    step. Nothing is padded, since padding rows would change BatchNorm's statistics.
    """
    optimise = None if jit_compile else optimise
    if jit_compile:  # XLA compiles for one device: one stage
        whole = stages.num_stages == 1
    else:  # unless a backward waits for the counts; stages only where split layers
        # name part devices, which a stage's function shared by every tower cannot
        whole = not objective.counted and (stages.num_stages == 1 or part_homes is not None)
    if not whole:
        renamed = part_homes is not None  # a stage's forward names its parts' devices
        return forwards_traced_once(stages, jit_compile, None if optimise is None and not renamed
                                    else tower_trace.OptimisedCalls(optimise), objective)

    @tf.function(jit_compile=jit_compile, autograph=False)
    def run_compiled_tower(shard, batch_rows, weights, state, tower_index, loss_scale,
                           micro_batching, sum_scale):
        # The rows from the shard's shape, which XLA knows: it needs split sizes it can
        # fold to constants. (It does not fold unless_empty's cond away: a cnn ran 20x
        # slower with it, so full batches get the variant without, as outside XLA.)
        # micro_batching: (micro-batches, may_be_empty), Python values: one trace each.
        micro_batches, may_be_empty = micro_batching
        step = StepWork(stages, objective, batch_rows, loss_scale, micro_batches, schedule,
                        may_be_empty, sum_scale=sum_scale)
        devices = [None] if stages.num_stages == 1 else [
            op_layers.part_device(home, 0) for home in part_homes]
        tower = TowerWork(shard, split.batch_size(shard), weights, state, devices, tower_index)
        return run_tower(step, tower, densify)

    traced = tower_trace.TowerTrace(run_compiled_tower, optimise)

    def run_on_its_device(step, tower):
        with tf.device(tower.devices[0]):
            return Finished(traced(
                tower.devices[0], tower.shard, step.batch_rows, tower.weights, tower.state,
                tf.constant(tower.index), step.loss_scale,
                (step.micro_batches, step.may_be_empty), step.sum_scale))

    return CompiledTower(run_on_its_device, optimised=optimise is not None)


def forwards_traced_once(stages, jit_compile=False, calls=None, objective=None):
    """A CompiledTower whose flights call each stage's forward traced once (one
    tf.function per stage, _traced_forward's) for every tower and micro-batch, and its
    gradient, which TensorFlow makes once per trace; the counts and the flight between
    the stages stay outside, in the step. Given the `objective` (a losses.Objective),
    the last of several stages calls its forward, its share of the loss and its
    backward as one function (traced_last_stage), where its backward need not wait
    for the counts; else the loss is traced in the step. calls: None, or a
    tower_trace.OptimisedCalls the calls are pointed through once a flight finishes."""
    forwards = traced_forwards(stages, training=True, jit_compile=jit_compile)
    last_stage = (None if objective is None or stages.num_stages == 1
                  else traced_last_stage(stages, objective, jit_compile))

    def run_stages(step, tower):
        step = dataclasses.replace(step, forwards=forwards, last_stage=last_stage)
        if calls is None:
            return start_flight(step, tower)
        return _CallsPointed(lambda: start_flight(step, tower), calls)

    return CompiledTower(run_stages, optimised=calls is not None)


def traced_forwards(stages, training, jit_compile=False):
    """Per stage of `stages`, forward(model, ..., training) as one tf.function that every
    tower and micro-batch calls on its own device: fn(weights, state, x) -> forward's
    result, traced once per structure of x (and per rows of x where the step is traced
    for its rows: split.work_spec). With split layers a trace
    names the part devices of the tower that first called it: each other tower's calls
    are then pointed at a copy with its own (tower_trace.OptimisedCalls)."""
    return tuple(_traced_forward(model, training, jit_compile) for model in stages.models)


def traced_last_stage(stages, objective, jit_compile=False):
    """flight.last_stage_at_once on the last of `stages` as one tf.function that every
    tower and micro-batch calls on its own device (StepWork.last_stage): its forward in
    training mode, its share of the batch's loss by `objective` and the backward of
    each pass, in one call; traced once per structure of its inputs (and per rows, as
    traced_forwards). A pipeline tower's last stage then makes one call per
    micro-batch, not a forward, the loss's ops and a backward: fewer ops for the step
    to trace and for TensorFlow to place, optimise and partition on its first call,
    and the loss and its gradient optimised once with the stage's own ops. Every
    argument that differs between calls is one of the function's, so one trace
    serves every tower."""
    k = stages.num_stages - 1

    def at_once(weights, state, inputs, masks, targets, rows, step_values, persistent):
        inputs = losses.with_masks((inputs, masks))
        batch_rows, loss_scale, sum_scale, may_be_empty = step_values
        step = StepWork(stages, objective, batch_rows, loss_scale, may_be_empty=may_be_empty,
                        sum_scale=sum_scale)
        micro_batch = TowerWork((inputs, *targets), rows, weights, state, devices=None,
                                index=None)
        return flight.last_stage_at_once(StageWork(step, micro_batch), k, weights, state,
                                         inputs, persistent)

    traced = tf.function(at_once, jit_compile=jit_compile, autograph=False)

    def call(weights, state, inputs, targets, rows, step_values, persistent):
        return _called_for_rows(traced, weights, state,
                                (inputs, losses.output_masks(inputs), targets),
                                (rows, step_values, persistent))

    return call


def _traced_forward(model, training, jit_compile):
    """forward(model, ..., training) as one tf.function: fn(weights, state, x) ->
    forward's result. The Keras masks x's tensors carry (a cut's, forward.cross_cut)
    go in as inputs of their own and are attached again inside: a tf.function's
    inputs carry no attribute."""
    def forward_with_masks(weights, state, x, masks):
        return forward(model, weights, state, losses.with_masks((x, masks)), training=training)

    traced = tf.function(forward_with_masks, jit_compile=jit_compile, autograph=False)

    def call(weights, state, x):
        return _called_for_rows(traced, weights, state, (x, losses.output_masks(x)))

    return call


def _called_for_rows(traced, weights, state, by_rows, rest=()):
    """traced(weights, state, *by_rows, *rest) (a tf.function), traced for
    split.work_spec of each of `by_rows`, the values whose first dim is the micro-batch's
    rows: for their rows where the step is traced for its rows, else for any."""
    specs = [split.work_spec(value) for value in by_rows]
    return traced.get_concrete_function(weights, state, *specs, *rest)(
        weights, state, *by_rows, *rest)
