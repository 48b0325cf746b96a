"""towers-train: train a model data-parallel on tower devices from the command line.

    python -m towers.train --dataset=digits --model=cnn --num_towers=4

Rerunning the same command with --checkpoint_dir resumes from the newest
checkpoint. SIGTERM or SIGINT stops it after the running step with a checkpoint
at the exact position, one line on stderr and exit status 75. With TF_CONFIG
set, or --worker_hosts and --task_index, the process is one worker of a
cluster (docs/multi_worker.md).
"""
# The docstring above is the usage text --help prints. This is the only module of towers
# that defines flags; it reads them into a cli.job.Job, and job.run does the work.

import math
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow loads

from absl import app, flags  # noqa: E402

import towers  # noqa: E402
from towers.cli import data as data_lib, job as job_lib, model_spec  # noqa: E402
from towers.data_parallel import exchange, replicas  # noqa: E402
from towers.model_parallel import schedule  # noqa: E402
from towers.multi_worker import cluster as cluster_lib  # noqa: E402

# EX_TEMPFAIL (sysexits.h): stopped on request; the same command resumes.
PREEMPTED_EXIT_STATUS = 75
OPTIMIZERS = ("adam", "sgd")
MIXED_PRECISION_POLICIES = ("none", "mixed_float16", "mixed_bfloat16")

DATASET = flags.DEFINE_enum("dataset", "digits", data_lib.DATASETS,
                            "Training data: the 8x8 digits scikit-learn ships (offline), random "
                            "synthetic images, or a keras.datasets set.")
DATA_NPZ = flags.DEFINE_string("data_npz", None,
                               "Your own .npz with x_train, y_train and optionally x_test, "
                               "y_test (without them a fixed, stratified 10% of the training "
                               "examples is held out for evaluation); overrides --dataset.")
MODEL = flags.DEFINE_string("model", "cnn",
                            f"Which model to train, one of three forms: {model_spec.FORMS}. "
                            "PACKAGE.MODULE is imported from the current directory, e.g. "
                            "--model=examples.my_model:small_cnn.")
# Upper bounds of counts that TensorFlow would take without a word and then spend minutes
# on, or hang: devices are made and a step traced once per tower; a thread per unit.
MAX_TOWERS = 256
MAX_THREADS = 1024
NUM_TOWERS = flags.DEFINE_integer("num_towers", 4, "Number of towers (devices) on this worker "
                                  f"(at most {MAX_TOWERS}).", lower_bound=1,
                                  upper_bound=MAX_TOWERS)
DEVICE_TYPE = flags.DEFINE_enum("device_type", "auto", towers.devices.DEVICE_TYPES,
                                "Tower device kind; auto = GPUs if any, else CPU devices.")
GLOBAL_BATCH_SIZE = flags.DEFINE_integer("global_batch_size", 64,
                                         "Examples per step, split across all workers and "
                                         "their towers.", lower_bound=1)
EPOCHS = flags.DEFINE_integer("epochs", None,
                              f"Epochs to train (default {job_lib.DEFAULT_EPOCHS}); not with --steps.",
                              lower_bound=1)
STEPS = flags.DEFINE_integer("steps", None, "Optimizer steps to train; not with --epochs.",
                             lower_bound=1)
OPTIMIZER = flags.DEFINE_enum("optimizer", "adam", OPTIMIZERS, "Optimizer.")
LEARNING_RATE = flags.DEFINE_float("learning_rate", 2e-3, "Learning rate (finite, >= 0).",
                                   lower_bound=0.0)
AGGREGATION = flags.DEFINE_enum("aggregation", "main", exchange.AGGREGATIONS,
                                "How tower gradients meet: gathered on the main device, "
                                "pairwise tree, collective all-reduce, or NCCL (GPUs).")
PACK_GRADIENTS = flags.DEFINE_bool("pack_gradients", False,
                                   "Exchange each tower's gradients as one flat buffer.")
VARIABLE_PLACEMENT = flags.DEFINE_enum("variable_placement", "main",
                                       replicas.VARIABLE_PLACEMENTS,
                                       "One copy of the variables on the main device "
                                       "(main), a copy on every tower written from the main "
                                       "values at the start of each step (replicated), or "
                                       "each variable and its optimizer slots on one tower, "
                                       "each tower filled to 1/N of the bytes, a variable "
                                       "across a tower's end held as slabs of rows (spread).")
