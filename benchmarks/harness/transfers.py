"""Bytes one call of a tf.function moves between devices, as TensorFlow ran it.

TensorFlow moves a tensor between devices by a _Send/_Recv pair in the graphs it
partitions a function into, one pair per tensor and destination device. Graph
collection hands those graphs back; tfdbg (tensor_debug_mode="SHAPE") records
the shape of every op output each time the op runs. Each send is sized from the
records of the tensor it sends, so dims unknown when tracing (a batch of None,
a boolean_mask's rows) count as they were in the run. A tf.cond or
tf.while_loop runs as Switch and Merge ops, and tfdbg records shapes, not the
predicate's values: how often a Switch passed a tensor on is read from how often
the recorded ops after it ran.
"""

import collections
import dataclasses
import math
import tempfile

import numpy as np
import tensorflow as tf

import towers
from benchmarks.harness import compat
from towers.engine import step as step_lib
from towers.training import placement, recompute

_SENDS = ("_Send", "_HostSend")
_RECEIVES = ("_Recv", "_HostRecv")
# Ops whose output k is their data input k (tfdbg does not record these).
_FORWARDS = ("Identity", "IdentityN", "Snapshot", "Enter", "Exit", "NextIteration", "LoopCond")
# Where a branch or loop body ends or a nested one begins: past them an op runs
# more or less often than the Switch port that led there.
_FRAME_EDGES = ("Merge", "Switch", "Enter", "NextIteration")


def bytes_between_devices(function, *args):
    """Runs `function` (a tf.function) once on `args` and returns what crossed devices:
    {"total": int bytes, "by_pair": {(source device, destination device): bytes},
     "tensors": [(source device, destination device, tensor name, dtype name, shape, bytes), ...]}
    Device names canonical, e.g. "/device:CPU:1"; shapes as they were in the run.

    "tensors" has one entry per transfer: a tensor sent in a loop body, one per
    iteration; one sent into the branch a tf.cond did not take moves nothing and
    has none, nor do control edges. Names are TensorFlow's in the partitioned
    graph, where `function` is inlined under its call ("StatefulPartitionedCall/
    ..."; an argument shows as "Func/.../input/_N" or "unknown"). Shape is None
    above rank 6 (tfdbg records 6 dims).

    Not counted: copies outside the function's graph (its arguments to the
    devices that read them, its results back), and copies between one device's
    host and device memory.

    `function` itself is left as it was: a copy of it runs, instrumented by tfdbg,
    whose ops can change what grappler rewrites (a tf.cond's predicate may cross
    as a byte more or less). Raises ValueError for a transfer whose run-time size
    tfdbg did not record: a tensor made inside a nested tf.function or an XLA
    computation (traced uninstrumented, see below), or of a dtype other than
    float, int and bool.
    """
    # The probe captures `args`: tfdbg's summaries of a function's arguments do not reach
    # its partitioned graphs, those of captured tensors do. A captured NumPy array would
    # be a constant, which grappler could fold into the function.
    args = tf.nest.map_structure(
        lambda arg: tf.constant(arg) if isinstance(arg, np.ndarray) else arg, args)
    # Nested tf.functions are traced now, plainly, so that the instrumented trace finds
    # them in their caches: instrumented ones left there would crash once tfdbg is off.
    compat.untraced_copy(function).get_concrete_function(*args)
    copy = compat.untraced_copy(function)  # its trace carries tfdbg's; `function`'s stays clean
    probe = tf.function(lambda: copy(*args))
    with tempfile.TemporaryDirectory() as dump_root:
        tf.debugging.experimental.enable_dump_debug_info(
            dump_root, tensor_debug_mode="SHAPE", circular_buffer_size=-1)
        try:
            probe.get_concrete_function()  # traced first: ops run while tracing are not collected
            with compat.partitioned_graphs() as run_metadata:
                probe()
                metadata = run_metadata()
        finally:
            tf.debugging.experimental.disable_dump_debug_info()
        runs = _recorded_runs(dump_root)
    tensors = [transfer for graph in metadata.function_graphs
               for transfer in _Partitions(graph, runs).transfers()]
    by_pair = collections.Counter()
    for source, destination, *_, size in tensors:
        by_pair[source, destination] += size
    return {"total": sum(by_pair.values()), "by_pair": dict(by_pair), "tensors": tensors}


