"""The model's variables in columns: each a group of variables living together on one
device, where the towers read them (step 2) and their gradients meet (steps 4-5).

A column is a pipeline stage's variables that are in no split layer's part (one
stage without pipeline cuts), or a stage's part j of its split layers: stages,
parts, or both (the grid of towers x stages x parts) are one kind of column. With
variable_placement="spread" each such group is one column per tower, what that tower
holds of it (spread_owners), a variable larger than what a tower holds as one slab of
its rows per tower (slabs.py): steps 2, 4 and 5 go over those columns the same way.
"""

import collections
import math

import tensorflow as tf

from towers import compat
from towers.model_parallel import stages as stages_lib
from towers.placement import slabs


class Columns(stages_lib.VariableGroups):
    """The columns of a model cut into `stages`, stage after stage: each stage's groups,
    its not-split variables and then each of its parts' (part j of its split layers),
    each group one column, or with spread placement one per tower (that tower's share
    of the group).

    Attributes:
      stages: the stages.Stages the columns refine.
      devices: per column, where its variables and optimizer slots live and its
        gradients meet.
      tower_devices: per tower, its device per column: where it reads the column's
        weights and runs their work.
      cluster: None, or the towers.Cluster whose workers the state is spread over
        (spread placement in a cluster of 2 workers or more; worker_owners.py).
    """

    def __init__(self, stages, mesh, parts=None, spread=False, cluster=None):
        """mesh: the step's devices.Mesh (mesh.grid[i][k]: tower i's device for stage
        k; mesh.stage_devices[k]: where stage k's not-split variables live;
        mesh.parts[i][k][j]: tower i's device for stage k's part j); parts: None, or an
        op_parallel.grid.Parts for a model with split layers; spread: each group's
        variables spread over its towers' devices (spread_owners, per stage and group),
        variable_placement="spread"; with a `cluster` (a towers.Cluster of 2 workers or
        more) spread over its workers instead (worker_owners), each worker's towers
        reading the columns as without spread."""
        self.stages = stages
        self.cluster = cluster if spread and cluster is not None and \
            cluster.num_workers > 1 else None
        spread = spread and self.cluster is None
        self._part_of = {} if parts is None else parts.part_of
        self._shares = mesh.num_towers if spread else 1  # columns per group
        self._groups = 1 + (0 if parts is None else mesh.shape["part"])  # per stage
        self.devices, self.tower_devices = [], [[] for _ in range(mesh.num_towers)]
        group_devices = []  # per stage and group: each tower's device for it
        for k, device in enumerate(mesh.stage_devices):
            # Per group, each tower's device for it: the stage's, then each part's.
            towers_devices = [mesh.stage(k)] + (
                [] if parts is None else [[tower[k][j] for tower in mesh.parts]
                                          for j in range(self._groups - 1)])
            for g, devices in enumerate(towers_devices):
                group_devices.append(devices)
                home = device if g == 0 else devices[0]
                self.devices += devices if spread else [home]
                for i in range(mesh.num_towers):
                    self.tower_devices[i] += [devices[i]] * self._shares
        # {id(variable): Slabbed}: the variables spread placement holds as slabs
        # (slabs.py) once hold_slabs ran.
        self.slabbed = {}
        # {id(variable): the tower holding it, on its device for the variable's group}
        self._owner = self._spread_owners(group_devices) if spread else None
        # {id(variable): the worker owning each of its held entries}, with a cluster
        self._workers = None if self.cluster is None else self._worker_owners()
        super().__init__(stages.model)

    def reindex(self):
        """The stages' positions, then the columns', for the model's trainable set now."""
        self.stages.reindex()
        super().reindex()

    def hold_slabs(self, optimizer):
        """Holds each variable in self.slabbed (spread_owners') as slabs on its towers,
        before `optimizer` makes its slots.

        Raises:
          ValueError: the optimizer cannot update them slab by slab
            (slabs.check_slab_updates); nothing is held as slabs.
        """
        slabbed = [(s.variable, s.devices, s.sizes) for s in self.slabbed.values()]
        slabs.check_slab_updates(optimizer, slabbed)
        for variable, devices, sizes in slabbed:
            slabs.hold(variable, devices, sizes, optimizer)

    def signature(self):
        """Per column, its device and the (path, shape) of the trainable variables held
        there (a slab's own): equal for two layouts only where steps 4-5 make the same
        ops."""
        held = self.held_variables()
        return tuple((device, tuple((held[i].path, tuple(held[i].shape)) for i in positions))
                     for device, positions in zip(self.devices, self.trainable_index))

    def check_held(self):
        """Raises ValueError, in one line, when a slabbed variable is no longer held in
        the slabs hold_slabs made (slabs.whole_variables, or another trainer's slabs): the
        optimizer's slots would train slabs the model no longer reads."""
        for slabbed in self.slabbed.values():
            if not slabs.is_held_on(slabbed.variable, slabbed.devices, slabbed.sizes):
                raise ValueError(
                    f"{slabbed.variable.path!r} is no longer held in the slabs this trainer "
                    "held it in (towers.whole_variables, or another trainer's placement), "
                    "and this trainer's optimizer updates those slabs; make a new "
                    "TowerTrainer with a fresh optimizer.")

    def held_variables(self):
        """The variables the optimizer updates: model.trainable_variables, each slabbed
        one replaced by its slabs (hold_slabs first). Gradients, steps 5-7, are of these."""
        return slabs.held_variables(self.model.trainable_variables)

    def held_owners(self):
        """Per held_variables entry, the worker whose optimizer updates it (spread over a
        cluster's workers), or None where every worker updates every entry."""
        if self._workers is None:
            return None
        return [worker for variable in self.model.trainable_variables
                for worker in self._workers[id(variable)]]

    def owned_variables(self):
        """The held_variables entries this worker's optimizer updates and holds slots
        for: all of them, or spread over a cluster's workers this worker's own."""
        held, owners = self.held_variables(), self.held_owners()
        if owners is None:
            return held
        return [variable for variable, worker in zip(held, owners)
                if worker == self.cluster.task_index]

    def slab_flags(self):
        """Per held_variables entry, whether it is a slab of a slabbed variable."""
        return [flag for variable in self.model.trainable_variables
                for flag in ([True] * len(self.slabbed[id(variable)].sizes)
                             if id(variable) in self.slabbed else [False])]

    def join_slabs(self, values, devices):
        """Step 2 on a tower: `values`, one per held_variables entry on its device of
        `devices` (a tower's entry of self.tower_devices), as one per
        model.trainable_variables entry: each slabbed variable's slabs joined on the
        tower's device for it (an all-gather)."""
        if not self.slabbed:
            return values
        values, joined = iter(values), []
        for variable in self.model.trainable_variables:
            if id(variable) not in self.slabbed:
                joined.append(next(values))
                continue
            slabbed = self.slabbed[id(variable)]
            rows = [next(values) for _ in slabbed.sizes]
            with tf.device(devices[slabbed.columns[0]]):
                joined.append(tf.concat(rows, 0))
        return joined

    def slab_gradients(self, grads, devices):
        """Before steps 4-5 on a tower: `grads`, one per model.trainable_variables entry, as
        one per held_variables entry: each slabbed variable's gradient divided into its
        slabs' rows on the tower's device for it (each then meets where its slab lives: a
        reduce-scatter)."""
        if not self.slabbed:
            return grads
        held = []
        for variable, grad in zip(self.model.trainable_variables, grads):
            if id(variable) not in self.slabbed:
                held.append(grad)
                continue
            slabbed = self.slabbed[id(variable)]
            with tf.device(devices[slabbed.columns[0]]):
                held += slabs.slab_rows(grad, slabbed.sizes)
        return held

    def _positions(self, variables, trainable):
        """Per column, the positions of its entries: in held_variables' order where
        `trainable` (a slabbed variable's slabs in their towers' columns), else in
        `variables`'."""
        index = [[] for _ in self.devices]
        by_stage = self.stages.trainable_index if trainable else self.stages.state_index
        # where each variable's first held entry is, and how many it has
        counts = [len(self.slabbed[id(v)].sizes) if trainable and id(v) in self.slabbed else 1
                  for v in variables]
        starts = [sum(counts[:i]) for i in range(len(variables))]
        for k, positions in enumerate(by_stage):
            for i in positions:
                if trainable and id(variables[i]) in self.slabbed:
                    for t, column in enumerate(self.slabbed[id(variables[i])].columns):
                        index[column].append(starts[i] + t)
                else:
                    index[self._column_of(k, variables[i])].append(starts[i])
        return index

    def _spread_owners(self, group_devices):
        """spread_owners of each stage's groups, each over the towers' devices for it;
        its slabbed variables go into self.slabbed."""
        owners = {}
        for k in range(self.stages.num_stages):
            variables = self.stages.variables(k)
            for group in sorted({self._group_of(v) for v in variables}):
                group_owners, slabbed = spread_owners(
                    [v for v in variables if self._group_of(v) == group],
                    group_devices[k * self._groups + group],
                    (k * self._groups + group) * self._shares)
                owners.update(group_owners)
                self.slabbed.update(slabbed)
        return owners

    def _worker_owners(self):
        """spread_owners of the model's variables (trainable and not, as for towers: a
        layer unfrozen later has its owner) over the cluster's workers, the same on every
        worker whatever its towers: {id(variable): the worker of each of its held
        entries}. A variable across a worker's run is held as slabs, all in its column
        on this worker (hold_slabs): each worker's rows a variable of their own. They go
        into self.slabbed."""
        staged = [(k, variable) for k in range(self.stages.num_stages)
                  for variable in self.stages.variables(k)]
        owners, slabbed = spread_owners([variable for _, variable in staged],
                                        [None] * self.cluster.num_workers)
        workers = {}
        for k, variable in staged:
            key = id(variable)
            if key not in slabbed:
                workers[key] = [owners[key]]
                continue
            held, column = slabbed[key], self._column_of(k, variable)
            workers[key] = held.columns  # spread_owners' columns, counted from 0: workers
            self.slabbed[key] = held._replace(devices=[self.devices[column]] * len(held.sizes),
                                              columns=[column] * len(held.sizes))
        return workers

    def _group_of(self, variable):
        """0 for a variable in no split layer's part, 1 + j for one of part j."""
        return 1 + self._part_of.get(id(variable), -1)

    def _column_of(self, stage, variable):
        share = 0 if self._owner is None else self._owner[id(variable)]
        return (stage * self._groups + self._group_of(variable)) * self._shares + share

    def variables(self, column):
        """Every variable (trainable and not) held in `column`: a slabbed variable's slab
        there (hold_slabs first) in its place."""
        stage = column // (self._groups * self._shares)
        held = []
        for variable in self.stages.variables(stage):
            if id(variable) in self.slabbed:
                held += [slab for slab, slab_column in zip(
                    compat.held_slabs(variable).variables, self.slabbed[id(variable)].columns)
                    if slab_column == column]
            elif self._column_of(stage, variable) == column:
                held.append(variable)
        return held


