"""A split layer's parts: each with its variables on its own device, and its work run
there (`run_part`); the parallel forms built from them are in forms.py and dense.py.

A part is one device's piece of a split layer (a tower's piece of the batch is a
shard). Sizes need not divide: parts differ by at most one, larger first, as
shards do (`part_sizes`).

Part j's variables live on devices[j]; it runs there too, except inside
`parts_on(places)`, where a form whose parts live on `devices` runs part j on
places[devices][j]: tower i of a mesh runs its parts on its own devices, reading
copies of the weights (grid.Parts). Inside `parts_recomputed`, each part's work
keeps no activation and runs again in its backward, on its device
(TowerTrainer(recompute=[...]) naming a split layer).
"""

import contextlib
import threading

import keras
import tensorflow as tf

from towers import compat
# .places: where the tower being traced runs its forms' parts; .recompute: parts_recomputed's;
# .once: backwards_once's.
_tower = threading.local()


def part_sizes(total, num_parts):
    """Sizes of `num_parts` parts of `total` units (rows, heads): differing by at most one,
    larger first. Raises ValueError for more parts than units."""
    if num_parts > total:
        raise ValueError(f"{num_parts} parts of {total}: each part needs at least one")
    base, extra = divmod(total, num_parts)
    return [base + (1 if j < extra else 0) for j in range(num_parts)]


def parts_on(places):
    """Within it, a form whose parts live on `devices` runs its part j on
    places[tuple(devices)][j] (None, or devices not in `places`: on devices[j]).
    `places`: {a pipeline stage's part devices: the tower's devices for them}."""
    return _set_within("places", places)


def current_places():
    """The `places` of the parts_on in effect on this thread, or None outside any."""
    return getattr(_tower, "places", None)


def parts_recomputed(recompute):
    """Within it, run_part runs the work of part j as recompute(part, work, inputs, {}),
    inside the part's op on its device: training/recompute.py's recompute_call, one op
    that keeps only its inputs and whose gradient runs the work again. A look-up of a
    table where it lives (op_parallel.tables) keeps only its ids and is not rerun."""
    return _set_within("recompute", recompute)


def backwards_once(once):
    """Within it, where `once`, the forward being traced is differentiated only once, so a
    part's tape need not be persistent. Outside, a part's tape is: a step may differentiate
    the forward more than once (a masked loss term's backward of its own,
    model_parallel/flight.py), and a recurrent layer's gradient is slower through a
    persistent tape only, not wrong."""
    return _set_within("once", once)


@contextlib.contextmanager
def _set_within(name, value):
    """Within it, this thread's tower context has `name` set to `value`."""
    outer = getattr(_tower, name, None)
    setattr(_tower, name, value)
    try:
        yield
    finally:
        setattr(_tower, name, outer)


def part_device(devices, j):
    """Where part j of a form whose parts live on `devices` runs now (parts_on')."""
    tower_devices = (getattr(_tower, "places", None) or {}).get(tuple(devices))
    return devices[j] if tower_devices is None else tower_devices[j]


def build_part(part, device, *shapes):
    """Builds `part` on `device`, and moves its weights' regularizers into a penalty of
    its own that run_part computes beside the part's work: Keras would compute them on
    the tower, reading each weight there and adding the penalty's gradient to the
    part's there, a weight's round trip per step."""
    with tf.device(device):
        part.build(*shapes)
    penalties = []
    for i, weight in enumerate(part.weights):  # freezing leaves part.weights' order as it is
        if weight.trainable and weight.regularizer is not None:
            penalties.append((i, weight.regularizer))
            weight.regularizer = None
    part.penalties = tuple(penalties)  # (index into part.weights, regularizer)


def _counted_penalties(part):
    """`part`'s weight penalties (build_part) that count now, as (weight, regularizer):
    its trainable weights' (as in Keras, a frozen weight's penalty is not counted)."""
    weights, trainable = part.weights, {id(weight) for weight in part.trainable_weights}
    return [(weights[i], regularizer) for i, regularizer in getattr(part, "penalties", ())
            if id(weights[i]) in trainable]


def _penalty(penalties, value):
    """The sum of `penalties`, (weight, regularizer) pairs, `value(weight)` the weight's
    value; None for none."""
    if not penalties:
        return None
    return tf.add_n([tf.cast(regularizer(value(weight)), tf.float32)
                     for weight, regularizer in penalties])


