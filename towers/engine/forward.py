"""Step 3: one tower's forward pass and its share of the batch's loss, on its device.

Every function here runs under `tf.device(tower)` and writes no variable: the
model runs through Keras 3 `stateless_call` on the tower's copies of the
weights, so towers never race to update BatchNorm statistics or RNG state. An
empty micro-batch does not run the model at all (`unless_empty`).
"""

import functools
import inspect

import keras
import tensorflow as tf

from towers.data_parallel import split
from towers.engine import losses, model_losses


def predict(stages, tower, may_be_empty=True, forwards=None):
    """Step 3 without gradients, stage by stage along the tower's devices: (outputs,
    regularization).

    tower: an engine.tower.TowerWork (its shard, rows, weights and state, each stage's
    on its device); may_be_empty as run_tower's. forwards: None, or per stage
    fn(weights, state, x) -> `forward`'s result in inference mode (one traced for
    every tower: traced_tower.traced_forwards). outputs ((y_pred, masks), as
    `forward`'s) and the regularisation (every stage's keyed terms,
    model_losses.merged; each 0 for no rows) are on the tower's last device.
    """
    values, regularization = tower.shard[0], []
    forwards = forwards or [functools.partial(forward, model, training=False)
                            for model in stages.models]
    for k, device in enumerate(tower.devices):
        with tf.device(device):
            values = values if k == 0 else cross_cut(values)
            values, _, stage_regularization = unless_empty(
                tower.rows, forwards[k],
                stages.select(tower.weights, k), stages.select(tower.state, k, trainable=False),
                values, may_be_empty)
            regularization.append(stage_regularization)
    with tf.device(tower.devices[-1]):
        return values, model_losses.merged(regularization)


def cross_cut(outputs):
    """What crosses a pipeline cut: a stage's (outputs, masks) copied to the current
    device, as the flat list the next stage takes, each mask attached again (a copy
    drops it, and a layer after the cut that only passes a mask on needs it)."""
    values, masks = outputs
    copies = [tf.identity(t) for t in tf.nest.flatten(values)]
    return losses.with_masks((copies, {i: tf.identity(m) for i, m in masks.items()}))


def unless_empty(rows, forward_fn, weights, state, x, may_be_empty=True):
    """forward_fn(weights, state, x), run only when the micro-batch x has rows.

    An empty micro-batch (a batch smaller than towers x micro-batches) has
    nothing to compute: its gradients are zero and its weight in every average
    is 0, so skipping it is exact. And some kernels mishandle a 0-row input
    (TensorFlow's oneDNN convolution returns a wrong shape), so the model must
    not see one. Where `rows` is known only at run time, a tf.cond picks.

    Args:
      rows: examples in x, an int or an int32 scalar Tensor.
      forward_fn: fn(weights, state, x) -> (y_pred, new_state, regularization),
        as `forward`.
      may_be_empty: False where x is known to have rows: forward_fn runs, no
        tf.cond (it costs a few percent of a small model's step).

    Returns:
      forward_fn's result; for no rows, outputs with 0 rows shaped like real
      ones (unknown dims 0), the state as it was and every regularisation term 0.
    """
    if not may_be_empty or isinstance(rows, int) and rows > 0:
        return forward_fn(weights, state, x)
    if tf.executing_eagerly():
        if int(rows) > 0:
            return forward_fn(weights, state, x)
        # The empty result takes its shapes from a traced forward: trace one.
        return tf.function(unless_empty, autograph=False)(tf.constant(0), forward_fn, weights,
                                                          state, x)
    traced = []

    def run():
        traced.append(forward_fn(weights, state, x))
        return traced[0]

    def skip():  # traced after run, so it knows run's structure
        outputs, new_state, regularization = traced[0]
        return (tf.nest.map_structure(split.no_rows, outputs),
                [None if new is None else old for new, old in zip(new_state, state)],
                {key: tf.constant(0.0) for key in regularization})

    return tf.cond(tf.greater(rows, 0), run, skip)


def forward(model, weights, state, x, training):
    """Step 3: the model's forward pass on the current device, writing no variable.

    Returns:
      (outputs, new_state, regularization): outputs = (y_pred, masks), the
      model's outputs and the Keras masks they carry ({index in
      tf.nest.flatten(y_pred): bool mask}, {} for none: a mask would not survive
      the copies and concatenations ahead); the new non-trainable values (None
      where the layer did not change them); the model's regularisation losses
      (model.losses) keyed by term (model_losses.keyed_terms), {} for none.
    """
    kwargs = {"training": training} if _accepts_training(model) else {}
    y_pred, new_values, regularization = stateless_run(
        model, model.trainable_variables + model.non_trainable_variables,
        list(weights) + list(state), lambda: model(x, **kwargs))
    return ((y_pred, losses.output_masks(y_pred)), new_values[len(weights):], regularization)