Slabbed = collections.namedtuple("Slabbed", ["variable", "devices", "sizes", "columns"])
Slabbed.__doc__ = """A variable spread placement holds as slabs (slabs.py): slab t of `sizes[t]`
rows on `devices[t]`, in column `columns[t]`."""


def spread_owners(variables, devices, first_column=0):
    """(owners, slabbed) for variable_placement="spread" of `variables` (a model's, trainable
    and not, of one group), over its towers (`devices`: each tower's device for the group;
    tower t's share in column first_column + t).

    owners: {id(variable): the tower holding it}; its optimizer slots and gradients' sum
    live with it. slabbed: {id(variable): Slabbed} for the variables held as slabs. The
    variables, largest first, are laid end to end and the run of their bytes is divided
    into N equal runs, one per tower, at row boundaries (each row of a variable, along dim
    0, to the tower whose run holds its middle): ZeRO's partition of its flat buffer, by
    rows. A variable within one run lives whole on its tower; one across a run's end is
    held as slabs (slabs.can_hold), one per tower, at most N - 1 of them; one that cannot
    be (of one row, or not trainable) goes whole to the run holding its middle. So no
    tower holds more than 1/N of the bytes plus half a row (or half a variable that cannot
    be held as slabs) at each end of its run. A slabbed variable's owner is its first
    slab's tower, where a step reads it whole if it is frozen later.
    """
    num_towers = len(devices)
    share = sum(_bytes(v) for v in variables) / num_towers or 1.0
    owners, slabbed, offset = {}, {}, 0
    for variable in sorted(variables, key=lambda v: -_bytes(v)):  # sorted() keeps ties' order
        size = _bytes(variable)
        if num_towers == 1 or not slabs.can_hold(variable):
            owners[id(variable)] = min(num_towers - 1, int((offset + size / 2) // share))
            offset += size
            continue
        # Row r goes to the tower whose run of bytes holds its middle.
        rows, row_bytes = variable.shape[0], size / variable.shape[0]
        starts = [0] + [min(rows, max(0, math.ceil((t * share - offset) / row_bytes - 0.5)))
                        for t in range(1, num_towers)] + [rows]
        slab_towers = [t for t in range(num_towers) if starts[t + 1] > starts[t]]
        owners[id(variable)] = slab_towers[0]
        if len(slab_towers) > 1:
            slabbed[id(variable)] = Slabbed(variable, [devices[t] for t in slab_towers],
                                            [starts[t + 1] - starts[t] for t in slab_towers],
                                            [first_column + t for t in slab_towers])
        offset += size
    return owners, slabbed


def _bytes(variable):
    return math.prod(variable.shape) * tf.as_dtype(variable.dtype).size
