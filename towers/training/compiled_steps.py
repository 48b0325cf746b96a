"""The bodies TowerTrainer compiles: the train step (steps 1-6), the eval step and the
predict step.

Each takes the trainer and reads only its public attributes (model, objective,
optimizer, metrics, setup, cluster, signals); call them
inside a tf.function. `train_step` is the contract executions' in-graph loop
builds on: its logs say what a caller needs to decide whether to go on.
"""

import collections
import contextlib

import keras
import tensorflow as tf

from towers.data_parallel import aggregate, collectives, split
from towers.engine import forward, sparse_labels, tower_trace, traced_tower
from towers.engine.step import SplitBatch, apply_update, assign_state, copy_weights, run_towers
from towers.multi_worker import cluster as cluster_lib
from towers.placement import worker_owners
from towers.training import recompute

def train_step(trainer, batch, may_be_empty):
    """One training step on `batch`: steps 1-5 (run_towers), then step 6 if finite.

    `may_be_empty`: whether a micro-batch of a tower may have no rows (False only
    where the batch is known to fill every one: fills_every_micro_batch).

    Returns logs, scalar Tensors: "loss" (the batch's, as Keras computes it, +
    regularisation), each loss term's ("cls_loss", ...) where there are several,
    "examples" (the rows the logs cover: the batch's, with a cluster every
    worker's; 0 for a step that is not finite, which enters no log), "finite"
    (loss and gradients finite, or with loss scaling the loss), "applied"
    (whether the optimizer applied the step; never for a batch of no rows, nor for
    one whose float class ids are not whole numbers), where a loss reads float
    class ids "fractional_label" (the first that is not whole, NaN where none: the
    caller refuses the batch; first_batch checks only a structure's first batch),
    each metric's result, with loss scaling "loss_scale", and with a cluster
    "stop_requested" and "data_ended" (every worker's signals.data_ended is
    set: the step trained on nothing).
    """
    # The step's collective ops take keys derived from the step, the model and where its
    # variables live (another placement of the same model makes other ops), the same on
    # every worker whatever else each traced (collectives.instance_keys).
    with collectives.instance_keys(("train_step", cluster_lib.model_signature(trainer.model),
                                    trainer.setup.columns.signature())), \
            recompute.recomputing(trainer.recomputed_layers):
        return _train_step(trainer, batch, may_be_empty)


def train_step_any_rows(trainer, batch, step):
    """The train step for a batch whose rows are known only when it runs (an in-graph
    loop's): one tf.cond picks the step that skips empty micro-batches only for a
    batch too small to give each a row. step: fn(batch, may_be_empty) -> its logs
    (train_step's)."""
    fills = fills_every_micro_batch(trainer.setup, batch)
    if isinstance(fills, bool):
        return step(batch, not fills)
    if num_micro_batches(trainer.setup) == 1 and trainer.cluster is None:
        # One micro-batch is empty only when the batch is, which train_step refuses
        # too; an assert costs less than the cond (about 3% of a small step).
        with tf.control_dependencies([tf.debugging.Assert(fills, [split.EMPTY_BATCH])]):
            batch = tf.nest.map_structure(tf.identity, batch)
        return step(batch, False)
    return tf.cond(fills, lambda: step(batch, False), lambda: step(batch, True))


Variant = collections.namedtuple("Variant",
                                 ["name", "may_be_empty", "rows_known", "work_for_rows"])
Variant.__doc__ = """Which step of a kind a batch takes (`variant`): its name (the
compiled function's kind), whether it skips empty micro-batches behind a tf.cond
(may_be_empty: body's), whether it is traced for the batch's rows (rows_known: then
dim 0 stays in its input signature), and whether its towers' work is too (work_for_rows:
split.work_spec)."""


