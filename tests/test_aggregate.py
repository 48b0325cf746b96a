"""Steps 5 and 6: average_gradients against numpy."""

import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import towers
from towers.data_parallel import aggregate


class AverageGradientsTest(tf.test.TestCase, parameterized.TestCase):

    def setUp(self):
        super().setUp()
        rng = np.random.default_rng(0)
        self.grads = [[rng.normal(size=(3, 2)).astype(np.float32),
                       rng.normal(size=(2,)).astype(np.float32)] for _ in range(4)]

    def test_equal_weights_is_plain_mean(self):
        mean = towers.average_gradients(self.grads)
        for v in range(2):
            self.assertAllClose(np.mean([g[v] for g in self.grads], axis=0), mean[v])

    def test_weighted_by_shard_size(self):
        weights = [3, 3, 2, 2]
        mean = towers.average_gradients(self.grads, weights=weights)
        for v in range(2):
            expected = sum(w * g[v] for w, g in zip(weights, self.grads)) / sum(weights)
            self.assertAllClose(expected, mean[v])

    def test_tensor_weights_and_empty_tower_with_nan(self):
        grads = [g[:] for g in self.grads]
        grads[3] = [np.full((3, 2), np.nan, np.float32), np.full((2,), np.inf, np.float32)]
        weights = [tf.constant(2), tf.constant(1), tf.constant(1), tf.constant(0)]
        mean = towers.average_gradients(grads, weights=weights)
        for v in range(2):
            expected = (2 * grads[0][v] + grads[1][v] + grads[2][v]) / 4
            self.assertAllClose(expected, mean[v])

    def test_none_gradients(self):
        grads = [[None, g[1]] for g in self.grads]
        grads[1][1] = None  # tower 1 has no gradient for variable 1: it counts as zero
        mean = towers.average_gradients(grads, weights=[1, 1, 1, 1])
        self.assertIsNone(mean[0])
        expected = (self.grads[0][1] + self.grads[2][1] + self.grads[3][1]) / 4
        self.assertAllClose(expected, mean[1])

    def test_indexed_slices_stay_sparse_and_equal_dense_mean(self):
        dense_shape = tf.constant([6, 2], tf.int64)
        towers_slices, dense = [], []
        rng = np.random.default_rng(1)
        for indices in ([0, 2], [2, 5, 5], [1]):
            values = rng.normal(size=(len(indices), 2)).astype(np.float32)
            towers_slices.append([tf.IndexedSlices(values, tf.constant(indices), dense_shape)])
            full = np.zeros((6, 2), np.float32)
            np.add.at(full, indices, values)
            dense.append(full)
        mean = towers.average_gradients(towers_slices, weights=[2, 3, 1])
        self.assertIsInstance(mean[0], tf.IndexedSlices)
        expected = (2 * dense[0] + 3 * dense[1] + 1 * dense[2]) / 6
        self.assertAllClose(expected, tf.convert_to_tensor(mean[0]))

    def test_result_is_placed_on_device(self):
        mean = towers.average_gradients(self.grads, device="/device:CPU:2")
        self.assertTrue(mean[0].device.endswith("CPU:2"))

    def test_no_device_keeps_the_callers_in_a_traced_step(self):
        # A tower's micro-batch sums (device None) stay on the tower: tf.device(None)
        # would clear the scope and leave them to the placer's device 0.
        from towers.data_parallel import aggregate

        @tf.function
        def on_a_tower(a, b):
            with tf.device("/device:CPU:3"):
                return aggregate.sum_gradients([[a], [b]])[0]

        graph = on_a_tower.get_concrete_function(tf.TensorSpec([2]), tf.TensorSpec([2])).graph
        self.assertEqual([op.device.split("device:")[-1] for op in graph.get_operations()
                          if op.type == "AddN"], ["CPU:3"])

    def test_gather_copies_to_main_device(self):
        from towers.data_parallel import aggregate
        with tf.device("/device:CPU:3"):
            grads = [[tf.constant(g[0])] for g in self.grads]
        gathered = aggregate.gather(grads, "/device:CPU:1")
        self.assertTrue(all(g[0].device.endswith("CPU:1") for g in gathered))
        self.assertAllClose(self.grads[2][0], gathered[2][0])

    def test_towers_disagree_on_variable_count(self):
        with self.assertRaisesRegex(ValueError, "lengths \\[2, 1\\]"):
            towers.average_gradients([self.grads[0], self.grads[1][:1]])

    def test_all_zero_weights_give_zeros(self):
        mean = towers.average_gradients(self.grads, weights=[0, 0, 0, 0])
        self.assertAllEqual(np.zeros((3, 2)), mean[0])

    @parameterized.parameters(([1, 2, 3],), ([1, -1, 1, 1],))
    def test_bad_weights(self, weights):
        with self.assertRaisesRegex(ValueError, "weights"):
            towers.average_gradients(self.grads, weights=weights)


if __name__ == "__main__":
    tf.test.main()


class MergeStateTest(tf.test.TestCase):
    """The towers' new values of non-trainable variables, merged by each one's rule."""

    def test_each_rule_on_uneven_towers(self):
        old = [tf.constant(10.0), tf.constant(1.0), tf.constant(5.0), tf.constant(7, tf.int64)]
        towers = [[tf.constant(12.0), tf.constant(4.0), None, tf.constant(9, tf.int64)],
                  [tf.constant(14.0), tf.constant(3.0), None, tf.constant(8, tf.int64)],
                  [None, None, None, None]]  # a tower whose calls changed nothing
        rules = ["sum", "mean", "mean", "first"]
        merged = aggregate.merge_state(towers, old, rules, weights=[3, 2, 1])
        self.assertAllClose(merged[0], 10.0 + 2.0 + 4.0)  # old + each tower's change
        self.assertAllClose(merged[1], (3 * 4.0 + 2 * 3.0 + 1 * 1.0) / 6)  # unchanged: old
        self.assertIsNone(merged[2])  # no tower changed it
        self.assertEqual(int(merged[3]), 9)  # tower 0's

    def test_rules_follow_keras_aggregation_then_the_policy(self):
        variables = [keras.Variable(0.0, trainable=False, aggregation="sum"),
                     keras.Variable(0.0, trainable=False, aggregation="only_first_replica"),
                     keras.Variable(0.0, trainable=False),
                     keras.Variable(0, trainable=False, dtype="int32")]
        self.assertEqual(aggregate.state_rules(variables), ["sum", "first", "mean", "first"])
        self.assertEqual(aggregate.state_rules(variables, "first_tower"),
                         ["sum", "first", "first", "first"])
