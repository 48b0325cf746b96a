"""run_op_parallel_benchmark: a transformer block split into T parts, for each T its
bytes of variables and optimizer slots per device and its step time, next to the
unsplit block's, timed interleaved in one run; the same for keras_hub's GPT-2 split by
a plan of layer paths, with the bytes each step moves against the formula;
keras_hub's Mistral, its grouped-query attention split by heads or by its projections
(grouped_heads.py); a vocab-split LM head's loss with its logits gathered or kept
split (vocab_loss.py); and the 1M-row embedding step, its rows looked up where the
table lives, against one device and against copying the table to every tower."""

import collections
import functools
import os

import keras
import numpy as np
import tensorflow as tf

import towers
# grouped_heads builds on run_plans and lm_batch here: each module imports the other and
# uses it only when called.
from benchmarks.harness import (grouped_heads as grouped_heads_lib, measure, mode as mode_lib,
                                report, split_bytes, transfers, vocab_loss as vocab_loss_lib)
from towers.op_parallel import dense as op_dense, layers as op_layers

PLAN = {"table": "vocab", "att": "heads", "up": "column", "down": "row"}

# What towers splits of keras_hub's GPT-2 today: each block's feed-forward pair, column
# -> row as Megatron pairs them.
HUB_FFN_PLAN = {"gpt2_backbone/transformer_layer_*/feedforward_intermediate_dense": "column",
                "gpt2_backbone/transformer_layer_*/feedforward_output_dense": "row"}
# The whole model: keras_hub's CachedMultiHeadAttention by heads, its ReversibleEmbedding
# by rows, the tied LM head with it (its logits kept in parts into the loss).
HUB_PLAN = {"gpt2_backbone/token_embedding": "vocab",
            "gpt2_backbone/transformer_layer_*/self_attention": "heads", **HUB_FFN_PLAN}
# What Adam's update of a variable on another part reads from the tower: the learning
# rate (float32) and the iteration count (int64), once per variable.
ADAM_BYTES_PER_VARIABLE = 4 + 8


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
                              seed=0, embedding_rows=1_000_000, embedding_towers=4, hub=None,
                              grouped_heads=None, vocab_loss=None):
    """Every T in `parts` (1 = the unsplit block) on devices[:T]; keras_hub's GPT-2 at
    the same T (run_hub_benchmark with the sizes in `hub`, a dict of its keyword
    arguments; None skips it); keras_hub's Mistral, its grouped-query attention split by
    heads and by its projections (grouped_heads.run_grouped_heads_benchmark with the
    keyword arguments in `grouped_heads`; None skips it); the LM head's loss both ways
    (vocab_loss.run_vocab_loss_benchmark with `vocab_loss`'s keyword arguments; None
    skips it); and the embedding step (run_embedding_benchmark; embedding_rows 0 skips
    it). Returns the results dict and writes results.json and results.md to output_dir."""
    rng = np.random.default_rng(seed)
    batch = (tf.constant(rng.integers(0, vocab, (global_batch_size, length), dtype=np.int32)),
             tf.constant(rng.integers(0, 10, global_batch_size)))
    rows = run_splits(lambda: transformer_block(vocab, width, heads, hidden, length, seed),
                      PLAN, batch, parts, devices, steps=steps, rounds=rounds, seed=seed)
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
    if hub is not None:
        results["hub"] = run_hub_benchmark(parts, devices, **hub, steps=steps, rounds=rounds,
                                           seed=seed)
    if grouped_heads is not None:
        results["grouped_heads"] = grouped_heads_lib.run_grouped_heads_benchmark(
            devices=devices, **grouped_heads, steps=steps, rounds=rounds, seed=seed)
    if vocab_loss is not None:
        results["vocab_loss"] = vocab_loss_lib.run_vocab_loss_benchmark(
            devices, **vocab_loss, rounds=rounds, seed=seed)
    if embedding_rows:
        results["embedding"] = run_embedding_benchmark(
            devices[:embedding_towers], rows=embedding_rows, length=length, steps=steps,
            rounds=rounds, seed=seed)
    report.write_json_and_markdown(results, markdown(results), output_dir)
    if split_parts:
        split_bytes.draw(results["bytes"], os.path.join(output_dir, "op_parallel.png"))
    return results


def run_splits(make_model, plan, batch, parts, devices, *, steps, rounds, seed,
               bytes_moved=False):
    """Each T in `parts` (T = 1: unsplit) split by `plan`: run_plans."""
    return run_plans(make_model, [(num_parts, plan) for num_parts in parts], batch, devices,
                     steps=steps, rounds=rounds, seed=seed, bytes_moved=bytes_moved)


