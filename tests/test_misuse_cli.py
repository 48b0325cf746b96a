"""towers-train refuses a mistake in its data or its output path in one line, before any
training and before anything is written; the trainer refuses fractional class ids."""

import json
import os

import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import towers
from tests import reference
from tests.test_train import _main_in_process, _run_cli

FLAGS = ("--model=mlp", "--num_towers=2", "--global_batch_size=8", "--steps=1")
ROWS = 24  # training examples of the .npz files; 8 test ones


def _labels(*classes, rows=ROWS):
    """`rows` labels cycling through `classes`."""
    return np.resize(np.array(classes), rows)


class NpzTest(tf.test.TestCase, parameterized.TestCase):
    """--data_npz: the classes come from y_train."""

    def setUp(self):
        super().setUp()
        self.directory = self.create_tempdir().full_path
        self.npz = os.path.join(self.directory, "mine.npz")
        self.output = os.path.join(self.directory, "out.json")
        self.checkpoints = os.path.join(self.directory, "ckpt")

    def _write(self, y_train, y_test):
        pixels = np.random.default_rng(0).integers(0, 256, (ROWS + 8, 4, 4), np.uint8)
        np.savez(self.npz, x_train=pixels[:ROWS], y_train=y_train, x_test=pixels[ROWS:],
                 y_test=y_test)

    def _train(self, *flags):
        return _main_in_process(f"--data_npz={self.npz}", f"--output_json={self.output}",
                                f"--checkpoint_dir={self.checkpoints}", *FLAGS, *flags)

    def assert_refused_in_one_line(self, status, stderr, *named):
        self.assertNotEqual(status, 0)
        # A fresh process's stderr also has TensorFlow's start-up lines.
        ours = [line for line in stderr.splitlines() if line.startswith("towers-train")]
        self.assertLen(ours, 1, stderr)
        self.assertStartsWith(ours[0], "towers-train: error: ")
        self.assertNotIn("Traceback", stderr)
        for words in named:
            self.assertIn(words, ours[0])
        self.assertFalse(os.path.exists(self.output))
        self.assertFalse(os.path.exists(self.checkpoints))

    @parameterized.named_parameters(
        ("test_labels_beyond_the_training_classes", _labels(0, 1, 2), _labels(7, rows=8),
         ["y_test holds label 7 beyond y_train's classes 0..2", "the classes come from the "
          "training labels"]),
        ("a_label_far_beyond_the_others", np.append(_labels(0, 1, 2, rows=ROWS - 1), 10**6),
         _labels(0, 1, rows=8),
         ["y_train's largest label, 1000000, would make 1000001 classes, but y_train holds "
          "only 4 different labels", "renumber the labels 0..3"]),
        ("one_class", np.zeros(ROWS, int), np.zeros(8, int),
         ["y_train holds one class only (0)", "at least two classes"]),
        ("fractional_labels", _labels(0.0, 1.5), _labels(0, 1, rows=8),
         ["y_train (dtype float64) is not integer class ids", "whole numbers"]),
    )
    def test_labels_that_are_not_class_ids_are_refused(self, y_train, y_test, messages):
        self._write(y_train, y_test)
        self.assert_refused_in_one_line(*self._train(), f"data_npz file '{self.npz}'",
                                        *messages)

    def test_test_labels_among_the_training_classes_train_and_report(self):
        # Class 1 is trained but never tested; 3 classes, as in the plain model below.
        self._write(_labels(0, 1, 2), _labels(0, 2, rows=8))
        status, stderr = self._train()
        self.assertEqual(status, 0, stderr)
        with open(self.output) as f:
            results = json.load(f)
        self.assertEqual((results["dataset"], results["steps"]), ("npz", 1))
        self.assertBetween(results["eval_accuracy"], 0.0, 1.0)
        self.assertTrue(np.isfinite(results["eval_loss"]))

    def test_up_to_ten_classes_per_label_are_kept(self):
        # Labels 0 and 19: 20 classes for 2 labels, the most allowed.
        self._write(_labels(0, 19), _labels(19, 0, rows=8))
        status, stderr = self._train()
        self.assertEqual(status, 0, stderr)
        self.assertTrue(os.path.exists(self.output))

    def test_output_json_under_a_file_is_refused(self):
        self._write(_labels(0, 1), _labels(0, 1, rows=8))
        status, stderr = _main_in_process(f"--data_npz={self.npz}",
                                          f"--output_json={self.npz}/out.json", *FLAGS)
        self.assert_refused_in_one_line(
            status, stderr, f"--output_json={self.npz}/out.json: cannot write in "
                            f"'{self.npz}': Not a directory")

    def test_output_json_that_is_a_folder_is_refused(self):
        self._write(_labels(0, 1), _labels(0, 1, rows=8))
        status, stderr = _main_in_process(f"--data_npz={self.npz}",
                                          f"--output_json={self.directory}", *FLAGS)
        self.assert_refused_in_one_line(
            status, stderr, f"--output_json={self.directory} is a folder; give a file path")

    def test_output_json_in_a_new_folder_is_written_there(self):
        # As --checkpoint_dir, the folder is made: the README's --output_json=RUN/result.json.
        self._write(_labels(0, 1), _labels(0, 1, rows=8))
        self.output = os.path.join(self.directory, "run", "new", "out.json")
        status, stderr = self._train()
        self.assertEqual(status, 0, stderr)
        with open(self.output) as f:
            self.assertEqual(json.load(f)["steps"], 1)

    def test_the_program_refuses_an_output_json_under_a_file_before_training(self):
        self._write(_labels(0, 1), _labels(0, 1, rows=8))
        result = _run_cli(f"--data_npz={self.npz}", f"--output_json={self.npz}/out.json",
                          f"--checkpoint_dir={self.checkpoints}", *FLAGS)
        self.assert_refused_in_one_line(result.returncode, result.stderr,
                                        f"--output_json={self.npz}/out.json")


