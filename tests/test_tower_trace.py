"""engine/tower_trace.py: one trace of a tower's work, each other tower calling a copy
with its part devices renamed, optimised by grappler once where asked; a trace that
captures a tower's own tensor is not copied."""

import functools

import tensorflow as tf
from absl.testing import parameterized

from towers.engine import tower_trace
from towers.op_parallel import layers as op_layers
from towers.training import graph_rewrites
from tests import reference

DEVICES = [f"/device:CPU:{i}" for i in range(4)]
HOME = tuple(DEVICES[:2])  # the parts' own devices: tower 0's
PLACES = [{HOME: DEVICES[:2]}, {HOME: DEVICES[2:]}]  # tower i's devices for them
SHARDS = [tf.constant([1.0, 2.0]), tf.constant([2.0, 3.0])]


def _work(x, scale):
    """Part 0 doubles x, part 1 adds scale; each where parts_on places it."""
    with tf.device(op_layers.part_device(list(HOME), 0)):
        doubled = x * 2.0
    with tf.device(op_layers.part_device(list(HOME), 1)):
        return tf.cond(tf.reduce_sum(doubled) > 0.0, lambda: doubled + scale,
                       lambda: doubled - scale)


def _optimise(calls, function_defs, inputs, devices):
    """GraphRewrites' optimisation on CPUs, its devices recorded in `calls`."""
    calls.append(devices)
    rewrites = graph_rewrites.GraphRewrites(DEVICES, lambda: True)
    return rewrites.optimised_function(function_defs, inputs, devices)


class TowerTraceTest(tf.test.TestCase, parameterized.TestCase):

    def _placed(self, step, *args):
        """{(op type, tower): the devices it runs on} for Mul and AddV2/Sub, every call."""
        graph = step.get_concrete_function(*args).graph.as_graph_def()
        library = {f.signature.name: f for f in graph.library.function}
        placed = {}
        for node in reference._called_nodes(graph.node, library, "", ""):
            if node.op in ("Mul", "AddV2"):
                tower = node.name.split("/")[0]
                placed.setdefault((node.op, tower), set()).add(node.device)
        return placed

    def _step(self, traced):
        @tf.function(autograph=False)
        def step(shards, scale):
            outputs = []
            for i, places in enumerate(PLACES):
                with (tf.name_scope(f"tower_{i}"), op_layers.parts_on(places),
                      tf.device(places[HOME][0])):  # as compiled_tower calls it
                    outputs.append(traced(places[HOME][0], shards[i], scale))
            return outputs

        return step

    def test_each_tower_runs_its_copy_on_its_devices_from_one_trace(self):
        traced = tower_trace.TowerTrace(tf.function(_work, autograph=False))
        step = self._step(traced)
        self.assertAllClose(step(SHARDS, 0.5), [[2.5, 4.5], [4.5, 6.5]])
        self.assertEqual(traced.function.experimental_get_tracing_count(), 1)
        self.assertEqual(self._placed(step, SHARDS, 0.5), {
            ("Mul", "tower_0"): {DEVICES[0]}, ("AddV2", "tower_0"): {DEVICES[1]},
            ("Mul", "tower_1"): {DEVICES[2]}, ("AddV2", "tower_1"): {DEVICES[3]}})

    def test_an_optimised_trace_is_optimised_once_and_copied_for_each_tower(self):
        """grappler takes the trace once, for the devices it names and its tower's;
        every tower, the first too, calls a copy of what it returns, placed as the
        trace is."""
        optimised = []
        traced = tower_trace.TowerTrace(tf.function(_work, autograph=False),
                                        functools.partial(_optimise, optimised))
        step = self._step(traced)
        self.assertAllClose(step(SHARDS, tf.constant(0.5)), [[2.5, 4.5], [4.5, 6.5]])
        self.assertAllClose(step(SHARDS, tf.constant(-9.0)), [[-7.0, -5.0], [-5.0, -3.0]])
        self.assertEqual(optimised, [sorted(DEVICES[:2])])  # once, for tower 0's devices
        self.assertEqual(self._placed(step, SHARDS, tf.constant(0.5)), {
            ("Mul", "tower_0"): {DEVICES[0]}, ("AddV2", "tower_0"): {DEVICES[1]},
            ("Mul", "tower_1"): {DEVICES[2]}, ("AddV2", "tower_1"): {DEVICES[3]}})

    @parameterized.parameters(False, True)
    def test_a_trace_capturing_a_towers_tensor_is_traced_per_tower(self, optimised):
        """A copy would read tower 0's tensor: tower 1 runs its own Python instead (its
        own trace, optimised on its own, where traces are optimised)."""
        own, optimisations = {}, []
        traced = tower_trace.TowerTrace(
            tf.function(lambda scale: _work(own["x"], scale), autograph=False),
            functools.partial(_optimise, optimisations) if optimised else None)

        @tf.function(autograph=False)
        def step(shards, scale):
            outputs = []
            for i, places in enumerate(PLACES):
                own["x"] = tf.identity(shards[i])  # this tower's tensor, captured
                with (tf.name_scope(f"tower_{i}"), op_layers.parts_on(places),
                      tf.device(places[HOME][0])):
                    outputs.append(traced(places[HOME][0], scale))
            return outputs

        scale = tf.constant(0.5)
        self.assertAllClose(step(SHARDS, scale), [[2.5, 4.5], [4.5, 6.5]])
        self.assertLen(optimisations, 2 if optimised else 0)  # one per tower
        self.assertEqual(self._placed(step, SHARDS, scale), {
            ("Mul", "tower_0"): {DEVICES[0]}, ("AddV2", "tower_0"): {DEVICES[1]},
            ("Mul", "tower_1"): {DEVICES[2]}, ("AddV2", "tower_1"): {DEVICES[3]}})

    def test_calls_in_conds_and_their_gradients_call_copies_optimised_once(self):
        """OptimisedCalls: a traced function two towers call under a tape inside a
        tf.cond (as unless_empty's), and its gradient: each optimised once, for the
        first tower's device; every call, in the conds' branches too, calls a copy;
        the results are as without."""
        optimised = []
        calls = tower_trace.OptimisedCalls(functools.partial(_optimise, optimised))
        cube = tf.function(lambda x: x * x * x, autograph=False)

        @tf.function(autograph=False)
        def step(shards, rows):
            graph = tf.compat.v1.get_default_graph()
            known = len(graph.get_operations())
            grads = []
            for device, shard in zip(DEVICES, shards):
                with tf.device(device):  # as a flight's stages: forward and backward
                    with tf.GradientTape() as tape:
                        tape.watch(shard)
                        cubed = tf.cond(rows > 0, lambda: cube(shard),
                                        lambda: tf.zeros_like(shard))
                    grads.append(tape.gradient(cubed, shard))
            calls.point(graph.get_operations()[known:])
            return grads

        self.assertAllClose(step(SHARDS, tf.constant(1)), [[3.0, 12.0], [12.0, 27.0]])
        self.assertAllClose(step(SHARDS, tf.constant(0)), [[0.0, 0.0], [0.0, 0.0]])
        self.assertEqual(optimised, [[DEVICES[0]]] * 2)  # the forward, its gradient
        graph = step.get_concrete_function(SHARDS, tf.constant(1)).graph.as_graph_def()
        library = {f.signature.name: f for f in graph.library.function}
        called = [node.attr["f"].func.name for node in reference._called_nodes(
            graph.node, library, "", "") if node.op in tower_trace.CALLS]
        self.assertLen(called, 4)  # per tower, the forward and the gradient
        self.assertTrue(all("_tower_copy_" in name for name in called), called)
