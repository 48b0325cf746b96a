"""What global batch statistics cost: the same trainer with batch_statistics="per_tower"
and "global", in one run.

    python benchmarks/batch_statistics.py --num_towers=4 --output_dir=DIR

Per model, two TowerTrainers on the same towers and batch, step times interleaved
(medians of rounds): per_tower normalises each shard by its own statistics (no
communication); global meets every BatchNormalization's moments across the towers,
two all-reduces in the forward and two in the backward per layer. The models: the
command line's cnn (no BatchNormalization: global changes nothing), its resnet (9
BatchNormalization layers) and keras.applications.MobileNetV3Small (34), random weights.
Writes DIR/results.json and DIR/results.md.
"""

import json
import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

NUM_TOWERS = flags.DEFINE_integer("num_towers", 4, "Towers (logical devices).", lower_bound=2)
GLOBAL_BATCH_SIZE = flags.DEFINE_integer("global_batch_size", 64, "Examples per step.",
                                         lower_bound=1)
IMAGE_SIZE = flags.DEFINE_integer("image_size", 32, "Height and width of the images.",
                                  lower_bound=32)
MODELS = flags.DEFINE_list("models", ["cnn", "resnet", "mobilenet_v3_small"], "Models to time.")
STEPS = flags.DEFINE_integer("steps", 24, "Timed steps per mode.", lower_bound=1)
ROUNDS = flags.DEFINE_integer("rounds", 4, "Interleaved rounds.", lower_bound=1)
DEVICE_TYPE = flags.DEFINE_enum("device_type", "cpu", ("cpu", "gpu", "auto"),
                                "What the towers are (towers.configure_devices).")
OUTPUT_DIR = flags.DEFINE_string("output_dir", None, "Where results.json/.md go.",
                                 required=True)
CLASSES = 10
STATISTICS = ("per_tower", "global")


def main(argv):
    del argv
    import towers
    devices = towers.configure_devices(NUM_TOWERS.value, DEVICE_TYPE.value)
    import numpy as np
    from benchmarks.harness import measure

    rng = np.random.default_rng(0)
    shape = (IMAGE_SIZE.value, IMAGE_SIZE.value, 3)
    batch = (rng.normal(size=(GLOBAL_BATCH_SIZE.value, *shape)).astype("float32"),
             rng.integers(0, CLASSES, GLOBAL_BATCH_SIZE.value))
    results = {}
    for name in MODELS.value:
        modes = [_Step(name, shape, devices, statistics, batch) for statistics in STATISTICS]
        times = measure.time_interleaved(modes, STEPS.value, ROUNDS.value, seed=0)
        stats = [measure.step_time_stats(t) for t in times]
        results[name] = {"batch_norm_layers": modes[0].batch_norm_layers,
                         **dict(zip(STATISTICS, stats)),
                         "global / per_tower": stats[1]["median_ms"] / stats[0]["median_ms"]}
    os.makedirs(OUTPUT_DIR.value, exist_ok=True)
    with open(os.path.join(OUTPUT_DIR.value, "results.json"), "w") as out:
        json.dump({"flags": _flags(), "devices": devices,
                   "machine": measure.machine_info(devices), "results": results}, out, indent=1)
    table = _table(results, len(devices))
    with open(os.path.join(OUTPUT_DIR.value, "results.md"), "w") as out:
        out.write(table)
    print(table)


def _model(name, shape):
    import keras
    from towers.cli import models
    if name == "mobilenet_v3_small":
        keras.utils.set_random_seed(0)
        return keras.applications.MobileNetV3Small(
            input_shape=shape, weights=None, classes=CLASSES, include_preprocessing=False,
            dropout_rate=0.0,
            classifier_activation=None)
    return models.build_model(name, shape, CLASSES, seed=0)


class _Step:
    """TowerTrainer.train_step of one model and batch_statistics, warmed up (traced)."""

    def __init__(self, name, shape, devices, statistics, batch):
        import keras
        import towers
        from towers.data_parallel import batch_statistics
        model = _model(name, shape)
        self.batch_norm_layers = len(batch_statistics.batch_norm_layers(model))
        self.trainer = towers.TowerTrainer(
            model, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            keras.optimizers.SGD(0.01), devices=devices, batch_statistics=statistics)
        self.batch = batch
        self.run(2)

    def run(self, num_steps):
        from benchmarks.harness import measure
        # train_step returns floats: the step has finished.
        return measure.wall_times(lambda: self.trainer.train_step(self.batch), num_steps)


def _table(results, num_towers):
    lines = [f"{num_towers} towers, batch {GLOBAL_BATCH_SIZE.value}, images "
             f"{IMAGE_SIZE.value}x{IMAGE_SIZE.value}x3; ms per step (median ± s.e.)", "",
             "| model | BatchNorm layers | per_tower | global | global / per_tower |",
             "|---|--:|--:|--:|--:|"]
    for name, row in results.items():
        cells = [f"{row[s]['median_ms']:.1f} ± {row[s]['uncertainty_ms'] or 0:.1f}"
                 for s in STATISTICS]
        lines.append(f"| {name} | {row['batch_norm_layers']} | {cells[0]} | {cells[1]} | "
                     f"{row['global / per_tower']:.3f} |")
    return "\n".join(lines) + "\n"


def _flags():
    return {name: flags.FLAGS[name].value for name in (
        "num_towers", "global_batch_size", "image_size", "models", "steps", "rounds",
        "device_type")}


if __name__ == "__main__":
    app.run(main)
