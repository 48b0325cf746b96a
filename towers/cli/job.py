"""The job towers-train runs, from plain values: the data, the model (split or cut
as asked), the trainer, fit, evaluation and the final metrics.

cli/train.py reads the flags into a Job; nothing here reads a flag, so a job can
be run (and tested) without parsing any. Error messages name the flags, as the
command line's user knows them.
"""

import dataclasses
import json
import math
import os
import tempfile
from typing import Optional

import keras
import tensorflow as tf
from absl import logging

import towers
from towers.cli import data as data_lib, model_spec, models, plans
from towers.multi_worker import cluster as cluster_lib
from towers.training.checkpoint import Checkpointer

DEFAULT_EPOCHS = 10
# --num_parts's name before issue 35's glossary, kept as its alias for a release
# (cli/train.py); the refusals that name --num_parts name it too.
NUM_PARTS_ALIAS = "tensor_parallel"
# The flags each worker of a cluster may set for itself: where it writes, its own towers
# and threads, how long it waits, its place in the cluster (whose addresses join checks).
# Every other flag shapes the data or the step, and the workers must agree on it.
PER_WORKER_FLAGS = ("num_towers", "intra_op_threads", "inter_op_threads", "checkpoint_dir",
                    "log_dir", "output_json", "worker_hosts", "task_index", "peer_timeout_s",
                    "startup_timeout_s", "step_timeout_s")


@dataclasses.dataclass(frozen=True)
class Job:
    """What towers-train was asked to do: one field per flag, named as the flag, with the
    flag's value (docs/api.md section 8 says what each means)."""
    # The data and the model.
    dataset: str
    data_npz: Optional[str]
    model: str
    seed: int
    deterministic: bool
    mixed_precision: str
    # How long, how fast.
    global_batch_size: int
    epochs: Optional[int]
    steps: Optional[int]
    optimizer: str
    learning_rate: float
    clip_global_norm: Optional[float]
    # The devices and the step.
    num_towers: int
    device_type: str
    aggregation: str
    pack_gradients: bool
    variable_placement: str
    accum_steps: int
    steps_per_execution: int
    jit_compile: bool
    prefetch_to_devices: str
    intra_op_threads: int
    inter_op_threads: int
    # Pipeline stages and split layers.
    pipeline_stages: int
    micro_batches: int
    pipeline_schedule: str
    recompute: Optional[list]
    batch_statistics: str
    num_parts: int
    split_plan: Optional[list]
    # What is written.
    checkpoint_dir: Optional[str]
    checkpoint_every: int
    log_dir: Optional[str]
    output_json: Optional[str]
    # Several workers.
    worker_hosts: Optional[list]
    task_index: Optional[int]
    peer_timeout_s: float
    startup_timeout_s: float
    step_timeout_s: float

    @classmethod
    def field_names(cls):
        return [field.name for field in dataclasses.fields(cls)]


def _recompute(names):
    """--recompute's value as TowerTrainer takes it: False, "stages" or layer names."""
    if not names:
        return False
    return "stages" if list(names) == ["stages"] else list(names)