def run_plans(make_model, splits, batch, devices, *, steps, rounds, seed, bytes_moved=False):
    """Each (T, plan) in `splits`: make_model() built on devices[0], split by `plan` on
    devices[:T] (T = 1: unsplit), trained on one tower (sparse cross-entropy from
    logits, Adam) on `batch`, all timed interleaved. Returns one row per split: {"parts",
    "bytes_per_device" (_bytes_per_device), median_ms..., "x_unsplit" (over the first
    split's median)}; with bytes_moved, also "moved" (bytes one step sends between
    devices, transfers.trainer_step_bytes), "variables_elsewhere" (trainable variables
    not on devices[0]) and "gathered_columns" (column splits whose activation towers
    does not know to be elementwise: their output is gathered, activated on the tower
    and split again for the row layer after, dense.ColumnDense.call)."""
    built, rows = [], []
    for num_parts, plan in splits:
        with tf.device(devices[0]):
            model = make_model()
        if num_parts > 1:
            model = towers.split_layers(model, plan, devices[:num_parts])
        trainer = towers.TowerTrainer(
            model, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            keras.optimizers.Adam(1e-3), devices=devices[:1])
        trainer.train_step(batch)  # builds the optimizer's slots and traces the step
        built.append(mode_lib.Mode(f"T={num_parts}", 1,
                                   lambda t=trainer: t.train_step(batch)["loss"], model))
        rows.append({"parts": num_parts, "bytes_per_device": _bytes_per_device(trainer)})
        if bytes_moved:
            rows[-1]["moved"] = transfers.trainer_step_bytes(trainer, batch)["total"]
            rows[-1]["variables_elsewhere"] = sum(
                towers.devices.canonical_name(v.value.device) != devices[0]
                for v in trainer.model.trainable_variables)
            rows[-1]["gathered_columns"] = sum(
                isinstance(layer, op_dense.ColumnDense)
                and not op_dense.is_elementwise(layer.activation)
                for layer in towers.compat.nested_layers(trainer.model))
    for mode in built:  # a step's first call after the others were built is slow once
        mode.run(1)
    base = None
    for row, samples in zip(rows, measure.time_interleaved(built, steps, rounds, seed)):
        row.update(measure.step_time_stats(samples))
        base = base or row["median_ms"]
        row["x_unsplit"] = row["median_ms"] / base
    return rows


def gpt2(vocab, layers, heads, width, intermediate, length, seed=0):
    """keras_hub's GPT2CausalLM(GPT2Backbone(...), preprocessor=None) with random weights
    (nothing is downloaded) and dropout 0: {"token_ids", "padding_mask"} (B, length)
    -> logits (B, length, vocab), the LM head the token embedding's table (tied)."""
    import keras_hub  # pylint: disable=g-import-not-at-top  (an extra; only this needs it)
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=vocab, num_layers=layers, num_heads=heads, hidden_dim=width,
        intermediate_dim=intermediate, dropout=0.0, max_sequence_length=length,
        name="gpt2_backbone")  # named, so that HUB_PLAN's paths find it in every build
    return keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)


def hub_formula_bytes(plan, num_parts, ids, *, vocab, layers, width, intermediate,
                      variables_elsewhere, gathered_columns=0):
    """Bytes one step of gpt2() split by `plan` into T parts moves between the tower
    (part 0's device) and parts 1..T-1, by docs/op_parallel.md's formula for each split
    (split_bytes.formula_bytes): per block, a heads split and a column -> row pair each
    send their input to every other part and its output back, and the gradients of
    both the other way; Adam's scalars to each variable on another part
    (ADAM_BYTES_PER_VARIABLE). Each of `gathered_columns` column splits not paired
    with the row split after it adds its other parts' units (B x length x
    (intermediate - part 0's)) to the tower and back again, and their gradients. A
    vocab split of the tied table adds its look-up of `ids` (B, length), and for the
    LM head the hidden states to every other part and their gradient back, and for
    its loss, kept in parts (op_parallel/vocab_loss.py), the targets out, three
    reductions back and one gradient out, per token: not the logits (B x length x
    V_j); and the tied table's gradient, (V_j, D) to the tower and back, where
    TensorFlow's tape adds its look-up's and its head's."""
    if num_parts == 1:
        return 0
    tokens, kinds = ids.size, set(plan.values())
    per_block = [kind for kind, used in (("heads", "heads" in kinds),
                                         ("column_row", "row" in kinds)) if used]
    total = ADAM_BYTES_PER_VARIABLE * variables_elsewhere + layers * sum(
        split_bytes.formula_bytes(kind, num_parts, tokens, width, intermediate)
        for kind in per_block)
    units_elsewhere = intermediate - op_layers.part_sizes(intermediate, num_parts)[0]
    total += gathered_columns * split_bytes.FLOAT * 4 * tokens * units_elsewhere
    if "vocab" in kinds:
        total += split_bytes.formula_bytes("vocab", num_parts, tokens, width, intermediate,
                                           ids, vocab)
        total += split_bytes.FLOAT * (num_parts - 1) * tokens * (2 * width + 5)
        # The tied table's two gradients (look-up and head) are added up where the tape
        # adds them, on the tower: each other part's (V_j, D) there and back.
        rows_elsewhere = vocab - op_layers.part_sizes(vocab, num_parts)[0]
        total += split_bytes.FLOAT * 2 * rows_elsewhere * width
    return total


