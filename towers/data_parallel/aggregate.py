"""Steps 4 and 5: the towers' gradients brought to the main device and added up there."""

import contextlib
import numbers

import numpy as np
import tensorflow as tf

from towers import compat, devices as devices_lib, gradients


def gather(tower_values, device):
    """Step 4: copies every tower's values (gradients, or new state) to `device`.

    Args:
      tower_values: one list per tower of Tensor, tf.IndexedSlices or None.
      device: where the copies go (the main device), e.g. "/device:GPU:0".

    Returns:
      the same nested lists, every tensor now on `device`.
    """
    with _placed(device):
        return [[_copy(value) for value in values] for values in tower_values]


# Called inside a user's tf.function: plain graph code with no Python control flow
# on tensors, which autograph need not convert (converting it cost a first call 0.35 s).
@tf.autograph.experimental.do_not_convert
def average_gradients(tower_grads, weights=None, device=None):
    """Step 5 for gradients of each tower's own mean loss: the weighted mean over towers.

    (The tower step itself weights each tower's loss by its shard's size
    before the gradient, so there step 5 is a plain sum: sum_gradients.)

    `tower_grads` holds one list per tower, one entry per variable:

        [[grad_var0_tower0, grad_var1_tower0, ...],    # tower 0
         [grad_var0_tower1, grad_var1_tower1, ...],    # tower 1
         ...]

    and the result is one list, one entry per variable:

        [sum_t w_t * grad_var0_tower_t / sum_t w_t,  ...]

    This is the synchronisation point of all towers: no mean exists until
    every tower's gradient has arrived.

    Args:
      tower_grads: list (towers) of equal-length lists (variables) of Tensor,
        tf.IndexedSlices or None. None counts as "no gradient from this tower";
        a variable that no tower has a gradient for gets None.
      weights: one non-negative number or scalar Tensor per tower (shard sizes,
        say), or None for equal weights. A tower of weight 0 contributes exactly
        nothing, even if its gradient holds NaN (an empty shard); if every
        weight is 0 the result is all zeros.
      device: where the mean is computed and placed; None = the current device.

    Returns:
      list of per-variable means. Where every tower gives tf.IndexedSlices the
      mean stays tf.IndexedSlices (indices concatenated, values scaled).

    Raises:
      ValueError: tower_grads not a list of equal-length lists, a gradient that is not
        a Tensor, NumPy array, tf.IndexedSlices or None, towers' gradients of one
        variable of other shapes, weights not one non-negative number per tower, or
        a device that is not a device name; in one line, before anything is computed.
    """
    _check_tower_grads(tower_grads)
    _check_gradients(tower_grads)
    if device is not None:
        devices_lib.canonical_name(device)  # a ValueError naming it, not TensorFlow's
    with _placed(device):
        fractions = _weight_fractions(weights, len(tower_grads))
        return sum_gradients([[None if grad is None else scale(grad, fraction)
                               for grad in grads]
                              for grads, fraction in zip(tower_grads, fractions)], device)


def sum_gradients(tower_grads, device=None):
    """Step 5 of the tower step: per variable, the sum over towers of its gradient
    (each tower's is of its share of the batch's loss, so the sum is the mean).

    Args:
      tower_grads: as average_gradients'.
      device: where the sums are computed and placed; None = the current device.

    Returns:
      list of per-variable sums (None where no tower has a gradient). Where
      every tower gives tf.IndexedSlices the sum stays tf.IndexedSlices (rows
      concatenated, repeated rows adding up when applied).
    """
    _check_tower_grads(tower_grads)
    with _placed(device):
        return [gradients.add(per_variable) for per_variable in zip(*tower_grads)]


# How the towers' new values of a non-trainable variable become one (`state_rules`):
# "mean" weighted by shard size (BatchNorm's moving statistics), "sum" of the towers'
# changes (a counter, a metric's totals: Keras's aggregation="sum"), or "first" (tower 0's).
STATE_RULES = ("mean", "sum", "first")
_RULE_OF_AGGREGATION = {"sum": "sum", "only_first_replica": "first"}


