"""Bytes per device: what each device holds for a step (counted) and the step's peak
(measured), for the ways towers spreads a model today.

    python benchmarks/memory.py --output_dir=DIR

Each configuration runs in its own process (peak memory only grows within one; it makes
the logical devices it needs, 4, or 8 for the grid), on an MLP of --layers hidden Dense
layers of --width units, Adam:
- towers: variable_placement="main" on 1, 2 and 4 towers;
- pipeline: 2 towers x 2 stages, micro_batches 1, 4 and 8, and the same with
  recompute="stages" (each stage's forward rerun in its backward);
- split: the hidden layers split column/row (Megatron's pairs) over T = 1, 2 and 4 parts;
- grid: all three, 2 towers x 2 stages x 2 parts (8 logical devices), 4 micro-batches;
- spread: variable_placement="spread" on 1, 2 and 4 towers (each variable, its slots and
  its gradient sum on one tower, balanced by bytes).

Counted exactly, per device: the model's variables, the optimizer's slots (each variable
where it lives), and the gradient sums (each column's gradients meet where its variables
live: their bytes). Measured over the timed steps (after a warm-up step, which traces):
TensorFlow's allocator peak less what it held before them (tf.config.experimental.
get_memory_info, reset after the warm-up), per device on a GPU; on CPU the child turns on
TensorFlow's BFC allocator (TF_CPU_ALLOCATOR_USE_BFC), which counts its bytes as a GPU's
does and which the logical devices share: all devices together. Also on CPU, where logical
devices share the host's memory, the process's peak resident memory minus its memory
before the first step (tracing included).
Writes DIR/results.json, DIR/results.md and DIR/memory.png (the busiest device's held
bytes by kind and the step peak, per configuration; benchmarks/figures/memory.png).
"""

import json
import os
import sys

from absl import app, flags, logging

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.harness import child_process, memory  # noqa: E402

WHICH = flags.DEFINE_list("configs", list(memory.CONFIGS),
                          f"Configurations, of {list(memory.CONFIGS)}.")
WIDTH = flags.DEFINE_integer("width", 2048, "Units of each hidden layer.", lower_bound=4)
LAYERS = flags.DEFINE_integer("layers", 4, "Hidden layers (an even number: column/row pairs).",
                              lower_bound=2)
GLOBAL_BATCH_SIZE = flags.DEFINE_integer("global_batch_size", 1024, "Examples per step.",
                                         lower_bound=1)
STEPS = flags.DEFINE_integer("steps", 3, "Timed steps.", lower_bound=1)
OUTPUT_DIR = flags.DEFINE_string("output_dir", None, "Where results.json/.md and memory.png go.")
CHILD_CONFIG = flags.DEFINE_string("child_config", None, "Internal: run one configuration.")


def main(argv):
    del argv
    if CHILD_CONFIG.value:
        child_process.report(memory.measure(json.loads(CHILD_CONFIG.value)))
        return
    if not OUTPUT_DIR.value:
        raise app.UsageError("--output_dir is required: where results.json and .md go.")
    unknown = sorted(set(WHICH.value) - set(memory.CONFIGS))
    if unknown:
        raise app.UsageError(f"--configs: unknown {unknown}; choose from {list(memory.CONFIGS)}.")
    rows = []
    for name in WHICH.value:
        config = {**memory.CONFIGS[name], "name": name, "width": WIDTH.value,
                  "layers": LAYERS.value, "global_batch_size": GLOBAL_BATCH_SIZE.value,
                  "steps": STEPS.value}
        rows.append(child_process.run_child(os.path.abspath(__file__), config))
        print(memory.row(rows[-1]), flush=True)
    os.makedirs(OUTPUT_DIR.value, exist_ok=True)
    with open(os.path.join(OUTPUT_DIR.value, "results.json"), "w") as out:
        json.dump({"flags": {"width": WIDTH.value, "layers": LAYERS.value,
                             "global_batch_size": GLOBAL_BATCH_SIZE.value,
                             "steps": STEPS.value},
                   "results": rows}, out, indent=1)
    table = memory.table(rows, WIDTH.value, LAYERS.value, GLOBAL_BATCH_SIZE.value)
    with open(os.path.join(OUTPUT_DIR.value, "results.md"), "w") as out:
        out.write(table)
    print(table)
    figure = os.path.join(OUTPUT_DIR.value, "memory.png")
    if not memory.draw(rows, figure, table.split(";")[0]):
        logging.warning("matplotlib is not installed, so %s is not drawn; install it with "
                        "`pip install matplotlib` (or `pip install -e .[bench]`).", figure)


if __name__ == "__main__":
    app.run(main)
