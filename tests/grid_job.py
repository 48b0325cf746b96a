"""The 3-D grid test's run, as its own process: it needs 8 logical devices, and the
suite's process has 4 (tests/conftest.py).

    python -m tests.grid_job OUTPUT.json

Trains a transformer with split attention and feed-forward layers on a grid of
2 towers x 2 pipeline stages x 2 parts (1F1B, 4 micro-batches; and GPipe with 2 and
variable_placement="spread" through fit and evaluate), and against it Keras's
compile + train_on_batch on one device; writes, as JSON, the largest weight
differences, where every variable and its optimizer slot lives (spread: each variable
or slab), and the evaluation's loss against Keras's. The 1F1B run's checkpoint
is restored into the unsplit model on 2 plain towers, which trains one more step. And a
causal LM on the same grid: GPT-2 split by plan="auto", cut inside its backbone.
"""

import json
import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import towers  # noqa: E402
from tests.test_nested_plans import (CLASSES, FFN, HEADS, SEQUENCE, VOCAB,  # noqa: E402
                                     WIDTH, TokenAndPositionEmbedding, TransformerBlock)

DEVICES = [f"/device:CPU:{i}" for i in range(8)]
GRID = [[DEVICES[0:2], DEVICES[2:4]], [DEVICES[4:6], DEVICES[6:8]]]  # grid[i][k][j]
PLAN = {"block_*/att": "heads", "block_*/ffn/up": "column", "block_*/ffn/down": "row"}
CUTS = ["block_0"]
ROWS = (9, 7, 5)  # uneven over 2 towers x 4 micro-batches; 5 rows leave some empty


def build(seed=0):
    """Embedding -> 2 keras-io transformer blocks -> mean -> logits; functional."""
    keras.utils.set_random_seed(seed)
    ids = keras.Input((SEQUENCE,), dtype="int32")
    x = TokenAndPositionEmbedding(SEQUENCE, VOCAB, WIDTH, name="embed")(ids)
    x = TransformerBlock(WIDTH, HEADS, FFN, name="block_0")(x)
    x = TransformerBlock(WIDTH, HEADS, FFN, name="block_1")(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(ids, keras.layers.Dense(CLASSES, name="out")(x))


def loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def optimizer():
    # SGD with momentum: Adam's sparse update of a position table looked up by every
    # tower differs from one device's, as under MirroredStrategy (docs/api.md).
    return keras.optimizers.SGD(0.1, momentum=0.9)


def batches():
    rng = np.random.default_rng(0)
    return [(rng.integers(0, VOCAB, (n, SEQUENCE)).astype("int32"),
             rng.integers(0, CLASSES, n).astype("int32")) for n in ROWS]


def largest_difference(values, wanted):
    return float(max(np.abs(a - b).max() for a, b in zip(values, wanted, strict=True)))


def device_of(variable):
    return towers.devices.canonical_name(variable.value.device)


def causal_lm():
    """GPT2CausalLM (tests/test_cut_paths.py's) split by plan="auto" over the grid's parts
    and cut inside its backbone, its tied token embedding looked up in stage 0 and the LM
    head in stage 1: the largest weight difference from Keras after 2 Adam steps."""
    from tests import test_cut_paths as lm_test  # needs keras_hub, as scripts/test installs
    batches = lm_test._lm_batches()
    expected = lm_test._gpt2_lm()
    expected.compile(keras.optimizers.Adam(1e-3), loss(), weighted_metrics=[])
    for x, y, weights in batches:
        expected.train_on_batch(x, y, sample_weight=weights)
    parted = towers.split_layers(lm_test._gpt2_lm(), "auto", GRID[0][0])
    trainer = towers.TowerTrainer(parted, loss(), keras.optimizers.Adam(1e-3), devices=GRID,
                                  pipeline_cuts=["gpt2_backbone*/transformer_layer_0"])
    for batch in batches:
        trainer.train_step(batch)
    return largest_difference(towers.join_layers(parted).get_weights(),
                              expected.get_weights())


def main(output):
    data = batches()
    keras_model = build()
    keras_model.compile(optimizer(), loss())
    wanted = []
    for x, y in data:
        keras_model.train_on_batch(x, y)
        wanted.append(keras_model.get_weights())
    results = {}

    trainer = towers.TowerTrainer(towers.split_layers(build(), PLAN, GRID[0][0]), loss(),
                                  optimizer(), devices=GRID, pipeline_cuts=CUTS,
                                  micro_batches=4, pipeline_schedule="1f1b")
    directory = tempfile.mkdtemp()
    checkpointer = towers.Checkpointer(directory, trainer.model, trainer.optimizer)
    for batch in data[:2]:
        trainer.train_step(batch)
    results["1f1b"] = largest_difference(towers.join_layers(trainer.model).get_weights(),
                                         wanted[1])
    slots = {v.path.split("/", 1)[1]: v for v in trainer.optimizer.variables}
    results["placement"] = {
        v.path: [device_of(v), device_of(slots[
            v.path.replace("/", "_") + "_momentum"])]
        for v in trainer.model.trainable_variables}
    results["forms"] = {form.path: form.devices
                        for form in towers.op_parallel.plan.parallel_forms(trainer.model)}
    checkpointer.save(epoch=0, batch_in_epoch=2)

    # The checkpoint restored into the unsplit model on 2 towers: Keras's third step.
    unsplit = build(seed=1)
    plain = towers.TowerTrainer(unsplit, loss(), optimizer(), devices=DEVICES[:2])
    plain.optimizer.build(unsplit.trainable_variables)
    towers.Checkpointer(directory, unsplit, plain.optimizer).restore()
    plain.train_step(data[2])
    results["restored_unsplit"] = largest_difference(unsplit.get_weights(), wanted[2])

    # fit and evaluate on the grid, GPipe with 2 micro-batches, with spread placement:
    # each (stage, part) group's variables over its towers' devices.
    fitted = towers.TowerTrainer(towers.split_layers(build(), PLAN, GRID[0][0]), loss(),
                                 optimizer(), devices=GRID, pipeline_cuts=CUTS,
                                 micro_batches=2, variable_placement="spread")
    fitted.fit(data, epochs=1, verbose=0)
    results["fit_gpipe_spread"] = largest_difference(
        towers.join_layers(fitted.model).get_weights(), wanted[2])
    # What the optimizer updates: each variable, or each slab of one slabbed across towers.
    results["spread_placement"] = [(v.path, device_of(v))
                                   for v in fitted.setup.columns.held_variables()]
    x, y = data[0]
    results["evaluate"] = [fitted.evaluate((x, y))["loss"],
                           float(keras_model.evaluate(x, y, verbose=0))]
    with open(output, "w") as f:
        json.dump({**results, "causal_lm": causal_lm()}, f)


if __name__ == "__main__":
    tf.config.set_logical_device_configuration(  # before the runtime starts
        tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 8)
    main(sys.argv[1])
