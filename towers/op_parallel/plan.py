"""split_layers: a model with the layers a plan names replaced by their parallel forms;
join_layers: the model back with the original layer types and the full weights.

A plan is {layer path: how}: "column" or "row" (Dense, EinsumDense; "column:n" / "row:u"
name the equation's letter to split along), "vocab" (Embedding, ReversibleEmbedding), "heads"
(MultiHeadAttention; keras_hub's grouped-query attention by key/value groups, grouped.py),
or an int j (the whole layer on devices[j]). A path is a top-level layer's name, or names
down to a nested layer ("block_0/ffn/dense"), each level a shell wildcard (paths.py).
"""

import keras
import numpy as np
import tensorflow as tf

from towers import compat, devices as devices_lib
from towers.op_parallel import exactness, grouped, grouped_classes, layouts, paths
from towers.op_parallel.dense import ColumnDense, RowDense, equation_of, split_axes, split_kind
from towers.op_parallel.forms import HeadsAttention, Placed, VocabEmbedding
from towers.op_parallel.layers import part_sizes

_DENSE_LAYERS = (keras.layers.Dense, keras.layers.EinsumDense)
# Per kind, the layer types it splits, the most specific first.
KINDS = {"column": _DENSE_LAYERS, "row": _DENSE_LAYERS,
         "vocab": (keras.layers.ReversibleEmbedding, keras.layers.Embedding),
         "heads": (keras.layers.MultiHeadAttention,)}
PARALLEL_FORMS = (ColumnDense, RowDense, VocabEmbedding, HeadsAttention,
                  grouped.GroupedHeadsAttention, Placed)


def split_layers(model, plan, devices, *, model_axis="model"):
    """A new keras.Model computing what `model` computes, each layer named in `plan`
    replaced by its parallel form (its part j's variables on devices[j]); every other
    layer's variables on devices[0]. `model` is left as it was.

    A nested layer's form takes its place inside its parent (paths.py), so the parent's
    own call runs it: any model whose config rebuilds it works, subclassed too.

    Args:
      model: a built keras.Model: functional, Sequential, a Functional subclass or
        subclassed.
      plan: {layer path: "column" | "row" | "vocab" | "heads" | int}, "column" and
        "row" optionally naming an EinsumDense's letter to split along ("row:u"); a path is a
        top-level layer's name or "/"-joined names down to a nested layer, each level
        a shell wildcard ("block_*/ffn/dense_?").
        Or a keras.distribution.LayoutMap: each weight sharded along the mesh axis
        `model_axis` gets the exact split for that axis (layouts.plan_of).
        Or "auto": Megatron's plan for a transformer (auto.auto_plan), logged.
      devices: one tower's T device names, e.g. ["/device:CPU:0", "/device:CPU:1"].

    Raises:
      ValueError: one line naming what is wrong with the model, the plan or the
        devices (one that does not exist included).
    """
    if isinstance(devices, str) or not isinstance(devices, (list, tuple)):
        raise ValueError(f"devices must be a list of device names, one per part, e.g. "
                         f"['/device:CPU:0', '/device:CPU:1'], got {devices!r}.")
    devices = [devices_lib.canonical_name(d) for d in devices]
    if isinstance(plan, str) and plan == "auto":
        from towers.op_parallel import auto  # auto.py builds on this module's checks
        plan = auto.auto_plan(model, len(devices))
    if isinstance(plan, keras.distribution.LayoutMap) and isinstance(model, keras.Model):
        plan = layouts.plan_of(model, plan, len(devices), model_axis)
    _check_arguments(model, plan, devices)
    if paths.reaches_inside(model, plan):
        return _split_by_paths(model, plan, devices)
    _check(model, plan, devices)
    devices_lib.check_devices_exist(devices)
    by_name = {layer.name: layer for layer in model.layers}

    def clone(layer):
        how = plan.get(layer.name)
        return paths.copy_layer(layer) if how is None else parallel_form(layer, how, devices)

    with tf.device(devices[0]):
        parted = keras.models.clone_model(model, clone_function=clone)
    for layer in parted.layers:
        original = by_name.get(layer.name)
        if original is not None and original.weights:
            write_split(layer, original.get_weights())
    return parted


