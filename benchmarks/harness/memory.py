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
    # All three: tower i's stage k's part j on device (i * 2 + k) * 2 + j.
    "grid_2x2x2": {"towers": 2, "stages": 2, "parts": 2, "micro_batches": 4},
    # Each variable, its slots and its gradient sum on one tower, the towers filled in
    # turn to 1/N of the bytes, a variable across a tower's end held as slabs of rows.
    "spread_1": {"towers": 1, "variable_placement": "spread"},
    "spread_2": {"towers": 2, "variable_placement": "spread"},
    "spread_4": {"towers": 4, "variable_placement": "spread"},
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
    # GPUs (one split in as many as the configuration needs, at least 4) where there are,
    # else CPU: logical devices, made before TensorFlow starts in the child.
    devices = towers.configure_devices(max(4, devices_needed(config)))
    import keras
    import tensorflow as tf

    model = _model(config["width"], config["layers"])
    grid = _grid(config, devices)
    stages, parts = config.get("stages", 1), config.get("parts", 1)
    options = {"variable_placement": config.get("variable_placement", "main")}
    if stages > 1:
        options.update(pipeline_cuts=[f"hidden_{config['layers'] // 2 - 1}"],
                       micro_batches=config["micro_batches"],
                       recompute=config.get("recompute", False))
    if parts > 1:
        plan = {f"hidden_{i}": "column" if i % 2 == 0 else "row"
                for i in range(config["layers"])}
        model = towers.split_layers(model, plan, grid[0][0] if stages > 1 else grid[0])
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


def devices_needed(config):
    """Logical devices a configuration places work on: towers x stages x parts."""
    return config["towers"] * config.get("stages", 1) * config.get("parts", 1)


def _grid(config, devices):
    """TowerTrainer's `devices`: tower i's stage k's part j is device (i * K + k) * P + j
    (K stages, P parts); a stage of one part is its device, a tower of one stage its
    stage: [d0, d1] are 2 towers, [[d0, d1]] one tower split in 2 parts, [[d0, d1],
    [d2, d3]] 2 towers of 2 stages, [[[d0, d1], [d2, d3]], ...] 2 stages of 2 parts."""
    stages, parts = config.get("stages", 1), config.get("parts", 1)

    def stage(tower, k):
        first = (tower * stages + k) * parts
        return devices[first:first + parts] if parts > 1 else devices[first]

    return [[stage(i, k) for k in range(stages)] if stages > 1 else stage(i, 0)
            for i in range(config["towers"])]


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
    """{device: {"variables", "slots", "gradient_sums": bytes}}: each model variable (or
    slab of one) and optimizer variable where it lives; a trainable variable's gradient
    sum where it lives (each column's gradients meet on its variables' device)."""
    from towers import devices as devices_lib
    held = {}

    def add(variable, kind):
        device = devices_lib.canonical_name(variable.value.device)
        size = int(variable.value.shape.num_elements()) * variable.value.dtype.size
        held.setdefault(device, {"variables": 0, "slots": 0, "gradient_sums": 0})
        held[device][kind] += size

    # What the optimizer updates: the trainable variables, a slabbed one's slabs in its place
    # (spread placement holds it as them, placement/slabs.py); then the others.
    updated = trainer.setup.columns.held_variables()
    state = trainer.model.non_trainable_variables
    for variable in updated + state:
        add(variable, "variables")
    for variable in updated:
        add(variable, "gradient_sums")
    for variable in trainer.optimizer.variables:
        add(variable, "slots")
    return held


KINDS = ("variables", "slots", "gradient_sums")


def busiest(result):
    """(device, {kind: bytes}) of the device holding the most state."""
    return max(result["held"].items(), key=lambda item: sum(item[1].values()))


def busiest_share(result):
    """The busiest device's share of all devices' state (1.0: one device holds it all)."""
    total = sum(sum(kinds.values()) for kinds in result["held"].values())
    return sum(busiest(result)[1].values()) / total


def step_peak_bytes(result):
    """The step's measured allocator peak: the busiest GPU's, or on CPU all logical
    devices' together (they share one allocator); None where nothing counted it."""
    allocator = result["gpu_peak_bytes"] or result.get("cpu_peak_bytes") or {}
    return max(allocator.values()) if allocator else None


def row(result):
    """One configuration's line: the device holding most, its bytes by kind (MiB)."""
    device, held = busiest(result)
    peak = step_peak_bytes(result)
    peak = "-" if peak is None else f"{peak / MIB:.1f}"
    return (f"| {result['config']} | {len(result['held'])} | {device.split('/device:')[-1]} | "
            f"{held['variables'] / MIB:.1f} | {held['slots'] / MIB:.1f} | "
            f"{held['gradient_sums'] / MIB:.1f} | {busiest_share(result):.2f} | {peak} | "
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


def draw(rows, path, title):
    """Per configuration, the busiest device's held bytes stacked by kind (topped by its
    share of all devices' state) and, beside them, the step's measured peak (MiB);
    writes a PNG to `path`. Returns False (and draws nothing) without matplotlib."""
    try:
        import matplotlib  # pylint: disable=g-import-not-at-top
        matplotlib.use("Agg")
        from matplotlib import pyplot  # pylint: disable=g-import-not-at-top
    except ImportError:
        return False
    palette = matplotlib.colormaps["tab10"].colors
    positions = range(len(rows))
    figure, axis = pyplot.subplots(figsize=(max(8, 0.75 * len(rows) + 2), 5.5))
    bottom = [0.0] * len(rows)
    for color, kind in zip(palette, KINDS):
        heights = [busiest(r)[1][kind] / MIB for r in rows]
        axis.bar([x - 0.2 for x in positions], heights, width=0.4, bottom=bottom, color=color,
                 label=f"held by the busiest device (counted): {kind.replace('_', ' ')}")
        bottom = [b + h for b, h in zip(bottom, heights)]
    for x, result, top in zip(positions, rows, bottom):
        axis.text(x - 0.2, top, f"{busiest_share(result):.2f}", ha="center", va="bottom",
                  fontsize=7)
    on_gpu = any(r["gpu_peak_bytes"] for r in rows)
    axis.bar([x + 0.2 for x in positions], [(step_peak_bytes(r) or 0) / MIB for r in rows],
             width=0.4, color="0.55", hatch="//", edgecolor="black", linewidth=0.5,
             label="step peak, measured (" + ("the busiest GPU's allocator)" if on_gpu else
                                             "CPU allocator: all logical devices together)"))
    axis.set_xticks(list(positions), [r["config"] for r in rows], rotation=40, ha="right",
                    fontsize=8)
    axis.set(ylabel="MiB", title=title)
    axis.title.set_fontsize(9)
    axis.grid(axis="y", alpha=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    pyplot.close(figure)
    return True
