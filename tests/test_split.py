"""Step 1: split_batch against numpy.array_split."""

import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import towers


class SplitBatchTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.product(batch_size=[1, 3, 4, 10, 12, 17], num_shards=[1, 2, 3, 4, 5])
    def test_matches_numpy_array_split(self, batch_size, num_shards):
        x = np.arange(batch_size * 2, dtype=np.float32).reshape(batch_size, 2)
        shards = towers.split_batch(x, num_shards)
        expected = np.array_split(x, num_shards)
        self.assertLen(shards, num_shards)
        for want, got in zip(expected, shards):
            self.assertAllEqual(want, got)

    def test_nested_dict_and_tuple_batch(self):
        batch = ({"image": np.arange(20.0).reshape(10, 2), "id": np.arange(10)},
                 np.arange(10) * 10)
        shards = towers.split_batch(batch, 4)
        ids = [s[0]["id"].numpy().tolist() for s in shards]
        self.assertEqual(ids, [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]])
        for shard, want_ids in zip(shards, ids):
            self.assertAllEqual(shard[1], np.array(want_ids) * 10)
            self.assertAllEqual(shard[0]["image"], np.arange(20.0).reshape(10, 2)[want_ids])

    def test_batch_size_known_only_at_run_time(self):
        spec = (tf.TensorSpec([None, 3], tf.float32), tf.TensorSpec([None], tf.int32))

        @tf.function(input_signature=[spec])
        def shard_sizes(batch):
            return [tf.shape(shard[0])[0] for shard in towers.split_batch(batch, 4)]

        for size in (10, 3, 1):
            batch = (np.zeros((size, 3), np.float32), np.zeros(size, np.int32))
            got = [int(s) for s in shard_sizes(batch)]
            self.assertEqual(got, [len(s) for s in np.array_split(np.arange(size), 4)])
        self.assertEqual(shard_sizes.experimental_get_tracing_count(), 1)

    def test_smaller_batch_than_shards_gives_empty_shards(self):
        shards = towers.split_batch(np.ones((2, 5)), 4)
        self.assertEqual([s.shape[0] for s in shards], [1, 1, 0, 0])
        self.assertEqual(shards[3].shape[1], 5)

    def test_empty_like_a_batch_its_shards_or_a_dataset_spec(self):
        batch = ({"image": np.ones((3, 2, 2)), "id": np.arange(3)}, np.arange(3, dtype=np.int32))
        dataset = tf.data.Dataset.from_generator(
            lambda: [batch], output_signature=({"image": tf.TensorSpec([None, 2, None]),
                                                "id": tf.TensorSpec([None], tf.int64)},
                                               tf.TensorSpec([None], tf.int32)))
        for like, image_shape in ((batch, [0, 2, 2]), (dataset.element_spec, [0, 2, 0])):
            x, y = towers.split.empty_like(like)
            # float64 becomes floatx, as the step's batches do; unknown dims are 0.
            self.assertEqual((x["image"].dtype, x["image"].shape.as_list()),
                             (tf.float32, image_shape))
            self.assertEqual((x["id"].dtype, x["id"].shape.as_list()), (tf.int64, [0]))
            self.assertEqual((y.dtype, y.shape.as_list()), (tf.int32, [0]))
        shards = towers.split.empty_like(towers.split.Shards(towers.split_batch(batch, 2)))
        self.assertIsInstance(shards, towers.split.Shards)
        self.assertEqual([towers.split.batch_size(shard) for shard in shards], [0, 0])

    def test_parts_that_disagree_on_batch_size(self):
        with self.assertRaisesRegex(ValueError, "disagree on batch size"):
            towers.split_batch((np.ones((4, 2)), np.ones(5)), 2)

    def test_parts_that_disagree_at_run_time(self):
        spec = (tf.TensorSpec([None, 2]), tf.TensorSpec([None]))

        @tf.function(input_signature=[spec])
        def split(batch):
            return towers.split_batch(batch, 2)

        with self.assertRaisesRegex(tf.errors.InvalidArgumentError, "disagree on batch size"):
            split((np.ones((4, 2), np.float32), np.ones(5, np.float32)))

    @parameterized.parameters(0, -1, 2.0, True)
    def test_bad_number_of_shards(self, num_shards):
        with self.assertRaisesRegex(ValueError, "num_shards must be an integer >= 1"):
            towers.split_batch(np.ones((4, 2)), num_shards)

    def test_scalar_part(self):
        with self.assertRaisesRegex(ValueError, "batch dimension"):
            towers.split_batch((np.ones((4, 2)), 3.0), 2)


if __name__ == "__main__":
    tf.test.main()
