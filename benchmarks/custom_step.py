"""What tower_step's machinery costs: your own loop through towers.tower_step against the
same towers written by hand, in one run.

    python benchmarks/custom_step.py --num_towers=4 --output_dir=DIR

Two loops, each in three forms on the same towers, medians of interleaved rounds:
- a per-example loss (a classifier's cross-entropy): the bare towers by hand (per
  tower: tf.device, a GradientTape, the model on its shard, the gradient; the sums
  on the main device), towers.tower_gradients, and towers.tower_step;
- InfoNCE with in-batch negatives (a loss of the whole batch): by hand (the towers'
  embeddings gathered on the main device, the loss and its gradient there, each
  tower's backward from its rows' part), and tower_step with batch_losses; one
  device on the whole batch is the reference both must equal.
Writes DIR/results.json and DIR/results.md.
"""

import json
import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

NUM_TOWERS = flags.DEFINE_integer("num_towers", 4, "Towers (logical devices).", lower_bound=1)
GLOBAL_BATCH_SIZE = flags.DEFINE_integer("global_batch_size", 256, "Examples per step.",
                                         lower_bound=1)
WIDTH = flags.DEFINE_integer("width", 256, "Units of each hidden layer.", lower_bound=1)
STEPS = flags.DEFINE_integer("steps", 60, "Timed steps per mode.", lower_bound=1)
ROUNDS = flags.DEFINE_integer("rounds", 6, "Interleaved rounds.", lower_bound=1)
OUTPUT_DIR = flags.DEFINE_string("output_dir", None, "Where results.json/.md go.",
                                 required=True)
FEATURES, CLASSES, EMBEDDING = 64, 10, 32


def main(argv):
    del argv
    import towers
    devices = towers.configure_devices(NUM_TOWERS.value, "cpu")
    import numpy as np
    import tensorflow as tf
    from benchmarks.harness import loops, measure

    rng = np.random.default_rng(0)
    rows = GLOBAL_BATCH_SIZE.value
    x = tf.constant(rng.normal(size=(rows, FEATURES)).astype("float32"))
    y = tf.constant(rng.integers(0, CLASSES, rows))
    views = (x, x + tf.constant(rng.normal(0, 0.1, (rows, FEATURES)).astype("float32")))
    modes = {
        "per-example, by hand": _Step(loops.by_hand, devices, CLASSES, (x, y)),
        "per-example, tower_gradients": _Step(loops.with_tower_gradients, devices, CLASSES,
                                              (x, y)),
        "per-example, tower_step": _Step(loops.with_tower_step, devices, CLASSES, (x, y)),
        "InfoNCE, one device": _Step(_nce_one_device, devices, EMBEDDING, views),
        "InfoNCE, by hand": _Step(_nce_by_hand, devices, EMBEDDING, views),
        "InfoNCE, tower_step": _Step(_nce_with_tower_step, devices, EMBEDDING, views),
    }
    times = measure.time_interleaved(list(modes.values()), STEPS.value, ROUNDS.value, seed=0)
    results = {name: measure.step_time_stats(t) for name, t in zip(modes, times)}
    os.makedirs(OUTPUT_DIR.value, exist_ok=True)
    with open(os.path.join(OUTPUT_DIR.value, "results.json"), "w") as out:
        json.dump({"flags": _flags(), "results": results}, out, indent=1)
    table = _table(results, len(devices))
    with open(os.path.join(OUTPUT_DIR.value, "results.md"), "w") as out:
        out.write(table)
    print(table)


def _model(outputs):
    import keras
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((FEATURES,)),
                             keras.layers.Dense(WIDTH.value, activation="relu"),
                             keras.layers.Dense(WIDTH.value, activation="relu"),
                             keras.layers.Dense(outputs)])


