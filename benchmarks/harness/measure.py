"""Numbers about the runs: step-time statistics, model FLOPs, a matmul roofline, the machine."""

import math
import os
import platform
import time

import keras
import numpy as np
import tensorflow as tf

from towers.data_parallel import split

# 1.4826 * MAD estimates the standard deviation of normal data, ignoring outliers.
MAD_TO_SIGMA = 1.4826


def step_time_stats(times_s):
    """Summary of per-step wall times.

    Args:
      times_s: per-step times in seconds (all rounds together).

    Returns:
      dict of milliseconds: median_ms, uncertainty_ms (std / sqrt(n), None for
      n = 1), jitter_ms (1.4826 * median absolute deviation), and n.
    """
    ms = np.asarray(times_s, dtype=np.float64) * 1e3
    median = float(np.median(ms))
    uncertainty = float(np.std(ms, ddof=1) / math.sqrt(len(ms))) if len(ms) > 1 else None
    return {"median_ms": median, "uncertainty_ms": uncertainty,
            "jitter_ms": float(MAD_TO_SIGMA * np.median(np.abs(ms - median))), "n": len(ms)}


def training_flops_per_example(model):
    """Estimated FLOPs of one training step per example: 3 x the forward pass.

    The forward pass counts the multiply-adds (2 FLOPs each) of Dense and Conv2D
    layers from their kernel and output shapes; bias adds, activations, pooling,
    normalisation, embedding look-ups and the loss are left out. The backward
    pass costs about twice the forward (gradients for inputs and for weights),
    hence 3 x; it slightly overcounts the first layer, which needs no input gradient.
    Only layers with a symbolic output count: a subclassed model's have none, so
    its estimate is 0 (and its % peak with it).
    """
    forward = 0
    for layer in model.layers:
        if isinstance(layer, (keras.layers.Dense, keras.layers.Conv2D)):
            try:
                output_shape = layer.output.shape
            except (AttributeError, ValueError):  # never called on a keras.Input
                continue
            kernel = layer.kernel.shape             # Dense (in, out); Conv2D (kh, kw, in, out)
            positions = math.prod(output_shape[1:-1])  # output pixels (1 for Dense on a vector)
            forward += 2 * math.prod(kernel) * positions
    return 3 * forward


def matmul_flops_per_sec(device, size=None, chain=4, repeats=5):
    """The best FLOP/s of square float32 matmuls on `device`: the roofline's ceiling.

    Args:
      device: e.g. "/device:GPU:0".
      size: matrix side; None = 4096 on a GPU, 1024 on a CPU.
      chain: matmuls per call, so one call's launch and host sync are amortised.
      repeats: timed calls; the fastest counts.

    Returns:
      FLOP/s (float), 2 * size**3 * chain / the fastest call's seconds.
    """
    size = size or (4096 if "GPU" in device.upper() else 1024)
    with tf.device(device):
        a = tf.random.uniform((size, size), seed=1)
        b = tf.random.uniform((size, size), seed=2) / size  # keeps the chained values bounded

    @tf.function
    def product():
        with tf.device(device):
            c = a
            for _ in range(chain):
                c = tf.matmul(c, b)
            return tf.reduce_sum(c)

    float(product())  # trace and warm up
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        float(product())
        best = min(best, time.perf_counter() - start)
    return 2 * size ** 3 * chain / best


def machine_info(devices):
    """TensorFlow and Keras versions, devices, CPU count, platform, GPU names."""
    gpus = tf.config.list_physical_devices("GPU")
    return {
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "tower_devices": list(devices),
        "logical_devices": [d.name for d in tf.config.list_logical_devices()],
        "physical_gpus": [tf.config.experimental.get_device_details(g).get("device_name", g.name)
                          for g in gpus],
    }


def physical_device_count(devices):
    """How many physical devices `devices` (logical names) stand on, at most len(devices)."""
    kind = "GPU" if all("GPU" in d.upper() for d in devices) else "CPU"
    return max(1, min(len(devices), len(tf.config.list_physical_devices(kind))))


def wall_times(step, num_steps):
    """Calls step() `num_steps` times; returns each call's wall time in seconds. The step
    must wait for its work (return a float it read, or the logs of train_step)."""
    times = []
    for _ in range(num_steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


def time_interleaved(built, steps, rounds, seed):
    """Per-step seconds of each of the `built` modes (anything with run(num_steps) -> times):
    `rounds` blocks each, the modes in turn, their order shuffled per round, so that a
    slow spell of a shared machine falls on every mode alike."""
    block_sizes = split.shard_sizes(steps, rounds)
    order_rng = np.random.default_rng(seed)
    times = [[] for _ in built]
    for block in block_sizes:
        for i in order_rng.permutation(len(built)):
            times[i].extend(built[i].run(block))
    return times
