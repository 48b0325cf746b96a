"""How long a user waits for the first step: each configuration in a fresh process
(import, build, fit), towers at 1, 2 and 4 towers against Keras compile + fit on one
device and MirroredStrategy on the same logical devices (issue 39).

    python benchmarks/first_step.py --rounds=2 --output_dir=DIR

Models: the built-in mlp and cnn, a 2-block transformer, the transformer split in 2 parts
per tower (split_layers, plan "auto"), cut into 2 pipeline stages (--micro_batches per
tower, 2 by default), and both (benchmarks/harness/first_step.py). Every configuration
runs once per round, in its own process, the order shuffled per round; the tables give
medians of seconds since the process was launched, to: TensorFlow and Keras imported,
towers imported, built, first step, first epoch (--steps steps of --batch_size), and a
second fit's seconds; then the time to the first step at the most towers over Keras's
and over one tower's.
Writes DIR/results.json, DIR/results.md and DIR/first_step.png (fit's share of the
time to the first step against the number of towers; benchmarks/figures/first_step.png).
"""

import json
import os
import sys

from absl import app, flags, logging

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.harness import child_process, first_step, report  # noqa: E402

MODELS = flags.DEFINE_list("models", list(first_step.MODELS),
                           f"Models, of {list(first_step.MODELS)}.")
NUM_TOWERS = flags.DEFINE_list("num_towers", ["1", "2", "4"],
                               "Tower counts of the towers rows; the ratios take the largest.")
MIRRORED_TOWERS = flags.DEFINE_list("mirrored_towers", ["4"],
                                    "Device counts of the MirroredStrategy rows (empty: none).")
STEPS = flags.DEFINE_integer("steps", 4, "Steps of each fit's epoch.", lower_bound=1)
BATCH_SIZE = flags.DEFINE_integer("batch_size", 32, "Global batch size.", lower_bound=1)
MICRO_BATCHES = flags.DEFINE_integer(
    "micro_batches", first_step.MICRO_BATCHES,
    "Micro-batches per tower of the pipelined models (pipeline, split_pipeline).", lower_bound=1)
ROUNDS = flags.DEFINE_integer("rounds", 2, "Rounds: each configuration's process per round.",
                              lower_bound=1)
SEED = flags.DEFINE_integer("seed", 0, "Seeds the order of the configurations per round.")
OUTPUT_DIR = flags.DEFINE_string("output_dir", None, "Where results.json/.md go.")
CHILD_CONFIG = flags.DEFINE_string("child_config", None, "Internal: run one configuration.")


def main(argv):
    del argv
    if CHILD_CONFIG.value:
        child_process.report(first_step.measure(json.loads(CHILD_CONFIG.value)))
        return
    num_towers, mirrored_towers = _checked_flags()
    configs = [{**c, "steps": STEPS.value, "batch_size": BATCH_SIZE.value,
                "micro_batches": MICRO_BATCHES.value}
               for c in first_step.configurations(MODELS.value, num_towers, mirrored_towers)]
    runs = first_step.run_rounds(os.path.abspath(__file__), configs, ROUNDS.value, SEED.value)
    median = first_step.medians(runs)
    ratios = first_step.ratios(median, MODELS.value, num_towers, mirrored_towers)
    config = {"models": MODELS.value, "num_towers": num_towers,
              "mirrored_towers": mirrored_towers, "steps": STEPS.value,
              "batch_size": BATCH_SIZE.value, "micro_batches": MICRO_BATCHES.value,
              "rounds": ROUNDS.value, "seed": SEED.value}
    results = {"config": config, "runs": runs, "medians": median, "ratios": ratios}
    text = first_step.markdown(median, ratios, config)
    report.write_json_and_markdown(results, text, OUTPUT_DIR.value)
    print(text)
    figure = os.path.join(OUTPUT_DIR.value, "first_step.png")
    if not first_step.draw(median, config, figure):
        logging.warning("matplotlib is not installed, so %s is not drawn; install it with "
                        "`pip install matplotlib` (or `pip install -e .[bench]`).", figure)


def _checked_flags():
    """(num_towers, mirrored_towers) as ints, after refusing what cannot run, in one line."""
    unknown = sorted(set(MODELS.value) - set(first_step.MODELS))
    try:
        num_towers = [int(n) for n in NUM_TOWERS.value]
        mirrored_towers = [int(n) for n in MIRRORED_TOWERS.value]
    except ValueError:
        num_towers = mirrored_towers = None
    problems = [
        (not OUTPUT_DIR.value, "--output_dir is required: where results.json and .md go."),
        (unknown, f"--models: unknown {unknown}; choose from {list(first_step.MODELS)}."),
        (num_towers is None or 1 not in num_towers or min(num_towers + mirrored_towers) < 1,
         f"--num_towers must hold 1 (the ratios' base) and --mirrored_towers counts >= 1, "
         f"got {NUM_TOWERS.value} and {MIRRORED_TOWERS.value}."),
    ]
    for problem, message in problems:
        if problem:
            raise app.UsageError(message)
    return num_towers, mirrored_towers


if __name__ == "__main__":
    app.run(main)
