"""A checkpoint's values against the variables a restore would fill, compared before
anything is assigned.

tf.train.Checkpoint.restore assigns every value it can match as it goes: a
checkpoint of another model or optimizer restores in part, with at most a
warning, and a value whose variable does not exist yet waits for one to be made
(or for ever). So Checkpointer.restore first reads the checkpoint's index and
compares it with the variables of the objects it restores, each under the key
a save would give it (the path of local names by which a breadth-first walk
from the root first reaches it, as tf.train.Checkpoint names it):
`difference` says in one phrase what differs, or None when the restore would
be whole.
"""

import collections

import keras
import tensorflow as tf

VALUE_SUFFIX = "/.ATTRIBUTES/VARIABLE_VALUE"  # a variable's value under its object's path
_ATTRIBUTES = "/.ATTRIBUTES/"  # what any object saves is under its path, then this
_SAVE_COUNTER = "save_counter"  # tf.train.Checkpoint's own count, made at its first save
_NAMES_SHOWN = 3  # differing values named in a message; the rest are counted


def saved_variables(root):
    """({checkpoint key: variable} of every variable `root` saves, the paths of all the
    objects it saves), as tf.train.Checkpoint(...) `root` names them when it saves.

    Keys look like "model/d1/_kernel/.ATTRIBUTES/VARIABLE_VALUE", or, for a weight
    the walk reaches through the optimizer first (a Sequential model's),
    "optimizer/_trainable_variables/0/.ATTRIBUTES/VARIABLE_VALUE".
    """
    paths = {id(root): ""}
    visited = [root]  # kept alive, so that no object's id is reused during the walk
    queue = collections.deque([root])
    variables = {}
    while queue:
        parent = queue.popleft()
        for name, child in tf.train.TrackableView.children(parent).items():
            if id(child) in paths:
                continue
            path = f"{paths[id(parent)]}/{_escape(name)}".lstrip("/")
            if path == _SAVE_COUNTER:
                continue
            paths[id(child)] = path
            visited.append(child)
            queue.append(child)
            if isinstance(child, (tf.Variable, keras.Variable)):
                variables[path + VALUE_SUFFIX] = child
    return variables, set(paths.values())


def difference(reader, variables, object_paths, named_first=()):
    """What differs between the checkpoint `reader` reads (tf.train.load_checkpoint) and
    `saved_variables`' answer, in one phrase; None when every variable has a value of
    its shape and dtype there and every value there belongs to one of the objects.

    A variable is named by its Keras path ("dense_1/kernel"), those among
    `named_first` (the model's weights) before the others; a value the checkpoint
    alone holds by its key, without the suffix every value's key ends in.
    """
    shapes, dtypes = reader.get_variable_to_shape_map(), reader.get_variable_to_dtype_map()
    first = {id(variable) for variable in named_first}
    missing = sorted((variables[key] for key in variables if key not in shapes),
                     key=lambda variable: id(variable) not in first)
    if missing:
        return (f"it lacks {_listed([(_path(v), tuple(v.shape)) for v in missing])}, which "
                "this model and optimizer have")
    extra = sorted((key for key in shapes if _ATTRIBUTES in key
                    and key.split(_ATTRIBUTES)[0] not in object_paths
                    and not key.startswith(_SAVE_COUNTER + "/")), key=_in_number_order)
    if extra:
        named = [(key.split(_ATTRIBUTES)[0], tuple(shapes[key])) for key in extra]
        return f"it holds {_listed(named)}, which this model and optimizer lack"
    for key, variable in variables.items():
        dtype, shape = tf.as_dtype(variable.dtype).name, tuple(variable.shape)
        if (dtypes[key].name, tuple(shapes[key])) != (dtype, shape):
            return (f"it holds {_path(variable)} as {dtypes[key].name} of shape "
                    f"{tuple(shapes[key])}, and this one is {dtype} of shape {shape}")
    return None


def _listed(named_shapes):
    """The first few (name, shape) as 'name (shape)', and how many more there are."""
    shown = ", ".join(f"{name} {shape}" for name, shape in named_shapes[:_NAMES_SHOWN])
    more = len(named_shapes) - _NAMES_SHOWN
    return shown + (f" and {more} more" if more > 0 else "")


def _path(variable):
    """A Keras variable's path ("dense_1/kernel"), a tf.Variable's name ("epoch")."""
    return getattr(variable, "path", None) or variable.name.split(":")[0]


def _in_number_order(key):
    """A sort key that puts "_variables/9" before "_variables/10"."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in key.split("/")]


def _escape(name):
    """A local name as a checkpoint key holds it ('.' doubled, '/' as '.S')."""
    return name.replace(".", "..").replace("/", ".S")
