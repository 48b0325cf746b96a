"""Model parallelism: a Keras model cut into pipeline stages, each on its own device.

`split_model` cuts a functional or Sequential model after named layers (or layers
named by path inside nested functional models: cut_paths.py) into stage models that
share the original layers and weights. `Stages` adds what
the tower step needs to run them: which of the model's variables each stage
owns, and which tensors cross each cut (skip connections are carried along to
the stage that uses them). placement/variables.py moves each stage's variables
to its stage device, as torchgpipe moves each partition to its device.
"""

import collections

import keras
import tensorflow as tf

from towers import compat, gradients
from towers.model_parallel import cut_paths


def split_model(model, cuts):
    """Cuts `model` after each layer `cuts` names; returns len(cuts) + 1 stage models.

    Chaining the stages computes the model: stage 0 takes the model's inputs,
    each later stage takes the list the stage before it returns, and the last
    stage returns the model's outputs. Stage k returns every tensor that a
    stage after it needs (its own activations, and skip connections or inputs
    passed through to the stage that uses them). Layers are taken in the
    order of `model.layers` (model.summary's order): a cut after layer L puts
    L and every layer listed before it in the earlier stages.

    A cut is a top-level layer's name, or a layer path with shell wildcards
    ("bert_backbone*/transformer_layer_0"), as plans name layers: a keras_hub task
    model is cut inside its backbone. The functional models that hold a cut layer
    are then flattened into one graph of the same layers (cut_paths.py) and cut as
    one; the layers' order is that graph's.

    A layer called in several stages (a tied embedding and LM head, ALBERT's
    shared block) is in each of their models; Stages gives its weights to the
    first, and the later ones read them.

    The stages share the model's layers, so they share its weights. (Like any
    keras.Model built on intermediate tensors, they add call nodes to those
    layers, so a layer's `.output` afterwards names several calls.)

    Args:
      model: a functional or Sequential keras.Model, built.
      cuts: names or paths of layers of `model`, in the order they run, each once.

    Returns:
      list of keras.Model, one per stage.

    Raises:
      ValueError: `model` not a keras.Model, `cuts` not a list of names, a
        subclassed model, an unknown or repeated cut, a path that matches several
        layers or reaches inside a layer that is not a functional model, a cut
        after an input, cuts out of order, a cut that leaves a stage empty, or a
        layer with state (non-trainable variables) or a weight regularizer called
        in two stages.
    """
    if not isinstance(model, keras.Model):
        raise ValueError(f"model must be a functional or Sequential keras.Model, got "
                         f"{type(model).__name__}.")
    if isinstance(cuts, str) or not isinstance(cuts, (list, tuple)):
        raise ValueError(f"cuts must be a list of layer names, got {cuts!r}.")
    graph, cut_layers = cut_paths.graph_to_cut(model, graph_of(model), list(cuts))
    nodes = _nodes_in_order(graph)
    stage_of_node = _assign_stages(graph, nodes, list(cuts), cut_layers)
    num_stages = len(cuts) + 1
    produced_in = {id(t): -1 for t in graph.inputs}  # tensor id -> stage (-1: an input)
    tensors = {id(t): t for t in graph.inputs}
    last_use = {}  # tensor id -> the last stage that reads it
    for node, stage in zip(nodes, stage_of_node):
        for tensor in node.input_tensors:
            last_use[id(tensor)] = max(last_use.get(id(tensor), -1), stage)
        for tensor in node.output_tensors:
            produced_in[id(tensor)], tensors[id(tensor)] = stage, tensor
    for tensor in graph.outputs:
        last_use[id(tensor)] = num_stages  # the loss reads them after the last stage
    # crossing[k]: the tensors that cross cut k, in the order they are computed.
    crossing = [[tensors[key] for key, where in produced_in.items()
                 if where <= k < last_use.get(key, -1)] for k in range(num_stages - 1)]
    stages, inputs = [], graph.input
    for k in range(num_stages):
        def handed_on(tensor, k=k):
            # A tensor from an earlier stage passes through this one unchanged.
            if produced_in[id(tensor)] == k:
                return tensor
            return keras.layers.Identity(name=f"{model.name}_stage_{k}_pass_{tensor.name}")(tensor)

        outputs = (keras.tree.map_structure(handed_on, graph.output) if k == num_stages - 1
                   else [handed_on(t) for t in crossing[k]])
        stages.append(compat.model_between(inputs, outputs, name=f"{model.name}_stage_{k}"))
        inputs = crossing[k] if k < num_stages - 1 else None
    return stages