def run(job):
    """Runs the whole `job` (a Job); returns the final metrics."""
    try:  # before anything starts TensorFlow's runtime, which fixes them
        towers.devices.size_thread_pools(job.intra_op_threads, job.inter_op_threads)
    except ValueError as error:
        raise ValueError(f"--{error}") from None
    cluster = _cluster(job)
    _check_pipeline_flags(job)
    _check_model_flag(job)
    if cluster is None or cluster.is_chief:  # the chief writes these
        if job.output_json:
            _check_output_json(job.output_json)
        if job.log_dir:
            _check_log_dir(job.log_dir)
    num_stages = job.pipeline_stages
    num_parts = job.num_parts
    width = num_stages * num_parts  # devices per tower: one per part of each stage
    devices = towers.configure_devices(job.num_towers * width, job.device_type)
    # Tower t runs on devices[t*W:(t+1)*W]: a row of stages or of parts, or with both
    # one row of parts per stage (stage k's part j on t*W + k*T + j); with neither, a
    # flat list with one device per tower.
    tower_devices = [devices[t * width:(t + 1) * width] for t in range(job.num_towers)]
    if width == 1:
        tower_devices = devices[:job.num_towers]
    elif num_stages > 1 and num_parts > 1:
        tower_devices = [[row[k * num_parts:(k + 1) * num_parts] for k in range(num_stages)]
                         for row in tower_devices]
    if cluster is not None:
        towers.join_cluster(cluster)
        # Before any step: workers whose steps differ in shape would wait on each other's
        # collectives for ever.
        cluster_lib.check_same(cluster, {f"--{name}": value for name, value in
                                         dataclasses.asdict(job).items()
                                         if name not in PER_WORKER_FLAGS})
    is_chief = cluster is None or cluster.is_chief
    worker_index, num_workers = (0, 1) if cluster is None else (cluster.task_index,
                                                                cluster.num_workers)
    keras.utils.set_random_seed(job.seed)
    if job.deterministic:
        tf.config.experimental.enable_op_determinism()
    num_towers = job.num_towers * num_workers
    if job.global_batch_size < num_towers:
        logging.warning("--global_batch_size=%d is smaller than the %d towers: some towers "
                        "get empty shards and idle.", job.global_batch_size, num_towers)
    elif job.global_batch_size < num_towers * job.micro_batches:
        logging.warning("--global_batch_size=%d gives each of the %d towers fewer examples "
                        "than --micro_batches=%d: some micro-batches are empty.",
                        job.global_batch_size, num_towers, job.micro_batches)
    keras.mixed_precision.set_global_policy(
        "float32" if job.mixed_precision == "none" else job.mixed_precision)
    data = data_lib.load_data("npz" if job.data_npz else job.dataset,
                              data_npz=job.data_npz, seed=job.seed)
    with tf.device(devices[0]):  # the main device holds the variables
        try:
            model = model_spec.load_model(job.model, data.input_shape, data.num_classes,
                                          seed=job.seed)
        except ValueError as error:
            raise ValueError(f"--model: {error}") from None
    cuts = models.cuts_for_stages(model, num_stages)
    model, plan = _split(job, model, devices[:num_parts])
    optimizer = (keras.optimizers.Adam(job.learning_rate) if job.optimizer == "adam"
                 else keras.optimizers.SGD(job.learning_rate, momentum=0.9))
    trainer = towers.TowerTrainer(
        model, keras.losses.SparseCategoricalCrossentropy(from_logits=True), optimizer,
        devices=tower_devices, metrics=["accuracy"], aggregation=job.aggregation,
        pack_gradients=job.pack_gradients, variable_placement=job.variable_placement,
        accum_steps=job.accum_steps, pipeline_cuts=cuts or None,
        steps_per_execution=job.steps_per_execution, jit_compile=job.jit_compile,
        prefetch_to_devices={"auto": "auto", "on": True,
                             "off": False}[job.prefetch_to_devices],
        micro_batches=job.micro_batches, pipeline_schedule=job.pipeline_schedule,
        clip_global_norm=job.clip_global_norm or None, cluster=cluster,
        recompute=_recompute(job.recompute), batch_statistics=job.batch_statistics)
    checkpointer = None
    if job.checkpoint_dir:
        with tf.device(devices[0]):  # the slots must exist to be restored
            trainer.optimizer.build(trainer.optimized_variables)
        checkpointer = Checkpointer(job.checkpoint_dir, model, trainer.optimizer,
                                    every_steps=job.checkpoint_every, writer=is_chief,
                                    run=_run_identity(job))
        checkpointer.lock()  # on the chief; before model_spec.json is written
        # Restoring compares the variables and the optimizer's class; this also compares
        # which model it is (a relu and a tanh MLP have the same variables).
        model_spec.claim_checkpoint_dir(job.checkpoint_dir, job.model,
                                        writer=is_chief)

    steps_per_epoch = data_lib.steps_per_epoch(data, job.global_batch_size)
    epochs = (math.ceil(job.steps / steps_per_epoch) if job.steps
              else job.epochs or DEFAULT_EPOCHS)
    test_batches = data_lib.eval_dataset(data, job.global_batch_size)
    history = trainer.fit(
        lambda epoch: data_lib.train_dataset(data, job.global_batch_size, epoch,
                                             seed=job.seed, worker_index=worker_index,
                                             num_workers=num_workers),
        epochs=epochs, steps_per_epoch=steps_per_epoch, validation_data=test_batches,
        max_steps=job.steps, checkpointer=checkpointer, log_dir=job.log_dir or None)

    final = trainer.evaluate(test_batches)
    results = {
        "eval_accuracy": final["accuracy"],
        "eval_loss": final["loss"],
        "train_loss": (history.history["loss"][-1] if history.epoch  # else a finished run resumed
                       else trainer.evaluate(data_lib.train_dataset(
                           data, job.global_batch_size, 0, seed=job.seed))["loss"]),
        "steps": trainer.step,
        "examples_per_sec": history.history["examples_per_sec"][-1] if history.epoch else 0.0,
        "num_towers": trainer.num_towers,
        "num_workers": num_workers,
        "devices": tower_devices,
        "dataset": data.name,
        "model": job.model,
        "global_batch_size": job.global_batch_size,
        "aggregation": job.aggregation,
        "variable_placement": job.variable_placement,
        "accum_steps": job.accum_steps,
        "steps_per_execution": job.steps_per_execution,
        "jit_compile": job.jit_compile,
        "prefetch_to_devices": trainer.prefetch_to_devices,
        "mixed_precision": job.mixed_precision,
        "pipeline_stages": num_stages,
        "micro_batches": job.micro_batches,
        "pipeline_schedule": job.pipeline_schedule,
        "pipeline_cuts": cuts,
        "recompute": _recompute(job.recompute),
        "batch_statistics": job.batch_statistics,
        "num_parts": num_parts,
        NUM_PARTS_ALIAS: num_parts,  # as long as the flag's alias
        "split_plan": plan,
    }
    if job.output_json and is_chief:
        os.makedirs(os.path.dirname(os.path.abspath(job.output_json)), exist_ok=True)
        with open(job.output_json, "w") as f:
            json.dump(results, f, indent=2)
    return results