def _split_by_paths(model, plan, devices):
    """split_layers for a plan of paths: a copy of the model, each layer the plan names
    replaced inside its parent, in the copy, by its parallel form."""
    targets = paths.resolve(model, plan)
    originals = [paths.locate(model, target.position)[1] for target in targets]
    for target, layer in zip(targets, originals):
        check_layer(target.key, layer, target.how, devices)
        if isinstance(target.how, int) and not paths.build_shapes_are_one(layer):
            raise ValueError(f"plan[{target.key!r}] = {target.how} places {target.path!r}, "
                             f"a {type(layer).__name__} not built for one input, and a "
                             "placed nested layer takes one; place its parent instead.")
    devices_lib.check_devices_exist(devices)
    with tf.device(devices[0]):
        parted = paths.copy_model(model)
        for target, original in zip(targets, originals):
            _, layer = paths.locate(parted, target.position, like=original)
            form = parallel_form(layer, target.how, devices)
            paths.install(parted, layer, form)
            write_split(form, layer.get_weights())
    return parted


def parallel_form(layer, how, devices):
    """The parallel form of `layer` for `how` (a plan's value), not built."""
    if isinstance(how, int):
        form = Placed(paths.copy_layer(layer), devices, how)
    elif split_kind(how)[0] in ("column", "row"):
        kind, letter = split_kind(how)
        form = (ColumnDense if kind == "column" else RowDense)(
            layer.get_config(), _base_class(layer, kind).__name__, devices,
            _split_size(layer, how)[0], letter=letter,
            activity_regularizer=layer.activity_regularizer)
    elif how == "vocab":
        form = VocabEmbedding(layer.get_config(), devices)
    elif grouped_classes.splits(layer):  # grouped-query attention: by key/value groups
        form = grouped.form_of(layer, devices)
    else:
        config = layer.get_config()
        if config["output_shape"] is None:  # the query's width, which the parts cannot see
            config["output_shape"] = int(layer.output_dense.kernel.shape[-1])
        # A subclass whose call the split keeps (check_layer) runs its own on each part.
        own_call = type(layer).call is not keras.layers.MultiHeadAttention.call
        form = HeadsAttention(config, devices, keras.saving.get_registered_name(
            type(layer) if own_call else keras.layers.MultiHeadAttention))
    form.original_class = type(layer)  # join_layers gives back a user's subclass as it was
    return form


def join_layers(model):
    """`model` with every parallel form replaced by the layer it stands for, with the
    full (joined) weights: to export, serve or compare. Variables on the current device.

    A functional or Sequential model is cloned layer by layer (nested ones too); a
    subclassed one, or a Functional subclass, is rebuilt from its config, which holds
    its original layers. A layer holding a split one is rebuilt from its config too,
    so a split layer held directly by a nested Functional or Sequential whose config
    another layer's config lists cannot be joined (refused in one line).
    """
    if not isinstance(model, keras.Model):
        raise ValueError(f"join_layers takes the keras.Model split_layers returned, got "
                         f"{type(model).__name__}.")

    def clone(layer):
        if isinstance(layer, (ColumnDense, RowDense)):
            cls = getattr(layer, "original_class", getattr(keras.layers, layer.layer_class))
            return cls.from_config(layer.layer_config)
        if isinstance(layer, VocabEmbedding):
            cls = getattr(layer, "original_class", keras.layers.Embedding)
            return cls.from_config(layer.embedding_config)
        if isinstance(layer, grouped.GroupedHeadsAttention):
            return layer.original_class.from_config(layer.attention_config)
        if isinstance(layer, HeadsAttention):
            cls = getattr(layer, "original_class", keras.layers.MultiHeadAttention)
            return cls.from_config(layer.attention_config)
        return paths.copy_layer(layer.layer if isinstance(layer, Placed) else layer)

    try:
        joined = paths.rebuild(model, clone)
    except (TypeError, ValueError) as error:
        raise ValueError(f"join_layers rebuilds model {model.name!r} from its layers' "
                         f"configs, and one lists a split layer ({type(error).__name__}: "
                         f"{paths.first_line(error)}); have that layer build its "
                         "sublayers in its constructor, as keras-io's and keras_hub's "
                         "layers do.") from None
    joined.set_weights(joined_values(model))
    return joined


