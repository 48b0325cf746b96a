"""Training a split model on a grid of towers x parts.

Row i of the grid is tower i's devices, one per part: tower i runs part j of
every split layer on rows[i][j] and the layers not split on its own device.
Part j's variables and optimizer slots live on the first row's device j, where
split_layers created them; the towers' gradients of part j meet there (steps
5-6 per column, as per pipeline stage) and its update is applied there.
"""

from towers import devices as devices_lib
from towers.model_parallel import stages as stages_lib
from towers.op_parallel import exactness, layers as layers_lib
from towers.op_parallel.plan import is_split, parallel_forms


def tower_and_part_devices(model, devices):
    """(one device per tower, per tower its devices per part, or None for a model
    without split layers) from TowerTrainer's `devices`.

    devices: for a split model, a flat list (one device per tower; every tower runs
    part j where split_layers put it), or a grid: one row of T devices per tower
    (T: the parts split_layers made), row 0 the devices the parts live on.

    Raises:
      ValueError: one line saying what is wrong with `devices`.
    """
    if not is_split(model):
        return devices, None
    parts = [devices_lib.canonical_name(d) for d in part_devices(model)]
    if not any(isinstance(d, (list, tuple)) for d in devices):
        return devices, [parts] * len(devices)
    rows = [[devices_lib.canonical_name(d) for d in row]
            if isinstance(row, (list, tuple)) else row for row in devices]
    if any(not isinstance(row, list) or len(row) != len(parts) for row in rows):
        raise ValueError(
            f"devices {devices} must be a flat list (one device per tower) or a grid of "
            f"rows of {len(parts)} devices, one per part of model {model.name!r}'s split "
            "layers.")
    if rows[0] != parts:
        raise ValueError(
            f"the first row of devices, {rows[0]}, must be the devices split_layers put "
            f"the parts on, {parts}: part j's variables and optimizer slots live on "
            "devices[0][j].")
    return [row[0] for row in rows], rows


def part_devices(model):
    """The devices the split layers of `model` put their parts on (split_layers' list)."""
    lists = {tuple(layer.devices) for layer in parallel_forms(model)}
    if len(lists) > 1:
        raise ValueError(
            f"model {model.name!r} has layers split over different devices, {sorted(lists)}; "
            "split every layer with one split_layers call, over one list of devices.")
    return list(lists.pop())


class PartGrid(stages_lib.VariableGroups):
    """A split model's variables in columns: column 0 holds the layers not split (they
    run on each tower's own device, and meet on the main device), column 1 + j part j
    of every split layer.

    Attributes:
      rows: per tower, its device per column: [its own, its part 0's, part 1's, ...].
      devices: per column, where its variables live and its gradients meet: the main
        device, then the parts' devices.
    """

    def __init__(self, model, tower_devices, part_rows, main_device):
        self._column_of = {}  # id of a part's variable -> its column (the others: 0)
        for layer in parallel_forms(model):  # nested ones too
            parts = layer.parts.items() if isinstance(layer.parts, dict) else enumerate(
                layer.parts)
            for j, part in parts:
                self._column_of.update({id(v): 1 + j for v in part.weights})
        self.rows = [[device] + list(row) for device, row in zip(tower_devices, part_rows)]
        self.devices = [main_device] + list(part_rows[0])
        super().__init__(model)

    def _positions(self, variables, trainable):
        index = [[] for _ in self.devices]
        for i, variable in enumerate(variables):
            index[self._column_of.get(id(variable), 0)].append(i)
        return index

    def scope(self, tower_index):
        """Within it, the split layers run tower `tower_index`'s parts on its row."""
        return layers_lib.tower_row(self.rows[tower_index][1:])


def check_split_model(model, optimizer, pipeline_cuts, variable_placement, jit_compile):
    """Refuses, in one line, what split layers cannot be combined with yet, and an
    optimizer whose update a split would change (exactness.check_optimizer)."""
    if not is_split(model):
        return
    exactness.check_optimizer(optimizer)
    if jit_compile:
        raise ValueError("jit_compile=True cannot compile split layers yet: XLA compiles a "
                         "tower for one device, and a split layer's parts run on several; "
                         "pass jit_compile=False.")
    if pipeline_cuts is not None:
        raise ValueError(
            "pipeline_cuts cannot be combined with split layers yet (a grid of towers x "
            "stages x parts); split the layers, or cut the model into stages, not both.")
    if variable_placement == "replicated":
        raise ValueError(
            "variable_placement='replicated' cannot be combined with split layers: each "
            "part's towers read its variables where they live, devices[0][j]; use 'main'.")
