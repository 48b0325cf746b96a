"""The parallel forms of a layer: its parts, each with its variables on its own device.

A part is one device's piece of a split layer (a tower's piece of the batch is a
shard). Sizes need not divide: parts differ by at most one, larger first, as
shards do (`part_sizes`). Each form computes exactly what the layer it replaces
computes; only where each multiply runs, and so where each variable lives, moves.
Dense and EinsumDense's forms are in dense.py.

Part j's variables live on devices[j]; it runs there too, except inside
`tower_rows(rows)`, where a form whose parts live on `devices` runs part j on
rows[devices][j]: tower i of a grid runs its parts on its own devices, reading
copies of the weights (grid.PartRows).
"""

import contextlib
import inspect
import threading

import keras
import tensorflow as tf
from keras import ops

from towers import compat
from towers.data_parallel import flight, split, vocab_loss

_tower = threading.local()  # .rows: where the tower being traced runs its forms' parts


def part_sizes(total, num_parts):
    """Sizes of `num_parts` parts of `total` units (rows, heads): differing by at most one,
    larger first. Raises ValueError for more parts than units."""
    if num_parts > total:
        raise ValueError(f"{num_parts} parts of {total}: each part needs at least one")
    return split.shard_sizes(total, num_parts)


@contextlib.contextmanager
def tower_rows(rows):
    """Within it, a form whose parts live on `devices` runs its part j on
    rows[tuple(devices)][j] (None, or devices not in `rows`: on devices[j]). `rows`:
    {a pipeline stage's part devices: the tower's devices for them}."""
    outer = getattr(_tower, "rows", None)
    _tower.rows = rows
    try:
        yield
    finally:
        _tower.rows = outer


