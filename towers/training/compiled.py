"""The trainer's compiled functions, and the host's work per call kept to what is needed.

A step function is traced once per batch structure, for the batch's rows or
for any rows (dim 0 left as None, so uneven and short batches reuse it: the
trainer's variant says which, compiled_steps.variant), and then called as its
traced graph, without tf.function's argument matching. A batch of Tensors
shaped as one seen before is recognised by a cheap signature, with no specs
built or compared. A function's logs come back packed in one float64 vector: one
device-to-host read per call. A predict step's outputs come back as they are,
as NumPy arrays.
"""

import functools

import tensorflow as tf

from towers import errors
from towers.data_parallel import split


# A step has no Python control flow on tensors, and Keras's own fit converts none
# (its step is do_not_convert): autograph's source rewriting, about half of tracing
# a step, buys nothing. A user's layer branching on a tensor fails here as in fit.


class CompiledFunctions:
    """One trainer's tf.functions, by key: (kind, ...) with the batch structure.

    `tracing`: fn() -> a context manager entered wherever a function may be traced
    (placement.step_hooks): a traced graph keeps what it placed, and runs without it.
    `calling`: fn(kind) -> a context manager entered around every call of a function
    of that kind (its first call optimises the function's graph:
    graph_rewrites.GraphRewrites.calls).
    `jit_compile`: whether the towers' work is compiled by XLA (what an error says).
    """

    def __init__(self, tracing, calling, jit_compile=False):
        self._tracing, self._calling, self._jit_compile = tracing, calling, jit_compile
        self._functions = {}  # key -> tf.function
        self._graphs = {}  # key -> its one traced graph (functions of a batch)
        self._log_names = {}  # key -> the names of its packed logs, in order
        self._log_dtypes = {}  # key -> their dtypes before packing, in the same order
        self._known = {}  # (kind, signature of a batch) -> key
        self._checked = set()  # the batch structures checked (or set up on) before a trace

    def functions(self):
        """Every tf.function compiled so far."""
        return list(self._functions.values())

    def known(self, kind, batch):
        """The key of `kind`'s function (for_batch's, whichever its name) for a batch of
        Tensors shaped as one seen before, or None (then the batch needs the trainer's
        full checks)."""
        signature = _signature(batch)
        return None if signature is None else self._known.get((kind, signature))

    def for_batch(self, kind, batch, step, check=None, packed=True, name=None,
                  rows_known=False):
        """The key of `kind`'s function for `batch` (checked Tensors, or split.Shards of
        them), traced now if its structure is new; `known(kind, ...)` finds it again.

        step: fn(batch) -> a dict of scalar logs (packed: one read per call), or with
          packed=False any nest of Tensors (a predict step's outputs).
        check: None, or fn(batch), called before a function is traced for a new
          structure (not for another variant of one checked); it raises for a batch the
          step cannot take.
        name: the function's kind where it is not `kind` (a variant of it; graph_rewrites
          reads its first word).
        rows_known: trace for batch's rows (dim 0 in the signature; `name` names them),
          not for batches of any rows.
        """
        is_shards = isinstance(batch, split.Shards)
        parts = list(batch) if is_shards else batch
        spec = (tf.nest.map_structure(tf.TensorSpec.from_tensor, parts) if rows_known
                else split.any_rows(parts))
        key = (name or kind, is_shards, spec_text(spec))
        if key not in self._functions:
            structure = batch_structure(batch)
            if check is not None and structure not in self._checked:
                check(batch)
            self._checked.add(structure)
            if is_shards:  # the one argument comes as a list: Shards again inside
                step = functools.partial(_with_shards, step)
            self._functions[key] = tf.function(
                self._packed(key, step) if packed else step, input_signature=[spec],
                autograph=False)
            with self._tracing():
                self._graphs[key] = self._functions[key].get_concrete_function()
        signature = _signature(batch)
        if signature is not None:
            self._known[kind, signature] = key
        return key

    def add(self, key, function, *bound, check=None):
        """Compiles function(*bound, *args) (-> a dict of scalar logs), packed, under
        `key` unless there.

        check: None, or fn(), called before a function is compiled under a new key;
          it raises for arguments of that key the function cannot take.
        """
        if key not in self._functions:
            if check is not None:
                check()
            self._functions[key] = tf.function(
                self._packed(key, functools.partial(function, *bound)), autograph=False)

    def call(self, key, *args):
        """Calls the function of `key`; its logs come back as Python floats (a function
        compiled with packed=False: its outputs, as NumPy arrays in their nest). An
        error that the batch or the model caused while it ran becomes a ValueError that
        says it in one line."""
        try:
            return self._called(key, *args)
        except (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError) as error:
            if self._jit_compile and errors.is_compile_error(error):
                raise ValueError(  # XLA compiles a tower before it runs: nothing was applied
                    f"XLA cannot compile this model's tower step: {errors.root_cause(error)}. "
                    "Pass jit_compile=False to run it without XLA.") from error
            raise ValueError(f"the step failed: {errors.root_cause(error)}.") from error

    def _called(self, key, *args):
        with self._calling(key[0]):
            if key in self._graphs:
                # The traced graph skips tf.function's argument matching: about 0.2 ms a call.
                result = self._graphs[key](*args)
            else:
                with self._tracing():  # a function added (not traced) yet traces when called
                    result = self._functions[key](*args)
        if key not in self._log_names:
            return tf.nest.map_structure(lambda t: t.numpy(), result)
        if isinstance(result, tuple):  # logs and what else the function gives back
            return self._logs(key, result[0]), tf.nest.map_structure(
                lambda t: t.numpy(), result[1])
        return self._logs(key, result)

    def _logs(self, key, values):
        values = values.numpy()  # the call's one device-to-host read of its logs
        return dict(zip(self._log_names[key], values.tolist()))

    def logs_within(self, key, batch):
        """Calls the function of `key` (for_batch's) on `batch` inside another function
        as it is traced (an in-graph loop's), its Python not run again; returns its
        logs as scalar Tensors of their own dtypes (float64 holds each exactly)."""
        values = self._functions[key](list(batch) if isinstance(batch, split.Shards) else batch)
        return {name: tf.cast(values[i], dtype) for i, (name, dtype) in
                enumerate(zip(self._log_names[key], self._log_dtypes[key]))}

    def _packed(self, key, function):
        """`function`, returning its dict of scalar logs as one float64 vector; the
        names go to self._log_names[key] and their dtypes to self._log_dtypes[key]
        when it is traced. A function may return (logs, a nest of Tensors): then
        (the vector, that nest)."""
        names = self._log_names.setdefault(key, [])
        dtypes = self._log_dtypes.setdefault(key, [])

        def packed(*args):
            result = function(*args)
            logs, more = result if isinstance(result, tuple) else (result, None)
            names[:] = list(logs)
            dtypes[:] = [tf.convert_to_tensor(value).dtype for value in logs.values()]
            vector = tf.stack([tf.cast(value, tf.float64) for value in logs.values()])
            return vector if more is None else (vector, more)

        return packed