class _Step:
    """One compiled step of `build(model, devices)` on one batch, warmed up (traced)."""

    def __init__(self, build, devices, outputs, batch):
        import keras
        import tensorflow as tf
        self.model, self.batch = _model(outputs), batch
        self.optimizer = keras.optimizers.SGD(0.01)
        loss_and_grads = build(self.model, devices)

        @tf.function
        def step(*batch):
            loss, grads = loss_and_grads(*batch)
            self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables))
            return loss

        self.step = step
        self.run(2)

    def run(self, num_steps):
        from benchmarks.harness import measure
        # The read of the loss waits for the step.
        return measure.wall_times(lambda: float(self.step(*self.batch)), num_steps)


def _info_nce(embeddings):
    import tensorflow as tf
    from benchmarks.harness import loops
    anchors, positives = (tf.math.l2_normalize(e, -1) for e in embeddings)
    logits = tf.matmul(anchors, positives, transpose_b=True) / 0.1
    return tf.reduce_mean(loops.cross_entropy(tf.range(tf.shape(logits)[0]), logits))


def _nce_one_device(model, devices):
    import tensorflow as tf

    def loss_and_grads(a, b):
        with tf.device(devices[0]), tf.GradientTape() as tape:
            loss = _info_nce((model(a), model(b)))
        return loss, tape.gradient(loss, model.trainable_variables)

    return loss_and_grads


def _nce_by_hand(model, devices):
    import tensorflow as tf
    from towers.data_parallel import split

    def loss_and_grads(a, b):
        sizes = split.shard_sizes(a.shape[0], len(devices))
        tapes, embeddings = [], []
        for device, (a_i, b_i) in zip(devices, split.split_rows((a, b), sizes)):
            with tf.device(device), tf.GradientTape() as tape:
                embeddings.append((model(a_i), model(b_i)))
            tapes.append(tape)
        with tf.device(devices[0]), tf.GradientTape() as tape:
            gathered = [tf.concat([tf.identity(e[k]) for e in embeddings], 0) for k in (0, 1)]
            tape.watch(gathered)
            loss = _info_nce(gathered)
        cotangents = [split.split_rows(g, sizes) for g in tape.gradient(loss, gathered)]
        grads = []
        for i, (device, tower_tape) in enumerate(zip(devices, tapes)):
            with tf.device(device):
                grads.append(tower_tape.gradient(
                    list(embeddings[i]), model.trainable_variables,
                    output_gradients=[tf.identity(cotangents[k][i]) for k in (0, 1)]))
        with tf.device(devices[0]):
            return loss, [tf.add_n(list(g)) for g in zip(*grads)]

    return loss_and_grads


def _nce_with_tower_step(model, devices):
    import towers

    def loss_and_grads(a, b):
        out = towers.tower_step(lambda tower, s: ({}, (tower(model, s[0]), tower(model, s[1]))),
                                (a, b), devices, {"nce": model.trainable_variables},
                                batch_losses={"nce": _info_nce})
        return out.losses["nce"], out.grads["nce"]

    return loss_and_grads


def _table(results, num_towers):
    lines = [f"{num_towers} towers, batch {GLOBAL_BATCH_SIZE.value}, MLP {FEATURES} -> "
             f"{WIDTH.value} -> {WIDTH.value} -> out; ms per step (median ± s.e.)", "",
             "| loop | mode | ms | / by hand |", "|---|---|--:|--:|"]
    for loop in ("per-example", "InfoNCE"):
        bare = results[f"{loop}, by hand"]["median_ms"]
        for name, stats in results.items():
            if name.startswith(loop):
                lines.append(f"| {loop} | {name.split(', ', 1)[1]} | {stats['median_ms']:.2f} "
                             f"± {stats['uncertainty_ms'] or 0:.2f} | "
                             f"{stats['median_ms'] / bare:.2f} |")
    return "\n".join(lines) + "\n"


def _flags():
    return {name: flags.FLAGS[name].value for name in (
        "num_towers", "global_batch_size", "width", "steps", "rounds")}


if __name__ == "__main__":
    app.run(main)
