"""towers-train: train a model data-parallel on tower devices from the command line.

    python -m towers.train --dataset=digits --model=cnn --num_towers=4

Rerunning the same command with --checkpoint_dir resumes from the newest
checkpoint. SIGTERM or SIGINT stops it after the running step with a checkpoint
at the exact position, one line on stderr and exit status 75. With TF_CONFIG
set, or --worker_hosts and --task_index, the process is one worker of a
cluster (docs/multi_worker.md). This is the only module of towers that defines flags.
"""

import json
import math
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow loads

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags, logging  # noqa: E402

import towers  # noqa: E402
from towers.cli import data as data_lib, model_spec, models, plans  # noqa: E402
from towers.data_parallel import exchange, replicas  # noqa: E402
from towers.model_parallel import schedule  # noqa: E402
from towers.multi_worker import cluster as cluster_lib  # noqa: E402
from towers.training.checkpoint import Checkpointer  # noqa: E402

# EX_TEMPFAIL (sysexits.h): stopped on request; the same command resumes.
PREEMPTED_EXIT_STATUS = 75
DEFAULT_EPOCHS = 10
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
NUM_TOWERS = flags.DEFINE_integer("num_towers", 4, "Number of towers (devices) on this worker.",
                                  lower_bound=1)
DEVICE_TYPE = flags.DEFINE_enum("device_type", "auto", towers.devices.DEVICE_TYPES,
                                "Tower device kind; auto = GPUs if any, else CPU devices.")
GLOBAL_BATCH_SIZE = flags.DEFINE_integer("global_batch_size", 64,
                                         "Examples per step, split across all workers and "
                                         "their towers.", lower_bound=1)
EPOCHS = flags.DEFINE_integer("epochs", None,
                              f"Epochs to train (default {DEFAULT_EPOCHS}); not with --steps.",
                              lower_bound=1)
STEPS = flags.DEFINE_integer("steps", None, "Optimizer steps to train; not with --epochs.",
                             lower_bound=1)
OPTIMIZER = flags.DEFINE_enum("optimizer", "adam", OPTIMIZERS, "Optimizer.")
LEARNING_RATE = flags.DEFINE_float("learning_rate", 2e-3, "Learning rate.", lower_bound=0.0)
AGGREGATION = flags.DEFINE_enum("aggregation", "main", exchange.AGGREGATIONS,
                                "How tower gradients meet: gathered on the main device, "
                                "pairwise tree, collective all-reduce, or NCCL (GPUs).")
PACK_GRADIENTS = flags.DEFINE_bool("pack_gradients", False,
                                   "Exchange each tower's gradients as one flat buffer.")
VARIABLE_PLACEMENT = flags.DEFINE_enum("variable_placement", "main",
                                       replicas.VARIABLE_PLACEMENTS,
                                       "One copy of the variables on the main device, or a "
                                       "copy on every tower, written from the main values "
                                       "at the start of each step.")
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
TENSOR_PARALLEL = flags.DEFINE_integer(
    "tensor_parallel", 1, "Op parallelism: parts each split layer is cut into, one device each "
    "(docs/op_parallel.md); with the built-in mlp and text a default plan, else --split_plan. "
    "The run uses --num_towers x this many devices: tower t runs part j on device t*T + j.",
    lower_bound=1)
SPLIT_PLAN = flags.DEFINE_list(
    "split_plan", None, "Op parallelism: LAYER:KIND,... with KIND column or row (Dense), vocab "
    "(Embedding), heads (MultiHeadAttention) or a part index (the whole layer on that part's "
    "device).")
MIXED_PRECISION = flags.DEFINE_enum("mixed_precision", "none", MIXED_PRECISION_POLICIES,
                                    "Keras dtype policy; mixed_float16 adds dynamic loss "
                                    "scaling shared by all towers.")
CLIP_GLOBAL_NORM = flags.DEFINE_float("clip_global_norm", None,
                                      "Clip the averaged gradient to this global norm.",
                                      lower_bound=0.0)
