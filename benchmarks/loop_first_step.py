"""Your own loop's first step: the first call of a tf.function around towers.tower_step
(or towers.tower_gradients), in a fresh process, against the same loop on one device and
the same towers by hand.

    python benchmarks/loop_first_step.py --num_towers=1,2,4 --rounds=3 --output_dir=DIR

The loop: benchmarks/harness/first_step.py's 2-block transformer, the batch's mean
sparse cross-entropy, its gradients applied by SGD with momentum, inside one
`@tf.function` (autograph on, as a user writes it), on 32 sequences of 16 ids. Four
ways (benchmarks/harness/loops.py): `one_device` (a GradientTape on the whole batch,
the reference), `by_hand` (per tower tf.device, a GradientTape, the model on its
shard; the sums on the main device), `tower_step` and `tower_gradients`, each at every
number of towers (one_device at 1). Each configuration runs once per round in a fresh
process, the order shuffled per round; medians of the first call (tracing, optimisation,
the run) and of a later step, and the first step's loss of each way (they must agree).
Writes DIR/results.json and DIR/results.md.
"""

import json
import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.harness import child_process, first_step, report  # noqa: E402

NUM_TOWERS = flags.DEFINE_list("num_towers", ["1", "2", "4"], "Towers of the by_hand, "
                               "tower_step and tower_gradients rows; 1 among them (the "
                               "ratios' base).")
STEPS = flags.DEFINE_integer("steps", 30, "Later steps timed after 5 untimed.", lower_bound=1)
ROUNDS = flags.DEFINE_integer("rounds", 3, "Rounds: each configuration's process per round.",
                              lower_bound=1)
SEED = flags.DEFINE_integer("seed", 0, "Seeds the order of the configurations per round.")
OUTPUT_DIR = flags.DEFINE_string("output_dir", None, "Where results.json/.md go.")
CHILD_CONFIG = flags.DEFINE_string("child_config", None, "Internal: run one configuration.")
ROWS = 32


def main(argv):
    del argv
    if CHILD_CONFIG.value:
        child_process.report(_measure(json.loads(CHILD_CONFIG.value)))
        return
    num_towers = first_step.checked_tower_counts(NUM_TOWERS.value, OUTPUT_DIR.value)
    import numpy as np
    configs = [{"model": "transformer", "way": "one_device", "num_towers": 1}]
    configs += [{"model": "transformer", "way": way, "num_towers": n}
                for way in ("by_hand", "tower_step", "tower_gradients") for n in num_towers]
    configs = [{**config, "steps": STEPS.value} for config in configs]
    runs = first_step.run_rounds(os.path.abspath(__file__), configs, ROUNDS.value, SEED.value)
    median = {first_step.key(c): {k: float(np.median([r[k] for r in runs[first_step.key(c)]]))
                                  for k in ("first_call_s", "step_ms", "first_loss")}
              for c in configs}
    text = _table(median, configs)
    report.write_json_and_markdown({"config": {"num_towers": num_towers, "steps": STEPS.value,
                                               "rounds": ROUNDS.value, "seed": SEED.value},
                                    "runs": runs, "medians": median}, text, OUTPUT_DIR.value)
    print(text)


def _table(median, configs):
    one_device = median["transformer/one_device/1"]
    lines = [f"Medians of {ROUNDS.value} rounds, each in a fresh process: the first call of "
             f"the loop's tf.function on {ROWS} sequences, then the mean of {STEPS.value} "
             "later steps.", "",
             "| way | towers | first call (s) | over one device | over 1 tower, same way | "
             "a later step (ms) | first loss − one device's |",
             "|---|--:|--:|--:|--:|--:|--:|"]
    for config in configs:
        row, way = median[first_step.key(config)], config["way"]
        one_tower = median[f"transformer/{way}/1"]
        lines.append(f"| {way} | {config['num_towers']} | {row['first_call_s']:.2f} | "
                     f"{row['first_call_s'] / one_device['first_call_s']:.2f} | "
                     f"{row['first_call_s'] / one_tower['first_call_s']:.2f} | "
                     f"{row['step_ms']:.1f} | "
                     f"{abs(row['first_loss'] - one_device['first_loss']):.1e} |")
    return "\n".join(lines) + "\n"


def _measure(config):
    """Child: builds the loop on its towers; times its first call and later steps."""
    import towers
    devices = towers.configure_devices(config["num_towers"], "cpu")
    import keras
    import numpy as np
    import tensorflow as tf
    from benchmarks.harness import loops
    model = first_step.transformer()
    optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
    optimizer.build(model.trainable_variables)
    build = {"one_device": loops.one_device, "by_hand": loops.by_hand,
             "tower_step": loops.with_tower_step,
             "tower_gradients": loops.with_tower_gradients}[config["way"]]
    loss_and_grads = build(model, devices)

    @tf.function
    def step(x, y):
        loss, grads = loss_and_grads(x, y)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    rng = np.random.default_rng(0)
    x = tf.constant(rng.integers(0, first_step.VOCAB, (ROWS, first_step.LENGTH)), tf.int32)
    y = tf.constant(rng.integers(0, first_step.NUM_CLASSES, ROWS), tf.int32)
    start = time.perf_counter()
    first_loss = float(step(x, y))  # the read waits for the step
    first_call = time.perf_counter() - start
    for _ in range(5):
        float(step(x, y))
    start = time.perf_counter()
    for _ in range(config["steps"]):
        float(step(x, y))
    return {"first_call_s": first_call, "first_loss": first_loss,
            "step_ms": 1000 * (time.perf_counter() - start) / config["steps"]}


if __name__ == "__main__":
    app.run(main)
