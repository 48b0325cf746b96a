"""Plans by layer path: plan keys resolved to the layers they name, nested ones too, and
a layer replaced inside its parent, on a copy of the model.

A plan key is a layer path whose levels may be shell wildcards ("block_*/ffn/*"),
matched level by level as towers/layer_paths.py matches every pattern.

A replaced layer's parent keeps running its own `call`: the parallel form takes the
layer's place in the parent's attributes, in its tracked sublayers (so its weights
take the layer's place in `parent.weights`, and the layer's leave) and, for a
Functional or Sequential parent, in its graph's nodes (compat.replace_sublayer).
"""

import collections
import contextlib

import keras

from towers import compat, layer_paths

Target = collections.namedtuple("Target", ["key", "path", "how", "position"])
Target.__doc__ = """A layer a plan names: the plan key that names it, its path, the key's
value, and its position (the index of each level's layer among its parent's sublayers,
compat.sublayers: the same in a copy of the model, whose layers' names may differ)."""


def is_graph_model(model):
    """Whether `model` is a plain functional or Sequential keras.Model (not a subclass):
    one keras.models.clone_model rebuilds layer by layer."""
    return isinstance(model, keras.Sequential) or type(model).__name__ == "Functional"


def reaches_inside(model, plan):
    """Whether `plan` needs paths: a key with "/" or a wildcard, or a model that is not a
    plain functional or Sequential one (whose top-level layers clone_model replaces)."""
    return not is_graph_model(model) or any(
        layer_paths.is_pattern(key) for key in plan if isinstance(key, str))


def resolve(model, plan):
    """The Targets `plan` names in `model`, one per layer, in `layer_paths.walk`'s order.

    Raises:
      ValueError: one line for a key that is not a string or matches no layer, for a
        layer two keys give different values, or for a layer inside another one the
        plan names.
    """
    layers = layer_paths.walk(model, repeats=True)  # a layer held twice is named by either path
    first = {}  # id(layer) -> (its first path, its first position)
    for path, layer, position in layers:
        first.setdefault(id(layer), (path, position))
    named = {}  # position -> Target
    for key, how in plan.items():
        if not isinstance(key, str) or not key or key.startswith("/") or key.endswith("/"):
            raise ValueError(f"plan keys must be layer paths such as 'block_0/ffn/dense' "
                             f"(levels '/'-separated, shell wildcards allowed), got {key!r}.")
        matches = [first[id(layer)] for path, layer, _ in layers
                   if layer_paths.matches(path, key)]
        if not matches:
            raise ValueError(f"plan key {key!r} matches no layer of model {model.name!r}; its "
                             f"layer paths at that depth are "
                             f"{layer_paths.paths_at_depth(layers, key)}.")
        for path, position in matches:
            other = named.get(position)
            if other is not None and other.how != how:
                raise ValueError(f"plan keys {other.key!r} and {key!r} both name layer {path!r}, "
                                 f"as {other.how!r} and {how!r}; give it one.")
            named.setdefault(position, Target(key, path, how, position))
    targets = sorted(named.values(), key=lambda target: target.position)
    for outer in targets:
        for inner in targets:
            if inner is not outer and inner.position[:len(outer.position)] == outer.position:
                raise ValueError(f"plan key {inner.key!r} names {inner.path!r}, inside "
                                 f"{outer.path!r}, which plan key {outer.key!r} already "
                                 f"replaces as a whole; give one of them.")
    return targets


def locate(model, position, like=None):
    """(parent, layer) at `position` (a Target's) in `model`.

    Raises:
      ValueError: one line where the layer there is not of `like`'s type (the layer at
        that position in the model `model` was copied from).
    """
    parent, layer = None, model
    for index in position:
        sublayers = compat.sublayers(layer)
        parent, layer = layer, sublayers[index] if index < len(sublayers) else None
    if like is not None and type(layer) is not type(like):
        raise ValueError(f"the copy of model {model.name!r} rebuilt from its config holds "
                         f"{type(layer).__name__} where the model holds {like.name!r} "
                         f"({type(like).__name__}); give {type(model).__name__} a "
                         "get_config() that rebuilds it as it is.")
    return parent, layer


