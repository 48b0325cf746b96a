"""benchmarks/first_step.py's work, without flags: how long a user waits for the first
step, each configuration in a fresh process (import, build, fit), and the tables.

A configuration is a model, a way of training it and a number of towers:

    keras     keras.Model.compile + fit on one device (no logical devices made)
    towers    TowerTrainer(...).fit on N towers (N x parts x stages logical CPU devices)
    mirrored  compile + fit under tf.distribute.MirroredStrategy on N logical devices

The models: the built-in mlp and cnn (towers.cli.models), a 2-block transformer
(`transformer`), the same split by split_layers(model, "auto", parts) on 2 parts per
tower (`split_transformer`), cut into 2 pipeline stages between its blocks
(`pipeline`), and both: 2 stages of 2 parts per tower (`split_pipeline`); the last three
only as towers, against the transformer's keras and mirrored rows.

The child reports wall-clock seconds since the parent launched it (`launched_at`), so
Python's start is counted: imported (TensorFlow and Keras), towers imported (every child
imports towers: the built-in models live there), built (model, optimizer, trainer or
compile), first step (fit's first on_train_batch_end), first epoch (the first fit's
end: `steps` steps of `batch_size`), and second fit (a second fit's seconds alone).
"""

import contextlib
import time

import numpy as np

from benchmarks.harness import child_process

MODELS = ("mlp", "cnn", "transformer", "split_transformer", "pipeline", "split_pipeline")
# Which rows a model's towers rows are measured against: split and pipeline against the
# transformer they are made of.
BASE_MODEL = {"split_transformer": "transformer", "pipeline": "transformer",
              "split_pipeline": "transformer"}
WAYS = ("keras", "towers", "mirrored")
STAMPS = ("imported", "towers_imported", "built", "first_step", "first_epoch")
IMAGE_SHAPE, NUM_CLASSES = (16, 16, 1), 10
VOCAB, LENGTH, WIDTH, HEADS, HIDDEN, BLOCKS = 1000, 16, 32, 4, 64, 2
SPLIT_PARTS, MICRO_BATCHES = 2, 2
PIPELINE_CUT = "block_0_out"  # the last layer of block 0: the only tensor into block 1


def configurations(models, num_towers, mirrored_towers):
    """The child configurations of one round, in a fixed order: per model, keras on one
    device, towers at each N, mirrored at each of mirrored_towers (keras and mirrored
    only for models that are not made of another)."""
    configs = []
    for model in models:
        if model not in BASE_MODEL:
            configs.append({"model": model, "way": "keras", "num_towers": 1})
        configs += [{"model": model, "way": "towers", "num_towers": n} for n in num_towers]
        if model not in BASE_MODEL:
            configs += [{"model": model, "way": "mirrored", "num_towers": n}
                        for n in mirrored_towers]
    return configs


def devices_needed(config):
    """Logical devices the configuration trains on (keras: none made)."""
    stages, parts = _stages_and_parts(config["model"])
    return 0 if config["way"] == "keras" else config["num_towers"] * stages * parts


def _stages_and_parts(name):
    """(pipeline stages, parts per split layer) of a model's towers."""
    return 2 if name.endswith("pipeline") else 1, SPLIT_PARTS if name.startswith("split") else 1


def checked_tower_counts(values, output_dir):
    """The tower counts `values` (a --num_towers list of strings) as sorted ints, after
    refusing in one line (absl's UsageError) what cannot run: counts that are not whole
    numbers >= 1, no 1 among them (the ratios' base), or no output_dir."""
    from absl import app
    try:
        num_towers = sorted({int(n) for n in values})
    except ValueError:
        num_towers = None
    if not output_dir:
        raise app.UsageError("--output_dir is required: where results.json and .md go.")
    if num_towers is None or 1 not in num_towers or min(num_towers) < 1:
        raise app.UsageError(f"--num_towers must be counts >= 1 holding 1 (the ratios' "
                             f"base), got {values}.")
    return num_towers


def run_rounds(script, configs, rounds, seed, run=child_process.run_child):
    """Each configuration once per round in a fresh process, the order shuffled per round;
    returns {config key: [the child's result per round]}."""
    order_rng = np.random.default_rng(seed)
    results = {key(c): [] for c in configs}
    for _ in range(rounds):
        for i in order_rng.permutation(len(configs)):
            config = {**configs[i], "launched_at": time.time()}
            results[key(configs[i])].append(run(script, config))
    return results


def key(config):
    return f"{config['model']}/{config['way']}/{config['num_towers']}"


