"""What TowerTrainer sets up on its first batch, eagerly: the model built and checked,
its stages and their variables placed, the choices that need a batch (dense
gradients) made, what depends on the trainable set (training.trainable: the optimizer
built, replicas, XLA towers) set up, and a cluster's workers started."""

import tensorflow as tf
from absl import logging

from towers import devices as devices_lib, errors
from towers.data_parallel import losses, split, tower
from towers.model_parallel import stages as stages_lib
from towers.multi_worker import cluster as cluster_lib
from towers.op_parallel import plan as op_plan
from towers.training import trainable


def set_up(trainer, batch):
    """Builds model and optimizer on the main device and checks the loss, on `batch`'s
    first example; fills in trainer.setup's first-batch fields."""
    setup = trainer.setup
    shards, _, _ = split.shards_of(batch, len(setup.grid))
    first_shard = shards[0]  # holds the batch's first example
    if split.batch_size(first_shard) == 0:  # a worker whose part of the batch is empty
        # One example of zeros builds the model and checks the loss; nothing trains on it.
        first_shard = tf.nest.map_structure(
            lambda t: tf.zeros([1, *t.shape[1:]], t.dtype), first_shard)
    x, y, sample_weight = split.unpack_batch(tf.nest.map_structure(lambda t: t[:1], first_shard))
    with tf.device(setup.main_device):
        try:
            y_pred = trainer.model(x, training=False)
            outputs = (y_pred, losses.output_masks(y_pred))
            trainer.objective.terms(y, outputs, sample_weight)  # resolves the loss's forms
        except (tf.errors.OpError, TypeError) as error:
            raise ValueError(
                f"the model or the loss failed on the first example of the batch: "
                f"{errors.root_cause(error)}. Check that x matches the model's inputs and y "
                "its outputs.") from None
        except ValueError as error:  # Keras's own checks of the loss's forms: several lines
            raise ValueError(" ".join(str(error).split())) from None
        for shard in shards:  # the whole first batch's labels, once
            losses.check_sparse_labels(trainer.objective, split.unpack_batch(shard)[1])
        trainer.metrics.build(y, outputs)
        check_model(trainer)
        setup.dense_choices = tower.choose_dense_gradients(
            trainer.model, trainer.objective, first_shard, setup.options.sparse_policy)
    trainable.set_up(trainer)
    if trainer.cluster is not None:
        setup.first_tower, trainer.num_towers = cluster_lib.start_together(
            trainer.cluster, trainer.model, trainer.optimizer, setup.options,
            setup.main_device, len(setup.grid))


def check_model(trainer):
    """Checks the built model, cuts it into stages and places each stage's variables."""
    model, setup = trainer.model, trainer.setup
    trainable.check_trainable(model)
    if setup.stages is None:
        setup.stages = stages_lib.Stages(model, trainer.pipeline_cuts)
    if trainer.pipeline_cuts is not None:
        stages_lib.place_variables(setup.stages, setup.stage_devices, trainer.optimizer)
    misplaced = sorted({v.value.device for v in model.variables
                        if devices_lib.canonical_name(v.value.device) != setup.main_device})
    # Stages and split layers place their variables on purpose.
    if misplaced and trainer.pipeline_cuts is None and not op_plan.is_split(model):
        logging.warning(
            "model %r has variables on %s, not on main_device %s; they stay there. To "
            "keep them on the main device, build the model inside `with tf.device(%r):`.",
            model.name, misplaced, setup.main_device, setup.main_device)
