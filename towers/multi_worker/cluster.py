"""Past one machine: the workers of a cluster, joined by TensorFlow's own runtime.

Every worker runs the same program with its own task index; worker 0 is the
chief. `join` starts this worker's TensorFlow gRPC server with collective
ops enabled (what MultiWorkerMirroredStrategy does underneath), waits until
every worker has joined, and starts a watchdog that ends a step whose peers
stopped answering. The cross-worker all-reduce of the gradients is
collectives.all_reduce_across_workers; the tower step is unchanged.
"""

import dataclasses
import json
import os
import socket
import zlib

import tensorflow as tf
from absl import logging
# Public TensorFlow has no call that starts a collective-enabled server for an
# eager program; MultiWorkerMirroredStrategy uses exactly these two.
from tensorflow.core.protobuf import tensorflow_server_pb2

from towers import compat, errors
from towers.data_parallel import collectives, exchange
from towers.errors import WorkerLostError
from towers.multi_worker.watchdog import Watchdog

JOB = "worker"
DEFAULT_PEER_TIMEOUT_S = 30.0
DEFAULT_STARTUP_TIMEOUT_S = 300.0
DEFAULT_STEP_TIMEOUT_S = 1800.0
HOST_DEVICE = "/device:CPU:0"  # every worker has one: control messages go there
_JOBS_IN_ORDER = ("chief", "worker")  # TF_CONFIG jobs, in task-index order
# The Watchdog of the cluster this process joined; a process joins at most one.
_joined = None


@dataclasses.dataclass(frozen=True)
class Cluster:
    """The workers of a synchronous data-parallel job and which one this process is.

    Attributes:
      workers: "host:port" of every worker; the position is its task index.
      task_index: this process's position in `workers`; 0 is the chief.
      peer_timeout_s: a worker that does not answer for this long during a
        step ends the step on every other worker (WorkerLostError).
      startup_timeout_s: how long `join` waits for every worker to join.
      step_timeout_s: a call of the step (its first one's tracing included) that no
        worker finishes for this long ends on every worker (WorkerLostError): workers
        that all answer but wait on each other for ever.
    """
    workers: tuple
    task_index: int
    peer_timeout_s: float = DEFAULT_PEER_TIMEOUT_S
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S
    step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S

    def __post_init__(self):
        object.__setattr__(self, "workers", tuple(self.workers))
        if not self.workers:
            raise ValueError("the cluster has no workers; list at least one 'host:port'.")
        for address in self.workers:
            _check_address(address)
        duplicates = sorted({a for a in self.workers if self.workers.count(a) > 1})
        if duplicates:
            raise ValueError(f"the cluster lists {duplicates} more than once; give every "
                             "worker its own host:port.")
        if (isinstance(self.task_index, bool) or not isinstance(self.task_index, int)
                or not 0 <= self.task_index < len(self.workers)):
            raise ValueError(f"task index {self.task_index!r} is not a worker of this cluster "
                             f"of {len(self.workers)}; use 0..{len(self.workers) - 1}.")
        for name in ("peer_timeout_s", "startup_timeout_s", "step_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}.")

    @property
    def num_workers(self):
        return len(self.workers)

    @property
    def is_chief(self):
        """True on worker 0, the one that writes checkpoints, summaries and results."""
        return self.task_index == 0

    def task_name(self, index):
        """TensorFlow's name of worker `index`, e.g. '/job:worker/replica:0/task:1'."""
        return f"/job:{JOB}/replica:0/task:{index}"


