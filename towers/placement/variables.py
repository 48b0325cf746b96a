"""Where each variable lives: moved to its column's device before the optimizer is
built, and updated there.

Each column of a placement.columns.Columns (a pipeline stage, or a split layer's
part) has one device for its variables and their optimizer slots, as torchgpipe
moves each partition to its device; `updates_on_variable_devices` keeps each
variable's update there while the step is traced.
"""

import tensorflow as tf

from towers import compat, devices as devices_lib


def place_variables(columns, optimizer):
    """Moves each column's variables (a stage's, or a stage's split layers' part j's) to
    its device, columns.devices[c]; `columns` a data_parallel.columns.Columns.

    Keras 3's optimizer creates each slot on its variable's device when it is
    built, so it must not be built yet when a variable has to move.

    Raises:
      ValueError: a variable must move but the optimizer is already built.
    """
    moves = [(variable, device) for column, device in enumerate(columns.devices)
             for variable in columns.variables(column) if not is_whole_on(variable, device)]
    if moves and optimizer.built:
        raise ValueError(
            "the optimizer was built before the variables were placed on their devices "
            "(pipeline stages, spread placement), so its slots would stay behind; create "
            "the TowerTrainer with a fresh optimizer (it is built at the first step, next "
            "to each variable).")
    for variable, device in moves:
        compat.move_variable(variable, device)


def is_whole_on(variable, device):
    """Whether `variable` lives on `device` whole (not held as slabs by an earlier
    trainer's spread placement, placement/slabs.py)."""
    return compat.held_slabs(variable) is None and \
        devices_lib.canonical_name(variable.value.device) == device


def updates_on_variable_devices(optimizer):
    """(the object, {attribute: replacement}) that make `optimizer` compute each
    variable's update on that variable's device while they are set; the trainer
    sets them only while it traces its step (training/placement.step_hooks), so
    the user's optimizer is its own again outside.

    Keras 3 runs every variable's update under the caller's device scope, and
    has no public option to place it with its variable; so the one per-variable
    hook is wrapped (compat.update_hooks). Without it, every stage's weights and
    slots would be read onto one device to be updated. And Keras's TensorFlow
    optimizer first sums the gradients over the replicas of a tf.distribute
    strategy: with none, that is one IdentityN of all of them, on the caller's
    device, which would copy every stage's gradients there and back; the towers
    have summed them already, so that step is skipped.
    """
    return compat.update_hooks(optimizer, lambda variable: tf.device(variable.device))
