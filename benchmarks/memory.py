"""Bytes per device: what each device holds for a step (counted) and the step's peak
(measured), for the ways towers spreads a model today.

    python benchmarks/memory.py --output_dir=DIR

Each configuration runs in its own process (peak memory only grows within one), on an
MLP of --layers hidden Dense layers of --width units, Adam:
- towers: variable_placement="main" on 1, 2 and 4 towers;
- pipeline: 2 towers x 2 stages, micro_batches 1, 4 and 8;
- split: the hidden layers split column/row (Megatron's pairs) over T = 1, 2 and 4 parts.

Counted exactly, per device: the model's variables, the optimizer's slots (each variable
where it lives), and the gradient sums (each column's gradients meet where its variables
live: their bytes). Measured: on a GPU, TensorFlow's allocator peak per device
(tf.config.experimental.get_memory_info, reset before the timed steps); on CPU, where
logical devices share the host's memory, the process's peak resident memory minus its
memory before the first step (the step's own need: activations, gradients, copies).
Writes DIR/results.json and DIR/results.md.
"""

import json
import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.harness import child_process  # noqa: E402

CONFIGS = {
    "towers, 1": {"towers": 1}, "towers, 2": {"towers": 2}, "towers, 4": {"towers": 4},
    "pipeline 2x2, M=1": {"towers": 2, "stages": 2, "micro_batches": 1},
    "pipeline 2x2, M=4": {"towers": 2, "stages": 2, "micro_batches": 4},
    "pipeline 2x2, M=8": {"towers": 2, "stages": 2, "micro_batches": 8},
    "split, T=1": {"towers": 1, "parts": 1}, "split, T=2": {"towers": 1, "parts": 2},
    "split, T=4": {"towers": 1, "parts": 4},
}
WHICH = flags.DEFINE_list("configs", list(CONFIGS), f"Configurations, of {list(CONFIGS)}.")
WIDTH = flags.DEFINE_integer("width", 2048, "Units of each hidden layer.", lower_bound=4)
LAYERS = flags.DEFINE_integer("layers", 4, "Hidden layers (an even number: column/row pairs).",
                              lower_bound=2)
GLOBAL_BATCH_SIZE = flags.DEFINE_integer("global_batch_size", 1024, "Examples per step.",
                                         lower_bound=1)
STEPS = flags.DEFINE_integer("steps", 3, "Timed steps.", lower_bound=1)
OUTPUT_DIR = flags.DEFINE_string("output_dir", None, "Where results.json/.md go.")
CHILD_CONFIG = flags.DEFINE_string("child_config", None, "Internal: run one configuration.")
FEATURES, CLASSES, MIB = 256, 10, 2 ** 20


def measure(config):
    """Child: builds the configuration, runs its steps; returns bytes per device."""
    import numpy as np
    import towers
    devices = towers.configure_devices(4)  # GPUs (one split in 4) where there are, else CPU
    import keras
    import tensorflow as tf

    model = _model(config["width"], config["layers"])
    grid, options = devices[:config["towers"]], {}
    if config.get("stages"):
        grid = [devices[2 * i:2 * i + 2] for i in range(config["towers"])]
        options = {"pipeline_cuts": [f"hidden_{config['layers'] // 2 - 1}"],
                   "micro_batches": config["micro_batches"]}
    elif config.get("parts", 1) > 1:
        plan = {f"hidden_{i}": "column" if i % 2 == 0 else "row"
                for i in range(config["layers"])}
        model = towers.split_layers(model, plan, devices[:config["parts"]])
        grid = [devices[:config["parts"]]]
    trainer = towers.TowerTrainer(model, keras.losses.SparseCategoricalCrossentropy(
        from_logits=True), keras.optimizers.Adam(1e-4), devices=grid, **options)
    rng = np.random.default_rng(0)
    rows = config["global_batch_size"]
    batch = (rng.random((rows, FEATURES), dtype=np.float32), rng.integers(0, CLASSES, rows))
    gpus = [d for d in devices if ":GPU:" in d]
    for device in gpus:
        tf.config.experimental.reset_memory_stats(device)
    timing = child_process.time_steps(lambda: trainer.train_step(batch), config["steps"])
    held = _held_bytes(trainer)
    peaks = {d: tf.config.experimental.get_memory_info(d)["peak"] for d in gpus}
    return {"config": config["name"], "held": held, "gpu_peak_bytes": peaks,
            "step_mb": timing["step_mb"], "peak_mb": timing["peak_mb"],
            "median_ms": timing["median_ms"]}


