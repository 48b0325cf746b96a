"""Op parallelism: bytes of variables and optimizer slots per device, and step time,
of a transformer block split into T parts, against the unsplit block.

    python benchmarks/op_parallel.py --parts=1,2,4 --output_dir=DIR

The block's embedding is split by rows (vocab), its attention by heads, its
feed-forward pair as column -> row (towers.split_layers), part j on device j;
one tower, Adam. Then keras_hub's GPT-2 (--hub_* sizes, random weights) split
at the same T by a plan of layer paths, with the bytes each step moves;
keras_hub's Mistral (--gqa_* sizes), its grouped-query attention split by whole
key/value groups ("heads") and by its projections (column/row, the attention core on
the tower) at each T in --gqa_parts, bytes moved next to the formula and step time
against the unsplit model; a
vocab-split LM head's loss (--vocab_loss_*), its logits gathered on the tower
or kept split (Megatron's vocab-parallel cross-entropy), bytes and time; and the
--embedding_rows embedding step, looked up where the table lives, on 1 and
--embedding_towers towers, against plain Keras on one device and against
copying the table to every tower. Writes DIR/results.json and DIR/results.md.
The work is in benchmarks/harness/op_parallel.py, grouped_heads.py and
vocab_loss.py; this file
only reads the flags.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow loads
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

import towers  # noqa: E402
from benchmarks.harness import op_parallel  # noqa: E402

PARTS = flags.DEFINE_list("parts", ["1", "2", "4"], "Part counts T; 1 is the unsplit block.")
VOCAB = flags.DEFINE_integer("vocab", 20000, "Embedding rows.", lower_bound=1)
WIDTH = flags.DEFINE_integer("width", 64, "Embedding width (divisible by --heads).",
                             lower_bound=1)
HEADS = flags.DEFINE_integer("heads", 4, "Attention heads.", lower_bound=1)
HIDDEN = flags.DEFINE_integer("hidden", 256, "Feed-forward hidden width.", lower_bound=1)
GLOBAL_BATCH_SIZE = flags.DEFINE_integer("global_batch_size", 64, "Sequences per step.",
                                         lower_bound=1)
STEPS = flags.DEFINE_integer("steps", 50, "Timed steps per T.", lower_bound=1)
ROUNDS = flags.DEFINE_integer("rounds", 5, "Interleaved rounds.", lower_bound=1)
EMBEDDING_ROWS = flags.DEFINE_integer("embedding_rows", 1_000_000,
                                      "Rows of the embedding step's table; 0 skips it.",
                                      lower_bound=0)
EMBEDDING_TOWERS = flags.DEFINE_integer("embedding_towers", 4, "Towers of the embedding step.",
                                        lower_bound=1)
HUB_LAYERS = flags.DEFINE_integer("hub_layers", 2, "Transformer blocks of keras_hub's GPT-2; "
                                  "0 skips it.", lower_bound=0)
HUB_VOCAB = flags.DEFINE_integer("hub_vocab", 8192, "GPT-2's vocabulary.", lower_bound=1)
HUB_HEADS = flags.DEFINE_integer("hub_heads", 4, "GPT-2's attention heads.", lower_bound=1)
HUB_WIDTH = flags.DEFINE_integer("hub_width", 128, "GPT-2's hidden width (divisible by "
                                 "--hub_heads).", lower_bound=1)
HUB_INTERMEDIATE = flags.DEFINE_integer("hub_intermediate", 512, "GPT-2's feed-forward width.",
                                        lower_bound=1)
HUB_LENGTH = flags.DEFINE_integer("hub_length", 64, "GPT-2's tokens per sequence.",
                                  lower_bound=1)
HUB_BATCH_SIZE = flags.DEFINE_integer("hub_batch_size", 8, "GPT-2's sequences per step.",
                                      lower_bound=1)
GQA_LAYERS = flags.DEFINE_integer("gqa_layers", 2, "Layers of keras_hub's Mistral (grouped-"
                                  "query attention); 0 skips it.", lower_bound=0)
GQA_PARTS = flags.DEFINE_list("gqa_parts", ["2"], "Part counts T of Mistral's attention, each "
                              "at most --gqa_kv_heads (a part takes whole key/value groups).")
GQA_VOCAB = flags.DEFINE_integer("gqa_vocab", 8192, "Mistral's vocabulary.", lower_bound=1)
GQA_QUERY_HEADS = flags.DEFINE_integer("gqa_query_heads", 8, "Mistral's query heads.",
                                       lower_bound=1)
GQA_KV_HEADS = flags.DEFINE_integer("gqa_kv_heads", 2, "Mistral's key/value heads (divides "
                                    "--gqa_query_heads).", lower_bound=1)
GQA_WIDTH = flags.DEFINE_integer("gqa_width", 128, "Mistral's hidden width (divisible by "
                                 "--gqa_query_heads).", lower_bound=1)
GQA_INTERMEDIATE = flags.DEFINE_integer("gqa_intermediate", 512, "Mistral's feed-forward "
                                        "width.", lower_bound=1)
GQA_LENGTH = flags.DEFINE_integer("gqa_length", 64, "Mistral's tokens per sequence.",
                                  lower_bound=1)
GQA_BATCH_SIZE = flags.DEFINE_integer("gqa_batch_size", 8, "Mistral's sequences per step.",
                                      lower_bound=1)
VOCAB_LOSS_VOCABS = flags.DEFINE_list("vocab_loss_vocabs", ["8192", "32768"],
                                      "Vocabularies V of the LM head's loss; empty skips it.")
VOCAB_LOSS_PARTS = flags.DEFINE_list("vocab_loss_parts", ["2", "4"],
                                     "Part counts T of the LM head's table.")
VOCAB_LOSS_TOKENS = flags.DEFINE_integer("vocab_loss_tokens", 1024,
                                         "Tokens (B x S) of the LM head's loss.", lower_bound=1)
VOCAB_LOSS_WIDTH = flags.DEFINE_integer("vocab_loss_width", 128,
                                        "Hidden width D of the LM head.", lower_bound=1)
VOCAB_LOSS_STEPS = flags.DEFINE_integer("vocab_loss_steps", 10,
                                        "Timed steps per way, V and T of the LM head's loss.",
                                        lower_bound=1)
OUTPUT_DIR = flags.DEFINE_string("output_dir", "benchmarks/results/op_parallel",
                                 "Where results.json and results.md go.")


def _positive_ints(values):
    """Whether every comma-separated value is an integer >= 1."""
    return all(value.isdigit() and int(value) >= 1 for value in values)


flags.register_validator("vocab_loss_vocabs", _positive_ints,
                         "must be comma-separated positive integers, e.g. 8192,32768")
flags.register_validator("vocab_loss_parts", lambda v: bool(v) and _positive_ints(v),
                         "must be comma-separated positive integers, e.g. 2,4")
flags.register_validator("gqa_parts", lambda v: bool(v) and _positive_ints(v),
                         "must be comma-separated positive integers, e.g. 2,4")
flags.register_multi_flags_validator(
    ["gqa_layers", "gqa_parts", "gqa_query_heads", "gqa_kv_heads", "gqa_width"],
    lambda f: not f["gqa_layers"] or not _positive_ints(f["gqa_parts"]) or (
        f["gqa_width"] % f["gqa_query_heads"] == 0
        and f["gqa_query_heads"] % f["gqa_kv_heads"] == 0
        and 2 <= min(map(int, f["gqa_parts"])) and max(map(int, f["gqa_parts"]))
        <= f["gqa_kv_heads"]),
    "--gqa_width must be divisible by --gqa_query_heads, --gqa_query_heads by "
    "--gqa_kv_heads, and each of --gqa_parts be from 2 to --gqa_kv_heads")
flags.register_multi_flags_validator(
    ["hub_layers", "hub_width", "hub_heads"],
    lambda f: not f["hub_layers"] or f["hub_width"] % f["hub_heads"] == 0,
    "--hub_width must be divisible by --hub_heads (each head's width is their quotient)")


def main(argv):
    del argv
    parts = [int(p) for p in PARTS.value]
    vocab_loss_parts = [int(p) for p in VOCAB_LOSS_PARTS.value]
    gqa_parts = [int(p) for p in GQA_PARTS.value]
    devices = towers.configure_devices(max(parts + vocab_loss_parts + gqa_parts
                                           + [EMBEDDING_TOWERS.value]))
    hub = None
    if HUB_LAYERS.value:
        hub = {"vocab": HUB_VOCAB.value, "layers": HUB_LAYERS.value, "heads": HUB_HEADS.value,
               "width": HUB_WIDTH.value, "intermediate": HUB_INTERMEDIATE.value,
               "length": HUB_LENGTH.value, "global_batch_size": HUB_BATCH_SIZE.value}
    grouped_heads = None
    if GQA_LAYERS.value:
        grouped_heads = {"parts": gqa_parts, "vocab": GQA_VOCAB.value,
                         "layers": GQA_LAYERS.value, "query_heads": GQA_QUERY_HEADS.value,
                         "kv_heads": GQA_KV_HEADS.value, "width": GQA_WIDTH.value,
                         "intermediate": GQA_INTERMEDIATE.value, "length": GQA_LENGTH.value,
                         "global_batch_size": GQA_BATCH_SIZE.value}
    vocab_loss = None
    if VOCAB_LOSS_VOCABS.value:
        vocab_loss = {"vocabs": [int(v) for v in VOCAB_LOSS_VOCABS.value],
                      "parts": vocab_loss_parts, "tokens": VOCAB_LOSS_TOKENS.value,
                      "width": VOCAB_LOSS_WIDTH.value, "steps": VOCAB_LOSS_STEPS.value}
    results = op_parallel.run_op_parallel_benchmark(
        parts, devices, OUTPUT_DIR.value, vocab=VOCAB.value, width=WIDTH.value,
        heads=HEADS.value, hidden=HIDDEN.value, global_batch_size=GLOBAL_BATCH_SIZE.value,
        steps=STEPS.value, rounds=ROUNDS.value, embedding_rows=EMBEDDING_ROWS.value,
        embedding_towers=EMBEDDING_TOWERS.value, hub=hub, grouped_heads=grouped_heads,
        vocab_loss=vocab_loss)
    print(op_parallel.markdown(results))


if __name__ == "__main__":
    app.run(main)
