"""The keras_hub attention classes "heads" splits by key/value groups (grouped.py), each
checked against its source (`_CLASSES`), and why it splits none of the others keras_hub
ships (`_WHY_NOT`): the one-line refusal split_layers gives, and auto's choice between
"heads" and the column/row split of the projections."""

import collections
import importlib

# The classes split this way, by module and name (naming keras_hub's classes here keeps
# it an optional extra), each checked against its source: its weights are its query, key,
# value and output projections and norms every head shares (below), its call(hidden_states
# or x, attention_mask, cache, cache_update_index, training) returns the output, and the
# cache (B, 2, S, kv_heads, head_dim) (or a (key, value) pair, each (B, S, kv_heads,
# head_dim)) where given. Per class, a Checked: its config, its head width and the
# sublayers the parts share.
Checked = collections.namedtuple(
    "Checked", ["names", "takes_head_dim", "shared", "heads_argument", "width_argument",
                "cache_arguments"],
    defaults=("num_query_heads", None, ("cache", "cache_update_index")))
Checked.__doc__ = """How a class of _CLASSES is split.

Attributes:
  names: the constructor arguments read from its attributes where its get_config is
    wrong or missing (LlamaAttention's reads an attribute it does not have; Qwen3's
    leaves out head_dim), else None: its config.
  takes_head_dim: whether it takes head_dim; a class that takes none computes it as
    hidden_dim // num_query_heads, so each part's projections are rebuilt for the
    layer's head width (compat.rebuild_for_head_dim).
  shared: the attributes of sublayers every head reads alike (a norm's scale of shape
    (head_dim,), a rotary embedding's frequencies): one sublayer, parts[0]'s, held by
    every part (compat.share_sublayers).
  heads_argument: its constructor's argument for the number of query heads.
  width_argument: None, or its constructor's argument for its output width from which
    it computes its head width (SmolLM3's hidden_size): a part is given its query
    heads' width there, and its output projection is rebuilt for the layer's width
    (compat.rebuild_output_width).
  cache_arguments: its call's names for the cache and the cache's update index.
"""
_LLAMA = ("num_query_heads", "num_key_value_heads", "rope_max_wavelength",
          "rope_position_scaling_factor", "rope_frequency_adjustment_factor",
          "rope_low_freq_factor", "rope_high_freq_factor", "rope_pretraining_sequence_length",
          "dropout")
_GEMMA = ("head_dim", "num_query_heads", "num_key_value_heads", "logit_soft_cap",
          "use_sliding_window_attention", "sliding_window_size", "query_head_dim_normalize",
          "dropout")
