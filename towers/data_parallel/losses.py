"""Per-example losses: the part of step 3 that turns predictions into numbers to average."""

import keras
import tensorflow as tf

# Keras reductions whose meaning is "mean over the examples of the batch", which
# is what every tower step computes over the global batch.
_MEAN_REDUCTIONS = ("sum_over_batch_size", None, "none")


def check_loss(loss):
    """Raises ValueError unless `loss` is a Keras loss with a mean reduction or a callable."""
    if isinstance(loss, keras.losses.Loss):
        if loss.reduction not in _MEAN_REDUCTIONS:
            raise ValueError(
                f"loss {loss.name!r} has reduction={loss.reduction!r}; towers averages "
                "per-example losses over the global batch, as Keras's default "
                "reduction='sum_over_batch_size' does. Build the loss with that reduction.")
    elif not callable(loss):
        raise ValueError(
            f"loss must be a keras.losses.Loss or a callable(y_true, y_pred) returning "
            f"per-example losses, got {type(loss).__name__}.")


def per_example_loss(loss, y_true, y_pred, sample_weight=None):
    """The loss of each example, sample-weighted.

    Args:
      loss: a keras.losses.Loss (its reduction is not applied) or a
        callable(y_true, y_pred) returning losses of shape (n,) or (n, ...).
      y_true, y_pred: targets and model outputs for n examples.
      sample_weight: None, or weights of shape (n,) or broadcastable to the losses.

    Returns:
      float32 Tensor of shape (n,); extra loss dimensions (time steps, say) are
      averaged, so the batch mean equals Keras's 'sum_over_batch_size'.

    Raises:
      ValueError: the loss returns a scalar, a non-float, or a wrong batch size.
    """
    if isinstance(loss, keras.losses.Loss):
        y_pred = tf.nest.map_structure(lambda t: tf.cast(t, loss.dtype), y_pred)
        values = loss.call(y_true, y_pred)
    else:
        values = loss(y_true, y_pred)
    values = _checked_losses(values, y_pred)
    if sample_weight is not None:
        values *= _broadcast_weight(tf.cast(sample_weight, tf.float32), values)
    if values.shape.rank > 1:
        values = tf.reduce_mean(values, axis=list(range(1, values.shape.rank)))
    return values


def _checked_losses(values, y_pred):
    """`values` as float32 after checking it holds one loss per example of y_pred."""
    name = "the loss"
    if not tf.is_tensor(values):
        try:
            values = tf.convert_to_tensor(values)
        except (TypeError, ValueError):
            raise ValueError(f"{name} returned {type(values).__name__}, not a tensor of "
                             "per-example losses.") from None
    if not values.dtype.is_floating:
        raise ValueError(f"{name} returned {values.dtype.name} values; it must return "
                         "floating-point per-example losses.")
    if values.shape.rank == 0:
        raise ValueError(
            f"{name} returned a scalar; it must return one loss per example, shape "
            "(batch,). Don't reduce inside a loss callable (towers averages over the "
            "global batch itself), or pass a keras.losses.Loss object.")
    expected = tf.nest.flatten(y_pred)[0].shape[0]
    if values.shape[0] is not None and expected is not None and values.shape[0] != expected:
        raise ValueError(
            f"{name} returned shape {tuple(values.shape)} for a batch of {expected} "
            f"examples; it must return one loss per example, shape ({expected},).")
    if values.shape[0] is not None and expected is None:
        raise ValueError(
            f"{name} returned a fixed shape {tuple(values.shape)} that does not follow "
            "the batch size; it must return one loss per example, shape (batch,).")
    return tf.cast(values, tf.float32)


def _broadcast_weight(weight, values):
    """Sample weights reshaped to broadcast against `values` along dim 0."""
    while weight.shape.rank > values.shape.rank and weight.shape[-1] == 1:
        weight = tf.squeeze(weight, -1)
    while weight.shape.rank < values.shape.rank:
        weight = tf.expand_dims(weight, -1)
    return weight
