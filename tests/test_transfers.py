"""benchmarks/harness/transfers.py: bytes a tf.function moves between devices, against
sizes worked out by hand (float32 and int32 are 4 bytes, bool 1)."""

import numpy as np
import tensorflow as tf
from absl.testing import parameterized

from benchmarks.harness import transfers

CPU = [f"/device:CPU:{i}" for i in range(4)]


def _bytes_of(result, dtype):
    """by_pair counted over the transfers of one dtype only."""
    by_pair = {}
    for source, destination, _, name, _, size in result["tensors"]:
        if name == dtype:
            by_pair[source, destination] = by_pair.get((source, destination), 0) + size
    return by_pair


class BytesBetweenDevicesTest(tf.test.TestCase, parameterized.TestCase):

    def test_matmul_on_another_device_moves_its_input_there_and_its_result_back(self):
        @tf.function
        def step(x):
            with tf.device(CPU[1]):
                product = tf.matmul(x, x)
            with tf.device(CPU[0]):
                return product + 1.0

        with tf.device(CPU[0]):
            x = tf.ones([100, 100])
        result = transfers.bytes_between_devices(step, x)
        # 100 x 100 float32 = 40000 bytes each way.
        self.assertEqual(result["by_pair"], {(CPU[0], CPU[1]): 40000, (CPU[1], CPU[0]): 40000})
        self.assertEqual(result["total"], 80000)
        self.assertCountEqual([entry[:2] + entry[3:] for entry in result["tensors"]],
                              [(CPU[0], CPU[1], "float32", (100, 100), 40000),
                               (CPU[1], CPU[0], "float32", (100, 100), 40000)])

    @parameterized.named_parameters(
        ("two_readers_on_one_device", CPU[1], CPU[1], {(CPU[0], CPU[1]): 60}),
        ("readers_on_two_devices", CPU[1], CPU[2], {(CPU[0], CPU[1]): 60, (CPU[0], CPU[2]): 60}),
    )
    def test_a_tensor_crosses_once_per_device_that_reads_it(self, first, second, expected):
        @tf.function
        def step(x):
            with tf.device(CPU[0]):
                doubled = x * 2.0  # 5 x 3 float32 = 60 bytes
            with tf.device(first):
                a = doubled + 1.0
            with tf.device(second):
                b = doubled * 3.0
            return a, b  # results stay where they were made: not counted

        result = transfers.bytes_between_devices(step, tf.ones([5, 3]))
        self.assertEqual(result["by_pair"], expected)
        self.assertLen(result["tensors"], len(expected))

    @parameterized.parameters(10, 3)
    def test_sizes_known_only_at_run_time_are_measured(self, rows_kept):
        @tf.function(input_signature=[tf.TensorSpec([None, 8], tf.float32),
                                      tf.TensorSpec([None], tf.int32),
                                      tf.TensorSpec([None], tf.bool)])
        def step(x, ids, mask):
            with tf.device(CPU[0]):
                rows = tf.boolean_mask(x, mask)  # (None, 8) when traced
                kept_ids = tf.boolean_mask(ids, mask)  # (None,)
            with tf.device(CPU[2]):
                return tf.reduce_sum(rows) + tf.cast(tf.reduce_sum(kept_ids), tf.float32)

        mask = np.arange(64) < rows_kept
        result = transfers.bytes_between_devices(
            step, tf.ones([64, 8]), tf.range(64), tf.constant(mask))
        float_bytes, int_bytes = rows_kept * 8 * 4, rows_kept * 4  # 320 and 40 for 10 rows
        self.assertEqual(result["by_pair"], {(CPU[0], CPU[2]): float_bytes + int_bytes})
        self.assertCountEqual([entry[3:] for entry in result["tensors"]],
                              [("float32", (rows_kept, 8), float_bytes),
                               ("int32", (rows_kept,), int_bytes)])

    def test_two_calls_agree_and_leave_tensorflow_as_it_was(self):
        @tf.function
        def inner(a):  # nested and never traced before: its trace must stay uninstrumented
            return a * 2.0

        @tf.function
        def step(x):
            with tf.device(CPU[1]):
                return tf.reduce_sum(inner(x))  # x, 4 x 4 float32 = 64 bytes, to CPU:1

        x = tf.ones([4, 4])
        first = transfers.bytes_between_devices(step, x)
        second = transfers.bytes_between_devices(step, x)
        self.assertEqual(first["by_pair"], {(CPU[0], CPU[1]): 64})
        self.assertEqual(second, first)
        self.assertEqual(step.experimental_get_tracing_count(), 0)  # measured on copies
        self.assertAllEqual(step(x), 32.0)
        self.assertAllEqual(inner(x), 2.0 * x)

        @tf.function
        def later(a):
            return a + 1.0

        self.assertAllEqual(later(x), x + 1.0)
        self.assertNotIn("Debug", " ".join(
            op.type for op in later.get_concrete_function(x).graph.get_operations()))

    @parameterized.parameters(True, False)
    def test_only_the_branch_a_cond_takes_moves_data(self, take_first):
        @tf.function
        def step(pred, x, y):
            with tf.device(CPU[1]):
                chosen, label = tf.cond(pred, lambda: (x * 2.0, tf.constant([1.0, 2.0, 3.0])),
                                        lambda: (y * 3.0, tf.constant([4.0, 5.0, 6.0, 7.0, 8.0])))
            with tf.device(CPU[0]):
                return chosen + 1.0, label + 1.0

        with tf.device(CPU[0]):
            x, y = tf.ones([100]), tf.ones([10])
        result = transfers.bytes_between_devices(step, tf.constant(take_first), x, y)
        # The taken branch's input goes to CPU:1; its results, one a constant, come back.
        moved, label = (400, 3 * 4) if take_first else (40, 5 * 4)
        # (Where the predicate crosses, a byte, depends on where grappler puts the Switches.)
        self.assertEqual(_bytes_of(result, "float32"),
                         {(CPU[0], CPU[1]): moved, (CPU[1], CPU[0]): moved + label})

    def test_a_variable_read_crosses_from_the_variables_device(self):
        with tf.device(CPU[1]):
            table = tf.Variable(tf.ones([6, 2]))

        @tf.function
        def step():
            with tf.device(CPU[0]):  # the read runs on CPU:1, with the variable
                return table.value() * 2.0  # 6 x 2 float32 = 48 bytes

        self.assertEqual(transfers.bytes_between_devices(step)["by_pair"], {(CPU[1], CPU[0]): 48})

    def test_a_tensor_only_tfdbg_reads_on_another_device_is_not_counted(self):
        with tf.device(CPU[1]):
            table = tf.Variable(tf.ones([6, 2]))

        @tf.function
        def step():
            with tf.device(CPU[0]):  # the read runs on CPU:1, with the variable; tfdbg's
                value = table.value()  # summary of it is made here, on CPU:0
            with tf.device(CPU[1]):
                return tf.reduce_sum(value)

        self.assertEqual(transfers.bytes_between_devices(step)["by_pair"], {})

    def test_a_loop_body_moves_data_each_iteration(self):
        @tf.function
        def step(x):
            def body(i, total):
                with tf.device(CPU[1]):
                    doubled = total * 2.0
                with tf.device(CPU[0]):
                    return i + 1, doubled + 1.0

            with tf.device(CPU[0]):
                _, total = tf.while_loop(lambda i, _: i < 3, body, (0, x))
            with tf.device(CPU[2]):
                return total * 1.0

        result = transfers.bytes_between_devices(step, tf.ones([2, 2]))
        # 3 iterations move the 2 x 2 float32 total (16 bytes) to CPU:1 and back; CPU:1's
        # copy of the loop's control takes the predicate (1 byte) on each of 4 tests;
        # the loop's result goes to CPU:2 once.
        self.assertEqual(result["by_pair"], {(CPU[0], CPU[1]): 3 * 16 + 4 * 1,
                                             (CPU[1], CPU[0]): 3 * 16, (CPU[0], CPU[2]): 16})

    def test_a_result_of_a_nested_function_crossing_devices_is_not_measured(self):
        @tf.function
        def inner(a):
            with tf.device(CPU[1]):
                return tf.matmul(a, a)

        @tf.function
        def step(x):
            with tf.device(CPU[0]):
                return inner(x) + 1.0

        with self.assertRaisesRegex(ValueError, "No run-time size for .*MatMul.*nested"):
            transfers.bytes_between_devices(step, tf.ones([4, 4]))


if __name__ == "__main__":
    tf.test.main()