def joined_values(layer, read=lambda variable: variable.numpy()):
    """The weights (NumPy arrays) of the layer `layer` stands for, in that layer's order:
    a parallel form's parts' joined, nested ones' too; else its own. `read`: a
    variable's value (an optimizer slot's can stand in for it)."""
    return [read(variables[0]) if axis is None else
            np.concatenate([read(v) for v in variables], axis)
            for axis, variables in _layout(layer)]


def write_split(layer, values, write=lambda variable, value: variable.assign(value)):
    """Writes `values`, the weights of the layer `layer` stands for, into it: split into
    the parts of each parallel form in it. `write(variable, value)` as joined_values'
    read."""
    for (axis, variables), value in zip(_layout(layer), values):
        if axis is None:
            write(variables[0], value)
            continue
        ends = np.cumsum([variable.shape[axis] for variable in variables])[:-1]
        for variable, piece in zip(variables, np.split(value, ends, axis)):
            write(variable, piece)


def _layout(layer):
    """Per weight of the layer `layer` stands for, in its order (Keras's: a layer's own
    weights, then each sublayer's, each once): (axis, variables), the variables that
    hold it joined along axis (None: one variable holds it whole)."""
    groups, seen = [], set()

    def visit(layer):
        is_form = isinstance(layer, PARALLEL_FORMS)
        for axis, variables in (layer.layout() if is_form else
                                [(None, [w]) for w in compat.own_weights(layer)]):
            if id(variables[0]) not in seen:
                seen.add(id(variables[0]))
                groups.append((axis, variables))
        if not is_form:
            for sublayer in compat.sublayers(layer):
                visit(sublayer)

    visit(layer)
    return groups


def is_split(model):
    """Whether `model` holds parallel forms of layers (split_layers' result), nested
    ones too."""
    return bool(parallel_forms(model))


def parallel_forms(model):
    """The parallel forms inside `model`, at any depth."""
    return [layer for layer in compat.nested_layers(model)
            if isinstance(layer, PARALLEL_FORMS)]


def _split_size(layer, how):
    """(how many units the split `how` divides among the parts, what they are)."""
    kind, letter = split_kind(how)
    if kind in ("column", "row"):
        axis = split_axes(equation_of(layer)[0], None, kind, letter).kernel_axis
        return int(layer.kernel.shape[axis]), "output units" if kind == "column" else "input units"
    if how == "heads" and grouped_classes.splits(layer):
        return grouped_classes.key_value_heads(layer), "key/value heads"
    if how == "heads":
        return layer.num_heads, "heads"
    return layer.input_dim, "rows"


def _check_arguments(model, plan, devices):
    if not isinstance(model, keras.Model):
        raise ValueError(f"split_layers needs a built keras.Model (functional, Sequential or "
                         f"subclassed), got {type(model).__name__}.")
    if not model.built:
        raise ValueError(f"model {model.name!r} is not built; call it on a batch (or build "
                         "it) before split_layers.")
    if not isinstance(plan, dict) or not plan:
        raise ValueError(f"plan must be a non-empty dict {{layer path: how}}, a "
                         f"keras.distribution.LayoutMap or \"auto\", got {plan!r}.")
    if not devices:
        raise ValueError("devices must name at least one device, one per part.")


def _check(model, plan, devices):
    """Checks a plan of top-level layer names (no paths)."""
    layers = {layer.name: layer for layer in model.layers}
    for name, how in plan.items():
        if name not in layers:
            raise ValueError(f"plan names layer {name!r}, which model {model.name!r} does not "
                             f"have; its layers are {sorted(layers)}.")
        check_layer(name, layers[name], how, devices)