STEPS_PER_EXECUTION = flags.DEFINE_integer(
    "steps_per_execution", 1,
    "Training steps per call of one compiled function (an in-graph loop, no Python "
    "between them); logs, progress, callbacks and checkpoints then happen once per call.",
    lower_bound=1)
JIT_COMPILE = flags.DEFINE_bool(
    "jit_compile", False,
    "Compile each tower's forward and backward with XLA, one computation on its device "
    "(with --pipeline_stages > 1: each stage's, per micro-batch).")
PREFETCH_TO_DEVICES = flags.DEFINE_enum(
    "prefetch_to_devices", "auto", ["auto", "on", "off"],
    "on: split each batch in the input pipeline and copy every tower's shard to its device "
    "while the previous step runs; off: split inside the step; auto: on for GPU towers.")
ACCUM_STEPS = flags.DEFINE_integer("accum_steps", 1,
                                   "Micro-batches each tower runs one after another per step "
                                   "(gradient accumulation: less memory, same result).",
                                   lower_bound=1)
PIPELINE_STAGES = flags.DEFINE_integer(
    "pipeline_stages", 1,
    "Pipeline stages each tower's model is cut into, each on its own device (model "
    "parallelism): the run uses --num_towers x this many devices. The built-in model is cut "
    "into stages of about equal estimated compute; 1 = no pipeline.", lower_bound=1)
MICRO_BATCHES = flags.DEFINE_integer(
    "micro_batches", 1,
    "Micro-batches each tower's shard is split into, so the pipeline stages work on "
    "different micro-batches at once; with --pipeline_stages=1 it is gradient "
    "accumulation, like --accum_steps (set one of the two).", lower_bound=1)
PIPELINE_SCHEDULE = flags.DEFINE_enum(
    "pipeline_schedule", "gpipe", schedule.SCHEDULES,
    "Order of each stage's forwards and backwards: gpipe (all forwards, then all "
    "backwards) or 1f1b (alternating, fewer micro-batches' activations alive at once); "
    "the same weights either way.")
RECOMPUTE = flags.DEFINE_list(
    "recompute", None,
    "Activations recomputed in the backward instead of kept from the forward: 'stages' "
    "(each pipeline stage's forward rerun per micro-batch, only the stages' inputs kept; "
    "with --pipeline_stages=1 the whole model) or LAYER,... (layer names or paths, shell "
    "wildcards allowed). The same weights, less activation memory, one more forward.")
BATCH_STATISTICS = flags.DEFINE_enum(
    "batch_statistics", "per_tower", ("per_tower", "global"),
    "BatchNormalization's mean and variance in training: per_tower (each tower's shard, "
    "as MirroredStrategy) or global (the global batch's, met across the towers: the same "
    "weights as one device).")
NUM_PARTS = flags.DEFINE_integer(
    "num_parts", 1, "Op parallelism: the parts of each split layer, one device each "
    "(docs/op_parallel.md); with the built-in mlp and text a default plan, else --split_plan. "
    "The run uses --num_towers x this many devices: tower t runs part j on device t*T + j.",
    lower_bound=1)
SPLIT_PLAN = flags.DEFINE_list(
    "split_plan", None, "Op parallelism: LAYER:KIND,... with KIND column or row (Dense), vocab "
    "(Embedding), heads (MultiHeadAttention) or a part index (the whole layer on that part's "
    "device). An EinsumDense may be split along another letter of its equation: "
    "PATH:column:LETTER (output-only) or PATH:row:LETTER (contracted), e.g. "
    "'*/self_attention/attention_output:row:u'. Or auto: Megatron's plan for a transformer "
    "(towers.auto_plan: token embedding by vocab, attention by heads, feed-forward pairs "
    "column then row, an untied LM head by column), logged one line per rule.")
MIXED_PRECISION = flags.DEFINE_enum("mixed_precision", "none", MIXED_PRECISION_POLICIES,
                                    "Keras dtype policy; mixed_float16 adds dynamic loss "
                                    "scaling shared by all towers.")
