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
                     without the library (bare.py), one entry per
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

import itertools

import tensorflow as tf

import towers
from benchmarks.harness import bare, baselines
from benchmarks.harness.mode import ExecutionMode, FitMode, Mode, Unsupported, make_loss
from benchmarks.harness.mode import make_optimizer, regularization

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
# The floor (bare.py), by mode: bare reads constants on the main device, bare_loop
# runs 10 steps per call over tf.data as towers_spe10 does.
BARE_CONFIGS = {"bare": {}, "bare_loop": {"steps_per_execution": 10},
                "bare_xla": {"jit_compile": True}}
SINGLE_DEVICE_MODES = (*PLAIN_CONFIGS, *FIT_CONFIGS)
MULTI_DEVICE_MODES = (*BARE_CONFIGS, *TOWER_CONFIGS, "independent", "mirrored_custom",
                      "mirrored_fit")
MODES = SINGLE_DEVICE_MODES + MULTI_DEVICE_MODES


def build(name, setup, devices):
    """Builds mode `name` on `devices`; returns a Mode. Raises Unsupported."""
    for configs, builder in ((TOWER_CONFIGS, _towers), (PLAIN_CONFIGS, _plain),
                             (FIT_CONFIGS, _keras_fit), (BARE_CONFIGS, _bare)):
        if name in configs:
            return builder(name, configs[name], setup, devices)
    return baselines.BUILDERS[name](setup, devices)


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
                loss = loss_fn(y, model(x, training=True)) + regularization(model)
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
    """The floor: bare.py's step, one per call or 10 per call over tf.data."""
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
