"""Loss terms over the whole batch whose denominator is counted, not known in advance.

Keras divides a masked output's loss by the batch's unmasked entries (and with
reduction="mean_with_sample_weight" by the sum of the weights): a count that
exists once every tower has run its forward. So a tower differentiates such a
term's plain sum (its own backward, tower.run_tower's term_grads), and here,
with every tower's count in, each tower's gradients of it are scaled by
1 / the batch's count and added to its other gradients, on the device each
gradient lives on. Steps 5-6 then add up the towers' gradients as ever.

Across workers the count is the global batch's (one all-reduce of the counts
and the rows), and each worker's share is scaled so that step 6's mean over
workers, weighted by their rows, comes out as one device's.
"""

import tensorflow as tf

from towers.data_parallel import aggregate, exchange


def fold_counted(outputs, objective, batch_rows, cluster, device):
    """The towers' outputs with every counted term folded into grads and loss, and
    each loss term's value (for the logs).

    Args:
      outputs: per tower its tower.TowerOutput.
      objective: the losses.Objective the towers computed.
      batch_rows: this worker's rows in the batch, a float32 scalar.
      cluster: None, or the towers.Cluster this worker belongs to.
      device: the main device, where the counts meet.

    Returns:
      (outputs, term_losses): the TowerOutputs with term_grads folded in (and
      emptied); per loss term its mean over the batch (unweighted), a float32
      scalar on `device` (with a cluster, this worker's share, which step 6's
      weighted mean over the workers turns into the global batch's), or [] for
      an objective of one term (its value is the loss).
    """
    terms = list(zip(*[o.terms for o in outputs]))  # per term: one Term per tower
    counted = [i for i, per_tower in enumerate(terms) if per_tower[0].per_row is None]
    if not counted and not objective.names:
        return outputs, []
    with tf.device(device), tf.name_scope("denominators"):
        sums = [tf.add_n([tf.identity(t.sum) for t in per_tower]) for per_tower in terms]
        units = [tf.add_n([tf.identity(t.units) for t in per_tower]) for per_tower in terms]
        # An all-masked batch counts 0 and weighs 0, as Keras's divide_no_nan does.
        scales = [tf.math.divide_no_nan(1.0, u) for u in units]
        if counted and cluster is not None:
            # The global batch's counts; this worker's share of each term, which the
            # mean over workers weighted by rows (step 6) adds up to sum / count.
            *counts, all_rows = exchange.sum_across_workers(
                [units[i] for i in counted] + [batch_rows], cluster, device)
            for i, count in zip(counted, counts):
                scales[i] = tf.math.divide_no_nan(all_rows, count * batch_rows)
        term_losses = [total * scale for total, scale in zip(sums, scales)] if (
            objective.names) else []
        counted_scales = [scales[i] for i in counted]
        weights = [objective.weights[i] for i in counted]
    folded = []
    for output in outputs:
        grads = _add_scaled(output.grads, output.term_grads, counted_scales)
        with tf.device(device):
            loss = tf.add_n([tf.identity(output.loss)] + [
                weight * scale * output.terms[i].sum
                for i, weight, scale in zip(counted, weights, counted_scales)])
        folded.append(output._replace(grads=grads, loss=loss, term_grads=[]))
    return folded, term_losses


def _add_scaled(grads, term_grads, scales):
    """Per variable grads + sum_c scales[c] * term_grads[c], on the gradient's device."""
    if not term_grads:
        return grads
    added = []
    for v, grad in enumerate(grads):
        pieces = [(grad, None)] + [(group[v], scale) for group, scale in zip(term_grads, scales)]
        pieces = [(g, s) for g, s in pieces if g is not None]
        if not pieces:
            added.append(None)
            continue
        with tf.device(aggregate.dense_part(pieces[0][0]).device):
            added.append(aggregate.sum_gradients(
                [[g if s is None else aggregate.scale(g, s)] for g, s in pieces])[0])
    return added
