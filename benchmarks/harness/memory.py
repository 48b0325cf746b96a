"""benchmarks/memory.py's work, without flags: one configuration measured (in its own
process), and the table of results."""

import os

from benchmarks.harness import child_process

CONFIGS = {
    "towers_1": {"towers": 1}, "towers_2": {"towers": 2}, "towers_4": {"towers": 4},
    "pipeline_2x2_m1": {"towers": 2, "stages": 2, "micro_batches": 1},
    "pipeline_2x2_m4": {"towers": 2, "stages": 2, "micro_batches": 4},
    "pipeline_2x2_m8": {"towers": 2, "stages": 2, "micro_batches": 8},
    # GPipe's rematerialisation: each stage's forward rerun in its backward.
    "pipeline_2x2_m1_recompute": {"towers": 2, "stages": 2, "micro_batches": 1,
                                  "recompute": "stages"},
    "pipeline_2x2_m4_recompute": {"towers": 2, "stages": 2, "micro_batches": 4,
                                  "recompute": "stages"},
    "pipeline_2x2_m8_recompute": {"towers": 2, "stages": 2, "micro_batches": 8,
                                  "recompute": "stages"},
    "split_t1": {"towers": 1, "parts": 1}, "split_t2": {"towers": 1, "parts": 2},
    "split_t4": {"towers": 1, "parts": 4},
}
FEATURES, CLASSES, MIB = 256, 10, 2 ** 20


def measure(config):
    """Child: builds the configuration, runs its steps; returns bytes per device.

    On CPU, TensorFlow's allocator is made a BFC allocator (TF_CPU_ALLOCATOR_USE_BFC,
    read when TensorFlow starts: in the benchmark's child, not in a test that imported
    it already), which counts its bytes in use as a GPU's does: the logical CPU devices
    share it, so its peak is all devices' together."""
    os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
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
                   "micro_batches": config["micro_batches"],
                   "recompute": config.get("recompute", False)}
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
    counted = gpus or [d for d in devices[:1] if _allocator_counts(d)]
    in_use = {}  # per counted device, its bytes in use before the timed steps

    def reset_after_warmup():  # the peak of the timed steps, not of tracing the step
        for device in counted:
            tf.config.experimental.reset_memory_stats(device)
            in_use[device] = tf.config.experimental.get_memory_info(device)["current"]

    timing = child_process.time_steps(lambda: trainer.train_step(batch), config["steps"],
                                      after_warmup=reset_after_warmup)
    held = _held_bytes(trainer)
    peaks = {d: tf.config.experimental.get_memory_info(d)["peak"] - in_use[d] for d in counted}
    return {"config": config["name"], "held": held,
            "gpu_peak_bytes": peaks if gpus else {}, "cpu_peak_bytes": {} if gpus else peaks,
            "step_mb": timing["step_mb"], "peak_mb": timing["peak_mb"],
            "median_ms": timing["median_ms"]}


def _allocator_counts(device):
    """Whether `device`'s allocator counts its bytes in use (a GPU's; a CPU's BFC one):
    once the model is built it has counted some (CPU's default allocator answers 0)."""
    import tensorflow as tf
    try:
        return tf.config.experimental.get_memory_info(device)["peak"] > 0
    except ValueError:
        return False


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


def row(result):
    """One configuration's line: the device holding most, its bytes by kind (MiB)."""
    device, held = max(result["held"].items(), key=lambda item: sum(item[1].values()))
    total = sum(sum(kinds.values()) for kinds in result["held"].values())
    allocator = result["gpu_peak_bytes"] or result.get("cpu_peak_bytes") or {}
    peak = f"{max(allocator.values()) / MIB:.1f}" if allocator else "-"
    return (f"| {result['config']} | {len(result['held'])} | {device.split('/device:')[-1]} | "
            f"{held['variables'] / MIB:.1f} | {held['slots'] / MIB:.1f} | "
            f"{held['gradient_sums'] / MIB:.1f} | {sum(held.values()) / total:.2f} | {peak} | "
            f"{result['step_mb']:.0f} | {result['median_ms']:.0f} |")


def table(rows, width, layers, global_batch_size):
    return "\n".join([
        f"MLP {FEATURES} -> {layers} x {width} -> {CLASSES}, Adam, batch "
        f"{global_batch_size}; MiB. Held: on the device holding most (counted); "
        "step peak: measured over the timed steps, TensorFlow's allocator peak less what it "
        "held before them (GPU: the busiest device's; CPU: its BFC allocator, which the "
        "logical devices share: all together); process: the process's peak resident memory "
        "minus its memory before the first step (tracing included).", "",
        "| configuration | devices holding state | busiest | variables | slots | "
        "gradient sums | share of all state | step peak | process | ms/step |",
        "|---|--:|---|--:|--:|--:|--:|--:|--:|--:|"] + [row(r) for r in rows]) + "\n"
