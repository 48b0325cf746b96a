"""A vocab-split LM head's loss, two ways, measured to decide whether towers should
build the second (issue 26, section 3): bytes moved between devices per step, next to
their formulas, and step time, in one run, interleaved.

The head: hidden states h (N tokens, D) and targets (N,) on the tower (devices[0]);
the table E (V, D), the tied embedding, split by rows into T parts, part j (V_j rows,
larger first) on devices[j], so part 0 is on the tower. Each part computes its logits
l_j = h E_j^T (N, V_j) where its rows live. Then:

- "gather": the parts' logits are concatenated on the tower (N, V), which computes the
  softmax cross-entropy and its gradient (N, V), split back to the parts;
- "vocab_parallel" (Megatron's vocab-parallel cross-entropy): each part reduces its
  logits to three (N,) vectors, its row-wise max m_j, its sum of exponentials
  s_j = sum exp(l_j - m_j), and the target's logit where the target is among its rows
  (0 elsewhere); the tower combines them into log Z = M + log sum_j s_j exp(m_j - M)
  (M = max_j m_j) and sends log Z back, from which each part computes the gradient of
  its own logits, softmax - one-hot, over N.

Both steps are the forward and backward of the mean loss with respect to h and every
part of the table, written out by hand with each op placed explicitly (a part's
backward on its part); each is checked against tf.GradientTape on the whole table on
one device, and against each other, before anything is timed.
"""

import numpy as np
import tensorflow as tf

from benchmarks.harness import measure, mode as mode_lib, transfers
from towers.op_parallel import layers as op_layers

FLOAT, INT = 4, 4  # bytes of a float32, of an int32 target
TOLERANCE = 1e-5
WAYS = ("gather", "vocab_parallel")


def formula_bytes(way, num_parts, tokens, width, vocab):
    """Bytes one step of `way` moves between the tower and parts 1..T-1. Both send h
    (N x D) to each other part and its gradient back. gather: part j's logits
    (N x V_j) to the tower and their gradient back, 2 N (V - V_0) floats in all, about
    the brief's B*S*V*4 bytes each way; vocab_parallel: the targets to each other part,
    three (N,) reductions back and log Z (N,) out, 5 N per other part."""
    others = num_parts - 1
    hidden_both_ways = FLOAT * 2 * tokens * width * others
    if way == "gather":
        sizes = op_layers.part_sizes(vocab, num_parts)
        return hidden_both_ways + FLOAT * 2 * tokens * (vocab - sizes[0])
    return hidden_both_ways + (INT + 4 * FLOAT) * tokens * others


def make_steps(table_parts, devices, tower):
    """{way: tf.function(h, targets) -> (loss, dloss/dh, [dloss/dE_j])} for the table's
    parts `table_parts` (variables, part j on devices[j]) and the tower's device."""
    offsets = np.cumsum([0] + [int(part.shape[0]) for part in table_parts[:-1]])

    def logits_on_parts(h):
        parts = []
        for part, device in zip(table_parts, devices):
            with tf.device(device):
                parts.append(tf.matmul(h, part, transpose_b=True))
        return parts

    def backward_on_parts(h, logit_grads):
        """Each part's dh_j and dE_j from its logits' gradient, on the part; dh summed on
        the tower."""
        hidden_grads, table_grads = [], []
        for part, device, grad in zip(table_parts, devices, logit_grads):
            with tf.device(device):
                hidden_grads.append(tf.matmul(grad, part))
                table_grads.append(tf.matmul(grad, h, transpose_a=True))
        with tf.device(tower):
            return tf.add_n(hidden_grads), table_grads

    @tf.function
    def gather(h, targets):
        logits = logits_on_parts(h)
        with tf.device(tower):
            whole = tf.concat(logits, axis=1)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(targets, whole))
            probabilities = tf.nn.softmax(whole)
            one_hot = tf.one_hot(targets, tf.shape(whole)[1])
            grad = (probabilities - one_hot) / tf.cast(tf.shape(whole)[0], whole.dtype)
            grads = tf.split(grad, [int(p.shape[0]) for p in table_parts], axis=1)
        return (loss, *backward_on_parts(h, grads))

    @tf.function
    def vocab_parallel(h, targets):
        logits = logits_on_parts(h)
        maxima, sums, target_logits, one_hots = [], [], [], []
        for part_logits, device, offset in zip(logits, devices, offsets):
            with tf.device(device):
                maximum = tf.reduce_max(part_logits, axis=1)
                maxima.append(maximum)
                sums.append(tf.reduce_sum(tf.exp(part_logits - maximum[:, None]), axis=1))
                local = targets - offset  # outside [0, V_j): one_hot gives a zero row
                one_hot = tf.one_hot(local, tf.shape(part_logits)[1])
                one_hots.append(one_hot)
                target_logits.append(tf.reduce_sum(part_logits * one_hot, axis=1))
        with tf.device(tower):
            largest = tf.reduce_max(tf.stack(maxima), axis=0)
            total = tf.add_n([s * tf.exp(m - largest) for s, m in zip(sums, maxima)])
            log_z = largest + tf.math.log(total)
            loss = tf.reduce_mean(log_z - tf.add_n(target_logits))
            scale = 1.0 / tf.cast(tf.shape(h)[0], h.dtype)
        grads = []
        for part_logits, device, one_hot in zip(logits, devices, one_hots):
            with tf.device(device):
                grads.append((tf.exp(part_logits - log_z[:, None]) - one_hot) * scale)
        return (loss, *backward_on_parts(h, grads))

    return {"gather": gather, "vocab_parallel": vocab_parallel}


