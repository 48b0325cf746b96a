"""Step 3's losses: what keras.Model.compile takes as `loss` and `loss_weights`, per shard.

Keras's loss of a batch is, per loss term (one per output that has a loss),
sum(loss values x sample weight x mask) / denominator, weighted by its
loss_weight, the terms added. A shard can compute its share of every sum but
not always the denominator, which the loss's reduction decides:
- "sum_over_batch_size" (Keras's default) and "mean" without a mask: the
  batch's rows times the values per row, known before the forward, so each
  tower pre-weights its share (its gradients then only need adding up, steps 4-5);
- the same with a Keras mask on the output: the batch's unmasked entries (and
  with "mean_with_sample_weight" the sum of the weights): *counted*, known only
  once every tower has run its forward (towers.engine.denominators);
- "sum": none (1): a *sum term*, whose share is the shard's sum, whole (a mask
  only zeroes the masked entries, as Keras's does);
- None / "none": Keras's compile adds the terms' unreduced values entry by entry
  into one loss vector, logs its mean (each such term a mean over the batch's
  entries, masked ones counted as 0) and differentiates its sum: the gradient
  of that mean times the vector's entries over the batch (denominators.count).
`Objective` resolves the forms exactly as compile does, with Keras's own
CompileLoss (towers.compat), and gives each shard a `Term` per loss term.
"""

import collections

import keras
import tensorflow as tf

from towers import compat, errors
from towers.op_parallel import vocab_loss

# Keras's reductions (keras.losses.Loss): those that divide by the batch's
# entries, of which a mask counts only the unmasked ones; by the sum of the
# weights; none (a sum term); and none at all (compile sums the values).
_ENTRIES_MEAN = ("sum_over_batch_size", "mean")
_WEIGHTS_MEAN = "mean_with_sample_weight"
SUM = "sum"
UNREDUCED = (None, "none")
_REDUCTIONS = _ENTRIES_MEAN + (_WEIGHTS_MEAN, SUM) + UNREDUCED
_AUTO_NAMES = ("crossentropy", "ce")  # compile picks binary / categorical / sparse by shape

Term = collections.namedtuple("Term", ["sum", "units", "per_row"])
Term.__doc__ = """One loss term on one shard (or micro-batch), float32 scalars.

sum: the sum of its loss values times their sample weights and mask (0/1).
units: the shard's share of the term's denominator: Keras's loss of a batch is
  sum over the batch's shards of `sum` / sum of `units` (but a sum term's,
  Objective.summed, is the sum of `sum`: its units are the shard's entries).
per_row: units per row where the denominator follows the rows (known before
  the forward: rows x per_row), else None (counted: a mask, or the weights).
"""


