"""The parallel forms of Embedding (vocab), MultiHeadAttention (heads) and of a whole
layer placed on one device, built from parts (layers.py); Dense and EinsumDense's
forms are in dense.py.

Each form computes exactly what the layer it replaces computes; only where each
multiply runs, and so where each variable lives, moves.
"""

import functools
import inspect

import keras
import tensorflow as tf
from keras import ops

from towers import compat
from towers.op_parallel import vocab_loss
from towers.op_parallel.layers import build_part, part_sizes, run_part


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
        # Keras regularises each projection's activity: a part's query, key and value
        # hold its heads' entries (their penalties add up), but its output projection a
        # share of a sum, so that one is regularised here, on the parts' sum.
        self.output_regularizer = self.parts[0].output_dense.activity_regularizer
        for part in self.parts:
            part.output_dense.activity_regularizer = None

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
        # As MultiHeadAttention.call, the query's own mask, not the query_mask argument
        # (a query_mask passed by hand to an unmasked query is ignored there).
        own_mask = compat.keras_mask(query)
        outputs, scores, new_caches = [], [], []
        for j, (part, part_cache) in enumerate(zip(self.parts, caches)):
            inputs = {"query": query, "value": value, "key": key, "cache": part_cache}
            inputs = {name: tensor for name, tensor in inputs.items() if tensor is not None}
            result = run_part(self.devices, j, part, functools.partial(
                _attend, part, own_mask, arguments), inputs)
            result = list(result) if return_attention_scores or cache is not None else [result]
            outputs.append(result[0])  # (B, T, D): heads_j's share of the output
            if return_attention_scores:
                scores.append(result[1])  # (B, heads_j, T, S)
            if cache is not None:
                new_caches.append(result[-1])  # (B, 2, S, heads_j, k)
        output = [ops.sum(ops.stack(outputs), axis=0)]
        if self.output_regularizer is not None:  # as Keras's Layer.__call__ adds one
            penalty = self.output_regularizer(output[0])
            self.add_loss(ops.divide_no_nan(
                penalty, ops.cast(ops.shape(output[0])[0], penalty.dtype)))
        if return_attention_scores:
            output.append(ops.concatenate(scores, axis=1))
        if cache is not None:
            output.append(ops.concatenate(new_caches, axis=3))
        return output[0] if len(output) == 1 else tuple(output)

    def compute_output_shape(self, query_shape, value_shape, key_shape=None):
        return self.parts[0].compute_output_shape(query_shape, value_shape, key_shape)

    def layout(self):
        """Per weight of the MultiHeadAttention, in its order: the query, key and value
        kernels (d, H, k) joined on the heads axis, their biases (H, k) on axis 0 (where
        the class gives one: Whisper's key has none), the output kernel (H, v, d) on
        axis 0, and the output bias (part 0's, whole)."""
        use_bias, weights = self.parts[0].use_bias, []
        for name in ("query_dense", "key_dense", "value_dense"):
            weights.append((1, [getattr(part, name).kernel for part in self.parts]))
            if getattr(self.parts[0], name).bias is not None:  # Whisper's key has none
                weights.append((0, [getattr(part, name).bias for part in self.parts]))
        weights.append((0, [part.output_dense.kernel for part in self.parts]))
        if use_bias:
            weights.append((None, [self.parts[0].output_dense.bias]))
        return weights

    def get_config(self):
        return {**super().get_config(), "attention_config": self.attention_config,
                "devices": self.devices, "part_class": self.part_class}


def _attend(part, own_mask, arguments, inputs):
    """part(**inputs, **arguments), with `own_mask` (the caller's query's own Keras
    mask, or None) attached to the part's query: Keras's MultiHeadAttention takes the
    query's mask from the query itself, not from its query_mask argument, and the
    query a part reads on its device is a copy, which carries none (its padded rows
    would attend where Keras's all-masked rows attend: a different output)."""
    if own_mask is not None:
        query = tf.identity(inputs["query"])  # the caller's query keeps its own
        compat.set_keras_mask(query, own_mask)
        inputs = {**inputs, "query": query}
    return part(**inputs, **arguments)
