"""The model's variables in columns: each a group of variables living together on one
device, where the towers read them (step 2) and their gradients meet (steps 5-6).

A column is a pipeline stage's variables that are in no split layer's part (one
stage without pipeline cuts), or a stage's part j of its split layers: stages,
parts, or both (the grid of towers x stages x parts) are one kind of column. With
variable_placement="spread" each such group is one column per tower, what that tower
holds of it (spread_owners): steps 2, 5 and 6 go over those shares the same way.
"""

import math

import tensorflow as tf

from towers.model_parallel import stages as stages_lib


class Columns(stages_lib.VariableGroups):
    """The columns of a model cut into `stages`, stage after stage: each stage's groups,
    its not-split variables and then each of its parts' (part j of its split layers),
    each group one column, or with spread placement one per tower (that tower's share
    of the group).

    Attributes:
      stages: the stages.Stages the columns refine.
      devices: per column, where its variables and optimizer slots live and its
        gradients meet.
      rows: per tower, its device per column: where it reads the column's weights
        and runs their work.
    """

    def __init__(self, stages, grid, stage_devices, parts=None, spread=False):
        """grid[i][k]: tower i's device for stage k; stage_devices[k]: where stage k's
        not-split variables live; parts: None, or an op_parallel.grid.PartRows (its
        rows[i][k][j]: tower i's device for stage k's part j); spread: each group's
        variables spread over its towers' devices (spread_owners, per stage and group),
        variable_placement="spread"."""
        self.stages = stages
        self._part_of = {} if parts is None else parts.part_of
        # {id(variable): the tower holding it, on its device for the variable's group}
        self._owner = self._spread_owners(len(grid)) if spread else None
        self._shares = len(grid) if spread else 1  # columns per group
        self._groups = 1 + (0 if parts is None else len(parts.rows[0][0]))  # per stage
        self.devices, self.rows = [], [[] for _ in grid]
        for k, device in enumerate(stage_devices):
            # Per group, each tower's device for it: the stage's, then each part's.
            towers_devices = [[row[k] for row in grid]] + (
                [] if parts is None else [[tower[k][j] for tower in parts.rows]
                                          for j in range(self._groups - 1)])
            for g, devices in enumerate(towers_devices):
                home = device if g == 0 else devices[0]
                self.devices += devices if spread else [home]
                for i in range(len(grid)):
                    self.rows[i] += [devices[i]] * self._shares
        super().__init__(stages.model)

    def reindex(self):
        """The stages' positions, then the columns', for the model's trainable set now."""
        self.stages.reindex()
        super().reindex()

    def _positions(self, variables, trainable):
        index = [[] for _ in self.devices]
        by_stage = self.stages.trainable_index if trainable else self.stages.state_index
        for k, positions in enumerate(by_stage):
            for i in positions:
                index[self._column_of(k, variables[i])].append(i)
        return index

    def _spread_owners(self, num_towers):
        """spread_owners of each stage's groups, each over the towers."""
        owners = {}
        for k in range(self.stages.num_stages):
            variables = self.stages.variables(k)
            for group in sorted({self._group_of(v) for v in variables}):
                owners.update(spread_owners(
                    [v for v in variables if self._group_of(v) == group], num_towers))
        return owners

    def _group_of(self, variable):
        """0 for a variable in no split layer's part, 1 + j for one of part j."""
        return 1 + self._part_of.get(id(variable), -1)

    def _column_of(self, stage, variable):
        share = 0 if self._owner is None else self._owner[id(variable)]
        return (stage * self._groups + self._group_of(variable)) * self._shares + share

    def variables(self, column):
        """Every variable (trainable and not) of `column`, whatever is trainable now."""
        stage = column // (self._groups * self._shares)
        return [v for v in self.stages.variables(stage) if self._column_of(stage, v) == column]


def spread_owners(variables, num_towers):
    """{id(variable): the tower holding it} for variable_placement="spread": each of
    `variables` (a model's, trainable and not), largest first, to the tower holding the
    fewest bytes so far (ties: the lowest index), so that every tower holds about 1/N of
    the bytes; a variable's optimizer slots and gradients' sum live with it. No tower
    holds more than 1/N of the bytes plus the largest variable's."""
    held, owners = [0] * num_towers, {}
    for variable in sorted(variables, key=lambda v: -_bytes(v)):  # sorted() keeps ties' order
        tower = held.index(min(held))
        owners[id(variable)] = tower
        held[tower] += _bytes(variable)
    return owners


def _bytes(variable):
    return math.prod(variable.shape) * tf.as_dtype(variable.dtype).size
