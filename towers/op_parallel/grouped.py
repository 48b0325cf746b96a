""""heads" for keras_hub's grouped-query attention classes (Mistral's, Llama's, Qwen's,
Phi-3's, Gemma's): the layer's key/value heads split by whole groups, each part an
instance of the layer's own class with fewer heads, on its own device; the parts' outputs
summed.

Grouped-query attention gives each key/value head a group of num_query_heads //
num_key_value_heads query heads, which read that head only. Part j holds key/value heads
[start_j, end_j) and the query heads of their groups: their query, key and value
projections, their rows of the output projection (`bquh,uhm->bqm`, summed over u), and
their slice (B, 2, S, kv_j, head_dim) of the cache. Each query head's attention reads its
own projections and its group's key and value only, rotary embeddings act per head, and
the output projection is a sum over heads, so the parts' outputs add up to the layer's.

A class is split only where building it with fewer heads changes nothing else: head_dim
is given (Mistral's and Gemma's config), or, for a class that computes it as
hidden_dim // num_query_heads (Llama's, Qwen's, Phi-3's), each part's projections are
rebuilt for the layer's head width; and every weight it has is a projection along the
heads (a weight shared by every head, as Qwen3's query and key norms, would be one per
part). `_CLASSES` lists those checked.
"""

import importlib
import inspect

import keras
import tensorflow as tf
from keras import ops

from towers import compat
from towers.op_parallel.layers import build_part, part_sizes, run_part

# The classes split this way, by module and name (naming keras_hub's classes here keeps
# it an optional extra), each checked against its source: its weights are its query, key,
# value and output projections (no norm shared by the heads), its call(hidden_states,
# attention_mask, cache, cache_update_index, training) returns the output, and the cache
# (B, 2, S, kv_heads, head_dim) where given. Per class: (the constructor arguments read
# from its attributes where its get_config is wrong (LlamaAttention's reads an attribute
# it does not have), else None: its config; whether it takes head_dim). A class that takes
# none computes it as hidden_dim // num_query_heads, so each part's projections are
# rebuilt for the layer's head width (compat.rebuild_for_head_dim).
_CLASSES = {
    "keras_hub.src.models.mistral.mistral_attention.CachedMistralAttention": (None, True),
    "keras_hub.src.models.llama.llama_attention.LlamaAttention": ((
        "num_query_heads", "num_key_value_heads", "rope_max_wavelength",
        "rope_position_scaling_factor", "rope_frequency_adjustment_factor",
        "rope_low_freq_factor", "rope_high_freq_factor", "rope_pretraining_sequence_length",
        "dropout"), False),
    # Its query, key and value biases (u, h) and (v, h) split with their heads; its
    # sliding window masks each head alike.
    "keras_hub.src.models.qwen.qwen_attention.QwenAttention": (None, False),
    # Without rope scaling (below): its rotary embedding acts per head.
    "keras_hub.src.models.phi3.phi3_attention.Phi3Attention": (None, False),
    # Its config is Layer's only; its soft cap, sliding window and query scaling act per
    # head, its projections "btd,ndh->btnh" hold the heads on the kernel's first axis.
    "keras_hub.src.models.gemma.gemma_attention.CachedGemmaAttention": ((
        "head_dim", "num_query_heads", "num_key_value_heads", "logit_soft_cap",
        "use_sliding_window_attention", "sliding_window_size", "query_head_dim_normalize",
        "dropout"), True),
}
# Per class name: (whether a layer of it is refused all the same, why).
_REFUSED_WHEN = {
    "Phi3Attention": (lambda layer: layer.rope_scaling_type is not None,
                      "with rope_scaling_type='su' its build checks the scaling factors "
                      "against hidden_dim // num_query_heads, which a part's fewer heads "
                      "would change"),
}
# Why the other attention classes keras_hub ships are not, by class name.
_WHY_NOT = {
    "Qwen3Attention": "its query and key norms are weights shared by every head, which "
                      "each part would hold and train apart",
}


def class_path(cls):
    return f"{cls.__module__}.{cls.__qualname__}"


def splits(layer):
    """Whether "heads" splits `layer` by key/value groups (its class is one of _CLASSES)."""
    return class_path(type(layer)) in _CLASSES


def refusal(layer, num_parts):
    """Why "heads" cannot split `layer` (a grouped-query attention layer, or another
    attention class) into `num_parts`, one line; None where it can."""
    name = type(layer).__name__
    projections = ("split its query by 'column:u', its key and value by 'column:v' and its "
                   "attention_output by 'row:u' instead (plan='auto' does)")
    if not splits(layer):
        why = _WHY_NOT.get(name, "it is not a class towers has checked a split by heads of")
        return f"{name} is not split by heads: {why}; {projections}"
    refused, why = _REFUSED_WHEN.get(name, (lambda layer: False, None))
    if refused(layer):
        return f"{name} is not split by heads: {why}; {projections}"
    kv_heads = key_value_heads(layer)
    if kv_heads < num_parts:
        return (f"{name} has {kv_heads} key/value heads, and each of {num_parts} parts needs "
                f"a whole group; give at most {kv_heads} devices, or {projections}")
    return None