def reference(h, targets, table):
    """(loss, dloss/dh, dloss/dE) by tf.GradientTape on the whole table, one device."""
    h, table = tf.constant(h), tf.constant(table)
    with tf.GradientTape() as tape:
        tape.watch([h, table])
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            targets, tf.matmul(h, table, transpose_b=True)))
    return (loss, *tape.gradient(loss, [h, table]))


def check_equal(results, want):
    """Raises AssertionError unless `results` (loss, dh, [dE_j]) equals `want` (loss, dh,
    dE) within TOLERANCE; returns the largest difference."""
    loss, hidden_grad, table_grads = results
    got = [np.asarray(loss), np.asarray(hidden_grad),
           np.concatenate([np.asarray(g) for g in table_grads])]
    differences = [float(np.max(np.abs(g - np.asarray(w)))) for g, w in zip(got, want)]
    assert max(differences) <= TOLERANCE, f"loss, dh, dE differ by {differences}"
    return max(differences)


def run_vocab_loss_benchmark(devices, *, vocabs=(8192, 32768), parts=(2, 4), tokens=1024,
                             width=128, steps=10, rounds=5, seed=0):
    """For every V in `vocabs` and T in `parts`: both ways' bytes per step (measured by
    transfers.bytes_between_devices, and the formula), their largest difference from the
    one-device reference, and their step times, interleaved. Returns {"config", "rows":
    [{"vocab", "parts", "way", "measured", "formula", "max_difference", median_ms...,
    "x_gather"}]}."""
    rng = np.random.default_rng(seed)
    h = rng.normal(size=(tokens, width)).astype(np.float32)
    rows, built = [], []
    for vocab in vocabs:
        targets = rng.integers(0, vocab, tokens).astype(np.int32)
        table = (0.02 * rng.normal(size=(vocab, width))).astype(np.float32)  # GPT-2's init
        want = reference(h, targets, table)
        for num_parts in parts:
            bounds = np.cumsum([0] + op_layers.part_sizes(vocab, num_parts))
            table_parts = []
            for j, device in enumerate(devices[:num_parts]):
                with tf.device(device):
                    table_parts.append(tf.Variable(table[bounds[j]:bounds[j + 1]]))
            with tf.device(devices[0]):
                args = (tf.constant(h), tf.constant(targets))
            steps_by_way = make_steps(table_parts, devices[:num_parts], devices[0])
            for way in WAYS:
                step = steps_by_way[way]
                difference = check_equal(step(*args), want)
                moved = transfers.bytes_between_devices(step, *args)["total"]
                rows.append({"vocab": vocab, "parts": num_parts, "way": way, "measured": moved,
                             "formula": formula_bytes(way, num_parts, tokens, width, vocab),
                             "max_difference": difference})
                built.append(mode_lib.Mode(f"{way}_V{vocab}_T{num_parts}", 1,
                                           lambda s=step, a=args: float(s(*a)[0]), None))
    for row, samples in zip(rows, measure.time_interleaved(built, steps, rounds, seed)):
        row.update(measure.step_time_stats(samples))
    for gathered, split in zip(rows[::2], rows[1::2]):
        for row in (gathered, split):
            row["x_gather"] = row["median_ms"] / gathered["median_ms"]
            row["bytes_x_gather"] = row["measured"] / gathered["measured"]
    return {"config": {"vocabs": list(vocabs), "parts": list(parts), "tokens": tokens,
                       "width": width, "steps": steps, "rounds": rounds},
            "rows": rows}


def markdown(results):
    """The section of results.md: one row per V, T and way."""
    config = results["config"]
    lines = ["", "## A vocab-split LM head's loss: logits gathered, or kept split (Megatron)",
             "",
             f"{config['tokens']} tokens of width {config['width']}, the table split by rows "
             "into T parts (part 0 on the tower's device); forward and backward of the mean "
             "cross-entropy w.r.t. the hidden states and the table, by hand "
             "(benchmarks/harness/vocab_loss.py), each equal to tf.GradientTape on one "
             f"device within {TOLERANCE:g}. Bytes measured as TensorFlow sent them, next to "
             f"the formula; medians of {config['steps']} steps in {config['rounds']} "
             "interleaved rounds.",
             "",
             "| V | T | way | measured KiB | formula KiB | bytes x gather | step ms "
             "| x gather | max diff |",
             "|--:|--:|---|--:|--:|--:|--:|--:|--:|"]
    for row in results["rows"]:
        lines.append(f"| {row['vocab']} | {row['parts']} | {row['way']} "
                     f"| {row['measured'] / 1024:.1f} | {row['formula'] / 1024:.1f} "
                     f"| {row['bytes_x_gather']:.3f} | {row['median_ms']:.2f} ± "
                     f"{row['uncertainty_ms'] or 0:.2f} | {row['x_gather']:.2f} "
                     f"| {row['max_difference']:.1e} |")
    return lines