def part_device(devices, j):
    """Where part j of a form whose parts live on `devices` runs now (tower_rows')."""
    row = (getattr(_tower, "rows", None) or {}).get(tuple(devices))
    return devices[j] if row is None else row[j]


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
    their gradients flow; outside one, its variables get theirs (`variables`).
    """
    device = part_device(devices, j)
    penalties = _counted_penalties(part)
    # Per weight, what a stateless call maps it to (the tower's copy), or None.
    mapped = [compat.stateless_value(weight) for weight in part.trainable_weights]
    if whole_tables and any(isinstance(value, tf.Variable) for value in mapped):
        # A table the call reads whole (a reverse projection), read once where it lives:
        # a tensor input of the op like a copied weight, so its backward runs here too.
        with tf.device(device):
            mapped = [tf.convert_to_tensor(value) if isinstance(value, tf.Variable) else value
                      for value in mapped]
        call = _reading(call, [(weight, value) for weight, value
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
        # Persistent where a step differentiates the part more than once (a masked loss
        # term's backward of its own, data_parallel/flight.py).
        with tf.device(device), tf.GradientTape(
                persistent=flight.several_backwards()) as tape:
            tape.watch([a for a in args if a.dtype.is_floating])
            outputs = call(*tf.nest.pack_sequence_as(
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


class Placed(keras.layers.Layer):
    """A whole layer on devices[index]: its variables created there and its call run
    there, so independent branches placed on different devices run at once."""

    def __init__(self, layer, devices, index, **kwargs):
        super().__init__(name=layer.name, dtype=layer.dtype_policy, **kwargs)
        self.layer, self.devices, self.index = layer, list(devices), index
        self.parts = {index: layer}  # part index -> the layer holding its variables

    def build(self, input_shape):
        build_part(self.layer, self.devices[self.index], input_shape)

    def call(self, inputs, **kwargs):
        return run_part(self.devices, self.index, self.layer,
                        lambda x: self.layer(x, **kwargs), inputs)

    def compute_output_shape(self, input_shape):
        return self.layer.compute_output_shape(input_shape)

    def layout(self):
        """Per weight of the layer: (None, [it]): the layer holds its weights itself."""
        return [(None, [weight]) for weight in self.layer.weights]


class VocabEmbedding(keras.layers.Layer):
    """Embedding with its table's rows split: part j holds rows [start_j, end_j) on
    devices[j]. The tower sends part j only the ids in its rows and receives only
    their vectors, which it puts back in place; each id's vector comes from exactly
    one part. The gradient of part j's table is a tf.IndexedSlices of its rows looked
    up. An id outside the table reads zeros (as Embedding on a GPU); a negative one
    counts from the end (as Keras's take).

    A ReversibleEmbedding's reverse projection (`reverse=True`: hidden states times
    the table's transpose, or its own reverse table when untied, as GPT-2's and
    Gemma's LM heads) is split by the same rows: part j computes its rows' logits
    where its part of the table lives, and the parts' logits are joined. The table's
    gradients from both uses meet on the part."""

    def __init__(self, embedding_config, devices, **kwargs):
        super().__init__(name=embedding_config["name"], dtype=embedding_config.get("dtype"),
                         trainable=embedding_config.get("trainable", True),
                         activity_regularizer=embedding_config.get("activity_regularizer"),
                         **kwargs)
        self.embedding_config, self.devices = dict(embedding_config), list(devices)
        self.input_dim = embedding_config["input_dim"]
        self.output_dim = embedding_config["output_dim"]
        self.mask_zero = embedding_config.get("mask_zero", False)
        self.supports_masking = self.mask_zero
        self.sizes = part_sizes(self.input_dim, len(self.devices))
        # Only a ReversibleEmbedding's config has tie_weights.
        self.reversible = "tie_weights" in embedding_config
        part_class = (keras.layers.ReversibleEmbedding if self.reversible
                      else keras.layers.Embedding)
        self.parts = [part_class.from_config({
            **embedding_config, "input_dim": size, "name": f"part_{j}",
            "dtype": self.dtype_policy, "mask_zero": False, "activity_regularizer": None})
            for j, size in enumerate(self.sizes)]

    def build(self, input_shape):
        for device, part in zip(self.devices, self.parts):
            build_part(part, device, input_shape)

    def call(self, inputs, reverse=False):
        if reverse:
            return self._logits(inputs)
        ids = tf.reshape(tf.cast(inputs, tf.int32), [-1])                       # (N,)
        ids = tf.where(ids < 0, ids + self.input_dim, ids)
        positions, vectors, start = [], [], 0
        for j, (part, size) in enumerate(zip(self.parts, self.sizes)):
            mine = tf.where((ids >= start) & (ids < start + size))              # (n_j, 1)
            local = tf.gather_nd(ids, mine) - start                             # (n_j,)
            positions.append(mine)
            vectors.append(run_part(self.devices, j, part, part, local))        # (n_j, D)
            start += size
        found = tf.scatter_nd(tf.concat(positions, 0), tf.concat(vectors, 0),
                              tf.stack([tf.size(ids, tf.int64), self.output_dim]))  # (N, D)
        return tf.reshape(found, tf.concat([tf.shape(inputs), [self.output_dim]], 0))

    def _logits(self, hidden):
        """The reverse projection of `hidden` (..., D): part j's logits (..., V_j) for its
        rows, on its device; joined (..., V) in row order."""
        if not self.reversible:
            raise TypeError(f"layer {self.name!r} splits an Embedding, which has no reverse "
                            "projection; reverse=True needs a ReversibleEmbedding.")
        logits = [run_part(self.devices, j, part,
                           lambda h, part=part: part(h, reverse=True), hidden,
                           whole_tables=True)
                  for j, part in enumerate(self.parts)]
        # The loss may keep them in their parts (vocab_loss): only reductions travel.
        return vocab_loss.mark_parts(ops.concatenate(logits, axis=-1), logits)

    def compute_mask(self, inputs, mask=None):
        return ops.not_equal(inputs, 0) if self.mask_zero else None

    def layout(self):
        """The table: (axis 0, the parts' tables, joined along it); an untied reverse
        table (D, V) on axis 1."""
        weights = [(0, [part.embeddings for part in self.parts])]
        if self.reversible and not self.embedding_config["tie_weights"]:
            weights.append((1, [part.reverse_embeddings for part in self.parts]))
        return weights

    def compute_output_shape(self, input_shape):
        return (*input_shape, self.output_dim)

    def compute_output_spec(self, inputs, reverse=False):
        if not reverse:
            return super().compute_output_spec(inputs)
        return keras.KerasTensor((*inputs.shape[:-1], self.input_dim), self.compute_dtype)

    def get_config(self):
        return {**super().get_config(), "embedding_config": self.embedding_config,
                "devices": self.devices}


class HeadsAttention(keras.layers.Layer):
    """MultiHeadAttention with its heads split: part j holds heads [start_j, end_j) on
    devices[j] (their query, key and value projections and their slice of the output
    projection) and computes their attention there; the parts' outputs are summed.
    Part 0 holds the output bias, the others none, so it is added once (a frozen zero
    bias would be trained again by `model.trainable = True`). Each part draws its own
    dropout stream, as the layer's heads do (a given seed is offset by the part).

    The parts are of the layer's own class: MultiHeadAttention, or a subclass whose
    call a heads split keeps (exactness.keeps_call: keras_hub's
    CachedMultiHeadAttention, whose key/value cache (B, 2, S, heads, k) is split by
    heads with them)."""

    def __init__(self, attention_config, devices, part_class="MultiHeadAttention", **kwargs):
        """attention_config: the layer's get_config(), its output_shape given (each part's
        slice of the output projection maps to the whole output). part_class: the
        registered name (keras.saving's) of the layer's class."""
        super().__init__(name=attention_config["name"], dtype=attention_config.get("dtype"),
                         trainable=attention_config.get("trainable", True), **kwargs)
        self.attention_config, self.devices = dict(attention_config), list(devices)
        self.part_class = part_class
        cls = (keras.saving.get_registered_object(part_class)
               or getattr(keras.layers, part_class))
        self.call_arguments = frozenset(inspect.signature(cls.call).parameters)
        self.supports_masking = True  # the query's mask passes on, as MultiHeadAttention's
        self.sizes = part_sizes(attention_config["num_heads"], len(self.devices))
        seed = attention_config.get("seed")
        self.parts = [cls.from_config({
            **attention_config, "num_heads": heads, "name": f"part_{j}",
            "seed": None if seed is None else seed + j}) for j, heads in enumerate(self.sizes)]

    def build(self, query_shape, value_shape, key_shape=None):
        for j, (device, part) in enumerate(zip(self.devices, self.parts)):
            build_part(part, device, query_shape, value_shape, key_shape)
            if j > 0 and part.use_bias:
                compat.drop_weight(part.output_dense, "bias")

    def call(self, query, value, key=None, query_mask=None, value_mask=None, key_mask=None,
             attention_mask=None, return_attention_scores=False, training=None,
             use_causal_mask=False, cache=None, cache_update_index=None):
        """As the layer's call: MultiHeadAttention's arguments (Keras fills the masks from
        the inputs' own), and CachedMultiHeadAttention's cache and cache_update_index
        (named here: Keras's call takes no **kwargs of tensors). -> the output (B, T, D),
        with the scores (B, heads, T, S) and the cache where the layer returns them."""
        arguments = {"attention_mask": attention_mask, "training": training,
                     "return_attention_scores": return_attention_scores,
                     "use_causal_mask": use_causal_mask, "cache": cache,
                     "cache_update_index": cache_update_index}
        refused = [name for name, given in arguments.items()
                   if name not in self.call_arguments and not (given is None or given is False)]
        if refused:
            raise TypeError(f"layer {self.name!r} ({self.part_class}) takes no "
                            f"{', '.join(refused)}.")
        # Masks Keras fills from the inputs reach a call that takes them, as unsplit.
        arguments.update(query_mask=query_mask, value_mask=value_mask, key_mask=key_mask)
        arguments = {name: given for name, given in arguments.items()
                     if name in self.call_arguments}
        cache = arguments.pop("cache", None)
        caches = ([None] * len(self.parts) if cache is None else
                  tf.split(cache, self.sizes, axis=3))  # (B, 2, S, heads_j, k) each
        outputs, scores, new_caches = [], [], []
        for j, (part, part_cache) in enumerate(zip(self.parts, caches)):
            inputs = {"query": query, "value": value, "key": key, "cache": part_cache}
            inputs = {name: tensor for name, tensor in inputs.items() if tensor is not None}
            result = run_part(self.devices, j, part,
                              lambda inputs, part=part: part(**inputs, **arguments), inputs)
            result = list(result) if return_attention_scores or cache is not None else [result]
            outputs.append(result[0])  # (B, T, D): heads_j's share of the output
            if return_attention_scores:
                scores.append(result[1])  # (B, heads_j, T, S)
            if cache is not None:
                new_caches.append(result[-1])  # (B, 2, S, heads_j, k)
        output = [ops.sum(ops.stack(outputs), axis=0)]
        if return_attention_scores:
            output.append(ops.concatenate(scores, axis=1))
        if cache is not None:
            output.append(ops.concatenate(new_caches, axis=3))
        return output[0] if len(output) == 1 else tuple(output)

    def compute_output_shape(self, query_shape, value_shape, key_shape=None):
        return self.parts[0].compute_output_shape(query_shape, value_shape, key_shape)

    def layout(self):
        """Per weight of the MultiHeadAttention, in its order: the query, key and value
        kernels (d, H, k) joined on the heads axis, their biases (H, k) on axis 0, the
        output kernel (H, v, d) on axis 0, and the output bias (part 0's, whole)."""
        use_bias, weights = self.parts[0].use_bias, []
        for name in ("_query_dense", "_key_dense", "_value_dense"):
            weights.append((1, [getattr(part, name).kernel for part in self.parts]))
            if use_bias:
                weights.append((0, [getattr(part, name).bias for part in self.parts]))
        weights.append((0, [part.output_dense.kernel for part in self.parts]))
        if use_bias:
            weights.append((None, [self.parts[0].output_dense.bias]))
        return weights

    def get_config(self):
        return {**super().get_config(), "attention_config": self.attention_config,
                "devices": self.devices, "part_class": self.part_class}
