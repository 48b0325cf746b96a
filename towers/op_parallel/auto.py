"""plan="auto": Megatron's plan for a transformer, found by walking the model's layers.

The rules, each a plan entry split_layers already computes exactly:
- the token embedding (an Embedding named token_embedding, else the one with the most
  rows, position embeddings left out: ViT has none) by "vocab": a tied
  ReversibleEmbedding serves the look-up and the LM head;
- an attention layer by "heads" where HeadsAttention splits its class (Keras's
  MultiHeadAttention and the subclasses whose call it keeps, keras_hub's
  CachedMultiHeadAttention and Whisper's) or grouped_classes.py does (keras_hub's grouped-query
  attention: Mistral's, Mixtral's, Llama's, Qwen's, Qwen-MoE's, Qwen3's, Qwen3-MoE's,
  Phi-3's, Gemma's, Gemma 3's, SmolLM3's, GPT-OSS's, by key/value groups); another
  attention class (Falcon's, Bloom's, ...) has its query, key and value projections split by
  "column" along their heads letter and its output projection by "row" along it, its own
  attention core running on the joined heads (Bloom's, Falcon's, T5's, Whisper's, DeBERTa's:
  a block whose class says attention but holds one, DeBERTa's encoder layer, is a block);
  without those four projections it stays whole;
- each feed-forward pair inside a transformer block (a parent holding an attention
  layer, or its child): the layers widening the width D to F ("column"; a gate too),
  then the one narrowing F back to D ("row");
- an untied LM head (a Dense or EinsumDense whose output units are the vocabulary) by
  "column".
Where the model's backbone defines get_layout_map (Llama's, Qwen's, Gemma's, ...), each
weight that map shards is split as it shards it (auto_layouts.py).
A layer with fewer units than parts, or that split_layers would refuse (a subclass with
its own call, LoRA, a constraint across the split), stays whole. Paths that differ only in
keras_hub's numbering ("transformer_layer_0", "_1") become one key with a wildcard
("transformer_layer_*") where that key names exactly those layers. Each rule is logged on
one line.
"""

import collections
import re

import keras
from absl import logging

from towers import layer_paths
from towers.op_parallel import grouped_classes, paths, plan as plan_lib
from towers.op_parallel.dense import equation_of, split_axes, split_kind

_DENSE = (keras.layers.Dense, keras.layers.EinsumDense)
# An attention layer's own projections, by the names keras_hub and Keras give them.
PROJECTIONS = {"query": ("query", "q", "q_proj", "query_dense", "query_projector"),
                "key": ("key", "k", "k_proj", "key_dense", "key_projector"),
                "value": ("value", "v", "v_proj", "value_dense", "value_projector"),
                "output": ("attention_output", "output", "o", "o_proj", "out_proj",
                           "output_dense", "output_projector")}

Entry = collections.namedtuple("Entry", ["path", "layer", "how", "rule"])
Entry.__doc__ = """One layer of the auto plan: its path, the layer, how it is split, and
the rule that chose it (said in the log)."""


def auto_plan(model, num_parts=None):
    """{layer path: how}, Megatron's plan for `model` (the module's rules), for
    split_layers(model, plan, devices); logged one line per rule.

    Args:
      model: a built keras.Model.
      num_parts: the number of devices it will be split over; a layer with fewer units
        than that stays whole (None: no layer is left whole for its size).

    Raises:
      ValueError: one line: not a built keras.Model, or nothing the rules split.
    """
    if not isinstance(model, keras.Model) or not model.built:
        raise ValueError(f"auto_plan needs a built keras.Model (call it on a batch first), "
                         f"got {type(model).__name__} {getattr(model, 'name', '')!r}.")
    checker = _Checker(num_parts)
    layers = layer_paths.walk(model)
    entries, vocabulary = _token_embedding(layers, checker)
    attentions, attention_paths = _attention(layers, checker)
    entries += attentions
    entries += _feedforward(layers, attention_paths, checker)
    entries += _lm_head(layers, vocabulary, [e.path for e in entries] + attention_paths,
                        checker)
    from towers.op_parallel import auto_layouts  # it builds on this module's rules
    entries, followed = auto_layouts.follow(model, layers, entries, num_parts, checker)
    if not entries:
        raise ValueError(f"plan='auto' finds nothing to split in model {model.name!r}: no token "
                         "Embedding, attention layer, feed-forward pair or LM head it splits "
                         f"exactly{checker.said()}; give split_layers a plan of your own.")
    plan = {}
    if followed:
        logging.info("plan='auto': %s", followed)
    for key, group in _keys(model, entries):
        plan[key] = group[0].how
        logging.info("plan='auto': %r -> %r: %s (%d layer%s).", key, group[0].how,
                     group[0].rule, len(group), "" if len(group) == 1 else "s")
    for line in checker.whole:
        logging.info("plan='auto': %s", line)
    return plan