class VariableGroups:
    """A model's variables in groups (pipeline stages, or split layers' part columns),
    each group's gradients summed and applied on its own device.

    Attributes:
      model: the whole keras.Model.
      trainable_index: per group, the positions in model.trainable_variables of
        its trainable variables.
      state_index: the same for model.non_trainable_variables.
    Both are of the model's trainable set when `reindex` last ran.
    """

    def __init__(self, model):
        self.model = model
        self.reindex()

    def reindex(self):
        """Recomputes the positions for the model's trainable set now: freezing or
        unfreezing a layer moves its variables between the two lists."""
        self.trainable_index = self._positions(self.model.trainable_variables, True)
        self.state_index = self._positions(self.model.non_trainable_variables, False)

    def _positions(self, variables, trainable):
        """Per group, the positions in `variables` (the model's trainable variables, or
        its others) of the group's."""
        raise NotImplementedError

    def select(self, values, group, trainable=True):
        """The entries of `values` (one per model variable) that belong to `group`."""
        index = self.trainable_index if trainable else self.state_index
        return [values[i] for i in index[group]]

    def merge(self, per_group, trainable=True):
        """Inverse of `select`: per-group lists back into one list in model order."""
        index = self.trainable_index if trainable else self.state_index
        merged = [None] * sum(len(positions) for positions in index)
        for positions, values in zip(index, per_group):
            for i, value in zip(positions, values):
                merged[i] = value
        return merged


class Stages(VariableGroups):
    """A model cut into pipeline stages, with the bookkeeping the tower step needs.

    With cuts=None there is one stage, the model itself. The groups are the
    stages: trainable_index[k] and state_index[k] are the variables stage k owns,
    in the order of the stage model's own lists. A layer called in several stages
    (a tied embedding and LM head) has its variables owned by the first: they live
    on its device, and their gradients meet there.

    Attributes:
      models: one keras.Model per stage (split_model's).
      read_index, read_state_index: per stage, the positions of every variable its
        model reads (its own and those an earlier stage owns), in its model's order.
    """

    def __init__(self, model, cuts=None):
        self.models = split_model(model, cuts) if cuts else [model]
        super().__init__(model)

    def reindex(self):
        self.read_index = self._reads(self.model.trainable_variables, True)
        self.read_state_index = self._reads(self.model.non_trainable_variables, False)
        self._check_shared_reads()
        super().reindex()

    def _check_shared_reads(self):
        """Refuses, in one line, a variable that several stages read and that holds state
        or has a regularizer: reached through a sublayer that layers of two stages share
        (split_model refuses a layer called in two stages with such weights itself)."""
        for variables, index in ((self.model.non_trainable_variables, self.read_state_index),
                                 (self.model.trainable_variables, self.read_index)):
            readers = collections.Counter(i for reads in index for i in set(reads))
            for i, count in readers.items():
                variable = variables[i]
                if count > 1 and (index is self.read_state_index
                                  or variable.regularizer is not None):
                    what = ("holds state that each stage's call would update"
                            if index is self.read_state_index else "has a regularizer, "
                            "which each stage's model would add to the loss")
                    raise ValueError(
                        f"variable {variable.path!r} is read by {count} stages of model "
                        f"{self.model.name!r} (a layer their layers share) and {what}; cut "
                        "so that the layers sharing it run in one stage.")

    def _reads(self, variables, trainable):
        where = {id(v): i for i, v in enumerate(variables)}
        index = [[where.get(id(v), -1) for v in (
            m.trainable_variables if trainable else m.non_trainable_variables)]
            for m in self.models]
        if sorted({i for stage in index for i in stage}) != list(range(len(variables))):
            raise ValueError(
                f"model {self.model.name!r} has variables that belong to no stage (a layer "
                "outside the model's graph); cut so that every layer runs in a stage.")
        return index

    def _positions(self, variables, trainable):
        owned, seen = [], set()  # each variable with the first stage that reads it
        for reads in (self.read_index if trainable else self.read_state_index):
            owned.append([i for i in reads if i not in seen])
            seen.update(reads)
        return owned

    def select(self, values, group, trainable=True):
        """The entries of `values` (one per model variable) that stage `group`'s model
        reads, in its order: those it owns and those an earlier stage owns."""
        index = self.read_index if trainable else self.read_state_index
        return [values[i] for i in index[group]]

    def merge(self, per_group, trainable=True, devices=None):
        """Inverse of `select`: per-stage lists back into one list in model order. A
        variable several stages read gets their gradients' sum (trainable), or the first
        value given (state; None where none is), summed on devices[its owner] where
        `devices` (one per stage) is given: where its weights live."""
        reads = self.read_index if trainable else self.read_state_index
        owner = {i: k for k, owned in enumerate(
            self.trainable_index if trainable else self.state_index) for i in owned}
        given = collections.defaultdict(list)
        for positions, values in zip(reads, per_group):
            for i, value in zip(positions, values):
                given[i].append(value)
        merged = [None] * len(owner)
        for i, values in given.items():
            if len(values) == 1:
                merged[i] = values[0]
            elif not trainable:
                merged[i] = next((v for v in values if v is not None), None)
            else:
                with tf.device(devices[owner[i]] if devices else None):
                    merged[i] = gradients.add(values)
        return merged

    @property
    def num_stages(self):
        return len(self.models)

    def variables(self, stage):
        """Every variable (trainable and not) `stage` owns: its model's, less those an
        earlier stage's model reads too."""
        earlier = {id(v) for model in self.models[:stage] for v in model.variables}
        return [v for v in self.models[stage].variables if id(v) not in earlier]


