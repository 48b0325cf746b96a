"""A checkpoint's values against the variables a restore would fill, compared before
anything is assigned.

tf.train.Checkpoint.restore assigns every value it can match as it goes: a
checkpoint of another model or optimizer restores in part, with at most a
warning, and a value whose variable does not exist yet waits for one to be made
(or for ever). So Checkpointer.restore first reads the checkpoint's index and
compares it with the variables (and the tables, which save their keys and
values themselves) of the objects it restores, each under the key a save would
give it (the path of local names by which a breadth-first walk from the root
first reaches it, as tf.train.Checkpoint names it):
`difference` says in one phrase what differs, or None when the restore would
be whole.
"""

import collections
import dataclasses

import keras
import tensorflow as tf

from towers import compat

VALUE_SUFFIX = "/.ATTRIBUTES/VARIABLE_VALUE"  # a variable's value under its object's path
_ATTRIBUTES = "/.ATTRIBUTES/"  # what any object saves is under its path, then this
_SAVE_COUNTER = "save_counter"  # tf.train.Checkpoint's own count, made at its first save
_NAMES_SHOWN = 3  # differing values named in a message; the rest are counted


@dataclasses.dataclass(frozen=True)
class Saved:
    """What tf.train.Checkpoint(...) `root` saves, as it names it (saved_state).

    Attributes:
      variables: {checkpoint key: variable} of every variable; keys look like
        "model/d1/_kernel/.ATTRIBUTES/VARIABLE_VALUE", or, for a weight the walk
        reaches through the optimizer first (a Sequential model's),
        "optimizer/_trainable_variables/0/.ATTRIBUTES/VARIABLE_VALUE".
      tables: {object path: object} of the objects other than variables that save
        tensors of their own under their path (lookup tables: their keys and values).
      object_paths: the paths of all the objects it saves.
    """
    variables: dict
    tables: dict
    object_paths: set


def saved_state(root):
    """`root`'s Saved: the variables, tables and objects tf.train.Checkpoint(...) `root`
    saves, under the keys it gives them."""
    paths = {id(root): ""}
    visited = [root]  # kept alive, so that no object's id is reused during the walk
    queue = collections.deque([root])
    variables, tables = {}, {}
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
            elif compat.saves_own_tensors(child):
                tables[path] = child
    return Saved(variables, tables, set(paths.values()))


def difference(reader, saved, named_first=()):
    """What differs between the checkpoint `reader` reads (tf.train.load_checkpoint) and
    `saved` (saved_state's answer), in one phrase; None when every variable has a value
    of its shape and dtype there, every table has values there, and every value there
    belongs to one of the objects.

    A variable is named by its Keras path ("dense_1/kernel"), those among
    `named_first` (the model's weights) before the others; a table by its object's
    path. A variable the checkpoint alone holds is named by the name it was saved
    with (the path of the variable that wrote it), other values by their object's path.
    """
    shapes, dtypes = reader.get_variable_to_shape_map(), reader.get_variable_to_dtype_map()
    first = {id(variable) for variable in named_first}
    missing = sorted((saved.variables[key] for key in saved.variables if key not in shapes),
                     key=lambda variable: id(variable) not in first)
    missing_tables = [f"{path} (a {type(table).__name__})"
                      for path, table in sorted(saved.tables.items())
                      if not any(key.startswith(path + _ATTRIBUTES) for key in shapes)]
    if missing or missing_tables:
        named = [f"{_path(v)} {tuple(v.shape)}" for v in missing] + missing_tables
        return f"it lacks {_listed(named)}, which this model and optimizer have"
    extra = _extra_values(reader, shapes, saved.object_paths)
    if extra:
        return f"it holds {_listed(extra)}, which this model and optimizer lack"
    for key, variable in saved.variables.items():
        dtype, shape = tf.as_dtype(variable.dtype).name, tuple(variable.shape)
        if (dtypes[key].name, tuple(shapes[key])) != (dtype, shape):
            return (f"it holds {_path(variable)} as {dtypes[key].name} of shape "
                    f"{tuple(shapes[key])}, and this one is {dtype} of shape {shape}")
    return None


def _extra_values(reader, shapes, object_paths):
    """The checkpoint's values of objects outside `object_paths`, one per object, in
    key order: a variable as "its saved name (shape)", the saved name being its path
    when it was saved (not its key: "optimizer/_trainable_variables/2" says nothing
    of which weight it is), anything else as "its object's path (not a variable)"."""
    names, extra = None, {}
    for key in sorted(shapes, key=_in_number_order):
        path = key.split(_ATTRIBUTES)[0]
        if (_ATTRIBUTES not in key or path in object_paths or path in extra
                or key.startswith(_SAVE_COUNTER + "/")):
            continue
        if not key.endswith(VALUE_SUFFIX):
            extra[path] = f"{path} (not a variable)"
            continue
        names = compat.saved_variable_names(reader) if names is None else names
        extra[path] = f"{names.get(key, path)} {tuple(shapes[key])}"
    return list(extra.values())


def _listed(named):
    """The first few of `named` (strings), and how many more there are."""
    shown = ", ".join(named[:_NAMES_SHOWN])
    more = len(named) - _NAMES_SHOWN
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