def key_value_heads(layer):
    """How many key/value heads a class of _CLASSES has."""
    found = getattr(layer, "num_key_value_heads", None)  # CachedMistralAttention's is private
    return int(found if found is not None else layer.get_config()["num_key_value_heads"])


def _class_named(path):
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def form_of(layer, devices):
    """The GroupedHeadsAttention of `layer` (refusal(layer) None), not built."""
    names, takes_head_dim = _CLASSES[class_path(type(layer))]
    head_dim = int(layer.weights[0].shape[-1])  # the query kernel (m, u, h)
    if names is None:
        config = layer.get_config()
    else:
        config = {"name": layer.name, "trainable": layer.trainable,  # Layer's config
                  "dtype": keras.dtype_policies.serialize(layer.dtype_policy),
                  **{name: getattr(layer, name) for name in names},
                  "kernel_initializer": keras.initializers.serialize(
                      compat.kernel_initializer_of(layer))}
    if takes_head_dim:  # given, not recomputed from the part's fewer heads
        config["head_dim"] = head_dim
    return GroupedHeadsAttention(config, devices, class_path(type(layer)),
                                 [list(weight.shape) for weight in layer.weights],
                                 head_dim=None if takes_head_dim else head_dim)


class GroupedHeadsAttention(keras.layers.Layer):
    """A grouped-query attention layer with its key/value heads split by whole groups:
    part j (the layer's own class, with kv_j key/value heads and their groups' query
    heads) holds their projections and their rows of the output projection on
    devices[j] and computes their attention there; the parts' outputs are summed, a
    cache is split along its key/value heads axis into the parts and their updated
    caches joined. Each part draws its own dropout stream, as the layer's heads do."""

    def __init__(self, attention_config, devices, part_class, weight_shapes, head_dim=None,
                 **kwargs):
        """attention_config: the layer's constructor arguments (its get_config(), head_dim
        given where it takes one). part_class: its class's module and name. weight_shapes:
        the layer's weights' shapes, in order (each part's weights are joined along the
        axis where theirs differ). head_dim: the head width of a class that takes none
        (each part's projections rebuilt for it), else None."""
        super().__init__(name=attention_config["name"], dtype=attention_config.get("dtype"),
                         trainable=attention_config.get("trainable", True), **kwargs)
        self.attention_config, self.devices = dict(attention_config), list(devices)
        self.part_class, self.weight_shapes = part_class, [list(s) for s in weight_shapes]
        self.head_dim = head_dim
        kv_heads = attention_config["num_key_value_heads"]
        groups = attention_config["num_query_heads"] // kv_heads
        self.sizes = part_sizes(kv_heads, len(self.devices))  # key/value heads per part
        cls = _class_named(part_class)
        self.input_name = list(inspect.signature(cls.call).parameters)[1]  # x, hidden_states
        self.parts = [cls.from_config({
            **attention_config, "num_query_heads": size * groups,
            "num_key_value_heads": size, "name": f"part_{j}"})
            for j, size in enumerate(self.sizes)]

    def build(self, hidden_states_shape=None, **shapes):
        shape = hidden_states_shape or shapes.get("input_shape") or shapes.get("inputs_shape")
        for device, part in zip(self.devices, self.parts):
            build_part(part, device, shape)
            if self.head_dim is not None:
                compat.rebuild_for_head_dim(part, self.head_dim, shape, device)

    def call(self, hidden_states, attention_mask=None, cache=None, cache_update_index=None,
             training=None):
        """As the layer's call: -> its output (B, T, D), and the updated cache where one
        is given."""
        caches = ([None] * len(self.parts) if cache is None else
                  tf.split(cache, self.sizes, axis=3))  # (B, 2, S, kv_j, head_dim) each
        outputs, new_caches = [], []
        for j, (part, part_cache) in enumerate(zip(self.parts, caches)):
            inputs = {self.input_name: hidden_states}
            if part_cache is not None:
                inputs["cache"] = part_cache
            given = {name: value for name, value in (("cache_update_index", cache_update_index),
                                                     ("training", training))
                     if value is not None}  # else the class's defaults, as unsplit

            def work(inputs, part=part, given=given):
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
        return output, ops.concatenate(new_caches, axis=3)

    def layout(self):
        """Per weight of the layer, in its order: the parts' weights joined along the axis
        where their shapes differ from the layer's (their heads)."""
        weights = []
        for i, shape in enumerate(self.weight_shapes):
            variables = [part.weights[i] for part in self.parts]
            axes = [a for a, size in enumerate(shape) if variables[0].shape[a] != size]
            if len(variables) == 1:
                weights.append((None, variables))
                continue
            if len(axes) != 1:
                raise ValueError(f"layer {self.name!r}: weight {variables[0].path} of shape "
                                 f"{shape} is not split along one heads axis.")
            weights.append((axes[0], variables))
        return weights

    def get_config(self):
        return {**super().get_config(), "attention_config": self.attention_config,
                "devices": self.devices, "part_class": self.part_class,
                "weight_shapes": self.weight_shapes, "head_dim": self.head_dim}