def run_part(devices, j, part, call, *inputs, whole_tables=False):
    """call(*inputs), the work of part j (`part`: the layer holding its variables), with
    its forward and its backward on part_device(devices, j). `whole_tables`: the call
    reads its embedding tables whole (a reverse projection), not rows of them.

    tape.gradient creates every backward op under the device scope it is called in,
    the tower's (TensorFlow issue #33688); that would run each part's backward, 2/3 of
    its work, on one device and copy its weights there. So a part is one
    custom-gradient op that differentiates itself on its device. Inside a stateless
    call the part's weights are tensors (the tower's copies), inputs of that op, so
    their gradients flow; outside one, its variables get theirs (`variables`). Inside
    parts_recomputed the work is an op of its own inside that one, on the same device,
    keeping only its inputs there.
    """
    device = part_device(devices, j)
    penalties = _counted_penalties(part)
    # Per weight, what a stateless call maps it to (the tower's copy), or None.
    mapped = [compat.stateless_value(weight) for weight in part.trainable_weights]
    recompute = getattr(_tower, "recompute", None)
    work = call if recompute is None else (lambda *args: recompute(part, call, args, {}))
    if whole_tables and any(isinstance(value, tf.Variable) for value in mapped):
        # A table the call reads whole (a reverse projection), read once where it lives:
        # a tensor input of the op like a copied weight, so its backward runs here too.
        with tf.device(device):
            mapped = [tf.convert_to_tensor(value) if isinstance(value, tf.Variable) else value
                      for value in mapped]
        work = _reading(work, [(weight, value) for weight, value
                               in zip(part.trainable_weights, mapped) if value is not None])
    reads = {id(weight): weight if value is None else value
             for weight, value in zip(part.trainable_weights, mapped)}

    def value(weight):  # what the part reads for `weight`
        return reads[id(weight)]

    if any(isinstance(value, tf.Variable) for value in mapped):
        # A table looked up where it lives (op_parallel.tables): its read, and so the
        # gradient's rows, are where it lives already; a custom gradient would read it whole.
        with tf.device(device):
            penalty = _penalty(penalties, value)
            if penalty is not None:
                part.add_loss(penalty)
            return call(*inputs)
    weights = [value for value in mapped if value is not None]
    # Each tensor is one input of the op, however often it is passed (self-attention's
    # query and value): a gradient per input, or the tape would count it twice.
    flat_inputs, unique = tf.nest.flatten(inputs), {}
    for tensor in flat_inputs + weights:
        unique.setdefault(id(tensor), tensor)
    position = {key: i for i, key in enumerate(unique)}

    @tf.custom_gradient
    def run(*args):
        # Persistent unless the step differentiates the part once only (backwards_once).
        with tf.device(device), tf.GradientTape(
                persistent=not getattr(_tower, "once", None)) as tape:
            tape.watch([a for a in args if a.dtype.is_floating])
            outputs = work(*tf.nest.pack_sequence_as(
                inputs, [args[position[id(t)]] for t in flat_inputs]))
            penalty = _penalty(penalties, value)
            if penalty is not None:  # its gradient joins the part's here, on the part
                outputs = (outputs, penalty)
        flat_outputs = tf.nest.flatten(outputs)

        def gradient(*output_grads, variables=None):
            given = [(o, g) for o, g in zip(flat_outputs, output_grads) if g is not None]
            sources = [a for a in args if a.dtype.is_floating] + list(variables or [])
            grads = iter([None] * len(sources))
            if given:
                with tf.device(device):
                    grads = iter(tape.gradient([o for o, _ in given], sources,
                                               output_gradients=[g for _, g in given]))
            arg_grads = [next(grads) if a.dtype.is_floating else None for a in args]
            return (arg_grads, list(grads)) if variables else arg_grads

        return outputs, gradient

    with tf.device(device):  # where custom_gradient's IdentityN, and so the outputs, are
        outputs = run(*unique.values())
    if penalties:
        outputs, penalty = outputs
        part.add_loss(penalty)
    return outputs


def _reading(call, mapping):
    """`call` reading each weight as its value in `mapping` ((weight, tensor) pairs)."""
    def read(*args):
        with keras.StatelessScope(mapping):
            return call(*args)
    return read