def _run_identity(job):
    """What the checkpoint folder records of the flags: those that decide which examples
    each step reads (a resume with others is refused, naming the flag), and those a
    resume may change (said in one log line; --learning_rate is the optimizer's)."""
    data_order = {"dataset": None if job.data_npz else job.dataset,
                  "data_npz": job.data_npz and os.path.abspath(job.data_npz),
                  "seed": job.seed, "global_batch_size": job.global_batch_size}
    settings = {name: getattr(job, name) for name in (
        "epochs", "steps", "num_towers", "checkpoint_every", "log_dir", "output_json")}
    return towers.RunIdentity(data_order=data_order, settings=settings, flag_prefix="--")


def _split(job, model, part_devices):
    """(the model split as --split_plan says, else as the built-in model's default plan for
    --num_parts > 1, the plan); (`model`, {}) for none. A plan split_layers refuses
    is one line naming the flag it came from."""
    flag = ("--split_plan" if job.split_plan else
            f"--num_parts={job.num_parts} (alias --{NUM_PARTS_ALIAS})")
    try:
        if job.split_plan == ["auto"]:  # Megatron's plan for a transformer, logged
            plan = towers.auto_plan(model, len(part_devices))
        elif job.split_plan:
            plan = plans.parse(job.split_plan)
        else:
            plan = plans.default(model, job.model) if job.num_parts > 1 else {}
        return (towers.split_layers(model, plan, part_devices) if plan else model), plan
    except ValueError as error:
        raise ValueError(f"{flag}: {error}") from None


def _check_pipeline_flags(job):
    """Refuses, before any work, flag combinations the pipeline cannot run."""
    if job.accum_steps > 1 and job.micro_batches > 1:
        raise ValueError(
            f"--accum_steps={job.accum_steps} and "
            f"--micro_batches={job.micro_batches} both "
            "split each tower's shard into micro-batches run one after another; set only one "
            "of them (--micro_batches with --pipeline_stages).")
    if job.split_plan and job.pipeline_stages != 1 and job.num_parts == 1:
        raise ValueError(f"--pipeline_stages={job.pipeline_stages} with --split_plan needs "
                         f"--num_parts=T (alias --{NUM_PARTS_ALIAS}), the parts of each stage "
                         "(the grid of towers x stages x parts).")
    if job.pipeline_stages == 1:
        return
    if job.variable_placement == "replicated":
        raise ValueError(
            f"--pipeline_stages={job.pipeline_stages} cannot be combined with "
            "--variable_placement=replicated: each stage's variables live on one device, "
            "which all towers read; use --variable_placement=main.")


def _check_model_flag(job):
    """Refuses, before any work, a --model of none of the three forms."""
    try:
        model_spec.form_of(job.model)
    except ValueError as error:
        raise ValueError(f"--model: {error}") from None


def _check_output_json(path):
    """Refuses, before any work, an --output_json the results could not be written to at
    the end: a folder, or a path in a folder that cannot be made or written."""
    if os.path.isdir(path):
        raise ValueError(f"--output_json={path} is a folder; give a file path, e.g. "
                         f"--output_json={os.path.join(path, 'results.json')}.")
    _check_can_write_in(f"--output_json={path}", os.path.dirname(os.path.abspath(path)))


def _check_log_dir(path):
    """Refuses, before any work, a --log_dir the summaries could not be written to: a
    file, or a folder that cannot be made or written."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"--log_dir={path} is a file; give a folder for the TensorBoard "
                         "summaries.")
    _check_can_write_in(f"--log_dir={path}", os.path.abspath(path))


def _check_can_write_in(flag, folder):
    """Refuses a `folder` whose nearest existing folder is a file or not writable (folders
    still missing are made when something is written there); `flag` starts the message."""
    existing = folder
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    try:  # as the Checkpointer tries its directory
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".write-test"):
            pass
    except OSError as error:
        raise ValueError(f"{flag}: cannot write in {existing!r}: "
                         f"{error.strerror or error}; give a path in a writable folder."
                         ) from None


def _cluster(job):
    """The Cluster from --worker_hosts/--task_index, else from TF_CONFIG; None for one process."""
    timeouts = {"peer_timeout_s": job.peer_timeout_s,
                "startup_timeout_s": job.startup_timeout_s, "step_timeout_s": job.step_timeout_s}
    if job.worker_hosts is None:
        if job.task_index is not None:
            raise ValueError("--task_index needs --worker_hosts (or use TF_CONFIG alone).")
        return towers.cluster_from_tf_config(**timeouts)
    if job.task_index is None:
        raise ValueError("--worker_hosts needs --task_index: this worker's position in it, "
                         "0 for the chief.")
    return towers.Cluster(tuple(job.worker_hosts), job.task_index, **timeouts)
