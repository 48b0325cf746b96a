"""Where a TowerTrainer's step runs: its devices as a Mesh of towers x stages (x a split
model's parts), each column's main device, checked once; and the
hooks that place the optimizer's updates and the tables' reads while it traces."""

import contextlib

from towers import devices as devices_lib
from towers.data_parallel import exchange
from towers.engine.step import StepSetup
from towers.op_parallel import grid as op_grid, tables as op_tables
from towers.placement import variables as variables_lib

_ABSENT = object()


def step_setup(model, devices, main_device, pipeline_cuts, options, cluster):
    """(the step's StepSetup, the trainer's `devices`): `devices` (None: the default
    ones) as a devices.Mesh of towers x stages (x a split model's parts); stage k's
    variables and gradients on tower 0's device for it (stage 0's on main_device); a
    split model's parts on their devices (devices[0][j], with stages devices[0][k][j]).

    Raises:
      ValueError: a device that does not exist, devices of the wrong shape, or an
        aggregation the devices cannot run.
    """
    devices = devices_lib.device_list(devices)
    num_stages = None if pipeline_cuts is None else len(pipeline_cuts) + 1
    devices, part_devices = op_grid.split_devices(model, devices, num_stages)
    mesh = devices_lib.mesh_of(devices, num_stages, part_devices, main_device)
    parts = None if part_devices is None else op_grid.Parts(model, mesh)
    setup = StepSetup(None, mesh, options, cluster=cluster, parts=parts)
    # A split layer's part columns are not checked: where towers share a part's
    # device, its gradients are summed there, with nothing to exchange.
    for k in range(mesh.num_stages):
        exchange.check_aggregation(options.aggregation, mesh.stage(k))
    return setup, (mesh.stage(0) if pipeline_cuts is None else mesh.grid)


@contextlib.contextmanager
def step_hooks(trainer):
    """While inside, the trainer's model and optimizer place their work as its step
    needs: each variable's update on its own device (several columns: pipeline
    stages, split layers) and each table's look-up where it lives (setup.tables).

    Keras has an option for neither, so both are attributes set on the user's
    optimizer and variables; the compiled step keeps what they placed, so they are
    needed only while it is traced. On exit every attribute is as it was: a model
    and optimizer used by plain Keras or tf.distribute afterwards are their own.
    """
    setup, hooks = trainer.setup, []
    if len(setup.columns.devices) > 1:
        hooks.append(variables_lib.updates_on_variable_devices(trainer.optimizer))
    if setup.tables is not None:
        hooks += op_tables.reads_where_they_live(setup.columns.held_variables(),
                                                 setup.tables)
    replaced = [(owner, name, vars(owner).get(name, _ABSENT))
                for owner, replacements in hooks for name in replacements]
    for owner, replacements in hooks:
        for name, replacement in replacements.items():
            setattr(owner, name, replacement)
    try:
        yield
    finally:
        for owner, name, before in reversed(replaced):
            if before is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, before)