class Objective:
    """A model's loss as keras.Model.compile defines it, computed shard by shard.

    Attributes:
      names: the log name of each loss term ("cls_loss", ...) where there are
        several (Keras logs each), else [] (the one term is "loss"). Known
        after the first call of `terms`.
      weights: per term its loss_weight (1.0 where none was given).
      reductions: per term the Keras reduction of its loss; `summed`: the
        indices of the sum terms ("sum"), `unreduced`: of those with None or
        "none" (all three known after the first call of `terms`).
      given_reductions: the reductions of the losses given, a frozenset, known
        at construction (what the step decides before any forward).
      counted: None before the first call of `terms`, then the indices of the
        terms whose denominator is counted (a Keras mask on the output).
      sparse_targets: None before the first call of `terms`, then the indices in
        tf.nest.flatten(y_true) of the targets a sparse categorical crossentropy
        term reads (class ids; `sparse_labels.check_sparse_labels`).
      model_loss_forms: None (every term of model.losses counts as a mean over
        rows), or {key: model_losses.MEAN or SUM} per loss the model adds in its
        call, as measured on the first batch (training/model_loss_forms.py).
    """

    def __init__(self, loss, loss_weights=None, output_names=None):
        """Checks `loss` and `loss_weights` (each form keras.Model.compile takes).

        Raises:
          ValueError: one line saying which entry is wrong and what would do.
        """
        if loss is None:
            raise ValueError("loss is None; give what keras.Model.compile takes as loss (a "
                             "keras.losses.Loss, a loss name, a callable(y_true, y_pred) or a "
                             "list or dict of them per output), or a model compiled with one.")
        for entry in tf.nest.flatten(loss):
            _check_loss(entry)
        if loss_weights is not None and not all(
                _is_number(w) or w is None for w in tf.nest.flatten(loss_weights)):
            raise ValueError(f"loss_weights must be a number, or a list or dict of numbers "
                             f"(one per output with a loss), got {loss_weights!r}.")
        if isinstance(loss, (list, tuple, dict)) and not tf.nest.flatten(loss):
            raise ValueError(f"loss {loss!r} holds no loss; give one per output.")
        _check_loss_weights(loss, loss_weights, output_names)
        self.given_reductions = frozenset(
            entry.reduction if isinstance(entry, keras.losses.Loss) else _ENTRIES_MEAN[0]
            for entry in tf.nest.flatten(loss) if entry is not None)
        self._recorded, self.counted, self.sparse_targets = None, None, None
        self.model_loss_forms = None
        self._keras = compat.CompileLoss(loss, loss_weights, output_names, self._record)

    @property
    def names(self):
        terms = self._keras.flat_losses or []
        return [f"{term.name}_loss" for term in terms] if len(terms) > 1 else []

    @property
    def weights(self):
        return [1.0 if term.loss_weights is None else float(term.loss_weights)
                for term in self._keras.flat_losses]

    @property
    def reductions(self):
        return [term.loss.reduction for term in self._keras.flat_losses]

    @property
    def summed(self):
        return [i for i, reduction in enumerate(self.reductions) if reduction == SUM]

    @property
    def unreduced(self):
        return [i for i, reduction in enumerate(self.reductions) if reduction in UNREDUCED]

    def terms(self, y_true, outputs, sample_weight=None):
        """Each loss term of one shard: a list of Term, in Keras's order of the terms.

        Args:
          y_true: the shard's targets, any structure keras.Model.fit takes.
          outputs: (y_pred, masks) as forward.forward returns them: the model's
            outputs and their Keras masks, {index in tf.nest.flatten(y_pred): mask}.
          sample_weight: None, weights of shape (n,) or (n, ...), or one per output.

        Raises:
          errors.LossMismatch: the loss itself does not fit the outputs (what it
            returns), in one line.
          errors.LossMismatch: unreduced terms (reduction=None) whose values differ
            in shape per row, which Keras's compile cannot add entry by entry either.
          ValueError, TypeError, tf.errors.OpError: targets that do not fit them.
        """
        y_pred = with_masks(outputs)
        self._recorded, self._sparse_ids, self._row_shapes = [], [], []
        try:
            self._keras(y_true, y_pred, sample_weight)
        except (KeyError, TypeError) as error:
            raise errors.LossMismatch(
                f"the loss does not fit the model's outputs: {error}") from None
        terms, self._recorded = self._recorded, None
        _check_unreduced([self._row_shapes[i] for i in self.unreduced])
        self.counted = [i for i, term in enumerate(terms) if term.per_row is None]
        # Keras hands each term one of y_true's own leaves, only regrouped.
        index_of = {id(target): i for i, target in enumerate(tf.nest.flatten(y_true))}
        self.sparse_targets = sorted({index_of[k] for k in self._sparse_ids if k in index_of})
        return terms

    def _record(self, loss, y_true, y_pred, sample_weight):
        if getattr(loss, "fn", None) is keras.losses.sparse_categorical_crossentropy:
            self._sparse_ids.append(id(y_true))  # also SparseCategoricalCrossentropy's fn
        values, weight, mask = _weighted_values(loss, y_true, y_pred, sample_weight)
        self._row_shapes.append(tuple(values.shape[1:]))
        self._recorded.append(_term(loss, values, weight, mask))
        return tf.zeros([])  # Keras adds these up; the terms are what counts


def term(loss, y_true, y_pred, sample_weight=None):
    """One loss term of a shard as a Term: Keras's Loss.__call__ up to its reduction.

    The mask is the one Keras attaches to y_pred, combined with one the loss's
    values may carry; Keras's "sum_over_batch_size" with a mask divides by the
    batch's unmasked entries, which `units` counts (scaled as Keras scales them
    where the values and the mask differ in size). With any other reduction the
    mask only weighs the values 0 or 1, as Keras's does.
    """
    return _term(loss, *_weighted_values(loss, y_true, y_pred, sample_weight))