CLIP_GLOBAL_NORM = flags.DEFINE_float("clip_global_norm", None,
                                      "Clip the averaged gradient to this global norm (> 0); "
                                      "without the flag, no clipping.", lower_bound=0.0)
CHECKPOINT_DIR = flags.DEFINE_string("checkpoint_dir", None,
                                     "Where checkpoints go; a rerun resumes from the newest.")
CHECKPOINT_EVERY = flags.DEFINE_integer(
    "checkpoint_every", 100, "Save a checkpoint every this many steps (and at the end).",
    lower_bound=1)
# absl.logging already defines --log_dir, for log files it writes only when asked to; the
# command-line contract names it as the TensorBoard directory, so it is shared, with our help.
flags.FLAGS["log_dir"].help = "Where TensorBoard summaries go."
flags.declare_key_flag("log_dir")  # listed by --help with the flags defined here
OUTPUT_JSON = flags.DEFINE_string("output_json", None, "Write the final metrics here as JSON.")
SEED = flags.DEFINE_integer("seed", 0, "Seed for weights, data order and dropout.",
                            lower_bound=0, upper_bound=2**32 - 1)  # what Keras's seed takes
DETERMINISTIC = flags.DEFINE_bool("deterministic", False,
                                  "Also make TensorFlow's ops deterministic, so two runs of the "
                                  "same command give identical weights.")
INTRA_OP_THREADS = flags.DEFINE_integer(
    "intra_op_threads", 0,
    "Threads TensorFlow may use inside one op (a matmul, a convolution); 0 = TensorFlow's "
    "choice (about one per core). Logical CPU devices (towers or stages carved out of one "
    "CPU) all share this one process-wide pool, so more devices do not bring more threads.",
    lower_bound=0, upper_bound=MAX_THREADS)
INTER_OP_THREADS = flags.DEFINE_integer(
    "inter_op_threads", 0,
    "Ops TensorFlow may run at the same time; 0 = TensorFlow's choice (about one per core). "
    "The process has one such pool for all logical CPU devices, so it bounds how many "
    "towers' and stages' ops overlap.", lower_bound=0, upper_bound=MAX_THREADS)
WORKER_HOSTS = flags.DEFINE_list("worker_hosts", None,
                                 "host:port of every worker, the chief first; builds the "
                                 "cluster instead of TF_CONFIG. Needs --task_index.")
TASK_INDEX = flags.DEFINE_integer("task_index", None,
                                  "This worker's position in --worker_hosts (0 = chief).",
                                  lower_bound=0)
PEER_TIMEOUT_S = flags.DEFINE_float("peer_timeout_s", cluster_lib.DEFAULT_PEER_TIMEOUT_S,
                                    "A worker that does not answer for this many seconds "
                                    "during a step stops every worker with an error.",
                                    lower_bound=1.0)
STARTUP_TIMEOUT_S = flags.DEFINE_float("startup_timeout_s",
                                       cluster_lib.DEFAULT_STARTUP_TIMEOUT_S,
                                       "How long each worker waits for all the others to start.",
                                       lower_bound=1.0)
STEP_TIMEOUT_S = flags.DEFINE_float("step_timeout_s", cluster_lib.DEFAULT_STEP_TIMEOUT_S,
                                    "A call of the step (the first one's tracing included) "
                                    "that no worker finishes for this many seconds stops every "
                                    "worker with an error.", lower_bound=1.0)
flags.mark_flags_as_mutual_exclusive(["epochs", "steps"])
flags.register_validator("learning_rate", math.isfinite,
                         "the learning rate must be a finite number (not nan or inf)")
flags.register_validator("clip_global_norm", lambda norm: norm is None or norm > 0,
                         "a global norm of 0 would clip every gradient to zero; give a norm "
                         "> 0, or leave the flag out for no clipping")
for _path_flag in ("checkpoint_dir", "output_json"):
    flags.register_validator(_path_flag, lambda path: path is None or path.strip() != "",
                             "an empty path; give one, or leave the flag out to write none")
