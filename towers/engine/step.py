"""The tower step: steps 1-5 in one function (`run_towers`), and step 6.

`run_towers` is the whole algorithm on one screen, each line marked with its
step number; TowerTrainer compiles it, with `apply_update`, into one tf.function.
"""

import collections
import contextlib
import dataclasses
from typing import Callable, Optional

import tensorflow as tf

from towers import devices as devices_lib
from towers.data_parallel import aggregate, batch_statistics, exchange, replicas as replicas_lib
from towers.data_parallel import split
from towers.engine import denominators, forward, tower
from towers.engine.options import TowerOptions
from towers.model_parallel import stages as stages_lib
from towers.placement import columns as columns_lib, worker_owners

TowerResult = collections.namedtuple(
    "TowerResult", ["grads", "loss", "state", "y_pred", "examples", "term_losses"])
TowerResult.__doc__ = """Steps 1-5 of one global batch, everything on the main device.

grads: mean gradient per setup.columns.held_variables() entry (None where unused),
  times the loss scale if one was given (and, with an unreduced loss, times its
  entries: Keras's gradient of their sum): per model.trainable_variables entry, but
  for a variable held as slabs (variable_placement="spread") one per slab. With
  spread placement in a cluster, None for the entries another worker owns.
loss: scalar float32, the batch's loss as Keras computes and logs it (each loss
  term's mean over the batch, or a sum term's sum, weighted and added) plus
  regularisation.
state: new value per model.non_trainable_variables entry (None where unchanged).
y_pred: (outputs, masks) for the whole batch, rows in batch order (forward.forward's).
examples: float32 scalar, the number of examples in the batch.
term_losses: per loss term its unweighted value (Keras's "<output>_loss" logs),
  or [] for a loss of one term.

With a cluster, all but y_pred are the global batch's, the same on every worker.
"""


@dataclasses.dataclass(frozen=True)
class StepSetup:
    """Everything a step needs besides the batch and the loss: one frozen value, built
    when the trainer is built (the mesh, the options), replaced once on the first batch
    with what it decides (training/first_batch.py: the stages, dense_choices,
    first_tower), and again with what depends on the trainable set whenever that changes
    (training/trainable.py: densify, replicas, compiled_tower, tables, trainable_ids).

    Attributes:
      stages: the model as a stages.Stages (one stage: the whole model).
      mesh: the devices.Mesh of towers x stages (x parts): where each tower runs,
        and each stage's main device (mesh.stage_devices), where its variables live
        and its gradients meet; stage 0's also gets the loss and outputs.
      options: a TowerOptions.
      cluster: None, or the towers.Cluster this worker belongs to; the batch is
        then this worker's batch, and the step's result the
        whole global batch's, the same on every worker.
      first_tower: global index of this worker's first tower (dropout seeds).
      trainable_ids: None before the first batch, then the ids of the
        model.trainable_variables that the columns' positions, densify, replicas,
        compiled_tower and tables are set up for (TowerTrainer sets them up again
        when a layer is frozen or unfrozen).
      dense_choices: None, or per variable of the model (by id) whether each tower
        densifies its sparse gradient (tower.choose_dense_gradients, on the first batch).
      densify: None, or dense_choices per trainable variable.
      replicas: a replicas.Replicas with variable_placement="replicated", else None.
      compiled_tower: None, or traced_tower.compiled_tower's function, which then runs
        steps 3-4 of each tower, traced once for all of them (with XLA where
        jit_compile; else where traced_tower.traced_once).
      route: steps 4-5, exchange.route(options.aggregation, options.pack_gradients):
        fn(tower_grads, devices, device) -> the towers' sum on `device`.
      parts: None, or an op_parallel.grid.Parts for a model with split layers:
        where each stage's parts live and where each tower runs them.
      columns: the variables' columns.Columns, built with the stages (with_stages):
        steps 2, 4 and 5 go column by column (stages, parts, or both).
      tables: None, or per columns.held_variables() entry whether it is an embedding
        table the towers look up where it lives (op_parallel.tables): step 2 passes the
        variable on instead of copying it.
      statistics: the batch_statistics.Meeting of the model's BatchNormalization layers
        whose statistics are the global batch's (options.batch_statistics, or built
        synchronized=True), built with the stages.
    """
    stages: stages_lib.Stages
    mesh: devices_lib.Mesh
    options: TowerOptions
    cluster: Optional[object] = None
    first_tower: int = 0
    trainable_ids: Optional[tuple] = None
    dense_choices: Optional[dict] = None
    densify: Optional[list] = None
    replicas: Optional[replicas_lib.Replicas] = None
    compiled_tower: Optional[Callable] = None
    route: Callable = dataclasses.field(init=False)
    parts: Optional[object] = None
    tables: Optional[list] = None
    columns: Optional[columns_lib.Columns] = None
    statistics: Optional[batch_statistics.Meeting] = None

    def __post_init__(self):
        # Set while the value is made: what follows from the options and the stages.
        object.__setattr__(self, "route", exchange.route(self.options.aggregation,
                                                         self.options.pack_gradients))
        if self.stages is not None and self.columns is None:
            object.__setattr__(self, "columns", columns_lib.Columns(
                self.stages, self.mesh, self.parts,
                spread=self.options.variable_placement == "spread", cluster=self.cluster))
            object.__setattr__(self, "statistics", batch_statistics.Meeting.of_model(
                self.stages.model, self.options.batch_statistics,
                [self.mesh.tower_devices(i) for i in range(self.mesh.num_towers)]))

    def with_stages(self, stages):
        """This set-up for the model cut into `stages` (a stages.Stages), with its
        columns and its BatchNormalization layers' meeting built for them."""
        return dataclasses.replace(self, stages=stages, columns=None, statistics=None)

    @property
    def main_device(self):
        return self.mesh.main_device

    @contextlib.contextmanager
    def tower_scope(self, tower_index):
        """Where tower `tower_index` traces its model: its split layers on its devices, its
        global BatchNormalization layers meeting the other towers'."""
        with (contextlib.nullcontext() if self.parts is None else self.parts.scope(tower_index)
              ), self.statistics.on_tower(tower_index):
            yield