def trainer_step_bytes(trainer, batch):
    """bytes_between_devices of one step of `trainer` (set up by a first train_step) on
    `batch`: steps 1-6 (run_towers) and the update, as its compiled step runs them
    (traced with the trainer's hooks: updates and table reads placed as there; the
    layers recompute names recomputed).

    Without XLA, each tower is traced into the step on its own here: tfdbg records no op
    inside the one tf.function the trainer's step calls on every tower's device
    (traced_tower.traced_once), and what crosses devices is the same either way, that
    function's inputs and outputs and what its ops name a device for. Traced without
    autograph, as the trainer's own step is (compiled.py)."""
    setup = (trainer.setup if trainer.jit_compile else
             dataclasses.replace(trainer.setup, compiled_tower=None))

    @tf.function(autograph=False)
    def step(batch):
        result = step_lib.run_towers(setup, trainer.objective, batch)
        step_lib.apply_update(trainer.optimizer, result.grads,
                              trainer.model.trainable_variables, trainer.setup.main_device)
        return result.loss

    with placement.step_hooks(trainer), recompute.recomputing(trainer.recomputed_layers):
        return bytes_between_devices(step, batch)


def _recorded_runs(dump_root):
    """{tfdbg tensor id: [(shape, bytes) each time its op ran]} from a SHAPE-mode dump."""
    runs = collections.defaultdict(list)
    with compat.DebugDataReader(dump_root) as reader:
        reader.update()
        for trace in reader.graph_execution_traces():
            tensor_id, dtype, rank, size, *dims = (int(v) for v in trace.debug_tensor_value)
            shape = tuple(dims[:rank]) if rank <= len(dims) else None
            runs[tensor_id].append((shape, size * tf.as_dtype(dtype).size))
    return runs


def _is_stateful(op_type):
    """Whether ops of `op_type` have effects beyond their outputs (a variable update)."""
    try:
        return compat.op_def(op_type).is_stateful
    except AttributeError:  # a function's name, not an op's
        return False


def _tensor(name):
    """An input as a tensor name: 'op' -> 'op:0', 'op:1' as it is."""
    return name if ":" in name else name + ":0"


def _node_name(name):
    """'^op', 'op', 'op:1' -> 'op'."""
    return name.lstrip("^").split(":")[0]


