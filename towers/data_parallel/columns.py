"""The model's variables in columns: each a group of variables living together on one
device, where the towers read them (step 2) and their gradients meet (steps 5-6).

A column is a pipeline stage's variables that are in no split layer's part (one
stage without pipeline cuts), or a stage's part j of its split layers: stages,
parts, or both (the grid of towers x stages x parts) are one kind of column. With
variable_placement="spread" a column is what one tower holds (its owner's share,
spread_owners): steps 2, 5 and 6 go over owners the same way.
"""

import math

import tensorflow as tf

from towers.model_parallel import stages as stages_lib


class Columns(stages_lib.VariableGroups):
    """The columns of a model cut into `stages`, each stage's not-split variables then
    its parts', stage after stage.

    Attributes:
      stages: the stages.Stages the columns refine.
      devices: per column, where its variables and optimizer slots live and its
        gradients meet.
      rows: per tower, its device per column: where it reads the column's weights
        and runs their work.
    """

    def __init__(self, stages, grid, stage_devices, parts=None, owners=None):
        """grid[i][k]: tower i's device for stage k; stage_devices[k]: where stage k's
        not-split variables live; parts: None, or an op_parallel.grid.PartRows (its
        rows[i][k][j]: tower i's device for stage k's part j); owners: None, or
        (spread placement, one stage, no parts) {id(variable): the tower holding it}."""
        self.stages = stages
        self._part_of = {} if parts is None else parts.part_of
        self._width = 1 + (0 if parts is None else len(parts.rows[0][0]))  # columns per stage
        self._owner = owners
        self.devices, self.rows = [], [[] for _ in grid]
        if owners is not None:  # column t: what tower t holds, read by each on its own device
            self.devices = [row[0] for row in grid]
            self.rows = [[row[0]] * len(grid) for row in grid]
        else:
            for k, device in enumerate(stage_devices):
                self.devices += [device] + ([] if parts is None else parts.rows[0][k])
                for i, row in enumerate(grid):
                    self.rows[i] += [row[k]] + ([] if parts is None else parts.rows[i][k])
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

    def _column_of(self, stage, variable):
        if self._owner is not None:
            return self._owner[id(variable)]
        return stage * self._width + 1 + self._part_of.get(id(variable), -1)

    def variables(self, column):
        """Every variable (trainable and not) of `column`, whatever is trainable now."""
        stage = 0 if self._owner is not None else column // self._width
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
