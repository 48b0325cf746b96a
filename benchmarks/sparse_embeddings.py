"""Embedding gradients: step time and memory against vocabulary size.

    python benchmarks/sparse_embeddings.py --vocab_sizes=1000,10000,100000,1000000 \
        --num_towers=4 --global_batch_size=256

Modes: towers with sparse_policy="keep" (IndexedSlices end to end), towers
with "dense" (each tower densifies before the gather), and MirroredStrategy's
custom loop on the same devices. Each (vocabulary, mode) runs in its own
process for an honest peak memory. "gathered MiB" is what reaches the main
device per step: sparse, the looked-up rows (values + int64 indices) of every
tower; dense, one full table per tower.
"""

import json
import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.harness import child_process  # noqa: E402

MODES = ("keep", "dense", "mirrored")
VOCAB_SIZES = flags.DEFINE_list("vocab_sizes", ["1000", "10000", "100000", "1000000"],
                                "Embedding table rows.")
MODES_FLAG = flags.DEFINE_multi_enum("modes", list(MODES), MODES, "Modes to run.")
NUM_TOWERS = flags.DEFINE_integer("num_towers", 4, "Towers.", lower_bound=1)
GLOBAL_BATCH_SIZE = flags.DEFINE_integer("global_batch_size", 256, "Examples per step.",
                                         lower_bound=1)
SEQUENCE_LENGTH = flags.DEFINE_integer("sequence_length", 16, "Tokens per example.",
                                       lower_bound=1)
EMBEDDING_DIM = flags.DEFINE_integer("embedding_dim", 32, "Embedding width.", lower_bound=1)
STEPS = flags.DEFINE_integer("steps", 20, "Timed steps.", lower_bound=1)
OUTPUT = flags.DEFINE_string("output", None, "Write the results here as JSON.")
CHILD_CONFIG = flags.DEFINE_string("child_config", None, "Internal: run one configuration.")


def measure(config):
    """Child: times config["steps"] steps of one mode; returns ms and MiB."""
    import numpy as np
    import towers
    devices = towers.configure_devices(config["num_towers"])
    import keras
    import tensorflow as tf

    def make_model():
        keras.utils.set_random_seed(0)
        return keras.Sequential([
            keras.Input((config["sequence_length"],), dtype="int32"),
            keras.layers.Embedding(config["vocab"], config["embedding_dim"]),
            keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(10)])

    rng = np.random.default_rng(0)
    x = rng.integers(0, config["vocab"], (config["global_batch_size"], config["sequence_length"]),
                     dtype=np.int32)
    y = rng.integers(0, 10, config["global_batch_size"])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if config["mode"] == "mirrored":
        step = _mirrored_step(make_model, loss, devices, x, y, tf, keras, np)
    else:
        trainer = towers.TowerTrainer(make_model(), loss, keras.optimizers.SGD(0.1),
                                      devices=devices, sparse_policy=config["mode"])
        step = lambda: trainer.train_step((x, y))  # noqa: E731
    return {**config, **child_process.time_steps(step, config["steps"], warmup_steps=2)}


def _mirrored_step(make_model, loss, devices, x, y, tf, keras, np):
    """MirroredStrategy's custom loop on `devices`; returns a function running one step."""
    cross_device_ops = None if "GPU" in devices[0] else tf.distribute.ReductionToOneDevice()
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=cross_device_ops)
    with strategy.scope():
        model = make_model()
        optimizer = keras.optimizers.SGD(0.1)
        optimizer.build(model.trainable_variables)
    per_example = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    rows = np.array_split(np.arange(len(x)), len(devices))
    shards = strategy.experimental_distribute_values_from_function(
        lambda ctx: (x[rows[ctx.replica_id_in_sync_group]], y[rows[ctx.replica_id_in_sync_group]]))

    @tf.function
    def step(shards):
        def replica_step(xs, ys):
            with tf.GradientTape() as tape:
                value = tf.reduce_sum(per_example(ys, model(xs, training=True))) / len(x)
            grads = tape.gradient(value, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return value
        return strategy.reduce("SUM", strategy.run(replica_step, args=shards), axis=None)

    return lambda: float(step(shards))


def gathered_mb(config):
    """MiB reaching the main device per step (see the module docstring)."""
    if config["mode"] == "dense":
        return config["num_towers"] * config["vocab"] * config["embedding_dim"] * 4 / 2**20
    lookups = config["global_batch_size"] * config["sequence_length"]
    return lookups * (config["embedding_dim"] * 4 + 8) / 2**20


def main(argv):
    del argv
    if CHILD_CONFIG.value:
        child_process.report(measure(json.loads(CHILD_CONFIG.value)))
        return
    rows = []
    for vocab in (int(v) for v in VOCAB_SIZES.value):
        for mode in MODES_FLAG.value:
            config = {"vocab": vocab, "mode": mode, "num_towers": NUM_TOWERS.value,
                      "global_batch_size": GLOBAL_BATCH_SIZE.value, "steps": STEPS.value,
                      "sequence_length": SEQUENCE_LENGTH.value,
                      "embedding_dim": EMBEDDING_DIM.value}
            rows.append(child_process.run_child(os.path.abspath(__file__), config))
    print(f"{NUM_TOWERS.value} towers, global batch {GLOBAL_BATCH_SIZE.value} x "
          f"{SEQUENCE_LENGTH.value} tokens, embedding width {EMBEDDING_DIM.value}\n")
    print("| vocabulary | mode | step time (ms) | x keep | step memory (MiB) | peak RSS (MiB) "
          "| gathered MiB/step |")
    print("|---|---|---|---|---|---|---|")
    keep = {r["vocab"]: r for r in rows if r["mode"] == "keep"}
    for row in rows:
        ratio = row["median_ms"] / keep[row["vocab"]]["median_ms"] if row["vocab"] in keep else 0
        gathered = "" if row["mode"] == "mirrored" else f"{gathered_mb(row):.2f}"
        print(f"| {row['vocab']:,} | {row['mode']} | {row['median_ms']:.1f} ± "
              f"{row['uncertainty_ms'] or 0:.1f} | {ratio:.2f} | {row['step_mb']:.0f} | "
              f"{row['peak_mb']:.0f} | {gathered} |")
    if OUTPUT.value:
        with open(OUTPUT.value, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    app.run(main)
