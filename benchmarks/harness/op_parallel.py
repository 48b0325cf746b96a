"""run_op_parallel_benchmark: a transformer block split into T parts, for each T its
bytes of variables and optimizer slots per device and its step time, next to the
unsplit block's, timed interleaved in one run."""

import collections

import keras
import numpy as np
import tensorflow as tf

import towers
from benchmarks.harness import measure, mode as mode_lib, report

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
                              seed=0):
    """Every T in `parts` (1 = the unsplit block) on devices[:T]; returns the results dict
    and writes results.json and results.md to output_dir."""
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
    report.write_json_and_markdown(results, markdown(results), output_dir)
    return results


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
    return "\n".join(lines) + "\n"
