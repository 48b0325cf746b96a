"""Compares towers with a plain loop, Keras fit, MirroredStrategy, no-communication towers
and the floor (the seven steps and nothing else), with and without XLA.

    python benchmarks/compare_strategies.py --models=mlp,cnn --num_towers=1,2,4 \\
        --global_batch_size=256 --steps=50 --output_dir=DIR

writes DIR/results.json, DIR/results.md and DIR/results.png, prints the tables,
and leaves a tf.profiler trace of one towers step per tower count under
DIR/trace (with a Chrome trace, trace.json, beside each). The rows include the
floor: bare (benchmarks/bare.py), bare_loop (10 steps per call) and bare_xla.

Your own model goes in --models in the forms towers-train --model takes:

    --models=cnn,examples.my_model:small_cnn --input_shape=8,8,1 --num_classes=10
    --models=/path/to/model.keras          # its own input shape, dtype and classes

with synthetic data of the model's input shape and dtype (benchmarks/model_setup.py).
The work is in benchmarks/harness/compare.py (run_benchmark); this file only reads the flags.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow loads
# Run as a script, Python puts benchmarks/ on the path, not the project root.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

import towers  # noqa: E402
from benchmarks.harness import compare, model_setup, modes, report  # noqa: E402
from towers.cli import model_spec, models  # noqa: E402

MODELS = flags.DEFINE_list("models", ["mlp", "cnn"],
                           f"Comma-separated models to benchmark, each {model_spec.FORMS}. "
                           "Results name each as written here.")
NUM_TOWERS = flags.DEFINE_list("num_towers", ["1", "2", "4"],
                               "Comma-separated tower counts N; each mode runs on the first N "
                               "devices.")
GLOBAL_BATCH_SIZE = flags.DEFINE_integer("global_batch_size", 256,
                                         "Examples per step, split across all towers; the same "
                                         "for every mode and N.", lower_bound=1)
STEPS = flags.DEFINE_integer("steps", 50, "Timed steps per mode (after the warm-up), spread "
                             "over --rounds interleaved rounds.", lower_bound=1)
WARMUP_STEPS = flags.DEFINE_integer("warmup_steps", 5, "Untimed steps per mode before timing "
                                    "(tracing, memory allocation).", lower_bound=1)
ROUNDS = flags.DEFINE_integer("rounds", 5, "Interleaved rounds: each round times a block of "
                              "every mode in turn, so machine drift hits all modes alike.",
                              lower_bound=1)
DEVICE_TYPE = flags.DEFINE_enum("device_type", "auto", towers.devices.DEVICE_TYPES,
                                "Tower device kind; auto = GPUs if any, else logical CPU devices.")
MODES = flags.DEFINE_list("modes", list(modes.MODES),
                          f"Comma-separated modes to run, from {','.join(modes.MODES)}. plain "
                          "always runs: it is the baseline.")
INPUT_SHAPE = flags.DEFINE_list("input_shape", ["32", "32", "3"],
                                "Shape of one synthetic example: height,width,channels for the "
                                "built-in models; any shape a FUNCTION of --models takes. A "
                                ".keras file's own shape is used instead.")
NUM_CLASSES = flags.DEFINE_integer("num_classes", compare.NUM_CLASSES,
                                   "Classes of the synthetic labels (the logits' width) for the "
                                   "built-in models and FUNCTIONs; a .keras file's own output "
                                   "width is used instead.", lower_bound=2)
SEED = flags.DEFINE_integer("seed", 0, "Seed of the weights (identical in every mode) and data.")
OUTPUT_DIR = flags.DEFINE_string("output_dir", "benchmarks/results",
                                 "Where results.json, results.md and results.png go.")
TRACE_DIR = flags.DEFINE_string("trace_dir", None,
                                "Where the tf.profiler traces go; default OUTPUT_DIR/trace.")
TRACE_STEPS = flags.DEFINE_integer("trace_steps", 3, "Towers steps traced per tower count for "
                                   "the phase breakdown; 0 = no trace.", lower_bound=0)


def _positive_ints(values, count=None):
    try:
        numbers = [int(v) for v in values]
    except ValueError:
        return False
    return bool(numbers) and min(numbers) >= 1 and (count is None or len(numbers) == count)


def _model_forms(specs):
    """True when every entry has one of the forms; else model_spec's line says which does not."""
    for spec in specs:
        try:
            model_spec.form_of(spec)
        except ValueError as error:
            raise flags.ValidationError(str(error)) from None
    return bool(specs)


flags.register_validator("models", _model_forms, "must name at least one model")
flags.register_validator("num_towers", _positive_ints,
                         "must be comma-separated positive integers, e.g. 1,2,4")
flags.register_validator("modes", lambda v: bool(v) and set(v) <= set(modes.MODES),
                         f"must be a comma-separated subset of {','.join(modes.MODES)}")
flags.register_validator("input_shape", _positive_ints,
                         "must be positive integers, e.g. 32,32,3 (height,width,channels)")
flags.register_multi_flags_validator(
    ["models", "input_shape"],
    lambda f: not set(f["models"] or []) & set(models.MODELS)
    or _positive_ints(f["input_shape"] or [], count=3),
    f"--input_shape must be three positive integers, height,width,channels, for the built-in "
    f"models ({','.join(models.MODELS)})")
flags.register_multi_flags_validator(
    ["steps", "rounds"], lambda f: f["rounds"] <= f["steps"],
    "--rounds must be at most --steps (each round times at least one step)")
flags.register_multi_flags_validator(
    ["global_batch_size", "num_towers"],
    lambda f: not _positive_ints(f["num_towers"])
    or f["global_batch_size"] >= max(int(n) for n in f["num_towers"]),
    "--global_batch_size must be at least the largest --num_towers (every tower needs an example)")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    num_towers = [int(n) for n in NUM_TOWERS.value]
    tf.get_logger().setLevel("WARNING")  # MirroredStrategy logs every reduction it sets up
    try:
        devices = towers.configure_devices(max(num_towers), DEVICE_TYPE.value)  # before TF starts
    except (ValueError, towers.DeviceConfigError) as error:
        print(f"compare_strategies: error: {error}", file=sys.stderr)
        return 1
    try:
        results = compare.run_benchmark(
            MODELS.value, num_towers, GLOBAL_BATCH_SIZE.value, STEPS.value,
            warmup_steps=WARMUP_STEPS.value, rounds=ROUNDS.value, devices=devices,
            modes=MODES.value, input_shape=[int(d) for d in INPUT_SHAPE.value],
            num_classes=NUM_CLASSES.value, seed=SEED.value, output_dir=OUTPUT_DIR.value,
            trace_steps=TRACE_STEPS.value, trace_dir=TRACE_DIR.value)
    except model_setup.ModelError as error:  # checked before anything is timed
        print(f"compare_strategies: error: --models: {error}", file=sys.stderr)
        return 1
    print(report.markdown(results))
    print(f"Wrote results.json, results.md and results.png to {OUTPUT_DIR.value}")
    return 0


if __name__ == "__main__":
    app.run(main)
