"""A restore is all or nothing: a checkpoint that does not match the model and optimizer
(in their variables, their tables or the optimizer's class), or a checkpointer bound to
another model or optimizer than the trainer's, is refused in one line before any step, with the
weights, the step count and the checkpoint directory as they were; an unbuilt model
is built before its checkpoint is restored, and resumes as if never stopped. A folder
belongs to one run and is never silently started again from step 0: an unreadable index or
none readable checkpoint, another model of the same shapes, another data order or a second
live writer is refused in one line; a missing index restores the newest checkpoint and a
changed learning rate is applied, each said in a log line."""

import json
import os
import shutil
import signal
import subprocess
import sys

import keras
import numpy as np
import tensorflow as tf
from absl import flags
from absl.testing import flagsaver, parameterized

import towers
from tests.checkpoint_files import checkpoint_values
from towers.cli import train
from towers.training import folder_lock

if not flags.FLAGS.is_parsed():  # the command line's test runs train.train() in-process
    flags.FLAGS.mark_as_parsed()

DEVICES = ["/device:CPU:0", "/device:CPU:1"]
STEPS_PER_EPOCH = 3


class Sub(keras.Model):
    """The issue's subclassed model: unbuilt until its first call."""

    def __init__(self, hidden=5):
        super().__init__()
        self.d1 = keras.layers.Dense(hidden, activation="relu", name="d1")
        self.d2 = keras.layers.Dense(3, name="d2")

    def call(self, x):
        return self.d2(self.d1(x))


class SubWithVocabulary(Sub):
    """Sub with an adapted StringLookup it does not use: the lookup's token counts, a
    table, are saved beside the variables."""

    def __init__(self):
        super().__init__()
        self.vocabulary = keras.layers.StringLookup()
        self.vocabulary.adapt(["a", "b", "b"])
        self.vocabulary.build((None,))


