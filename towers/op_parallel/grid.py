"""Training a split model on a grid of towers x parts, or towers x stages x parts.

devices[i][j] (no pipeline stages) or devices[i][k][j] (with them): tower i's
device for part j (of stage k). Tower i runs part j of every split layer (of
stage k) on that device, and the layers not split on its part 0's device. Part
j's variables and optimizer slots live on the first tower's device for it,
where split_layers created them (stage 0) or the trainer moves them (a later
stage's, `settle_parts`); the towers' gradients of a part meet there and its
update is applied there (steps 4-5 per column: placement/columns.py).
"""

from towers import devices as devices_lib
from towers.op_parallel import exactness, layers as layers_lib
from towers.op_parallel.plan import is_split, parallel_forms


def split_devices(model, devices, num_stages=None):
    """(TowerTrainer's devices as a grid of towers x stages for devices.mesh_of, and
    parts[i][k][j], tower i's device for stage k's part j, or None for a model without
    split layers).

    devices: for a split model without pipeline stages, a flat list (one device per
    tower; every tower runs part j where split_layers put it) or rows of T devices,
    one per tower (T: the parts split_layers made), row 0 the devices the parts live
    on; with num_stages stages, per tower a list of num_stages rows of T devices,
    devices[0][0] split_layers' devices.

    Raises:
      ValueError: one line saying what is wrong with `devices`.
    """
    if not is_split(model):
        return devices, None
    homes = {tuple(form.devices) for form in parallel_forms(model)}
    parts = len(next(iter(homes)))
    if num_stages is not None:
        shape = f"per tower {num_stages} rows (one per stage) of {parts} devices (one per part)"
        if any(not isinstance(tower, (list, tuple)) or len(tower) != num_stages or any(
                not isinstance(row, (list, tuple)) or len(row) != parts for row in tower)
               for tower in devices):
            raise ValueError(f"devices {devices} must be a grid of towers x stages x parts: "
                             f"{shape}, devices[i][k][j]; model {model.name!r} has split "
                             "layers, and pipeline_cuts cut it into stages.")
        rows = [[[devices_lib.canonical_name(d) for d in row] for row in tower]
                for tower in devices]
    elif not any(isinstance(d, (list, tuple)) for d in devices):
        if len(homes) > 1:
            raise _different_devices(model, homes)
        return devices, [[list(next(iter(homes)))] for _ in devices]
    else:
        if any(not isinstance(row, (list, tuple)) or len(row) != parts for row in devices):
            raise ValueError(
                f"devices {devices} must be a flat list (one device per tower) or a grid of "
                f"rows of {parts} devices, one per part of model {model.name!r}'s split "
                "layers.")
        rows = [[[devices_lib.canonical_name(d) for d in row]] for row in devices]
    home = [tuple(row) for row in rows[0]]
    if not homes <= set(home) or (len(homes) > 1 and num_stages is None):
        raise ValueError(
            f"the first tower's devices, {rows[0][0]}, must be the devices split_layers put "
            f"the parts on, {sorted(homes)[0]}: part j's variables and optimizer slots "
            "live on devices[0][j] (with stages, devices[0][k][j]).")
    firsts = [[row[0] for row in tower] for tower in rows]  # each stage's part 0's device
    return (firsts if num_stages else [tower[0] for tower in firsts]), rows


def _different_devices(model, homes):
    return ValueError(
        f"model {model.name!r} has layers split over different devices, {sorted(homes)}; "
        "split every layer with one split_layers call, over one list of devices.")


class Parts:
    """Where a split model's parts live and run.

    Attributes:
      mesh: the step's devices.Mesh: mesh.parts[i][k][j], tower i's device for part j
        of stage k (one stage without pipeline cuts); mesh.parts[0][k][j] is where
        stage k's part j lives.
      part_of: {id(variable): j} for each variable of a split layer's part j (a variable
        every part holds, a shared norm's: 0, where it lives).
    """

    def __init__(self, model, mesh):
        self.mesh = mesh
        self.part_of = {}
        for form in parallel_forms(model):  # nested ones too
            parts = form.parts.items() if isinstance(form.parts, dict) else enumerate(form.parts)
            for j, part in parts:
                for variable in part.weights:  # a norm all parts share: the first's
                    self.part_of.setdefault(id(variable), j)

    def scope(self, tower_index):
        """Within it, the split layers run tower `tower_index`'s parts on its devices."""
        parts = self.mesh.parts
        return layers_lib.parts_on({tuple(home): devices for home, devices in zip(
            parts[0], parts[tower_index])})

    def settle(self, stages):
        """Each split layer's parts made to live with its pipeline stage k: on
        mesh.parts[0][k] (a form's variables move with the stage's columns; its `devices`,
        where it runs outside a tower, are set here). `stages`: a stages.Stages."""
        stage_of = {id(v): k for k in range(stages.num_stages) for v in stages.variables(k)}
        for form in parallel_forms(stages.model):
            k = stage_of[id(form.weights[0])]
            form.devices = list(self.mesh.parts[0][k])


def check_split_model(model, optimizer, variable_placement, jit_compile):
    """Refuses, in one line, what split layers cannot be combined with yet, and an
    optimizer whose update a split would change (exactness.check_elementwise_optimizer)."""
    if not is_split(model):
        return
    exactness.check_elementwise_optimizer(optimizer)
    if jit_compile:
        raise ValueError("jit_compile=True cannot compile split layers yet: XLA compiles a "
                         "tower for one device, and a split layer's parts run on several; "
                         "pass jit_compile=False.")
    if variable_placement == "replicated":
        raise ValueError(
            "variable_placement='replicated' cannot be combined with split layers: each "
            "part's towers read its variables where they live, devices[0][j]; use 'main'.")
