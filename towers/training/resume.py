"""fit's checkpointer before the first step: bound to the trainer's own model and
optimizer, and, when there is a checkpoint to resume from, every variable it
restores made first, so that Checkpointer.restore can match them all.

An unbuilt model is built as the first step builds it (training.first_batch),
on the dataset's first batch; a built one gets its optimizer built as the first
step builds it, next to each variable.
"""

import tensorflow as tf

from towers.training import checkpoint, first_batch, trainable


def check_binding(trainer, checkpointer):
    """Raises ValueError, in one line, when `checkpointer` saves another model or
    optimizer than the trainer's (it would save them under the trainer's step count),
    or is no Checkpointer."""
    if not isinstance(checkpointer, checkpoint.Checkpointer):
        raise ValueError(f"checkpointer must be a towers.Checkpointer(directory, "
                         f"trainer.model, trainer.optimizer), got {type(checkpointer).__name__}.")
    if checkpointer.model is not trainer.model:
        raise ValueError(
            f"checkpointer is bound to model {checkpointer.model.name!r}, not to the "
            f"trainer's {trainer.model.name!r}, so it would save a model that is not "
            "trained; pass towers.Checkpointer(directory, trainer.model, trainer.optimizer).")
    if checkpointer.optimizer is not trainer.optimizer:
        wrapped = checkpointer.optimizer is getattr(trainer.optimizer, "inner_optimizer", None)
        raise ValueError(
            f"checkpointer is bound to optimizer {checkpointer.optimizer.name!r}, not to the "
            f"trainer's {trainer.optimizer.name!r}"
            f"{' (its LossScaleOptimizer for float16)' if wrapped else ''}, so it would "
            "save another optimizer's state; pass towers.Checkpointer(directory, "
            "trainer.model, trainer.optimizer).")


def build_for_restore(trainer, checkpointer, dataset):
    """Builds the model and optimizer, as the first step does, when `checkpointer` has a
    checkpoint to restore and the trainer has taken no step yet.

    `dataset`: fit's (a callable epoch -> batches, or batches); an unbuilt model is
    built on its first batch (epoch 0's). Returns `dataset`, or, when that was a
    one-shot iterator, one that yields the batch taken from it first.
    """
    if not checkpointer.has_checkpoint() or trainer.setup.trainable_ids is not None:
        return dataset
    if trainer.model.built:
        if trainer.setup.stages is None:  # built after the trainer was made
            first_batch.check_model(trainer)
        with tf.device(trainer.main_device):
            trainable.extend_optimizer(trainer.optimizer, trainer.optimized_variables)
        return dataset
    return first_batch.set_up_before_fit(trainer, dataset, "before its checkpoint is restored")
