"""The training set-ups compared by the benchmark, each behind one small interface, `Mode`.

Every mode trains a model built from the same seed (so all start from identical
weights) with the same loss and optimizer on the same fixed global batch, which
is made once and placed on the devices before timing (tf_cnn_benchmarks' synthetic
data). Every step ends with the loss fetched as a Python float: one host sync per
step in every mode (the *_spe10 and bare_loop modes aside, below), so no mode
gains from queueing steps ahead of the host.

    plain...         one device, whole batch, a GradientTape step in a tf.function
                     (plain_xla: the same tf.function with jit_compile=True)
    keras_fit...     one device, model.compile + model.fit, one entry per FIT_CONFIGS row
    bare...          the floor: N devices, the seven steps and nothing else, written
                     without the library (benchmarks/bare.py), one entry per
                     BARE_CONFIGS row: bare reads the batch from the main device;
                     bare_loop runs 10 steps per call over tf.data, as towers_spe10;
                     bare_xla compiles each tower's forward and backward with XLA
    towers...        towers.TowerTrainer on N devices, one entry per TOWER_CONFIGS row;
                     towers_fit and towers_fit_spe10 train with TowerTrainer.fit,
                     timed per call by a callback as the Keras fit modes are
    independent      N devices, no gradient exchange: each tower trains its own copy
    mirrored_custom  tf.distribute.MirroredStrategy, strategy.run of a GradientTape step
    mirrored_fit     MirroredStrategy with model.compile + model.fit

The Keras fit modes and the towers modes with an "input" (towers_tfdata,
towers_staged, towers_spe10..., towers_fit...) are fed through tf.data (the
same batch, repeated), because that is how fit takes data and how it splits a
batch over replicas, and how an in-graph loop reads its batches; every other
mode reads tensors that already sit on its devices. "tf.data": the host batch goes into
the step, which splits it and copies each shard to its tower; "staged": the
input pipeline splits it and stages each shard on its tower's device ahead of
the step (TowerTrainer.shard_iterator) and TowerTrainer.train_steps reads them
in its compiled loop, one step per call in towers_staged: what fit does with
prefetch_to_devices (on by default on GPUs only). Only the modes named
*_xla compile with XLA. keras_fit_xla_spe10 runs 10 steps per call of fit's
compiled function, towers_spe10* 10 steps per call of TowerTrainer.train_steps
(towers' defaults otherwise, no XLA), towers_fit_spe10 10 per call of
TowerTrainer.fit's and bare_loop 10 bare steps per call, and so fetch their
logs once per 10 steps: that saving is what they measure. towers_fit against
towers_tfdata (train_step on the same tf.data input, one step per call) and
towers_fit_spe10 against towers_spe10 show what fit's outer loop costs.
"""

import dataclasses
import functools
import itertools
import time
from typing import Callable

import keras
import numpy as np
import tensorflow as tf

import towers
from benchmarks import bare

LEARNING_RATE = 0.01
MOMENTUM = 0.9

AGGREGATIONS = ("main", "tree", "collective", "nccl")
VARIABLE_PLACEMENTS = ("main", "replicated")


def _tower_configs():
    """TowerTrainer keyword arguments per towers mode, by mode name.

    "towers" is the library's defaults; then every aggregation x
    variable_placement, and gradient packing. "input" is not the trainer's:
    "tf.data" or "staged" (see above); without it, constants on the main
    device; "fit": TowerTrainer.fit over tf.data. An option the library does not know yet raises TypeError/ValueError
    when the trainer is built and the mode is reported as unsupported, so its
    rows light up once the library has it.
    """
    configs = {"towers": {}}
    for aggregation, placement in itertools.product(AGGREGATIONS, VARIABLE_PLACEMENTS):
        if (aggregation, placement) != ("main", "main"):  # that is "towers"
            configs[f"towers_{aggregation}_{placement}"] = {
                "aggregation": aggregation, "variable_placement": placement}
    configs["towers_packed"] = {"pack_gradients": True}
    configs["towers_xla"] = {"jit_compile": True}
    configs["towers_tfdata"] = {"input": "tf.data"}
    configs["towers_staged"] = {"input": "staged"}
    configs["towers_spe10"] = {"steps_per_execution": 10, "input": "tf.data"}  # ExecutionMode
    configs["towers_spe10_staged"] = {"steps_per_execution": 10, "input": "staged"}
    configs["towers_fit"] = {"input": "fit"}  # FitMode: TowerTrainer.fit over setup.dataset()
    configs["towers_fit_spe10"] = {"steps_per_execution": 10, "input": "fit"}
    return configs


