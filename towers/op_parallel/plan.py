"""split_layers: a model with the layers a plan names replaced by their parallel forms;
join_layers: the model back with the original layer types and the full weights.

A plan is {layer name: how}: "column" or "row" (Dense, EinsumDense), "vocab" (Embedding),
"heads" (MultiHeadAttention), or an int j (the whole layer on devices[j]).
"""

import keras
import numpy as np
import tensorflow as tf

from towers import devices as devices_lib
from towers.op_parallel import exactness
from towers.op_parallel.dense import DENSE_EQUATION, ColumnDense, RowDense, split_axes
from towers.op_parallel.layers import HeadsAttention, Placed, VocabEmbedding, part_sizes

_DENSE_LAYERS = (keras.layers.Dense, keras.layers.EinsumDense)
KINDS = {"column": _DENSE_LAYERS, "row": _DENSE_LAYERS,
         "vocab": (keras.layers.Embedding,), "heads": (keras.layers.MultiHeadAttention,)}
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
      ValueError: one line naming what is wrong with the model, the plan or the
        devices (one that does not exist included).
    """
    if isinstance(devices, str) or not isinstance(devices, (list, tuple)):
        raise ValueError(f"devices must be a list of device names, one per part, e.g. "
                         f"['/device:CPU:0', '/device:CPU:1'], got {devices!r}.")
    devices = [devices_lib.canonical_name(d) for d in devices]
    _check(model, plan, devices)
    devices_lib.check_devices_exist(devices)
    by_name = {layer.name: layer for layer in model.layers}

    def clone(layer):
        how = plan.get(layer.name)
        if how is None:
            return _copy(layer)
        if isinstance(how, int):
            return Placed(_copy(layer), devices, how)
        config = layer.get_config()
        if how in ("column", "row"):
            form = ColumnDense if how == "column" else RowDense
            return form(config, type(layer).__name__, devices, _split_size(layer, how)[0],
                        activity_regularizer=layer.activity_regularizer)
        if how == "vocab":
            return VocabEmbedding(config, devices)
        if how == "heads":
            if config["output_shape"] is None:  # the query's width, which the parts cannot see
                config["output_shape"] = int(layer.output_dense.kernel.shape[-1])
            return HeadsAttention(config, devices)

    with tf.device(devices[0]):
        parted = keras.models.clone_model(model, clone_function=clone)
    for layer in parted.layers:
        original = by_name.get(layer.name)
        if original is not None and original.weights:
            write_split(layer, original.get_weights())
    return parted


def join_layers(model):
    """`model` with every parallel form replaced by the layer it stands for, with the
    full (joined) weights: to export, serve or compare. Variables on the current device."""
    if not isinstance(model, keras.Model):
        raise ValueError(f"join_layers takes the keras.Model split_layers returned, got "
                         f"{type(model).__name__}.")

    def clone(layer):
        if isinstance(layer, (ColumnDense, RowDense)):
            return getattr(keras.layers, layer.layer_class).from_config(layer.layer_config)
        if isinstance(layer, VocabEmbedding):
            return keras.layers.Embedding.from_config(layer.embedding_config)
        if isinstance(layer, HeadsAttention):
            return keras.layers.MultiHeadAttention.from_config(layer.attention_config)
        return _copy(layer.layer if isinstance(layer, Placed) else layer)

    joined = keras.models.clone_model(model, clone_function=clone)
    by_name = {layer.name: layer for layer in model.layers}
    for layer in joined.layers:
        if layer.weights:
            layer.set_weights(joined_values(by_name[layer.name]))
    return joined


def joined_values(layer, read=lambda variable: variable.numpy()):
    """The weights (NumPy arrays) of the layer `layer` stands for, in that layer's order:
    its parts' joined, for a parallel form; else its own. `read`: a variable's value
    (an optimizer slot's can stand in for it)."""
    if not isinstance(layer, PARALLEL_FORMS):
        return [read(weight) for weight in layer.weights]
    return [read(variables[0]) if axis is None else
            np.concatenate([read(v) for v in variables], axis)
            for axis, variables in layer.layout()]


def write_split(layer, values, write=lambda variable, value: variable.assign(value)):
    """Writes `values`, the weights of the layer `layer` stands for, into it: cut into
    its parts for a parallel form. `write(variable, value)` as joined_values' read."""
    if not isinstance(layer, PARALLEL_FORMS):
        for weight, value in zip(layer.weights, values):
            write(weight, value)
        return
    for (axis, variables), value in zip(layer.layout(), values):
        if axis is None:
            write(variables[0], value)
            continue
        ends = np.cumsum([variable.shape[axis] for variable in variables])[:-1]
        for variable, piece in zip(variables, np.split(value, ends, axis)):
            write(variable, piece)


def is_split(model):
    """Whether `model` holds parallel forms of layers (split_layers' result)."""
    return any(isinstance(layer, PARALLEL_FORMS) for layer in model.layers)


def _copy(layer):
    """A new layer like `layer`; a layer (or op) without variables is shared, not copied:
    it has nothing to place, and its config may not rebuild it (a Lambda's function)."""
    if not getattr(layer, "weights", None):
        return layer
    return layer.__class__.from_config(layer.get_config())


def _split_size(layer, how):
    """(how many units the split `how` divides among the parts, what they are)."""
    if how in ("column", "row"):
        equation = DENSE_EQUATION if isinstance(layer, keras.layers.Dense) else layer.equation
        axis = split_axes(equation, None, how).kernel_axis
        return int(layer.kernel.shape[axis]), "output units" if how == "column" else "input units"
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
        if type(layer) not in KINDS[how]:
            kinds = " or ".join(kind.__name__ for kind in KINDS[how])
            raise ValueError(f"plan[{name!r}] = {how!r} splits {kinds} layers, but {name!r} "
                             f"is {type(layer).__name__}.")
        if isinstance(layer, keras.layers.EinsumDense):
            try:
                split_axes(layer.equation, layer.bias_axes, how)
            except ValueError as error:
                raise ValueError(f"plan[{name!r}] = {how!r}: {error}") from None
        if getattr(layer, "lora_enabled", False) or getattr(layer, "quantization_mode", None):
            raise ValueError(f"plan[{name!r}] = {how!r}: layer {name!r} has LoRA or is "
                             "quantized, which split layers do not carry; split the layer "
                             "before enabling LoRA or quantizing, or place it whole.")
        if how == "heads" and layer.get_config().get("use_gate"):
            raise ValueError(f"plan[{name!r}] = 'heads': a gated MultiHeadAttention "
                             "(use_gate=True) is not split yet; place it whole instead.")
        exactness.check_layer(name, layer, how)
        units, what = _split_size(layer, how)
        try:
            part_sizes(units, len(devices))
        except ValueError:
            raise ValueError(f"plan[{name!r}] = {how!r} splits {units} {what} into "
                             f"{len(devices)} parts; give at most {units} devices.") from None
