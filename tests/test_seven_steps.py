"""examples/seven_steps.py: the algorithm written plainly trains as one device and as towers do."""

import os
import re
import subprocess
import sys

import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import towers
from examples import seven_steps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOLERANCE = 1e-5


def _devices():
    return [d.name for d in tf.config.list_logical_devices("CPU")]


def _optimizer():
    return keras.optimizers.SGD(learning_rate=0.1, momentum=0.9)


def _batches(batch_sizes):
    """One batch per entry of `batch_sizes`, each drawn with a seed of its own."""
    return [batch for step, size in enumerate(batch_sizes)
            for batch in seven_steps.make_batches(size, num_steps=1, seed=step)]


def _one_device_weights(batches):
    """A plain GradientTape loop on the whole batch, written here, not the example's."""
    model, optimizer = seven_steps.make_model(), _optimizer()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    for x, y in batches:
        with tf.GradientTape() as tape:
            value = loss(y, model(x, training=True))
        grads = tape.gradient(value, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return model.get_weights()


def _tower_trainer_weights(batches, devices):
    model = seven_steps.make_model()
    trainer = towers.TowerTrainer(
        model, keras.losses.SparseCategoricalCrossentropy(from_logits=True), _optimizer(),
        devices=devices)
    for batch in batches:
        trainer.train_step(batch)
    return model.get_weights()


class SevenStepsTest(tf.test.TestCase, parameterized.TestCase):

    def test_shard_sizes_match_numpy_array_split(self):
        for global_batch_size in range(13):
            for num_towers in (1, 3, 4):
                want = [len(s) for s in np.array_split(np.arange(global_batch_size), num_towers)]
                self.assertEqual(seven_steps.shard_sizes(global_batch_size, num_towers), want)

    @parameterized.named_parameters(
        # 30 rows on 4 towers: 8, 8, 7, 7; 3 rows: 1, 1, 1 and one tower empty.
        ("batch30_uneven", (30, 30, 30)),
        ("batch3_one_tower_empty", (3, 3, 3)),
        ("batch_size_changing", (30, 3, 12)),
    )
    def test_four_towers_match_one_device_and_tower_trainer(self, batch_sizes):
        devices = _devices()
        self.assertLen(devices, 4)
        batches = _batches(batch_sizes)
        got = seven_steps.train(seven_steps.make_model(), _optimizer(), batches,
                                devices).get_weights()
        for reference in (_one_device_weights(batches),
                          _tower_trainer_weights(batches, devices)):
            for want, actual in zip(reference, got):
                self.assertAllClose(want, actual, atol=TOLERANCE, rtol=TOLERANCE)

    def test_weights_move(self):
        # Guards the comparisons above against a step that changes nothing.
        before = seven_steps.make_model().get_weights()
        after = seven_steps.train(seven_steps.make_model(), _optimizer(), _batches((30,)),
                                  _devices()).get_weights()
        self.assertGreater(max(np.max(np.abs(a - b)) for a, b in zip(before, after)), 1e-3)

    def test_script_prints_difference_from_one_device(self):
        result = subprocess.run([sys.executable, os.path.join("examples", "seven_steps.py")],
                                cwd=ROOT, capture_output=True, text=True, timeout=300)
        self.assertEqual(result.returncode, 0, result.stderr[-2000:])
        match = re.search(r"largest weight difference from one device: (\S+)", result.stdout)
        self.assertIsNotNone(match, result.stdout)
        self.assertLess(float(match.group(1)), TOLERANCE)