class FractionalClassIdsTest(tf.test.TestCase, parameterized.TestCase):
    """TowerTrainer with a sparse categorical loss: float labels must be whole numbers."""

    def _trainer(self, loss):
        return towers.TowerTrainer(reference.make_model(), loss, keras.optimizers.SGD(0.1),
                                   devices=[f"/device:CPU:{i}" for i in range(4)])

    @parameterized.named_parameters(("loss_object", reference.make_loss()),
                                    ("loss_name", "sparse_categorical_crossentropy"))
    def test_fractional_labels_are_refused_at_the_first_batch(self, loss):
        trainer = self._trainer(loss)
        x, y = reference.make_batches(8, num_steps=1, sample_weights=False)[0]
        y = y.astype(np.float32)
        y[5] = 1.5  # on tower 2 of 4
        untrained = reference.make_model().get_weights()
        with self.assertRaisesRegex(ValueError, "^the labels of a sparse categorical "
                                    "crossentropy loss are float32 and hold 1.5, not a class "
                                    "id; give whole-number class ids") as raised:
            trainer.train_step((x, y))
        self.assertLen(str(raised.exception).splitlines(), 1)
        self.assertEqual(trainer.step, 0)
        for want, got in zip(untrained, trainer.model.get_weights()):
            self.assertAllEqual(want, got)

    def test_whole_number_float_labels_train_as_class_ids(self):
        batch = reference.make_batches(8, num_steps=1)[0]
        trainer = self._trainer(reference.make_loss())
        x, y, w = batch
        trainer.train_step((x, y.astype(np.float32), w))
        want = reference.single_device_weights(reference.make_model(), keras.optimizers.SGD(0.1),
                                               reference.make_loss(), [batch])
        for expected, got in zip(want, trainer.model.get_weights()):
            self.assertAllClose(expected, got, atol=1e-6)

    def test_only_the_sparse_output_s_labels_must_be_whole(self):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((reference.NUM_FEATURES,))
        model = keras.Model(inputs, [keras.layers.Dense(reference.NUM_CLASSES)(inputs),
                                     keras.layers.Dense(1)(inputs)])
        loss = [keras.losses.SparseCategoricalCrossentropy(from_logits=True), "mse"]
        trainer = towers.TowerTrainer(model, loss, keras.optimizers.SGD(0.1),
                                      devices=[f"/device:CPU:{i}" for i in range(4)])
        x, y = reference.make_batches(8, num_steps=1, sample_weights=False)[0]
        values = np.linspace(-1, 1, 8, dtype=np.float32)[:, None]  # fractional: a regression
        classes = y.astype(np.float32)
        classes[0] = 0.25
        with self.assertRaisesRegex(ValueError, r"^the labels \(target 0 of 2\) .* hold 0.25"):
            trainer.train_step((x, (classes, values)))
        logits, predicted = model(x)  # untrained: the refused batch applied nothing
        want = loss[0](y, logits) + keras.losses.MeanSquaredError()(values, predicted)
        logs = trainer.train_step((x, (y.astype(np.float32), values)))
        self.assertEqual(trainer.step, 1)
        self.assertAllClose(want, logs["loss"], rtol=1e-5)


if __name__ == "__main__":
    tf.test.main()
