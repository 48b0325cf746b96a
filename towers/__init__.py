"""towers: data-parallel TensorFlow 2 training written out by hand.

Each step splits the global batch into one shard per tower, runs forward and
backward on every tower under `tf.device`, gathers the gradients on a main
device, averages them weighted by shard size, and applies them once. A tower
may itself be a pipeline: the model cut into stages on devices of their own.
"""

try:
    import tensorflow as _tf  # noqa: F401
except ImportError:  # pragma: no cover - exercised only without TensorFlow
    raise ImportError(
        "towers needs TensorFlow: install it with `pip install towers[cpu]` "
        "(CPU) or `pip install towers[gpu]` (NVIDIA GPU)."
    ) from None

from towers import exchange  # noqa: F401  (towers.exchange.AGGREGATIONS)
from towers.aggregate import average_gradients
from towers.cluster import Cluster, cluster_from_tf_config
from towers.cluster import join as join_cluster
from towers.devices import configure_devices
from towers.checkpoint import Checkpointer
from towers.errors import DeviceConfigError, NonFiniteError, Preempted, WorkerLostError
from towers.split import split_batch
from towers.stages import split_model
from towers.step import TowerOptions, tower_gradients
from towers.trainer import TowerTrainer

__all__ = [
    "Checkpointer",
    "Cluster",
    "DeviceConfigError",
    "NonFiniteError",
    "Preempted",
    "TowerOptions",
    "TowerTrainer",
    "WorkerLostError",
    "average_gradients",
    "cluster_from_tf_config",
    "configure_devices",
    "join_cluster",
    "split_batch",
    "split_model",
    "tower_gradients",
]
__version__ = "0.1.0"
