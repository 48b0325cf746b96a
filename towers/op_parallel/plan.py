"""split_layers: a model with the layers a plan names replaced by their parallel forms;
join_layers: the model back with the original layer types and the full weights.

A plan is {layer name: how}: "column" or "row" (Dense), "vocab" (Embedding),
"heads" (MultiHeadAttention), or an int j (the whole layer on devices[j]).
"""

import keras
import numpy as np
import tensorflow as tf

from towers import devices as devices_lib
from towers.op_parallel.layers import ColumnDense, HeadsAttention, Placed, RowDense
from towers.op_parallel.layers import VocabEmbedding, part_sizes

KINDS = {"column": keras.layers.Dense, "row": keras.layers.Dense,
         "vocab": keras.layers.Embedding, "heads": keras.layers.MultiHeadAttention}
PARALLEL_FORMS = (ColumnDense, RowDense, VocabEmbedding, HeadsAttention, Placed)


def split_layers(model, plan, devices):
    """A new keras.Model computing what `model` computes, each layer named in `plan`
    replaced by its parallel form (its part j's variables on devices[j]); every other
    layer's variables on devices[0]. `model` is left as it was.

    Args:
      model: a built functional or Sequential keras.Model.
      plan: {layer name: "column" | "row" | "vocab" | "heads" | int}.
      devices: one tower's T device names, e.g. ["/device:CPU:0", "/device:CPU:1"].

    Raises:
      ValueError: one line naming what is wrong with the plan.
    """
    devices = [devices_lib.canonical_name(d) for d in devices]
    _check(model, plan, devices)
    by_name = {layer.name: layer for layer in model.layers}

    def clone(layer):
        how = plan.get(layer.name)
        if how is None:
            return _copy(layer)
        if isinstance(how, int):
            return Placed(_copy(layer), devices, how)
        config = layer.get_config()
        regularizer = layer.activity_regularizer
        if how == "column":
            return ColumnDense(config, devices, activity_regularizer=regularizer)
        if how == "vocab":
            return VocabEmbedding(config, devices)
        if how == "heads":
            if config["output_shape"] is None:  # the query's width, which the parts cannot see
                config["output_shape"] = int(layer._output_dense.kernel.shape[-1])
            return HeadsAttention(config, devices)
        return RowDense(config, devices, _input_units(layer), activity_regularizer=regularizer)

    with tf.device(devices[0]):
        parted = keras.models.clone_model(model, clone_function=clone)
    for layer in parted.layers:
        original = by_name.get(layer.name)
        if original is not None and original.weights:
            _copy_split(original, layer)
    return parted


def join_layers(model):
    """`model` with every parallel form replaced by the layer it stands for, with the
    full (joined) weights: to export, serve or compare. Variables on the current device."""
    def clone(layer):
        if isinstance(layer, (ColumnDense, RowDense)):
            return keras.layers.Dense.from_config(layer.dense_config)
        if isinstance(layer, VocabEmbedding):
            return keras.layers.Embedding.from_config(layer.embedding_config)
        if isinstance(layer, HeadsAttention):
            return keras.layers.MultiHeadAttention.from_config(layer.attention_config)
        return _copy(layer.layer if isinstance(layer, Placed) else layer)

    joined = keras.models.clone_model(model, clone_function=clone)
    by_name = {layer.name: layer for layer in model.layers}
    for layer in joined.layers:
        if not layer.weights:
            continue
        parted = by_name[layer.name]
        if isinstance(parted, ColumnDense):
            kernels = [p.kernel.numpy() for p in parted.parts]
            weights = [np.concatenate(kernels, axis=-1)]
            if parted.dense_config["use_bias"]:
                weights.append(np.concatenate([p.bias.numpy() for p in parted.parts]))
            layer.set_weights(weights)
        elif isinstance(parted, RowDense):
            weights = [np.concatenate([p.kernel.numpy() for p in parted.parts], axis=0)]
            if parted.dense_config["use_bias"]:
                weights.append(parted.parts[0].bias.numpy())
            layer.set_weights(weights)
        elif isinstance(parted, VocabEmbedding):
            layer.set_weights([np.concatenate([p.embeddings.numpy() for p in parted.parts])])
        elif isinstance(parted, HeadsAttention):
            layer.set_weights(_joined_heads(parted))
        elif parted.weights:
            layer.set_weights(parted.get_weights())
    return joined


def is_split(model):
    """Whether `model` holds parallel forms of layers (split_layers' result)."""
    return any(isinstance(layer, PARALLEL_FORMS) for layer in model.layers)


def _copy(layer):
    """A new layer like `layer`; a layer (or op) without variables is shared, not copied:
    it has nothing to place, and its config may not rebuild it (a Lambda's function)."""
    if not getattr(layer, "weights", None):
        return layer
    return layer.__class__.from_config(layer.get_config())


def _part_ranges(parted):
    """(part, start, end) of each part of `parted`: the units [start, end) it holds."""
    ends = np.cumsum(parted.sizes)
    return zip(parted.parts, ends - parted.sizes, ends)