def run_hub_benchmark(parts, devices, *, vocab=8192, layers=2, heads=4, width=128,
                      intermediate=512, length=64, global_batch_size=8, steps=50, rounds=5,
                      seed=0):
    """gpt2() split by HUB_PLAN at every T in `parts` (run_splits), on a batch of
    global_batch_size x length random ids (no padding) whose labels are the next ids;
    each T's bytes moved per step measured and by hub_formula_bytes, as split
    ("formula") and with every column -> row pair paired ("formula_paired"). Returns
    {"config", "rows"}."""
    ids, batch = lm_batch(vocab, global_batch_size, length, seed)
    sizes = {"vocab": vocab, "layers": layers, "heads": heads, "width": width,
             "intermediate": intermediate, "length": length}
    rows = run_splits(lambda: gpt2(**sizes, seed=seed), HUB_PLAN, batch, parts, devices,
                      steps=steps, rounds=rounds, seed=seed, bytes_moved=True)
    for row in rows:
        formula = functools.partial(
            hub_formula_bytes, HUB_PLAN, row["parts"], ids, vocab=vocab,
            layers=layers, width=width, intermediate=intermediate,
            variables_elsewhere=row["variables_elsewhere"])
        row["formula"] = formula(gathered_columns=row["gathered_columns"])
        row["formula_paired"] = formula()
    return {"config": {**sizes, "global_batch_size": global_batch_size, "plan": HUB_PLAN,
                       "steps": steps, "rounds": rounds},
            "rows": rows}


def lm_batch(vocab, global_batch_size, length, seed=0):
    """(ids, batch): global_batch_size x length random ids (no padding), as a keras_hub
    causal LM takes them ({"token_ids", "padding_mask"}), labelled with the next ids."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (global_batch_size, length + 1), dtype=np.int32)
    batch = ({"token_ids": tf.constant(ids[:, :-1]),
              "padding_mask": tf.ones((global_batch_size, length), tf.int32)},
             tf.constant(ids[:, 1:]))
    return ids[:, :-1], batch


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
    lines += [_split_row(row) + " |" for row in results["rows"]]
    if "bytes" in results:
        lines += _bytes_markdown(results["bytes"], config)
    if "hub" in results:
        lines += _hub_markdown(results["hub"])
    if "grouped_heads" in results:
        lines += grouped_heads_lib.markdown(results["grouped_heads"])
    if "vocab_loss" in results:
        lines += vocab_loss_lib.markdown(results["vocab_loss"])
    if "embedding" in results:
        lines += _embedding_markdown(results["embedding"])
    return "\n".join(lines) + "\n"


def _split_row(row):
    """A run_splits row as the first cells of a table row: T, step ms, x unsplit, MiB of
    variables and of optimizer slots on each device that holds any."""
    per_device = row["bytes_per_device"]
    variables = ", ".join(f"{d.split(':', 1)[-1]}: {v / 2**20:.2f}"
                          for d, (v, _) in per_device.items() if v)
    slots = ", ".join(f"{d.split(':', 1)[-1]}: {s / 2**20:.2f}"
                      for d, (_, s) in per_device.items() if s)
    return (f"| {row['parts']} | {row['median_ms']:.2f} ± {row['uncertainty_ms'] or 0:.2f} "
            f"| {row['x_unsplit']:.2f} | {variables} | {slots}")


def _hub_markdown(hub):
    config = hub["config"]
    lines = ["", "## keras_hub's GPT-2 split by a plan of layer paths",
             "",
             f"GPT2CausalLM (random weights, dropout 0): vocabulary {config['vocab']}, "
             f"{config['layers']} blocks of {config['heads']} heads, hidden {config['width']}, "
             f"feed-forward {config['intermediate']}; batch {config['global_batch_size']} x "
             f"{config['length']} tokens, next-token cross-entropy, Adam, one tower. Plan: "
             + ", ".join(f"`{path}`: {how}" for path, how in config["plan"].items())
             + f". Medians of {config['steps']} steps in {config['rounds']} interleaved "
             "rounds; bytes moved per step (forward, backward, update) measured as "
             "TensorFlow sent them, next to the formula for the split as it ran (a column "
             "split whose activation towers does not know to be elementwise is gathered "
             "before the row split after it) and for every column -> row pair paired.",
             "",
             "| T | step ms | x unsplit | MiB of variables per device "
             "| MiB of slots per device | measured KiB moved | formula KiB "
             "| column splits gathered | formula KiB if paired |",
             "|--:|--:|--:|---|---|--:|--:|--:|--:|"]
    for row in hub["rows"]:
        lines.append(f"{_split_row(row)} | {row['moved'] / 1024:.1f} "
                     f"| {row['formula'] / 1024:.1f} | {row['gathered_columns']} "
                     f"| {row['formula_paired'] / 1024:.1f} |")
    return lines


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
