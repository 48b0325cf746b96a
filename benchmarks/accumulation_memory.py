"""Peak memory and step time against micro-batch accumulation (accum_steps).

    python benchmarks/accumulation_memory.py --accum_steps=1,2,4,8 \
        --model=cnn --global_batch_size=512 --num_towers=1

Each accum_steps value runs in its own process (peak memory only grows within
one). "step memory" is the peak resident memory minus the memory after the
model, optimizer and data were set up: what the compiled step itself needed,
activations of the live micro-batch included.
"""

import json
import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.harness import child_process  # noqa: E402

ACCUM_STEPS = flags.DEFINE_list("accum_steps", ["1", "2", "4", "8"], "Values of accum_steps.")
MODEL = flags.DEFINE_enum("model", "cnn", ["mlp", "cnn", "resnet", "text"], "Model.")
GLOBAL_BATCH_SIZE = flags.DEFINE_integer("global_batch_size", 512, "Examples per step.",
                                         lower_bound=1)
NUM_TOWERS = flags.DEFINE_integer("num_towers", 1, "Towers.", lower_bound=1)
STEPS = flags.DEFINE_integer("steps", 5, "Timed steps.", lower_bound=1)
OUTPUT = flags.DEFINE_string("output", None, "Write the results here as JSON.")
CHILD_CONFIG = flags.DEFINE_string("child_config", None, "Internal: run one configuration.")


def measure(config):
    """Child: trains config["steps"] steps; returns memory (MiB) and step time (ms)."""
    import numpy as np
    import towers
    devices = towers.configure_devices(config["num_towers"])
    import keras
    from towers.cli import models

    model = models.build_model(config["model"], (32, 32, 3), 10, seed=0)
    trainer = towers.TowerTrainer(
        model, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        keras.optimizers.SGD(0.01), devices=devices, accum_steps=config["accum_steps"])
    rng = np.random.default_rng(0)
    batch = (rng.random((config["global_batch_size"], 32, 32, 3), dtype=np.float32),
             rng.integers(0, 10, config["global_batch_size"]))
    return {"accum_steps": config["accum_steps"],
            **child_process.time_steps(lambda: trainer.train_step(batch), config["steps"])}


def main(argv):
    del argv
    if CHILD_CONFIG.value:
        child_process.report(measure(json.loads(CHILD_CONFIG.value)))
        return
    rows = []
    for accum_steps in (int(k) for k in ACCUM_STEPS.value):
        config = {"accum_steps": accum_steps, "model": MODEL.value, "steps": STEPS.value,
                  "global_batch_size": GLOBAL_BATCH_SIZE.value, "num_towers": NUM_TOWERS.value}
        rows.append(child_process.run_child(os.path.abspath(__file__), config))
    base = rows[0]
    print(f"{MODEL.value}, global batch {GLOBAL_BATCH_SIZE.value}, {NUM_TOWERS.value} tower(s)\n")
    print("| accum_steps | micro-batch | step memory (MiB) | x accum_steps=1 | peak RSS (MiB) "
          "| step time (ms) | x accum_steps=1 |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        micro = GLOBAL_BATCH_SIZE.value / NUM_TOWERS.value / row["accum_steps"]
        print(f"| {row['accum_steps']} | {micro:.0f} | {row['step_mb']:.0f} | "
              f"{row['step_mb'] / base['step_mb']:.2f} | {row['peak_mb']:.0f} | "
              f"{row['median_ms']:.1f} ± {row['uncertainty_ms'] or 0:.1f} | "
              f"{row['median_ms'] / base['median_ms']:.2f} |")
    if OUTPUT.value:
        with open(OUTPUT.value, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    app.run(main)
