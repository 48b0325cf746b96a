"""The bytes one training step of a split layer moves between devices, measured as
TensorFlow sends them (transfers.py) next to the formula of docs/op_parallel.md,
and the figure that draws each split with them.

Each split runs alone: a small model, one tower on devices[0], which is part 0's
device, the layer's T parts on devices[:T]; an unsplit Dense before the split
layer, so the gradient of its input is needed and crosses back as well.
"""

import keras
import numpy as np
import tensorflow as tf

import towers
from benchmarks.harness import transfers
from towers.op_parallel import layers as op_layers

FLOAT, INT = 4, 4  # bytes of a float32, of an int32 id
KINDS = ("column", "row", "column_row", "vocab", "heads")


def split_model(kind, width, hidden, heads, vocab, length):
    """(model, plan) of one split of `kind` between an unsplit Dense (or the ids) and the
    logits: tokens (B, length, width) or, for "vocab", ids (B, length)."""
    keras.utils.set_random_seed(0)
    if kind == "vocab":
        inputs = keras.Input((length,), dtype="int32")
        x = keras.layers.Embedding(vocab, width, name="split")(inputs)
    else:
        inputs = keras.Input((length, width))
        x = keras.layers.Dense(width, name="before")(inputs)
        if kind == "column":  # with L2 on the kernel: each part's penalty computed there
            x = keras.layers.Dense(hidden, activation="relu", name="split",
                                   kernel_regularizer=keras.regularizers.L2(1e-4))(x)
        elif kind == "row":
            x = keras.layers.Dense(width, name="split")(x)
        elif kind == "column_row":
            x = keras.layers.Dense(hidden, activation="relu", name="up")(x)
            x = keras.layers.Dense(width, name="split")(x)
        else:
            x = keras.layers.MultiHeadAttention(heads, width // heads, name="split")(x, x)
    logits = keras.layers.Dense(10, name="logits")(keras.layers.GlobalAveragePooling1D()(x))
    plan = {"split": {"column": "column", "row": "row", "column_row": "row", "vocab": "vocab",
                      "heads": "heads"}[kind]}
    if kind == "column_row":
        plan["up"] = "column"
    return keras.Model(inputs, logits), plan


def formula_bytes(kind, num_parts, rows, width, hidden, ids=None, vocab=None,
                  variables_elsewhere=0):
    """Bytes a step (forward, backward and update) moves between the tower (part 0's
    device) and parts 1..T-1, per docs/op_parallel.md. rows: tokens through the layer
    (B x length); ids: the batch's ids (vocab); variables_elsewhere: variables on parts
    1..T-1, each sent the learning rate (4 bytes) for its update."""
    if num_parts == 1:
        return 0
    return FLOAT * variables_elsewhere + _activation_bytes(kind, num_parts, rows, width,
                                                           hidden, ids, vocab)


def _activation_bytes(kind, num_parts, rows, width, hidden, ids, vocab):
    others = num_parts - 1
    first = op_layers.part_sizes(hidden if kind == "column" else width, num_parts)[0]
    if kind == "column":   # the input to each other part and its gradient back; their
        # units and their gradient; the kernel's L2 penalty, a scalar, back
        return FLOAT * (2 * rows * (others * width + hidden - first) + others)
    if kind == "row":      # the input slices and their gradients; the partial sums, both ways
        return FLOAT * 2 * rows * (width - first + others * width)
    if kind in ("column_row", "heads"):  # the input to, and the output from, each other part
        return FLOAT * 2 * rows * others * (width + width)
    sizes = op_layers.part_sizes(vocab, num_parts)
    looked_up = int(np.sum(np.asarray(ids).ravel() >= sizes[0]))  # ids not in part 0's rows
    # Each such id to its part, its vector back, the vector's gradient to the part again
    # (the update's IndexedSlices indices are the ids the part has already).
    return looked_up * (INT + 2 * FLOAT * width)


def measure_splits(devices, parts, *, width=64, hidden=256, heads=4, vocab=20000, length=16,
                   global_batch_size=32, seed=0):
    """For each kind in KINDS and T in `parts`: {"kind", "parts", "measured", "formula",
    "by_pair": {"SRC->DST": bytes}} of one step of split_model(kind) on one tower."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (global_batch_size, length)).astype(np.int32)
    tokens = rng.normal(size=(global_batch_size, length, width)).astype(np.float32)
    labels = rng.integers(0, 10, global_batch_size)
    rows = []
    for kind in KINDS:
        for num_parts in parts:
            with tf.device(devices[0]):
                model, plan = split_model(kind, width, hidden, heads, vocab, length)
            if num_parts > 1:
                model = towers.split_layers(model, plan, devices[:num_parts])
            trainer = towers.TowerTrainer(
                model, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                keras.optimizers.SGD(0.1), devices=devices[:1])
            batch = (ids if kind == "vocab" else tokens, labels)
            trainer.train_step(batch)  # sets the trainer up
            moved = transfers.trainer_step_bytes(trainer, batch)
            elsewhere = sum(towers.devices.canonical_name(v.value.device) != devices[0]
                            for v in trainer.model.trainable_variables)
            rows.append({"kind": kind, "parts": num_parts, "measured": moved["total"],
                         "formula": formula_bytes(kind, num_parts, global_batch_size * length,
                                                  width, hidden, ids, vocab, elsewhere),
                         "by_pair": {f"{src}->{dst}": size
                                     for (src, dst), size in moved["by_pair"].items()}})
    return rows


def draw(rows, path):
    """One panel per split kind: the tower's device and the parts' devices as boxes, an
    arrow each way per part, labelled with the bytes measured (largest T)."""
    try:
        import matplotlib  # pylint: disable=g-import-not-at-top
        matplotlib.use("Agg")
        from matplotlib import pyplot  # pylint: disable=g-import-not-at-top
    except ImportError:
        return
    largest = max(row["parts"] for row in rows)
    shown = [row for row in rows if row["parts"] == largest]
    figure, axes = pyplot.subplots(1, len(shown), figsize=(3.4 * len(shown), 3.6))
    for axis, row in zip(np.atleast_1d(axes), shown):
        axis.set_xlim(0, 10)
        axis.set_ylim(-0.5, largest)
        axis.axis("off")
        devices = sorted({d for pair in row["by_pair"] for d in pair.split("->")})
        tower = devices[0] if devices else "tower"
        axis.text(1.5, (largest - 1) / 2, f"tower\n(part 0)\n{tower.split('device:')[-1]}",
                  ha="center", va="center", bbox=dict(boxstyle="round", fc="#dde8f5"))
        for j, device in enumerate(devices[1:], start=1):
            y = largest - 1 - (j - 1) * (largest - 1) / max(len(devices) - 2, 1)
            axis.text(8.5, y, f"part {j}\n{device.split('device:')[-1]}", ha="center",
                      va="center", bbox=dict(boxstyle="round", fc="#f5e6dd"))
            middle = (largest - 1) / 2
            out = row["by_pair"].get(f"{tower}->{device}", 0)
            back = row["by_pair"].get(f"{device}->{tower}", 0)
            for start, end, size, dy in (((2.7, middle), (7.3, y), out, 0.1),
                                         ((7.3, y), (2.7, middle), back, -0.1)):
                axis.annotate("", xy=(end[0], end[1] + dy), xytext=(start[0], start[1] + dy),
                              arrowprops=dict(arrowstyle="->", color="#555555"))
                axis.text(5, (y + middle) / 2 + 2.5 * dy, f"{size / 1024:.1f} KiB",
                          ha="center", va="center", fontsize=7,
                          color="#1f4e8c" if dy > 0 else "#8c3b1f")
        axis.set_title(f"{row['kind']} (T={largest})\nmeasured {row['measured'] / 1024:.0f} KiB, "
                       f"formula {row['formula'] / 1024:.0f} KiB", fontsize=9)
    figure.suptitle("Bytes one training step moves between devices, per split "
                    "(blue: to the part, brown: back)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    pyplot.close(figure)
