"""Pipeline stages: step time, measured bubble and bytes per device, against K and M.

    python benchmarks/pipeline.py --model=cnn --stages=1,2,4 --micro_batches=1,2,4,8 \\
        --output_dir=DIR

For every K in --stages and M in --micro_batches the model is cut into K stages
of about equal estimated compute (towers.models.pipeline_cuts), one device each,
and trained with M micro-batches. Writes DIR/results.json, DIR/results.md (step
time, measured bubble next to (K-1)/(M+K-1), bytes of variables per device)
and DIR/timeline.png (one row per stage device, one box per micro-batch's
forward and backward, for --timeline=K,M under gpipe and 1f1b, over their
ideal timetables). Traces and compiled graphs stay under DIR/trace. Also
keras_hub's GPT-2 (--tied_* sizes, random weights) on 1 tower x 2 stages, its
tied token table looked up in stage 0 and read by stage 1's LM head: the bytes
a step moves, the table's share next to its formula, and the step time against
one device. The work is in benchmarks/harness/pipeline.py and tied_table.py;
this file only reads the flags.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow loads
# Run as a script, Python puts benchmarks/ on the path, not the project root.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

import towers  # noqa: E402
from benchmarks.harness import pipeline as pipeline_harness  # noqa: E402
from towers.cli import models  # noqa: E402
from towers.model_parallel import schedule  # noqa: E402

MODEL = flags.DEFINE_enum("model", "cnn", models.MODELS, "Model to cut into pipeline stages.")
STAGES = flags.DEFINE_list("stages", ["1", "2", "4"],
                           "Comma-separated stage counts K; each stage gets its own device.")
MICRO_BATCHES = flags.DEFINE_list("micro_batches", ["1", "2", "4", "8"],
                                  "Comma-separated micro-batch counts M per tower and step.")
SCHEDULE = flags.DEFINE_enum("schedule", "gpipe", schedule.SCHEDULES,
                             "Pipeline schedule of the K x M sweep.")
NUM_TOWERS = flags.DEFINE_integer("num_towers", 1, "Data-parallel towers, each a pipeline of K "
                                  "stage devices (num_towers x K devices in all).", lower_bound=1)
GLOBAL_BATCH_SIZE = flags.DEFINE_integer("global_batch_size", 256, "Examples per step, split "
                                         "over the towers, then the micro-batches.",
                                         lower_bound=1)
STEPS = flags.DEFINE_integer("steps", 30, "Timed steps per configuration (after the warm-up), "
                             "spread over --rounds interleaved rounds.", lower_bound=1)
WARMUP_STEPS = flags.DEFINE_integer("warmup_steps", 3, "Untimed steps per configuration after "
                                    "the first (compiling) one.", lower_bound=0)
ROUNDS = flags.DEFINE_integer("rounds", 5, "Interleaved rounds: each times a block of every "
                              "configuration in turn, so machine drift hits all alike.",
                              lower_bound=1)
TRACE_STEPS = flags.DEFINE_integer("trace_steps", 3, "Steps per configuration traced with "
                                   "tf.profiler for the bubble and the timeline.", lower_bound=1)
TIMELINE = flags.DEFINE_list("timeline", ["4", "4"],
                             "K,M of the configuration drawn in timeline.png, under every "
                             "schedule; added to the sweep if not in it.")
INPUT_SHAPE = flags.DEFINE_list("input_shape", ["32", "32", "3"],
                                "Height,width,channels of the synthetic images.")
DEVICE_TYPE = flags.DEFINE_enum("device_type", "auto", towers.devices.DEVICE_TYPES,
                                "Stage device kind; auto = GPUs if any, else logical CPU devices.")
SEED = flags.DEFINE_integer("seed", 0, "Seed of the weights (the same in every configuration) "
                            "and of the synthetic data.")
TIED_LAYERS = flags.DEFINE_integer("tied_layers", 2, "Transformer blocks of keras_hub's GPT-2 "
                                   "whose tied table two stages share; 0 skips it.",
                                   lower_bound=0)
TIED_MICRO_BATCHES = flags.DEFINE_list("tied_micro_batches", ["1", "2"],
                                       "Micro-batch counts M of GPT-2 on 2 stages.")
TIED_VOCAB = flags.DEFINE_integer("tied_vocab", 8192, "GPT-2's vocabulary (the table's rows).",
                                  lower_bound=1)
TIED_HEADS = flags.DEFINE_integer("tied_heads", 4, "GPT-2's attention heads.", lower_bound=1)
TIED_WIDTH = flags.DEFINE_integer("tied_width", 128, "GPT-2's hidden width (divisible by "
                                  "--tied_heads; feed-forward 4x).", lower_bound=1)
TIED_LENGTH = flags.DEFINE_integer("tied_length", 64, "GPT-2's tokens per sequence.",
                                   lower_bound=1)
TIED_BATCH_SIZE = flags.DEFINE_integer("tied_batch_size", 8, "GPT-2's sequences per step.",
                                       lower_bound=1)
OUTPUT_DIR = flags.DEFINE_string("output_dir", "benchmarks/results/pipeline",
                                 "Where results.json, results.md, timeline.png and trace/ go.")


def _positive_ints(values, count=None):
    """The comma-separated values as ints, or None unless all are >= 1 (and `count` many)."""
    try:
        numbers = [int(v) for v in values]
    except ValueError:
        return None
    if not numbers or min(numbers) < 1 or (count is not None and len(numbers) != count):
        return None
    return numbers


for _name, _count, _example in (("stages", None, "1,2,4"), ("micro_batches", None, "1,2,4,8"),
                                ("tied_micro_batches", None, "1,2"),
                                ("timeline", 2, "4,4 (K,M)"), ("input_shape", 3, "32,32,3")):
    flags.register_validator(_name, lambda v, count=_count: _positive_ints(v, count) is not None,
                             f"must be comma-separated positive integers, e.g. {_example}")
flags.register_multi_flags_validator(
    ["tied_layers", "tied_width", "tied_heads", "tied_batch_size", "tied_micro_batches"],
    lambda f: not f["tied_layers"] or not _positive_ints(f["tied_micro_batches"]) or (
        f["tied_width"] % f["tied_heads"] == 0
        and f["tied_batch_size"] >= max(_positive_ints(f["tied_micro_batches"]))),
    "--tied_width must be divisible by --tied_heads, and --tied_batch_size at least the "
    "largest --tied_micro_batches (every micro-batch needs a sequence)")
flags.register_multi_flags_validator(
    ["steps", "rounds"], lambda f: f["rounds"] <= f["steps"],
    "--rounds must be at most --steps (each round times at least one step)")
flags.register_multi_flags_validator(
    ["global_batch_size", "num_towers", "micro_batches", "timeline"],
    lambda f: not (_positive_ints(f["micro_batches"]) and _positive_ints(f["timeline"], 2))
    or f["global_batch_size"] >= f["num_towers"] * max(_positive_ints(f["micro_batches"])
                                                       + _positive_ints(f["timeline"], 2)[1:]),
    "--global_batch_size must be at least --num_towers x the largest micro-batch count "
    "(every micro-batch needs an example)")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    stages, timeline = _positive_ints(STAGES.value), _positive_ints(TIMELINE.value, 2)
    # Every configuration has its own trainer, so TensorFlow's warning that the
    # step function "retraced" 5 times in a row is expected here.
    tf.get_logger().setLevel("ERROR")
    try:
        tied = None
        if TIED_LAYERS.value:
            tied = {"micro_batches": _positive_ints(TIED_MICRO_BATCHES.value),
                    "vocab": TIED_VOCAB.value, "layers": TIED_LAYERS.value,
                    "heads": TIED_HEADS.value, "width": TIED_WIDTH.value,
                    "length": TIED_LENGTH.value, "global_batch_size": TIED_BATCH_SIZE.value}
        devices = towers.configure_devices(
            max(NUM_TOWERS.value * max(stages + timeline[:1]), 2 if tied else 1),
            DEVICE_TYPE.value)  # before TensorFlow starts
        results = pipeline_harness.run_pipeline_benchmark(
            MODEL.value, stages, _positive_ints(MICRO_BATCHES.value), devices, OUTPUT_DIR.value,
            schedule_name=SCHEDULE.value, num_towers=NUM_TOWERS.value,
            global_batch_size=GLOBAL_BATCH_SIZE.value, steps=STEPS.value,
            warmup_steps=WARMUP_STEPS.value, rounds=ROUNDS.value, trace_steps=TRACE_STEPS.value,
            timeline=tuple(timeline), input_shape=tuple(_positive_ints(INPUT_SHAPE.value, 3)),
            seed=SEED.value, tied=tied)
    except (ValueError, towers.DeviceConfigError) as error:
        print(f"pipeline: error: {error}", file=sys.stderr)
        return 1
    print(pipeline_harness.markdown(results))
    print(f"Wrote results.json, results.md and timeline.png to {OUTPUT_DIR.value}")
    return 0


if __name__ == "__main__":
    app.run(main)
