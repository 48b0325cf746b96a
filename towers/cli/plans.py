"""The op-parallel plans of the command line: --split_plan parsed, and the built-in
models' defaults for --num_parts (towers.split_layers takes either)."""

from keras import layers


def parse(items):
    """["LAYER:KIND", ...] -> {layer: kind}, KIND column, row, vocab, heads or a part index;
    column and row may name the equation letter to split along ("attention_output:row:u":
    parsed at the first colon)."""
    plan = {}
    for item in items:
        name, _, how = item.partition(":")
        if not name or not how:
            raise ValueError(f"{item!r} is not LAYER:KIND (KIND column, row, vocab, heads or a "
                             "part index; column:LETTER or row:LETTER split along that letter).")
        if name in plan:
            raise ValueError(f"names layer {name!r} twice ({name}:{plan[name]} and {item}); "
                             "give each layer one kind.")
        plan[name] = int(how) if how.isdigit() else how
    return plan


def default(model, name):
    """The op-parallel plan --num_parts uses for built-in model `name`: the mlp's
    hidden Dense layers as a column -> row pair, the text model's table split by rows."""
    if name == "mlp":
        hidden = [layer.name for layer in model.layers
                  if isinstance(layer, layers.Dense) and layer.name != "logits"]
        return {hidden[0]: "column", hidden[1]: "row"}
    if name == "text":
        return {"embedding": "vocab"}
    raise ValueError(f"model {name!r} has no default split plan (convolution channels are not "
                     "split yet); name its layers with --split_plan=LAYER:KIND,...")
