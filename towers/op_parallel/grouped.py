""""heads" for keras_hub's grouped-query attention classes (Mistral's and Mixtral's,
Llama's, Qwen's and Qwen-MoE's, Qwen3's and Qwen3-MoE's, Phi-3's, Gemma's and Gemma 3's,
SmolLM3's, GPT-OSS's): the layer's key/value heads split by whole groups, each part an
instance of the layer's own class with fewer heads, on its own device; the parts'
outputs summed.

Grouped-query attention gives each key/value head a group of num_query_heads //
num_key_value_heads query heads, which read that head only. Part j holds key/value heads
[start_j, end_j) and the query heads of their groups: their query, key and value
projections, their rows of the output projection (`bquh,uhm->bqm`, summed over u), and
their slice (B, 2, S, kv_j, head_dim) of the cache (Gemma 3's: of its key and value, each
(B, S, kv_j, head_dim)). Each query head's attention reads its own projections and its
group's key and value only; rotary embeddings, sliding windows, soft caps and query
scales act per head; and the output projection is a sum over heads, so the parts'
outputs add up to the layer's.

A class is split only where building it with fewer heads changes nothing else: head_dim
is given (Mistral's, Qwen3's, Gemma's config), or, for a class that computes it as
hidden_dim // num_query_heads (Llama's, Qwen's, Phi-3's, Mixtral's), each part's
projections are rebuilt for the layer's head width (SmolLM3's, from its hidden_size:
each part given its heads' width, its output projection rebuilt); every weight it has
is a projection along the heads (GPT-OSS's sinks, one per query head, too; an output
bias is added once, part 0's), or a sublayer every head reads alike (Qwen3's and Gemma
3's query and key norms, a scale of shape (head_dim,); SmolLM3's rotary frequencies):
that one is one sublayer all parts hold, its variable on part 0's device, read by every
part, its gradient summed over the parts by the tape as over the heads of the unsplit
layer, so its update is the unsplit layer's. `_CLASSES` in grouped_classes.py lists
those checked, and `_WHY_NOT` there says why the others keras_hub ships are not split.
"""

import inspect

import keras
import tensorflow as tf
from keras import ops

from towers import compat
from towers.op_parallel.grouped_classes import checked, class_named, class_path
from towers.op_parallel.layers import build_part, part_sizes, run_part


def form_of(layer, devices):
    """The GroupedHeadsAttention of `layer` (refusal(layer) None), not built."""
    found = checked(class_path(type(layer)))
    head_dim = int(compat.output_projection(layer).kernel.shape[1])  # (heads, head_dim, m)
    if found.names is None:
        config = layer.get_config()
    else:
        config = {"name": layer.name, "trainable": layer.trainable,  # Layer's config
                  "dtype": keras.dtype_policies.serialize(layer.dtype_policy),
                  **{name: getattr(layer, name) for name in found.names}}
        if "kernel_initializer" in inspect.signature(type(layer).__init__).parameters:
            config["kernel_initializer"] = keras.initializers.serialize(
                compat.kernel_initializer_of(layer))
    if found.takes_head_dim:  # given, not recomputed from the part's fewer heads
        config["head_dim"] = head_dim
    rebuilt = not found.takes_head_dim and found.width_argument is None
    return GroupedHeadsAttention(config, devices, class_path(type(layer)),
                                 [list(weight.shape) for weight in layer.weights],
                                 head_dim=head_dim if rebuilt else None)


