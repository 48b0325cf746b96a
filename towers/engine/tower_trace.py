"""One trace of a tower's work for every tower, where the trace names the tower's devices.

A tower's work (tower.compiled_tower's function) takes its shard, weights and state as
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
"""

import itertools

import tensorflow as tf

from towers import compat
from towers.devices import canonical_name
from towers.op_parallel import layers as op_layers

_COPY_NUMBERS = itertools.count()  # a copy's functions' names are unique in the process


class TowerTrace:
    """`function` (a tf.function of a tower's work, autograph off) traced once per input
    signature and called by every tower: fn(*args) -> its outputs, for the tower whose
    split layers' places (op_parallel.layers.parts_on) are in effect; a tower other than
    the one the trace was made for calls its copy with its own part devices."""

    def __init__(self, function):
        self.function = function
        self._traced_for = {}  # a trace's name -> the places in effect when it was traced
        self._copies = {}  # (a trace's name, the places of a tower) -> its copy

    def __call__(self, *args):
        places = op_layers.current_places() or {}
        traces_before = self.function.experimental_get_tracing_count()
        trace = self.function.get_concrete_function(*args)
        if self.function.experimental_get_tracing_count() > traces_before:
            self._traced_for[trace.name] = places
        renames = _device_renames(self._traced_for[trace.name], places)
        if not renames:
            return trace(*args)
        key = (trace.name, _places_key(places))
        if key not in self._copies:
            if not _copyable(trace):  # each tower traces its own
                return self.function.python_function(*args)
            self._copies[key] = _copy(trace, renames)
        return compat.calling_instead(trace, self._copies[key], args)


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


def _copyable(trace):
    """Whether every tower may read what `trace` captures: variables, or constants."""
    return all(t.dtype == tf.resource or not tf.is_symbolic_tensor(t)
               for t in trace.captured_inputs)


def _copy(trace, renames):
    """A runtime function (compat.runtime_function): a copy of `trace` and of every
    function it calls, each under a new name, each node's device renamed by `renames`
    (only a node placed as a mesh places it: a device with no job or task)."""
    suffix = f"_tower_copy_{next(_COPY_NUMBERS)}"
    callees = list(trace.graph.as_graph_def().library.function)
    names = {f.signature.name for f in callees + [trace.function_def]}
    copied = []
    for function in callees + [trace.function_def]:  # the trace's own last: it calls them
        copy = type(function)()
        copy.CopyFrom(function)
        copy.signature.name += suffix
        for node in copy.node_def:
            spec = tf.DeviceSpec.from_string(node.device) if node.device else None
            if (spec is not None and spec.device_type and spec.job is None
                    and spec.task is None and canonical_name(node.device) in renames):
                node.device = renames[canonical_name(node.device)]
            for value in node.attr.values():
                for called in ([value.func] if value.HasField("func") else []) + list(
                        value.list.func):
                    if called.name in names:
                        called.name += suffix
        copied.append(copy)
    return compat.runtime_function(copied[-1], [compat.runtime_function(callee, [])
                                                for callee in copied[:-1]])
