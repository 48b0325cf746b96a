"""Cuts by layer path: a pipeline cut names a layer of the model by its name, or by its
path into a nested functional model ("bert_backbone*/transformer_layer_0"), each level
a shell wildcard, as plans name the layers they split (towers/layer_paths.py).

A keras_hub task model runs its backbone, itself a functional model, as one layer
call. To cut inside it, the functional models that hold a cut layer are flattened:
the model's graph is run once more on its own inputs, each such model's layers called
in its place (compat.run_graph), which gives one functional graph of the same layers
(so the same weights, no copies). split_model cuts that graph as it cuts any.
"""

import keras

from towers import compat, layer_paths


def graph_to_cut(model, graph, cuts):
    """(the functional graph to cut, the layer each cut names): `graph` (model's own,
    compat.functional_graph's) with the functional models that hold a cut layer
    flattened into it, or `graph` itself where every cut names a top-level layer.

    Raises:
      ValueError: one line for a cut that is not a string, names an input, matches no
        layer or several, or lies inside a layer that is not a functional model.
    """
    walked = layer_paths.walk(model, repeats=True)  # a layer held twice: either path
    layers, inside = [], {}  # inside: id -> each functional model holding a cut layer
    for cut in cuts:
        if isinstance(cut, str) and layer_paths.is_pattern(cut):
            layer, chain = _layer_at(model, walked, cut)
            inside.update((id(holder), holder) for holder in chain[1:-1])
        else:
            layer = _top_level_layer(model, walked, cut)
        layers.append(layer)
    return (flatten(graph, inside) if inside else graph), layers


def _top_level_layer(model, walked, cut):
    inputs = [layer.name for layer in model.layers if isinstance(layer, keras.layers.InputLayer)]
    if cut in inputs:
        raise ValueError(
            f"pipeline cut {cut!r} is an input of model {model.name!r}, which computes "
            "nothing; cut after a layer that does.")
    named = [layer for layer in model.layers if layer.name == cut]
    if not isinstance(cut, str) or not named:
        nested = [path for path, _, _ in walked if path.endswith(f"/{cut}")]
        hint = f"; a nested layer is cut by its path, as {nested[0]!r}" if nested else ""
        raise ValueError(
            f"pipeline cut {cut!r} is not the name of a layer of model {model.name!r}; "
            f"its layers are {[layer.name for layer in model.layers]}{hint}.")
    return named[0]


def _layer_at(model, walked, cut):
    """(the one layer `cut` names, the layers from the model down to it)."""
    first = {}  # id(layer) -> (its first path, its first position)
    for path, layer, position in walked:
        first.setdefault(id(layer), (path, position))
    found = {id(layer): first[id(layer)] for path, layer, _ in walked
             if layer_paths.matches(path, cut)}
    if not found:
        raise ValueError(
            f"pipeline cut {cut!r} matches no layer of model {model.name!r}; its layer "
            f"paths at that depth are {layer_paths.paths_at_depth(walked, cut)}.")
    if len(found) > 1:
        raise ValueError(
            f"pipeline cut {cut!r} matches {len(found)} layers of model {model.name!r} "
            f"({sorted(path for path, _ in found.values())[:6]}); name one.")
    path, position = next(iter(found.values()))
    chain = layer_paths.holders(model, position)
    for depth, holder in enumerate(chain[1:-1], start=1):
        if not compat.runs_its_graph(holder):
            where = "/".join(path.split("/")[:depth])
            raise ValueError(
                f"pipeline cut {cut!r} lies inside {where!r}, a {type(holder).__name__} "
                "whose call() is not a functional graph of layers, so it cannot be cut "
                f"inside; cut after {where!r} or after a layer of a functional model.")
    return chain[-1], chain


def flatten(graph, inside):
    """A functional model computing what `graph` computes, from its inputs, with each
    functional model in `inside` ({id: model}) replaced by calls of its own layers (the
    same layer objects: they gain call nodes, as stage models give them).

    A nested model's call on symbolic tensors gets no `training` (None while a graph
    is built) and its inputs' masks travel on the tensors, so its layers, called on
    them, see what the model's call would give them.
    """
    def operation_fn(operation):
        if id(operation) not in inside:
            return operation

        def call(inputs, *args, **kwargs):
            del args, kwargs  # training and mask: see above
            return compat.run_graph(operation, inputs, operation_fn)
        return call

    outputs = compat.run_graph(graph, graph.input, operation_fn)
    return keras.Model(graph.input, outputs, name=graph.name)


def layer_calls(model, prefix=""):
    """[(path, layer, outputs of each of its calls)] of `model`'s layers in its layers'
    order, inputs left out; a nested functional model called once (a keras_hub task
    model's backbone) gives its own layers' calls in its place, at their paths
    ("gpt2_backbone/transformer_layer_0"), which split_model takes as cuts.

    `model`: a functional or built Sequential model (stages.graph_of's check); a nested
    model that is neither is one layer.
    """
    graph = compat.functional_graph(model)
    outputs = {}  # id(layer) -> [the outputs of each of its calls in `graph`]
    for nodes in compat.nodes_by_depth(graph).values():
        for node in nodes:
            outputs.setdefault(id(node.operation), []).append(node.outputs)
    calls = []
    for layer in graph.layers:
        if isinstance(layer, keras.layers.InputLayer):
            continue
        path = f"{prefix}{layer.name}"
        if compat.runs_its_graph(layer) and len(outputs.get(id(layer), ())) == 1:
            calls += layer_calls(layer, f"{path}/")
        else:
            calls.append((path, layer, outputs.get(id(layer), [])))
    return calls
