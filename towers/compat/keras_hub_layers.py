"""keras_hub layers' private attributes: an attention layer's projections rebuilt for a
head width its class computes itself, its norms shared by the parts of a heads split,
its query scale kept as the unsplit layer's."""

import math

import keras
import tensorflow as tf

from towers.compat.keras_layers import drop_weight, replace_sublayer

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


def rebuild_output_width(attention, width, device):
    """Rebuilds a part's output projection, SmolLM3Attention's `o_proj`
    ("bquh,uhm->bqm"), to map its heads to `width` units (the unsplit layer's), on
    `device` under the layer's name, in its place.

    Public alternative: none: the class takes its output width and its head width
    from one argument, hidden_size (head_dim = hidden_size // num_attention_heads), so
    a part with fewer heads and the layer's head width is made narrower, and its
    output projection with it.
    """
    old = attention.o_proj
    config = old.get_config()
    config["output_shape"] = (*config["output_shape"][:-1], width)
    new = keras.layers.EinsumDense.from_config(config)
    with tf.device(device), keras.name_scope(attention.name):
        new.build((None, None, *old.kernel.shape[:-1]))  # (B, T, heads, head_dim)
    replace_sublayer(attention, old, new)


def output_projection(attention):
    """A keras_hub attention layer's output projection, its heads first in its kernel
    (heads, head_dim, width): `_output_dense` (Mistral's, Llama's, Qwen's, Qwen3's),
    `output_dense` (Mixtral's, Qwen-MoE's, Phi-3's, Gemma's, GPT-OSS's) or `o_proj`
    (SmolLM3's).

    Public alternative: none for the classes that keep it private.
    """
    return next(getattr(attention, name) for name in ("_output_dense", "output_dense", "o_proj")
                if getattr(attention, name, None) is not None)


def drop_output_bias(attention):
    """Drops the bias of a part's output projection (GPT-OSS's), where it has one: the
    parts' outputs are summed, so the bias is added once, by part 0's.

    Public alternative: none (compat.drop_weight).
    """
    projection = output_projection(attention)
    if projection.bias is not None:
        drop_weight(projection, "bias")


def kernel_initializer_of(attention):
    """A keras_hub attention layer's kernel initializer: its `kernel_initializer`, or
    CachedGemmaAttention's `_kernel_initializer`.

    Public alternative: get_config()'s, which CachedGemmaAttention does not define.
    """
    found = getattr(attention, "kernel_initializer", None)
    return found if found is not None else attention._kernel_initializer


def share_sublayers(parts, names):
    """Makes every part of a heads split hold parts[0]'s sublayer at each attribute of
    `names` it has (Qwen3Attention's `_query_dense_layer_norm`, CachedGemma3Attention's
    `query_norm`), in the place of its own: a norm whose scale, shape (head_dim,), every
    head reads. One variable then, on parts[0]'s device, that each part reads and whose
    gradient the tape sums over the parts, as over the heads of the unsplit layer.

    Public alternative: none: the class builds its norms itself, in build, under
    attributes its call reads (keras_hub's own for Qwen3's are private).
    """
    for name in names:
        shared = getattr(parts[0], name, None)
        if shared is None:  # CachedGemma3Attention without use_query_key_norm
            continue
        for part in parts[1:]:
            replace_sublayer(part, getattr(part, name), shared)


def keep_query_scale(attention, whole_head_width):
    """Makes a built part of CachedGemmaAttention or CachedGemma3Attention with
    query_head_dim_normalize=False scale its queries by 1 / sqrt(whole_head_width), the
    unsplit layer's hidden_dim // num_query_heads, rather than by its own fewer heads'
    (any other layer is left as it is).

    Public alternative: none: the class computes the scale in call from `hidden_dim`,
    which build sets to the input's width; it reads `hidden_dim` nowhere else after build.
    """
    if getattr(attention, "query_head_dim_normalize", True) is False:
        attention.hidden_dim = whole_head_width * attention.num_query_heads