class _Checker:
    """Whether split_layers would split a layer as a rule asks (plan.check_layer: its
    type, its own call, LoRA, constraints, at least one unit per part); what it refuses
    stays whole, said in `whole`."""

    def __init__(self, num_parts):
        self.num_parts, self.whole = num_parts, []

    def fits(self, path, layer, how):
        refused = self.refusal(path, layer, how)
        if refused is not None:
            self.whole.append(f"{path!r} stays whole: {refused}")
        return refused is None

    def refusal(self, path, layer, how):
        """Why split_layers would refuse plan[path] = how, or None."""
        try:
            plan_lib.check_layer(path, layer, how, [None] * (self.num_parts or 1))
        except ValueError as error:
            return paths.first_line(error).rstrip(".")
        return None

    def said(self):
        return f" ({self.whole[0]})" if self.whole else ""


def _token_embedding(layers, checker):
    """([its entry, if it splits], the vocabulary size: its rows; None: no token
    embedding found)."""
    embeddings = [(path, layer) for path, layer, _ in layers
                  if isinstance(layer, keras.layers.Embedding) and "position" not in layer.name]
    named = [(p, layer) for p, layer in embeddings if layer.name == "token_embedding"]
    if not named and embeddings:
        most = max(layer.input_dim for _, layer in embeddings)
        named = [(p, layer) for p, layer in embeddings if layer.input_dim == most]
    if len(named) != 1:  # none, or several of the most rows: which one is the vocabulary?
        return [], None
    path, layer = named[0]
    tied = isinstance(layer, keras.layers.ReversibleEmbedding) and layer.tie_weights
    rule = "the token embedding by vocabulary rows" + (
        " (tied: its reverse projection, an LM head, too)" if tied else "")
    fits = checker.fits(path, layer, "vocab")
    return ([Entry(path, layer, "vocab", rule)] if fits else []), layer.input_dim


def _attention(layers, checker):
    """(entries for each attention layer: "heads", else its four projections; the
    attention layers' paths)."""
    entries, done = [], []
    for path, layer, _ in layers:
        if any(path.startswith(d + "/") for d in done):
            continue
        if isinstance(layer, keras.layers.MultiHeadAttention):
            refused = checker.refusal(path, layer, "heads")
            if refused is None:
                entries.append(Entry(path, layer, "heads", f"{type(layer).__name__} by heads"))
                done.append(path)
                continue
            checker.whole.append(f"{path!r} is not split by heads ({refused}); its "
                                 "projections are split where they can be.")
        elif not _says_attention(layer) or any(
                isinstance(sub, keras.layers.MultiHeadAttention) or _says_attention(sub)
                for _, sub, _ in layer_paths.walk(layer)):
            continue  # not an attention layer, or a block holding one (DeBERTa's encoder)
        elif grouped_classes.splits(layer):  # grouped-query attention split by key/value groups
            done.append(path)
            refused = checker.refusal(path, layer, "heads")
            if refused is None:
                entries.append(Entry(path, layer, "heads", f"{type(layer).__name__} by "
                                     "key/value groups with their query heads"))
                continue
            checker.whole.append(f"{path!r} is not split by heads ({refused}); its "
                                 "projections are split where they can be.")
            entries += _projections(path, layer, checker)
            continue
        done.append(path)
        entries += _projections(path, layer, checker)
    return entries, done


def _says_attention(layer):
    return "attention" in type(layer).__name__.lower()


def _projections(path, layer, checker):
    """The query, key and value projections by "column" along their heads letter and the
    output projection by "row" along it; none where one of the four is missing."""
    found = {}
    for sub_path, sublayer, _ in layer_paths.walk(layer):
        if "/" not in sub_path and isinstance(sublayer, _DENSE):
            for role, names in PROJECTIONS.items():
                if sublayer.name in names:
                    found.setdefault(role, sublayer)
    if len(found) < 4:
        checker.whole.append(f"{path!r} stays whole: {type(layer).__name__} is not split by "
                             "heads and has no query, key, value and output projections "
                             f"(found {sorted(found)}).")
        return []
    entries = []
    for role, sublayer in found.items():
        kind = "row" if role == "output" else "column"
        sub = f"{path}/{sublayer.name}"
        how = heads_split(sublayer, kind)
        if checker.fits(sub, sublayer, how):
            entries.append(Entry(sub, sublayer, how, f"{type(layer).__name__}'s {role} "
                                 "projection by heads (its attention core runs on the "
                                 "joined heads)"))
    return entries


