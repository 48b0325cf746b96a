"""One trace of a tower's work for every tower, where the trace names the tower's devices.

A tower's work (traced_tower.compiled_tower's function) takes its shard, weights and state as
arguments and names no device of its own, so one trace serves every tower: called under
tf.device(tower's device), its ops run there. Split layers are the exception: a part's
work runs on the tower's device for that part (op_parallel.layers.parts_on), a name
written into the trace. Tracing each tower again costs the Python of a whole forward
and backward per tower (a split transformer: 0.8 s at 1 tower, 1.9 s at 4); so the
work is traced once, for the first tower that calls it, and every other tower calls a
copy of that trace whose part devices are renamed to its own (`TowerTrace`). The copy
is TensorFlow's own graph of the trace (its FunctionDef and the functions it calls,
such as a tf.cond's branches), with each node's device replaced; nothing is traced.

What the trace reads besides its arguments (its captures) must be the same for every
tower; a trace that captures anything but variables and constants is not copied, and
each tower traces its own (where it was before).

Given `optimise`, the trace is also optimised once by TensorFlow's graph optimiser
(grappler) before it is copied, and every tower, the first too, calls an optimised
copy: TensorFlow inlines each tower's call into the step before it optimises the
step's graph, so grappler would otherwise take N copies of the same work (a 2-block
transformer: 0.14 s at 1 tower, 0.55 s at 4, most of the step's first call);
training/graph_rewrites.py then leaves the step's graph to its cheap passes.

A pipeline's stages are not one trace: each stage's forward on a micro-batch is a
traced function, and so is its backward, the gradient TensorFlow makes of it (a copy
of a trace would have none); the last stage's forward, loss and backward are one
traced function (traced_tower.traced_last_stage). Every tower and micro-batch calls
the same ones, so once a tower's calls are made, each is pointed at a copy of its
function that grappler optimised once (`OptimisedCalls`): a 4-tower pipeline of 2
micro-batches calls each 8 times. Where the stages hold split layers, whose traces
name their parts' devices, each tower's calls are pointed at copies with its own
part devices, renamed from those of the tower the function was made for (its forward
traced, its gradient taken). Where no backward waits for the batch's counts, the
tower's whole flight is one trace instead, copied for each other tower as above (its
stage devices are its parts' too): optimised whole, once.
"""

import functools
import itertools

import tensorflow as tf

from towers import compat
from towers.data_parallel import split
from towers.devices import canonical_name
from towers.op_parallel import layers as op_layers

_COPY_NUMBERS = itertools.count()  # a copy's functions' names are unique in the process
CALLS = ("PartitionedCall", "StatefulPartitionedCall")  # ops that call the function f


class TowerTrace:
    """`function` (a tf.function of a tower's work, autograph off) traced once per input
    signature and called by every tower: fn(device, shard, *args) -> its outputs, for
    the tower on `device` whose split layers' places (op_parallel.layers.parts_on) are
    in effect; a tower other than the one the trace was made for calls its copy with
    its own part devices. The shard (function's first argument) is traced as
    split.work_spec says: for its rows where the step's batch fills every micro-batch
    with rows known as it is traced, else with its rows unknown (shards of any size
    then share a trace).

    optimise: None, or fn(function_defs, inputs, devices) -> FunctionDefs, grappler's
      optimisation of function_defs[0] and the functions it calls (inputs: a
      tf.TensorSpec per argument; devices: those its nodes name), which every tower
      then calls a copy of (graph_rewrites.GraphRewrites.optimised_function).
    """

    def __init__(self, function, optimise=None):
        self.function, self.optimise = function, optimise
        self._traced_for = {}  # a trace's name -> the places in effect when it was traced
        self._function_defs = _FunctionDefsOnce(optimise)
        self._copies = {}  # (a trace's name, the places of a tower) -> its copy

    def __call__(self, device, shard, *args):
        args = (shard, *args)
        specs = (split.work_spec(shard), *args[1:])
        places = op_layers.current_places() or {}
        traces_before = self.function.experimental_get_tracing_count()
        trace = self.function.get_concrete_function(*specs)
        if self.function.experimental_get_tracing_count() > traces_before:
            self._traced_for[trace.name] = places
        renames = _device_renames(self._traced_for[trace.name], places)
        if renames and not copyable(trace):  # each tower traces its own
            if self.optimise is None:
                return self.function.python_function(*args)
            own = tf.function(self.function.python_function, autograph=False)
            own_trace = own.get_concrete_function(*specs)  # this call's alone: not kept
            optimised = _optimised(_trace_function_defs(own_trace), self.optimise, device)
            return compat.calling_instead(own_trace, _copy(optimised, {}), args)
        if not renames and self.optimise is None:
            return trace(*args)
        key = (trace.name, _places_key(places))
        if key not in self._copies:
            self._copies[key] = self._copy_for(trace, renames, device)
        return compat.calling_instead(trace, self._copies[key], args)

    def _copy_for(self, trace, renames, device):
        """A copy of `trace` (optimised once, given self.optimise) with its devices
        renamed."""
        return _copy(self._function_defs(trace.name, lambda: _trace_function_defs(trace),
                                         device), renames)


