"""run_tied_table_benchmark: a layer called in two pipeline stages, what it moves.

keras_hub's GPT-2 causal LM looks its tokens up in its token embedding's table and,
reversed, uses the same table as its LM head. Cut into 2 stages after half its blocks,
on one tower, the look-up runs in stage 0 and the head in stage 1; the
table lives with stage 0 (towers/model_parallel/stages.py), stage 1 reads it each step,
and stage 1's gradient of it returns to stage 0's device, where the two gradients meet.
Each step's bytes between the two devices are measured as TensorFlow sent them
(transfers.trainer_step_bytes), the table's share picked out as the transfers shaped as
the table, next to the formula; the step is timed against the same model on one device,
interleaved.
"""

import keras
import tensorflow as tf

import towers
from benchmarks.harness import measure, mode as mode_lib, op_parallel, split_bytes, transfers


def formula_bytes(micro_batches, *, vocab, width, global_batch_size, length,
                  variables_elsewhere):
    """{"table", "total"}: bytes a step of 1 tower x 2 stages moves between the stage
    devices, by what the measurement showed TensorFlow sending: the table (V, D) to stage
    1 once per micro-batch (each micro-batch's head reads it) and stage 1's gradient of
    it back once (summed over the micro-batches where it is computed), (M + 1) V D
    floats; over all micro-batches, the hidden states that cross the cut (B, S, D) and
    their gradient back, the targets (B, S) int32 to the loss and the padding mask (B, S)
    int32 that stage 1's attention reads; Adam's scalars to each variable stage 1 holds
    (op_parallel.ADAM_BYTES_PER_VARIABLE)."""
    table = split_bytes.FLOAT * (micro_batches + 1) * vocab * width
    tokens = global_batch_size * length
    cut = split_bytes.FLOAT * 2 * tokens * width + split_bytes.INT * 2 * tokens
    return {"table": table, "total": table + cut + op_parallel.ADAM_BYTES_PER_VARIABLE
            * variables_elsewhere}


def run_tied_table_benchmark(devices, *, micro_batches=(1, 2), vocab=8192, layers=2,
                             heads=4, width=128, length=64, global_batch_size=8, steps=30,
                             rounds=5, seed=0):
    """op_parallel.gpt2() (feed-forward 4 x width) trained with Adam on one device, and
    on 1 tower x 2 stages (devices[:2], cut after half its blocks) with each M
    in `micro_batches`, timed interleaved on one batch of random ids labelled with the
    next ids. Returns {"config", "rows"}: per row "stages", "micro_batches", timing,
    "x_one_device", and for 2 stages the bytes measured ("moved", "moved_table": those
    of transfers shaped as the table) and by formula_bytes."""
    if len(devices) < 2 or layers < 2 or min(micro_batches, default=0) < 1:
        raise ValueError(f"needs 2 devices, 2 blocks and micro-batch counts >= 1, got "
                         f"{devices}, {layers} blocks, {list(micro_batches)}.")
    if global_batch_size < max(micro_batches):
        raise ValueError(f"global_batch_size {global_batch_size} is smaller than "
                         f"{max(micro_batches)} micro-batches; each needs a sequence.")
    _, batch = op_parallel.lm_batch(vocab, global_batch_size, length, seed)
    # Half the blocks in each stage. (towers.models.pipeline_cuts, balancing estimated
    # compute, puts the LM head alone in stage 1 where the vocabulary is large.)
    cuts = [f"gpt2_backbone/transformer_layer_{layers // 2 - 1}"]
    sizes = {"vocab": vocab, "layers": layers, "heads": heads, "width": width,
             "intermediate": 4 * width, "length": length}
    built, rows = [], []
    for stages, m in [(1, 1)] + [(2, m) for m in micro_batches]:
        with tf.device(devices[0]):
            lm = op_parallel.gpt2(**sizes, seed=seed)
        layout = {"devices": devices[:1]}
        if stages == 2:
            layout = {"devices": [devices[:2]], "pipeline_cuts": cuts, "micro_batches": m}
        trainer = towers.TowerTrainer(
            lm, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            keras.optimizers.Adam(1e-3), **layout)
        trainer.train_step(batch)  # builds the optimizer's slots and traces the step
        built.append(mode_lib.Mode(f"K{stages}_M{m}", 1,
                                   lambda t=trainer: t.train_step(batch)["loss"], lm))
        row = {"stages": stages, "micro_batches": m}
        if stages == 2:
            table_shape = tuple(lm.backbone.token_embedding.embeddings.shape)
            moved = transfers.trainer_step_bytes(trainer, batch)
            elsewhere = sum(towers.devices.canonical_name(v.value.device) != devices[0]
                            for v in lm.trainable_variables)
            formula = formula_bytes(m, vocab=vocab, width=width,
                                    global_batch_size=global_batch_size, length=length,
                                    variables_elsewhere=elsewhere)
            row.update(moved=moved["total"], formula=formula["total"],
                       moved_table=sum(size for *_, shape, size in moved["tensors"]
                                       if shape == table_shape),
                       formula_table=formula["table"], variables_elsewhere=elsewhere)
        rows.append(row)
    for mode in built:  # a step's first call after the others were built is slow once
        mode.run(1)
    for row, samples in zip(rows, measure.time_interleaved(built, steps, rounds, seed)):
        row.update(measure.step_time_stats(samples))
        row["x_one_device"] = row["median_ms"] / rows[0]["median_ms"]
    return {"config": {**sizes, "global_batch_size": global_batch_size, "pipeline_cuts": cuts,
                       "steps": steps, "rounds": rounds},
            "rows": rows}


def markdown(results):
    """The results as a Markdown section (a list of lines)."""
    config = results["config"]
    table_kib = split_bytes.FLOAT * config["vocab"] * config["width"] / 1024
    lines = ["", "## A layer called in two stages: GPT-2's tied table",
             "",
             f"GPT2CausalLM (random weights, dropout 0): vocabulary {config['vocab']}, "
             f"{config['layers']} blocks of {config['heads']} heads, hidden {config['width']}, "
             f"feed-forward {config['intermediate']}; batch {config['global_batch_size']} x "
             f"{config['length']} tokens, Adam. One device, and 1 tower x 2 stages cut after "
             f"{config['pipeline_cuts']}: the token table ({table_kib:.0f} KiB) lives with "
             "stage 0's look-up; stage 1's LM head reads it each step, its gradient returns. "
             "Bytes per step between the two devices measured as TensorFlow sent them; the "
             "table's: the transfers shaped as the table. Formula: the table (M + 1) times "
             "(once per micro-batch out, its gradient once back), the cut's hidden states and "
             "their gradient, the targets and the padding mask, "
             f"Adam's scalars. Medians of {config['steps']} "
             f"steps in {config['rounds']} interleaved rounds.",
             "",
             "| stages | M | step ms | x one device | measured KiB | formula KiB "
             "| table's KiB measured | (M + 1) x table KiB |",
             "|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for row in results["rows"]:
        cells = (f"{row['moved'] / 1024:.1f} | {row['formula'] / 1024:.1f} "
                 f"| {row['moved_table'] / 1024:.1f} | {row['formula_table'] / 1024:.1f}"
                 if "moved" in row else "– | – | – | –")
        lines.append(f"| {row['stages']} | {row['micro_batches']} | {row['median_ms']:.2f} ± "
                     f"{row['uncertainty_ms'] or 0:.2f} | {row['x_one_device']:.2f} | {cells} |")
    return lines
