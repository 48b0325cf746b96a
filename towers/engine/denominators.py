"""Loss terms over the whole batch whose denominator is counted, not known in advance.

Keras divides a masked output's loss by the batch's unmasked entries (and with
reduction="mean_with_sample_weight" by the sum of the weights): a count that
exists once every tower has run its forward. `count` adds up every tower's
terms on the main device and gives each term its scale, 1 / the batch's count
(1 / its known denominator for the others, for the logs). Where the schedule
lets the counts come first, each tower's backward starts from its counted terms
weighed by their scales (flight.Flight.finish); where it does not, each counted
term was differentiated on its own and `fold` scales those gradients and adds
them to the tower's others, on the device each gradient lives on. Steps 4-5
then add up the towers' gradients as ever.

Across workers the count is the global batch's (one all-reduce of the counts
and the rows), and each worker's share is scaled so that step 5's mean over
workers, weighted by their rows, comes out as one device's.

Two reductions need no count but a factor. A sum term (reduction="sum") has no
denominator: each tower's share is its sum, whole; across workers it is scaled
by the global batch's rows over the worker's (`sum_scale`: one all-reduce of
the rows before the towers start), which step 5's mean turns back into the sum
of every worker's. An unreduced loss (reduction=None) is logged as a mean over
its entries, while Keras differentiates the sum of its loss vector: the mean
gradient times the vector's entries over the global batch, which `count` counts
(Counts.grad_scale) and `scale_gradients` applies once steps 1-5 are done.
"""

import collections

import tensorflow as tf

from towers import gradients
from towers.data_parallel import aggregate, exchange
from towers.engine import losses

Counts = collections.namedtuple("Counts", ["scales", "term_losses", "grad_scale"])
Counts.__doc__ = """The batch's loss terms counted, on the main device.

scales: per loss term, what its sum is multiplied by: 1 / the batch's count
  (with a cluster, this worker's share of it: global rows / (count x this
  worker's rows)), 1 / its known denominator, or a sum term's sum_scale (1
  without a cluster); float32 scalars. None where no term is counted and there
  is one term (nothing to count).
term_losses: per loss term its value over the batch (unweighted, for the logs:
  a mean, a sum term's sum; with a cluster this worker's share, which step 5's
  mean over the workers turns into the global batch's), or [] for an objective
  of one term.
grad_scale: None, or with an unreduced loss (reduction=None) the entries of its
  values over the global batch (all workers'), a float32 scalar: what the batch's
  mean gradients are multiplied by (scale_gradients).
"""


def sum_scale(objective, batch_rows, cluster, device):
    """What a sum term's sum is multiplied by in a tower's share: None (1) without a
    cluster or a sum term; with both, the global batch's rows over this worker's (one
    all-reduce of the rows, on `device`), 0 for a worker of no rows."""
    if cluster is None or losses.SUM not in objective.given_reductions:
        return None
    with tf.device(device), tf.name_scope("denominators"):
        [all_rows] = exchange.sum_across_workers([batch_rows], cluster, device)
        return tf.math.divide_no_nan(all_rows, batch_rows)


def count(tower_terms, objective, batch_rows, cluster, device, sum_scale=None):
    """Every tower's loss terms added up: Counts.

    Args:
      tower_terms: per tower, its losses.Term per loss term (a flight's `terms`).
      objective: the losses.Objective the towers computed.
      batch_rows: this worker's rows in the batch, a float32 scalar.
      cluster: None, or the towers.Cluster this worker belongs to.
      device: the main device, where the counts meet.
      sum_scale: None, or the `sum_scale` the towers' shares used.
    """
    terms = list(zip(*tower_terms))  # per term: one Term per tower
    counted = [i for i, per_tower in enumerate(terms) if per_tower[0].per_row is None]
    unreduced = objective.unreduced[:1]  # their entries are the same (losses._check_unreduced)
    if not counted and not objective.names and not unreduced:
        return Counts(None, [], None)
    with tf.device(device), tf.name_scope("denominators"):
        sums = [tf.add_n([tf.identity(t.sum) for t in per_tower]) for per_tower in terms]
        units = [tf.add_n([tf.identity(t.units) for t in per_tower]) for per_tower in terms]
        # An all-masked batch counts 0 and weighs 0, as Keras's divide_no_nan does.
        scales = [tf.math.divide_no_nan(1.0, u) for u in units]
        for i in objective.summed:
            scales[i] = tf.constant(1.0) if sum_scale is None else sum_scale
        entries = [units[i] for i in unreduced]
        if (counted or unreduced) and cluster is not None:
            # The global batch's counts; this worker's share of each term, which the
            # mean over workers weighted by rows (step 5) adds up to sum / count.
            *counts, all_rows = exchange.sum_across_workers(
                [units[i] for i in counted] + entries + [batch_rows], cluster, device)
            for i, total in zip(counted, counts):
                scales[i] = tf.math.divide_no_nan(all_rows, total * batch_rows)
            entries = counts[len(counted):]
        term_losses = [total * scale for total, scale in zip(sums, scales)] if (
            objective.names) else []
    return Counts(scales, term_losses, entries[0] if entries else None)


def scale_gradients(grads, counts):
    """The batch's gradients (a step.TowerResult's, None where unused) times
    counts.grad_scale, each on its device; `grads` itself where there is none."""
    if counts.grad_scale is None:
        return grads
    scaled = []
    for grad in grads:
        if grad is None:
            scaled.append(None)
            continue
        with tf.device(gradients.dense_part(grad).device):
            scaled.append(aggregate.scale(grad, counts.grad_scale))
    return scaled


def fold(outputs, objective, counts, device):
    """The towers' TowerOutputs with every counted term differentiated on its own
    (term_grads) folded in: its gradients scaled by counts.scales and added to grads,
    its scaled sum to the loss (on `device`)."""
    folded = []
    for output in outputs:
        if not output.term_grads:
            folded.append(output)
            continue
        counted = [i for i, term in enumerate(output.terms) if term.per_row is None]
        scales = [counts.scales[i] for i in counted]
        with tf.device(device):
            loss = tf.add_n([tf.identity(output.loss)] + [
                objective.weights[i] * scale * output.terms[i].sum
                for i, scale in zip(counted, scales)])
        folded.append(output._replace(grads=_add_scaled(output.grads, output.term_grads, scales),
                                      loss=loss, term_grads=[]))
    return folded


def _add_scaled(grads, term_grads, scales):
    """Per variable grads + sum_c scales[c] * term_grads[c], on the gradient's device."""
    added = []
    for v, grad in enumerate(grads):
        pieces = [(grad, None)] + [(group[v], scale) for group, scale in zip(term_grads, scales)]
        pieces = [(g, s) for g, s in pieces if g is not None]
        if not pieces:
            added.append(None)
            continue
        with tf.device(gradients.dense_part(pieces[0][0]).device):
            added.append(aggregate.sum_gradients(
                [[g if s is None else aggregate.scale(g, s)] for g, s in pieces])[0])
    return added
