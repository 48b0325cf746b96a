"""towers: data-parallel TensorFlow 2 training written out by hand.

Each step splits the global batch into one shard per tower, runs forward and
backward on every tower under `tf.device`, gathers the gradients on a main
device, averages them weighted by shard size, and applies them once. A tower
may itself be a pipeline: the model cut into stages on devices of their own.

The packages (docs/architecture.md; each imports only what its table row allows):
  cli/             the command line: towers-train, model specs, built-in models, data
  training/        TowerTrainer, its compiled steps, executions, the fit loop, callbacks,
                   checkpoints, preemption, input staging
  multi_worker/    the cluster of workers, its watchdog and the local launcher
  engine/          the step the three techniques plug into: run_towers, a tower's run,
                   the forward and its loss, TowerOptions, tower_step
  placement/       where variables and optimizer state live: columns, slabs, owners
  data_parallel/   split, replicas, aggregate, exchange, collectives, batch statistics
  model_parallel/  pipeline stages, their schedules, the flight through them
  op_parallel/     split layers: a layer's parts on their own devices
  devices, errors, gradients, compat   shared by all of them
"""

import importlib as _importlib
import importlib.abc as _importlib_abc
import importlib.util as _importlib_util
import sys as _sys

try:
    import tensorflow as _tf  # noqa: F401
except ImportError:  # pragma: no cover - exercised only without TensorFlow
    raise ImportError(
        "towers needs TensorFlow: install it with `pip install towers[cpu]` "
        "(CPU) or `pip install towers[gpu]` (NVIDIA GPU)."
    ) from None

from towers.data_parallel import exchange  # noqa: F401  (towers.exchange.AGGREGATIONS)
from towers.data_parallel.aggregate import average_gradients
from towers.engine.custom_step import StepOutput, tower_step
from towers.data_parallel.split import split_batch
from towers.engine.options import TowerOptions
from towers.placement.slabs import whole_variables
from towers.engine.loop_gradients import tower_gradients
from towers.devices import configure_devices
from towers.errors import (CheckpointWriteError, DeviceConfigError, NonFiniteError, Preempted,
                           WorkerLostError)
from towers.model_parallel.stages import split_model
from towers.op_parallel.auto import auto_plan
from towers.op_parallel.plan import join_layers, split_layers
from towers.multi_worker.cluster import Cluster, cluster_from_tf_config
from towers.multi_worker.cluster import join as join_cluster
from towers.training.checkpoint import Checkpointer
from towers.training.run_record import RunIdentity
from towers.training.trainer import TowerTrainer

# Modules that lived directly in towers/ before the packages: their old paths
# (`import towers.trainer`, `from towers import split`, `towers.models`) name the same
# module objects, imported when first named, so `import towers` imports no command line.
# towers.train is a file of its own, since `python -m towers.train` runs it.
_MOVED = {
    "aggregate": "data_parallel", "exchange": "data_parallel", "split": "data_parallel",
    "losses": "engine", "step": "engine", "tower": "engine",
    "schedule": "model_parallel", "stages": "model_parallel",
    "callbacks": "training", "checkpoint": "training", "compiled": "training",
    "executions": "training", "loop": "training", "preemption": "training",
    "prefetch": "training", "trainer": "training",
    "cluster": "multi_worker", "launch": "multi_worker",
    "data": "cli", "data_files": "cli", "model_spec": "cli", "models": "cli",
}


def __getattr__(name):
    """towers.<old module name>: the moved module (PEP 562), imported now."""
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return _moved(name)


def _moved(name):
    module = _importlib.import_module(f"{__name__}.{_MOVED[name]}.{name}")
    _sys.modules.setdefault(f"{__name__}.{name}", module)
    globals()[name] = module
    return module


class _MovedModules(_importlib_abc.MetaPathFinder, _importlib_abc.Loader):
    """`import towers.<old module name>`: the moved module under its old path."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, name = fullname.rpartition(".")
        if package != __name__ or name not in _MOVED:
            return None
        return _importlib_util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        module = _moved(spec.name.rpartition(".")[2])
        self._own_spec = module.__spec__  # the import system sets the alias's; put back
        return module

    def exec_module(self, module):
        module.__spec__ = self._own_spec


_sys.meta_path.append(_MovedModules())

__all__ = [
    "CheckpointWriteError",
    "Checkpointer",
    "Cluster",
    "DeviceConfigError",
    "NonFiniteError",
    "Preempted",
    "RunIdentity",
    "StepOutput",
    "TowerOptions",
    "TowerTrainer",
    "WorkerLostError",
    "auto_plan",
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
    "whole_variables",
]
__version__ = "0.1.0"
