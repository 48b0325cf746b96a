"""plan="auto" where the model's backbone defines get_layout_map (keras_hub's Llama, Qwen,
Qwen-MoE, Qwen3-MoE, Gemma): each weight that map shards is split as it shards it.

The map is read over a (1, T) mesh as a plan (layouts.of_backbone); its entry replaces
auto.py's rules' for each layer it splits, except an attention layer the rules split by
"heads" that splits the same weights along the same kernel axes into the same parts
(Gemma's, whose map shards its query, key, value and output kernels along their heads):
there "heads" stays, its core running in parts too. Elsewhere the map wins: Llama's and
Qwen's query, key and value go by "row" (along the width), their output projection by
"row:u", their core on the joined heads, as their maps ask. A map that is no exact plan
is not followed. Each is said in one log line.
"""

import re

from towers.op_parallel import auto, grouped_classes, layouts, paths
from towers.op_parallel.layers import part_sizes


def follow(model, layers, entries, num_parts, checker):
    """(entries, with the weights that a get_layout_map of the model's backbone shards
    split as it shards them, a line for the log; None where no layer defines one).

    The map's entry (layouts.of_backbone: its plan over num_parts, None: 2) replaces
    the rules' for each layer it splits; an attention layer the rules split by "heads"
    stays so where that splits each projection the map splits along the same kernel
    axis into the same parts (Gemma's: its core then runs in parts too), else its
    projections are split as the map splits them (Llama's and Qwen's query, key and
    value along the width, "row"). A map that is no exact plan is not followed.
    """
    try:
        found = layouts.of_backbone(model, num_parts or 2)
    except ValueError as error:
        return entries, f"the layout map is not followed: {paths.first_line(error)}"
    if found is None:
        return entries, None
    owner, mapped = found
    name = f"{type(owner).__name__}.get_layout_map"
    by_path = {path: layer for path, layer, _ in layers}
    kept, heads = [], 0
    for entry in entries:
        inside = {p: how for p, how in mapped.items() if p.startswith(entry.path + "/")}
        if entry.path in mapped or (inside and not _splits_alike(entry, inside, by_path,
                                                                  num_parts or 2)):
            continue  # the map's entries take its place
        if inside:
            heads += 1
            for path in inside:
                del mapped[path]
            entry = entry._replace(rule=f"{entry.rule}, its projections' weights as {name} "
                                   "splits them")
        kept.append(entry)
    added = [auto.Entry(path, by_path[path], how, f"as {name} shards its weights")
             for path, how in mapped.items() if checker.fits(path, by_path[path], how)]
    checker.whole = [line for line in checker.whole  # the rules' "stays whole", now split
                     if not any(_about(line, e.path) for e in added)]
    kept += added
    order = {path: i for i, (path, _, _) in enumerate(layers)}
    said = (f"follows {name}: {len(added)} layers split as it shards their weights"
            + (f", {heads} attention layers by heads, which splits their weights as it "
               "does" if heads else "") + ".")
    return sorted(kept, key=lambda e: order[e.path]), said


def _splits_alike(entry, mapped, by_path, num_parts):
    """Whether entry's "heads" splits each projection of its attention layer that
    `mapped` ({path: how}) splits along the same kernel axis into the same parts,
    `mapped` holding its four projections only."""
    if entry.how != "heads" or len(mapped) != 4:
        return False
    layer = entry.layer
    heads = (grouped_classes.key_value_heads(layer) if grouped_classes.splits(layer)
             else layer.num_heads)
    for path, how in mapped.items():
        sub = by_path[path]
        role = next((r for r, names in auto.PROJECTIONS.items() if sub.name in names), None)
        if role is None or path.rpartition("/")[0] != entry.path:
            return False
        kind = "row" if role == "output" else "column"
        axis = auto.kernel_axis(sub, auto.heads_split(sub, kind))
        units = int(sub.kernel.shape[axis])  # key/value heads, or query heads: whole groups
        sizes = [units // heads * size for size in part_sizes(heads, num_parts)]
        if (axis, sizes) != (auto.kernel_axis(sub, how), part_sizes(units, num_parts)):
            return False
    return True


def _about(line, path):
    """Whether a log line of _Checker's names `path` or a layer holding it."""
    named = re.match(r"'([^']*)'", line)
    return bool(named) and (path == named[1] or path.startswith(named[1] + "/"))
