"""A restore is all or nothing: a checkpoint that does not match the model and optimizer
(in their variables, their tables or the optimizer's class), or a checkpointer bound to
another model or optimizer than the trainer's, is refused in one line before any step, with the
weights, the step count and the checkpoint directory as they were; an unbuilt model
is built before its checkpoint is restored, and resumes as if never stopped."""

import os

import keras
import numpy as np
import tensorflow as tf
from absl import flags
from absl.testing import flagsaver, parameterized

import towers
from towers.cli import train

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


class RefusalTest(tf.test.TestCase):

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


if __name__ == "__main__":
    tf.test.main()