class OptimisedCalls:
    """The calls a tower's work makes to traced functions whose gradients TensorFlow
    makes (a pipeline stage's forward, its backward), each made to call a copy of the
    function, optimised once where `optimise` is given, whichever tower, micro-batch or
    step calls it: `point(operations)` once they are made. A call inside a tf.cond's
    branch (unless_empty's) too: the branch is copied with its calls pointed. A call
    that names no device (none of a flight's) is left as it is.

    Where split layers name their parts' devices inside a trace, a function serves
    every tower too: each tower's calls point at a copy with the part devices renamed
    to its own, from those in effect where the function was made (a forward when the
    first tower called it, its backward when that tower's gradient was taken; a
    function is first seen by the tower it was made for, whose calls point first).

    optimise: as TowerTrace's, or None: copies made only where devices are renamed.
    """

    def __init__(self, optimise):
        self.optimise = optimise
        self._made_for = {}  # a function's name -> the places in effect where it was made
        self._function_defs = _FunctionDefsOnce(optimise)
        self._copies = {}  # (a function's name, places) -> what its calls call (None: it)
        self._copy_names = set()

    def point(self, operations):
        """Makes each of `operations` (ops of the graph being built, by the tower whose
        places, op_parallel.layers.parts_on, are in effect) that calls a function, or
        holds one as a branch, call its copy."""
        places = op_layers.current_places() or {}
        for op in operations:
            for attribute, called in _function_attributes(op.node_def):
                copy = self._copy_of(op.graph, called, op.type in CALLS, op.device, places)
                if copy is not None:
                    compat.call_instead(op, attribute, copy)

    def _copy_of(self, graph, name, called, device, places):
        """What a call (`called`) or a branch of `name`, placed on `device`, calls
        instead for the tower at `places`: the function optimised, its devices renamed,
        or a branch that calls copies; None where nothing changes."""
        if name in self._copy_names or not device:
            return None
        key = (name, _places_key(places))
        if key not in self._copies:
            function = compat.graph_function_def(graph, name)
            if function is None:
                return None
            renames = _device_renames(self._made_for.setdefault(name, places), places)
            if not called:
                copy = self._branch_copy(graph, function, device, places)
            elif self.optimise is None and not renames:
                copy = None
            else:
                lookup = functools.partial(compat.graph_function_def, graph)
                copy = _copy(self._function_defs(
                    name, lambda: _function_defs(function, lookup), device), renames)
            self._copies[key] = copy
            if copy is not None:
                self._copy_names.add(copy.name.decode())
        return self._copies[key]

    def _branch_copy(self, graph, branch, device, places):
        """A copy of `branch` (a control-flow op's FunctionDef) whose calls call their
        copies, or None where it calls no function that has one."""
        branch = _copied(branch)
        copies = []
        for node in branch.node_def:
            for called in _called(node):
                copy = self._copy_of(graph, called.name, node.op in CALLS,
                                     node.device or device, places)
                if copy is not None:
                    called.name = copy.name.decode()
                    copies.append(copy)
        if not copies:
            return None
        branch.signature.name += f"_calls_optimised_{next(_COPY_NUMBERS)}"
        return compat.runtime_function(branch, copies)


class _FunctionDefsOnce:
    """fn(name, function_defs, device) -> the FunctionDefs of the function `name` and
    of those it calls (function_defs(): them, the function first), made once per name
    and optimised by `optimise` (TowerTrace's) where given, for a caller on `device`."""

    def __init__(self, optimise):
        self.optimise, self._made = optimise, {}  # a function's name -> its FunctionDefs

    def __call__(self, name, function_defs, device):
        if name not in self._made:
            made = function_defs()
            self._made[name] = made if self.optimise is None else _optimised(
                made, self.optimise, device)
        return self._made[name]


