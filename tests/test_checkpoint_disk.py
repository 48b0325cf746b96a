"""A checkpoint that cannot be written mid-run, on a real small disk: the disk full, the
folder turned read-only. fit stops with towers.CheckpointWriteError, one line; the newest
complete checkpoint is kept and restores the weights it saved; nothing unfinished is left.
Each test mounts a tmpfs of its own (root, as CI runs), and is skipped where it cannot."""

import gc
import os
import subprocess
import tempfile

import keras
import numpy as np
import tensorflow as tf

import towers

DEVICES = ["/device:CPU:0", "/device:CPU:1"]
# Its variables and Adam's two slots: 3 x 4 x 10,000 bytes, about 120 kB a checkpoint,
# so a 200 kB disk holds one and not the unfinished files of a second.
WIDTH, DISK = 100, "200k"


def _mounted(test, size=DISK):
    """A fresh tmpfs of `size` bytes, unmounted when `test` ends; skips where it cannot."""
    folder = test.enterContext(tempfile.TemporaryDirectory())
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", folder],
                           capture_output=True, text=True)
    if mount.returncode:
        test.skipTest(f"cannot mount a small disk here: {mount.stderr.strip()}")
    test.addCleanup(subprocess.run, ["umount", folder], check=True)
    # First (cleanups run last to first): the run's Checkpointer, which a refused fit's
    # traceback keeps in a cycle, let go of its folder's lock file.
    test.addCleanup(gc.collect)
    return folder


def _trainer():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((WIDTH,)), keras.layers.Dense(WIDTH)])
    return towers.TowerTrainer(model, keras.losses.MeanSquaredError(),
                               keras.optimizers.Adam(1e-2), devices=DEVICES)


def _batches():
    rng = np.random.default_rng(0)
    return [(rng.normal(size=(4, WIDTH)).astype("float32"),
             rng.normal(size=(4, WIDTH)).astype("float32")) for _ in range(3)]


class Remember(keras.callbacks.Callback):
    """Keeps the weights after each step; `then(step)` runs after it, if given."""

    def __init__(self, then=None):
        super().__init__()
        self.weights, self.then = [], then

    def on_train_batch_end(self, batch, logs=None):
        self.weights.append([w.numpy() for w in self.model.weights])
        if self.then:
            self.then(len(self.weights))


class CheckpointDiskTest(tf.test.TestCase):

    def _fit_until_refused(self, directory, then=None):
        """Fits with a save after every step until one fails; returns the step it
        failed at, its line, and the weights after each step before it."""
        trainer, remember = _trainer(), Remember(then)
        checkpointer = towers.Checkpointer(directory, trainer.model, trainer.optimizer,
                                           every_steps=1)
        with self.assertRaises(towers.CheckpointWriteError) as refused:
            trainer.fit(_batches(), epochs=1, callbacks=[remember], checkpointer=checkpointer)
        return int(trainer.optimizer.iterations), str(refused.exception), remember.weights

    def _assert_restores(self, directory, step, weights):
        trainer = _trainer()
        trainer.optimizer.build(trainer.optimized_variables)
        checkpointer = towers.Checkpointer(directory, trainer.model, trainer.optimizer,
                                           writer=False)  # the folder may be read-only
        checkpointer.restore()
        self.assertEqual(int(trainer.optimizer.iterations), step)
        for restored, saved in zip(trainer.model.weights, weights[step - 1]):
            self.assertAllEqual(restored, saved)

    def test_a_full_disk_keeps_the_newest_checkpoint_and_leaves_nothing_unfinished(self):
        directory = os.path.join(_mounted(self), "run")
        step, line, weights = self._fit_until_refused(directory)
        self.assertEqual(step, 2)
        self.assertEqual(line, f"cannot save the checkpoint of step 2 in {directory!r} (No "
                         "space left on device): the newest complete one, ckpt-1, is kept; "
                         "free space or make the folder writable (or give another checkpoint "
                         "directory), then run again to resume.")
        self.assertEqual(sorted(os.listdir(directory)), [
            ".writer.lock", "checkpoint", "ckpt-1.data-00000-of-00001", "ckpt-1.index",
            "run.json"])
        self._assert_restores(directory, 1, weights)

    def test_a_folder_turned_read_only_keeps_the_newest_checkpoint(self):
        disk = _mounted(self, "1m")
        directory = os.path.join(disk, "run")

        def read_only_after_step_1(step):
            if step == 1:  # after its checkpoint: fit saves before the callbacks
                subprocess.run(["mount", "-o", "remount,ro", disk], check=True)

        step, line, weights = self._fit_until_refused(directory, read_only_after_step_1)
        self.assertEqual(step, 2)
        self.assertRegex(line, r"cannot save the checkpoint of step 2 in .* \(Read-only file "
                         r"system\): the newest complete one, ckpt-1, is kept;")
        self._assert_restores(directory, 1, weights)
