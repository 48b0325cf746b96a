"""Prefetch to device: each tf.data batch is split in the input pipeline and the
step receives every tower's shard already on that tower's device."""

from unittest import mock

import keras
from absl.testing import parameterized
import tensorflow as tf

import towers
from tests import reference
from towers import devices as devices_lib
from towers.data_parallel import split
from towers.engine import step as step_lib
from towers.training import prefetch

DEVICES = [f"/device:CPU:{i}" for i in range(4)]
SIZE, BATCH = 14, 4  # batches of 4, 4, 4, 2: the last one leaves towers 2 and 3 empty


def _batches():
    return reference.make_batches(SIZE, num_steps=1, seed=6)[0]


def _dataset():
    return tf.data.Dataset.from_tensor_slices(_batches()).batch(BATCH)


def _trainer(devices=DEVICES, model=None, **options):
    options = {"prefetch_to_devices": True, **options}  # "auto" is off on CPU devices
    return towers.TowerTrainer(model or reference.make_model(), reference.make_loss(),
                               keras.optimizers.SGD(0.1, momentum=0.9), devices=devices,
                               **options)


def _expected_weights(epochs):
    x, y, w = _batches()
    batches = [(x[i:i + BATCH], y[i:i + BATCH], w[i:i + BATCH]) for i in range(0, SIZE, BATCH)]
    return reference.single_device_weights(
        reference.make_model(), keras.optimizers.SGD(0.1, momentum=0.9),
        reference.make_loss(), batches * epochs)


def _devices_of(shards):
    """Per shard, the canonical device of each of its tensors."""
    return [{devices_lib.canonical_name(t.device) for t in tf.nest.flatten(shard)}
            for shard in shards]


class ShardIteratorTest(tf.test.TestCase):

    def test_each_shard_is_the_steps_split_on_its_device(self):
        iterator = prefetch.ShardIterator(_dataset(), DEVICES)
        batches = list(_dataset())
        for batch, shards in zip(batches, iterator, strict=True):
            self.assertIsInstance(shards, split.Shards)
            self.assertEqual(_devices_of(shards), [{d} for d in DEVICES])
            for want, got in zip(split.split_batch(batch, len(DEVICES)), shards):
                for a, b in zip(want, got):
                    self.assertAllEqual(a, b)
        self.assertEqual([split.batch_size(s) for s in shards], [1, 1, 0, 0])

    def test_float64_features_arrive_as_float32(self):
        x, y, _ = _batches()
        dataset = tf.data.Dataset.from_tensor_slices((x.astype("float64"), y)).batch(BATCH)
        shards = next(prefetch.ShardIterator(dataset, DEVICES[:2]))
        self.assertEqual(shards[1][0].dtype, tf.float32)

    def test_bad_input_is_one_clear_error(self):
        with self.assertRaisesRegex(ValueError, "needs a tf.data.Dataset, got list"):
            prefetch.ShardIterator([_batches()], DEVICES)
        single = tf.data.Dataset.from_tensor_slices(_batches()[0]).batch(BATCH)
        with self.assertRaisesRegex(ValueError, r"\(x, y\) or \(x, y, sample_weight\)"):
            prefetch.ShardIterator(single, DEVICES)
        with self.assertRaisesRegex(ValueError, "buffer_size must be an integer >= 1"):
            prefetch.ShardIterator(_dataset(), DEVICES, buffer_size=0)
        with self.assertRaisesRegex(ValueError, "prefetch_to_devices must be True, False or "
                                                "'auto', got 'yes'"):
            _trainer(prefetch_to_devices="yes")
        shards = next(_trainer(DEVICES[:2]).shard_iterator(_dataset()))
        with self.assertRaisesRegex(ValueError, "comes in 2 shards but the step has 4 towers"):
            _trainer().train_step(shards)