def run_towers(setup, objective, batch, loss_scale=None, may_be_empty=True):
    """Steps 1-5 of the tower algorithm on one global batch; returns a TowerResult.

    `setup`: a StepSetup (the devices, the model's stages, the options).
    `objective`: a losses.Objective, the loss as keras.Model.compile takes it.
    `batch`: (x, y[, sample_weight]), or its split.Shards, one per tower (the
    input pipeline did step 1: prefetch.ShardIterator).
    `loss_scale`: None, or a float32 scalar every tower multiplies its loss by.
    `may_be_empty`: False where the batch is known to give every micro-batch of
    every tower a row: no tf.cond skips empty ones.
    """
    stages, options = setup.stages, setup.options
    split_batch = SplitBatch(setup, batch)                                          # 1
    shard_sizes, batch_rows, state_values = (split_batch.working_sizes, split_batch.batch_rows,
                                             split_batch.state)
    setup.statistics.start_step(shard_sizes)  # where step 3's global BatchNorms meet
    state_rules = aggregate.state_rules(stages.model.non_trainable_variables,
                                        options.state_policy)
    # A sum term's share is its sum; in a cluster, scaled for step 5's mean over workers.
    sum_scale = denominators.sum_scale(objective, batch_rows, setup.cluster, setup.main_device)
    step = tower.StepWork(stages, objective, batch_rows, loss_scale, options.micro_batches,
                          options.pipeline_schedule, may_be_empty,
                          recompute_stages=options.recompute_stages, sum_scale=sum_scale)
    flights = [(scope, this_tower.index, start_tower(setup, step, this_tower))      # 3
               for scope, this_tower in split_batch.towers(read_weights)]           # 2
    # A masked output's loss is over the whole batch's unmasked entries: counted here.
    counts = denominators.count([f.terms for _, _, f in flights], objective, batch_rows,
                                setup.cluster, setup.main_device, sum_scale)
    outputs = []
    for scope, i, flight in flights:
        with tf.name_scope(scope), setup.tower_scope(i):
            outputs.append(flight.finish(counts.scales, setup.densify))             # 4
    outputs = denominators.fold(outputs, objective, counts, setup.main_device)
    grads, state, columns = [], [], setup.columns
    tower_devices = [columns.tower_devices[i] for _, i, _ in flights]
    tower_grads = [columns.slab_gradients(o.grads, devices)
                   for o, devices in zip(outputs, tower_devices)]
    for k, column_device in enumerate(columns.devices):
        column = [devices[k] for devices in tower_devices]
        grads.append(setup.route([columns.select(g, k) for g in tower_grads],       # 4, 5
                                 column, column_device))
        state.append(aggregate.merge_state(
            [columns.select(o.state, k, trainable=False) for o in outputs],
            columns.select(state_values, k, trainable=False), columns.select(
                state_rules, k, trainable=False), shard_sizes, column_device))
    with tf.device(setup.main_device):
        result = TowerResult(
            grads=columns.merge(grads),
            loss=tf.add_n([o.loss for o in outputs]),  # the towers' shares of the batch's loss
            state=columns.merge(state, trainable=False),
            y_pred=forward.concat_rows([o.y_pred for o in outputs]),
            examples=batch_rows, term_losses=counts.term_losses)
    if columns.cluster is not None:  # the state spread over the workers
        result = worker_owners.means_on_owners(result, setup, state_rules, state_values)  # 5
    elif setup.cluster is not None:
        result = exchange.across_workers(result, setup.cluster, setup.main_device,   # 5
                                         state_rules, state_values)
    # Keras differentiates an unreduced loss's sum: the mean gradient times its entries.
    return result._replace(grads=denominators.scale_gradients(result.grads, counts))


