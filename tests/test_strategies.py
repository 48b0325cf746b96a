"""Aggregation and variable placement: every combination gives the "main"/"main" weights."""

import functools
import itertools

import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import towers
from tests import reference

DEVICES = [f"/device:CPU:{i}" for i in range(4)]
COMBINATIONS = list(itertools.product(["main", "tree", "collective"], [False, True],
                                      ["main", "replicated"]))


def _sparse_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((3,), dtype="int32"), keras.layers.Embedding(20, 4),
        keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(reference.NUM_CLASSES)])


def _sparse_batches():
    rng = np.random.default_rng(0)
    return [(rng.integers(0, 20, (size, 3)).astype(np.int32),
             rng.integers(0, reference.NUM_CLASSES, size)) for size in (9, 3)]


# model -> (make_model, make_batches); the dense batches are uneven on 3 and 4 towers.
MODELS = {"dense": (reference.make_model, lambda: reference.make_batches(10)),
          "sparse": (_sparse_model, _sparse_batches)}


def _weights(model, devices, **options):
    make_model, make_batches = MODELS[model]
    keras_model = make_model()
    trainer = towers.TowerTrainer(keras_model, reference.make_loss(),
                                  keras.optimizers.Adam(0.01), devices=devices, **options)
    for batch in make_batches():
        trainer.train_step(batch)
    return [v.numpy() for v in keras_model.weights]


@functools.lru_cache(maxsize=None)
def _main_main_weights(model, num_towers):
    """The default trainer's weights ("main" aggregation and placement), which every
    combination must meet: trained once per model and tower count."""
    return _weights(model, DEVICES[:num_towers])


class StrategyEquivalenceTest(tf.test.TestCase, parameterized.TestCase):

    # Every combination on 3 or 4 towers (10 rows: uneven on both), chosen so that each
    # aggregation, packing and placement meets both counts.
    @parameterized.named_parameters(
        (f"{agg}_{'packed' if pack else 'unpacked'}_{place}_{n}towers", agg, pack, place, n)
        for i, (agg, pack, place) in enumerate(COMBINATIONS) for n in [3 + (i + i // 2) % 2])
    def test_same_weights_as_main_main(self, aggregation, pack, placement, num_towers):
        expected = _main_main_weights("dense", num_towers)
        actual = _weights("dense", DEVICES[:num_towers], aggregation=aggregation,
                          pack_gradients=pack, variable_placement=placement)
        for want, got in zip(expected, actual):
            self.assertAllClose(want, got, atol=1e-5, rtol=1e-5)

    @parameterized.parameters(*COMBINATIONS)
    def test_sparse_gradients_and_an_empty_tower(self, aggregation, pack, placement):
        expected = _main_main_weights("sparse", len(DEVICES))
        actual = _weights("sparse", DEVICES, aggregation=aggregation, pack_gradients=pack,
                          variable_placement=placement)
        for want, got in zip(expected, actual):
            self.assertAllClose(want, got, atol=1e-5, rtol=1e-5)

    def test_replicas_follow_set_weights(self):
        batches = reference.make_batches(8, num_steps=2)
        model = reference.make_model(seed=5)
        trainer = towers.TowerTrainer(model, reference.make_loss(), keras.optimizers.SGD(0.1),
                                      devices=DEVICES, variable_placement="replicated")
        trainer.train_step(batches[0])  # the replicas now hold seed 5's trained weights
        model.set_weights(reference.make_model().get_weights())  # no call tells the trainer
        trainer.train_step(batches[1])
        expected = reference.make_model()  # plain SGD keeps no state, so one step suffices
        towers.TowerTrainer(expected, reference.make_loss(), keras.optimizers.SGD(0.1),
                            devices=DEVICES).train_step(batches[1])
        for want, got in zip(expected.weights, model.weights):
            self.assertAllClose(want, got, atol=1e-6)


class StrategyErrorTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.named_parameters(
        ("unknown_aggregation", dict(aggregation="ring"), "aggregation must be one of"),
        ("nccl_on_cpu", dict(aggregation="nccl"), "needs every tower on a GPU"),
        ("collective_on_one_device_twice",
         dict(aggregation="collective", devices=DEVICES[:1] * 2), "distinct tower devices"),
        ("unknown_placement", dict(variable_placement="sharded"),
         "variable_placement must be one of"),
        ("pack_not_bool", dict(pack_gradients="yes"), "pack_gradients must be True or False"),
    )
    def test_rejected_at_construction(self, options, message):
        options.setdefault("devices", DEVICES)
        with self.assertRaisesRegex(ValueError, message):
            towers.TowerTrainer(reference.make_model(), reference.make_loss(),
                                keras.optimizers.SGD(0.1), **options)


if __name__ == "__main__":
    tf.test.main()
