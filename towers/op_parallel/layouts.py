"""A keras.distribution.LayoutMap read as a plan: each weight's layout along the mesh's
model axis becomes the exact split of its layer.

Keras's LayoutMap says, per variable path (regex keys, full match, as Keras matches
them), which mesh axis each dimension is sharded along. A weight sharded along the
model axis maps to the form that splits it there:
- a Dense or EinsumDense kernel along an output-only axis: "column"; along a
  contracted input axis: "row"; each naming the equation's letter where it is not the
  last such letter, the one plain "column"/"row" split (Llama's attention_output
  "bquh,uhm->bqm" sharded on dim 0: "row:u"; dense.kind_of_kernel_axis);
- an Embedding table along its rows (a ReversibleEmbedding's reverse table along its
  columns): "vocab";
- a MultiHeadAttention's query/key/value kernels along their heads axis (and its
  output kernel along its heads axis): "heads".
A weight sharded along another axis of the mesh (the data axis) stays whole: towers
already splits the batch. A layout with no exact form (a bias or a norm's scale
sharded alone, a kernel along an axis neither output-only nor contracted) is refused
in one line.
"""

import keras
from absl import logging

from towers import layer_paths
from towers.op_parallel.dense import equation_of, kind_of_kernel_axis, split_axes, split_kind


def plan_of(model, layout_map, num_parts, model_axis="model", *, say_other_axes=True):
    """{layer path: kind}, split_layers' plan, of `layout_map` for `model`.

    Args:
      model: the keras.Model split_layers splits.
      layout_map: a keras.distribution.LayoutMap.
      num_parts: the number of devices split_layers was given.
      model_axis: the mesh axis whose devices are the parts.
      say_other_axes: log that weights sharded along other axes stay whole (not where
        plan="auto" reads a backbone's map, whose data axis it chose itself).

    Raises:
      ValueError: one line: a mesh without `model_axis`, or of another size along it
        than num_parts; a layout with no exact split; a map that splits nothing.
    """
    mesh = layout_map.device_mesh
    if model_axis not in mesh.axis_names:
        raise ValueError(f"the layout map's mesh has axes {list(mesh.axis_names)}, not "
                         f"model_axis={model_axis!r}; name the axis whose devices are the "
                         "parts with model_axis=.")
    size = mesh.shape[list(mesh.axis_names).index(model_axis)]
    if size != num_parts:
        raise ValueError(f"the layout map's mesh has {size} devices along {model_axis!r} but "
                         f"split_layers was given {num_parts}; give one device per part.")
    plan, covered, other_axes = {}, set(), set()
    for path, layer, _ in layer_paths.walk(model):
        if any(path.startswith(done + "/") for done in plan):
            continue  # inside a layer already split (an attention's projections)
        sharded = {}
        for variable in layer.weights:
            axes = _axes(layout_map, variable)
            other_axes.update(a for a in axes if a is not None and a != model_axis)
            if model_axis in axes:
                sharded[variable.path] = (variable, axes.index(model_axis))
        kind = _kind(layer, sharded) if sharded or isinstance(
            layer, keras.layers.MultiHeadAttention) else None
        if kind is not None:
            plan[path] = kind
            covered.update(v.path for v in layer.weights)
    for path, layer, _ in layer_paths.walk(model):
        for variable in layer.weights:
            axes = _axes(layout_map, variable)
            if model_axis in axes and variable.path not in covered:
                raise ValueError(
                    f"the layout map shards {variable.path} {tuple(variable.shape)} along "
                    f"{model_axis!r} (dim {axes.index(model_axis)}), which no split computes "
                    "exactly (a bias or a scale sharded alone, or a layer towers does not "
                    "split); leave it whole (None) or shard its layer's kernel.")
    if not plan:
        raise ValueError(f"the layout map shards no weight of model {model.name!r} along "
                         f"{model_axis!r}: nothing to split.")
    if other_axes and say_other_axes:
        logging.info("split_layers: weights sharded along %s stay whole on their part's "
                     "device; towers splits the batch itself.", sorted(other_axes))
    return plan


