"""How TensorFlow's graph optimiser (grappler) takes a trainer's compiled functions.

A step holds every tower's forward and backward: one traced function (engine/tower.py
compiled_tower), which TensorFlow inlines into the step once per tower before grappler
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

What a user set on purpose (tf.config.optimizer, a number of passes) is kept; the
user's own functions are not touched. benchmarks/RESULTS.md, "The first step".
"""

import tensorflow as tf
from tensorflow.core.protobuf import rewriter_config_pb2

from towers import compat

RewriterConfig = rewriter_config_pb2.RewriterConfig


class GraphRewrites:
    """The call options of one trainer's compiled functions: `calls()` is entered around
    each call (its first call optimises the function's graph).

    devices: every device the trainer's steps run on (device strings)."""

    def __init__(self, devices):
        self.all_cpu = all(tf.DeviceSpec.from_string(device).device_type == "CPU"
                           for device in devices)
        self._options = {}  # the thread's config now (serialized) -> its options edited

    def calls(self):
        """A context manager: a tf.function called eagerly within it is optimised with
        this trainer's rewrites, on top of the thread's config now."""
        config = compat.current_call_config()
        if config not in self._options:
            self._options[config] = compat.call_options_edited(config, self.edit)
        return compat.calls_with(self._options[config])

    def edit(self, rewriter_config):
        """Changes a RewriterConfig (grappler's settings) where it holds the defaults."""
        if rewriter_config.meta_optimizer_iterations == RewriterConfig.DEFAULT_NUM_ITERS:
            rewriter_config.meta_optimizer_iterations = RewriterConfig.ONE
        if self.all_cpu and rewriter_config.memory_optimization == RewriterConfig.DEFAULT_MEM_OPT:
            rewriter_config.memory_optimization = RewriterConfig.NO_MEM_OPT
        if self.all_cpu and rewriter_config.layout_optimizer == RewriterConfig.DEFAULT:
            rewriter_config.layout_optimizer = RewriterConfig.OFF
