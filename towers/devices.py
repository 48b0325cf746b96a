"""Devices: choosing the towers' (set-up), naming them, laying them out as a `Mesh`.

`configure_devices` must run before TensorFlow initialises its runtime, because
logical devices (several towers carved out of one physical GPU or out of the
CPU) can only be declared before then.
"""

import shutil
import subprocess

import tensorflow as tf

from towers.errors import DeviceConfigError

DEVICE_TYPES = ("auto", "gpu", "cpu")
# The runtime keeps some memory of each GPU for itself; logical GPUs share the rest.
_GPU_MEMORY_FRACTION = 0.9

_configured_devices = None


def configure_devices(num_towers=4, device_type="auto", memory_limit_mb=None):
    """Declares one device per tower and returns their names.

    Args:
      num_towers: how many towers (int >= 1).
      device_type: "auto" (physical GPUs when there are enough, else one physical
        GPU split into `num_towers` logical GPUs, else the CPU split into
        `num_towers` logical CPU devices), "gpu" or "cpu".
      memory_limit_mb: memory of each logical GPU in MiB; None = an equal share
        of 90% of the card. Ignored for CPU devices.

    Returns:
      list of `num_towers` device names, e.g. ["/device:GPU:0", "/device:GPU:1"].

    Raises:
      ValueError: bad arguments.
      DeviceConfigError: the layout cannot be made, e.g. the runtime already
        started with fewer devices.
    """
    global _configured_devices
    _check_arguments(num_towers, device_type, memory_limit_mb)
    gpus = tf.config.list_physical_devices("GPU")
    if device_type == "gpu" and not gpus:
        raise DeviceConfigError(
            "device_type='gpu' but TensorFlow sees no GPU; use device_type='cpu' "
            "or 'auto', or install the GPU build with `pip install towers[gpu]`.")
    if device_type == "cpu" or not gpus:
        devices = _split_physical(tf.config.list_physical_devices("CPU")[:1], "CPU",
                                  num_towers, memory_limit_mb=None)
    else:
        physical = gpus[:num_towers] if len(gpus) >= num_towers else gpus
        devices = _split_physical(physical, "GPU", num_towers, memory_limit_mb)
    _configured_devices = devices
    return list(devices)


def default_devices():
    """The last `configure_devices` result, else every visible GPU, else every CPU device."""
    if _configured_devices is not None:
        return list(_configured_devices)
    gpus = tf.config.list_logical_devices("GPU")
    return [canonical_name(d.name) for d in (gpus or tf.config.list_logical_devices("CPU"))]


def canonical_name(device):
    """'/job:localhost/replica:0/task:0/device:GPU:1' or '/gpu:1' (or a
    tf.config.LogicalDevice of that name) -> '/device:GPU:1'."""
    device = _by_name(device)
    try:
        spec = tf.DeviceSpec.from_string(device)
    except (ValueError, TypeError, AttributeError):  # "/gpu:banana", 0, None
        raise ValueError(f"device {device!r} is not a device name; use e.g. "
                         "'/device:GPU:0' or '/device:CPU:1'.") from None
    if spec.device_type is None:
        raise ValueError(f"device {device!r} names no device type; use e.g. '/device:GPU:0'.")
    return f"/device:{spec.device_type}:{spec.device_index or 0}"


def device_list(devices):
    """`devices` as a list (None: default_devices()); a single name is refused.

    Raises:
      ValueError: `devices` is one name (a tower list of one is ["/device:GPU:0"]) or
        not a list.
    """
    if devices is None:
        return default_devices()
    if isinstance(devices, tf.config.LogicalDevice):
        devices = devices.name  # one device: refused below as one name is
    if not isinstance(devices, str):
        try:
            return [_by_name(d) for d in devices]
        except TypeError:
            pass
    raise ValueError(f"devices must be a list of device names, one per tower, e.g. "
                     f"[{devices!r}], not a single {type(devices).__name__}.")


def _by_name(device):
    """A tf.config.LogicalDevice (a namedtuple, which would read as a row of a grid) as its
    name, in a list or grid of devices; other entries as they are."""
    if isinstance(device, tf.config.LogicalDevice):
        return device.name
    if isinstance(device, (list, tuple)):
        return [_by_name(d) for d in device]
    return device