def _weighted_values(loss, y_true, y_pred, sample_weight):
    """(values x weights, weights, mask) of one loss term: the weights are the sample
    weights times the mask (0/1; None for neither), the mask None for none."""
    in_mask = compat.keras_mask(y_pred)
    y_pred = tf.nest.map_structure(lambda t: tf.cast(t, loss.dtype), y_pred)
    y_true = tf.nest.map_structure(lambda t: tf.cast(t, loss.dtype), y_true)
    values = vocab_loss.per_example_losses(loss, y_true, y_pred)  # logits kept in parts
    values = _checked_losses(loss.call(y_true, y_pred) if values is None else values, y_true,
                             y_pred)
    out_mask = compat.keras_mask(values)
    masks = [tf.cast(m, tf.bool) for m in (in_mask, out_mask) if m is not None]
    mask = None if not masks else masks[0] if len(masks) == 1 else masks[0] & masks[1]
    weight = None if sample_weight is None else tf.cast(sample_weight, tf.float32)
    if mask is not None:
        weight = _times(tf.cast(mask, tf.float32), weight)
    if weight is not None:
        values, weight = _matched(values, weight)
        values = values * weight
    return values, weight, mask


def _term(loss, values, weight, mask):
    """The Term of a loss term's weighted values (_weighted_values')."""
    per_row = tf.cast(tf.reduce_prod(tf.shape(values)[1:]), tf.float32)
    rows = tf.cast(tf.shape(values)[0], tf.float32)
    total = tf.reduce_sum(values)
    if loss.reduction == _WEIGHTS_MEAN and weight is not None:
        return Term(total, tf.reduce_sum(weight), None)
    if mask is None or loss.reduction not in _ENTRIES_MEAN:
        return Term(total, rows * per_row, per_row)
    # Keras weighs each unmasked entry total / valid (mask entries over unmasked
    # ones) and divides by the values' size: size x valid / total per shard, summed.
    mask_size = tf.cast(tf.size(mask), tf.float32)
    valid = tf.reduce_sum(tf.cast(mask, tf.float32))
    return Term(total, tf.math.divide_no_nan(rows * per_row * valid, mask_size), None)


def with_masks(outputs):
    """y_pred of (y_pred, masks) with each mask attached as Keras attaches it."""
    y_pred, masks = outputs
    leaves = tf.nest.flatten(y_pred)
    for index, mask in masks.items():
        compat.set_keras_mask(leaves[index], mask)
    return y_pred


def output_masks(y_pred):
    """{index in tf.nest.flatten(y_pred): the Keras mask of that output} for masked ones."""
    masks = [compat.keras_mask(t) for t in tf.nest.flatten(y_pred)]
    return {i: mask for i, mask in enumerate(masks) if mask is not None}


def _check_loss(loss):
    """Raises ValueError unless `loss` is one loss compile takes."""
    if loss is None:
        return
    if isinstance(loss, type):  # callable, but calling it builds a loss, not a value
        raise ValueError(f"loss {loss.__name__} is a class; pass an instance, "
                         f"{loss.__name__}(), or a loss name.")
    if isinstance(loss, keras.losses.Loss):
        if loss.reduction not in _REDUCTIONS:  # Keras checks its own; a subclass may not
            raise ValueError(
                f"loss {loss.name!r} has reduction={loss.reduction!r}, which is not one of "
                f"Keras's: {', '.join(map(repr, _REDUCTIONS))}.")
    elif isinstance(loss, str):
        if loss.lower() not in _AUTO_NAMES and not _known_loss(loss):
            raise ValueError(f"loss {loss!r} is not a Keras loss name; pass e.g. "
                             "'sparse_categorical_crossentropy' or a keras.losses.Loss.")
    elif not callable(loss):
        raise ValueError(
            f"loss must be a keras.losses.Loss, a loss name or a callable(y_true, y_pred) "
            f"returning per-example losses, or a list or dict of them (one per output), "
            f"got {type(loss).__name__}.")


def _check_unreduced(row_shapes):
    """Raises errors.LossMismatch for unreduced terms whose values differ in shape per row:
    Keras's compile adds them entry by entry into one loss vector and fails (or,
    where one has a single entry per row, spreads it over a square)."""
    if len(set(row_shapes)) > 1:
        shapes = " and ".join(str((None, *shape)) for shape in row_shapes)
        raise errors.LossMismatch(
            f"the losses with reduction=None return values of shapes {shapes}; Keras's "
            "compile adds unreduced losses entry by entry, which these shapes do not allow: "
            "give them one shape, or a reduction ('sum', 'sum_over_batch_size').")