def _model(width, layers):
    import keras
    keras.utils.set_random_seed(0)
    inputs = keras.Input((FEATURES,))
    hidden = inputs
    for i in range(layers):
        hidden = keras.layers.Dense(width, activation="relu", name=f"hidden_{i}")(hidden)
    return keras.Model(inputs, keras.layers.Dense(CLASSES, name="logits")(hidden))


def _held_bytes(trainer):
    """{device: {"variables", "slots", "gradient_sums": bytes}}: each model variable and
    optimizer variable where it lives; a trainable variable's gradient sum where it
    lives (each column's gradients meet on its variables' device)."""
    from towers import devices as devices_lib
    held = {}

    def add(variable, kind):
        device = devices_lib.canonical_name(variable.value.device)
        size = int(variable.value.shape.num_elements()) * variable.value.dtype.size
        held.setdefault(device, {"variables": 0, "slots": 0, "gradient_sums": 0})
        held[device][kind] += size

    model_ids = {id(v) for v in trainer.model.weights}
    for variable in trainer.model.weights:
        add(variable, "variables")
    for variable in trainer.model.trainable_variables:
        add(variable, "gradient_sums")
    for variable in trainer.optimizer.variables:
        if id(variable) not in model_ids:
            add(variable, "slots")
    return held


def main(argv):
    del argv
    if CHILD_CONFIG.value:
        child_process.report(measure(json.loads(CHILD_CONFIG.value)))
        return
    if not OUTPUT_DIR.value:
        raise app.UsageError("--output_dir is required: where results.json and .md go.")
    unknown = sorted(set(WHICH.value) - set(CONFIGS))
    if unknown:
        raise app.UsageError(f"--configs: unknown {unknown}; choose from {list(CONFIGS)}.")
    rows = []
    for name in WHICH.value:
        config = {**CONFIGS[name], "name": name, "width": WIDTH.value, "layers": LAYERS.value,
                  "global_batch_size": GLOBAL_BATCH_SIZE.value, "steps": STEPS.value}
        rows.append(child_process.run_child(os.path.abspath(__file__), config))
        print(_row(rows[-1]), flush=True)
    os.makedirs(OUTPUT_DIR.value, exist_ok=True)
    with open(os.path.join(OUTPUT_DIR.value, "results.json"), "w") as out:
        json.dump({"flags": {"width": WIDTH.value, "layers": LAYERS.value,
                             "global_batch_size": GLOBAL_BATCH_SIZE.value,
                             "steps": STEPS.value},
                   "results": rows}, out, indent=1)
    table = _table(rows)
    with open(os.path.join(OUTPUT_DIR.value, "results.md"), "w") as out:
        out.write(table)
    print(table)


def _row(result):
    """One configuration's line: the device holding most, its bytes by kind (MiB)."""
    device, held = max(result["held"].items(), key=lambda item: sum(item[1].values()))
    total = sum(sum(kinds.values()) for kinds in result["held"].values())
    peak = (f"{max(result['gpu_peak_bytes'].values()) / MIB:.1f}"
            if result["gpu_peak_bytes"] else f"{result['step_mb']:.0f} (process)")
    return (f"| {result['config']} | {len(result['held'])} | {device.split('/device:')[-1]} | "
            f"{held['variables'] / MIB:.1f} | {held['slots'] / MIB:.1f} | "
            f"{held['gradient_sums'] / MIB:.1f} | {sum(held.values()) / total:.2f} | {peak} | "
            f"{result['median_ms']:.0f} |")


def _table(rows):
    return "\n".join([
        f"MLP {FEATURES} -> {LAYERS.value} x {WIDTH.value} -> {CLASSES}, Adam, batch "
        f"{GLOBAL_BATCH_SIZE.value}; MiB. Held: on the device holding most (counted); "
        "step peak: measured (GPU: allocator peak of the busiest device; CPU: the process's "
        "peak resident memory minus its memory before the first step).", "",
        "| configuration | devices holding state | busiest | variables | slots | "
        "gradient sums | share of all state | step peak | ms/step |",
        "|---|--:|---|--:|--:|--:|--:|--:|--:|"] + [_row(r) for r in rows]) + "\n"


if __name__ == "__main__":
    app.run(main)
