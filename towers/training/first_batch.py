"""What TowerTrainer sets up on its first batch, eagerly: the model built and checked,
its stages and their variables placed, the choices that need a batch (dense
gradients) made, what depends on the trainable set (training.trainable: the optimizer
built, replicas, XLA towers) set up, and a cluster's workers started."""

import dataclasses
import itertools

import keras
import tensorflow as tf
from absl import logging

from towers import compat, devices as devices_lib, errors
from towers.data_parallel import split
from towers.engine import forward, losses, sparse_labels, tower
from towers.model_parallel import stages as stages_lib
from towers.multi_worker import cluster as cluster_lib
from towers.op_parallel import plan as op_plan
from towers.placement import variables as variables_lib
from towers.training import model_loss_forms, trainable


def set_up(trainer, batch):
    """Builds model and optimizer on the main device and checks the loss, on `batch`'s
    first examples (check_examples); fills in trainer.setup's first-batch fields."""
    setup = trainer.setup
    shards, _, _ = split.shards_of(batch, setup.mesh.num_towers)
    first_shard = shards[0]  # holds the batch's first example
    if split.batch_size(first_shard) == 0:  # a worker whose batch is empty
        # One example of zeros builds the model and checks the loss; nothing trains on it.
        first_shard = tf.nest.map_structure(
            lambda t: tf.zeros([1, *t.shape[1:]], t.dtype), first_shard)
    whole = not isinstance(batch, split.Shards) and split.batch_size(batch) != 0
    with tf.device(setup.main_device):
        y, outputs, sample_weight = check_examples(trainer, batch if whole else first_shard)
        trainer.objective.model_loss_forms = model_loss_forms.measure(
            trainer.model, _inputs(shards, first_shard), trainer.cluster)
        for shard in shards:  # the whole first batch's labels, once
            sparse_labels.check_sparse_labels(trainer.objective, split.unpack_batch(shard)[1])
        trainer.metrics.build(y, outputs, sample_weight)
        check_model(trainer)
        trainer.setup = dataclasses.replace(trainer.setup, dense_choices=(
            tower.choose_dense_gradients(trainer.model, trainer.objective, first_shard,
                                         setup.options.sparse_policy)))
    trainable.set_up_for_trainable(trainer)
    if trainer.cluster is not None:
        setup = trainer.setup
        first_tower, trainer.num_towers = cluster_lib.start_together(
            trainer.cluster, trainer.model, trainer.optimizer, setup.options,
            setup.main_device, setup.mesh.num_towers, own_slots=setup.columns.cluster is not None,
            step_shape=_step_shape(trainer))
        trainer.setup = dataclasses.replace(setup, first_tower=first_tower)


def _step_shape(trainer):
    """The trainer's own settings that shape each call's collectives, by what a worker
    that differs is told: every worker of a cluster must have the same."""
    return {"the trainer's steps_per_execution": trainer.steps_per_execution,
            "the trainer's prefetch_to_devices": trainer.prefetch_to_devices,
            "the trainer's jit_compile": trainer.jit_compile,
            "the trainer's pipeline_cuts": trainer.pipeline_cuts,
            "the stages and parts of a tower": {
                name: size for name, size in trainer.setup.mesh.shape.items() if name != "tower"}}


def _inputs(shards, first_shard):
    """x of the batch's first rows in order (model_loss_forms.ROWS of them, or fewer: its
    shards' first rows joined), or of `first_shard` where the batch has none."""
    parts = [tf.nest.map_structure(lambda t: t[:model_loss_forms.ROWS],
                                   split.unpack_batch(shard)[0])
             for shard in shards if split.batch_size(shard)]
    if not parts:
        return split.unpack_batch(first_shard)[0]
    return parts[0] if len(parts) == 1 else forward.concat_rows(parts)


