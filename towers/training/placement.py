"""Where a TowerTrainer's step runs: its devices as a grid of towers x stages (or a
split model's towers x parts), each column's main device, checked once."""

from towers import devices as devices_lib
from towers.data_parallel import exchange
from towers.data_parallel.step import StepSetup
from towers.op_parallel import grid as op_grid


def step_setup(model, devices, main_device, pipeline_cuts, options, cluster):
    """(the step's StepSetup, the trainer's `devices`): `devices` (None: the default
    ones) as a grid, one row per tower; stage k's variables and gradients on row 0's
    device k (stage 0's on main_device); a split model's parts on their columns.

    Raises:
      ValueError: a device that does not exist, a grid of the wrong shape, or an
        aggregation the devices cannot run.
    """
    devices = devices_lib.default_devices() if devices is None else list(devices)
    devices, part_rows = op_grid.tower_and_part_devices(model, devices)
    grid = devices_lib.device_grid(devices, None if pipeline_cuts is None
                                   else len(pipeline_cuts) + 1)
    main_device = devices_lib.canonical_name(main_device or grid[0][0])
    # Stage k's main device: where its variables live and its gradients meet.
    setup = StepSetup(None, grid, [main_device] + list(grid[0][1:]), options, cluster=cluster)
    tower_devices = [row[0] for row in grid]
    if part_rows is not None:
        setup.parts = op_grid.PartGrid(model, tower_devices, part_rows, main_device)
    devices_lib.check_devices_exist(sum(setup.column_grid, []) + [main_device])
    # A split layer's part columns are not checked: where towers share a part's
    # device, its gradients are summed there, with nothing to exchange.
    for k in range(len(setup.stage_devices)):
        exchange.check_aggregation(options.aggregation, [row[k] for row in grid])
    return setup, (tower_devices if pipeline_cuts is None else grid)