def _copy_split(original, parted):
    """Writes `original`'s weights into `parted`, its parallel form or clone."""
    if isinstance(parted, ColumnDense):
        kernel, bias = original.kernel.numpy(), original.bias if original.use_bias else None
        for part, start, end in _part_ranges(parted):
            part.kernel.assign(kernel[:, start:end])
            if bias is not None:
                part.bias.assign(bias.numpy()[start:end])
    elif isinstance(parted, VocabEmbedding):
        table = original.embeddings.numpy()
        for part, start, end in _part_ranges(parted):
            part.embeddings.assign(table[start:end])
    elif isinstance(parted, HeadsAttention):
        _split_heads(original, parted)
    elif isinstance(parted, RowDense):
        kernel = original.kernel.numpy()
        for part, start, end in _part_ranges(parted):
            part.kernel.assign(kernel[start:end])
        if original.use_bias:
            parted.parts[0].bias.assign(original.bias.numpy())
    else:
        parted.set_weights(original.get_weights())


_PROJECTIONS = ("_query_dense", "_key_dense", "_value_dense")


def _split_heads(original, parted):
    """Each part's heads of the query, key and value projections (kernels (d, H, k), biases
    (H, k)) and of the output projection (kernel (H, v, d)); the output bias to part 0."""
    for part, start, end in _part_ranges(parted):
        for name in _PROJECTIONS:
            whole, piece = getattr(original, name), getattr(part, name)
            piece.kernel.assign(whole.kernel.numpy()[:, start:end])
            if original._use_bias:
                piece.bias.assign(whole.bias.numpy()[start:end])
        part._output_dense.kernel.assign(original._output_dense.kernel.numpy()[start:end])
    if original._use_bias:
        parted.parts[0]._output_dense.bias.assign(original._output_dense.bias.numpy())


def _joined_heads(parted):
    """The weights of the MultiHeadAttention `parted` stands for, in its weights' order."""
    weights = []
    for name in _PROJECTIONS:
        weights.append(np.concatenate([getattr(p, name).kernel.numpy() for p in parted.parts], 1))
        if parted.parts[0]._use_bias:
            weights.append(np.concatenate([getattr(p, name).bias.numpy() for p in parted.parts]))
    weights.append(np.concatenate([p._output_dense.kernel.numpy() for p in parted.parts]))
    if parted.parts[0]._use_bias:
        weights.append(parted.parts[0]._output_dense.bias.numpy())
    return weights


def _input_units(layer):
    return int(layer.kernel.shape[0])


def _split_size(layer, how):
    """(how many units the split `how` divides among the parts, what they are)."""
    if how == "column":
        return layer.units, "output units"
    if how == "row":
        return _input_units(layer), "input units"
    if how == "heads":
        return layer.num_heads, "heads"
    return layer.input_dim, "rows"


def _check(model, plan, devices):
    if not isinstance(model, keras.Model) or not (
            isinstance(model, keras.Sequential) or model.__class__.__name__ == "Functional"):
        raise ValueError(f"split_layers needs a functional or Sequential keras.Model, got "
                         f"{type(model).__name__}: a subclassed model's layers cannot be "
                         "replaced from outside; build it with the functional API.")
    if not model.built:
        raise ValueError(f"model {model.name!r} is not built; call it on a batch (or build "
                         "it) before split_layers.")
    if not isinstance(plan, dict) or not plan:
        raise ValueError(f"plan must be a non-empty dict {{layer name: how}}, got {plan!r}.")
    if not devices:
        raise ValueError("devices must name at least one device, one per part.")
    layers = {layer.name: layer for layer in model.layers}
    for name, how in plan.items():
        if name not in layers:
            raise ValueError(f"plan names layer {name!r}, which model {model.name!r} does not "
                             f"have; its layers are {sorted(layers)}.")
        layer = layers[name]
        if isinstance(how, bool) or not isinstance(how, (int, str)):
            raise ValueError(f"plan[{name!r}] must be one of {sorted(KINDS)} or a device "
                             f"index, got {how!r}.")
        if isinstance(how, int):
            if not 0 <= how < len(devices):
                raise ValueError(f"plan[{name!r}] = {how} is not a device index: there are "
                                 f"{len(devices)} devices, 0 to {len(devices) - 1}.")
            continue
        if how not in KINDS:
            raise ValueError(f"plan[{name!r}] = {how!r} is not a kind; use one of "
                             f"{sorted(KINDS)} or a device index.")
        if type(layer) is not KINDS[how]:
            raise ValueError(f"plan[{name!r}] = {how!r} splits {KINDS[how].__name__} layers, "
                             f"but {name!r} is {type(layer).__name__}.")
        if how == "heads" and layer.get_config().get("use_gate"):
            raise ValueError(f"plan[{name!r}] = 'heads': a gated MultiHeadAttention "
                             "(use_gate=True) is not split yet; place it whole instead.")
        units, what = _split_size(layer, how)
        try:
            part_sizes(units, len(devices))
        except ValueError:
            raise ValueError(f"plan[{name!r}] = {how!r} splits {units} {what} into "
                             f"{len(devices)} parts; give at most {units} devices.") from None
