"""How TensorFlow's graph optimiser (grappler) takes a trainer's compiled functions.

A step holds every tower's forward and backward: one traced function
(engine/traced_tower.py compiled_tower), which TensorFlow inlines into the step once per tower before grappler
runs, so grappler's first call sees N copies, and its time grows faster than the graph
(a 2-block transformer: 0.30 s at 1 tower, 1.17 s at 4, most of its first call). Three
of its defaults buy a step nothing, so a trainer's functions run without them:

- a second pass of every optimiser over the graph: on that step it removed 40 of its
  3046 nodes and took 0.28 s;
- where every device of the mesh is a CPU, the memory optimiser: it schedules and
  swaps GPU memory, and changed no node of a CPU step in 0.14 s;
- where every device of the mesh is a CPU, the layout optimiser: it converts the data
  formats of ops on GPUs (on CPUs only where RewriterConfig.cpu_layout_conversion asks),
  so a step on CPUs has nothing for it; without a GPU it returns the graph as it was,
  after inferring its shapes (0.07 s at 4 towers).

On a mesh of CPUs a trainer's tower work, traced once for every tower
(engine/tower_trace.py), is also optimised once, on its own, before the step calls it
(`optimised_function`); the step's training functions then run only grappler's cheap
passes, which take away what the towers' calls left around them (pruning, common
subexpressions, dependencies), and not its MLIR pass (tfg), which runs besides any list
of passes and changed no node of a 4-tower pipeline's step in 57 ms: grappler's time
hardly grows with the towers (that transformer, the tower's and the step's together:
0.16 s at 1 tower, 0.25 s at 4, where the whole step took 0.22 and 0.61 s), and the
steps are as fast (benchmarks/RESULTS.md); so too a pipeline's stages, whose forwards
and backwards are optimised once each (tower_trace.OptimisedCalls), and the eval and
predict steps, whose stages' inference forwards are (compiled_steps.py, from 2
towers). Not on GPUs, where grappler's
layout and fusion rewrites depend on the devices it sees placed: a step there keeps
the whole graph's optimisation.

What a user set on purpose (tf.config.optimizer, a number of passes, a list of
optimisers) is kept; the user's own functions are not touched. benchmarks/RESULTS.md,
"The first step".
"""

import contextlib

import tensorflow as tf
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2

from towers import compat

RewriterConfig = rewriter_config_pb2.RewriterConfig
# The functions of a training step, whose model work is the towers': each variant of
# "train" (compiled_steps.variant) and the trainer's in-graph loop, "steps".
TRAINING_KINDS = ("train", "steps")
# Those whose model work is each stage's forward in inference mode (compiled_steps.py).
INFERENCE_KINDS = ("eval", "predict")
# What grappler runs on a step whose tower work is optimised already: the passes that
# remove the Identity and NoOp nodes inlining leaves, and repeated subexpressions.
CHEAP_PASSES = ("pruning", "common_subgraph_elimination", "dependency")


class GraphRewrites:
    """The call options of one trainer's compiled functions: `calls(kind)` is entered
    around each call (its first call optimises the function's graph).

    devices: every device the trainer's steps run on (device strings).
    towers_optimised: fn() -> whether the trainer's tower work is optimised already
      (engine/traced_tower.py CompiledTower.optimised).
    forwards_optimised: fn() -> whether its eval and predict steps' forwards are
      (compiled_steps.inference_traced_once, on CPUs).
    """

    def __init__(self, devices, towers_optimised, forwards_optimised=lambda: False):
        self.all_cpu = all(tf.DeviceSpec.from_string(device).device_type == "CPU"
                           for device in devices)
        self.towers_optimised, self.forwards_optimised = towers_optimised, forwards_optimised
        self._options = {}  # (the thread's config now (serialized), cheap) -> its options
        self._thread_config = None  # within calls(): the thread's config outside it

    @contextlib.contextmanager
    def calls(self, kind):
        """A context manager: a tf.function of `kind` (CompiledFunctions' keys) called
        eagerly within it is optimised with this trainer's rewrites, on top of the
        thread's config now."""
        config = compat.current_call_config()
        kind = kind.split("_")[0]
        cheap = self.all_cpu and (kind in TRAINING_KINDS and self.towers_optimised()
                                  or kind in INFERENCE_KINDS and self.forwards_optimised())
        if (config, cheap) not in self._options:
            self._options[config, cheap] = compat.call_options_edited(
                config, lambda rewriter_config: self.edit(rewriter_config, cheap))
        # A function traced within (an in-graph loop) optimises its towers' work by the
        # thread's config, not by the cheap passes its call runs under.
        outside, self._thread_config = self._thread_config, config
        try:
            with compat.calls_with(self._options[config, cheap]):
                yield
        finally:
            self._thread_config = outside

    def function_optimiser(self):
        """TowerTrace's optimise (optimised_function) on a mesh of CPUs, else None."""
        return self.optimised_function if self.all_cpu else None

    def optimised_function(self, function_defs, inputs, devices):
        """FunctionDefs of function_defs[0] (calling the others; inputs: a tf.TensorSpec
        per argument; devices: those its nodes name) as grappler optimises it under the
        thread's config and this trainer's rewrites, the optimised function first."""
        config = config_pb2.ConfigProto.FromString(
            self._thread_config or compat.current_call_config())
        self.edit(config.graph_options.rewrite_options)
        return compat.optimized_function(function_defs, inputs, devices, config)

    def edit(self, rewriter_config, cheap=False):
        """Changes a RewriterConfig (grappler's settings) where it holds the defaults;
        cheap: to CHEAP_PASSES, without the MLIR pass."""
        if rewriter_config.meta_optimizer_iterations == RewriterConfig.DEFAULT_NUM_ITERS:
            rewriter_config.meta_optimizer_iterations = RewriterConfig.ONE
        if self.all_cpu and rewriter_config.memory_optimization == RewriterConfig.DEFAULT_MEM_OPT:
            rewriter_config.memory_optimization = RewriterConfig.NO_MEM_OPT
        if self.all_cpu and rewriter_config.layout_optimizer == RewriterConfig.DEFAULT:
            rewriter_config.layout_optimizer = RewriterConfig.OFF
        if cheap and not rewriter_config.optimizers:
            rewriter_config.optimizers.extend(CHEAP_PASSES)
            rewriter_config.disable_tfg_optimizer = True
