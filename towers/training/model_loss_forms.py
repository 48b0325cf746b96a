"""Each loss a model adds in its call, told apart by measuring on the first batch: a mean
over rows, a sum over rows, or one that couples rows (engine/model_losses.py
says what each form's share of a tower's loss is).

On rows A (the first example), B (the next one or two) and A+B (both), a term L is
- a mean where L(A+B) = (|A| L(A) + |B| L(B)) / |A+B| (a constant, a function of the
  weights only, or 0, passes this too);
- a sum where L(A+B) = L(A) + L(B);
- otherwise it couples rows (a product of batch means, a variance over the batch),
  which no tower can compute its share of: refused in one line, before any step.
The measurement runs the model eagerly on the current weights, writing nothing.
"""

import tensorflow as tf

from towers.engine import forward, model_losses

# float32 round-off of a loss over a few rows is ~1e-7 of it; a form that does not
# hold misses by far more (a sum against a mean of 3 rows: a factor of 3).
_RELATIVE_TOLERANCE = 1e-4
ROWS = 3  # A is row 0, B rows 1-2: uneven, so a per-row mean and a per-row sum differ


def measure(model, x, cluster=None):
    """{key: model_losses.MEAN or SUM} for every loss `model` adds in its call (add_loss,
    activity regularizers; model_losses.keyed_terms' keys), measured on x's first rows.

    A term is measured with training=False where the call adds it then: in inference,
    BatchNormalization normalises each row by its moving statistics and Dropout
    passes rows through, so a per-row term after them stays per-row (with
    training=True, batch statistics and masks drawn per call would make it look
    coupled). A term added only with training=True is measured in training mode.

    Args:
      model: a built keras.Model (its weights as they are now).
      x: the first batch's inputs (a nest of Tensors with rows).
      cluster: None, or the towers.Cluster the trainer belongs to.

    Raises:
      ValueError: in one line, naming the layer: a term that couples rows, one that
        the call adds on some rows and not on others, a sum term in a cluster, or a
        first batch of one row where the model adds losses.
    """
    rows = int(tf.shape(tf.nest.flatten(x)[0])[0])
    first_rows = _rows(x, 0, min(rows, ROWS))
    forms = {}
    for training in (False, True):
        whole = _added_terms(model, first_rows, training)
        unmeasured = sorted(set(whole) - set(forms))
        if not unmeasured:
            continue
        if rows < 2:
            raise ValueError(
                f"model {model.name!r} adds losses in its call ({_layers(unmeasured)}); "
                "towers tells a mean over rows from a sum on the first batch's first rows, "
                f"and it has {rows}: make the first batch 2 rows or more.")
        first, rest = (_added_terms(model, _rows(x, *span), training)
                       for span in ((0, 1), (1, min(rows, ROWS))))
        for key in unmeasured:
            forms[key] = _form(model, key, whole[key], first.get(key), rest.get(key),
                               rest_rows=min(rows, ROWS) - 1, training=training)
    summed = [key for key, form in forms.items() if form == model_losses.SUM]
    if summed and cluster is not None:
        raise ValueError(
            f"layer {model_losses.layer_of(summed[0])!r} adds a loss that is a sum over rows, "
            "which towers does not yet add up across a cluster's workers; make it a mean "
            "over rows, or train on one worker.")
    return forms


def _form(model, key, whole, first, rest, rest_rows, training):
    """MEAN or SUM for the term `key`, from its values on A+B, A and B."""
    layer, mode = model_losses.layer_of(key), f"training={training}"
    if first is None or rest is None:
        raise ValueError(
            f"layer {layer!r} of model {model.name!r} adds a loss on some rows and not on "
            f"others ({mode}); towers cannot tell its form (mean or sum over rows): add it "
            "on every call, or compute it over the global batch with "
            "towers.tower_step(..., batch_losses=).")
    whole, first, rest = float(whole), float(first), float(rest)
    scale = max(abs(whole), abs(first), abs(rest))

    def close(value):
        return abs(whole - value) <= _RELATIVE_TOLERANCE * scale

    if close((first + rest_rows * rest) / (1 + rest_rows)):
        return model_losses.MEAN
    if close(first + rest):
        return model_losses.SUM
    moved_by = "" if not training else (
        " (measured with training=True, the only mode that adds it, where BatchNormalization "
        "and Dropout couple rows too)")
    raise ValueError(
        f"layer {layer!r} of model {model.name!r} adds a loss that is neither a mean nor a "
        f"sum over rows{moved_by}: it couples the batch's rows (a product of batch means, a "
        "variance), which no tower can compute its share of; compute it over the global "
        "batch with towers.tower_step(..., batch_losses=).")


def _added_terms(model, x, training):
    """{key: float} of the losses the model adds in a call on x (not its weights')."""
    weights = [v.value for v in model.trainable_variables]
    state = [v.value for v in model.non_trainable_variables]
    _, _, terms = forward.forward(model, weights, state, x, training)
    return {key: value for key, value in terms.items() if key != model_losses.WEIGHTS}


def _rows(x, start, stop):
    return tf.nest.map_structure(lambda t: t[start:stop], x)


def _layers(keys):
    return ", ".join(sorted({repr(model_losses.layer_of(key)) for key in keys}))