def state_rules(variables, state_policy="mean"):
    """Per variable, how its towers' new values merge: one of STATE_RULES.

    The variable's own Keras annotation decides where it has one
    (`aggregation="sum"`, as Keras's metrics' variables have: "sum";
    `"only_first_replica"`: "first"); an RNG seed state and a non-float value are
    tower 0's (each tower draws from its own offset seed); the rest follow
    `state_policy` ("mean", or "first_tower": "first").
    """
    rules = []
    for variable in variables:
        rule = _RULE_OF_AGGREGATION.get(getattr(variable, "aggregation", None))
        if rule is None:
            floating = tf.as_dtype(variable.dtype).is_floating
            seed = compat.is_seed_state(variable)
            rule = "mean" if floating and not seed and state_policy == "mean" else "first"
        rules.append(rule)
    return rules


def merge_state(tower_states, old_values, rules, weights=None, device=None):
    """New non-trainable values after a step, merged over towers by `rules`.

    Args:
      tower_states: one list per tower of new values (None: unchanged there).
      old_values: per variable its value before the step.
      rules: per variable one of STATE_RULES (state_rules).
      weights: per tower its shard size (None = equal), for "mean".
      device: where the merged values are placed; None = the current device.

    Returns:
      per variable its merged value, None where no tower changed it. "mean": the
      towers' values weighted by shard size (a tower that left it unchanged
      counts its old value); "sum": old + the sum of the towers' changes; "first":
      tower 0's.
    """
    _check_tower_grads(tower_states)
    with _placed(device):
        fractions = _weight_fractions(weights, len(tower_states))
        merged = []
        for values, old, rule in zip(zip(*tower_states), old_values, rules):
            if all(value is None for value in values):
                merged.append(None)
                continue
            values = [old if value is None else value for value in values]
            if rule == "mean":
                merged.append(_weighted_mean(values, fractions))
            elif rule == "sum":
                old = tf.identity(old)
                merged.append(old + tf.add_n([tf.identity(value) - old for value in values]))
            else:
                merged.append(_copy(values[0]))
        return merged


def clip_gradients(grads, clip_global_norm, loss_scale=None):
    """The averaged gradients clipped to a global norm (of the unscaled gradients).

    As tf.clip_by_global_norm on the dense gradients, but each gradient's squared
    norm and scaling are computed on its own device; only scalars travel. A
    tf.IndexedSlices counts as its dense form (repeated rows added first), so
    the norm is the same with any sparse_policy and any number of towers.
    """
    if clip_global_norm is None:
        return grads
    # Gradients carry the loss scale; clipping them at scale * norm is the same as
    # clipping the unscaled gradients at norm.
    limit = clip_global_norm if loss_scale is None else clip_global_norm * loss_scale
    half_squares = []
    for grad in grads:
        if grad is not None:
            with tf.device(gradients.dense_part(grad).device):
                half_squares.append(half_squared_norm(grad))
    if not half_squares:
        return grads
    global_norm = tf.sqrt(tf.add_n(half_squares) * 2.0)
    # A non-finite norm makes every gradient NaN, as tf.clip_by_global_norm does.
    factor = limit * tf.minimum(1.0 / global_norm, 1.0 / limit) + (global_norm - global_norm)
    return [None if grad is None else _scaled(grad, factor) for grad in grads]


def _scaled(grad, factor):
    with tf.device(gradients.dense_part(grad).device):
        return scale(grad, factor)


def all_finite(values):
    """A scalar bool Tensor: True when no Tensor or IndexedSlices in `values` holds NaN or Inf.

    Each value is checked on its own device (pipeline stages keep theirs apart);
    only the one bool per value travels.
    """
    checks = []
    for value in values:
        if value is not None:
            with tf.device(gradients.dense_part(value).device):
                checks.append(tf.reduce_all(tf.math.is_finite(gradients.dense_part(value))))
    return tf.reduce_all(tf.stack(checks)) if checks else tf.constant(True)