_QWEN3_NORMS = ("_query_dense_layer_norm", "_key_dense_layer_norm")
_CLASSES = {
    "keras_hub.src.models.mistral.mistral_attention.CachedMistralAttention":
        Checked(None, True, ()),
    # Mistral's with public attributes and head_dim always derived.
    "keras_hub.src.models.mixtral.mixtral_attention.CachedMixtralAttention":
        Checked(None, False, ()),
    "keras_hub.src.models.llama.llama_attention.LlamaAttention": Checked(_LLAMA, False, ()),
    # Its query, key and value biases (u, h) and (v, h) split with their heads; its
    # sliding window masks each head alike.
    "keras_hub.src.models.qwen.qwen_attention.QwenAttention": Checked(None, False, ()),
    # Qwen's with public projections.
    "keras_hub.src.models.qwen_moe.qwen_moe_attention.QwenMoeAttention":
        Checked(None, False, ()),
    # Qwen's without biases, with query and key RMS norms over each head's head_dim
    # entries, one scale every head reads; its sliding window masks each head alike.
    "keras_hub.src.models.qwen3.qwen3_attention.Qwen3Attention": Checked(
        ("num_query_heads", "num_key_value_heads", "rope_max_wavelength",
         "rope_scaling_factor", "dropout", "sliding_window_size", "layer_norm_epsilon"),
        True, _QWEN3_NORMS),
    "keras_hub.src.models.qwen3_moe.qwen3_moe_attention.Qwen3MoeAttention":
        Checked(None, True, _QWEN3_NORMS),
    # Dense projections (m, heads * head_dim) whose columns are head after head, its
    # output projection "bquh,uhm->bqm"; its rotary embedding's frequencies, set by its
    # head width, shared; whether a layer uses rope is its layer_idx's, alike per head.
    "keras_hub.src.models.smollm3.smollm3_layers.SmolLM3Attention": Checked(
        ("hidden_size", "num_attention_heads", "num_key_value_heads", "attention_bias",
         "attention_dropout", "rope_layer_enabled_list", "layer_types", "layer_idx",
         "max_position_embeddings", "rope_theta", "partial_rotary_factor"),
        False, ("rotary_embedding",), heads_argument="num_attention_heads",
        width_argument="hidden_size",
        cache_arguments=("self_attention_cache", "self_attention_cache_update_index")),
    # Mistral's with biases: its query, key and value biases split with their heads, its
    # output bias added once (part 0's; compat.drop_output_bias); its sinks, one logit
    # per query head (num_query_heads,), split with their heads; its YaRN rotary
    # embedding and sliding window act per head.
    "keras_hub.src.models.gpt_oss.gpt_oss_attention.GptOssAttention": Checked(None, True, ()),
    # Without rope scaling (below): its rotary embedding acts per head.
    "keras_hub.src.models.phi3.phi3_attention.Phi3Attention": Checked(None, False, ()),
    # Its config is Layer's only; its soft cap, sliding window and query scaling act per
    # head (the scale by hidden_dim // num_query_heads kept as the layer's:
    # compat.keep_query_scale), its projections "btd,ndh->btnh" hold the heads on the
    # kernel's first axis.
    "keras_hub.src.models.gemma.gemma_attention.CachedGemmaAttention":
        Checked(_GEMMA, True, ()),
    # Gemma's, with query and key RMS norms (one scale (head_dim,) each, every head's),
    # the rope wavelength and scaling of its layer (local or global), a bidirectional
    # sliding window, each per head alike; no config of its own either.
    "keras_hub.src.models.gemma3.gemma3_attention.CachedGemma3Attention": Checked(
        _GEMMA + ("use_query_key_norm", "layer_norm_epsilon", "rope_wavelength",
                  "rope_scaling_factor", "use_bidirectional_attention"),
        True, ("query_norm", "key_norm")),
}
# Per class name: (whether a layer of it is refused all the same, why).
_REFUSED_WHEN = {
    "Phi3Attention": (lambda layer: layer.rope_scaling_type is not None,
                      "with rope_scaling_type='su' its build checks the scaling factors "
                      "against hidden_dim // num_query_heads, which a part's fewer heads "
                      "would change"),
}
# Why the other attention classes keras_hub ships are not, by class name (each read in
# its source); auto splits their projections by "column"/"row" instead.
_WIDTH_FROM_ARGUMENT = ("it sets its head width to hidden_dim // num_heads from its own "
                        "hidden_dim argument, which is its output width too, so a part with "
                        "fewer heads would change one or the other")
_WHY_NOT = {
    "BloomAttention": "its ALiBi slopes are computed from each head's index among all "
                      "the layer's heads, which a part's fewer heads would renumber",
    "FalconAttention": "its call adds the ALiBi bias its decoder computes for all its heads "
                       "at once, (B, heads, 1, S), which a part's fewer heads cannot take",
    "GPTNeoXAttention": _WIDTH_FROM_ARGUMENT,
    "DisentangledSelfAttention": _WIDTH_FROM_ARGUMENT,  # DeBERTa-v3's
    "T5MultiHeadAttention": "its relative position bias, a (buckets, heads) table its first "
                            "layer owns, reaches every layer as one (1, heads, T, S) input "
                            "for all heads at once",
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
    # Their letters differ by class (Mistral's query "column:u", Gemma's "column:n",
    # SmolLM3's Dense "column"); auto finds each.
    projections = ("split its query, key and value projections by 'column' and its output "
                   "projection by 'row' along their heads letter instead (plan='auto' does)")
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


def checked(path):
    """The Checked of the class at `path` (module and name, a key of _CLASSES)."""
    return _CLASSES[path]


def class_named(path):
    """The class at `path`, its module and name."""
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)