CHECKPOINT_DIR = flags.DEFINE_string("checkpoint_dir", None,
                                     "Where checkpoints go; a rerun resumes from the newest.")
CHECKPOINT_EVERY = flags.DEFINE_integer(
    "checkpoint_every", 100, "Save a checkpoint every this many steps (and at the end).",
    lower_bound=1)
# absl.logging already defines --log_dir, for log files it writes only when asked to; the
# command-line contract names it as the TensorBoard directory, so it is shared, with our help.
flags.FLAGS["log_dir"].help = "Where TensorBoard summaries go."
OUTPUT_JSON = flags.DEFINE_string("output_json", None, "Write the final metrics here as JSON.")
SEED = flags.DEFINE_integer("seed", 0, "Seed for weights, data order and dropout.")
DETERMINISTIC = flags.DEFINE_bool("deterministic", False,
                                  "Also make TensorFlow's ops deterministic, so two runs of the "
                                  "same command give identical weights.")
INTRA_OP_THREADS = flags.DEFINE_integer(
    "intra_op_threads", 0,
    "Threads TensorFlow may use inside one op (a matmul, a convolution); 0 = TensorFlow's "
    "choice (about one per core). Logical CPU devices (towers or stages carved out of one "
    "CPU) all share this one process-wide pool, so more devices do not bring more threads.",
    lower_bound=0)
