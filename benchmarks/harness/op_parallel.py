"""run_op_parallel_benchmark: a transformer block split into T parts, for each T its
bytes of variables and optimizer slots per device and its step time, next to the
unsplit block's, timed interleaved in one run; and the 1M-row embedding step, its
rows looked up where the table lives, against one device and against copying the
table to every tower."""

import collections
import os

import keras
import numpy as np
import tensorflow as tf

import towers
from benchmarks.harness import measure, mode as mode_lib, report, split_bytes

PLAN = {"table": "vocab", "att": "heads", "up": "column", "down": "row"}


def transformer_block(vocab, width, heads, hidden, length, seed=0):
    """ids (B, length) -> Embedding(vocab, width) -> self-attention (heads) + residual ->
    LayerNorm -> Dense(hidden) -> Dense(width) -> mean -> 10 logits."""
    keras.utils.set_random_seed(seed)
    ids = keras.Input((length,), dtype="int32")
    x = keras.layers.Embedding(vocab, width, name="table")(ids)
    attended = keras.layers.MultiHeadAttention(heads, width // heads, name="att")(x, x)
    x = keras.layers.LayerNormalization()(keras.layers.Add()([x, attended]))
    x = keras.layers.Dense(hidden, activation="relu", name="up")(x)
    x = keras.layers.Dense(width, name="down")(x)
    return keras.Model(ids, keras.layers.Dense(10)(keras.layers.GlobalAveragePooling1D()(x)))


def run_op_parallel_benchmark(parts, devices, output_dir, *, vocab=20000, width=64, heads=4,
                              hidden=256, length=16, global_batch_size=64, steps=50, rounds=5,
                              seed=0, embedding_rows=1_000_000, embedding_towers=4):
    """Every T in `parts` (1 = the unsplit block) on devices[:T], and the embedding step
    (run_embedding_benchmark; embedding_rows 0 skips it); returns the results dict and
    writes results.json and results.md to output_dir."""
    rng = np.random.default_rng(seed)
    batch = (tf.constant(rng.integers(0, vocab, (global_batch_size, length), dtype=np.int32)),
             tf.constant(rng.integers(0, 10, global_batch_size)))
    built, rows = [], []
    for num_parts in parts:
        with tf.device(devices[0]):
            model = transformer_block(vocab, width, heads, hidden, length, seed)
        if num_parts > 1:
            model = towers.split_layers(model, PLAN, devices[:num_parts])
        trainer = towers.TowerTrainer(
            model, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            keras.optimizers.Adam(1e-3), devices=devices[:1])
        trainer.train_step(batch)  # builds the optimizer's slots and traces the step
        built.append(mode_lib.Mode(f"T={num_parts}", 1,
                                   lambda t=trainer: t.train_step(batch)["loss"], model))
        rows.append({"parts": num_parts, "bytes_per_device": _bytes_per_device(trainer)})
    times = measure.time_interleaved(built, steps, rounds, seed)
    base = None
    for row, samples in zip(rows, times):
        row.update(measure.step_time_stats(samples))
        base = base or row["median_ms"]
        row["x_unsplit"] = row["median_ms"] / base
    results = {"config": {"parts": list(parts), "vocab": vocab, "width": width, "heads": heads,
                          "hidden": hidden, "length": length,
                          "global_batch_size": global_batch_size, "steps": steps,
                          "rounds": rounds, "plan": PLAN},
               "machine": measure.machine_info(devices), "rows": rows}
    split_parts = [num_parts for num_parts in parts if num_parts > 1]
    if split_parts:
        results["bytes"] = split_bytes.measure_splits(
            devices, split_parts, width=width, hidden=hidden, heads=heads, vocab=vocab,
            length=length, global_batch_size=global_batch_size, seed=seed)
    if embedding_rows:
        results["embedding"] = run_embedding_benchmark(
            devices[:embedding_towers], rows=embedding_rows, length=length, steps=steps,
            rounds=rounds, seed=seed)
    report.write_json_and_markdown(results, markdown(results), output_dir)
    if split_parts:
        split_bytes.draw(results["bytes"], os.path.join(output_dir, "op_parallel.png"))
    return results


def bag_of_words(rows, width, length):
    """ids (B, length) -> Embedding(rows, width) -> mean -> 10 logits."""
    keras.utils.set_random_seed(0)
    ids = keras.Input((length,), dtype="int32")
    vectors = keras.layers.Embedding(rows, width, name="table")(ids)
    return keras.Model(ids, keras.layers.Dense(10)(keras.layers.GlobalAveragePooling1D()(vectors)))


def run_embedding_benchmark(devices, *, rows=1_000_000, width=32, length=16,
                            global_batch_size=256, steps=50, rounds=5, seed=0):
    """One SGD step of bag_of_words(rows) on a batch of global_batch_size x length ids:
    plain Keras on devices[0] (a GradientTape step: it reads the whole table), the
    trainer on one tower and on every device looking rows up where the table lives
    (embedding_lookup="table"), and on every device copying the table ("copy").
    Returns {"config": ..., "rows": [{"mode", "towers", median_ms..., "x_keras",
    "x_one_tower"}]}."""
    rng = np.random.default_rng(seed)
    batch = (tf.constant(rng.integers(0, rows, (global_batch_size, length), dtype=np.int32)),
             tf.constant(rng.integers(0, 10, global_batch_size)))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with tf.device(devices[0]):
        model = bag_of_words(rows, width, length)
    optimizer = keras.optimizers.SGD(0.1)

    @tf.function
    def keras_step():
        with tf.device(devices[0]), tf.GradientTape() as tape:
            value = loss(batch[1], model(batch[0], training=True))
        optimizer.apply_gradients(zip(tape.gradient(value, model.trainable_variables),
                                      model.trainable_variables))
        return value

    keras_step()
    built = [mode_lib.Mode("keras_one_device", 1, lambda: float(keras_step()), model)]
    for name, towers_used, lookup in (("table", 1, "table"), ("table", len(devices), "table"),
                                      ("copy", len(devices), "copy")):
        with tf.device(devices[0]):
            tower_model = bag_of_words(rows, width, length)
        trainer = towers.TowerTrainer(tower_model, loss, keras.optimizers.SGD(0.1),
                                      devices=devices[:towers_used], embedding_lookup=lookup)
        trainer.train_step(batch)
        built.append(mode_lib.Mode(f"towers_{name}", towers_used,
                                   lambda t=trainer: t.train_step(batch)["loss"], tower_model))
    times = measure.time_interleaved(built, steps, rounds, seed)
    results = []
    for mode, samples in zip(built, times):
        results.append({"mode": mode.name, "towers": mode.num_towers,
                        **measure.step_time_stats(samples)})
    keras_ms, one_tower_ms = results[0]["median_ms"], results[1]["median_ms"]
    for row in results:
        row["x_keras"], row["x_one_tower"] = (row["median_ms"] / keras_ms,
                                              row["median_ms"] / one_tower_ms)
    return {"config": {"rows": rows, "width": width, "length": length,
                       "global_batch_size": global_batch_size, "optimizer": "SGD"},
            "rows": results}


def _bytes_per_device(trainer):
    """{device: [variable bytes, optimizer slot bytes]} after a step."""
    sizes = collections.defaultdict(lambda: [0, 0])
    for kind, variables in enumerate((trainer.model.weights, trainer.optimizer.variables)):
        for variable in variables:
            device = towers.devices.canonical_name(variable.value.device)
            sizes[device][kind] += int(np.prod(variable.shape)) * np.dtype(variable.dtype).itemsize
    return dict(sorted(sizes.items()))


def markdown(results):
    config = results["config"]
    lines = ["# Op parallelism: a transformer block split into T parts",
             "",
             f"Embedding {config['vocab']} x {config['width']} (vocab), attention with "
             f"{config['heads']} heads (heads), feed-forward {config['width']} -> "
             f"{config['hidden']} -> {config['width']} (column, row); batch "
             f"{config['global_batch_size']} x {config['length']} tokens, Adam, one tower. "
             f"Medians of {config['steps']} steps in {config['rounds']} interleaved rounds.",
             "",
             "| T | step ms | x unsplit | MiB of variables per device | MiB of slots per device |",
             "|--:|--:|--:|---|---|"]
    for row in results["rows"]:
        per_device = row["bytes_per_device"]
        variables = ", ".join(f"{d.split(':', 1)[-1]}: {v / 2**20:.2f}"
                              for d, (v, _) in per_device.items() if v)
        slots = ", ".join(f"{d.split(':', 1)[-1]}: {s / 2**20:.2f}"
                          for d, (_, s) in per_device.items() if s)
        spread = row["uncertainty_ms"] or 0
        lines.append(f"| {row['parts']} | {row['median_ms']:.2f} ± {spread:.2f} "
                     f"| {row['x_unsplit']:.2f} | {variables} | {slots} |")
    if "bytes" in results:
        lines += _bytes_markdown(results["bytes"], config)
    if "embedding" in results:
        lines += _embedding_markdown(results["embedding"])
    return "\n".join(lines) + "\n"


def _bytes_markdown(rows, config):
    lines = ["", "## Bytes one step moves between devices, per split",
             "",
             f"Each split alone (benchmarks/harness/split_bytes.py): one tower, batch "
             f"{config['global_batch_size']} x {config['length']} tokens of width "
             f"{config['width']} (hidden {config['hidden']}, {config['heads']} heads, "
             f"{config['vocab']} rows), SGD; forward, backward and update, measured as "
             "TensorFlow sent them (harness/transfers.py), next to docs/op_parallel.md's "
             "formula.",
             "",
             "| split | T | measured KiB | formula KiB |",
             "|---|--:|--:|--:|"]
    for row in rows:
        lines.append(f"| {row['kind']} | {row['parts']} | {row['measured'] / 1024:.1f} "
                     f"| {row['formula'] / 1024:.1f} |")
    return lines


def _embedding_markdown(embedding):
    config = embedding["config"]
    lines = ["", f"## The {config['rows']:,}-row embedding step",
             "",
             f"Embedding({config['rows']:,}, {config['width']}) -> mean -> Dense 10, batch "
             f"{config['global_batch_size']} x {config['length']} ids, {config['optimizer']}. "
             "keras_one_device: a plain GradientTape step (reads the whole table); "
             "towers_table: rows looked up where the table lives; towers_copy: the table "
             "copied to every tower (embedding_lookup=\"copy\").",
             "",
             "| mode | towers | step ms | x keras one device | x towers on one tower |",
             "|---|--:|--:|--:|--:|"]
    for row in embedding["rows"]:
        lines.append(f"| {row['mode']} | {row['towers']} | {row['median_ms']:.2f} ± "
                     f"{row['uncertainty_ms'] or 0:.2f} | {row['x_keras']:.2f} "
                     f"| {row['x_one_tower']:.2f} |")
    return lines
