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