def _check_tower_grads(tower_grads):
    if not isinstance(tower_grads, (list, tuple)) or not tower_grads:
        raise ValueError("tower_grads must be a non-empty list with one list of gradients per tower.")
    lengths = [len(grads) for grads in tower_grads]
    if len(set(lengths)) > 1:
        raise ValueError(
            f"every tower must give one gradient per variable, but the towers' lists "
            f"have lengths {lengths}.")


def _check_gradients(tower_grads):
    """Raises ValueError for a gradient of no tensor type, or one variable's gradients of
    shapes that differ between towers (known statically)."""
    for tower, grads in enumerate(tower_grads):
        for index, grad in enumerate(grads):
            if not (grad is None or tf.is_tensor(grad) or
                    isinstance(grad, (tf.IndexedSlices, np.ndarray))):
                raise ValueError(f"tower {tower}'s gradient {index} is a "
                                 f"{type(grad).__name__}; give a Tensor, NumPy array, "
                                 "tf.IndexedSlices or None.")
    for index, grads in enumerate(zip(*tower_grads)):
        shapes = [tf.TensorShape(grad.shape) for grad in grads
                  if grad is not None and not isinstance(grad, tf.IndexedSlices)]
        if any(not shape.is_compatible_with(shapes[0]) for shape in shapes):
            raise ValueError(f"the towers' gradients of variable {index} have shapes "
                             f"{[tuple(shape) for shape in shapes]}; every tower gives the "
                             "variable's gradient, of the variable's shape.")


def _weight_fractions(weights, num_towers):
    """Per-tower float32 fractions w_t / sum(w) as a list of scalar Tensors."""
    if weights is None:
        return [tf.constant(1.0 / num_towers)] * num_towers
    weights = list(weights)
    if len(weights) != num_towers:
        raise ValueError(f"got {len(weights)} weights for {num_towers} towers; give one per tower.")
    if all(isinstance(w, numbers.Number) for w in weights):
        if any(w < 0 for w in weights):
            raise ValueError(f"weights must be non-negative, got {weights}.")
    weights = tf.cast(tf.stack(weights), tf.float32)
    return tf.unstack(tf.math.divide_no_nan(weights, tf.reduce_sum(weights)))


def _weighted_mean(values, fractions):
    """sum_t fraction_t * value_t for one variable's state, skipping towers with None."""
    return gradients.add([None if value is None else _scale(value, fraction)
                 for value, fraction in zip(values, fractions)])


def scale(grad, fraction):
    """grad * fraction (a number or float scalar), a Tensor or tf.IndexedSlices; a zero
    fraction gives exact zeros, even where grad holds NaN (an empty tower or worker)."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(_scale(grad.values, fraction), grad.indices, grad.dense_shape)
    return _scale(grad, fraction)


def _scale(tensor, fraction):
    # multiply_no_nan: a zero-weight (empty) tower adds 0, never NaN * 0 = NaN.
    return tf.math.multiply_no_nan(tensor, tf.cast(fraction, tensor.dtype))


def _copy(grad):
    if grad is None:
        return None
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(tf.identity(grad.values), tf.identity(grad.indices),
                                grad.dense_shape)
    return tf.identity(grad)


def _is_float(value):
    return value is not None and value.dtype.is_floating


def half_squared_norm(grad):
    """tf.nn.l2_loss of the dense gradient `grad` stands for, on the current device.

    A tf.IndexedSlices' repeated rows (an id looked up twice, or by two towers)
    are added before squaring, as in gradients.to_dense, but only the rows present are
    summed: no (vocabulary, width) Tensor is built.
    """
    if not isinstance(grad, tf.IndexedSlices):
        return tf.nn.l2_loss(grad)
    rows, row_of_slice = tf.unique(grad.indices)
    return tf.nn.l2_loss(tf.math.unsorted_segment_sum(grad.values, row_of_slice, tf.size(rows)))


def _placed(device):
    """tf.device(device), or the current device scope for None: tf.device(None) would
    clear it, leaving the ops to TensorFlow's placer (device 0)."""
    return contextlib.nullcontext() if device is None else tf.device(device)
