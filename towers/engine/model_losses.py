"""A model's own losses (`model.losses`) in a tower's step: each term, its form, its share.

Keras adds every entry of model.losses to a batch's loss once: the losses a layer
adds during the call (`add_loss`: an activity regularizer, a VAE's KL) and the
weights' regularizers. A tower computes them on its shard alone, so what its share
of the batch's loss is depends on each term's form:
- a mean over rows (Keras 3 divides an activity regularizer by the batch's rows),
  or a function of the weights only: the shard's value times its rows / the
  batch's rows; the towers' shares add up to the batch's value (a constant's too);
- a sum over rows (`add_loss(ops.sum(...))`, a VAE's KL summed over the batch):
  the shard's value, times 1;
- a term that couples rows (a product of batch means, a variance over the batch):
  no shard computes its share; training/model_loss_forms.py refuses it.
Forms are measured on the first batch (model_loss_forms.measure), not read from the
user's code, and kept on the losses.Objective; `share` applies them.

Each added loss is keyed by the layer that added it and its index among that layer's
losses of the call ("encoder/dense#0"), so a term is found again in every forward: a
pipeline stage's sub-model, a recomputed layer's op (which adds its losses again by
the layer that added them, training/recompute.py), a split layer's part.
"""

import collections

import tensorflow as tf
from absl import logging

from towers import compat

MEAN, SUM = "mean", "sum"
WEIGHTS = "(weights)"  # the key of every weight regularizer's term, added up: a MEAN


def keyed_terms(model, losses, added):
    """{key: float32 scalar}: `losses` (model.losses read inside the stateless call)
    by term, `added` the call's StatelessScope.losses (add_loss's); {} for none.

    Each added loss is reduced as Keras's Trainer.compute_loss reduces it (a sum)."""
    added_ids = {id(loss) for loss in added}
    own = [loss for loss in losses if id(loss) in added_ids]
    weights_only = [_scalar(loss) for loss in losses if id(loss) not in added_ids]
    terms, seen = {}, collections.Counter()
    for adder, loss in zip(compat.loss_adders(model, own), own):
        terms[f"{adder.path}#{seen[adder.path]}"] = _scalar(loss)
        seen[adder.path] += 1
    if weights_only:
        terms[WEIGHTS] = tf.add_n(weights_only)
    return terms


def merged(per_stage):
    """Several forwards' keyed terms (pipeline stages') as one dict, a key's values added
    (a layer called in two stages)."""
    values = collections.defaultdict(list)
    for terms in per_stage:
        for key, value in terms.items():
            values[key].append(tf.identity(value))  # to the current device
    return {key: tf.add_n(pieces) for key, pieces in values.items()}


def share(terms, forms, fraction):
    """A shard's share of the batch's loss from its keyed terms: the mean terms' sum
    times `fraction` (its rows / the batch's rows, a float32 scalar) plus the sum terms'.
    Returns a float32 scalar, or None where there are no terms.

    forms: {key: MEAN or SUM} as measured on the first batch, or None where nothing
      was measured (towers.tower_gradients): every term counts as a mean.

    Raises:
      ValueError: (when the step is traced, before it runs) a term the first batch
        did not have: its form is unknown.
    """
    if not terms:
        return None
    if forms is None:
        _warn_unmeasured(terms)
    means, sums = [], []
    for key, value in sorted(terms.items()):
        form = MEAN if forms is None or key == WEIGHTS else forms.get(key)
        if form is None:
            raise ValueError(
                f"layer {layer_of(key)!r} adds a loss (add_loss or activity_regularizer; "
                f"loss {index_of(key)} of its call) that it did not add on the first batch, "
                "where towers measured each loss's form (mean or sum over rows); add the "
                "same losses on every call, or compute it over the global batch with "
                "towers.tower_step(..., batch_losses=).")
        (sums if form == SUM else means).append(value)
    pieces = ([tf.add_n(means) * fraction] if means else []) + sums
    return tf.add_n(pieces)


_warned = set()  # the layers _warn_unmeasured has named, once each per process


def _warn_unmeasured(terms):
    """One warning per layer whose added losses count as a mean over rows because
    nothing measured their form (towers.tower_gradients, inside the caller's
    tf.function, sees no batch values): a sum over rows would be scaled wrong."""
    layers = sorted({layer_of(key) for key in terms if key != WEIGHTS} - _warned)
    if layers:
        _warned.update(layers)
        logging.warning(
            "layers %s add losses in their call (add_loss, activity_regularizer), which "
            "towers.tower_gradients counts as means over rows, unmeasured: a loss summed "
            "over the batch's rows would be scaled by each tower's rows. Train with "
            "TowerTrainer, which measures each loss's form on the first batch, or with "
            "towers.tower_step, adding tower.losses yourself.", layers)


def total(terms):
    """The plain sum of keyed terms (model.losses added up, as Keras adds them), a
    float32 scalar, or None for none."""
    return tf.add_n([terms[key] for key in sorted(terms)]) if terms else None


def layer_of(key):
    """The path of the layer that added the keyed term `key`."""
    return key.rpartition("#")[0]


def index_of(key):
    """The index of the keyed term `key` among its layer's losses of a call."""
    return int(key.rpartition("#")[2])


def _scalar(loss):
    return tf.reduce_sum(tf.cast(loss, tf.float32))