def device_grid(devices, num_stages=None):
    """The devices as rows (towers) x columns (pipeline stages) of canonical names.

    Without pipeline stages (num_stages None) `devices` is a flat list, one
    device per tower; with them, a list of rows of num_stages devices.
    """
    if not devices:
        raise ValueError("devices is empty; give at least one tower device.")
    nested = [isinstance(d, (list, tuple)) for d in devices]
    if num_stages is None:
        if any(nested):
            raise ValueError(
                f"devices {devices} is a grid (rows of devices), which is for pipeline stages; "
                "pass pipeline_cuts too, or a flat list with one device per tower.")
        return [[canonical_name(d)] for d in devices]
    if not all(nested):
        raise ValueError(
            f"with pipeline_cuts, devices must be a grid: one row per tower, each a list of "
            f"{num_stages} devices (one per stage), e.g. "
            f"[[\"/device:GPU:0\", \"/device:GPU:1\"]]; got {devices}.")
    lengths = [len(row) for row in devices]
    if set(lengths) != {num_stages}:
        raise ValueError(
            f"every row of devices needs {num_stages} devices, one per pipeline stage "
            f"(len(pipeline_cuts) + 1), but the rows have {lengths} devices.")
    return [[canonical_name(d) for d in row] for row in devices]


class Mesh:
    """Which devices are towers, stages and parts: a step's one picture of its devices,
    its dimensions named as torch.distributed.init_device_mesh(..., mesh_dim_names=
    ("tower", "stage", "part")) names them. Built once from TowerTrainer's devices= (the
    nested lists: a list of towers, towers x stages, towers x parts, towers x stages x
    parts), then passed down.

    Attributes:
      grid: grid[i][k], tower i's device for stage k: where it runs the stage's layers
        that are not split. One stage without pipeline cuts.
      parts: None for a model without split layers, else parts[i][k][j], tower i's
        device for stage k's part j.
      main_device: where stage 0's variables live and the loss and outputs meet.
      stage_devices: per stage, its main device: where its variables live and its
        gradients meet (stage 0's main_device, stage k's tower 0's device for it).
    """
    DIM_NAMES = ("tower", "stage", "part")

    def __init__(self, grid, parts=None, main_device=None):
        """grid, parts: as the attributes, of canonical names; main_device: None for
        tower 0's stage 0 device."""
        self.grid, self.parts = grid, parts
        self.main_device = canonical_name(main_device or grid[0][0])
        self.stage_devices = [self.main_device] + list(grid[0][1:])

    @property
    def shape(self):
        """{dimension name: its size}."""
        return dict(zip(self.DIM_NAMES, (len(self.grid), len(self.grid[0]),
                                         1 if self.parts is None else len(self.parts[0][0]))))

    @property
    def num_towers(self):
        return len(self.grid)

    @property
    def num_stages(self):
        return len(self.grid[0])

    def tower(self, i):
        """Tower i's device per stage."""
        return self.grid[i]

    def stage(self, k):
        """Every tower's device for stage k, tower by tower."""
        return [devices[k] for devices in self.grid]

    def tower_devices(self, i):
        """Tower i's devices in one order alike for every tower: its stages', or with
        split layers its stages' parts'."""
        if self.parts is None:
            return list(self.grid[i])
        return [device for stage in self.parts[i] for device in stage]

    def all_devices(self):
        """Every device of the mesh, once."""
        return list(dict.fromkeys(sum(self.grid, []) + [
            device for i in range(self.num_towers) for device in self.tower_devices(i)]))


def mesh_of(devices, num_stages=None, parts=None, main_device=None):
    """The Mesh of `devices` (a flat list, one device per tower; with num_stages, rows of
    num_stages devices, one row per tower) and a split model's `parts` (None, or
    parts[i][k][j]: op_parallel.grid.split_devices' reading of devices=).

    Raises:
      ValueError: devices of the wrong shape (device_grid), or one that does not exist.
    """
    mesh = Mesh(device_grid(devices, num_stages), parts, main_device)
    check_devices_exist(mesh.all_devices())
    check_devices_exist([mesh.main_device], "main_device")
    return mesh


def check_devices_exist(devices, argument="devices"):
    """Raises ValueError naming any device in `devices` that TensorFlow does not have,
    and `argument`, the argument they were given as ("main_device": one device)."""
    available = [canonical_name(d.name) for d in tf.config.list_logical_devices()]
    missing = [d for d in dict.fromkeys(devices) if d not in available]
    if missing:
        what = (f"{argument} {missing} do not exist" if argument == "devices"
                else f"{argument} {missing[0]!r} does not exist")
        raise ValueError(
            f"{what}; available devices are {available}. "
            "Call towers.configure_devices(num_towers=N) before anything else in "
            "TensorFlow runs to create more.")