def set_up_before_fit(trainer, dataset, why):
    """Sets the trainer up as its first step would, on fit's first batch (epoch 0's for
    a callable `dataset`), unless it has taken a step. Returns `dataset`, or, for a
    one-shot iterator, one that yields the batch taken from it first.

    why: what needs it, for the error when the dataset has no batch.
    """
    if trainer.setup.trainable_ids is not None:
        return dataset
    batches = dataset(0) if callable(dataset) else dataset
    batch, batches_again = _peeked(batches)
    if batch is None:
        raise ValueError(
            f"model {trainer.model.name!r} is not set up and the dataset has no batch to "
            f"set it up on {why}; pass a dataset with batches.")
    set_up(trainer, split.checked_batch(batch))
    return dataset if callable(dataset) else batches_again


def check_validation(trainer, validation_data):
    """Checks fit's validation_data's first batch as check_batch checks a new batch:
    before the first epoch, not after it. Returns validation_data, or, for a one-shot
    iterator, one that yields the batch taken from it first."""
    if isinstance(validation_data, tuple):  # one batch, as evaluate takes it
        batch = validation_data
    else:
        batch, validation_data = _peeked(validation_data)
    if batch is None:
        raise ValueError("validation_data has no batches; pass a batch, a non-empty dataset "
                         "or None.")
    try:
        check_batch(trainer, split.checked_batch(batch))
    except ValueError as error:
        raise ValueError(f"validation_data: {error}") from None
    return validation_data


def _peeked(data):
    """(the first batch of `data` or None, `data` to use from now on): a one-shot
    iterator comes back with that batch in front again. `data`: a tf.data.Dataset
    or an iterable of batches."""
    iterator = iter(data)
    batch = next(iterator, None)
    if iterator is data and batch is not None:
        return batch, itertools.chain([batch], iterator)
    return batch, data


def set_up_to_predict(trainer, batch):
    """Before the first step, what predict needs of it, on `batch` ((x,), Tensors): the
    model built on the main device on its first examples (check_examples) and cut into
    stages, its variables placed (check_model); the loss, metrics and optimizer are left
    to the first train or eval batch (set_up). A model set up so far: its columns
    indexed for the trainable set now (a layer frozen since), for a predict step traced
    now; one traced before reads the same values and stays."""
    if trainer.setup.stages is not None:
        trainer.setup.columns.reindex()
        return
    with tf.device(trainer.setup.main_device):
        check_examples(trainer, batch)
        check_model(trainer)


def check_batch(trainer, batch):
    """Checks a batch (Tensors, or split.Shards of them) of a structure the steps have
    not been traced for, before it is: the model and the loss run eagerly on its first
    examples (check_examples), and a sparse loss's labels, all of them, are class ids
    (float labels for a trainer set up on integer ones are a new structure), on the main
    device; of predict's (x,), the model only. A batch of no rows (a cluster worker's
    batch) passes: its structure is that of a batch the worker had."""
    parts = batch if isinstance(batch, split.Shards) else [batch]
    if split.batch_size(parts[0]) != 0:
        with tf.device(trainer.setup.main_device):
            check_examples(trainer, parts[0])
            if len(parts[0]) == 1:  # predict's (x,): no labels
                return
            for part in parts:
                sparse_labels.check_sparse_labels(trainer.objective, split.unpack_batch(part)[1])


def check_spec(trainer, spec):
    """Checks batches of element_spec `spec` (a tf.data iterator's, or a ShardIterator's
    one shard's) as check_batch checks a batch, without taking one: on two examples of
    zeros of that structure (an unknown feature dim 1), its messages showing the spec's
    shapes (dim 0 None where the batches' rows vary). Ragged, sparse or scalar parts are
    left to the trace, which refuses them in one line (split.as_batch, batch_size)."""
    split.unpack_batch(spec)
    if not all(isinstance(leaf, tf.TensorSpec) and leaf.shape.rank
               for leaf in tf.nest.flatten(spec)):
        return
    x_shape = _input_shape(trainer.model, spec[0])
    examples = split.as_batch(tf.nest.map_structure(
        lambda leaf: tf.zeros([2] + [1 if d is None else d for d in leaf.shape[1:]],
                              leaf.dtype), tuple(spec)))
    if x_shape is not None:  # a dim the spec leaves unknown, as the model's input has it
        examples = (tf.zeros([2, *x_shape], spec[0].dtype), *examples[1:])
    with tf.device(trainer.setup.main_device):
        check_examples(trainer, examples, shown=spec)


