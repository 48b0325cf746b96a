"""Layer paths: how plans (op_parallel/paths.py) and pipeline cuts (model_parallel/stages.py)
address a model's layers, nested ones too.

A layer's path is the "/"-joined names from the model down to it, as Keras writes
`layer.path` ("transformer_block/att/query"; for a subclassed model without the
model's own name in front). A pattern is a path whose levels are shell wildcards
("block_*/ffn/*"), each matched against one level's names (fnmatch, case-sensitive):
Keras numbers repeated names ("gpt2_backbone_1"), so "gpt2_backbone*/..." names the
backbone whatever its number.
"""

import fnmatch

import keras

from towers import compat

WILDCARDS = frozenset("*?[")


def is_pattern(key):
    """Whether `key` (a plan key, a pipeline cut) reaches inside a layer or has a
    wildcard: not a plain name of a top-level layer."""
    return "/" in key or bool(WILDCARDS & set(key))


def walk(model, repeats=False):
    """(path, layer, position) of every layer inside `model`, parents before their
    sublayers; InputLayers left out. A layer's position is the index of each level's
    layer among its parent's sublayers (compat.sublayers). A layer held twice (a
    keras_hub task model calls its backbone's token embedding again as its LM head) is
    listed once, at its first path; with `repeats`, at each path that holds it (its
    sublayers at the first)."""
    seen, found = set(), []

    def visit(layer, prefix, position):
        for index, sublayer in enumerate(compat.sublayers(layer)):
            if isinstance(sublayer, keras.layers.InputLayer):
                continue
            path = f"{prefix}{sublayer.name}"
            if id(sublayer) in seen:
                if repeats:
                    found.append((path, sublayer, position + (index,)))
                continue
            seen.add(id(sublayer))
            found.append((path, sublayer, position + (index,)))
            visit(sublayer, path + "/", position + (index,))

    visit(model, "", ())
    return found


def matches(path, pattern):
    """Whether layer path `path` is named by `pattern`, level by level."""
    names, levels = path.split("/"), pattern.split("/")
    return len(names) == len(levels) and all(
        fnmatch.fnmatchcase(name, level) for name, level in zip(names, levels))


def paths_at_depth(layers, pattern, most=12):
    """The paths of `layers` (walk's) as deep as `pattern`, for an error message saying
    what a pattern that matches nothing could have named."""
    depth = [path for path, _, _ in layers if path.count("/") == pattern.count("/")]
    return f"{depth[:most]}{' ...' if len(depth) > most else ''}"


def holders(model, position):
    """The layers along `position` (walk's): [model, its sublayer, ..., the layer]."""
    chain = [model]
    for index in position:
        sublayers = compat.sublayers(chain[-1])
        chain.append(sublayers[index] if index < len(sublayers) else None)
    return chain