TOWER_CONFIGS = _tower_configs()
# Options of the one-device GradientTape loop, and compile() arguments of Keras fit, by mode.
# jit_compile=False is explicit: Keras would turn XLA on by itself on a GPU.
PLAIN_CONFIGS = {"plain": {"jit_compile": False}, "plain_xla": {"jit_compile": True}}
FIT_CONFIGS = {"keras_fit": {"jit_compile": False},
               "keras_fit_xla": {"jit_compile": True},
               "keras_fit_xla_spe10": {"jit_compile": True, "steps_per_execution": 10}}
# The floor (benchmarks/bare.py), by mode: bare reads constants on the main device, bare_loop
# runs 10 steps per call over tf.data as towers_spe10 does.
BARE_CONFIGS = {"bare": {}, "bare_loop": {"steps_per_execution": 10},
                "bare_xla": {"jit_compile": True}}
SINGLE_DEVICE_MODES = (*PLAIN_CONFIGS, *FIT_CONFIGS)
MULTI_DEVICE_MODES = (*BARE_CONFIGS, *TOWER_CONFIGS, "independent", "mirrored_custom",
                      "mirrored_fit")
MODES = SINGLE_DEVICE_MODES + MULTI_DEVICE_MODES


class Unsupported(Exception):
    """The library does not (yet) offer what a mode asks for; the message says what."""


@dataclasses.dataclass(frozen=True)
class Setup:
    """What every mode of one model shares.

    Attributes:
      make_model: callable() -> a built keras.Model, identical weights every call;
        its variables go to the current device or strategy scope.
      x, y: the global batch in host memory, (B, H, W, C) float32 and (B,) int32.
    """
    make_model: Callable[[], keras.Model]
    x: np.ndarray
    y: np.ndarray

    @property
    def global_batch_size(self):
        return len(self.x)

    def shards(self, num_towers):
        """The batch split like towers.split_batch: sizes differ by at most one, larger first."""
        sizes = towers.split.shard_sizes(self.global_batch_size, num_towers)
        bounds = np.cumsum([0] + sizes)
        return [(self.x[a:b], self.y[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]

    def dataset(self):
        """The whole batch as one tf.data element, repeated forever (no copy per step)."""
        return tf.data.Dataset.from_tensors((self.x, self.y)).repeat()


class Mode:
    """One way of training, built and ready to time.

    Attributes:
      name: e.g. "plain", "towers", "mirrored_custom".
      num_towers: how many devices it trains on.
      model: the keras.Model it trains (for independent: tower 0's copy).
      info: extra facts for results.json (options, cross-device ops).
    """

    def __init__(self, name, num_towers, step, model, info=None):
        self.name, self.num_towers, self.info = name, num_towers, dict(info or {})
        self.model, self._step = model, step

    def run(self, num_steps):
        """Runs `num_steps` training steps; returns each one's wall time in seconds."""
        times = []
        for _ in range(num_steps):
            start = time.perf_counter()
            self._step()  # returns the loss as a float: the step's host sync
            times.append(time.perf_counter() - start)
        return times

    def weights(self):
        """The weights now, as a list of NumPy arrays (for independent: tower 0's copy)."""
        return self.model.get_weights()


class ExecutionMode(Mode):
    """A mode that runs several steps per call: execute(max_steps) runs up to max_steps in one
    call (one host sync) and returns how many ran.

    Each sample is one call's time divided by its steps, as FitMode's, so such a
    mode has fewer samples.
    """

    def __init__(self, name, num_towers, execute, model, info=None):
        super().__init__(name, num_towers, None, model, info)
        self._execute = execute

    def run(self, num_steps):
        times, left = [], num_steps
        while left > 0:
            start = time.perf_counter()
            steps = self._execute(left)
            times.append((time.perf_counter() - start) / steps)
            left -= steps
        return times


class FitMode(Mode):
    """A mode trained by a fit method, keras.Model.fit (the default) or TowerTrainer.fit;
    steps are timed by a callback.

    With steps_per_execution=K fit calls back once per K steps, so each sample
    is one call's time divided by its steps: such a mode has fewer samples.
    """

    def __init__(self, name, num_towers, model, dataset, info=None, fit=None):
        super().__init__(name, num_towers, None, model, info)
        # shuffle=False: Keras's default True warns on every call that a Dataset ignores it.
        self._dataset = dataset
        self._fit = fit or functools.partial(model.fit, shuffle=False)

    def run(self, num_steps):
        timer = _StepTimer(num_steps)
        # Exactly num_steps batches: fit's in-graph loop stops at their end, so a last call
        # of fewer than K steps runs only those (as steps_per_epoch would not).
        self._fit(self._dataset.take(num_steps), epochs=1, verbose=False, callbacks=[timer])
        return timer.times


class _StepTimer(keras.callbacks.Callback):
    """Wall time per step of each call of fit's step function, from one call's end to the
    next (the first from its begin), divided by the steps the call ran.

    Both fits hand on_train_batch_end the logs as Python floats, every call
    (Keras converts them because the method is defined; TowerTrainer.fit always
    does): one host sync per call, as in the other modes (which make one call
    per step). Fit's set-up before the first call is not counted.
    """

    def __init__(self, num_steps):
        super().__init__()
        self.times, self._num_steps, self._first_step, self._last = [], num_steps, 0, None

    def on_train_batch_begin(self, batch, logs=None):
        self._first_step = batch  # the call's first step
        if self._last is None:
            self._last = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        # batch: the call's last step, first + K - 1 even where the data ended sooner.
        now = time.perf_counter()
        steps = min(batch + 1, self._num_steps) - self._first_step
        self.times.append((now - self._last) / steps)
        self._last = now


def build(name, setup, devices):
    """Builds mode `name` on `devices`; returns a Mode. Raises Unsupported."""
    for configs, builder in ((TOWER_CONFIGS, _towers), (PLAIN_CONFIGS, _plain),
                             (FIT_CONFIGS, _keras_fit), (BARE_CONFIGS, _bare)):
        if name in configs:
            return builder(name, configs[name], setup, devices)
    return _BUILDERS[name](setup, devices)


def make_optimizer():
    return keras.optimizers.SGD(LEARNING_RATE, momentum=MOMENTUM)


def make_loss(reduction="sum_over_batch_size"):
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)


def _plain(name, options, setup, devices):
    device = devices[0]
    with tf.device(device):
        model, optimizer = setup.make_model(), make_optimizer()
        optimizer.build(model.trainable_variables)
        x, y = tf.constant(setup.x), tf.constant(setup.y)
    loss_fn = make_loss()

    @tf.function(jit_compile=options["jit_compile"])
    def step():
        with tf.device(device):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True)) + _regularization(model)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

    return Mode(name, 1, lambda: float(step()), model, {"options": options})