def of_backbone(model, num_parts, model_axis="model"):
    """(the layer of `model` (or model itself) whose class defines get_layout_map, as
    keras_hub's Llama, Gemma, Qwen and Qwen-MoE backbones do, plan_of its map over a
    (1, num_parts) mesh of axes ("batch", model_axis)), or None where none does.

    Raises:
      ValueError: one line: the map cannot be read as a plan (plan_of's), or
        get_layout_map refused the mesh.
    """
    for layer in [model] + [layer for _, layer, _ in layer_paths.walk(model)]:
        if callable(getattr(type(layer), "get_layout_map", None)):
            break
    else:
        return None
    # The devices are names only: the map is read, never used to place anything.
    mesh = keras.distribution.DeviceMesh((1, num_parts), ["batch", model_axis],
                                         devices=[f"cpu:{j}" for j in range(num_parts)])
    try:
        layout_map = layer.get_layout_map(mesh, model_parallel_dim_name=model_axis)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{type(layer).__name__}.get_layout_map(mesh) refused a (1, "
                         f"{num_parts}) mesh: {str(error).splitlines()[0]}") from None
    return layer, plan_of(model, layout_map, num_parts, model_axis, say_other_axes=False)


def _axes(layout_map, variable):
    """The variable's layout as a tuple of mesh axis names (None: not sharded), or ()."""
    try:
        layout = layout_map[variable.path]
    except ValueError as error:  # Keras: the path matches several keys
        raise ValueError(str(error).replace("\n", " ")) from None
    if layout is None:
        return ()
    axes = tuple(layout.axes if hasattr(layout, "axes") else layout)
    return tuple(axis for axis in axes)


def _kind(layer, sharded):
    """The split kind `sharded` ({path: (variable, dim along the model axis)}) asks of
    `layer`, or None where the layer's own weights are not sharded."""
    if isinstance(layer, keras.layers.MultiHeadAttention):
        return _attention_kind(layer, sharded)
    kernel = next((dim for (v, dim) in sharded.values() if v.path.endswith("/kernel")), None)
    if isinstance(layer, keras.layers.Embedding):
        # Each table's vocabulary axis: a table's rows, an untied ReversibleEmbedding's
        # reverse table's (D, V) columns.
        vocabulary_axis = {"embeddings": 0, "reverse_embeddings": 1}
        if all(vocabulary_axis.get(v.path.rsplit("/", 1)[-1]) == dim
               for v, dim in sharded.values()):
            return "vocab"
        _refuse(sharded, "an Embedding table is split by its vocabulary only (a table's "
                "dim 0, a ReversibleEmbedding's reverse table's dim 1)")
    if isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense)) and kernel is not None:
        equation, bias_axes = equation_of(layer)
        try:
            how = kind_of_kernel_axis(equation, kernel)
            kind, letter = split_kind(how)
            axes = split_axes(equation, bias_axes, kind, letter)
        except ValueError as error:  # neither kind's letter, or a bias across the split axis
            _refuse(sharded, f"{type(layer).__name__} {layer.name!r}: "
                    + str(error).rstrip("."))
        bias = [dim for v, dim in sharded.values() if v.path.endswith("/bias")]
        if bias and (kind == "row" or bias != [axes.bias_axis]):
            _refuse(sharded, f"a {kind} split keeps the bias "
                    + ("whole on part 0" if kind == "row" else
                       f"split along its dim {axes.bias_axis}"))
        return how
    return None  # sharded weights of another layer: refused as uncovered


def _attention_kind(layer, sharded):
    """'heads' where the query/key/value kernels (d, heads, k) are sharded along heads
    and the output kernel (heads, k, d), if at all, along heads too; else refused."""
    projections = {layer.query_dense.kernel.path: 1, layer.key_dense.kernel.path: 1,
                   layer.value_dense.kernel.path: 1, layer.output_dense.kernel.path: 0}
    if not sharded:
        return None
    if layer.output_dense.bias is not None and layer.output_dense.bias.path in sharded:
        _refuse(sharded, "a heads split keeps the output bias whole on part 0")
    for path, (_, dim) in sharded.items():
        if path.endswith("/bias"):
            continue  # a projection's bias (heads, k) is split with its heads
        if projections.get(path) != dim:
            _refuse(sharded, "a MultiHeadAttention is split by heads: its query, key and "
                    "value kernels along dim 1, its output kernel along dim 0")
    return "heads"


def _refuse(sharded, why):
    paths_and_dims = ", ".join(f"{path} dim {dim}" for path, (_, dim) in sharded.items())
    raise ValueError(f"the layout map shards {paths_and_dims}, which no split computes "
                     f"exactly: {why}.")