def _device_renames(traced_places, places):
    """{a device the trace names (canonical): the tower's device for it}, where they
    differ."""
    renames = {}
    for home, traced in traced_places.items():
        for was, now in zip(traced, places[home]):
            if canonical_name(was) != canonical_name(now):
                renames[canonical_name(was)] = canonical_name(now)
    return renames


def _places_key(places):
    return tuple(sorted((home, tuple(devices)) for home, devices in places.items()))


def copyable(trace):
    """Whether every tower may read what `trace` (a ConcreteFunction) captures: variables,
    or constants, never a tensor of the caller's graph (what it reads may be one
    tower's own)."""
    return all(t.dtype == tf.resource or not tf.is_symbolic_tensor(t)
               for t in trace.captured_inputs)


def _function_defs(first, lookup):
    """`first` (a FunctionDef) and every function it calls, in the order it first calls
    them (lookup(name) -> a FunctionDef, or None for one it does not hold): the same
    for two traces of the same work (a trace's library also holds functions it does
    not call, such as a cond's branches as they were before their gradient rewrote
    them)."""
    ordered, seen = [first], {first.signature.name}
    for function in ordered:  # grows as it goes: each function's callees after it
        for node in function.node_def:
            for called in _called(node):
                found = None if called.name in seen else lookup(called.name)
                if found is not None:
                    seen.add(called.name)
                    ordered.append(found)
    return ordered


def _trace_function_defs(trace):
    """_function_defs of a ConcreteFunction, from its own graph's library."""
    library = {f.signature.name: f for f in trace.graph.as_graph_def().library.function}
    return _function_defs(trace.function_def, library.get)


def _function_attributes(node_def):
    """(attribute, function name) of each function a NodeDef holds in an attribute of
    its own (a call's f, a cond's branches, a while loop's cond and body)."""
    for attribute, value in node_def.attr.items():
        if value.HasField("func"):
            yield attribute, value.func.name


def _called(node):
    """The functions a NodeDef calls: its attributes' NameAttrLists (a call's f, a
    cond's branches, a while loop's cond and body)."""
    for value in node.attr.values():
        if value.HasField("func"):
            yield value.func
        yield from value.list.func


def _optimised(function_defs, optimise, device):
    """optimise's FunctionDefs of function_defs[0] (calling the others), called by the
    tower on `device`. A node that names no device runs on the caller's: grappler is
    told so (its rewrites differ by device), and the name is taken off again, so that
    each caller's call places it."""
    device = canonical_name(device)
    function_defs = [_copied(function) for function in function_defs]
    named = {device}
    for node in _nodes(function_defs):
        if node.device:
            named.add(canonical_name(node.device))
        else:
            node.device = device
    inputs = [tf.TensorSpec(None, tf.as_dtype(arg.type))
              for arg in function_defs[0].signature.input_arg]
    optimised = optimise(function_defs, inputs, sorted(named))
    for node in _nodes(optimised):
        if node.device and canonical_name(node.device) == device:
            node.device = ""
    return optimised


def _copied(function):
    copy = type(function)()
    copy.CopyFrom(function)
    return copy


def _nodes(function_defs):
    return (node for function in function_defs for node in function.node_def)


def _copy(function_defs, renames):
    """A runtime function (compat.runtime_function): a copy of function_defs[0] and of
    every function it calls (the others), each under a new name, each node's device
    renamed by `renames` (only a node placed as a mesh places it: a device with no job
    or task)."""
    suffix = f"_tower_copy_{next(_COPY_NUMBERS)}"
    names = {f.signature.name for f in function_defs}
    copied = []
    for function in function_defs:
        copy = _copied(function)
        copy.signature.name += suffix
        for node in copy.node_def:
            spec = tf.DeviceSpec.from_string(node.device) if node.device else None
            if (spec is not None and spec.device_type and spec.job is None
                    and spec.task is None and canonical_name(node.device) in renames):
                node.device = renames[canonical_name(node.device)]
            for called in _called(node):
                if called.name in names:
                    called.name += suffix
        copied.append(copy)
    return compat.runtime_function(copied[0], [compat.runtime_function(callee, [])
                                               for callee in copied[1:]])