def _keras_fit(name, options, setup, devices):
    with tf.device(devices[0]):
        model = setup.make_model()
        model.compile(optimizer=make_optimizer(), loss=make_loss(), **options)
    return FitMode(name, 1, model, setup.dataset(), {"options": options})


def _towers(name, options, setup, devices):
    with tf.device(devices[0]):  # the main device holds the variables
        model = setup.make_model()
        batch = (tf.constant(setup.x), tf.constant(setup.y))
    trainer_options = {k: v for k, v in options.items() if k != "input"}
    try:
        trainer = towers.TowerTrainer(model, make_loss(), make_optimizer(), devices=devices,
                                      **trainer_options)
    except (TypeError, ValueError) as error:
        raise Unsupported(f"{type(error).__name__}: {error}") from None
    info = {"options": options}
    if options.get("input") == "fit":
        return FitMode(name, len(devices), model, setup.dataset(), info, fit=trainer.fit)
    iterator = {None: None, "tf.data": iter, "staged": trainer.shard_iterator}[
        options.get("input")]
    iterator = iterator and iterator(setup.dataset())
    # fit reads staged shards in its compiled loop even at one step per call.
    if trainer.steps_per_execution == 1 and options.get("input") != "staged":
        def step():
            return trainer.train_step(batch if iterator is None else next(iterator))["loss"]

        return Mode(name, len(devices), step, model, info)

    # Calls of at most steps_per_execution steps (the trainer's very first call runs one).
    def execute(max_steps):
        logs = trainer.train_steps(iterator, min(max_steps, trainer.steps_per_execution))
        return logs["steps"]  # the data repeats forever: never 0

    return ExecutionMode(name, len(devices), execute, model, info)