def measure(config):
    """Child: imports, builds the configuration and fits it twice; returns its stamps."""
    launched_at = config["launched_at"]
    stamps = {}

    def stamp(name):
        stamps[name] = time.time() - launched_at

    import keras
    import tensorflow as tf
    stamp("imported")
    import towers
    from benchmarks.harness import mode as mode_lib
    stamp("towers_imported")
    if devices_needed(config):
        devices = towers.configure_devices(devices_needed(config), "cpu")
    loss = mode_lib.make_loss()
    if config["way"] == "towers":
        model = _build_model(config["model"])
        fit = _trainer(config, model, loss, mode_lib.make_optimizer(), devices).fit
    else:  # Keras's compile + fit, under a MirroredStrategy's scope for mirrored
        scope = (tf.distribute.MirroredStrategy(devices).scope() if config["way"] == "mirrored"
                 else contextlib.nullcontext())
        with scope:
            model = _build_model(config["model"])
            model.compile(optimizer=mode_lib.make_optimizer(), loss=loss, jit_compile=False)
        fit = model.fit
    stamp("built")
    x, y = _data(config["model"], config["steps"] * config["batch_size"])

    class FirstStep(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if "first_step" not in stamps:
                stamp("first_step")

    fit(x, y, batch_size=config["batch_size"], shuffle=False, verbose=0, callbacks=[FirstStep()])
    stamp("first_epoch")
    start = time.perf_counter()
    fit(x, y, batch_size=config["batch_size"], shuffle=False, verbose=0)
    return {**stamps, "second_fit": time.perf_counter() - start}


def _trainer(config, model, loss, optimizer, devices):
    import towers
    n, name = config["num_towers"], config["model"]
    stages, parts = _stages_and_parts(name)
    if stages * parts == 1:
        return towers.TowerTrainer(model, loss, optimizer, devices=devices)
    grid = tower_grid(devices, n, stages, parts)
    # As devices= takes it: one level per dimension there is more than one of.
    grid = [[row if parts > 1 else row[0] for row in tower] for tower in grid]
    grid = [tower if stages > 1 else tower[0] for tower in grid]
    if parts > 1:
        model = towers.split_layers(model, "auto", grid[0][0] if stages > 1 else grid[0])
    options = {} if stages == 1 else {"pipeline_cuts": [PIPELINE_CUT],
                                      "micro_batches": config.get("micro_batches", MICRO_BATCHES)}
    return towers.TowerTrainer(model, loss, optimizer, devices=grid, **options)


def tower_grid(devices, num_towers, stages, parts):
    """grid[i][k][j], tower i's device for stage k's part j: devices[(i * stages + k) *
    parts + j] (device names, at least num_towers * stages * parts)."""
    return [[devices[(i * stages + k) * parts:][:parts] for k in range(stages)]
            for i in range(num_towers)]


def _build_model(name):
    from towers.cli import models
    if name in ("mlp", "cnn"):
        return models.build_model(name, IMAGE_SHAPE, NUM_CLASSES, seed=0)
    return transformer()


def transformer(vocab=VOCAB, length=LENGTH, width=WIDTH, heads=HEADS, hidden=HIDDEN,
                blocks=BLOCKS, seed=0):
    """ids (B, length) -> Embedding(vocab, width) + positions -> `blocks` x [self-attention
    + residual, LayerNorm, Dense(hidden) relu -> Dense(width) + residual, LayerNorm] ->
    mean over tokens -> NUM_CLASSES logits. Block i ends in the layer block_i_out."""
    import keras
    keras.utils.set_random_seed(seed)
    ids = keras.Input((length,), dtype="int32")
    x = keras.layers.Embedding(vocab, width, name="token_embedding")(ids)      # (B, T, D)
    x = x + keras.layers.Embedding(length, width, name="position_embedding")(
        keras.ops.arange(length))
    for i in range(blocks):
        attended = keras.layers.MultiHeadAttention(heads, width // heads,
                                                   name=f"block_{i}_attention")(x, x)
        x = keras.layers.LayerNormalization(name=f"block_{i}_norm")(x + attended)
        h = keras.layers.Dense(hidden, activation="relu", name=f"block_{i}_up")(x)  # (B, T, F)
        h = keras.layers.Dense(width, name=f"block_{i}_down")(h)                   # (B, T, D)
        x = keras.layers.LayerNormalization(name=f"block_{i}_out")(x + h)
    pooled = keras.layers.GlobalAveragePooling1D()(x)                               # (B, D)
    return keras.Model(ids, keras.layers.Dense(NUM_CLASSES, name="logits")(pooled),
                       name="transformer")


def _data(name, rows):
    rng = np.random.default_rng(0)
    if name in ("mlp", "cnn"):
        x = rng.uniform(size=(rows, *IMAGE_SHAPE)).astype(np.float32)
    else:
        x = rng.integers(0, VOCAB, size=(rows, LENGTH)).astype(np.int32)
    return x, rng.integers(0, NUM_CLASSES, size=rows).astype(np.int32)


def medians(results):
    """{config key: {stamp: median seconds over rounds, "rounds": n}}."""
    return {k: {**{s: float(np.median([r[s] for r in runs]))
                   for s in (*STAMPS, "second_fit")}, "rounds": len(runs)}
            for k, runs in results.items()}


def ratios(median, models, num_towers, mirrored_towers):
    """Per model, the first step of its towers rows against keras on one device and
    against one tower, and mirrored's against keras: {name: ratio or None (a row not
    run)}. Each twice: counted from the process's launch, and from the end of building
    (suffix "_fit": fit's own share, without import and build)."""
    most, table = max(num_towers), {}
    for model in models:
        base = BASE_MODEL.get(model, model)
        table[model] = {}
        for since_built, suffix in ((False, ""), (True, "_fit")):
            def first(way, name, n):
                row = median.get(f"{name}/{way}/{n}")
                return None if row is None else row["first_step"] - since_built * row["built"]

            keras_first, one_tower = first("keras", base, 1), first("towers", model, 1)
            table[model][f"towers_{most}_over_keras{suffix}"] = _ratio(
                first("towers", model, most), keras_first)
            for n in (n for n in num_towers if n > 1):
                table[model][f"towers_{n}_over_1{suffix}"] = _ratio(
                    first("towers", model, n), one_tower)
            if model not in BASE_MODEL:
                for n in mirrored_towers:
                    table[model][f"mirrored_{n}_over_keras{suffix}"] = _ratio(
                        first("mirrored", model, n), keras_first)
    return table


def _ratio(a, b):
    return None if a is None or b is None else a / b


def markdown(median, table, config):
    """The medians, one row per configuration, then the ratios, one row per model."""
    lines = [
        f"Medians of {config['rounds']} rounds, each configuration in a fresh process; "
        f"seconds since the process was launched (first epoch: {config['steps']} steps of "
        f"{config['batch_size']}; micro-batches per pipelined tower: {config['micro_batches']}); "
        "second fit: that fit's own seconds.", "",
        "| model | way | N | devices | imported | towers imported | built | first step "
        "| first step − built | first epoch | second fit |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for name, row in median.items():
        model, way, n = name.split("/")
        devices = devices_needed({"model": model, "way": way, "num_towers": int(n)})
        lines.append(f"| {model} | {way} | {n} | {devices or 1} | {row['imported']:.1f} | "
                     f"{row['towers_imported']:.1f} | {row['built']:.1f} | "
                     f"{row['first_step']:.1f} | {row['first_step'] - row['built']:.1f} | "
                     f"{row['first_epoch']:.1f} | {row['second_fit']:.2f} |")
    names = list(dict.fromkeys(name for row in table.values() for name in row))
    lines += ["", "Time to the first step, ratios of the medians (`_fit`: counted from the "
              "end of building, fit's own share):", "",
              "| model | " + " | ".join(names) + " |", "|---|" + "--:|" * len(names)]
    for model, row in table.items():
        lines.append(f"| {model} | " + " | ".join(
            "–" if row.get(n) is None else f"{row[n]:.2f}" for n in names) + " |")
    return "\n".join(lines) + "\n"


def draw(median, config, path):
    """Per model, fit's share of the time to the first step (first step − built) against
    the number of towers, Keras on one device and MirroredStrategy as marks beside it;
    writes a PNG to `path`. Returns False (and draws nothing) without matplotlib."""
    try:
        import matplotlib  # pylint: disable=g-import-not-at-top
        matplotlib.use("Agg")
        from matplotlib import pyplot  # pylint: disable=g-import-not-at-top
    except ImportError:
        return False

    def share(model, way, n):
        row = median.get(f"{model}/{way}/{n}")
        return None if row is None else row["first_step"] - row["built"]

    figure, axis = pyplot.subplots(figsize=(7, 4.5))
    palette = matplotlib.colormaps["tab10"].colors
    for color, model in zip(palette, config["models"]):
        counts = [n for n in config["num_towers"] if share(model, "towers", n) is not None]
        axis.plot(counts, [share(model, "towers", n) for n in counts], "o-", color=color,
                  label=f"{model}, towers")
        base = BASE_MODEL.get(model, model)
        if model == base and share(model, "keras", 1) is not None:
            axis.plot([1], [share(model, "keras", 1)], "s", color=color, markersize=9,
                      markerfacecolor="none", label=f"{model}, Keras fit, 1 device")
        for n in config["mirrored_towers"] if model == base else []:
            if share(model, "mirrored", n) is not None:
                axis.plot([n], [share(model, "mirrored", n)], "x", color=color, markersize=9,
                          label=f"{model}, MirroredStrategy" if n == config["mirrored_towers"][0]
                          else None)
    axis.set(xlabel="towers (logical CPU devices)", xticks=config["num_towers"],
             ylabel="seconds", title="Time to the first step inside fit (first step − built), "
                                     f"medians of {config['rounds']} fresh processes")
    axis.title.set_fontsize(9)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    pyplot.close(figure)
    return True