def _unshareable(layer):
    """Why `layer`, called in two stages, cannot keep its weights with the first: state
    (each call would update it on another device), or a weight regularizer (each
    stage's model would add it to the loss); None where it can."""
    state = getattr(layer, "non_trainable_variables", None)
    if state:
        return f"holds state ({state[0].path!r}) that its calls update"
    regularized = [v for v in getattr(layer, "trainable_variables", [])
                   if v.regularizer is not None]
    if regularized:
        return (f"has a regularizer on {regularized[0].path!r}, which each stage's model "
                "would add to the loss")
    return None


def check_pipeline(pipeline_cuts, main_device, variable_placement):
    """pipeline_cuts as a list of layer names or paths, or None for no pipeline (None or an
    empty list: one stage), after refusing, up front, what pipeline stages cannot
    be combined with."""
    if pipeline_cuts is None:
        return None
    if isinstance(pipeline_cuts, str) or not isinstance(pipeline_cuts, (list, tuple)):
        raise ValueError(f"pipeline_cuts must be a list of layer names (or layer paths), got "
                         f"{pipeline_cuts!r}.")
    if not pipeline_cuts:
        return None
    refused = {
        "main_device": (main_device is not None,
                        "stage k's variables live on devices[0][k]; leave main_device=None"),
        "variable_placement='replicated'": (
            variable_placement == "replicated",
            "each stage's towers read its variables from devices[0][k]; use 'main'"),
    }
    for name, (given, why) in refused.items():
        if given:
            raise ValueError(f"{name} cannot be combined with pipeline_cuts: {why}.")
    return list(pipeline_cuts)


def graph_of(model):
    """The Functional graph behind `model`, or a ValueError saying why there is none."""
    if isinstance(model, keras.Sequential):
        if not model.built:
            raise ValueError(
                f"model {model.name!r} is a Sequential model that is not built; give it a "
                "keras.Input first, or call it once on a batch, before cutting it.")
    graph = compat.functional_graph(model)
    if graph is None:
        raise ValueError(
            f"model {model.name!r} is a subclassed keras.Model: its call() is Python code, "
            "so there is no graph of layers to cut. Rebuild it as a functional model "
            "(keras.Model(inputs, outputs)) or a Sequential, or cut it by hand into one "
            "model per stage.")
    return graph


def _nodes_in_order(graph):
    """The graph's layer calls (Keras nodes) in execution order, inputs excluded.

    Keras 3 has no public walk of a functional graph; its nodes by depth are
    the walk Functional itself runs (deepest first), ordered within a depth by
    the graph's layers.
    """
    position = {id(layer): i for i, layer in enumerate(graph.layers)}
    nodes, by_depth = [], compat.nodes_by_depth(graph)
    for depth in sorted(by_depth, reverse=True):
        nodes += sorted((n for n in by_depth[depth] if not n.is_input),
                        key=lambda n: position.get(id(n.operation), -1))
    return nodes


def _assign_stages(graph, nodes, cuts, cut_layers):
    """The stage of each node: the number of cut layers run before it."""
    position = {id(layer): i for i, layer in enumerate(graph.layers)}
    for cut, layer in zip(cuts, cut_layers):
        if id(layer) not in position:
            raise ValueError(f"pipeline cut {cut!r} names layer {layer.name!r}, which model "
                             f"{graph.name!r} never calls; cut after a layer it calls.")
    if len({id(layer) for layer in cut_layers}) != len(cuts):
        raise ValueError(f"pipeline cuts {cuts} name a layer twice; cut after each layer once.")
    order = sorted(range(len(cuts)), key=lambda i: position[id(cut_layers[i])])
    if order != list(range(len(cuts))):
        raise ValueError(
            f"pipeline cuts {cuts} are not in the order of the model's layers; list them "
            f"as model.layers does: {[cuts[i] for i in order]}.")
    cut_index = {id(layer): i for i, layer in enumerate(cut_layers)}
    stage, stages, stage_of_layer = 0, [], {}
    for node in nodes:
        layer = node.operation
        first = stage_of_layer.setdefault(id(layer), stage)
        why = _unshareable(layer) if first != stage else None
        if why:
            raise ValueError(
                f"layer {layer.name!r} is called in stages {first} and {stage} and {why}; a "
                "layer called in several stages may hold unregularized trainable weights "
                f"only (they live with stage {first}; the later stages read them). Cut "
                "before its first call or after its last.")
        stages.append(stage)
        if cut_index.get(id(layer)) == stage:
            stage += 1
    counts = collections.Counter(stages)
    empty = [k for k in range(len(cuts) + 1) if not counts[k]]
    if empty:
        raise ValueError(
            f"pipeline cuts {cuts} leave stage {empty[0]} of model {graph.name!r} without "
            "layers; every stage needs at least one layer (the first cut must come after "
            "a layer, the last before the model's final layer).")
    return stages