class SplitBatch:
    """Steps 1 and 2 of every tower: the batch split into one shard per tower, then, tower
    by tower, each tower's copies of the weights (`towers`).

    A tower whose shard is known to have no rows as the step is traced (a batch of fewer
    rows than towers) is left out: it has nothing to compute, and it weighs 0 in every
    mean. Not where BatchNorms meet across the towers: each tower's forward meets the
    others' (a tf.cond then skips the empty one's model: forward.unless_empty).

    Attributes:
      shards, sizes: one shard per tower (split.shards_of) and its rows.
      working: the indices of the towers that work (`towers` yields them), in order;
        working_sizes: their rows.
      batch_rows: the batch's rows, a float32 scalar.
      weights, state: the values, one per setup.columns.held_variables() entry and one
        per model.non_trainable_variables entry, each read once for every tower to copy;
        a value a tower reads where it lives (`_read_where_it_lives`) is the variable.
    """

    def __init__(self, setup, batch):
        with tf.name_scope("split"):  # name scopes label the phases in a profiler trace
            self.shards, self.sizes, rows = split.shards_of(batch, setup.mesh.num_towers)
            self.batch_rows = tf.cast(rows, tf.float32)
        self.setup = setup
        self.working = [i for i, size in enumerate(self.sizes)
                        if setup.statistics.layers or not split.known_empty(size)]
        self.working_sizes = [self.sizes[i] for i in self.working]
        self.weights = [v.value if in_place else tf.convert_to_tensor(v.value)
                        for v, in_place in zip(setup.columns.held_variables(),
                                               _read_where_it_lives(setup))]
        self.state = [tf.convert_to_tensor(v.value)
                      for v in setup.stages.model.non_trainable_variables]

    def towers(self, read):
        """Per working tower, inside its name scope, (the scope, a tower.TowerWork of its
        shard and of the weights and state read(setup, weights, state, i) gives it: step
        2 by read_weights, or copy_weights where nothing may be written)."""
        for i in self.working:
            shard = self.shards[i]
            with tf.name_scope(f"tower_{i}") as scope:
                weights, state = read(self.setup, self.weights, self.state, i)
                yield scope, tower.TowerWork(shard, self.sizes[i], weights, state,
                                             self.setup.mesh.tower(i), i)


def start_tower(setup, step, this_tower):
    """Steps 3-4 on one tower (a tower.TowerWork; its index is this worker's) up to where
    the batch's counts are needed: tower.start_flight's flight, or that of the work
    traced once for every tower (setup.compiled_tower)."""
    i = this_tower.index
    this_tower = dataclasses.replace(this_tower, index=setup.first_tower + i)
    if isinstance(this_tower.rows, int) and 0 < this_tower.rows < step.micro_batches:
        # Fewer rows than micro-batches, known as traced: one micro-batch per row (as the
        # split gives them), and none for what would have no row to compute.
        step = dataclasses.replace(step, micro_batches=this_tower.rows)
    with setup.tower_scope(i):
        if setup.compiled_tower is not None:
            return setup.compiled_tower(step, this_tower)
        return tower.start_flight(step, this_tower)


def read_weights(setup, weights, state, tower_index):
    """Step 2 for one tower: (weights, state), one per model.trainable_variables and
    non_trainable_variables entry, each stage's on the tower's device for it: copies
    of the values where they live (`weights`: held_variables'), or the tower's replicas."""
    if setup.replicas is not None:
        return setup.replicas.read(tower_index)
    return copy_weights(setup, weights, state, tower_index)


def copy_weights(setup, weights, state, tower_index):
    """Step 2 by copying: (weights, state) of the values where they live (weights: one
    per setup.columns.held_variables() entry), each column's copied to its device of the
    tower's devices (a stage's, or a split layer part's), a variable held as slabs joined
    there. Evaluation reads this way too: it writes no replica."""
    columns = setup.columns
    devices = columns.tower_devices[tower_index]
    return (columns.join_slabs(broadcast_columns(columns, weights, devices,
                                                 kept=_read_where_it_lives(setup)), devices),
            broadcast_columns(columns, state, devices, trainable=False))


def _read_where_it_lives(setup):
    """Per setup.columns.held_variables() entry, whether a tower reads the variable where
    it lives, not a copy: an embedding table (looked up there, op_parallel.tables) or a
    slab (joined on the tower, columns.join_slabs)."""
    slab_flags = setup.columns.slab_flags()
    return [table or slab for table, slab in zip(setup.tables or [False] * len(slab_flags),
                                                  slab_flags)]


def broadcast_columns(columns, values, devices, trainable=True, kept=None):
    """Step 2 for a tower: each column's values (model order) copied to its device in
    `devices` (a tower's, per column); `columns` a columns.Columns.
    kept: None, or per value whether it is passed on uncopied (a table)."""
    kept = kept or [False] * len(values)
    return columns.merge(
        [replicas_lib.broadcast_weights(columns.select(values, k, trainable), device,
                                        columns.select(kept, k, trainable))
         for k, device in enumerate(devices)], trainable)


def apply_update(optimizer, grads, variables, main_device):
    """Step 6: the optimizer applies the averaged gradients, once, on the main device."""
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
