"""evaluate and fit against Keras computing the same numbers on one device."""

import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import towers
from tests import reference

DEVICES = [f"/device:CPU:{i}" for i in range(4)]


def _trainer(**kwargs):
    return towers.TowerTrainer(reference.make_model(), reference.make_loss(),
                               keras.optimizers.Adam(0.05), devices=DEVICES[:3], **kwargs)


class EvaluateTest(tf.test.TestCase, parameterized.TestCase):

    def test_batch_dataset_and_list_give_the_global_mean(self):
        trainer = _trainer(metrics=["accuracy"])
        x, y, w = reference.make_batches(23, num_steps=1)[0]
        model = trainer.model
        logits = model(x)
        expected_loss = float(reference.make_loss()(y, logits) + tf.add_n(model.losses))
        expected_accuracy = float(np.mean(np.argmax(logits, -1) == y))
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(5)  # last batch of 3
        for data in ((x, y), dataset, list(dataset)):
            logs = trainer.evaluate(data)
            self.assertAllClose(expected_loss, logs["loss"], atol=1e-6)
            self.assertAllClose(expected_accuracy, logs["accuracy"])

    def test_sample_weights_follow_keras(self):
        trainer = _trainer()
        x, y, w = reference.make_batches(9, num_steps=1)[0]
        expected = float(reference.make_loss()(y, trainer.model(x), sample_weight=w)
                         + tf.add_n(trainer.model.losses))
        self.assertAllClose(expected, trainer.evaluate((x, y, w))["loss"], atol=1e-6)

    @parameterized.parameters(
        (np.eye(3)[[0, 2, 1, 1]], "CategoricalAccuracy"),
        (np.array([0, 2, 1, 1]), "SparseCategoricalAccuracy"),
    )
    def test_accuracy_name_picks_the_keras_metric(self, y, kind):
        trainer = towers.TowerTrainer(
            reference.make_model(), keras.losses.CategoricalCrossentropy(from_logits=True)
            if y.ndim == 2 else reference.make_loss(), keras.optimizers.SGD(), devices=DEVICES,
            metrics=["accuracy"])
        trainer.evaluate((np.ones((4, 5), np.float32), y))
        self.assertEqual(type(trainer.metrics[0]).__name__, kind)

    def test_no_batches(self):
        with self.assertRaisesRegex(ValueError, "no batches"):
            _trainer().evaluate([])


class FitTest(tf.test.TestCase):

    def test_fit_equals_train_steps_and_learns(self):
        rng = np.random.default_rng(0)
        x = rng.normal(size=(60, 5)).astype(np.float32)
        y = (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0)  # a learnable 3-class rule
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)  # 16, 16, 16, 12

        trainer = _trainer(metrics=["accuracy"])
        before = trainer.evaluate((x, y))
        history = trainer.fit(dataset, epochs=4, validation_data=(x, y))
        after = trainer.evaluate((x, y))

        reference_trainer = _trainer()
        for _ in range(4):
            for batch in dataset:
                reference_trainer.train_step(batch)
        for a, b in zip(trainer.model.weights, reference_trainer.model.weights):
            self.assertAllClose(a, b, atol=1e-6)

        self.assertEqual(history.epoch, [0, 1, 2, 3])
        self.assertEqual(trainer.step, 16)
        self.assertAllClose(history.history["val_loss"][-1], after["loss"], atol=1e-6)
        self.assertLess(after["loss"], before["loss"] * 0.8)
        self.assertGreater(after["accuracy"], before["accuracy"])
        self.assertLen(history.history["loss"], 4)

    def test_steps_per_epoch_continues_one_iterator(self):
        x, y, _ = reference.make_batches(40, num_steps=1)[0]
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)  # 5 batches
        trainer = _trainer()
        history = trainer.fit(dataset, epochs=3, steps_per_epoch=2)
        self.assertEqual((trainer.step, history.epoch), (5, [0, 1, 2]))

    def test_bad_epochs(self):
        with self.assertRaisesRegex(ValueError, "epochs must be an integer >= 1"):
            _trainer().fit([], epochs=0)


if __name__ == "__main__":
    tf.test.main()
