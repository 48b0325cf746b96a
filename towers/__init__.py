"""towers: data-parallel TensorFlow 2 training written out by hand.

Each step splits the global batch into one shard per tower, runs forward and
backward on every tower under `tf.device`, gathers the gradients on a main
device, averages them weighted by shard size, and applies them once. A tower
may itself be a pipeline: the model cut into stages on devices of their own.

The packages, one per part (docs/architecture.md; imports point down the list):
  cli/             the command line: towers-train, model specs, built-in models, data
  training/        TowerTrainer, its compiled steps, executions, the fit loop, callbacks,
                   checkpoints, preemption, input staging
  multi_worker/    the cluster of workers, its watchdog and the local launcher
  op_parallel/     split layers: a layer's parts on their own devices
  data_parallel/   the seven steps: split, replicas, tower, losses, aggregate, exchange, step
  model_parallel/  pipeline stages and their schedules
  devices, errors  shared by all of them
"""

import importlib
import sys

try:
    import tensorflow as _tf  # noqa: F401
except ImportError:  # pragma: no cover - exercised only without TensorFlow
    raise ImportError(
        "towers needs TensorFlow: install it with `pip install towers[cpu]` "
        "(CPU) or `pip install towers[gpu]` (NVIDIA GPU)."
    ) from None

from towers.data_parallel import exchange  # noqa: F401  (towers.exchange.AGGREGATIONS)
from towers.data_parallel.aggregate import average_gradients
from towers.data_parallel.custom_step import StepOutput, tower_step
from towers.data_parallel.split import split_batch
from towers.data_parallel.options import TowerOptions
from towers.data_parallel.slabs import whole_variables
from towers.data_parallel.step import tower_gradients
from towers.devices import configure_devices
from towers.errors import DeviceConfigError, NonFiniteError, Preempted, WorkerLostError
from towers.model_parallel.stages import split_model
from towers.op_parallel.plan import join_layers, split_layers
from towers.multi_worker.cluster import Cluster, cluster_from_tf_config
from towers.multi_worker.cluster import join as join_cluster
from towers.training.checkpoint import Checkpointer
from towers.training.trainer import TowerTrainer

# Modules that lived directly in towers/ before the packages: their old paths
# (`import towers.trainer`, `from towers import split`) name the same module object.
# towers.train is a file of its own, since `python -m towers.train` runs it.
_MOVED = {
    "aggregate": "data_parallel", "exchange": "data_parallel", "losses": "data_parallel",
    "split": "data_parallel", "step": "data_parallel", "tower": "data_parallel",
    "schedule": "model_parallel", "stages": "model_parallel",
    "callbacks": "training", "checkpoint": "training", "compiled": "training",
    "executions": "training", "loop": "training", "preemption": "training",
    "prefetch": "training", "trainer": "training",
    "cluster": "multi_worker", "launch": "multi_worker",
    "data": "cli", "data_files": "cli", "model_spec": "cli", "models": "cli",
}
for _name, _package in _MOVED.items():
    _module = importlib.import_module(f"towers.{_package}.{_name}")
    sys.modules.setdefault(f"towers.{_name}", _module)
    globals().setdefault(_name, _module)

__all__ = [
    "Checkpointer",
    "Cluster",
    "DeviceConfigError",
    "NonFiniteError",
    "Preempted",
    "StepOutput",
    "TowerOptions",
    "TowerTrainer",
    "WorkerLostError",
    "average_gradients",
    "cluster_from_tf_config",
    "configure_devices",
    "join_cluster",
    "join_layers",
    "split_batch",
    "split_layers",
    "split_model",
    "tower_gradients",
    "tower_step",
]
__version__ = "0.1.0"
