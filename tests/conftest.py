"""Splits the CPU into 4 logical devices before TensorFlow starts, so every
multi-tower path runs on any machine."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# TensorFlow turns its oneDNN kernels on by itself on recent Intel CPUs only; on
# everywhere, so the suite meets what most x86 users get (their convolutions
# mishandle 0-row inputs: tests/test_layers.py). Worker processes inherit it.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

import tensorflow as tf  # noqa: E402

NUM_TEST_DEVICES = 4

tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0],
    [tf.config.LogicalDeviceConfiguration()] * NUM_TEST_DEVICES)
tf.config.list_logical_devices()  # starts the runtime with this layout

# absltest's create_tempdir reads --test_tmpdir, parsed by absltest.main, which pytest
# does not run: its defaults, whichever test module a process imports first.
from absl import flags  # noqa: E402

flags.FLAGS.mark_as_parsed()
