"""One worker of the 2-worker equivalence test, run as its own process.

    python -m tests.multi_worker_job '{"worker_hosts": [...], "task_index": 0, ...}'

Trains make_model(config["model"]) on BATCH_SIZES global batches, feeding
this worker its towers.split_batch part of each, and saves the weights, the
per-step losses and the final accuracy to the "output" .npz. With
config["uneven_data"] it fits instead (uneven_data_fits).
"""

import functools
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import towers  # noqa: E402
from tests import reference  # noqa: E402
from towers.multi_worker.cluster import check_same  # noqa: E402

# 1 leaves worker 1 with no rows at all, at its first step; 7 splits unevenly (4 + 3).
BATCH_SIZES = (1, 12, 7, 3, 10)
VOCABULARY, TOKENS = 40, 6
# Per epoch: worker 0 gets its part of the first 3 global batches, worker 1 its
# part of them and the whole 4th (so 3 and 4 batches).
UNEVEN_SIZES, UNEVEN_EPOCHS = (6, 5, 4, 3), 2


def make_model(kind):
    """reference.make_model, ("conv") a convolution over the features, which must not
    run on a worker's empty part, ("embedding") one whose gradient is a
    tf.IndexedSlices, or ("masked") a tagger of padded sequences (its table's gradient
    a tf.IndexedSlices too), its output masked."""
    if kind == "dense":
        return reference.make_model()
    keras.utils.set_random_seed(0)
    if kind == "masked":
        # The mask passes through the Dense layers to the output (an LSTM's use of it
        # is test_compile's: here the loss's count across workers is what is tested).
        return keras.Sequential([keras.Input((TOKENS,), dtype="int32"),
                                 keras.layers.Embedding(VOCABULARY, 4, mask_zero=True),
                                 keras.layers.Dense(4, activation="tanh"),
                                 keras.layers.Dense(reference.NUM_CLASSES)])
    if kind == "conv":
        return keras.Sequential([keras.Input((reference.NUM_FEATURES,)),
                                 keras.layers.Reshape((reference.NUM_FEATURES, 1)),
                                 keras.layers.Conv1D(4, 2), keras.layers.Flatten(),
                                 keras.layers.Dense(reference.NUM_CLASSES)])
    return keras.Sequential([keras.Input((TOKENS,), dtype="int32"),
                             keras.layers.Embedding(VOCABULARY, 4),
                             keras.layers.GlobalAveragePooling1D(),
                             keras.layers.Dense(reference.NUM_CLASSES)])


def global_batches(kind):
    batches = [reference.make_batches(size, num_steps=1, seed=step)[0]
               for step, size in enumerate(BATCH_SIZES)]
    if kind not in ("embedding", "masked"):
        return batches
    rng = np.random.default_rng(7)  # few tokens, so workers look up the same rows too
    if kind == "embedding":
        return [(rng.integers(0, VOCABULARY, (len(y), TOKENS)).astype("int32"), y, w)
                for _, y, w in batches]
    masked = []  # rows padded with 0 after 1..TOKENS tokens; a label and weight per token
    for _, y, _ in batches:
        x = rng.integers(1, VOCABULARY, (len(y), TOKENS))
        x[np.arange(TOKENS)[None] >= rng.integers(1, TOKENS + 1, len(y))[:, None]] = 0
        masked.append((x.astype("int32"), rng.integers(0, reference.NUM_CLASSES, x.shape),
                       rng.uniform(0.5, 2.0, x.shape).astype("float32")))
    return masked


def make_loss(reduction="sum_over_batch_size"):
    """reference.make_loss with Keras's `reduction` (a sum, or None: unreduced)."""
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)


def make_trainer(devices, kind, cluster=None, **options):
    """The same model, loss, optimizer and metric in every process.

    options["loss_reduction"], if there, is the loss's reduction (make_loss).
    options["pipeline_cuts"], if there, holds indices into model.layers, and so does
    options["split_plan"] ({index: how}): the model's layers are then split over the
    grid's first row (towers.split_layers).
    """
    with tf.device(tf.nest.flatten(devices)[0]):
        model = make_model(kind)
    if "pipeline_cuts" in options:
        options["pipeline_cuts"] = [model.layers[i].name for i in options["pipeline_cuts"]]
    if "split_plan" in options:
        plan = {model.layers[int(i)].name: how for i, how in options.pop("split_plan").items()}
        model = towers.split_layers(model, plan, devices[0])
    loss = make_loss(options.pop("loss_reduction", "sum_over_batch_size"))
    return towers.TowerTrainer(model, loss, reference.OPTIMIZERS["adam"](),
                               devices=devices, metrics=["accuracy"], cluster=cluster,
                               **options)