def cluster_from_tf_config(tf_config=None, **timeouts):
    """The Cluster that TF_CONFIG describes, or None when it is unset or empty.

    TF_CONFIG is the JSON every TensorFlow worker gets, e.g.
    {"cluster": {"worker": ["10.0.0.1:2222", "10.0.0.2:2222"]},
     "task": {"type": "worker", "index": 1}}. A "chief" job, if given, is
    worker 0 and the "worker" job follows it.

    Args:
      tf_config: the JSON text; None = the TF_CONFIG environment variable.
      **timeouts: peer_timeout_s, startup_timeout_s, step_timeout_s as in Cluster.
    """
    text = os.environ.get("TF_CONFIG", "") if tf_config is None else tf_config
    if not text.strip():
        return None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"TF_CONFIG is not valid JSON ({error}); it should look like "
                         '{"cluster": {"worker": ["host:port", ...]}, "task": {"type": '
                         '"worker", "index": 0}}.') from None
    cluster, task = config.get("cluster"), config.get("task")
    if not isinstance(cluster, dict) or not isinstance(task, dict):
        got = sorted(config) if isinstance(config, dict) else type(config).__name__
        raise ValueError(f'TF_CONFIG needs a "cluster" object and a "task" object, got {got}.')
    others = sorted(set(cluster) - set(_JOBS_IN_ORDER))
    if others:
        raise ValueError(f"TF_CONFIG's cluster has jobs {others}; towers trains synchronously "
                         "on 'chief' and 'worker' tasks only (no parameter servers or "
                         "evaluators): remove them.")
    jobs = {job: cluster.get(job, []) for job in _JOBS_IN_ORDER}
    if not all(isinstance(hosts, list) for hosts in jobs.values()):
        raise ValueError("TF_CONFIG's cluster must map each job to a list of 'host:port'.")
    task_type, index = task.get("type"), task.get("index")
    if task_type not in _JOBS_IN_ORDER or not jobs[task_type]:
        raise ValueError(f"TF_CONFIG's task type {task_type!r} is not a job of its cluster "
                         f"{sorted(j for j in jobs if jobs[j])}.")
    if isinstance(index, bool) or not isinstance(index, int) \
            or not 0 <= index < len(jobs[task_type]):
        raise ValueError(f"TF_CONFIG's task index {index!r} is out of range: its "
                         f"{task_type!r} job has {len(jobs[task_type])} task(s).")
    offset = len(jobs["chief"]) if task_type == "worker" else 0
    return Cluster(tuple(jobs["chief"] + jobs["worker"]), offset + index, **timeouts)


def join(cluster):
    """Starts this worker's server and waits until every worker of `cluster` has joined.

    Call it once per process (towers.join_cluster), after
    towers.configure_devices; then pass `cluster` to TowerTrainer.

    Raises:
      ValueError: this worker's port is in use, the workers disagree on the
        cluster, or not all of them joined within cluster.startup_timeout_s.
    """
    global _joined
    if _joined is not None:
        if _joined.cluster != cluster:
            raise ValueError(f"this process already joined the cluster {_joined.cluster}; "
                             "a process can join one cluster only.")
        return cluster
    _check_port_free(cluster)
    config = compat.eager_runtime().config
    # Collective groups are formed by the chief; each worker talks only to its own task.
    config.experimental.collective_group_leader = cluster.task_name(0)
    del config.device_filters[:]
    config.device_filters.append(cluster.task_name(cluster.task_index))
    server_def = tensorflow_server_pb2.ServerDef(
        cluster=tf.train.ClusterSpec({JOB: list(cluster.workers)}).as_cluster_def(),
        default_session_config=config, job_name=JOB, task_index=cluster.task_index,
        protocol="grpc", port=_port(cluster.workers[cluster.task_index]))
    try:
        compat.eager_runtime().enable_collective_ops(server_def)
        compat.eager_runtime().ensure_initialized()
    except tf.errors.OpError as error:
        raise ValueError(f"worker {cluster.task_index} could not start its server on "
                         f"{cluster.workers[cluster.task_index]}: {errors.root_cause(error)}.") from None
    logging.info("worker %d of %d: waiting up to %.0f s for the others to join",
                 cluster.task_index, cluster.num_workers, cluster.startup_timeout_s)
    check_same(cluster, {"cluster addresses": cluster.workers},
               timeout_s=cluster.startup_timeout_s)
    _joined = Watchdog(cluster)
    logging.info("worker %d of %d: all workers joined", cluster.task_index, cluster.num_workers)
    return cluster


def watchdog(cluster):
    """The Watchdog of `cluster`, which this process must have joined."""
    if not isinstance(cluster, Cluster):
        raise ValueError(f"cluster must be a towers.Cluster (the one towers.join_cluster "
                         f"joined), got {type(cluster).__name__}.")
    if _joined is None or _joined.cluster != cluster:
        raise ValueError(f"this process has not joined {cluster}; call "
                         "towers.join_cluster(cluster) first, on every worker.")
    return _joined


