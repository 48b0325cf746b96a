"""A split pipeline whose loss has a counted term (a Keras mask): the first `train_step`
in a fresh process, and later steps, at each number of towers.

    python benchmarks/masked_split_step.py --num_towers=1,2,4 --rounds=2 --output_dir=DIR

The model tags tokens: ids (32 sequences of 16, the last 4 padded, mask_zero=True) ->
2 blocks of self-attention and a Dense pair -> 10 logits per token, split by plan
"auto" into 2 parts per stage, 2 stages, 2 micro-batches: 4 logical CPUs per tower.
The loss is over the batch's unpadded tokens, a count known once every tower has run
its forward, so each tower's backward starts outside any traced tower work. Each
configuration runs once per round in a fresh process, the order shuffled per round
(harness/first_step.py run_rounds);
medians; writes DIR/results.json and DIR/results.md.
"""

import json
import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.harness import child_process, first_step, report  # noqa: E402

NUM_TOWERS = flags.DEFINE_list("num_towers", ["1", "2", "4"], "Towers to run; 1 among them "
                               "(the ratios' base).")
STEPS = flags.DEFINE_integer("steps", 30, "Later steps timed after 5 untimed.", lower_bound=1)
ROUNDS = flags.DEFINE_integer("rounds", 2, "Rounds: each configuration's process per round.",
                              lower_bound=1)
SEED = flags.DEFINE_integer("seed", 0, "Seeds the order of the configurations per round.")
OUTPUT_DIR = flags.DEFINE_string("output_dir", None, "Where results.json/.md go.")
CHILD_CONFIG = flags.DEFINE_string("child_config", None, "Internal: run one configuration.")
VOCABULARY, TOKENS, PADDED, WIDTH, TAGS, ROWS, STAGES, PARTS = 1000, 16, 4, 32, 10, 32, 2, 2


def main(argv):
    del argv
    if CHILD_CONFIG.value:
        child_process.report(_measure(json.loads(CHILD_CONFIG.value)))
        return
    num_towers = first_step.checked_tower_counts(NUM_TOWERS.value, OUTPUT_DIR.value)
    import numpy as np
    configs = [{"model": "masked_split_pipeline", "way": "towers", "num_towers": n,
                "steps": STEPS.value} for n in num_towers]
    runs = first_step.run_rounds(os.path.abspath(__file__), configs, ROUNDS.value, SEED.value)
    runs = {config["num_towers"]: runs[first_step.key(config)] for config in configs}
    median = {n: {k: float(np.median([r[k] for r in rows])) for k in ("first_step_s", "step_ms")}
              for n, rows in runs.items()}
    lines = [f"Medians of {ROUNDS.value} rounds, each in a fresh process: the first "
             f"`train_step` on {ROWS} sequences, then the mean of {STEPS.value} later steps.",
             "", "| towers | devices | first `train_step` (s) | over 1 tower | a later step (ms) |",
             "|--:|--:|--:|--:|--:|"]
    for n, row in median.items():
        lines.append(f"| {n} | {n * STAGES * PARTS} | {row['first_step_s']:.2f} | "
                     f"{row['first_step_s'] / median[1]['first_step_s']:.2f} | "
                     f"{row['step_ms']:.1f} |")
    text = "\n".join(lines) + "\n"
    report.write_json_and_markdown({"config": {"num_towers": num_towers, "steps": STEPS.value,
                                               "rounds": ROUNDS.value, "seed": SEED.value},
                                    "runs": runs, "medians": median}, text, OUTPUT_DIR.value)
    print(text)


def _measure(config):
    """Child: builds the split pipeline on its towers; times its first and later steps."""
    import towers
    n = config["num_towers"]
    devices = towers.configure_devices(n * STAGES * PARTS, "cpu")
    import keras
    import numpy as np
    import tensorflow as tf
    keras.utils.set_random_seed(0)
    ids = keras.Input((TOKENS,), dtype="int32")
    x = keras.layers.Embedding(VOCABULARY, WIDTH, mask_zero=True, name="table")(ids)
    for i in range(2):  # no residual Add: Keras's drops the mask, and the loss its count
        x = keras.layers.MultiHeadAttention(4, WIDTH // 4, name=f"block_{i}_attention")(x, x)
        x = keras.layers.Dense(2 * WIDTH, activation="relu", name=f"block_{i}_up")(x)
        x = keras.layers.Dense(WIDTH, name=f"block_{i}_down")(x)
        x = keras.layers.LayerNormalization(name=f"block_{i}_out")(x)
    model = keras.Model(ids, keras.layers.Dense(TAGS, name="tags")(x))
    grid = first_step.tower_grid(devices, n, STAGES, PARTS)
    trainer = towers.TowerTrainer(
        towers.split_layers(model, "auto", grid[0][0]),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        keras.optimizers.SGD(0.01), devices=grid, pipeline_cuts=["block_0_out"],
        micro_batches=2)
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, VOCABULARY, size=(ROWS, TOKENS)).astype("int32")
    tokens[:, TOKENS - PADDED:] = 0
    batch = (tf.constant(tokens), tf.constant(rng.integers(0, TAGS, size=(ROWS, TOKENS))))
    start = time.perf_counter()
    trainer.train_step(batch)
    first = time.perf_counter() - start
    for _ in range(5):
        trainer.train_step(batch)
    start = time.perf_counter()
    for _ in range(config["steps"]):
        trainer.train_step(batch)
    return {"first_step_s": first,
            "step_ms": 1000 * (time.perf_counter() - start) / config["steps"],
            "counted_terms": len(trainer.objective.counted)}


if __name__ == "__main__":
    app.run(main)
