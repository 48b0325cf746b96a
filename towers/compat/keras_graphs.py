"""Private Keras names about functional models' graphs of layers, each beside the public
alternative it stands in for (towers/compat/__init__.py says why they live here)."""

import keras
from keras.src.models import functional

# ---------------------------------------------------------------------------------------
# Keras: the graph of layers a functional model runs


def functional_graph(model):
    """The keras.Model whose graph of layers `model` runs: a built Sequential's inner
    Functional, else `model` itself (None for a subclassed model, which has none).

    Public alternative: none; `keras.Model(model.inputs, model.outputs)` builds a
    new graph on the same layers, adding call nodes to each.
    """
    if isinstance(model, keras.Sequential):
        model = model._functional
    return model if hasattr(model, "_nodes_by_depth") else None


def nodes_by_depth(graph):
    """{depth: [keras Node]} of a functional graph (functional_graph's), the walk
    Functional itself runs (deepest first).

    Public alternative: none.
    """
    return graph._nodes_by_depth


def runs_its_graph(model):
    """Whether `model` is a functional model whose call runs its graph, node by node
    (a Functional or a subclass that keeps Functional's call: a keras_hub backbone or
    task model), so its layers' calls can stand in its place in an enclosing graph.

    Public alternative: none; `type(model).__name__ == "Functional"` leaves out
    keras_hub's subclasses, which run their graphs too.
    """
    return (isinstance(model, functional.Functional)
            and type(model).call is functional.Functional.call)


def run_graph(model, inputs, operation_fn):
    """`model`'s graph run on `inputs` (as its call takes them: a structure of tensors),
    each node computed by operation_fn(node.operation)(*args, **kwargs); returns the
    outputs in `model.output`'s structure. Functional.call's walk (its inputs
    standardized as its call does), with `operation_fn` in place of its own (which
    calls each operation, passing `training` on).

    Public alternative: `model.call(inputs)`, which calls each of its operations
    itself, so a nested functional model on symbolic tensors stays one call.
    """
    return model._run_through_graph(model._standardize_inputs(inputs),
                                    operation_fn=operation_fn)


def model_between(inputs, outputs, name):
    """keras.Model(inputs, outputs, name=name) for `inputs` that may be intermediate
    tensors of a functional graph (a pipeline stage after the first).

    Keras makes each intermediate input a new Input and maps every call of the layer that
    produced it to that Input (functional.clone_graph_nodes keys the map by layer, not by
    call), so a layer called again after the cut that its output crosses (ALBERT's shared
    transformer layer, called in two stages) would drop out of the stage. There the graph
    between them is called anew on new Inputs: the same layers (no copies), each call
    node called again, in the order Keras walks them.

    Public alternative: keras.Model(inputs, outputs), once Keras keys that map by call.
    """
    flat = keras.tree.flatten(inputs)
    given = {id(t) for t in flat}
    nodes = [node for node in functional.find_nodes_by_inputs_and_outputs(inputs, outputs)
             if not node.is_input and not any(id(t) in given for t in node.outputs)]
    made = {id(t._keras_history.operation) for t in flat
            if not functional.is_input_keras_tensor(t)}
    if not any(id(node.operation) in made for node in nodes):
        return keras.Model(inputs, outputs, name=name)
    tensors = {id(t): keras.Input(batch_shape=t.shape, dtype=t.dtype, sparse=t.sparse,
                                  name=f"{name}_input_{i}") for i, t in enumerate(flat)}
    for node in nodes:  # Keras's order: each after the calls it reads
        args, kwargs = node.arguments.fill_in(tensors)
        called = keras.tree.flatten(node.operation(*args, **kwargs))
        tensors.update((id(before), after) for before, after in zip(node.outputs, called))
    return keras.Model(keras.tree.pack_sequence_as(inputs, [tensors[id(t)] for t in flat]),
                       keras.tree.map_structure(lambda t: tensors[id(t)], outputs), name=name)
