"""The tower step: steps 1-6 in one function (`run_towers`), and step 7.

`run_towers` is the whole algorithm on one screen, each line marked with its
step number; TowerTrainer compiles it, with `apply_update`, into one tf.function.
"""

import collections
import dataclasses
from typing import Optional, Union

import tensorflow as tf

from towers import aggregate, devices as devices_lib, exchange, schedule, split, stages as stages_lib
from towers import tower

ON_NONFINITE = ("raise", "skip")
STATE_POLICIES = ("mean", "first_tower")
SPARSE_POLICIES = ("keep", "dense")

TowerResult = collections.namedtuple("TowerResult",
                                     ["grads", "loss", "state", "y_pred", "examples"])
TowerResult.__doc__ = """Steps 1-6 of one global batch, everything on the main device.

grads: mean gradient per model.trainable_variables entry (None where unused),
  times the loss scale if one was given.
loss: scalar float32, mean loss over the global batch plus regularisation.
state: new value per model.non_trainable_variables entry (None where unchanged).
y_pred: model outputs for the whole batch, rows in batch order.
examples: float32 scalar, the number of examples in the batch.

With a cluster, all but y_pred are the global batch's, the same on every worker.
"""


@dataclasses.dataclass(frozen=True)
class TowerOptions:
    """How the tower step treats gradients and state; checked on construction.

    Attributes:
      accum_steps: micro-batches each tower runs one after another per step;
        their gradients are averaged (weighted by size) before the towers'.
      clip_global_norm: None, or clip the averaged gradient to this global norm.
      sparse_policy: "keep" (tf.IndexedSlices stay sparse), "dense" (densified
        on each tower), or a float in (0, 1]: densify a variable's gradient when
        a tower's first shard looks up more than that fraction of its rows.
      state_policy: "mean" (new non-trainable values averaged by shard size) or
        "first_tower" (tower 0's values, as the classic tutorials do).
      on_nonfinite: "raise" (NonFiniteError, nothing applied) or "skip"
        (nothing applied, counted in logs["skipped_steps"]).
      aggregation: how gradients meet, one of exchange.AGGREGATIONS: "main"
        (gathered on the main device), "tree", "collective" or "nccl".
      pack_gradients: exchange each tower's dense gradients as one flat buffer.
      variable_placement: "main" (towers read the main device's variables) or
        "replicated" (each tower reads its own copy, refreshed after each step).
      micro_batches: micro-batches each tower's shard is split into for the
        pipeline stages (with one stage, the same as accum_steps).
      pipeline_schedule: the order of each stage's forwards and backwards, one
        of schedule.SCHEDULES: "gpipe" or "1f1b".
    """
    accum_steps: int = 1
    clip_global_norm: Optional[float] = None
    sparse_policy: Union[str, float] = "keep"
    state_policy: str = "mean"
    on_nonfinite: str = "raise"
    aggregation: str = "main"
    pack_gradients: bool = False
    variable_placement: str = "main"
    micro_batches: int = 1
    pipeline_schedule: str = "gpipe"

    def __post_init__(self):
        if isinstance(self.accum_steps, bool) or not isinstance(self.accum_steps, int) \
                or self.accum_steps < 1:
            raise ValueError(f"accum_steps must be an integer >= 1, got {self.accum_steps!r}.")
        if self.clip_global_norm is not None and not (
                isinstance(self.clip_global_norm, (int, float))
                and not isinstance(self.clip_global_norm, bool) and self.clip_global_norm > 0):
            raise ValueError(
                f"clip_global_norm must be a positive number or None, got {self.clip_global_norm!r}.")
        if self.sparse_policy not in SPARSE_POLICIES and not (
                isinstance(self.sparse_policy, float) and 0 < self.sparse_policy <= 1):
            raise ValueError(
                f"sparse_policy must be one of {SPARSE_POLICIES} or a density threshold in "
                f"(0, 1], got {self.sparse_policy!r}.")
        if self.state_policy not in STATE_POLICIES:
            raise ValueError(
                f"state_policy must be one of {STATE_POLICIES}, got {self.state_policy!r}.")
        if self.on_nonfinite not in ON_NONFINITE:
            raise ValueError(
                f"on_nonfinite must be one of {ON_NONFINITE}, got {self.on_nonfinite!r}.")
        if self.aggregation not in exchange.AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {exchange.AGGREGATIONS}, got "
                             f"{self.aggregation!r}.")
        if not isinstance(self.pack_gradients, bool):
            raise ValueError(f"pack_gradients must be True or False, got {self.pack_gradients!r}.")
        if isinstance(self.micro_batches, bool) or not isinstance(self.micro_batches, int) \
                or self.micro_batches < 1:
            raise ValueError(
                f"micro_batches must be an integer >= 1, got {self.micro_batches!r}.")
        if self.micro_batches > 1 and self.accum_steps > 1:
            raise ValueError(
                f"accum_steps={self.accum_steps} and micro_batches={self.micro_batches} both "
                "split each tower's shard into micro-batches run one after another; set one "
                "of them (micro_batches with pipeline stages).")
        if self.pipeline_schedule not in schedule.SCHEDULES:
            raise ValueError(f"pipeline_schedule must be one of {schedule.SCHEDULES}, got "
                             f"{self.pipeline_schedule!r}.")
        if self.variable_placement not in devices_lib.VARIABLE_PLACEMENTS:
            raise ValueError(f"variable_placement must be one of "
                             f"{devices_lib.VARIABLE_PLACEMENTS}, got {self.variable_placement!r}.")

    @property
    def tower_schedule(self):
        """(micro-batches per shard, schedule name) for tower.run_tower.

        accum_steps is a one-stage pipeline run forward, backward, forward, ...
        so that one micro-batch's activations are alive at a time.
        """
        if self.accum_steps > 1:
            return self.accum_steps, "1f1b"
        return self.micro_batches, self.pipeline_schedule