def _dataset():
    """STEPS_PER_EPOCH batches of 8 rows, 4 features, 3 classes; the same every epoch."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8 * STEPS_PER_EPOCH, 4)).astype("float32")
    y = rng.integers(0, 3, size=(8 * STEPS_PER_EPOCH,))
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(8)


def _sequential(*layers, name="trained"):
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4,)), *layers], name=name)


def _trainer(model, optimizer):
    return towers.TowerTrainer(model, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                               optimizer, devices=DEVICES)


def _fit(trainer, epochs, directory=None, model=None, optimizer=None, data=None):
    """trainer.fit over `data` (default: _dataset()), STEPS_PER_EPOCH batches an epoch;
    with `directory`, through a Checkpointer of `model` and `optimizer` (default: the
    trainer's)."""
    checkpointer = None if directory is None else towers.Checkpointer(
        directory, model or trainer.model, optimizer or trainer.optimizer)
    trainer.fit(_dataset() if data is None else data, epochs=epochs,
                steps_per_epoch=STEPS_PER_EPOCH, checkpointer=checkpointer, verbose=False)
    return trainer


def _files(directory):
    """{name: bytes} of every file in `directory`."""
    files = {}
    for name in os.listdir(directory):
        with open(os.path.join(directory, name), "rb") as f:
            files[name] = f.read()
    return files


class _Refusals(tf.test.TestCase):

    def _assert_refused(self, run, message, trainer, directory):
        """`run()` raises a one-line ValueError matching `message`, and leaves the
        trainer's weights and step count and the directory's files as they were."""
        weights = [v.numpy() for v in trainer.model.weights] if trainer.model.built else None
        step, files = trainer.step, _files(directory)
        with self.assertRaisesRegex(ValueError, message) as caught:
            run()
        self.assertNotIn("\n", str(caught.exception))
        self.assertEqual(trainer.step, step)
        if weights is not None:
            for want, got in zip(weights, trainer.model.weights):
                self.assertAllEqual(want, got)
        self.assertEqual(_files(directory), files)


class RefusalTest(_Refusals):

    def test_checkpoint_of_another_optimizer_class_is_refused(self):
        directory = self.create_tempdir().full_path
        model = lambda: _sequential(keras.layers.Dense(5, "relu"), keras.layers.Dense(3))
        _fit(_trainer(model(), keras.optimizers.Adam(0.01)), 1, directory)
        resumed = _trainer(model(), keras.optimizers.SGD(0.1))
        self._assert_refused(lambda: _fit(resumed, 2, directory),
                             "does not match this model and optimizer: it was written with "
                             "optimizer Adam, and this one is SGD", resumed, directory)

    def test_checkpoint_of_more_layers_is_refused(self):
        # A Sequential model's weights are saved under the optimizer's keys
        # ("optimizer/_trainable_variables/2"); the line names them by their paths.
        directory = self.create_tempdir().full_path
        _fit(_trainer(_sequential(keras.layers.Dense(5, "relu", name="hidden"),
                                  keras.layers.Dense(3, name="logits")),
                      keras.optimizers.SGD(0.1)), 1, directory)
        fewer = _trainer(_sequential(keras.layers.Dense(5, "relu", name="hidden")),
                         keras.optimizers.SGD(0.1))
        self._assert_refused(lambda: _fit(fewer, 2, directory),
                             r"it holds trained/logits/kernel \(5, 3\), trained/logits/bias "
                             r"\(3,\), which this model and optimizer lack", fewer, directory)

    def test_checkpoint_and_model_of_other_tables_are_refused(self):
        # A lookup table saves its keys and values, not as variables: matched both ways.
        with_table, without_table = (self.create_tempdir().full_path for _ in range(2))
        _fit(_trainer(Sub(), keras.optimizers.SGD(0.1)), 1, without_table)
        written = _fit(_trainer(SubWithVocabulary(), keras.optimizers.SGD(0.1)), 1, with_table)
        for directory, model, message in (
                (without_table, SubWithVocabulary(), r"it lacks model/vocabulary/token_counts "
                 r"\(a MutableHashTable\), which this model and optimizer have"),
                (with_table, Sub(), r"it holds model/vocabulary/token_counts \(not a "
                 r"variable\), which this model and optimizer lack")):
            resumed = _trainer(model, keras.optimizers.SGD(0.1))
            self._assert_refused(lambda: _fit(resumed, 2, directory), message, resumed,
                                 directory)
        # Tables that match restore (fit to the epoch reached: nothing more trains).
        restored = _fit(_trainer(SubWithVocabulary(), keras.optimizers.SGD(0.1)), 1, with_table)
        self.assertEqual(restored.step, STEPS_PER_EPOCH)
        for want, got in zip(written.model.weights, restored.model.weights):
            self.assertAllEqual(want, got)

    def test_checkpoint_of_an_unbuilt_model_of_other_sizes_is_refused(self):
        directory = self.create_tempdir().full_path
        _fit(_trainer(Sub(), keras.optimizers.SGD(0.1)), 1, directory)
        wider = _trainer(Sub(hidden=6), keras.optimizers.SGD(0.1))
        self._assert_refused(lambda: _fit(wider, 2, directory),
                             r"it holds \S*d1/kernel as float32 of shape \(4, 5\), and "
                             r"this one is float32 of shape \(4, 6\)", wider, directory)
        # Outside fit, nobody builds them: restore() cannot match what does not exist.
        unbuilt = _trainer(Sub(), keras.optimizers.SGD(0.1))
        self._assert_refused(towers.Checkpointer(directory, unbuilt.model,
                                                 unbuilt.optimizer).restore,
                             "cannot restore into an unbuilt model and optimizer",
                             unbuilt, directory)

    def test_checkpointer_of_another_model_or_optimizer_is_refused_before_any_step(self):
        directory = self.create_tempdir().full_path
        trainer = _fit(_trainer(_sequential(keras.layers.Dense(3)), keras.optimizers.SGD(0.1)),
                       1, directory)
        other_model = _sequential(keras.layers.Dense(3), name="other")
        other_weights = [v.numpy() for v in other_model.weights]
        for options, message in (
                (dict(model=other_model, optimizer=keras.optimizers.SGD(name="other")),
                 "checkpointer is bound to model 'other', not to the trainer's 'trained'"),
                (dict(optimizer=keras.optimizers.SGD(name="other")),
                 "checkpointer is bound to optimizer 'other', not to the trainer's")):
            self._assert_refused(lambda: _fit(trainer, 2, directory, **options), message,
                                 trainer, directory)
        for want, got in zip(other_weights, other_model.weights):
            self.assertAllEqual(want, got)

    def test_command_line_resume_with_another_optimizer_is_refused(self):
        directory = self.create_tempdir().full_path
        quick = dict(model="mlp", num_towers=2, global_batch_size=64, steps=3,
                     checkpoint_dir=directory)
        with flagsaver.flagsaver(**quick, optimizer="adam"):
            train.train()
        files = _files(directory)
        with flagsaver.flagsaver(**quick, optimizer="sgd"):
            with self.assertNoLogs("tensorflow", "WARNING"):
                with self.assertRaisesRegex(ValueError, "written with optimizer Adam, and "
                                            "this one is SGD") as caught:
                    train.train()
        self.assertNotIn("\n", str(caught.exception))
        self.assertEqual(_files(directory), files)


class UnbuiltResumeTest(tf.test.TestCase, parameterized.TestCase):

    # The data of each run: the uninterrupted one (2 epochs), the one stopped after
    # epoch 1, the resumed one. A one-shot iterator gives the resumed run the batch it
    # was built on back, first.
    @parameterized.named_parameters(
        ("dataset", lambda: (_dataset().repeat(),) * 3),  # one iterator across epochs
        ("callable", lambda: (lambda epoch: _dataset(),) * 3),
        ("iterator", lambda: (iter(list(_dataset()) * 2), iter(_dataset()), iter(_dataset()))))
    def test_unbuilt_subclassed_model_resumes_to_the_uninterrupted_weights(self, data):
        def fit_sub(epochs, data, directory=None):
            keras.utils.set_random_seed(0)
            return _fit(_trainer(Sub(), keras.optimizers.SGD(0.1)), epochs, directory,
                        data=data)

        uninterrupted_data, first_data, resumed_data = data()
        uninterrupted = fit_sub(2, uninterrupted_data)
        directory = self.create_tempdir().full_path
        fit_sub(1, first_data, directory)
        resumed = fit_sub(2, resumed_data, directory)
        self.assertEqual(resumed.step, 2 * STEPS_PER_EPOCH)
        self.assertLen(resumed.model.trainable_variables, 4)
        for want, got in zip(uninterrupted.model.weights, resumed.model.weights):
            self.assertAllClose(want, got, atol=1e-6, rtol=0, msg=got.path)


class FolderTest(_Refusals, parameterized.TestCase):
    """A folder that holds checkpoints is never started again from step 0 without a word
    (issue 38): an unreadable index or unreadable checkpoints are refused in one line; a
    missing index beside complete checkpoints restores the newest, with a log line."""

    def _written(self):
        directory = self.create_tempdir().full_path
        _fit(_trainer(_sequential(keras.layers.Dense(3)), keras.optimizers.SGD(0.1)), 2,
             directory)  # ckpt-1 (after epoch 1, every_steps unset: the end only) ...
        _fit(_trainer(_sequential(keras.layers.Dense(3)), keras.optimizers.SGD(0.1)), 3,
             directory)  # ... and ckpt-2
        return directory

    def _resumed(self):
        return _trainer(_sequential(keras.layers.Dense(3)), keras.optimizers.SGD(0.1))

    @parameterized.named_parameters(
        ("truncated", lambda text: text[:20]), ("garbage", lambda text: "not an index ]]"),
        ("empty", lambda text: ""))
    def test_an_unreadable_index_is_refused(self, damage):
        directory = self._written()
        index = os.path.join(directory, "checkpoint")
        with open(index) as f:
            text = f.read()
        with open(index, "w") as f:
            f.write(damage(text))
        resumed = self._resumed()
        self._assert_refused(lambda: _fit(resumed, 4, directory),
                             r"the checkpoint index \S+checkpoint is unreadable .* beside "
                             r"ckpt-1, ckpt-2; to resume from ckpt-2, write .* or delete the "
                             "folder or give another checkpoint directory to start over",
                             resumed, directory)

    def test_a_missing_index_restores_the_newest_checkpoint_and_says_so(self):
        directory = self._written()
        indexed = self.create_tempdir().full_path
        shutil.copytree(directory, indexed, dirs_exist_ok=True)
        os.remove(os.path.join(directory, "checkpoint"))
        steps = []
        resumed = self._resumed()
        with self.assertLogs("absl", "WARNING") as logs:
            resumed.fit(_dataset(), epochs=4, steps_per_epoch=STEPS_PER_EPOCH, verbose=False,
                        checkpointer=towers.Checkpointer(directory, resumed.model,
                                                         resumed.optimizer),
                        callbacks=[keras.callbacks.LambdaCallback(
                            on_train_batch_end=lambda batch, logs: steps.append(batch))])
        self.assertRegex("\n".join(logs.output), r"has no checkpoint index .*restored "
                         r"\S+ckpt-2, the newest readable checkpoint file")
        self.assertLen(steps, STEPS_PER_EPOCH)  # epoch 4 only: 3 were restored
        self.assertEqual(resumed.step, 4 * STEPS_PER_EPOCH)
        with_index = _fit(self._resumed(), 4, indexed)
        for want, got in zip(with_index.model.weights, resumed.model.weights):
            self.assertAllClose(want, got, atol=1e-6, msg=got.path)

    def test_an_unreadable_run_record_is_refused(self):
        directory = self._written()
        with open(os.path.join(directory, "run.json"), "w") as f:
            f.write('{"model": ')
        resumed = self._resumed()
        self._assert_refused(lambda: _fit(resumed, 4, directory),
                             r"cannot read \S+run.json \(JSONDecodeError: .*\), which records "
                             "the run that wrote the checkpoints beside it; put it back, or "
                             "delete the folder", resumed, directory)

    def test_command_line_without_an_index_keeps_the_folders_model(self):
        # The case: with the index gone, --model=cnn was accepted into an mlp's
        # folder and model_spec.json rewritten.
        directory = self.create_tempdir().full_path
        quick = dict(num_towers=2, global_batch_size=64, steps=3, checkpoint_dir=directory)
        with flagsaver.flagsaver(**quick, model="mlp"):
            train.train()
        os.remove(os.path.join(directory, "checkpoint"))
        files = _files(directory)
        with flagsaver.flagsaver(**quick, model="cnn"):
            with self.assertRaisesRegex(ValueError, r"the checkpoint \S+ckpt-1 does not match "
                                        "this model: it holds model 'mlp', not 'cnn'"):
                train.train()
        self.assertEqual(_files(directory), files)

    @parameterized.named_parameters(("index_files", ".index"), ("data_files", ".data"))
    def test_a_folder_of_unreadable_checkpoints_is_refused(self, kind):
        directory = self._written()
        for name in os.listdir(directory):
            if name.startswith("ckpt-") and kind in name:
                with open(os.path.join(directory, name), "r+b") as f:
                    f.truncate(7)
        resumed = self._resumed()
        self._assert_refused(lambda: _fit(resumed, 4, directory),
                             r"\S+ holds checkpoints \(ckpt-1, ckpt-2\) and none of them is "
                             r"readable \(ckpt-2: .*\); put back readable files, or delete the "
                             "folder", resumed, directory)


class OneRunTest(_Refusals):
    """A checkpoint folder belongs to one run (issue 38): another model of the same shapes,
    another data order or a second live writer is refused in one line; a changed learning
    rate is applied and said."""

    def test_a_model_of_the_same_shapes_is_refused_on_resume_and_on_save(self):
        directory = self.create_tempdir().full_path
        _fit(_trainer(_sequential(keras.layers.Dense(3), name="first"),
                      keras.optimizers.SGD(0.1)), 1, directory)
        second = _trainer(_sequential(keras.layers.Dense(3), name="second"),
                          keras.optimizers.SGD(0.1))
        message = ("the checkpoints in .* belong to another run: it trained model 'first', and "
                   "this one is 'second'; delete the folder")
        self._assert_refused(lambda: _fit(second, 2, directory), message, second, directory)
        second.model.build((None, 4))
        second.optimizer.build(second.model.trainable_variables)
        checkpointer = towers.Checkpointer(directory, second.model, second.optimizer)
        self._assert_refused(lambda: checkpointer.save(0, 0), message, second, directory)

    def test_command_line_resume_with_another_data_order_is_refused_naming_the_flag(self):
        directory = self.create_tempdir().full_path
        quick = dict(model="mlp", num_towers=2, global_batch_size=64, steps=3, seed=0,
                     checkpoint_dir=directory)
        with flagsaver.flagsaver(**quick):
            train.train()
        files = _files(directory)
        for flag, value in (("seed", 1), ("global_batch_size", 32)):
            with flagsaver.flagsaver(**{**quick, flag: value, "steps": 6}):
                with self.assertRaisesRegex(
                        ValueError, f"belong to another run: it read its data with "
                        f"--{flag}={quick[flag]}, and this run with --{flag}={value} .*; "
                        f"rerun with --{flag}={quick[flag]}, or delete") as caught:
                    train.train()
            self.assertNotIn("\n", str(caught.exception))
            self.assertEqual(_files(directory), files)

    def test_command_line_resume_applies_a_new_learning_rate_and_says_so(self):
        # The case: --learning_rate=0 on resume, where the checkpoint's rate was
        # restored and the weights kept moving.
        directory = self.create_tempdir().full_path
        quick = dict(model="mlp", num_towers=2, global_batch_size=64, checkpoint_dir=directory)
        with flagsaver.flagsaver(**quick, steps=3, learning_rate=0.002):
            train.train()
        before = checkpoint_values(directory)
        with flagsaver.flagsaver(**quick, steps=6, learning_rate=0.0):
            with self.assertLogs("absl", "INFO") as logs:
                self.assertEqual(train.train()["steps"], 6)
        changed = [line for line in logs.output if "changed settings" in line]
        self.assertLen(changed, 1)
        self.assertRegex(changed[0], r"resumed from \S+ckpt-1 with changed settings: "
                         r"--learning_rate 0.002 -> 0, --steps 3 -> 6\.$")
        after = checkpoint_values(directory)
        rates = [name for name in after if "learning_rate" in name]
        self.assertLen(rates, 1)
        self.assertEqual(after[rates[0]], 0.0)
        for name, value in before.items():  # a rate of 0 moves no weight
            if "/kernel" in name or "/bias" in name:
                self.assertAllEqual(value, after[name], msg=name)
        with open(os.path.join(directory, "run.json")) as f:  # the new run's, all JSON
            self.assertEqual(json.load(f)["settings"]["steps"], 6)
        self.assertEqual([name for name in os.listdir(directory) if "tmp" in name], [])

    def test_python_resume_with_another_data_order_is_refused_naming_it(self):
        directory = self.create_tempdir().full_path

        def fit(seed, epochs):
            trainer = _trainer(_sequential(keras.layers.Dense(3)), keras.optimizers.SGD(0.1))
            checkpointer = towers.Checkpointer(
                directory, trainer.model, trainer.optimizer,
                run=towers.RunIdentity(data_order={"seed": seed}))
            trainer.fit(_dataset(), epochs=epochs, steps_per_epoch=STEPS_PER_EPOCH,
                        checkpointer=checkpointer, verbose=False)
            return trainer

        fit(0, 1)
        self.assertEqual(fit(0, 2).step, 2 * STEPS_PER_EPOCH)  # the same order resumes
        other = _trainer(_sequential(keras.layers.Dense(3)), keras.optimizers.SGD(0.1))
        self._assert_refused(lambda: fit(1, 3), "it read its data with seed=0, and this run "
                             "with seed=1 .*; rerun with seed=0, or delete", other, directory)
        for run, message in ((dict(data_order=[0]), "data_order must be a dict with str keys"),
                             (dict(settings={"log": print}), "settings must hold JSON values")):
            with self.assertRaisesRegex(ValueError, message):
                towers.RunIdentity(**run)
        with self.assertRaisesRegex(ValueError, "run must be a towers.RunIdentity"):
            towers.Checkpointer(directory, other.model, other.optimizer, run={"seed": 0})

    def test_a_learning_rate_given_again_stays_as_restored_and_a_new_one_is_applied(self):
        # A callback lowered the rate; a resume given the rate the run was given keeps the
        # lowered one the checkpoint holds, a resume given another rate takes it.
        directory = self.create_tempdir().full_path
        lower = keras.callbacks.LambdaCallback(
            on_epoch_end=lambda epoch, logs: setattr(trainer.model.optimizer,
                                                     "learning_rate", 0.003))
        trainer = _trainer(_sequential(keras.layers.Dense(3)), keras.optimizers.Adam(0.01))
        trainer.fit(_dataset(), epochs=1, steps_per_epoch=STEPS_PER_EPOCH, verbose=False,
                    callbacks=[lower], checkpointer=towers.Checkpointer(
                        directory, trainer.model, trainer.optimizer))
        for given, epochs, expected in ((0.01, 2, 0.003), (0.005, 3, 0.005)):
            resumed = _trainer(_sequential(keras.layers.Dense(3)), keras.optimizers.Adam(given))
            with self.assertLogs("absl", "INFO") as logs:
                _fit(resumed, epochs, directory)
            self.assertAllClose(float(resumed.optimizer.learning_rate), expected)
            changed = [line for line in logs.output if "changed settings" in line]
            self.assertEqual(bool(changed), given != 0.01)
        self.assertRegex(changed[0], r"with changed settings: learning_rate 0.01 -> 0.005\.$")

    def test_a_second_live_writer_is_refused_and_a_killed_ones_lock_does_not_stay(self):
        directory = self.create_tempdir().full_path
        holder = subprocess.Popen(  # a run's lock, held by a bare process: no TensorFlow
            [sys.executable, "-c", _HOLD_LOCK, folder_lock.__file__, directory],
            stdout=subprocess.PIPE, text=True)
        self.addCleanup(holder.kill)
        self.assertEqual(holder.stdout.readline().strip(), "held")
        trainer = _trainer(_sequential(keras.layers.Dense(3)), keras.optimizers.SGD(0.1))
        self._assert_refused(
            lambda: _fit(trainer, 1, directory),
            rf"another run is writing checkpoints to \S+: a live process holds its lock "
            rf"\S+{folder_lock.LOCK_FILE} .*; wait for it to end, or give this run another "
            "checkpoint directory", trainer, directory)
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        self.assertEqual(_fit(trainer, 1, directory).step, STEPS_PER_EPOCH)


_HOLD_LOCK = """
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("folder_lock", sys.argv[1])
folder_lock = importlib.util.module_from_spec(spec)
spec.loader.exec_module(folder_lock)
folder_lock.acquire(sys.argv[2])
print("held", flush=True)
time.sleep(600)
"""


if __name__ == "__main__":
    tf.test.main()
