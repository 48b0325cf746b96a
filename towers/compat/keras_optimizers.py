"""Private Keras names about optimizers and Keras's configuration, each beside the public
alternative it stands in for (towers/compat/__init__.py says why they live here)."""

from keras.src.backend.config import keras_home
from keras.src.utils import tracking

# ---------------------------------------------------------------------------------------
# Keras: optimizers

# The attribute through which Keras's TensorFlow optimizer sums the gradients over a
# tf.distribute strategy's replicas before applying them (one IdentityN of them all, on
# the caller's device); the towers have summed them already. Public alternative: none.
REPLICA_SUM = "_all_reduce_sum_gradients"


def update_hooks(optimizer, update_scope):
    """(the object, {attribute: replacement}) that, while set on it, make the Keras
    `optimizer` compute each variable's update inside update_scope(variable), a context
    manager (a tf.device), and skip the sum over replicas (REPLICA_SUM): the one per
    variable hook is update_step, of a LossScaleOptimizer's inner optimizer.

    Private: replacing a method on one instance, which Keras does not offer, and
    REPLICA_SUM. Public alternative: none; Keras 3 runs every variable's update under
    the caller's device scope, with no option to place it with its variable.
    """
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    update_step = inner.update_step

    def update_in_scope(gradient, variable, learning_rate):
        with update_scope(variable):
            return update_step(gradient, variable, learning_rate)

    return inner, {"update_step": update_in_scope,
                   REPLICA_SUM: lambda grads_and_vars: list(grads_and_vars)}


def optimizer_knows(optimizer, variable):
    """Whether a built Keras optimizer updates `variable` (was built with it).

    Public alternative: none; apply() raises "Unknown variable" for others.
    """
    return optimizer._var_key(variable) in optimizer._trainable_variables_indices


def track_as_optimized(optimizer, variables):
    """Makes a checkpoint of the built Keras `optimizer` name `variables` (one per variable
    it was built with, in order, of the same shapes) where it names those: a twin built
    on stand-ins then saves as an optimizer built on `variables` does.

    Public alternative: none; a Keras optimizer tracks the variables it was built with
    (its `_trainable_variables`), and tf.train.Checkpoint names a model's weights through
    it.
    """
    with tracking.DotNotTrackScope():  # not among its own variables: the list only
        optimizer._trainable_variables = list(variables)


def excluded_from_weight_decay(optimizer, variable):
    """Whether `optimizer.exclude_from_weight_decay(var_list=...)` listed `variable` (a
    keras.Variable held whole).

    Public alternative: none; the optimizer keeps the listed variables' keys, and asks
    only while it applies (`_use_weight_decay`).
    """
    return optimizer._var_key(variable) in getattr(optimizer, "_exclude_from_weight_decay", ())


def exclude_from_weight_decay_too(optimizer, variables):
    """Adds `variables` to those `optimizer.exclude_from_weight_decay(var_list=...)` listed
    (a variable held as slabs: its slabs), before the optimizer is built.

    Public alternative: exclude_from_weight_decay itself, which replaces the list.
    """
    optimizer._exclude_from_weight_decay |= {optimizer._var_key(v) for v in variables}


def optimizer_variables(optimizer):
    """The model variables a built Keras optimizer updates (those it was built with).

    Public alternative: none; optimizer.variables holds its own (slots, step count).
    """
    return list(optimizer._trainable_variables)


def slots_for(optimizer, variables):
    """{attribute: its list for `variables`}: the per-variable lists (each slot at its
    variable's index: Adam's momentums and velocities, SGD's momentums, ...) that a
    built Keras optimizer's build makes, made by a twin of the same class and config
    built on `variables` only (its learning rate does not matter), so each slot is
    made next to its variable, as build makes it.

    Public alternative: none (see add_optimizer_variables).

    Raises:
      ValueError: an optimizer that keeps per-variable state other than in such lists.
    """
    twin = type(optimizer).from_config({**optimizer.get_config(), "learning_rate": 0.0})
    own = {id(v) for v in twin.variables}  # its step count and learning rate
    twin.build(variables)
    made = {id(v) for v in twin.variables if id(v) not in own}
    lists = {name: list(value) for name, value in vars(twin).items()
             if isinstance(value, list) and len(value) == len(variables)
             and all(v is None or id(v) in made for v in value)}
    adopted = [v for values in lists.values() for v in values if v is not None]
    known = len(optimizer._trainable_variables)
    misaligned = [name for name in lists if not isinstance(getattr(optimizer, name, None), list)
                  or len(getattr(optimizer, name)) != known]
    if (made and not adopted) or misaligned:
        raise ValueError(
            f"cannot give the newly trainable {variables[0].path!r} its slots in a "
            f"{type(optimizer).__name__}: it keeps them other than Keras's optimizers do. "
            "Build the optimizer on every variable that will be trained before the first "
            "step (optimizer.build(variables)).")
    return lists


def add_optimizer_variables(optimizer, variables, slot_lists):
    """Makes a built Keras optimizer update `variables` too, with their slots: appends
    each list of `slot_lists` ({attribute: one slot per variable, as its build makes})
    to the optimizer's list of that name, and `variables` to those it updates.

    Public alternative: none; Keras 3.15 asks for a new optimizer instance for a new
    variable, which would lose the other slots' values and the step count. This
    extends what BaseOptimizer.build records: the variables, their index by key, and
    the optimizer's own variables (each slot tracked as add_variable tracks it).
    """
    for name, slots in slot_lists.items():
        for slot in slots:
            if slot is not None:
                optimizer._track_variable(slot)
        setattr(optimizer, name, list(getattr(optimizer, name)) + slots)
    start = len(optimizer._trainable_variables)
    optimizer._trainable_variables = list(optimizer._trainable_variables) + list(variables)
    for index, variable in enumerate(variables, start):
        optimizer._trainable_variables_indices[optimizer._var_key(variable)] = index


# ---------------------------------------------------------------------------------------
# Keras: configuration

def keras_home_dir():
    """Where Keras keeps its files ($KERAS_HOME, else ~/.keras), as it read it at import.

    Public alternative: none; keras.utils.get_file caches under it.
    """
    return keras_home()
