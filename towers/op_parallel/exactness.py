"""What a split would silently change, refused in one line.

A split layer's weight lives as parts, one per device, and everything Keras does to a
variable happens to each part on its own: the optimizer's update, a constraint applied
after it, a regulariser's penalty. That is exact where the operation is elementwise, or
a sum over entries (L1, L2: the parts' penalties add up to the whole's), or reduces
along axes the split leaves whole (MaxNorm over a column-split kernel's input axis).
Anything else (a norm along the split axis, an OrthogonalRegularizer, Lamb's trust ratio,
Adafactor's factored moments, Muon's orthogonalised update, a per-variable clipnorm)
would compute on a part what one device computes on the whole: refused here.
"""

import keras

from towers.op_parallel.dense import split_kind

# Regularisers that are a sum over the weight's entries: the parts' penalties add up.
_ADDITIVE_REGULARIZERS = (keras.regularizers.L1, keras.regularizers.L2, keras.regularizers.L1L2)
_NORM_CONSTRAINTS = (keras.constraints.MaxNorm, keras.constraints.UnitNorm,
                     keras.constraints.MinMaxNorm)
# Optimizers whose update of a variable reads the whole variable.
_WHOLE_VARIABLE_OPTIMIZERS = tuple(
    getattr(keras.optimizers, name) for name in ("Adafactor", "Lamb", "Muon")
    if hasattr(keras.optimizers, name))

# Per kind, the axis each of a Dense layer's (or an Embedding's) weights is split along:
# None = not split. EinsumDense and attention weights are split along axes their
# equations choose, so a norm constraint on them is refused whatever its axis.
_SPLIT_AXES = {"column": {"kernel": 1, "bias": 0}, "row": {"kernel": 0, "bias": None},
             "vocab": {"embeddings": 0}}


# Subclasses of a kind's layer type with their own call that a split keeps exactly, by
# module and name (naming keras_hub's classes here keeps it an optional extra). Each
# part runs the subclass's call on its own pieces:
# - keras_hub's CachedMultiHeadAttention: with no cache, MultiHeadAttention's projections,
#   attention and output projection; its key/value cache (B, 2, S, heads, k) runs along
#   the heads axis, which HeadsAttention splits with the heads.
# - keras_hub's WhisperCachedMultiHeadAttention: CachedMultiHeadAttention's call; its own
#   build makes the same projections, the key's without a bias, per head alike.
_CALLS_KEPT = frozenset({
    "keras_hub.src.layers.modeling.cached_multi_head_attention.CachedMultiHeadAttention",
    "keras_hub.src.models.whisper.whisper_cached_multi_head_attention."
    "WhisperCachedMultiHeadAttention"})


def keeps_call(cls, base):
    """Whether the parts of a split of `base` running `cls`'s call compute what one
    `cls` computes: every class from `cls` up to `base` that defines its own call or
    build is one a split keeps (_CALLS_KEPT)."""
    for klass in cls.__mro__[:cls.__mro__.index(base)]:
        if ("call" in vars(klass) or "build" in vars(klass)) and \
                f"{klass.__module__}.{klass.__qualname__}" not in _CALLS_KEPT:
            return False
    return True


def check_weights_split_exactly(name, layer, how):
    """Raises ValueError where splitting `layer` (plan entry `name`, kind `how`) would
    change what its weights' constraints or regularisers compute."""
    for weight in layer.trainable_weights:
        attribute = weight.path.rsplit("/", 1)[-1]  # kernel, bias, embeddings, ...
        regularizer = getattr(weight, "regularizer", None)
        if regularizer is not None and not isinstance(regularizer, _ADDITIVE_REGULARIZERS):
            raise ValueError(
                f"plan[{name!r}] = {how!r}: {attribute} has the regulariser "
                f"{type(regularizer).__name__}, which reads the whole weight; each part would "
                "compute its own. Use L1/L2, or leave the layer whole.")
        constraint = getattr(weight, "constraint", None)
        if constraint is None or isinstance(constraint, keras.constraints.NonNeg):
            continue
        kind = split_kind(how)[0]  # a Dense's "column:o" is its "column"
        axis = _SPLIT_AXES.get(kind, {}).get(attribute, "unknown") if isinstance(
            layer, (keras.layers.Dense, keras.layers.Embedding)) else "unknown"
        if isinstance(constraint, _NORM_CONSTRAINTS) and axis != "unknown":
            axes = constraint.axis if isinstance(constraint.axis, (list, tuple)) else [
                constraint.axis]
            if axis is None or axis not in [a % len(weight.shape) for a in axes]:
                continue
        raise ValueError(
            f"plan[{name!r}] = {how!r}: {attribute} has the constraint "
            f"{type(constraint).__name__}"
            + (f"(axis={constraint.axis})" if hasattr(constraint, "axis") else "")
            + ", which would read the whole weight across the parts; each part would apply "
            "its own. Drop the constraint, constrain along an axis the split leaves whole, "
            "or leave the layer whole.")


def check_elementwise_optimizer(optimizer):
    """Raises ValueError for an optimizer whose update of a variable is not elementwise:
    on a split layer's parts it would compute per part what one device computes on the
    whole variable."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)  # a LossScaleOptimizer's
    if isinstance(inner, _WHOLE_VARIABLE_OPTIMIZERS):
        raise ValueError(
            f"optimizer {type(inner).__name__} updates each variable from the whole of it "
            "(a trust ratio, factored or orthogonalised moments), but a split layer's "
            "weights are parts updated one by one; use an elementwise optimizer (SGD, Adam, "
            "AdamW, RMSprop, Lion, ...) with split layers.")
    if getattr(inner, "clipnorm", None) is not None:
        raise ValueError(
            f"optimizer clipnorm={inner.clipnorm} clips each variable by its own norm, which "
            "a split layer's parts would each compute alone; use global_clipnorm (or the "
            "trainer's clip_global_norm), whose norm spans every part.")