class _Partitions:
    """One function's partitioned graphs, with tfdbg's records of their tensors."""

    def __init__(self, function_graph, runs):
        self.nodes = {n.name: n for graph in function_graph.partition_graphs for n in graph.node}
        self.readers = collections.defaultdict(list)  # node name -> nodes that read it
        self.sends, self.receives = {}, {}  # by the name of the tensor they carry
        for node in self.nodes.values():
            for name in node.input:
                self.readers[_node_name(name)].append(node)
            if node.op in _SENDS + _RECEIVES:
                pairs = self.sends if node.op in _SENDS else self.receives
                pairs[node.attr["tensor_name"].s] = node
        # tfdbg summarises a tensor on the device of the op that made it in Python, which
        # may not be where the op ran (a variable read runs with the variable).
        self.measured = {}  # tensor -> its runs, for each tensor tfdbg summarised
        for node in self.nodes.values():
            if node.op == "DebugNumericSummaryV2":
                self.measured.setdefault(self._sent(_tensor(node.input[0])),
                                         runs[node.attr["tensor_id"].i])
        self.recorded = {_node_name(tensor): runs for tensor, runs in self.measured.items()}
        self.switches = [node for node in self.nodes.values() if node.op == "Switch"]
        self.times_live = {}  # (predicate, port) -> how often that port was live
        self.live = None  # names of the ops that ran for the function's effects (_live)

    def transfers(self):
        """(source, destination, tensor, dtype, shape, bytes) of each transfer."""
        for key, send in self.sends.items():
            source = towers.devices.canonical_name(send.attr["send_device"].s.decode())
            destination = towers.devices.canonical_name(send.attr["recv_device"].s.decode())
            if source == destination or not self._used(_tensor(self.receives[key].name)):
                continue  # memory types of one device, or sent only for tfdbg or the probe
            dtype = tf.as_dtype(send.attr["T"].type).name
            for shape, size in self.runs(_tensor(send.input[0])):
                yield source, destination, send.input[0], dtype, shape, size

    def _used(self, tensor):
        """Whether a live op (_live) reads `tensor`, directly or through Identity ops;
        tfdbg's ops and the probe's results do not count (the probe's results are placed
        on its default device; a function called plainly leaves them where they were made)."""
        for reader in self.readers[_node_name(tensor)]:
            for port, name in enumerate(reader.input):  # data inputs come first
                if (_tensor(name) != tensor or reader.op.startswith("Debug")
                        or reader.op == "_Retval"):
                    continue
                if reader.op in ("Identity", "IdentityN"):
                    if self._used(f"{reader.name}:{port}"):
                        return True
                elif reader.name in self._live():
                    return True
        return False

    def _live(self):
        """Names of the ops the function's results and effects need: its _Retvals and
        stateful ops (variable updates), the ops they read, and across devices the _Send
        of each _Recv read. What only tfdbg reads (an op grappler would have pruned, kept
        alive by a summary of it) is not among them."""
        if self.live is None:
            stack = [node for node in self.nodes.values() if node.op == "_Retval" or (
                _is_stateful(node.op) and not node.op.startswith("Debug"))]
            self.live = set()
            while stack:
                node = stack.pop()
                if node.name in self.live or node.op.startswith("Debug"):
                    continue  # tfdbg's ops run on control edges it adds: they need nothing
                self.live.add(node.name)
                stack.extend(self.nodes[_node_name(name)] for name in node.input)
                if node.op in _RECEIVES:
                    stack.append(self.sends[node.attr["tensor_name"].s])
        return self.live

    def runs(self, tensor):
        """(shape, bytes) of `tensor` each time it was computed and live."""
        tensor = self._sent(tensor)
        if tensor in self.measured:
            return self.measured[tensor]
        name, port = tensor.split(":")
        node = self.nodes[name]
        data_inputs = [_tensor(i) for i in node.input if not i.startswith("^")]
        if node.op == "Const":  # runs as often as its control inputs (a tf.cond branch's pivot)
            value = node.attr["value"].tensor
            shape = tuple(d.size for d in value.tensor_shape.dim)
            times = min((self._times_run(i[1:]) for i in node.input if i.startswith("^")),
                        default=1)
            return [(shape, math.prod(shape) * tf.as_dtype(value.dtype).size)] * times
        if node.op in _FORWARDS:
            return self.runs(data_inputs[int(port)])
        if node.op == "Merge":  # runs once per input that arrives
            return [run for data_input in data_inputs for run in self.runs(data_input)]
        if node.op == "Switch":
            live = self._times_live(self._origin(data_inputs[1]), port)
            runs = self.runs(data_inputs[0])
            # In a loop each iteration's value goes on to the body (port 1), the last out (0).
            return runs[:live] if port == "1" else runs[len(runs) - live:]
        raise ValueError(
            f"No run-time size for {tensor} ({node.op}): tfdbg records neither ops inside "
            "nested tf.functions or XLA computations nor dtypes other than float, int, bool.")

    def _times_run(self, name):
        """How often the node `name` ran."""
        node = self.nodes[name]
        if node.op == "DebugIdentityV2":  # runs when the summary it writes does
            return self._times_run(_node_name(node.input[0]))
        if node.op == "DebugNumericSummaryV2":
            return len(self.runs(_tensor(node.input[0])))
        return len(self.runs(_tensor(name)))

    def _sent(self, tensor):
        """The tensor that `tensor` is a copy of if a _Recv received it, else `tensor`."""
        node = self.nodes[_node_name(tensor)]
        if node.op in _RECEIVES:
            return self._sent(_tensor(self.sends[node.attr["tensor_name"].s].input[0]))
        return tensor

    def _origin(self, tensor):
        """The tensor that `tensor` is a copy of, across devices and Identity ops."""
        tensor = self._sent(tensor)
        node = self.nodes[_node_name(tensor)]
        return self._origin(_tensor(node.input[0])) if node.op == "Identity" else tensor

    def _times_live(self, predicate, port):
        """How often the Switches on `predicate` passed their input to `port`: as often as
        the nearest op after one of them that tfdbg recorded ran (tfdbg records shapes,
        not the predicate's values)."""
        if (predicate, port) in self.times_live:
            return self.times_live[predicate, port]
        queue = collections.deque(
            reader for switch in self.switches
            if self._origin(_tensor(switch.input[1])) == predicate
            for reader in self.readers[switch.name]
            if f"{switch.name}:{port}" in map(_tensor, reader.input))
        seen = set()
        while queue:
            node = queue.popleft()
            if node.name in seen or node.op.startswith("Debug") or node.op in _FRAME_EDGES:
                continue
            seen.add(node.name)
            if node.name in self.recorded:
                self.times_live[predicate, port] = len(self.recorded[node.name])
                return self.times_live[predicate, port]
            if node.op in _SENDS:
                queue.append(self.receives[node.attr["tensor_name"].s])
            queue.extend(self.readers[node.name])
        raise ValueError(f"No op that tfdbg recorded follows port {port} of the Switches "
                         f"on {predicate}: how often it was live is unknown.")