def copy_model(model):
    """A new model computing what `model` computes, with its own variables (on the
    current device) holding `model`'s values; `model` is left as it was (rebuild's copy;
    a layer without variables is shared).

    Raises:
      ValueError: one line where the model's config does not rebuild it.
    """
    try:
        copy = rebuild(model, copy_layer)
    except (TypeError, ValueError, NotImplementedError) as error:
        raise ValueError(
            f"split_layers works on a copy of model {model.name!r} rebuilt from its "
            f"config, and that failed ({type(error).__name__}: {first_line(error)}); give "
            f"{type(model).__name__} a get_config() holding its constructor's arguments."
        ) from None
    if [w.shape for w in copy.weights] != [w.shape for w in model.weights]:
        raise ValueError(
            f"a copy of model {model.name!r} rebuilt from its config does not hold its "
            f"weights: {_first_difference(model.weights, copy.weights)}; give "
            f"{type(model).__name__} a get_config() that rebuilds it as it is (a layer "
            "shared by two others, a tied table, must be one layer in the copy too).")
    copy.set_weights(model.get_weights())
    return copy


def _first_difference(weights, copied):
    """Where `copied` first differs from `weights` in shape, in a few words."""
    counts = f"{len(copied)} weights where the model has {len(weights)}"
    for index, (weight, copy) in enumerate(zip(weights, copied)):
        if weight.shape != copy.shape:
            return (f"{counts}; its weight {index} is {copy.path!r} {tuple(copy.shape)}, the "
                    f"model's {weight.path!r} {tuple(weight.shape)}")
    extra = (copied if len(copied) > len(weights) else weights)[min(len(weights), len(copied))]
    return f"{counts}, the first one past the shorter list {extra.path!r}"


def copy_layer(layer):
    """A new layer like `layer`; a layer (or op) without variables is shared, not copied:
    it has nothing to place, and its config may not rebuild it (a Lambda's function)."""
    if not getattr(layer, "weights", None):
        return layer
    return layer.__class__.from_config(layer.get_config())


def rebuild(model, clone_function):
    """A new built model like `model`, with new variables: a plain functional or
    Sequential model by keras.models.clone_model, `clone_function` giving each layer's
    replacement, nested plain functional and Sequential models cloned the same way (a
    layer they share cloned once); any other model (subclassed, a Functional subclass
    such as a keras_hub backbone), at the top or nested, from its get_config(), as
    Keras's saving rebuilds it, its layers those its constructor makes."""
    clones = {}  # id(layer) -> its clone, across nesting levels

    def clone(layer):
        if id(layer) not in clones:
            clones[id(layer)] = (keras.models.clone_model(layer, clone_function=clone)
                                 if is_graph_model(layer) else clone_function(layer))
        return clones[id(layer)]

    if is_graph_model(model):
        return keras.models.clone_model(model, clone_function=clone)
    copy = type(model).from_config(model.get_config())
    if not copy.weights:
        copy.build_from_config(model.get_build_config())
    return copy


def first_line(error):
    """The first line of `error`'s message (a one-line error quotes no more)."""
    return (str(error).strip().splitlines() or [""])[0]


def install(model, layer, form):
    """Builds `form` for the shapes `layer` was built for, its variables' paths under
    `layer`'s parent's (as `layer`'s), and puts it in `layer`'s place in every layer of
    `model` that holds it (a backbone's token embedding and the task model calling it
    again as its LM head: the one form serves both)."""
    with contextlib.ExitStack() as scopes:
        for name in (layer.path or "").split("/")[:-1]:  # Keras takes one level at a time
            scopes.enter_context(keras.name_scope(name))
        form.build_from_config(layer.get_build_config())
    holders = [model] + [held for _, held, _ in layer_paths.walk(model)]
    for parent in holders:
        if any(sublayer is layer for sublayer in compat.sublayers(parent)):
            compat.replace_sublayer(parent, layer, form)


def build_shapes_are_one(layer):
    """Whether `layer` was built for one input shape (what Placed builds from; a layer
    without variables may not have been built at all)."""
    return "input_shape" in (layer.get_build_config() or {})