def variant(setup, kind, batch, row_counts):
    """The Variant of `kind`'s step ("train", "eval", "predict") for `batch` (Tensors, or
    split.Shards of them); row_counts: the trainer's row_counts.RowCounts.

    A batch that gives every micro-batch of every tower a row (predict: every tower,
    which runs its shard whole) takes `kind`_of_R_rows, traced for its R rows (in
    Shards: "8+8+8+8"), its towers' work too, where they are known as it is traced,
    without a cluster, and row_counts says so (the batches keep their rows); else
    `kind`, traced for batches of any rows. One that leaves some micro-batch without a
    row takes `kind`_of_R_rows too where its rows are known as it is traced: the towers
    and micro-batches without a row are left out (step.SplitBatch, step.start_tower),
    so nothing waits on a tf.cond, and the towers' work is traced for any rows, as
    `kind`'s. That is at most towers x micro-batches - 1 such steps; in `fit`, one: its
    last batch. Where the rows are known only when it runs, with a cluster (a worker's
    rows are not the others'), or where BatchNorms meet across the towers, it takes
    `kind`_with_empty_parts, each micro-batch's model behind a tf.cond
    (forward.unless_empty).
    """
    fills = (split.smallest_shard_rows(batch, setup.mesh.num_towers) >= 1 if kind == "predict"
             else fills_every_micro_batch(setup, batch))
    sizes = ([split.batch_size(shard) for shard in batch] if isinstance(batch, split.Shards)
             else [split.batch_size(batch)])
    known = all(isinstance(size, int) for size in sizes) and setup.cluster is None
    of_rows = f"{kind}_of_{'+'.join(map(str, sizes))}_rows"
    if fills is True:
        if known and row_counts.traced_for_rows(kind, batch, sizes):
            return Variant(of_rows, False, rows_known=True, work_for_rows=True)
        return any_rows_variant(kind, may_be_empty=False)
    if fills is False and known and not setup.statistics.layers:
        return Variant(of_rows, False, rows_known=True, work_for_rows=False)
    return any_rows_variant(kind, may_be_empty=True)


def body(trainer, kind, variant):
    """fn(batch) -> the `kind` step's logs (predict: its outputs) on batch, in `variant`
    (a Variant: whether it skips empty micro-batches, whether its towers' work is traced
    for their rows)."""
    step = {"train": train_step, "eval": eval_step, "predict": predict_step}[kind]

    def traced(batch):
        with split.work_traced_for_rows(variant.work_for_rows):
            return step(trainer, batch, variant.may_be_empty)

    return traced


def any_rows_variant(kind, may_be_empty):
    """The Variant of `kind`'s step for batches of any rows that skips empty
    micro-batches (may_be_empty) or not."""
    return Variant(f"{kind}_with_empty_parts" if may_be_empty else kind, may_be_empty,
                   rows_known=False, work_for_rows=False)


def fills_every_micro_batch(setup, batch):
    """Whether `batch` gives every micro-batch of every tower a row: a bool, or a bool
    scalar Tensor where the rows are known only at run time."""
    return split.smallest_shard_rows(batch, setup.mesh.num_towers) >= setup.options.micro_batches


def micro_batch_rows(setup, batch):
    """The rows of each micro-batch of each tower for `batch` (Tensors or split.Shards):
    ints, or [] where the rows are known only at run time."""
    rows = ([split.batch_size(shard) for shard in batch] if isinstance(batch, split.Shards)
            else split.shard_sizes(split.batch_size(batch), setup.mesh.num_towers))
    if not all(isinstance(r, int) for r in rows):
        return []
    return [m for r in rows for m in split.shard_sizes(r, setup.options.micro_batches)]


def num_micro_batches(setup):
    """Micro-batches per step: towers x micro-batches per tower."""
    return setup.mesh.num_towers * setup.options.micro_batches