def _bare(name, options, setup, devices):
    """The floor: benchmarks/bare.py's step, one per call or 10 per call over tf.data."""
    with tf.device(devices[0]):  # the main device holds the variables and the batch
        model, optimizer = setup.make_model(), make_optimizer()
        optimizer.build(model.trainable_variables)
        x, y = tf.constant(setup.x), tf.constant(setup.y)
    train_step = bare.train_step_fn(model, make_loss(), optimizer, devices,
                                    setup.global_batch_size, options.get("jit_compile", False))
    info, steps_per_execution = {"options": options}, options.get("steps_per_execution", 1)
    if steps_per_execution == 1:
        step = tf.function(lambda: train_step(x, y))
        return Mode(name, len(devices), lambda: float(step()), model, info)
    iterator = iter(setup.dataset())  # on the host, as towers_spe10's

    @tf.function
    def steps(num_steps):
        """Up to num_steps steps over `iterator` in one call; returns how many ran."""
        ran = tf.constant(0)
        for _ in tf.range(num_steps):
            batch = iterator.get_next_as_optional()
            if not batch.has_value():
                break
            train_step(*batch.get_value())
            ran += 1
        return ran

    def execute(max_steps):  # reading the count is the call's one host sync
        return int(steps(tf.constant(min(max_steps, steps_per_execution))))

    return ExecutionMode(name, len(devices), execute, model, info)


def _independent(setup, devices):
    """Each tower trains its own copy on its shard with its own optimizer: no communication."""
    replicas = []
    for device, (x, y) in zip(devices, setup.shards(len(devices))):
        with tf.device(device):
            model, optimizer = setup.make_model(), make_optimizer()
            optimizer.build(model.trainable_variables)
            replicas.append((model, optimizer, tf.constant(x), tf.constant(y)))
    loss_fn = make_loss()

    @tf.function
    def step():
        losses = []
        for i, (device, (model, optimizer, x, y)) in enumerate(zip(devices, replicas)):
            with tf.device(device), tf.name_scope(f"tower_{i}"):
                with tf.GradientTape() as tape:
                    loss = loss_fn(y, model(x, training=True)) + _regularization(model)
                grads = tape.gradient(loss, model.trainable_variables)
                optimizer.apply_gradients(zip(grads, model.trainable_variables))
                losses.append(loss)
        with tf.device(devices[0]):
            return tf.add_n(losses) / len(losses)

    return Mode("independent", len(devices), lambda: float(step()), replicas[0][0])


def _mirrored_custom(setup, devices):
    strategy, cross_device_ops = _mirrored_strategy(devices)
    with strategy.scope():
        model, optimizer = setup.make_model(), make_optimizer()
        # Keras 3 optimizers must create their slots in the scope before the first step.
        optimizer.build(model.trainable_variables)
    shards = setup.shards(len(devices))

    def on_replica(context):
        x, y = shards[context.replica_id_in_sync_group]
        with tf.device(strategy.extended.worker_devices[context.replica_id_in_sync_group]):
            return tf.constant(x), tf.constant(y)

    x, y = strategy.experimental_distribute_values_from_function(on_replica)
    per_example = make_loss(reduction=None)
    global_batch_size = float(setup.global_batch_size)

    def replica_step(x, y):
        # Sum over the replica's examples / global batch: the strategy sums the gradients.
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(per_example(y, model(x, training=True))) / global_batch_size
            loss += _regularization(model) / strategy.num_replicas_in_sync
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def step():
        losses = strategy.run(replica_step, args=(x, y))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    return Mode("mirrored_custom", len(devices), lambda: float(step()), model,
                {"cross_device_ops": cross_device_ops})


def _mirrored_fit(setup, devices):
    strategy, cross_device_ops = _mirrored_strategy(devices)
    with strategy.scope():
        model = setup.make_model()
        model.compile(optimizer=make_optimizer(), loss=make_loss(), jit_compile=False)
    return FitMode("mirrored_fit", len(devices), model, setup.dataset(),
                   {"cross_device_ops": cross_device_ops})


def _mirrored_strategy(devices):
    """MirroredStrategy on `devices` and the name of its cross-device ops.

    NCCL where every device is its own physical GPU, else ReductionToOneDevice
    (NCCL cannot run two ranks on one GPU, nor on CPUs). Not the default
    collective all-reduce: it numbers its groups from 1 in every strategy, so
    strategies of different sizes in one process clash.
    """
    physical_gpus = tf.config.list_physical_devices("GPU")
    logical_gpus = tf.config.list_logical_devices("GPU")
    all_gpus = all("GPU" in towers.devices.canonical_name(d) for d in devices)
    if all_gpus and len(physical_gpus) == len(logical_gpus) and len(devices) > 1:
        cross_device_ops = tf.distribute.NcclAllReduce()
    else:
        cross_device_ops = tf.distribute.ReductionToOneDevice()
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=cross_device_ops)
    return strategy, type(cross_device_ops).__name__


def _regularization(model):
    return tf.add_n(model.losses) if model.losses else 0.0


_BUILDERS = {"independent": _independent, "mirrored_custom": _mirrored_custom,
             "mirrored_fit": _mirrored_fit}