def _input_shape(model, x_spec):
    """The feature shape of examples of `x_spec` (one tf.TensorSpec) for a model of one
    input of that rank: the spec's dims, each it leaves unknown (a generator's dataset:
    tf.TensorSpec([None, None])) as the model's input has it; None where there is
    nothing to fill in, or no such input."""
    try:
        inputs = model.inputs
    except (AttributeError, ValueError):
        return None
    if not isinstance(x_spec, tf.TensorSpec) or not inputs or len(inputs) != 1 or (
            len(inputs[0].shape) != x_spec.shape.rank):
        return None
    dims = list(zip(x_spec.shape[1:], inputs[0].shape[1:]))
    if all(spec_dim is not None for spec_dim, _ in dims):
        return None
    return [model_dim if spec_dim is None else spec_dim for spec_dim, model_dim in dims]


def check_examples(trainer, batch, shown=None):
    """Runs the model and the loss eagerly on the first two examples of `batch`; returns
    (y, (y_pred, output masks), sample_weight) of them. `shown`: what the messages give
    the shapes of (the batch's parts, or their tf.TensorSpec); by default `batch`.
    Predict's batch (x,) runs the model only (y and sample_weight None).

    Two rows, not one: a weight of the wrong shape would broadcast over one.

    Raises:
      ValueError: in one line, naming the field of the batch that does not fit: x
        (the model's inputs), y (its outputs and the loss) or sample_weight.
    """
    shown = batch if shown is None else shown
    first = tf.nest.map_structure(lambda t: t[:2], batch)
    x, y, sample_weight = (first[0], None, None) if len(first) == 1 else \
        split.unpack_batch(first)
    _check_inputs(trainer.model, x, shown[0])
    try:
        with keras.StatelessScope():  # a check: what the call assigns (a counter) is dropped
            y_pred = trainer.model(x, training=False)
    except (tf.errors.OpError, TypeError, ValueError) as error:
        raise ValueError(
            f"model {trainer.model.name!r} failed on x, {_shapes(shown[0])}: "
            f"{errors.root_cause(error)}. Check that x matches the model's inputs.") from None
    if len(first) == 1:  # predict's: no labels
        return None, (y_pred, losses.output_masks(y_pred)), None
    if isinstance(y, dict) and isinstance(y_pred, dict) and set(y) - set(y_pred):
        raise ValueError(
            f"y has key(s) {sorted(set(y) - set(y_pred))}, which name no output of model "
            f"{trainer.model.name!r}; its outputs are {sorted(y_pred)}: key y by output name.")
    num_outputs = len(tf.nest.flatten(y_pred))
    if num_outputs > 1 and tf.is_tensor(y):  # Keras would pair its rows with the outputs
        raise ValueError(
            f"y, {_shapes(shown[1])}, is one array but model {trainer.model.name!r} has "
            f"{num_outputs} outputs, {_shapes(y_pred, any_rows=True)}: give y as a list (or "
            "a dict by output name) of one array per output.")
    outputs = (y_pred, losses.output_masks(y_pred))
    try:
        trainer.objective.terms(y, outputs, sample_weight)  # resolves the loss's forms
    except errors.LossMismatch:  # the loss is at fault, not y, and its line says so
        raise
    except (tf.errors.OpError, TypeError, ValueError) as error:
        cause = errors.root_cause(error)
        if sample_weight is not None and _fits(trainer.objective, y, outputs):
            raise ValueError(
                f"sample_weight, {_shapes(shown[2])}, does not fit the loss: {cause}. Give "
                "one weight per example (shape (batch,)), or one per loss entry.") from None
        raise ValueError(
            f"y, {_shapes(shown[1])}, does not fit the loss on the model's outputs, "
            f"{_shapes(y_pred, any_rows=True)}: {cause}. Check that y matches the model's "
            "outputs and the loss (sparse losses take class indices, others one value per "
            "output entry).") from None
    return y, outputs, sample_weight


