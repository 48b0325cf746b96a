"""keras_hub layers' private attributes: an attention layer's projections rebuilt for a
head width its class computes itself."""

import math

import keras
import tensorflow as tf

from towers.compat.keras_layers import replace_sublayer

# The projections of keras_hub's grouped-query attention classes, by attribute
# (LlamaAttention's and QwenAttention's private, Phi3Attention's public), each
# EinsumDense's heads letter last but one.
_PROJECTIONS = (("_query_dense", "query_dense"), ("_key_dense", "key_dense"),
                ("_value_dense", "value_dense"), ("_output_dense", "output_dense"))


def rebuild_for_head_dim(attention, head_dim, input_shape, device):
    """Rebuilds a built attention layer whose build derives its head width as
    hidden_dim // num_query_heads (LlamaAttention) for heads `head_dim` wide: its query,
    key and value projections (…, heads, head_dim) and its output projection from
    (…, num_query_heads, head_dim) anew, on `device` under the layer's name, in their
    places, and its scores' scale 1 / sqrt(head_dim).

    Public alternative: none: the class takes no head_dim, and building it for fewer
    query heads (a part of a heads split) would widen its heads.
    """
    for names in _PROJECTIONS:
        old = next(getattr(attention, name) for name in names if hasattr(attention, name))
        config = old.get_config()
        if names[0] == "_output_dense":
            shape = (None, None, attention.num_query_heads, head_dim)
        else:
            config["output_shape"] = (*config["output_shape"][:-1], head_dim)
            shape = input_shape
        new = keras.layers.EinsumDense.from_config(config)
        with tf.device(device), keras.name_scope(attention.name):
            new.build(shape)
        replace_sublayer(attention, old, new)
    attention._inv_norm_factor = 1.0 / math.sqrt(head_dim)


def kernel_initializer_of(attention):
    """A keras_hub attention layer's kernel initializer: its `kernel_initializer`, or
    CachedGemmaAttention's `_kernel_initializer`.

    Public alternative: get_config()'s, which CachedGemmaAttention does not define.
    """
    found = getattr(attention, "kernel_initializer", None)
    return found if found is not None else attention._kernel_initializer