def check_same(cluster, values, timeout_s=None):
    """Raises ValueError naming each entry of `values` that differs between workers.

    `values`: dict name -> anything with a stable repr; every worker must call
    this with the same names in the same order (it is one all-reduce).
    WorkerLostError: a worker stopped meanwhile.
    """
    fingerprints = tf.constant([zlib.crc32(repr(v).encode()) for v in values.values()],
                               tf.int64)
    try:
        with tf.device(HOST_DEVICE), collectives.instance_keys(("check_same", tuple(values))):
            # max(f) and max(-f) = -min(f): equal on every worker only if all agree.
            highest = collectives.all_reduce_across_workers(
                [tf.concat([fingerprints, -fingerprints], 0)], cluster, HOST_DEVICE,
                merge_op="Max", timeout_s=timeout_s or 0)[0].numpy()
    except tf.errors.DeadlineExceededError:
        raise ValueError(
            f"not every one of the {cluster.num_workers} workers {list(cluster.workers)} joined "
            f"within {timeout_s:.0f} s. Start each of them with the same cluster and its own "
            "task index, and check that they can reach each other's ports.") from None
    except tf.errors.UnavailableError as error:
        raise WorkerLostError(f"a worker stopped while the workers were comparing their set-up "
                              f"({errors.root_cause(error)}); restart every worker.") from None
    except tf.errors.OpError as error:
        raise ValueError(f"the workers could not agree on the cluster ({errors.root_cause(error)}); "
                         "give every worker the same list of addresses.") from None
    count = len(values)
    differ = [name for i, name in enumerate(values) if highest[i] != -highest[count + i]]
    if differ:
        raise ValueError(f"the workers disagree on: {', '.join(differ)}. Every worker must run "
                         "the same program with the same flags, apart from its task index.")


def start_together(cluster, model, optimizer, options, main_device, num_towers,
                   own_slots=False, step_shape=None):
    """Before the first step: checks that every worker trains alike, then gives each
    the chief's weights and optimizer state (models built without a common seed
    would start apart).

    Args:
      options: the trainer's TowerOptions; main_device: its main device;
      num_towers: this worker's towers; own_slots: each worker's optimizer holds
        the slots of its own share of the variables (spread placement,
        placement/worker_owners.py): only its step count is the chief's.
      step_shape: {what: value} of the trainer's own settings that shape each call's
        collectives (steps per call, stages and parts per tower, ...): workers that
        differ in one would wait on each other for ever, so each is checked by name.

    Returns:
      (first_tower, total_towers): the global index of this worker's first
      tower, and the towers of all workers together.
    """
    signature = model_signature(model)
    check_same(cluster, {
        "the model's variables": signature,
        "the optimizer": (type(optimizer).__name__, optimizer.get_config()),
        "the trainer's options": options,
        "the main device type": tf.DeviceSpec.from_string(main_device).device_type,
        "the optimizer steps taken (every worker must restore the same checkpoint)":
            int(optimizer.iterations.numpy()),
        **(step_shape or {}),
    })
    variables = model.variables + ([optimizer.iterations] if own_slots else optimizer.variables)
    with collectives.instance_keys(("start_together", signature)):
        chiefs, _ = exchange.mean_across_workers(
            [v.value for v in variables], float(cluster.is_chief), cluster, HOST_DEVICE)
        for variable, value in zip(variables, chiefs):
            variable.assign(value)
        towers_per_worker = collectives.all_reduce_across_workers(
            [tf.one_hot(cluster.task_index, cluster.num_workers, dtype=tf.int64) * num_towers],
            cluster, HOST_DEVICE)[0].numpy()
    return int(towers_per_worker[:cluster.task_index].sum()), int(towers_per_worker.sum())


def model_signature(model):
    """(path, shape, dtype) of every variable of `model`: alike on every worker that
    trains the same model (start_together checks it), whatever else each built."""
    return [(v.path, tuple(v.shape), v.dtype) for v in model.variables]


def _check_address(address):
    host, _, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"worker address {address!r} is not 'host:port' with a port in "
                         "1..65535, e.g. '127.0.0.1:2222'.")


def _port(address):
    return int(address.rpartition(":")[2])


def _check_port_free(cluster):
    # TensorFlow's gRPC server listens on 0.0.0.0:port, so that is what must be free.
    port = _port(cluster.workers[cluster.task_index])
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # As gRPC does: a port whose old connections linger in TIME_WAIT is free.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("0.0.0.0", port))
        except OSError as error:
            raise ValueError(
                f"port {port} of worker {cluster.task_index} "
                f"({cluster.workers[cluster.task_index]}) is in use ({error.strerror}); stop "
                "what holds it or give this worker another port.") from None
