"""towers-train: train a model data-parallel on tower devices from the command line.

    python -m towers.train --dataset=digits --model=cnn --num_towers=4

Rerunning the same command with --checkpoint_dir resumes from the newest
checkpoint. SIGTERM or SIGINT stops it after the running step with a checkpoint
at the exact position, one line on stderr and exit status 75. With TF_CONFIG
set, or --worker_hosts and --task_index, the process is one worker of a
cluster (docs/multi_worker.md). Its flags are defined in train_flags.py.
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
from towers.cli import train_flags as flag  # noqa: E402
from towers.multi_worker import cluster as cluster_lib  # noqa: E402
from towers.training.checkpoint import Checkpointer  # noqa: E402

# EX_TEMPFAIL (sysexits.h): stopped on request; the same command resumes.
PREEMPTED_EXIT_STATUS = 75


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
        towers.devices.size_thread_pools(flag.INTRA_OP_THREADS.value, flag.INTER_OP_THREADS.value)
    except ValueError as error:
        raise ValueError(f"--{error}") from None
    cluster = _cluster()
    _check_pipeline_flags()
    _check_model_flag()
    num_stages = flag.PIPELINE_STAGES.value
    num_parts = flag.TENSOR_PARALLEL.value
    devices = towers.configure_devices(max(flag.NUM_TOWERS.value * num_stages, num_parts),
                                       flag.DEVICE_TYPE.value)
    # Tower t runs its stages on devices[t*K:(t+1)*K], one row of the grid per tower;
    # without a pipeline, a flat list with one device per tower.
    tower_devices = devices[:flag.NUM_TOWERS.value] if num_stages == 1 else [
        devices[t * num_stages:(t + 1) * num_stages] for t in range(flag.NUM_TOWERS.value)]
    if cluster is not None:
        towers.join_cluster(cluster)
        # What decides which examples each step reads; the trainer checks the rest.
        data_flags = (flag.DATASET, flag.DATA_NPZ, flag.GLOBAL_BATCH_SIZE, flag.EPOCHS,
                      flag.STEPS, flag.SEED)
        cluster_lib.check_same(cluster, {f"--{f.name}": f.value for f in data_flags})
    is_chief = cluster is None or cluster.is_chief
    worker_index, num_workers = (0, 1) if cluster is None else (cluster.task_index,
                                                                cluster.num_workers)
    keras.utils.set_random_seed(flag.SEED.value)
    if flag.DETERMINISTIC.value:
        tf.config.experimental.enable_op_determinism()
    num_towers = flag.NUM_TOWERS.value * num_workers
    if flag.GLOBAL_BATCH_SIZE.value < num_towers:
        logging.warning("--global_batch_size=%d is smaller than the %d towers: some towers "
                        "get empty shards and idle.", flag.GLOBAL_BATCH_SIZE.value, num_towers)
    elif flag.GLOBAL_BATCH_SIZE.value < num_towers * flag.MICRO_BATCHES.value:
        logging.warning("--global_batch_size=%d gives each of the %d towers fewer examples "
                        "than --micro_batches=%d: some micro-batches are empty.",
                        flag.GLOBAL_BATCH_SIZE.value, num_towers, flag.MICRO_BATCHES.value)
    keras.mixed_precision.set_global_policy(
        "float32" if flag.MIXED_PRECISION.value == "none" else flag.MIXED_PRECISION.value)
    data = data_lib.load_data("npz" if flag.DATA_NPZ.value else flag.DATASET.value,
                              data_npz=flag.DATA_NPZ.value, seed=flag.SEED.value)
    with tf.device(devices[0]):  # the main device holds the variables
        try:
            model = model_spec.load_model(flag.MODEL.value, data.input_shape, data.num_classes,
                                          seed=flag.SEED.value)
        except ValueError as error:
            raise ValueError(f"--model: {error}") from None
    cuts = models.cuts_for_stages(model, num_stages)
    plan = _split_plan(model)
    if plan:
        model = towers.split_layers(model, plan, devices[:num_parts])
    optimizer = (keras.optimizers.Adam(flag.LEARNING_RATE.value) if flag.OPTIMIZER.value == "adam"
                 else keras.optimizers.SGD(flag.LEARNING_RATE.value, momentum=0.9))
    trainer = towers.TowerTrainer(
        model, keras.losses.SparseCategoricalCrossentropy(from_logits=True), optimizer,
        devices=tower_devices, metrics=["accuracy"], aggregation=flag.AGGREGATION.value,
        pack_gradients=flag.PACK_GRADIENTS.value, variable_placement=flag.VARIABLE_PLACEMENT.value,
        accum_steps=flag.ACCUM_STEPS.value, pipeline_cuts=cuts or None,
        steps_per_execution=flag.STEPS_PER_EXECUTION.value, jit_compile=flag.JIT_COMPILE.value,
        prefetch_to_devices={"auto": "auto", "on": True,
                             "off": False}[flag.PREFETCH_TO_DEVICES.value],
        micro_batches=flag.MICRO_BATCHES.value, pipeline_schedule=flag.PIPELINE_SCHEDULE.value,
        clip_global_norm=flag.CLIP_GLOBAL_NORM.value or None, cluster=cluster)
    checkpointer = None
    if flag.CHECKPOINT_DIR.value:
        with tf.device(devices[0]):  # the slots must exist to be restored
            trainer.optimizer.build(model.trainable_variables)
        checkpointer = Checkpointer(flag.CHECKPOINT_DIR.value, model, trainer.optimizer,
                                    every_steps=flag.CHECKPOINT_EVERY.value, writer=is_chief)
        # Restoring compares variable shapes only; this also compares which model it is.
        model_spec.claim_checkpoint_dir(flag.CHECKPOINT_DIR.value, flag.MODEL.value,
                                        writer=is_chief)

    steps_per_epoch = data_lib.steps_per_epoch(data, flag.GLOBAL_BATCH_SIZE.value)
    epochs = (math.ceil(flag.STEPS.value / steps_per_epoch) if flag.STEPS.value
              else flag.EPOCHS.value or flag.DEFAULT_EPOCHS)
    test_batches = data_lib.eval_dataset(data, flag.GLOBAL_BATCH_SIZE.value)
    history = trainer.fit(
        lambda epoch: data_lib.train_dataset(data, flag.GLOBAL_BATCH_SIZE.value, epoch,
                                             seed=flag.SEED.value, worker_index=worker_index,
                                             num_workers=num_workers),
        epochs=epochs, steps_per_epoch=steps_per_epoch, validation_data=test_batches,
        max_steps=flag.STEPS.value, checkpointer=checkpointer, log_dir=flags.FLAGS.log_dir or None)

    final = trainer.evaluate(test_batches)
    results = {
        "eval_accuracy": final["accuracy"],
        "eval_loss": final["loss"],
        "train_loss": (history.history["loss"][-1] if history.epoch  # else a finished run resumed
                       else trainer.evaluate(data_lib.train_dataset(
                           data, flag.GLOBAL_BATCH_SIZE.value, 0, seed=flag.SEED.value))["loss"]),
        "steps": trainer.step,
        "examples_per_sec": history.history["examples_per_sec"][-1] if history.epoch else 0.0,
        "num_towers": trainer.num_towers,
        "num_workers": num_workers,
        "devices": tower_devices,
        "dataset": data.name,
        "model": flag.MODEL.value,
        "global_batch_size": flag.GLOBAL_BATCH_SIZE.value,
        "aggregation": flag.AGGREGATION.value,
        "variable_placement": flag.VARIABLE_PLACEMENT.value,
        "accum_steps": flag.ACCUM_STEPS.value,
        "steps_per_execution": flag.STEPS_PER_EXECUTION.value,
        "jit_compile": flag.JIT_COMPILE.value,
        "prefetch_to_devices": trainer.prefetch_to_devices,
        "mixed_precision": flag.MIXED_PRECISION.value,
        "pipeline_stages": num_stages,
        "micro_batches": flag.MICRO_BATCHES.value,
        "pipeline_schedule": flag.PIPELINE_SCHEDULE.value,
        "pipeline_cuts": cuts,
        "tensor_parallel": num_parts,
        "split_plan": plan,
    }
    if flag.OUTPUT_JSON.value and is_chief:
        with open(flag.OUTPUT_JSON.value, "w") as f:
            json.dump(results, f, indent=2)
    return results


def _split_plan(model):
    """The op-parallel plan of --split_plan, else the built-in model's default for
    --tensor_parallel > 1; {} for none."""
    try:
        if flag.SPLIT_PLAN.value:
            return plans.parse(flag.SPLIT_PLAN.value)
        return plans.default(model, flag.MODEL.value) if flag.TENSOR_PARALLEL.value > 1 else {}
    except ValueError as error:
        name = ("split_plan" if flag.SPLIT_PLAN.value
                else f"tensor_parallel={flag.TENSOR_PARALLEL.value}")
        raise ValueError(f"--{name}: {error}") from None


def _check_pipeline_flags():
    """Refuses, before any work, flag combinations the pipeline cannot run."""
    if flag.ACCUM_STEPS.value > 1 and flag.MICRO_BATCHES.value > 1:
        raise ValueError(
            f"--accum_steps={flag.ACCUM_STEPS.value} and "
            f"--micro_batches={flag.MICRO_BATCHES.value} both "
            "split each tower's shard into micro-batches run one after another; set only one "
            "of them (--micro_batches with --pipeline_stages).")
    if flag.TENSOR_PARALLEL.value > 1 or flag.SPLIT_PLAN.value:
        for other, fix in ((flag.PIPELINE_STAGES, "pipeline stages"),
                           (flag.NUM_TOWERS, "towers (the grid of towers x parts)")):
            if other.value != 1:
                raise ValueError(f"--{other.name}={other.value} cannot be combined with split "
                                 f"layers yet: {fix} with op parallelism is the next part of "
                                 f"issue 18; use --{other.name}=1.")
    if flag.PIPELINE_STAGES.value == 1:
        return
    if flag.VARIABLE_PLACEMENT.value == "replicated":
        raise ValueError(
            f"--pipeline_stages={flag.PIPELINE_STAGES.value} cannot be combined with "
            "--variable_placement=replicated: each stage's variables live on one device, "
            "which all towers read; use --variable_placement=main.")


def _check_model_flag():
    """Refuses, before any work, a --model of none of the three forms."""
    try:
        model_spec.form_of(flag.MODEL.value)
    except ValueError as error:
        raise ValueError(f"--model: {error}") from None


def _cluster():
    """The Cluster from --worker_hosts/--task_index, else from TF_CONFIG; None for one process."""
    timeouts = {"peer_timeout_s": flag.PEER_TIMEOUT_S.value,
                "startup_timeout_s": flag.STARTUP_TIMEOUT_S.value}
    if flag.WORKER_HOSTS.value is None:
        if flag.TASK_INDEX.value is not None:
            raise ValueError("--task_index needs --worker_hosts (or use TF_CONFIG alone).")
        return towers.cluster_from_tf_config(**timeouts)
    if flag.TASK_INDEX.value is None:
        raise ValueError("--worker_hosts needs --task_index: this worker's position in it, "
                         "0 for the chief.")
    return towers.Cluster(tuple(flag.WORKER_HOSTS.value), flag.TASK_INDEX.value, **timeouts)


def run():
    """Entry point of the towers-train console script."""
    app.run(main)


if __name__ == "__main__":
    run()