class FitPrefetchTest(tf.test.TestCase, parameterized.TestCase):

    def _assert_expected(self, trainer, epochs):
        for want, got in zip(_expected_weights(epochs), trainer.model.weights):
            self.assertAllClose(want, got, atol=1e-5, msg=got.path)

    def test_train_step_takes_the_staged_shards(self):
        trainer, received = _trainer(), []
        for _ in range(2):
            for shards in trainer.shard_iterator(_dataset()):
                received.append(_devices_of(shards))
                trainer.train_step(shards)
        self.assertEqual(received, [[{d} for d in DEVICES]] * 8)
        self._assert_expected(trainer, epochs=2)

    @parameterized.parameters(1, 3)
    def test_fit_reads_each_shard_on_its_tower(self, steps_per_execution):
        traced, read = [], []

        def start_tower(setup, step, this_tower):
            traced.append(this_tower.index)
            return start_tower.original(setup, step, this_tower)

        def get_next_as_optional(iterator, devices, or_empty=False):
            has_value, get_value = get_next_as_optional.original(iterator, devices, or_empty)

            def recorded():
                shards = get_value()
                read.extend({devices_lib.canonical_name(t.device) for t in tf.nest.flatten(shard)}
                            for shard in shards)
                return shards
            return has_value, recorded

        start_tower.original = step_lib.start_tower
        get_next_as_optional.original = prefetch.get_next_as_optional
        trainer = _trainer(steps_per_execution=steps_per_execution)
        with mock.patch.object(step_lib, "start_tower", start_tower), \
                mock.patch.object(prefetch, "get_next_as_optional", get_next_as_optional):
            trainer.fit(_dataset(), epochs=2, verbose=False)
        # fit's compiled loop reads the shards, each on its tower, even at one step per
        # call, and calls the step the first step traced for them (shards as arguments);
        # the last batch, of 2 rows, leaves towers 2 and 3 without one: it goes back to
        # the host, whose step for it is traced for its rows, those towers left out.
        self.assertEqual(read, [{d} for d in DEVICES])
        self.assertEqual(traced, [0, 1, 2, 3, 0, 1])
        self._assert_expected(trainer, epochs=2)

    def test_auto_stages_only_where_a_tower_is_not_a_cpu(self):
        self.assertFalse(_trainer(prefetch_to_devices="auto").prefetch_to_devices)

    def test_without_prefetch_the_step_splits_and_agrees_bit_for_bit(self):
        staged, unstaged = _trainer(), _trainer(prefetch_to_devices=False)
        for trainer in (staged, unstaged):
            trainer.fit(_dataset(), epochs=2, verbose=False)
        for want, got in zip(unstaged.model.weights, staged.model.weights):
            self.assertAllEqual(want, got, msg=got.path)

    def test_pipeline_rows_get_their_shard_on_the_first_stage(self):
        model = reference.make_model()
        trainer = _trainer([DEVICES[:2], DEVICES[2:]], model,
                           pipeline_cuts=[model.layers[0].name], micro_batches=2)
        self.assertEqual(trainer.input_devices, [DEVICES[0], DEVICES[2]])
        shards = next(trainer.shard_iterator(_dataset()))
        self.assertEqual(_devices_of(shards), [{DEVICES[0]}, {DEVICES[2]}])
        trainer.fit(_dataset(), epochs=2, verbose=False)
        self._assert_expected(trainer, epochs=2)

    def test_metrics_see_the_whole_batch(self):
        trainer = _trainer(metrics=["accuracy"])
        logs = trainer.fit(_dataset(), verbose=False).history
        model = reference.make_model()
        x, y, w = _batches()
        optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
        metric = keras.metrics.SparseCategoricalAccuracy()
        for i in range(0, SIZE, BATCH):  # accuracy of each batch before its update
            # `metrics`, as keras.Model.compile's, are not sample-weighted.
            metric.update_state(y[i:i + BATCH], model(x[i:i + BATCH]))
            reference.single_device_weights(model, optimizer, reference.make_loss(),
                                            [(x[i:i + BATCH], y[i:i + BATCH], w[i:i + BATCH])])
        self.assertAllClose(logs["accuracy"], [metric.result()], atol=1e-6)


if __name__ == "__main__":
    tf.test.main()