def loss_scale(optimizer):
    """The LossScaleOptimizer's current scale (float32 scalar), or None."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer.dynamic_scale.value
    return None


def _fractional_label(trainer, batch):
    """sparse_labels.first_fractional_label of the batch's labels (every shard's), on the
    main device; None where no loss reads float class ids, or with a cluster."""
    if trainer.cluster is not None:  # each worker has only its own labels: not yet
        return None
    parts = list(batch) if isinstance(batch, split.Shards) else [batch]
    with tf.device(trainer.setup.main_device):
        return sparse_labels.first_fractional_label(
            trainer.objective, [split.unpack_batch(part)[1] for part in parts])


def _check_some_gradient(trainer, result):
    """Raises ValueError, as the step is traced, where no weight gets a gradient (the
    optimizer's own "No gradients provided for any variable" names no cause)."""
    if result.grads and all(grad is None for grad in result.grads):
        integer = {tensor.dtype.name for tensor in tf.nest.flatten(result.y_pred[0])
                   if not tensor.dtype.is_floating}
        cause = (f"the model's outputs are {sorted(integer)}, and no gradient flows "
                 "through an integer: return floats (argmax or a cast after the loss, in "
                 "predict)" if integer else "check that the loss reads the model's outputs")
        raise ValueError(f"no trainable weight of model {trainer.model.name!r} gets a "
                         f"gradient from the loss: {cause}.")


def _train_step(trainer, batch, may_be_empty):
    setup, scale = trainer.setup, loss_scale(trainer.optimizer)
    fractional = _fractional_label(trainer, batch)
    labels_whole = True if fractional is None else tf.math.is_nan(fractional)
    result = run_towers(setup, trainer.objective, batch, scale, may_be_empty)      # 1-6
    _check_some_gradient(trainer, result)
    with tf.device(setup.main_device):
        grads = aggregate.clip_gradients(result.grads, setup.options.clip_global_norm, scale)
        grads_finite = aggregate.all_finite(grads)
        if setup.columns.cluster is not None:  # each worker has its own gradients
            grads_finite = worker_owners.finite_on_every_worker(grads_finite, trainer.cluster,
                                                    setup.main_device)
        # With loss scaling an overflowing gradient is routine: the
        # LossScaleOptimizer skips it and halves the scale. Only the loss decides.
        finite = aggregate.all_finite([result.loss]) & (grads_finite | (scale is not None))

    def apply():  # step 6, only for a finite step
        if setup.columns.cluster is None:
            apply_update(trainer.optimizer, grads, setup.columns.held_variables(),
                         setup.main_device)
        else:  # the state spread over the workers: each applies its own, then gathers
            worker_owners.apply_owned(trainer.optimizer, grads, setup.columns,
                                       setup.main_device)
        assign_state(trainer.model, result.state, when=grads_finite)
        return grads_finite

    metric_logs = trainer.metrics.update(batch, result.y_pred, setup.main_device,
                                         trainer.cluster, keep_if=finite & labels_whole)
    exchanged = list(metric_logs.values())
    if trainer.cluster is not None:
        # One all-reduce carries both signals: a stop signal to any worker stops every
        # worker after this same step, and the count of workers whose data has ended
        # (each then feeds an empty part) ends the epoch once it is all of them.
        [signals] = collectives.all_reduce_across_workers(
            [tf.stack([trainer.signals.stop_requested.read_value(),
                       trainer.signals.data_ended.read_value()])],
            trainer.cluster, cluster_lib.HOST_DEVICE)
        stop_requested, data_ended = signals[0] > 0, signals[1] >= trainer.cluster.num_workers
        exchanged += [stop_requested, data_ended]
        # A global batch of no rows (every worker's data ended) has nothing to apply:
        # its mean gradients and state would be zeros.
        finite_with_rows = finite & (result.examples > 0)
    else:
        finite_with_rows = finite & labels_whole  # the trainer refuses an empty batch
    # Across workers the metrics have an all-reduce of their own: it too comes
    # before the update, so a worker lost during the step leaves the weights alone.
    with tf.control_dependencies(exchanged):
        applied = tf.cond(finite_with_rows, apply, lambda: tf.constant(False))
    with tf.device(setup.main_device):
        logged_examples = tf.where(finite, result.examples, 0.0)
    logs = {"loss": result.loss, **dict(zip(trainer.objective.names, result.term_losses)),
            "finite": finite, "applied": applied, "examples": logged_examples, **metric_logs}
    if trainer.cluster is not None:
        logs.update(stop_requested=stop_requested, data_ended=data_ended)
    if fractional is not None:
        logs["fractional_label"] = fractional
    if scale is not None:
        logs["loss_scale"] = trainer.optimizer.dynamic_scale.value
    return logs


def eval_step(trainer, batch, may_be_empty):
    """The loss of `batch` as train_step computes it, on the main device, without
    gradients: logs {"loss", each loss term's, "examples", the metrics' results,
    "fractional_label" as train_step's} as scalar Tensors, the metrics updated with
    the towers' outputs. No other variable changes."""
    setup, objective = trainer.setup, trainer.objective
    split_batch = SplitBatch(setup, batch)                                          # 1
    terms, outputs, regularizations = [], [], []
    inference = _InferenceForwards(trainer)
    for _, this_tower in split_batch.towers(copy_weights):                         # 2
        with setup.tower_scope(this_tower.index), inference.calls() as forwards:
            tower_outputs, regularization = forward.predict(                        # 3
                setup.stages, this_tower, may_be_empty, forwards)
        with tf.device(this_tower.devices[-1]):
            _, y, sample_weight = split.unpack_batch(this_tower.shard)
            terms.append(objective.terms(y, tower_outputs, sample_weight))
            regularizations.append(forward.regularization_share(
                objective, regularization, this_tower.rows, split_batch.batch_rows))
        outputs.append(tower_outputs)
    with tf.device(setup.main_device):
        summed = objective.summed  # a sum term's value is its sum, over no denominator
        term_losses = [tf.add_n([t.sum for t in per_tower]) if i in summed else
                       tf.math.divide_no_nan(tf.add_n([t.sum for t in per_tower]),
                                             tf.add_n([t.units for t in per_tower]))
                       for i, per_tower in enumerate(zip(*terms))]
        metric_logs = trainer.metrics.update(batch, forward.concat_rows(outputs),
                                             setup.main_device)
        # Each tower's share of the regularisation, as in training (an empty tower's is 0).
        loss = tf.add_n([weight * value for weight, value in zip(objective.weights, term_losses)]
                        + [tf.identity(r) for r in regularizations if r is not None])
        logs = {"loss": loss, **dict(zip(objective.names, term_losses)),
                "examples": split_batch.batch_rows, **metric_logs}
    fractional = _fractional_label(trainer, batch)
    if fractional is not None:
        logs["fractional_label"] = fractional
    return logs


def predict_step(trainer, batch, may_be_empty):
    """The model's outputs for `batch`, (x,): each tower's for its shard, computed as
    eval_step computes them (inference mode, on the tower's copies of the weights, its
    shard whole through its stages), concatenated in row order on the main device, in
    the structure the model returns. No variable changes."""
    setup = trainer.setup
    split_batch = SplitBatch(setup, batch)                                          # 1
    outputs, inference = [], _InferenceForwards(trainer)
    for _, this_tower in split_batch.towers(copy_weights):                         # 2
        with setup.tower_scope(this_tower.index), inference.calls() as forwards:
            (y_pred, _), _ = forward.predict(setup.stages, this_tower, may_be_empty,  # 3
                                             forwards)
        outputs.append(y_pred)
    with tf.device(setup.main_device):
        return forward.concat_rows(outputs)


def inference_traced_once(setup):
    """Whether eval and predict steps call each stage's forward in inference mode traced
    once for every tower (traced_tower.traced_forwards), so that tracing them does not
    grow with the towers: from 2 towers (at 1 a traced function's call costs more than
    it shares)."""
    return setup.mesh.num_towers > 1


class _InferenceForwards:
    """The forwards an eval or predict step's towers call: where inference_traced_once,
    each stage's traced once, for the first tower that calls it; each tower's calls
    pointed, once made, at a copy (tower_trace.OptimisedCalls) that grappler optimised
    once on CPUs (the step's own graph then needs only cheap passes) and, with split
    layers, that names the tower's own part devices. Else None: each tower traces its
    own."""

    def __init__(self, trainer):
        setup = trainer.setup
        self.forwards, self.pointing = None, None
        if inference_traced_once(setup):
            self.forwards = traced_tower.traced_forwards(setup.stages, training=False)
            optimise = trainer.graph_rewrites.function_optimiser()
            if optimise is not None or setup.parts is not None:
                self.pointing = tower_trace.OptimisedCalls(optimise)

    @contextlib.contextmanager
    def calls(self):
        """Gives the forwards to one tower, whose places (op_parallel.layers.parts_on)
        are in effect; its calls are pointed at their copies at the end."""
        graph = tf.compat.v1.get_default_graph()
        known = len(graph.get_operations())
        yield self.forwards
        if self.pointing is not None:
            self.pointing.point(graph.get_operations()[known:])
