"""The model's variables in columns: each a group of variables living together on one
device, where the towers read them (step 2) and their gradients meet (steps 5-6).

A column is a pipeline stage's variables that are in no split layer's part (one
stage without pipeline cuts), or a stage's part j of its split layers: stages,
parts, or both (the grid of towers x stages x parts) are one kind of column.
"""

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

    def __init__(self, stages, grid, stage_devices, parts=None):
        """grid[i][k]: tower i's device for stage k; stage_devices[k]: where stage k's
        not-split variables live; parts: None, or an op_parallel.grid.PartRows (its
        rows[i][k][j]: tower i's device for stage k's part j)."""
        self.stages = stages
        self._part_of = {} if parts is None else parts.part_of
        self._width = 1 + (0 if parts is None else len(parts.rows[0][0]))  # columns per stage
        self.devices, self.rows = [], [[] for _ in grid]
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
                part = self._part_of.get(id(variables[i]), -1)
                index[k * self._width + 1 + part].append(i)
        return index

    def variables(self, column):
        """Every variable (trainable and not) of `column`, whatever is trainable now."""
        stage, place = divmod(column, self._width)
        return [v for v in self.stages.variables(stage)
                if 1 + self._part_of.get(id(v), -1) == place]
