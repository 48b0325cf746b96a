"""run_grouped_heads_benchmark: keras_hub's MistralCausalLM, grouped-query attention
(more query heads than key/value heads), its attention split into T parts two ways,
against the unsplit model, timed interleaved in one run (op_parallel.run_plans), with
the bytes each step moves between devices measured (transfers.py) next to the formula:

- "heads": each attention layer by whole key/value groups (towers/op_parallel/
  grouped.py), each part the layer's own class on its heads;
- "projections": its query, key and value by "column" along their heads letter and its
  output by "row" along it, what plan="auto" does for an attention class it does not
  split by heads: the attention core (rotary embedding, the groups' repeat, softmax)
  runs whole on the tower, on the joined heads.

Only the attention layers are split (the token embedding and feed-forward stay on the
tower), so what moves is theirs, and Adam's scalars (op_parallel.ADAM_BYTES_PER_VARIABLE).
"""

import keras

from benchmarks.harness import op_parallel, split_bytes
from towers.op_parallel import layers as op_layers

ATTENTION = "mistral_backbone/transformer_layer_*/self_attention"
PLANS = {
    "heads": {ATTENTION: "heads"},
    # CachedMistralAttention's equations: query "bqm,muh->bquh", key and value
    # "bkm,mvh->bkvh", output "bquh,uhm->bqm"; their heads letters u and v.
    "projections": {f"{ATTENTION}/query": "column:u", f"{ATTENTION}/key": "column:v",
                    f"{ATTENTION}/value": "column:v", f"{ATTENTION}/attention_output": "row:u"},
}


def mistral(vocab, layers, query_heads, kv_heads, width, intermediate, seed=0):
    """keras_hub's MistralCausalLM(MistralBackbone(...), preprocessor=None), random weights
    (nothing is downloaded), dropout 0: {"token_ids", "padding_mask"} (B, length) -> logits
    (B, length, vocab); query heads width // query_heads wide, in groups of
    query_heads // kv_heads per key/value head."""
    import keras_hub  # pylint: disable=g-import-not-at-top  (an extra; only this needs it)
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.MistralBackbone(
        vocabulary_size=vocab, num_layers=layers, num_query_heads=query_heads,
        num_key_value_heads=kv_heads, hidden_dim=width, intermediate_dim=intermediate,
        dropout=0.0, name="mistral_backbone")  # named, so that PLANS' paths find it
    return keras_hub.models.MistralCausalLM(backbone, preprocessor=None)


def formula_bytes(plan_name, num_parts, *, global_batch_size, length, layers, query_heads,
                  kv_heads, width, variables_elsewhere):
    """Bytes one step of mistral() with PLANS[plan_name] on T parts moves between the tower
    (part 0's device) and parts 1..T-1, R = B x S tokens, D = width, h = D / query heads;
    part j holds u_j query and v_j key/value heads (op_layers.part_sizes), floats and ids
    of 4 bytes:

    - "heads", per layer: per other part the hidden states (R, D) out and the partial
      output (R, D) back, and both gradients, 4 x 2 x R x (T-1) x 2D (split_bytes's
      "heads", as for MultiHeadAttention); once per step, the attention mask (B, S, S)
      int32 to each other part (the layers' masks are one tensor, sent once).
    - "projections", per layer and other part: the hidden states out once (the three
      column splits read the same tensor) and the gradient of each of the three back
      (the tower adds them), 4D per token; its query, key and value heads back and their
      gradients out, (u_j + 2 v_j) h both ways; the output row's slice of the heads out
      and its gradient back, u_j h both ways; its partial output back and its gradient
      out, 2D: 4 x R x (6D + 4 (u_j + v_j) h).

    Plus Adam's scalars to each variable on another part."""
    if num_parts == 1:
        return 0
    tokens, others = global_batch_size * length, num_parts - 1
    adam = op_parallel.ADAM_BYTES_PER_VARIABLE * variables_elsewhere
    if plan_name == "heads":
        mask = split_bytes.INT * others * global_batch_size * length * length
        return adam + mask + layers * split_bytes.formula_bytes("heads", num_parts, tokens,
                                                                width, width)
    head = width // query_heads
    query_elsewhere = query_heads - op_layers.part_sizes(query_heads, num_parts)[0]
    kv_elsewhere = kv_heads - op_layers.part_sizes(kv_heads, num_parts)[0]
    return adam + layers * split_bytes.FLOAT * tokens * (
        6 * width * others + 4 * (query_elsewhere + kv_elsewhere) * head)