def tower_gradients(model, loss, batch, devices, main_device=None, *, accum_steps=1,
                    state_policy="mean", loss_scale=None, cluster=None):
    """Steps 1-6: the shard-weighted mean gradient of `loss` on the whole batch.

    Call it inside your own tf.function and apply the gradients yourself. The
    model's non-trainable state (BatchNorm statistics) is updated, as calling
    the model in training mode would.

    Args:
      model: a built keras.Model.
      loss: a keras.losses.Loss or callable(y_true, y_pred) -> per-example losses.
      batch: (x, y) or (x, y, sample_weight), dim 0 = global batch, or its
        split.Shards (one per device).
      devices: tower device names, one shard each.
      main_device: where gradients are gathered and averaged; None = devices[0].
      accum_steps, state_policy: as in TowerOptions.
      loss_scale: None or a float32 scalar each tower multiplies its loss by
        (dynamic loss scaling); the gradients returned stay scaled.
      cluster: None, or a joined towers.Cluster: `batch` is then this worker's
        part of the global batch and the result is the global batch's mean,
        the same on every worker (towers.join_cluster first).

    Returns:
      (grads, logs): one gradient per model.trainable_variables entry, on
      main_device, and {"loss": scalar Tensor}.
    """
    options = TowerOptions(accum_steps=accum_steps, state_policy=state_policy)
    main_device = main_device or devices[0]
    result = run_towers(stages_lib.Stages(model), loss, batch, [[d] for d in devices],
                        [main_device], options, loss_scale=loss_scale, cluster=cluster)
    assign_state(model, result.state)
    return result.grads, {"loss": result.loss}


def run_towers(stages, loss, batch, grid, stage_devices, options, loss_scale=None,
               densify=None, replicas=None, cluster=None, first_tower=0, compiled_tower=None,
               may_be_empty=True):
    """Steps 1-6 of the tower algorithm on one global batch; returns a TowerResult.

    `batch`: (x, y[, sample_weight]), or its split.Shards, one per tower (the
    input pipeline did step 1: prefetch.ShardIterator).
    `stages`: the model as a stages.Stages (one stage: the whole model).
    `grid`: one row of devices per tower, one device per stage.
    `stage_devices`: per stage, its main device, where its variables live and
    its gradients are averaged; stage_devices[0] also gets the loss and outputs.
    `replicas`: a devices.Replicas for variable_placement="replicated", else None.
    `cluster`: None, or the towers.cluster.Cluster this worker belongs to; then
    `batch` is this worker's part of the global batch, its towers are numbered
    from `first_tower` (for their dropout seeds), and the result is the whole
    global batch's, the same on every worker.
    `compiled_tower`: None, or tower.compiled_tower's function, which then
    runs steps 3-4 of each tower with XLA.
    `may_be_empty`: False where the batch is known to give every micro-batch of
    every tower a row (fills_every_micro_batch): no tf.cond skips empty ones.
    """
    main_device, model = stage_devices[0], stages.model
    with tf.name_scope("split"):  # name scopes label the phases in a profiler trace
        shards, shard_sizes, rows = split.shards_of(batch, len(grid))             # 1
        batch_rows = tf.cast(rows, tf.float32)
    weights = [v.value for v in model.trainable_variables]
    state = [v.value for v in model.non_trainable_variables]
    outputs = []
    for i, (row, shard) in enumerate(zip(grid, shards)):
        with tf.name_scope(f"tower_{i}"):
            if replicas is None:                                                  # 2
                tower_weights = broadcast_stages(stages, weights, row)
                tower_state = broadcast_stages(stages, state, row, trainable=False)
            else:
                tower_weights, tower_state = replicas.read(i)
            if compiled_tower is None:
                outputs.append(tower.run_tower(                                   # 3, 4
                    stages, loss, shard, shard_sizes[i], batch_rows, tower_weights,
                    tower_state, row, first_tower + i, *options.tower_schedule, loss_scale,
                    densify, may_be_empty=may_be_empty))
            else:
                outputs.append(compiled_tower(                                    # 3, 4
                    shard, shard_sizes[i], batch_rows, tower_weights, tower_state, row,
                    tf.constant(first_tower + i), loss_scale, may_be_empty))
    grads, state = [], []
    for k, stage_device in enumerate(stage_devices):
        column = [row[k] for row in grid]
        grads.append(reduce_gradients(                                            # 5, 6
            [stages.select(o.grads, k) for o in outputs], column, stage_device, options))
        state.append(merge_state([stages.select(o.state, k, trainable=False) for o in outputs],
                                 shard_sizes, stage_device, options.state_policy))
    with tf.device(main_device):
        result = TowerResult(
            grads=stages.merge(grads),
            loss=tf.add_n([o.loss for o in outputs]),  # the towers' parts of the batch's loss
            state=stages.merge(state, trainable=False),
            y_pred=tower.concat_rows([o.y_pred for o in outputs]),
            examples=batch_rows)
    if cluster is None:
        return result
    return across_workers(result, cluster, main_device, options.state_policy)    # 6


