"""configure_devices on the 4 logical CPU devices conftest made, and in a fresh process."""

import subprocess
import sys
import textwrap
from unittest import mock

import tensorflow as tf
from absl.testing import parameterized

import towers


class ConfigureDevicesTest(tf.test.TestCase, parameterized.TestCase):

    def test_existing_layout_returns_same_devices(self):
        expected = [f"/device:CPU:{i}" for i in range(4)]
        self.assertEqual(towers.configure_devices(4, "cpu"), expected)
        self.assertEqual(towers.configure_devices(4, "auto"), expected)

    def test_fewer_towers_reuse_existing_devices(self):
        self.assertEqual(towers.configure_devices(2, "cpu"), ["/device:CPU:0", "/device:CPU:1"])

    def test_more_towers_than_devices_after_start(self):
        with self.assertRaisesRegex(towers.DeviceConfigError, "already started with 4 CPU"):
            towers.configure_devices(8, "cpu")

    def test_device_config_error_is_runtime_error(self):
        self.assertTrue(issubclass(towers.DeviceConfigError, RuntimeError))

    def test_gpu_without_gpu(self):
        with self.assertRaisesRegex(towers.DeviceConfigError, "sees no GPU"):
            towers.configure_devices(2, "gpu")

    @parameterized.parameters(0, -2, 1.5, "4")
    def test_bad_num_towers(self, num_towers):
        with self.assertRaisesRegex(ValueError, "num_towers must be an integer >= 1"):
            towers.configure_devices(num_towers)

    def test_bad_device_type(self):
        with self.assertRaisesRegex(ValueError, "device_type must be one of"):
            towers.configure_devices(2, "tpu")

    def test_bad_memory_limit(self):
        with self.assertRaisesRegex(ValueError, "memory_limit_mb"):
            towers.configure_devices(2, memory_limit_mb=-5)

    @parameterized.named_parameters(("same_memory", 1000, True), ("other_memory", 2000, False))
    def test_fewer_towers_of_gpus_split_before(self, memory_limit_mb, reused):
        # Two physical GPUs, each split into two logical GPUs of 1000 MiB when the
        # runtime started; now 2 towers are asked for, which would be whole GPUs.
        gpus = [tf.config.PhysicalDevice(f"/physical_device:GPU:{i}", "GPU") for i in range(2)]
        logical = [tf.config.LogicalDevice(f"/device:GPU:{i}", "GPU") for i in range(4)]
        split = [tf.config.LogicalDeviceConfiguration(memory_limit=1000)] * 2

        def started(*_):
            raise RuntimeError("Virtual devices cannot be modified after being initialized")

        with mock.patch.object(tf.config, "list_physical_devices", lambda kind=None: gpus), \
                mock.patch.object(tf.config, "list_logical_devices", lambda kind=None: logical), \
                mock.patch.object(tf.config, "get_logical_device_configuration",
                                  lambda device: split), \
                mock.patch.object(tf.config, "set_logical_device_configuration", started), \
                mock.patch.object(towers.devices, "_configured_devices", None):
            if reused:
                self.assertEqual(towers.configure_devices(2, "gpu", memory_limit_mb),
                                 ["/device:GPU:0", "/device:GPU:1"])
            else:
                with self.assertRaisesRegex(towers.DeviceConfigError,
                                            r"already started with 4 GPU.*memory_limit_mb=2000"):
                    towers.configure_devices(2, "gpu", memory_limit_mb)

    def test_fresh_process_splits_cpu_before_start(self):
        script = textwrap.dedent("""
            import towers, tensorflow as tf
            print(towers.configure_devices(3, "auto"))
            print(towers.configure_devices(3, "auto"))
            print(len(tf.config.list_logical_devices("CPU")))
            try:
                towers.configure_devices(5)
            except towers.DeviceConfigError as e:
                print("DeviceConfigError", "configure_devices(...) first" in str(e))
        """)
        output = subprocess.run([sys.executable, "-c", script], capture_output=True,
                                text=True, check=True).stdout.splitlines()
        names = "['/device:CPU:0', '/device:CPU:1', '/device:CPU:2']"
        self.assertEqual(output, [names, names, "3", "DeviceConfigError True"])


if __name__ == "__main__":
    tf.test.main()