flags.register_validator(
    "recompute", lambda names: not names or "stages" not in names or len(names) == 1,
    "'stages' recomputes every stage's whole forward and stands alone; give either "
    "--recompute=stages or layer names")
flags.register_multi_flags_validator(
    ["split_plan", "num_parts", "pipeline_stages"],
    lambda values: not values["split_plan"] or values["num_parts"] > 1
    or values["pipeline_stages"] > 1,  # that one's line names --pipeline_stages (cli/job.py)
    "--split_plan splits layers into --num_parts=T parts (alias --tensor_parallel), one "
    "device each; give --num_parts=2 or more, or leave --split_plan out")


def _define_alias(name, original):
    """flags.DEFINE_alias, except that a value absl refuses is named as typed: absl's line
    names the original flag, which the user may not have typed."""
    flags.DEFINE_alias(name, original)
    alias = flags.FLAGS[name]
    parse = alias.parse

    def parse_as_typed(argument):
        try:
            parse(argument)
        except flags.IllegalFlagValueError as error:
            raise flags.IllegalFlagValueError(
                str(error).replace(f"--{original}=", f"--{name}=", 1)) from None

    alias.parse = parse_as_typed


_define_alias(job_lib.NUM_PARTS_ALIAS, "num_parts")


def main(argv):
    if len(argv) > 1:  # one line, as for a bad flag (absl's UsageError prints all the help)
        print(f"towers-train: error: unexpected arguments {' '.join(argv[1:])!r}: every "
              "setting is a flag, e.g. --steps=100; towers-train --help lists them.",
              file=sys.stderr)
        return 1
    try:
        results = train()
    except (ValueError, ImportError, towers.DeviceConfigError, towers.NonFiniteError,
            towers.WorkerLostError, towers.CheckpointWriteError) as error:
        print(f"towers-train: error: {error}", file=sys.stderr)
        return 1
    except towers.Preempted as stopped:
        print(f"towers-train: {stopped}", file=sys.stderr)
        return PREEMPTED_EXIT_STATUS
    stages = results["pipeline_stages"]
    print(f"test accuracy {results['eval_accuracy']:.4f} (loss {results['eval_loss']:.4f}) "
          f"after {results['steps']} steps on {results['num_towers']} tower"
          f"{'s' if results['num_towers'] != 1 else ''}"
          f"{f' x {stages} pipeline stages' if stages > 1 else ''}, "
          f"{results['examples_per_sec']:.0f} examples/sec")
    return 0


def train():
    """Runs the whole job described by the flags; returns the final metrics."""
    return job_lib.run(job_lib.Job(**{name: flags.FLAGS[name].value
                                      for name in job_lib.Job.field_names()}))


def run():
    """Entry point of the towers-train console script and of `python -m towers.train`."""
    _help_describes_this_module()
    _help_flags_exit_0()
    app.run(main)


def _help_describes_this_module():
    """Makes --help and --helpshort print this module's docstring and key flags.

    absl's short help prints __main__'s docstring and the key flags of the module named by
    sys.argv[0]; in both ways of starting the program that module is a shim which only calls
    run() (towers/train.py, or the script pip writes for towers-train).
    """
    for flag in flags.FLAGS.get_key_flags_for_module(__name__):
        flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)
    sys.modules["__main__"].__doc__ = __doc__


class _ExitsZeroAfterHelp:
    """For absl's help flag classes, which print the help and exit with status 1."""

    def parse(self, argument):
        try:
            super().parse(argument)
        except SystemExit:  # raised only once the help is printed
            raise SystemExit(0) from None


def _help_flags_exit_0():
    """Replaces absl's --help, --helpshort and --helpfull with ones that exit 0.

    Asking for help is a success: scripts and package checks run `towers-train --help` to
    see that it is installed. app.run defines absl's own only if they are not there yet.
    """
    app.define_help_flags()
    for absl_class in (app.HelpFlag, app.HelpshortFlag, app.HelpfullFlag):
        help_flag = type(absl_class.__name__, (_ExitsZeroAfterHelp, absl_class), {})()
        help_flag.allow_override = True  # takes absl's flag's names, --help and -?
        flags.DEFINE_flag(help_flag, module_name=app.__name__)


if __name__ == "__main__":
    run()