def check_layer(key, layer, how, devices):
    """Refuses, in one line naming plan[key], a value `how` that cannot split or place
    `layer` over `devices`."""
    if isinstance(how, bool) or not isinstance(how, (int, str)):
        raise ValueError(f"plan[{key!r}] must be one of {sorted(KINDS)} or a device "
                         f"index, got {how!r}.")
    if isinstance(how, int):
        if not 0 <= how < len(devices):
            raise ValueError(f"plan[{key!r}] = {how} is not a device index: there are "
                             f"{len(devices)} devices, 0 to {len(devices) - 1}.")
        return
    kind, letter = split_kind(how)  # "row:u": a row split along the equation's letter u
    if kind not in KINDS:
        raise ValueError(f"plan[{key!r}] = {how!r} is not a kind; use one of "
                         f"{sorted(KINDS)} (column and row may name the letter to split along, "
                         "'row:u'), or a device index.")
    if kind == "heads" and not isinstance(layer, keras.layers.MultiHeadAttention) and (
            grouped_classes.splits(layer) or "attention" in type(layer).__name__.lower()):
        _check_grouped(key, layer, devices)
        return
    base = _base_class(layer, kind)
    if base is None:
        kinds = " or ".join(cls.__name__ for cls in KINDS[kind]  # not ReversibleEmbedding
                            if not any(cls is not k and issubclass(cls, k) for k in KINDS[kind]))
        raise ValueError(f"plan[{key!r}] = {how!r} splits {kinds} layers, but {layer.name!r} "
                         f"is {type(layer).__name__}.")
    changed = [method for method in ("call", "build")
               if getattr(type(layer), method) is not getattr(base, method)]
    if changed and not (kind == "heads" and exactness.keeps_call(type(layer), base)):
        raise ValueError(f"plan[{key!r}] = {how!r}: {layer.name!r} is a {type(layer).__name__}, "
                         f"a {base.__name__} subclass with its own {' and '.join(changed)}, "
                         f"which the parallel form (running {base.__name__}'s) would drop; "
                         "place it whole (a device index) instead.")
    if kind in ("column", "row"):  # a Dense is "...i,io->...o": "column:o", "row:i" only
        try:
            split_axes(*equation_of(layer), kind, letter)
        except ValueError as error:
            raise ValueError(f"plan[{key!r}] = {how!r}: {error}") from None
    if getattr(layer, "lora_enabled", False) or getattr(layer, "quantization_mode", None):
        raise ValueError(f"plan[{key!r}] = {how!r}: layer {layer.name!r} has LoRA or is "
                         "quantized, which split layers do not carry; split the layer "
                         "before enabling LoRA or quantizing, or place it whole.")
    if how == "heads" and layer.get_config().get("use_gate"):
        raise ValueError(f"plan[{key!r}] = 'heads': a gated MultiHeadAttention "
                         "(use_gate=True) is not split yet; place it whole instead.")
    exactness.check_weights_split_exactly(key, layer, how)
    units, what = _split_size(layer, how)
    try:
        part_sizes(units, len(devices))
    except ValueError:
        raise ValueError(f"plan[{key!r}] = {how!r} splits {units} {what} into "
                         f"{len(devices)} parts; give at most {units} devices.") from None


def _check_grouped(key, layer, devices):
    """check_layer for "heads" on an attention class that is not a MultiHeadAttention:
    keras_hub's grouped-query attention (grouped.py), split by key/value groups, or
    refused with the reason grouped_classes.py gives."""
    refused = grouped_classes.refusal(layer, len(devices))
    if refused is not None:
        raise ValueError(f"plan[{key!r}] = 'heads': {refused}.")
    if any(getattr(sub, "lora_enabled", False) or getattr(sub, "quantization_mode", None)
           for sub in [layer, *compat.nested_layers(layer)]):
        raise ValueError(f"plan[{key!r}] = 'heads': layer {layer.name!r} has LoRA or is "
                         "quantized, which split layers do not carry; split the layer "
                         "before enabling LoRA or quantizing, or place it whole.")
    exactness.check_weights_split_exactly(key, layer, "heads")


def _base_class(layer, how):
    """The layer type of KINDS[how] `layer` is (a subclass of), or None."""
    return next((kind for kind in KINDS[how] if isinstance(layer, kind)), None)
