"""What the Keras user's path costs: fit(x, y), evaluate and predict over towers, against
the same work fed by hand and against Keras on one device, in one run.

    python benchmarks/keras_path.py --num_towers=4 --output_dir=DIR

Modes, medians of interleaved rounds, each a whole pass over the same arrays, reported
per batch:
- fit: TowerTrainer.fit(x, y, batch_size) (arrays batched by Keras's own adapter), the
  same trainer on a tf.data.Dataset batched by hand, keras.Model.fit on one device, and
  Keras's array adapter alone (built once per call of fit, evaluate or predict);
- evaluate: TowerTrainer.evaluate(x, y, batch_size) and keras.Model.evaluate;
- predict: TowerTrainer.predict (each tower its shard, outputs in row order), the bare
  towers by hand (one tf.function: each shard under its device, outputs concatenated),
  and keras.Model.predict on one device.
Writes DIR/results.json and DIR/results.md.
"""

import json
import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

NUM_TOWERS = flags.DEFINE_integer("num_towers", 4, "Towers (logical devices).", lower_bound=1)
ROWS = flags.DEFINE_integer("rows", 8192, "Rows of the arrays.", lower_bound=1)
BATCH_SIZE = flags.DEFINE_integer("batch_size", 256, "Rows per batch.", lower_bound=1)
WIDTH = flags.DEFINE_integer("width", 256, "Units of each hidden layer.", lower_bound=1)
ROUNDS = flags.DEFINE_integer("rounds", 5, "Interleaved rounds (one pass each).",
                              lower_bound=1)
OUTPUT_DIR = flags.DEFINE_string("output_dir", None, "Where results.json/.md go.",
                                 required=True)
FEATURES, CLASSES = 64, 10


def main(argv):
    del argv
    import towers
    devices = towers.configure_devices(NUM_TOWERS.value, "cpu")
    import numpy as np
    from benchmarks.harness import measure

    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS.value, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, ROWS.value)
    modes = _modes(devices, x, y)
    times = measure.time_interleaved(list(modes.values()), ROUNDS.value, ROUNDS.value, seed=0)
    batches = -(-ROWS.value // BATCH_SIZE.value)
    results = {name: measure.step_time_stats([t / batches for t in passes])
               for name, passes in zip(modes, times)}
    os.makedirs(OUTPUT_DIR.value, exist_ok=True)
    with open(os.path.join(OUTPUT_DIR.value, "results.json"), "w") as out:
        json.dump({"flags": {f.name: f.value for f in flags.FLAGS.get_key_flags_for_module(
            sys.argv[0])}, "results": results}, out, indent=1)
    table = _table(results, len(devices))
    with open(os.path.join(OUTPUT_DIR.value, "results.md"), "w") as out:
        out.write(table)
    print(table)


def _modes(devices, x, y):
    """{name: a _Pass}, each warmed up (traced) by one pass."""
    import tensorflow as tf
    import towers
    from towers import compat
    batch_size = BATCH_SIZE.value
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)
    trainer = towers.TowerTrainer(_model(), devices=devices)
    keras_model = _model()
    bare = _bare_predict(trainer.model, devices)
    quiet = dict(verbose=0)
    return {
        "fit, towers, fit(x, y)": _Pass(lambda: trainer.fit(
            x, y, batch_size=batch_size, shuffle=False, **quiet)),
        "fit, towers, tf.data by hand": _Pass(lambda: trainer.fit(dataset, **quiet)),
        "fit, Keras, one device": _Pass(lambda: keras_model.fit(
            x, y, batch_size=batch_size, shuffle=False, **quiet)),
        # Paid once per call of fit, evaluate or predict (Keras's fit pays it too).
        "fit, Keras's array adapter alone": _Pass(lambda: compat.array_batches(
            x, y, None, batch_size, False)),
        "evaluate, towers": _Pass(lambda: trainer.evaluate(x, y, batch_size=batch_size,
                                                           **quiet)),
        "evaluate, Keras, one device": _Pass(lambda: keras_model.evaluate(
            x, y, batch_size=batch_size, **quiet)),
        "predict, towers": _Pass(lambda: trainer.predict(x, batch_size=batch_size, **quiet)),
        "predict, bare towers by hand": _Pass(lambda: [bare(batch).numpy() for batch, _ in
                                                       dataset]),
        "predict, Keras, one device": _Pass(lambda: keras_model.predict(
            x, batch_size=batch_size, **quiet)),
    }


def _model():
    import keras
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((FEATURES,)),
                              keras.layers.Dense(WIDTH.value, activation="relu"),
                              keras.layers.Dense(WIDTH.value, activation="relu"),
                              keras.layers.Dense(CLASSES)])
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def _bare_predict(model, devices):
    """One tf.function: the batch split, each shard through the model under its device,
    the outputs concatenated in row order on the first: the work predict organises."""
    import tensorflow as tf
    from towers.data_parallel import split

    @tf.function(reduce_retracing=True)
    def predict(x):
        outputs = []
        for device, shard in zip(devices, split.split_batch(x, len(devices))):
            with tf.device(device):
                outputs.append(model(shard, training=False))
        with tf.device(devices[0]):
            return tf.concat(outputs, axis=0)

    return predict


class _Pass:
    """One whole pass (`call()`), warmed up; run(n) -> n wall times in seconds."""

    def __init__(self, call):
        self.call = call
        call()

    def run(self, num_passes):
        from benchmarks.harness import measure
        return measure.wall_times(self.call, num_passes)


def _table(results, num_towers):
    """Markdown: per mode the median ms per batch and its ratio to the first of its kind."""
    lines = [f"{num_towers} towers, {ROWS.value} rows in batches of {BATCH_SIZE.value}, "
             f"width {WIDTH.value}; ms per batch (median of {ROUNDS.value} passes)", "",
             "| mode | ms per batch | ± | × the first of its kind |", "|---|---|---|---|"]
    first = {}
    for name, stats in results.items():
        kind = name.split(",")[0]
        first.setdefault(kind, stats["median_ms"])
        lines.append(f"| {name} | {stats['median_ms']:.2f} | {stats['uncertainty_ms'] or 0:.2f} "
                     f"| {stats['median_ms'] / first[kind]:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    app.run(main)