INTER_OP_THREADS = flags.DEFINE_integer(
    "inter_op_threads", 0,
    "Ops TensorFlow may run at the same time; 0 = TensorFlow's choice (about one per core). "
    "The process has one such pool for all logical CPU devices, so it bounds how many "
    "towers' and stages' ops overlap.", lower_bound=0)
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
flags.mark_flags_as_mutual_exclusive(["epochs", "steps"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    try:
        results = train()
    except (ValueError, ImportError, towers.DeviceConfigError, towers.NonFiniteError,
            towers.WorkerLostError) as error:
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
    try:  # before anything starts TensorFlow's runtime, which fixes them
        towers.devices.size_thread_pools(INTRA_OP_THREADS.value, INTER_OP_THREADS.value)
    except ValueError as error:
        raise ValueError(f"--{error}") from None
    cluster = _cluster()
    _check_pipeline_flags()
    _check_model_flag()
    num_stages = PIPELINE_STAGES.value
    num_parts = TENSOR_PARALLEL.value
    width = max(num_stages, num_parts)  # devices per tower: one per stage, or per part
    devices = towers.configure_devices(NUM_TOWERS.value * width, DEVICE_TYPE.value)
    # Tower t runs its stages or parts on devices[t*W:(t+1)*W], one row of the grid per
    # tower; with neither, a flat list with one device per tower.
    tower_devices = devices[:NUM_TOWERS.value] if width == 1 else [
        devices[t * width:(t + 1) * width] for t in range(NUM_TOWERS.value)]
    if cluster is not None:
        towers.join_cluster(cluster)
        # What decides which examples each step reads; the trainer checks the rest.
        data_flags = (DATASET, DATA_NPZ, GLOBAL_BATCH_SIZE, EPOCHS,
                      STEPS, SEED)
        cluster_lib.check_same(cluster, {f"--{f.name}": f.value for f in data_flags})
    is_chief = cluster is None or cluster.is_chief
    worker_index, num_workers = (0, 1) if cluster is None else (cluster.task_index,
                                                                cluster.num_workers)
    keras.utils.set_random_seed(SEED.value)
    if DETERMINISTIC.value:
        tf.config.experimental.enable_op_determinism()
    num_towers = NUM_TOWERS.value * num_workers
    if GLOBAL_BATCH_SIZE.value < num_towers:
        logging.warning("--global_batch_size=%d is smaller than the %d towers: some towers "
                        "get empty shards and idle.", GLOBAL_BATCH_SIZE.value, num_towers)
    elif GLOBAL_BATCH_SIZE.value < num_towers * MICRO_BATCHES.value:
        logging.warning("--global_batch_size=%d gives each of the %d towers fewer examples "
                        "than --micro_batches=%d: some micro-batches are empty.",
                        GLOBAL_BATCH_SIZE.value, num_towers, MICRO_BATCHES.value)
    keras.mixed_precision.set_global_policy(
        "float32" if MIXED_PRECISION.value == "none" else MIXED_PRECISION.value)
    data = data_lib.load_data("npz" if DATA_NPZ.value else DATASET.value,
                              data_npz=DATA_NPZ.value, seed=SEED.value)
    with tf.device(devices[0]):  # the main device holds the variables
        try:
            model = model_spec.load_model(MODEL.value, data.input_shape, data.num_classes,
                                          seed=SEED.value)
        except ValueError as error:
            raise ValueError(f"--model: {error}") from None
    cuts = models.cuts_for_stages(model, num_stages)
    plan = _split_plan(model)
    if plan:
        model = towers.split_layers(model, plan, devices[:num_parts])
    optimizer = (keras.optimizers.Adam(LEARNING_RATE.value) if OPTIMIZER.value == "adam"
                 else keras.optimizers.SGD(LEARNING_RATE.value, momentum=0.9))
    trainer = towers.TowerTrainer(
        model, keras.losses.SparseCategoricalCrossentropy(from_logits=True), optimizer,
        devices=tower_devices, metrics=["accuracy"], aggregation=AGGREGATION.value,
        pack_gradients=PACK_GRADIENTS.value, variable_placement=VARIABLE_PLACEMENT.value,
        accum_steps=ACCUM_STEPS.value, pipeline_cuts=cuts or None,
        steps_per_execution=STEPS_PER_EXECUTION.value, jit_compile=JIT_COMPILE.value,
        prefetch_to_devices={"auto": "auto", "on": True,
                             "off": False}[PREFETCH_TO_DEVICES.value],
        micro_batches=MICRO_BATCHES.value, pipeline_schedule=PIPELINE_SCHEDULE.value,
        clip_global_norm=CLIP_GLOBAL_NORM.value or None, cluster=cluster)
    checkpointer = None
    if CHECKPOINT_DIR.value:
        with tf.device(devices[0]):  # the slots must exist to be restored
            trainer.optimizer.build(model.trainable_variables)
        checkpointer = Checkpointer(CHECKPOINT_DIR.value, model, trainer.optimizer,
                                    every_steps=CHECKPOINT_EVERY.value, writer=is_chief)
        # Restoring compares variable shapes only; this also compares which model it is.
        model_spec.claim_checkpoint_dir(CHECKPOINT_DIR.value, MODEL.value,
                                        writer=is_chief)

    steps_per_epoch = data_lib.steps_per_epoch(data, GLOBAL_BATCH_SIZE.value)
    epochs = (math.ceil(STEPS.value / steps_per_epoch) if STEPS.value
              else EPOCHS.value or DEFAULT_EPOCHS)
    test_batches = data_lib.eval_dataset(data, GLOBAL_BATCH_SIZE.value)
    history = trainer.fit(
        lambda epoch: data_lib.train_dataset(data, GLOBAL_BATCH_SIZE.value, epoch,
                                             seed=SEED.value, worker_index=worker_index,
                                             num_workers=num_workers),
        epochs=epochs, steps_per_epoch=steps_per_epoch, validation_data=test_batches,
        max_steps=STEPS.value, checkpointer=checkpointer, log_dir=flags.FLAGS.log_dir or None)

    final = trainer.evaluate(test_batches)
    results = {
        "eval_accuracy": final["accuracy"],
        "eval_loss": final["loss"],
        "train_loss": (history.history["loss"][-1] if history.epoch  # else a finished run resumed
                       else trainer.evaluate(data_lib.train_dataset(
                           data, GLOBAL_BATCH_SIZE.value, 0, seed=SEED.value))["loss"]),
        "steps": trainer.step,
        "examples_per_sec": history.history["examples_per_sec"][-1] if history.epoch else 0.0,
        "num_towers": trainer.num_towers,
        "num_workers": num_workers,
        "devices": tower_devices,
        "dataset": data.name,
        "model": MODEL.value,
        "global_batch_size": GLOBAL_BATCH_SIZE.value,
        "aggregation": AGGREGATION.value,
        "variable_placement": VARIABLE_PLACEMENT.value,
        "accum_steps": ACCUM_STEPS.value,
        "steps_per_execution": STEPS_PER_EXECUTION.value,
        "jit_compile": JIT_COMPILE.value,
        "prefetch_to_devices": trainer.prefetch_to_devices,
        "mixed_precision": MIXED_PRECISION.value,
        "pipeline_stages": num_stages,
        "micro_batches": MICRO_BATCHES.value,
        "pipeline_schedule": PIPELINE_SCHEDULE.value,
        "pipeline_cuts": cuts,
        "tensor_parallel": num_parts,
        "split_plan": plan,
    }
    if OUTPUT_JSON.value and is_chief:
        with open(OUTPUT_JSON.value, "w") as f:
            json.dump(results, f, indent=2)
    return results


def _split_plan(model):
    """The op-parallel plan of --split_plan, else the built-in model's default for
    --tensor_parallel > 1; {} for none."""
    try:
        if SPLIT_PLAN.value:
            return plans.parse(SPLIT_PLAN.value)
        return plans.default(model, MODEL.value) if TENSOR_PARALLEL.value > 1 else {}
    except ValueError as error:
        name = ("split_plan" if SPLIT_PLAN.value
                else f"tensor_parallel={TENSOR_PARALLEL.value}")
        raise ValueError(f"--{name}: {error}") from None


def _check_pipeline_flags():
    """Refuses, before any work, flag combinations the pipeline cannot run."""
    if ACCUM_STEPS.value > 1 and MICRO_BATCHES.value > 1:
        raise ValueError(
            f"--accum_steps={ACCUM_STEPS.value} and "
            f"--micro_batches={MICRO_BATCHES.value} both "
            "split each tower's shard into micro-batches run one after another; set only one "
            "of them (--micro_batches with --pipeline_stages).")
    if (TENSOR_PARALLEL.value > 1 or SPLIT_PLAN.value) and PIPELINE_STAGES.value != 1:
        raise ValueError(f"--pipeline_stages={PIPELINE_STAGES.value} cannot be combined with "
                         "split layers yet (a grid of towers x stages x parts); use "
                         "--pipeline_stages=1 or no split.")
    if PIPELINE_STAGES.value == 1:
        return
    if VARIABLE_PLACEMENT.value == "replicated":
        raise ValueError(
            f"--pipeline_stages={PIPELINE_STAGES.value} cannot be combined with "
            "--variable_placement=replicated: each stage's variables live on one device, "
            "which all towers read; use --variable_placement=main.")


def _check_model_flag():
    """Refuses, before any work, a --model of none of the three forms."""
    try:
        model_spec.form_of(MODEL.value)
    except ValueError as error:
        raise ValueError(f"--model: {error}") from None


def _cluster():
    """The Cluster from --worker_hosts/--task_index, else from TF_CONFIG; None for one process."""
    timeouts = {"peer_timeout_s": PEER_TIMEOUT_S.value,
                "startup_timeout_s": STARTUP_TIMEOUT_S.value}
    if WORKER_HOSTS.value is None:
        if TASK_INDEX.value is not None:
            raise ValueError("--task_index needs --worker_hosts (or use TF_CONFIG alone).")
        return towers.cluster_from_tf_config(**timeouts)
    if TASK_INDEX.value is None:
        raise ValueError("--worker_hosts needs --task_index: this worker's position in it, "
                         "0 for the chief.")
    return towers.Cluster(tuple(WORKER_HOSTS.value), TASK_INDEX.value, **timeouts)


def run():
    """Entry point of the towers-train console script."""
    app.run(main)


if __name__ == "__main__":
    run()