class GroupedHeadsAttention(keras.layers.Layer):
    """A grouped-query attention layer with its key/value heads split by whole groups:
    part j (the layer's own class, with kv_j key/value heads and their groups' query
    heads) holds their projections and their rows of the output projection on
    devices[j] and computes their attention there; the parts' outputs are summed, a
    cache is split along its key/value heads axis into the parts and their updated
    caches joined. A norm every head reads is one sublayer all parts hold (its variable
    on devices[0]): each part reads it, and the tape sums its gradient over the parts as
    over the heads. An output bias is part 0's alone, added once. Each part draws its
    own dropout stream, as the layer's heads do."""

    def __init__(self, attention_config, devices, part_class, weight_shapes, head_dim=None,
                 **kwargs):
        """attention_config: the layer's constructor arguments (its get_config(), head_dim
        given where it takes one). part_class: its class's module and name (a key of
        _CLASSES). weight_shapes: the layer's weights' shapes, in order (each part's
        weights are joined along the axis where theirs differ). head_dim: the head width
        of a class whose projections each part rebuilds for it, else None."""
        super().__init__(name=attention_config["name"], dtype=attention_config.get("dtype"),
                         trainable=attention_config.get("trainable", True), **kwargs)
        self.attention_config, self.devices = dict(attention_config), list(devices)
        self.part_class, self.weight_shapes = part_class, [list(s) for s in weight_shapes]
        self.head_dim, self.checked = head_dim, checked(part_class)
        heads, width = self.checked.heads_argument, self.checked.width_argument
        kv_heads = attention_config["num_key_value_heads"]
        groups = attention_config[heads] // kv_heads
        self.sizes = part_sizes(kv_heads, len(self.devices))  # key/value heads per part
        cls = class_named(part_class)
        self.input_name = list(inspect.signature(cls.call).parameters)[1]  # x, hidden_states
        self.parts = []
        for j, (device, size) in enumerate(zip(self.devices, self.sizes)):
            config = {**attention_config, heads: size * groups, "num_key_value_heads": size,
                      "name": f"part_{j}"}
            if width is not None:  # its query heads' width: the head width it computes
                config[width] = attention_config[width] // attention_config[heads] * \
                    size * groups
            with tf.device(device):  # what the class makes in its constructor, there
                self.parts.append(cls.from_config(config))

    def build(self, hidden_states_shape=None, **shapes):
        shape = hidden_states_shape or shapes.get("input_shape") or shapes.get("inputs_shape")
        # SmolLM3's is [hidden_states, (position embeddings), mask]'s shapes, as built.
        hidden_shape = shape[0] if isinstance(shape[0], (list, tuple)) else shape
        heads = self.attention_config[self.checked.heads_argument]
        head_width = hidden_shape[-1] // heads  # the layer's hidden_dim // num_query_heads
        for device, part in zip(self.devices, self.parts):
            build_part(part, device, shape)
            if self.head_dim is not None:
                compat.rebuild_for_head_dim(part, self.head_dim, shape, device)
            if self.checked.width_argument is not None:
                compat.rebuild_output_width(part, hidden_shape[-1], device)
            compat.keep_query_scale(part, head_width)
        for part in self.parts[1:]:  # an output bias (GPT-OSS's) added once: part 0's
            compat.drop_output_bias(part)
        compat.share_sublayers(self.parts, self.checked.shared)

    def call(self, hidden_states, attention_mask=None, cache=None, cache_update_index=None,
             cache_update_mask=None, training=None, **kwargs):
        """As the layer's call (CachedGemma3Attention's cache_update_mask too): -> its
        output (B, T, D), and the updated cache where one is given. kwargs: the cache
        and its update index under a class's own names (SmolLM3's self_attention_cache,
        self_attention_cache_update_index), and what else its caller passes, given to
        each part as to the layer (SmolLM3's backbone rebuilt from its config passes its
        name, trainable and dtype to its decoder layers, which pass them on)."""
        cache_name, index_name = self.checked.cache_arguments
        if cache_name != "cache":
            cache, cache_update_index = kwargs.pop(cache_name, None), kwargs.pop(index_name, None)
        paired = isinstance(cache, (tuple, list))  # (key, value), each (B, S, kv, head_dim)
        if cache is None:
            caches = [None] * len(self.parts)
        elif paired:
            caches = list(zip(*[tf.split(c, self.sizes, axis=2) for c in cache]))
        else:
            caches = tf.split(cache, self.sizes, axis=3)  # (B, 2, S, kv_j, head_dim) each
        given = {name: value for name, value in ((index_name, cache_update_index),
                                                 ("cache_update_mask", cache_update_mask),
                                                 ("training", training))
                 if value is not None}  # else the class's defaults, as unsplit
        given.update(kwargs)
        outputs, new_caches = [], []
        for j, (part, part_cache) in enumerate(zip(self.parts, caches)):
            inputs = {self.input_name: hidden_states}
            if part_cache is not None:
                inputs[cache_name] = tuple(part_cache) if paired else part_cache

            def work(inputs, part=part):
                return part(**inputs, attention_mask=attention_mask, **given)

            result = run_part(self.devices, j, part, work, inputs)
            if cache is None:
                outputs.append(result)  # (B, T, D): its heads' share of the output
            else:
                outputs.append(result[0])
                new_caches.append(result[1])
        output = ops.sum(ops.stack(outputs), axis=0)
        if cache is None:
            return output
        if paired:
            return output, tuple(ops.concatenate(c, axis=2) for c in zip(*new_caches))
        return output, ops.concatenate(new_caches, axis=3)

    def layout(self):
        """Per weight of the layer, in its order: the parts' weights joined along the axis
        where their shapes differ from the layer's (their heads); a norm's one variable
        that every part holds, and an output bias part 0 holds alone (axis None)."""
        bias = compat.output_projection(self.parts[0]).bias
        held = [list(part.weights) for part in self.parts]
        for weights in held[1:]:  # the other parts hold none: in its place, None
            if bias is not None:
                weights.insert(next(i for i, w in enumerate(held[0]) if w is bias), None)
        weights = []
        for i, shape in enumerate(self.weight_shapes):
            variables = [part_weights[i] for part_weights in held]
            if all(v is variables[0] or v is None for v in variables):
                weights.append((None, variables[:1]))
                continue
            axes = [a for a, size in enumerate(shape) if variables[0].shape[a] != size]
            if len(axes) != 1:
                raise ValueError(f"layer {self.name!r}: weight {variables[0].path} of shape "
                                 f"{shape} is not split along one heads axis.")
            weights.append((axes[0], variables))
        return weights

    def get_config(self):
        return {**super().get_config(), "attention_config": self.attention_config,
                "devices": self.devices, "part_class": self.part_class,
                "weight_shapes": self.weight_shapes, "head_dim": self.head_dim}