def is_checkable(batch):
    """Whether `batch` comes as a batch checked before does (a flat tuple of Tensors with
    rows, or split.Shards of them), so that CompiledFunctions.known may recognise it."""
    return _signature(batch) is not None


def batch_structure(batch):
    """A batch's structure (Tensors, or split.Shards of them), whatever its rows: hashable."""
    is_shards = isinstance(batch, split.Shards)
    return is_shards, spec_text(split.any_rows(list(batch) if is_shards else batch))


def spec_text(spec):
    """A nest of tf.TensorSpec as a hashable string of dtypes and shapes."""
    return str(tf.nest.map_structure(lambda s: f"{s.dtype.name}{s.shape.as_list()}", spec))


def _signature(batch):
    """A cheap, hashable description of a batch of Tensors (or split.Shards of them):
    per part, each Tensor's dtype and shape.

    None where the trainer's full checks must run: anything but a flat tuple
    of Tensors (arrays, nested inputs), scalars, float64 (to be cast), parts
    that disagree on dim 0, or no rows at all.
    """
    parts = list(batch) if isinstance(batch, split.Shards) else [batch]
    signature, rows = [], 0
    for part in parts:
        if not isinstance(part, tuple) or not all(
                isinstance(t, tf.Tensor) and t.shape.rank and t.dtype != tf.float64
                for t in part):
            return None
        sizes = {t.shape[0] for t in part}
        if len(sizes) != 1 or None in sizes:
            return None
        rows += sizes.pop()
        signature.append(tuple((t.dtype, tuple(t.shape)) for t in part))
    return (isinstance(batch, split.Shards), tuple(signature)) if rows else None


def _with_shards(step, shards):
    return step(split.Shards(shards))