def _check_inputs(model, x, whole_x):
    """Raises ValueError when x does not fit a functional model's inputs: a number of
    arrays other than its inputs' (Keras would warn and take the first; a dict may also
    hold features the model does not read), or one array where the model's one input
    has a fixed feature size that x, of the same rank, lacks (Keras: several lines)."""
    try:
        inputs = model.inputs  # a functional model's; a subclassed one has none
    except (AttributeError, ValueError):
        return
    if not inputs:
        return
    leaves = tf.nest.flatten(x)
    expected = [tuple(i.shape) for i in inputs]
    if len(leaves) != len(inputs) and not isinstance(x, dict):
        raise ValueError(
            f"x holds {len(leaves)} arrays, {_shapes(whole_x)}, but model {model.name!r} "
            f"takes {len(inputs)} input(s), of shapes {expected}: give one array per input.")
    got = x.shape.as_list() if tf.is_tensor(x) else []
    shown = whole_x.shape.as_list() if isinstance(whole_x, tf.TensorSpec) else got
    if len(inputs) == 1 and len(expected[0]) == len(got) == len(shown) and any(
            e is not None and s is not None and e != g
            for e, g, s in zip(expected[0][1:], got[1:], shown[1:])):
        raise ValueError(
            f"x has shape {tuple(whole_x.shape)} but model {model.name!r} takes inputs of "
            f"shape {expected[0]} (dim 0 the batch): give every example the shape "
            f"{expected[0][1:]}.")


def _fits(objective, y, outputs):
    """Whether the loss runs on y and the outputs without sample weights."""
    try:
        objective.terms(y, outputs)
        return True
    except (tf.errors.OpError, TypeError, ValueError):
        return False


def _shapes(part, any_rows=False):
    """The shapes of a field of a batch (a Tensor or a nest of them), for messages; with
    any_rows, dim 0 as None (a model's outputs, computed here on two examples)."""
    shapes = tf.nest.map_structure(
        lambda t: (None, *t.shape[1:]) if any_rows else tuple(t.shape), part)
    return f"shape {shapes}" if isinstance(shapes, tuple) and all(
        isinstance(d, (int, type(None))) for d in shapes) else f"shapes {shapes}"


def check_model(trainer):
    """Checks the built model (and that the optimizer is not another model's), cuts it
    into stages and places each column's variables (a stage's, or its split layers'
    parts')."""
    model = trainer.model
    trainable.check_trainable(model)
    trainable.check_optimizer_is_the_models(trainer.optimizer, model)
    if trainer.setup.stages is None:
        trainer.setup = trainer.setup.with_stages(stages_lib.Stages(model, trainer.pipeline_cuts))
    setup = trainer.setup
    setup.statistics.check(setup.options.micro_batches, trainer.jit_compile, trainer.cluster)
    spread = setup.options.variable_placement == "spread"
    if trainer.pipeline_cuts is not None or spread:
        if setup.parts is not None:
            setup.parts.settle(setup.stages)
        setup.columns.hold_slabs(trainer.optimizer)
        variables_lib.place_variables(setup.columns, trainer.optimizer)
        return  # stages, split layers and spread placement place their variables on purpose
    for variable in model.variables:  # held as slabs by an earlier trainer: whole again
        if compat.held_slabs(variable) is not None:
            compat.move_variable(variable, setup.main_device)
    misplaced = sorted({v.value.device for v in model.variables
                        if devices_lib.canonical_name(v.value.device) != setup.main_device})
    if misplaced and not op_plan.is_split(model):
        logging.warning(
            "model %r has variables on %s, not on main_device %s; they stay there. To "
            "keep them on the main device, build the model inside `with tf.device(%r):`.",
            model.name, misplaced, setup.main_device, setup.main_device)
