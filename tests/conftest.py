"""Splits the CPU into 4 logical devices before TensorFlow starts, so every
multi-tower path runs on any machine."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

NUM_TEST_DEVICES = 4

tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0],
    [tf.config.LogicalDeviceConfiguration()] * NUM_TEST_DEVICES)
tf.config.list_logical_devices()  # starts the runtime with this layout