def main(config):
    width = config.get("devices_per_tower", 1)  # its stages, or its parts
    devices = towers.configure_devices(config["num_towers"] * width, "cpu")
    if width > 1:  # one row of the grid per tower
        devices = [devices[t * width:(t + 1) * width] for t in range(config["num_towers"])]
    cluster = towers.Cluster(config["worker_hosts"], config["task_index"])
    towers.join_cluster(cluster)
    if config.get("uneven_data"):
        return uneven_data_fits(config, cluster, devices)
    trainer = make_trainer(devices, config["model"], cluster, **config.get("options", {}))
    if config.get("trace_on_chief_first") and cluster.is_chief:
        # A function with collective ops across workers that only the chief traces
        # (never runs): it must not shift the keys of the trainer's collectives.
        spec = tuple(tf.TensorSpec([None, *np.shape(part)[1:]], tf.as_dtype(part.dtype))
                     for part in global_batches(config["model"])[0])
        tf.function(lambda batch: towers.tower_gradients(
            trainer.model, trainer.loss, batch, devices, cluster=cluster)
        ).get_concrete_function(spec)
    losses = []
    for batch in global_batches(config["model"]):
        part = towers.split_batch(batch, cluster.num_workers)[cluster.task_index]
        losses.append(trainer.train_step(part)["loss"])
    model = towers.join_layers(trainer.model) if "split_plan" in config.get(
        "options", {}) else trainer.model
    weights = {f"w{i}": v.numpy() for i, v in enumerate(model.weights)}
    # The bytes of this worker's optimizer slots (Adam's moments), and the model's.
    slot_bytes = sum(v.numpy().nbytes for v in trainer.optimizer.variables
                     if len(v.shape) > 0)
    np.savez(config["output"], losses=np.array(losses), accuracy=trainer.metrics[0].result(),
             steps=trainer.step, slot_bytes=slot_bytes,
             model_bytes=sum(v.numpy().nbytes for v in model.trainable_variables),
             checkpoint_refusal=checkpoint_refusal(config, cluster, trainer, part), **weights)


def checkpoint_refusal(config, cluster, trainer, part):
    """With spread placement, the ValueError's text where fit with a Checkpointer (on
    [part]) refuses it before any step (each worker holds its own slots, the chief
    writes); else ""."""
    if config.get("options", {}).get("variable_placement") != "spread":
        return ""
    checkpointer = towers.Checkpointer(os.path.join(os.path.dirname(config["output"]), "ckpt"),
                                       trainer.model, trainer.optimizer,
                                       writer=cluster.is_chief)
    try:
        trainer.fit([part], checkpointer=checkpointer, verbose=False)
    except ValueError as error:
        return str(error)
    return "not refused"


def uneven_global_batches(epoch):
    return [reference.make_batches(size, num_steps=1, seed=10 * epoch + i)[0]
            for i, size in enumerate(UNEVEN_SIZES)]


def uneven_validation_batch():
    return reference.make_batches(8, num_steps=1, seed=99)[0]


def uneven_parts(epoch, task_index, as_dataset):
    """Worker `task_index`'s batches of `epoch`: a list, or a tf.data.Dataset."""
    *shared, last = uneven_global_batches(epoch)
    parts = [towers.split_batch(batch, 2)[task_index] for batch in shared]
    parts += [tuple(map(tf.constant, last))] if task_index == 1 else []
    if not as_dataset:
        return parts
    return functools.reduce(tf.data.Dataset.concatenate, map(tf.data.Dataset.from_tensors, parts))


def uneven_data_fits(config, cluster, devices):
    """Fits over UNEVEN_EPOCHS of uneven_parts, with validation; saves per fit its step,
    weights and History logs: "step", a step per call over lists; "in_graph", 3 steps
    per call over Datasets split and staged on the towers (shard_iterator), stopped
    by max_steps=3 (a checkpoint at batch 3 of epoch 1) and resumed by a new trainer
    (whose data has ended already on worker 0)."""
    validation = uneven_validation_batch()
    results = {}

    def fit(in_graph, **options):
        """A new trainer's fit: a step per call over lists, or (in_graph) 3 per call over
        Datasets staged on the towers, with checkpoints; returns (trainer, history)."""
        trainer = make_trainer(devices, "dense", cluster, **(
            {"steps_per_execution": 3, "prefetch_to_devices": True} if in_graph else {}))
        if in_graph:
            options["checkpointer"] = towers.Checkpointer(
                config["checkpoint_dir"], trainer.model, trainer.optimizer,
                writer=cluster.is_chief)
        return trainer, trainer.fit(
            lambda epoch: uneven_parts(epoch, cluster.task_index, as_dataset=in_graph),
            epochs=UNEVEN_EPOCHS, validation_data=validation, verbose=False, **options)

    def keep(name, trainer, history):
        results.update({f"{name}_step": trainer.step,
                        **{f"{name}_w{i}": v.numpy() for i, v in enumerate(trainer.model.weights)},
                        **{f"{name}_{k}": v for k, v in history.history.items()
                           if k != "examples_per_sec"}})

    keep("step", *fit(in_graph=False))
    fit(in_graph=True, max_steps=3)
    check_same(cluster, {"the chief saved its checkpoint": True})  # a barrier
    keep("in_graph", *fit(in_graph=True))  # resumes where max_steps stopped
    np.savez(config["output"], **results)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