def size_thread_pools(intra_op_threads, inter_op_threads):
    """Sizes TensorFlow's two process-wide thread pools (0 or None keeps its choice).

    Raises ValueError once TensorFlow's runtime has started, which fixes them.
    """
    for name, threads, set_threads in (
            ("intra_op_threads", intra_op_threads,
             tf.config.threading.set_intra_op_parallelism_threads),
            ("inter_op_threads", inter_op_threads,
             tf.config.threading.set_inter_op_parallelism_threads)):
        if threads:
            try:
                set_threads(threads)
            except RuntimeError:
                raise ValueError(
                    f"{name}={threads} comes too late: TensorFlow's runtime already "
                    "started in this process and fixed its thread pools; set it in a fresh "
                    "process, before anything runs TensorFlow.") from None


def _check_arguments(num_towers, device_type, memory_limit_mb):
    if isinstance(num_towers, bool) or not isinstance(num_towers, int) or num_towers < 1:
        raise ValueError(f"num_towers must be an integer >= 1, got {num_towers!r}.")
    if device_type not in DEVICE_TYPES:
        raise ValueError(f"device_type must be one of {DEVICE_TYPES}, got {device_type!r}.")
    if memory_limit_mb is not None and (
            isinstance(memory_limit_mb, bool) or not isinstance(memory_limit_mb, int)
            or memory_limit_mb < 1):
        raise ValueError(
            f"memory_limit_mb must be a positive integer (MiB) or None, got {memory_limit_mb!r}.")


def _split_physical(physical, kind, num_towers, memory_limit_mb):
    """Splits each of `physical` into equal logical devices: num_towers in all."""
    if num_towers % len(physical):
        raise DeviceConfigError(
            f"cannot spread {num_towers} towers evenly over {len(physical)} physical "
            f"{kind}s; use a multiple of {len(physical)}.")
    per_device = num_towers // len(physical)
    if kind == "GPU" and per_device > 1 and memory_limit_mb is None:
        memory_limit_mb = int(_GPU_MEMORY_FRACTION * _smallest_gpu_memory_mb() / per_device)
    wanted = [tf.config.LogicalDeviceConfiguration(memory_limit=memory_limit_mb)] * per_device
    if kind == "GPU" and per_device == 1 and memory_limit_mb is None:
        wanted = None  # the whole card, no logical split
    for device in physical:
        if _layout(tf.config.get_logical_device_configuration(device)) == _layout(wanted):
            continue
        try:
            tf.config.set_logical_device_configuration(device, wanted)
        except RuntimeError:
            return _reuse_existing(kind, num_towers, memory_limit_mb)
    return [f"/device:{kind}:{i}" for i in range(num_towers)]


def _reuse_existing(kind, num_towers, memory_limit_mb):
    """After the runtime started: the first num_towers existing devices, if they fit."""
    existing = tf.config.list_logical_devices(kind)
    layouts = [_layout(tf.config.get_logical_device_configuration(d))
               for d in tf.config.list_physical_devices(kind)]
    # Every logical device, of every physical one, must have the memory asked for.
    memory_ok = memory_limit_mb is None or all(
        layout is not None and set(layout) == {memory_limit_mb} for layout in layouts)
    if len(existing) >= num_towers and memory_ok:
        return [f"/device:{kind}:{i}" for i in range(num_towers)]
    raise DeviceConfigError(
        f"TensorFlow's runtime already started with {len(existing)} {kind} device(s), "
        f"so {num_towers} towers (memory_limit_mb={memory_limit_mb}) cannot be made now. "
        "Call towers.configure_devices(...) first thing in your program, before any "
        "other TensorFlow or Keras call creates a tensor or lists devices.")


def _layout(configs):
    """Comparable form of a logical device configuration: a tuple of memory limits."""
    if not configs:
        return None
    return tuple(c.memory_limit for c in configs)


def _smallest_gpu_memory_mb():
    """Total memory of the smallest visible GPU in MiB, read from nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        raise DeviceConfigError(
            "cannot read GPU memory (no nvidia-smi) to split the GPU evenly; pass "
            "memory_limit_mb= to configure_devices.")
    output = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, check=True).stdout
    return min(int(line) for line in output.split())