def heads_split(layer, kind):
    """A column (row) split along the heads letter of a projection's equation: the first
    of its output-only (contracted) letters ("bqm,muh->bquh": "column:u"); a Dense's
    plain kind."""
    if isinstance(layer, keras.layers.Dense):
        return kind
    equation = re.sub(r"\.\.\.|\s", "", layer.equation)
    inputs, kernel, outputs = equation.replace("->", ",").split(",")
    spec, other = (outputs, inputs) if kind == "column" else (inputs, outputs)
    letters = [c for c in spec if c in kernel and c not in other]
    return kind if len(letters) < 2 else f"{kind}:{letters[0]}"


def _units(layer, how):
    """The number of units a split `how` of a Dense or EinsumDense divides (0: none)."""
    try:
        return int(layer.kernel.shape[kernel_axis(layer, how)])
    except ValueError:
        return 0


def kernel_axis(layer, how):
    """The kernel axis a split `how` of a Dense or EinsumDense divides."""
    return split_axes(*equation_of(layer), *split_kind(how)).kernel_axis


def _feedforward(layers, attention_paths, checker):
    """Per transformer block (an attention layer's parent)'s feed-forward: the widening
    layers by "column", the narrowing one by "row"."""
    blocks = {_parent(path) for path in attention_paths}
    inside = attention_paths
    by_parent = collections.defaultdict(list)
    for path, layer, _ in layers:
        if isinstance(layer, _DENSE) and not any(path.startswith(a + "/") for a in inside):
            parent = _parent(path)
            if parent in blocks or _parent(parent) in blocks:
                by_parent[parent].append((path, layer))
    entries = []
    for parent, denses in by_parent.items():
        sizes = [(path, layer, _units(layer, "row"), _units(layer, "column"))
                 for path, layer in denses]
        for down_path, down, inner, width in sizes:
            ups = [(p, layer) for p, layer, i, o in sizes if (i, o) == (width, inner)]
            if not ups or inner <= width:  # a feed-forward widens, then narrows
                continue
            pair = [(p, layer, "column") for p, layer in ups] + [(down_path, down, "row")]
            if all(checker.fits(p, layer, how) for p, layer, how in pair):
                names = " and ".join(layer.name for _, layer, _ in pair[:-1])
                entries += [Entry(p, layer, how, f"the feed-forward {names} ({width} -> "
                                  f"{inner}) then {down.name} ({inner} -> {width})")
                            for p, layer, how in pair]
        if len(denses) > 1 and not any(_parent(e.path) == parent for e in entries):
            checker.whole.append(
                f"{parent!r}'s {', '.join(layer.name for _, layer in denses)} stay whole: no "
                "feed-forward pair (layers widening the width D to F > D, then one "
                "narrowing F back to D).")
    return entries


def _lm_head(layers, vocabulary, taken, checker):
    """An untied LM head: a Dense or EinsumDense to the vocabulary, by "column", outside
    the layers `taken` (paths: those split, the attention layers)."""
    if vocabulary is None:
        return []
    heads = [(path, layer) for path, layer, _ in layers
             if isinstance(layer, _DENSE) and path not in taken
             and not any(path.startswith(p + "/") for p in taken)
             and _units(layer, "column") == vocabulary]
    return [Entry(path, layer, "column", "the LM head by vocabulary columns")
            for path, layer in heads if checker.fits(path, layer, "column")]


def _parent(path):
    return path.rpartition("/")[0]


def _keys(model, entries):
    """[(plan key, its entries)]: entries with the same how and rule whose paths differ
    only in the numbers ending some levels ("transformer_layer_0", "_1") under one key,
    each such level a wildcard ("transformer_layer_*"), where that key names exactly
    their layers; else each under its own path."""
    groups = collections.OrderedDict()
    for entry in entries:
        pattern = "/".join(re.sub(r"_\d+$", "_*", level) for level in entry.path.split("/"))
        groups.setdefault((pattern, entry.how, entry.rule), []).append(entry)
    keyed = []
    for (pattern, how, _), group in groups.items():
        levels = zip(pattern.split("/"), *(entry.path.split("/") for entry in group))
        key = "/".join(names[1] if len(set(names[1:])) == 1 else names[0] for names in levels)
        if len(group) > 1 and _names_exactly(model, key, how, group):
            keyed.append((key, group))
        else:
            keyed += [(entry.path, [entry]) for entry in group]
    return keyed


def _names_exactly(model, key, how, group):
    """Whether plan key `key` names exactly the layers of `group` in `model`."""
    targets = paths.resolve(model, {key: how})
    return sorted(t.path for t in targets) == sorted(e.path for e in group)
