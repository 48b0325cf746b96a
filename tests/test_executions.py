"""steps_per_execution: several tower steps per call of one compiled function (an
in-graph loop over a tf.data iterator) give the weights of single steps."""

import os
import signal
from unittest import mock

import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import towers
from tests import reference
from tests.checkpoint_files import checkpoint_values, position
from towers.training import compiled_steps

DEVICES = ["/device:CPU:0", "/device:CPU:1"]


def _dataset(nan_at=None, size=43, batch=6):
    """7 batches of 6 and a last one of 1; batch `nan_at` has a NaN feature."""
    x, y, w = reference.make_batches(size, num_steps=1, seed=4)[0]
    if nan_at is not None:
        x = x.copy()
        x[nan_at * batch, 2] = np.nan
    return tf.data.Dataset.from_tensor_slices((x, y, w)).batch(batch)


def _trainer(steps_per_execution=1, **options):
    return towers.TowerTrainer(reference.make_model(), reference.make_loss(),
                               keras.optimizers.Adam(0.05), devices=DEVICES,
                               steps_per_execution=steps_per_execution, **options)


def _single_steps(batches, **options):
    trainer = _trainer(**options)
    for batch in batches:
        trainer.train_step(batch)
    return trainer


class BatchEnds(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.ends = []

    def on_train_batch_end(self, batch, logs=None):
        self.ends.append(batch)


class ExecutionTest(tf.test.TestCase, parameterized.TestCase):

    def _assert_same_weights(self, expected, actual):
        for want, got in zip(expected.model.weights, actual.model.weights):
            self.assertAllEqual(want, got, msg=want.path)

    def test_train_steps_equal_single_steps(self):
        trainer, iterator, ran = _trainer(), iter(_dataset()), []
        while (logs := trainer.train_steps(iterator, 4))["steps"]:
            ran.append(logs["steps"])
        self.assertEqual(ran, [1, 4, 3])  # the first call sets up on one eager step
        self._assert_same_weights(_single_steps(list(_dataset())), trainer)

    def test_the_loop_calls_the_traced_step_and_gives_back_a_batch_too_small(self):
        # 43 rows in batches of 6: the last, of 1 row, leaves a tower without one. The
        # loop calls the step the first call traced (its Python runs no more), and gives
        # that batch back to run as train_step runs it: the step for its rows is traced
        # then, in the call that reaches it (the third), not with the loop, and skips
        # the empty tower with no tf.cond.
        traced, original = [], compiled_steps.train_step

        def train_step(trainer, batch, may_be_empty):
            traced.append((len(calls), may_be_empty))
            return original(trainer, batch, may_be_empty)

        trainer, iterator, calls = _trainer(), iter(_dataset()), []
        with mock.patch.object(compiled_steps, "train_step", train_step):
            while (logs := trainer.train_steps(iterator, 4))["steps"]:
                calls.append(logs)
        self.assertEqual(traced, [(0, False), (2, False)])
        self.assertEqual([logs["steps"] for logs in calls], [1, 4, 3])
        single, losses = _trainer(), []
        for batch in _dataset():
            losses.append(single.train_step(batch)["loss"])
        self._assert_same_weights(single, trainer)
        # The last call's loss: its steps' (6, 6 and 1 rows) mean over their rows.
        self.assertAllClose(calls[-1]["loss"], np.average(losses[5:], weights=[6, 6, 1]),
                            atol=1e-6)
        self.assertEqual(calls[-1]["examples"], 13)

    def test_fit_with_executions_equals_single_steps_and_ends_a_batch_per_execution(self):
        ends, trainer = BatchEnds(), _trainer(steps_per_execution=4, metrics=["accuracy"])
        history = trainer.fit(_dataset(), epochs=2, callbacks=[ends], verbose=False)
        single = _trainer(metrics=["accuracy"])
        single_history = single.fit(_dataset(), epochs=2, verbose=False)
        self._assert_same_weights(single, trainer)
        self.assertEqual(ends.ends, [0, 4, 7, 3, 7])  # 1 + 4 + 3 steps, then 4 + 4
        for name in ("loss", "accuracy"):
            self.assertAllClose(history.history[name], single_history.history[name], atol=1e-6)

    def test_a_nonfinite_step_inside_an_execution(self):
        with self.assertRaisesRegex(towers.NonFiniteError, "step 3: .*nothing was applied"):
            trainer = _trainer(steps_per_execution=4)
            trainer.fit(_dataset(nan_at=2), verbose=False)
        self._assert_same_weights(_single_steps(list(_dataset())[:2]), trainer)
        skipping = _trainer(steps_per_execution=4, on_nonfinite="skip")
        skipping.fit(_dataset(nan_at=2), verbose=False)
        expected = _single_steps(list(_dataset(nan_at=2)), on_nonfinite="skip")
        self._assert_same_weights(expected, skipping)
        self.assertEqual((skipping.step, skipping._skipped_steps), (7, 1))

    @parameterized.parameters(False, True)  # batches split in the step, or staged shards
    def test_stopping_at_an_execution_boundary_resumes_exactly(self, prefetch_to_devices):
        directory = self.get_temp_dir() + f"/executions_{prefetch_to_devices}"
        epoch_data = lambda epoch: _dataset()  # noqa: E731  (the same every epoch)

        def stop_after_second_execution(batch, logs):
            del logs
            if batch == 3:  # the execution of steps 2-4 of the first epoch
                os.kill(os.getpid(), signal.SIGTERM)

        trainer = _trainer(steps_per_execution=3, prefetch_to_devices=prefetch_to_devices)
        with self.assertRaises(towers.Preempted):
            trainer.fit(epoch_data, epochs=2, checkpointer=towers.Checkpointer(
                directory, trainer.model, trainer.optimizer, every_steps=2), verbose=False,
                callbacks=[keras.callbacks.LambdaCallback(
                    on_train_batch_end=stop_after_second_execution)])
        self.assertEqual(position(checkpoint_values(directory)), (0, 4))
        resumed = _trainer(steps_per_execution=3, prefetch_to_devices=prefetch_to_devices)
        resumed.fit(epoch_data, epochs=2, checkpointer=towers.Checkpointer(
            directory, resumed.model, resumed.optimizer), verbose=False)
        single = _trainer()
        single.fit(epoch_data, epochs=2, verbose=False)
        self.assertEqual(resumed.step, 16)
        for want, got in zip(single.model.weights, resumed.model.weights):
            self.assertAllClose(want, got, atol=1e-6, msg=want.path)

    def test_bad_value(self):
        with self.assertRaisesRegex(ValueError, "steps_per_execution must be an integer >= 1"):
            _trainer(steps_per_execution=0)

    def test_an_empty_batch_in_the_loop_is_refused_as_train_step_refuses_it(self):
        # One tower, one micro-batch: the loop runs the step without the skip, behind a
        # check. Batches of 6, 6, then one trimmed to 0 rows.
        x, y, w = reference.make_batches(18, num_steps=1, seed=4)[0]
        dataset = tf.data.Dataset.zip(
            tf.data.Dataset.from_tensor_slices((x, y, w)).batch(6),
            tf.data.Dataset.from_tensor_slices([6, 6, 0]),
        ).map(lambda batch, rows: tf.nest.map_structure(lambda t: t[:rows], batch))
        trainer = towers.TowerTrainer(reference.make_model(), reference.make_loss(),
                                      keras.optimizers.Adam(0.05), devices=DEVICES[:1])
        iterator = iter(dataset)
        self.assertEqual(trainer.train_steps(iterator, 1)["steps"], 1)  # sets the trainer up
        with self.assertRaisesRegex(ValueError, r"^the batch is empty \(batch size 0\): batch 2 "
                                    r"of this call of train_steps; .*The 1 step\(s\) before "
                                    r"it were applied, nothing of it or after it\.$"):
            trainer.train_steps(iterator, 3)
        self.assertEqual(trainer.step, 2)  # the second batch applied, the empty one not


if __name__ == "__main__":
    tf.test.main()