def run_grouped_heads_benchmark(parts, devices, *, vocab=8192, layers=2, query_heads=8,
                                kv_heads=2, width=128, intermediate=512, length=64,
                                global_batch_size=8, steps=50, rounds=5, seed=0):
    """mistral() unsplit, and for every T in `parts` (2 <= T <= kv_heads) split by each of
    PLANS on devices[:T], all timed interleaved (op_parallel.run_plans) on a batch of
    global_batch_size x length random ids labelled with the next ids; each row's bytes
    moved per step measured and by formula_bytes. Returns {"config", "rows"}, the rows
    {"plan": "unsplit" or a PLANS name, ...run_plans' row, "formula"}."""
    if not parts or min(parts) < 2 or max(parts) > kv_heads:
        raise ValueError(f"parts must be part counts T with 2 <= T <= kv_heads ({kv_heads}): "
                         f"each part takes whole key/value groups; got {list(parts)}.")
    if width % query_heads or query_heads % kv_heads:
        raise ValueError(f"width {width} must be divisible by query_heads {query_heads}, "
                         f"and query_heads by kv_heads {kv_heads}.")
    _, batch = op_parallel.lm_batch(vocab, global_batch_size, length, seed)
    sizes = {"vocab": vocab, "layers": layers, "query_heads": query_heads,
             "kv_heads": kv_heads, "width": width, "intermediate": intermediate}
    names = ["unsplit"] + [name for _ in parts for name in PLANS]
    splits = [(1, {})] + [(num_parts, plan) for num_parts in parts for plan in PLANS.values()]
    rows = op_parallel.run_plans(lambda: mistral(**sizes, seed=seed), splits, batch, devices,
                                 steps=steps, rounds=rounds, seed=seed, bytes_moved=True)
    for name, row in zip(names, rows):
        row["plan"] = name
        row["formula"] = formula_bytes(
            name, row["parts"], global_batch_size=global_batch_size, length=length,
            layers=layers, query_heads=query_heads, kv_heads=kv_heads, width=width,
            variables_elsewhere=row["variables_elsewhere"])
    return {"config": {**sizes, "length": length, "global_batch_size": global_batch_size,
                       "plans": PLANS,
                       "steps": steps, "rounds": rounds},
            "rows": rows}


def markdown(results):
    """The results as a Markdown section (a list of lines)."""
    config = results["config"]
    lines = ["", "## Grouped-query attention split by heads, and by its projections",
             "",
             f"MistralCausalLM (random weights, dropout 0): vocabulary {config['vocab']}, "
             f"{config['layers']} layers of {config['query_heads']} query heads over "
             f"{config['kv_heads']} key/value heads, hidden {config['width']}, feed-forward "
             f"{config['intermediate']}; batch {config['global_batch_size']} x "
             f"{config['length']} tokens, next-token cross-entropy, Adam, one tower; only "
             "the attention split. heads: by whole key/value groups; projections: query, "
             "key, value by column and output by row along the heads (the attention core "
             f"whole on the tower). Medians of {config['steps']} steps in {config['rounds']} "
             "interleaved rounds; bytes moved per step (forward, backward, update) measured "
             "as TensorFlow sent them, next to the formula (grouped_heads.formula_bytes).",
             "",
             "| plan | T | step ms | x unsplit | measured KiB | formula KiB "
             "| measured KiB per attention layer | x heads' bytes |",
             "|---|--:|--:|--:|--:|--:|--:|--:|"]
    heads = {row["parts"]: row["moved"] for row in results["rows"] if row["plan"] == "heads"}
    for row in results["rows"]:
        ratio = row["moved"] / heads[row["parts"]] if row["parts"] in heads else None
        lines.append(
            f"| {row['plan']} | {row['parts']} | {row['median_ms']:.2f} ± "
            f"{row['uncertainty_ms'] or 0:.2f} | {row['x_unsplit']:.2f} "
            f"| {row['moved'] / 1024:.1f} | {row['formula'] / 1024:.1f} "
            f"| {row['moved'] / config['layers'] / 1024:.1f} "
            f"| {'–' if ratio is None else f'{ratio:.2f}'} |")
    return lines
