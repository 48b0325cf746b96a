"""SIGTERM and SIGINT during fit: the step finishes, a checkpoint is saved, Preempted is
raised, and fitting again resumes to the weights of a run that never stopped."""

import functools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile

import keras
import tensorflow as tf

import towers
from tests import reference
from tests.checkpoint_files import checkpoint_values, position

DEVICES = ["/device:CPU:0", "/device:CPU:1"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
STEPS_PER_EPOCH = 5


def _batches(epoch):
    """Epoch `epoch`'s 5 batches, the same in every run."""
    return reference.make_batches(6, num_steps=STEPS_PER_EPOCH, seed=epoch)


def _trainer():
    return towers.TowerTrainer(reference.make_model(), reference.make_loss(),
                               keras.optimizers.Adam(0.05), devices=DEVICES)


def _signal_at(step, number):
    """A callback that sends `number` to this process at the end of step `step` (from 1)."""
    steps = []

    def send(batch, logs):
        del batch, logs
        steps.append(None)
        if len(steps) == step:
            os.kill(os.getpid(), number)
    return keras.callbacks.LambdaCallback(on_train_batch_end=send)


@functools.lru_cache(maxsize=None)
def _uninterrupted_weights():
    trainer = _trainer()
    trainer.fit(_batches, epochs=3, steps_per_epoch=STEPS_PER_EPOCH, verbose=False)
    return tuple(v.numpy() for v in trainer.model.weights)


class PreemptionTest(tf.test.TestCase):

    def _fit(self, directory, callbacks=(), epochs=3):
        trainer = _trainer()
        checkpointer = None if directory is None else towers.Checkpointer(
            directory, trainer.model, trainer.optimizer)
        trainer.fit(_batches, epochs=epochs, steps_per_epoch=STEPS_PER_EPOCH,
                    checkpointer=checkpointer, callbacks=list(callbacks), verbose=False)
        return trainer

    def _assert_resumes_to_uninterrupted(self, directory):
        resumed = self._fit(directory)
        self.assertEqual(resumed.step, 3 * STEPS_PER_EPOCH)
        for want, got in zip(_uninterrupted_weights(), resumed.model.weights):
            self.assertAllClose(want, got, atol=1e-6, msg=got.path)

    def test_sigterm_mid_epoch_saves_the_exact_position(self):
        directory = tempfile.mkdtemp(dir=self.get_temp_dir())
        handler = signal.getsignal(signal.SIGTERM)
        with self.assertRaisesRegex(towers.Preempted, "stopped by SIGTERM after step 8: a "
                                    "checkpoint is saved in .*rerun the same command"):
            self._fit(directory, [_signal_at(8, signal.SIGTERM)])
        self.assertIs(signal.getsignal(signal.SIGTERM), handler)  # put back after fit
        self.assertEqual(position(checkpoint_values(directory)), (1, 3))
        self._assert_resumes_to_uninterrupted(directory)

    def test_sigint_after_an_epochs_last_batch_resumes_at_the_next_epoch(self):
        directory = tempfile.mkdtemp(dir=self.get_temp_dir())
        with self.assertRaises(towers.Preempted) as caught:
            self._fit(directory, [_signal_at(STEPS_PER_EPOCH, signal.SIGINT)])
        self.assertEqual((caught.exception.signal_name, caught.exception.step), ("SIGINT", 5))
        self.assertEqual(position(checkpoint_values(directory)), (1, 0))
        self._assert_resumes_to_uninterrupted(directory)

    def test_a_second_signal_while_saving_is_ignored(self):
        directory = tempfile.mkdtemp(dir=self.get_temp_dir())
        save = towers.Checkpointer.save

        def interrupted_save(checkpointer, *args):
            os.kill(os.getpid(), signal.SIGINT)  # arrives in the middle of the save
            return save(checkpointer, *args)

        towers.Checkpointer.save = interrupted_save
        self.addCleanup(setattr, towers.Checkpointer, "save", save)
        with self.assertRaisesRegex(towers.Preempted, "SIGTERM after step 2"):
            self._fit(directory, [_signal_at(2, signal.SIGTERM)])
        towers.Checkpointer.save = save
        self.assertEqual(position(checkpoint_values(directory)), (0, 2))
        self._assert_resumes_to_uninterrupted(directory)

    def test_without_a_checkpointer_it_stops_and_says_nothing_was_saved(self):
        with self.assertRaisesRegex(towers.Preempted, "after step 4: nothing was saved"):
            self._fit(None, [_signal_at(4, signal.SIGTERM)])


if __name__ == "__main__":
    tf.test.main()


def _run_cli(*args):
    return subprocess.run([sys.executable, "-m", "towers.train", *args], capture_output=True,
                          text=True, cwd=ROOT, env=ENV, timeout=300)


class CommandLineTest(tf.test.TestCase):

    def test_sigterm_saves_says_one_line_and_a_rerun_ends_as_if_never_stopped(self):
        # No periodic checkpoint comes round in 120 steps: only the stop saves one.
        args = ["--model=mlp", "--steps=120", "--checkpoint_every=1000", "--deterministic",
                "--global_batch_size=32"]
        stopped = tempfile.mkdtemp(dir=self.get_temp_dir())
        process = subprocess.Popen(
            [sys.executable, "-m", "towers.train", *args, f"--checkpoint_dir={stopped}"],
            cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for line in process.stderr:  # the progress lines start once steps run
            if "batch" in line:
                break
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=120)
        self.assertEqual(process.returncode, 75, stderr[-2000:])
        last = stderr.strip().splitlines()[-1]
        self.assertRegex(last, rf"^towers-train: stopped by SIGTERM after step (\d+): a "
                               rf"checkpoint is saved in {stopped}; rerun the same command")
        step = int(re.search(r"after step (\d+)", last).group(1))
        self.assertBetween(step, 1, 119)
        self.assertEqual(position(checkpoint_values(stopped)), divmod(step, 45))  # 45 a epoch

        output = os.path.join(stopped, "out.json")
        rerun = _run_cli(*args, f"--checkpoint_dir={stopped}", f"--output_json={output}")
        self.assertEqual(rerun.returncode, 0, rerun.stderr[-2000:])
        with open(output) as f:
            self.assertEqual(json.load(f)["steps"], 120)
        straight = tempfile.mkdtemp(dir=self.get_temp_dir())
        result = _run_cli(*args, f"--checkpoint_dir={straight}")
        self.assertEqual(result.returncode, 0, result.stderr[-2000:])
        expected, actual = checkpoint_values(straight), checkpoint_values(stopped)
        self.assertEqual(sorted(expected), sorted(actual))
        for name in expected:
            self.assertAllEqual(expected[name], actual[name], msg=name)
