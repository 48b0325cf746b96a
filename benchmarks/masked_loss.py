"""What a masked loss costs: a padded-sequence tagger's step with its Keras mask, against
the same model without one, in one run.

    python benchmarks/masked_loss.py --num_towers=4 --output_dir=DIR

A masked output's loss is over the global batch's unmasked tokens, a count known
once every tower has run its forward. With the counts first (no accumulation:
GPipe order) each tower still runs one backward; under accumulation (1F1B, several
micro-batches) a masked term is differentiated apart from the other loss terms,
which costs a backward more where there are others (`--heads=2`: a per-sequence
class beside the tags). The bare work is the same model unmasked (mask_zero=False,
every token counted), on the same towers; Keras's own compile + train_on_batch on
one device is the reference the masked step must equal. Medians of interleaved
rounds; writes DIR/results.json and DIR/results.md.
"""

import json
import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ENCODERS = ("lstm", "attention")
NUM_TOWERS = flags.DEFINE_integer("num_towers", 4, "Towers (logical devices).", lower_bound=1)
ENCODER = flags.DEFINE_enum("encoder", "lstm", ENCODERS, "The tagger's encoder.")
HEADS = flags.DEFINE_integer("heads", 1, "1: tags only; 2: tags and a per-sequence class.",
                             lower_bound=1, upper_bound=2)
GLOBAL_BATCH_SIZE = flags.DEFINE_integer("global_batch_size", 64, "Sequences per step.",
                                         lower_bound=1)
TOKENS = flags.DEFINE_integer("tokens", 32, "Tokens per sequence (padded).", lower_bound=2)
STEPS = flags.DEFINE_integer("steps", 60, "Timed steps per mode.", lower_bound=1)
ROUNDS = flags.DEFINE_integer("rounds", 6, "Interleaved rounds.", lower_bound=1)
OUTPUT_DIR = flags.DEFINE_string("output_dir", None, "Where results.json/.md go.",
                                 required=True)
VOCABULARY, WIDTH, TAGS, CLASSES = 1000, 64, 10, 5


def main(argv):
    del argv
    import towers
    devices = towers.configure_devices(NUM_TOWERS.value, "cpu")
    import numpy as np
    from benchmarks.harness import measure

    batch = _batch(np.random.default_rng(0))
    modes = {"keras, 1 device": _Keras(batch)}
    for masked in (True, False):
        suffix = "" if masked else ", unmasked"
        modes[f"towers, 1 tower{suffix}"] = _Towers(batch, masked, devices[:1])
        modes[f"towers, {len(devices)} towers{suffix}"] = _Towers(batch, masked, devices)
        modes[f"towers, {len(devices)} towers, accum_steps=2{suffix}"] = _Towers(
            batch, masked, devices, accum_steps=2)
    times = measure.time_interleaved(list(modes.values()), STEPS.value, ROUNDS.value, seed=0)
    results = {name: measure.step_time_stats(t) for name, t in zip(modes, times)}
    os.makedirs(OUTPUT_DIR.value, exist_ok=True)
    with open(os.path.join(OUTPUT_DIR.value, "results.json"), "w") as out:
        json.dump({"flags": _flags(), "results": results}, out, indent=1)
    with open(os.path.join(OUTPUT_DIR.value, "results.md"), "w") as out:
        out.write(_table(results, len(devices)))
    print(_table(results, len(devices)))


def _model(masked):
    import keras
    keras.utils.set_random_seed(0)
    inputs = keras.Input((TOKENS.value,), dtype="int32")
    h = keras.layers.Embedding(VOCABULARY, WIDTH, mask_zero=masked)(inputs)
    if ENCODER.value == "lstm":
        h = keras.layers.LSTM(WIDTH, return_sequences=True)(h)
    else:
        h = keras.layers.MultiHeadAttention(4, WIDTH // 4)(h, h)
    tags = keras.layers.Dense(TAGS, name="tags")(h)
    if HEADS.value == 1:
        return keras.Model(inputs, tags)
    pooled = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(inputs, {"tags": tags,
                                "cls": keras.layers.Dense(CLASSES, name="cls")(pooled)})


def _loss():
    import keras
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return loss if HEADS.value == 1 else {"tags": loss, "cls": loss}


def _batch(rng):
    """Token ids padded with 0 after a length of 1..TOKENS, tags (and classes)."""
    import numpy as np
    import tensorflow as tf
    rows, tokens = GLOBAL_BATCH_SIZE.value, TOKENS.value
    x = rng.integers(1, VOCABULARY, (rows, tokens))
    x[np.arange(tokens)[None] >= rng.integers(1, tokens + 1, rows)[:, None]] = 0
    y = rng.integers(0, TAGS, (rows, tokens))
    if HEADS.value == 2:
        y = {"tags": y, "cls": rng.integers(0, CLASSES, rows)}
    return tf.constant(x.astype("int32")), tf.nest.map_structure(tf.constant, y)


class _Towers:
    """A TowerTrainer's train_step on one batch, warmed up (traced) once."""

    def __init__(self, batch, masked, devices, **options):
        import keras
        import towers
        self.batch = batch
        self.trainer = towers.TowerTrainer(_model(masked), _loss(), keras.optimizers.SGD(0.01),
                                           devices=devices, **options)
        self.run(2)

    def run(self, num_steps):
        from benchmarks.harness import measure
        # Its logs' one read waits for the step.
        return measure.wall_times(lambda: self.trainer.train_step(self.batch), num_steps)


class _Keras(_Towers):
    """keras.Model.compile + train_on_batch on one device: the reference."""

    def __init__(self, batch):  # pylint: disable=super-init-not-called
        import keras
        self.batch, self.model = batch, _model(True)
        self.model.compile(optimizer=keras.optimizers.SGD(0.01), loss=_loss())
        self.run(2)

    def run(self, num_steps):
        from benchmarks.harness import measure
        return measure.wall_times(lambda: self.model.train_on_batch(*self.batch), num_steps)


def _table(results, num_towers):
    lines = [f"encoder {ENCODER.value}, {HEADS.value} output(s), batch "
             f"{GLOBAL_BATCH_SIZE.value} x {TOKENS.value} tokens; ms per step (median ± s.e.)",
             "", "| mode | masked | unmasked | masked / unmasked |", "|---|--:|--:|--:|"]
    keras_ms = results["keras, 1 device"]["median_ms"]
    lines.append(f"| keras, 1 device | {keras_ms:.2f} | | |")
    for mode in ("towers, 1 tower", f"towers, {num_towers} towers",
                 f"towers, {num_towers} towers, accum_steps=2"):
        masked, bare = results[mode], results[f"{mode}, unmasked"]
        lines.append(f"| {mode} | {_ms(masked)} | {_ms(bare)} | "
                     f"{masked['median_ms'] / bare['median_ms']:.2f} |")
    return "\n".join(lines) + "\n"


def _ms(stats):
    return f"{stats['median_ms']:.2f} ± {stats['uncertainty_ms'] or 0:.2f}"


def _flags():
    return {name: flags.FLAGS[name].value for name in (
        "num_towers", "encoder", "heads", "global_batch_size", "tokens", "steps", "rounds")}


if __name__ == "__main__":
    app.run(main)