def stateless_run(model, variables, values, call):
    """call() with each of `variables` read as its value in `values`, writing none:
    Keras's `stateless_call`, for any call of `model` (any arguments) through its
    public `keras.StatelessScope`, keeping what `stateless_call` drops (a metric's
    update inside `call`) where `variables` lists it.

    Returns:
      (result, new_values, regularization): call()'s result; per variable its value
      after the call, None where the call left it; the losses the call added and the
      weights' regularisers (model.losses), keyed by term (model_losses.keyed_terms:
      {key: float32 scalar}, {} for none).

    Raises:
      ValueError: the call assigned a variable that is not in `variables`: its update
        would be lost.
    """
    with keras.StatelessScope(list(zip(variables, values)), collect_losses=True) as scope:
        given = dict(scope.state_mapping)
        result = call()
        extra_losses = model.losses
    lost = set(scope.state_mapping) - set(given)
    metrics = [v.path for v in model.metrics_variables if id(v) in lost]
    if metrics:
        raise ValueError(
            f"{model.name}'s call updates the metric variables {metrics}, which "
            "TowerTrainer does not carry from the towers; give the metric as "
            "TowerTrainer(metrics=...), computed from the outputs, or train with "
            "towers.tower_step, which carries it.")
    if lost:
        raise ValueError(
            f"calling {model.name} assigns {len(lost)} variable(s) that are not weights of "
            f"its layers nor of their metrics; the towers would lose that update. Make it "
            f"a weight of a layer of {model.name} (layer.add_weight) or a keras.metrics "
            "metric held by one.")
    new_values = [None if scope.state_mapping[id(v)] is given[id(v)] else
                  scope.state_mapping[id(v)] for v in variables]
    return result, new_values, model_losses.keyed_terms(model, extra_losses, scope.losses)


def shard_loss(objective, shard, outputs, regularization, rows, batch_rows, sum_scale=None):
    """A shard's share of the batch's loss, and its loss terms (losses.Term).

    share: a float32 scalar, or None where there is nothing to it: the sum of the
    terms whose denominator is known, each over the batch's (Keras's
    "sum_over_batch_size": rows x values per row; a sum term's: none, its sum
    times `sum_scale` where one is given) and times its loss weight, plus the
    regularisation's share (regularization_share). Adding up the shares of
    a batch's shards gives its loss plus the regularisation counted once,
    which is what one device computes. An empty shard's share is 0. The terms
    whose denominator is counted (a Keras mask) are not in it: denominators.py
    scales them once every shard is counted.
    """
    _, y, sample_weight = split.unpack_batch(shard)
    terms = objective.terms(y, outputs, sample_weight)
    summed = objective.summed
    shares = [weight * (term.sum if sum_scale is None else term.sum * sum_scale) if i in summed
              else weight * tf.math.divide_no_nan(term.sum, batch_rows * term.per_row)
              for i, (term, weight) in enumerate(zip(terms, objective.weights))
              if term.per_row is not None]
    regularization = regularization_share(objective, regularization, rows, batch_rows)
    if regularization is not None:
        shares.append(regularization)
    return (tf.add_n(shares) if shares else None), terms


def regularization_share(objective, regularization, rows, batch_rows):
    """A shard's share of the batch's regularisation (keyed terms, as `forward` returns
    them) by the forms measured on the first batch (objective.model_loss_forms): a
    mean term times rows / batch_rows, a sum term whole. A float32 scalar, or None.

    Raises:
      ValueError: (when traced) regularisation beside an unreduced loss
        (reduction=None), which Keras's compile cannot add to it either.
    """
    if regularization and objective.given_reductions & set(losses.UNREDUCED):
        added = sorted(model_losses.layer_of(key) for key in regularization
                       if key != model_losses.WEIGHTS)
        what = (f"layer {added[0]!r} adds a loss in its call" if added else
                "its weights have regularizers")
        raise ValueError(
            f"the loss has reduction=None and the model adds losses of its own ({what}); "
            "Keras's compile cannot add those to an unreduced loss either (its train_step "
            "fails on them): give the loss reduction='sum' (the gradient reduction=None "
            "gives) or another.")
    return model_losses.share(regularization, objective.model_loss_forms,
                             row_fraction(rows, batch_rows))


def row_fraction(rows, batch_rows):
    """rows / batch_rows as a float32 scalar (0 for a batch of no rows)."""
    return tf.math.divide_no_nan(tf.cast(rows, tf.float32), batch_rows)


def concat_rows(pieces):
    """Concatenates a list of (nested) outputs along dim 0 (outputs' masks too).

    The first piece holds the most rows (split_batch's order). An empty piece
    (unless_empty's) has 0 for the dims it could not know, so where those are
    unknown, every piece takes the first one's.
    """
    def concat(*tensors):
        if not tensors[0].shape[1:].is_fully_defined():
            features = tf.shape(tensors[0])[1:]
            tensors = [tf.reshape(p, tf.concat([tf.shape(p)[:1], features], 0)) for p in tensors]
        return tf.concat(tensors, 0)

    return tf.nest.map_structure(concat, *pieces)


def _accepts_training(model):
    parameters = inspect.signature(model.call).parameters
    return "training" in parameters or any(
        p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters.values())