def broadcast_stages(stages, values, row, trainable=True):
    """Step 2 for a tower: each stage's values (model order) copied to its device in `row`."""
    return stages.merge([devices_lib.broadcast_weights(stages.select(values, k, trainable), device)
                         for k, device in enumerate(row)], trainable)


def reduce_gradients(tower_grads, devices, device, options):
    """Steps 5-6: the towers' gradients (one list per tower, on `devices`) summed on
    `device` by options.aggregation's route. Each tower's are of its part of the
    batch's loss (rows / the batch's rows), so their sum is the batch's mean gradient:
    the mean weighted by shard size."""
    if not tower_grads[0]:
        return []  # a stage without trainable variables
    return exchange.sum_gradients(tower_grads, devices, device, options.aggregation,  # 5, 6
                                  options.pack_gradients)


def merge_state(tower_states, shard_sizes, device, state_policy):
    """New non-trainable values on `device`: the towers' mean by shard size, or tower 0's."""
    if state_policy == "mean":
        return aggregate.average_state(tower_states, shard_sizes, device)
    return aggregate.gather_gradients([tower_states[0]], device)[0]


def across_workers(result, cluster, main_device, state_policy):
    """Step 6 across workers: this worker's TowerResult -> the global batch's.

    Gradients, loss and (state_policy "mean") state are averaged weighted by
    each worker's example count; with "first_tower" the state is the chief's.
    y_pred stays this worker's own rows.
    """
    shared = list(result.grads) + [result.loss]
    if state_policy == "mean":
        shared += list(result.state)
    merged, examples = exchange.mean_across_workers(shared, result.examples, cluster,
                                                    main_device)
    grads, loss, state = merged[:len(result.grads)], merged[len(result.grads)], result.state
    if state_policy == "mean":
        state = merged[len(result.grads) + 1:]
    else:
        state, _ = exchange.mean_across_workers(state, float(cluster.is_chief), cluster,
                                                main_device)
    return result._replace(grads=grads, loss=loss, state=state, examples=examples)


def clip_gradients(grads, clip_global_norm, loss_scale=None):
    """The averaged gradients clipped to a global norm (of the unscaled gradients).

    As tf.clip_by_global_norm, but each gradient's squared norm and scaling are
    computed on its own device; only scalars travel.
    """
    if clip_global_norm is None:
        return grads
    # Gradients carry the loss scale; clipping them at scale * norm is the same as
    # clipping the unscaled gradients at norm.
    limit = clip_global_norm if loss_scale is None else clip_global_norm * loss_scale
    half_squares = []
    for grad in grads:
        if grad is not None:
            with tf.device(aggregate.dense_part(grad).device):
                half_squares.append(tf.nn.l2_loss(aggregate.dense_part(grad)))
    if not half_squares:
        return grads
    global_norm = tf.sqrt(tf.add_n(half_squares) * 2.0)
    # A non-finite norm makes every gradient NaN, as tf.clip_by_global_norm does.
    scale = limit * tf.minimum(1.0 / global_norm, 1.0 / limit) + (global_norm - global_norm)
    return [None if grad is None else _scaled(grad, scale) for grad in grads]


def _scaled(grad, scale):
    with tf.device(aggregate.dense_part(grad).device):
        if isinstance(grad, tf.IndexedSlices):
            return tf.IndexedSlices(grad.values * tf.cast(scale, grad.dtype), grad.indices,
                                    grad.dense_shape)
        return grad * tf.cast(scale, grad.dtype)


def apply_update(optimizer, grads, variables, main_device):
    """Step 7: the optimizer applies the averaged gradients, once, on the main device."""
    with tf.device(main_device), tf.name_scope("apply"):
        optimizer.apply_gradients(zip(grads, variables))


def assign_state(model, state, when=None):
    """Writes the merged non-trainable values (None = unchanged) into the model.

    `when`: None, or a bool scalar Tensor; where False the old values stay.
    """
    for variable, value in zip(model.non_trainable_variables, state):
        if value is not None:
            with tf.device(variable.value.device):
                variable.assign(value if when is None else tf.where(when, value, variable.value))