def _check_loss_weights(loss, loss_weights, output_names):
    """Raises ValueError for loss_weights that cannot fit `loss` whatever the batch: a
    dict naming an output the model (of `output_names`, where known) lacks, or, beside
    a list or dict of losses, another number of weights than of losses (Keras's rule)."""
    if isinstance(loss_weights, dict) and output_names:
        unknown = [name for name in loss_weights if name not in output_names]
        if unknown:
            raise ValueError(f"loss_weights names {unknown}, not outputs of the model; its "
                             f"outputs are {list(output_names)}.")
    if isinstance(loss, (list, tuple, dict)) and isinstance(loss_weights, (list, tuple, dict)):
        num_losses, num_weights = len(tf.nest.flatten(loss)), len(tf.nest.flatten(loss_weights))
        if num_losses != num_weights:
            raise ValueError(f"loss_weights holds {num_weights} weight(s) but the loss "
                             f"{num_losses} loss(es): give one weight per loss, in the "
                             "loss's form.")


def _known_loss(name):
    try:
        return keras.losses.get(name) is not None
    except ValueError:
        return False


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _checked_losses(values, y_true, y_pred):
    """`values` as float32 after checking it holds one loss per example of y_pred
    (errors.LossMismatch otherwise). The examples are y_pred's rows, or y_true's where
    only those are known as the step is traced (a stage's traced forward, retraced for
    another micro-batch size, returns rows of unknown size)."""
    name = "the loss"
    if not tf.is_tensor(values):
        try:
            values = tf.convert_to_tensor(values)
        except (TypeError, ValueError):
            raise errors.LossMismatch(f"{name} returned {type(values).__name__}, not a tensor "
                                      "of per-example losses.") from None
    if not values.dtype.is_floating:
        raise errors.LossMismatch(f"{name} returned {values.dtype.name} values; it must "
                                  "return floating-point per-example losses.")
    if values.shape.rank == 0:
        raise errors.LossMismatch(
            f"{name} returned a scalar; it must return one loss per example, shape "
            "(batch,). Don't reduce inside a loss callable (towers averages over the "
            "global batch itself), or pass a keras.losses.Loss object.")
    expected = next((t.shape[0] for t in tf.nest.flatten([y_pred, y_true])
                     if t is not None and t.shape.rank and t.shape[0] is not None), None)
    if values.shape[0] is not None and expected is not None and values.shape[0] != expected:
        raise errors.LossMismatch(
            f"{name} returned shape {tuple(values.shape)} for a batch of {expected} "
            f"examples; it must return one loss per example, shape ({expected},).")
    if values.shape[0] is not None and expected is None:
        raise errors.LossMismatch(
            f"{name} returned a fixed shape {tuple(values.shape)} that does not follow "
            "the batch size; it must return one loss per example, shape (batch,).")
    mask = compat.keras_mask(values)
    values = tf.cast(values, tf.float32)
    if mask is not None:
        compat.set_keras_mask(values, mask)
    return values


def _times(mask, weight):
    """A 0/1 float mask times the sample weights, ranks matched as Keras matches them."""
    if weight is None:
        return mask
    mask, weight = _matched(mask, weight)
    return mask * weight


def _matched(values, weight):
    """(values, weight) shaped to multiply as Keras does (squeeze_or_expand_to_same_rank:
    weights (rows, 1) make values (rows,) a column); where Keras would refuse a weight of
    lower rank (one weight per row of per-token values), it is broadcast along the row.

    Raises:
      ValueError: weights that would spread the values over more entries than they
        have (Keras multiplies (rows,) values by (rows, rows) weights into a square).
    """
    values, weight = compat.same_rank(values, weight)
    while weight.shape.rank < values.shape.rank:
        weight = tf.expand_dims(weight, -1)
    if weight.shape.rank > values.shape.rank or any(
            v == 1 and w not in (1, None) for v, w in zip(values.shape, weight.shape)):
        raise ValueError(f"weights of shape {(None, *weight.shape[1:])} for loss values of "
                         f"shape {(None, *values.shape[1:])}")
    return values, weight
