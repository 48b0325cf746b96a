"""The baselines towers is measured against on the same devices: towers that exchange
nothing (the hardware's bound) and tf.distribute.MirroredStrategy, in a custom loop and
in Keras fit."""

import tensorflow as tf

from benchmarks.harness.mode import FitMode, Mode, make_loss, make_optimizer, regularization
from towers import devices as devices_lib


def independent(setup, devices):
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
                    loss = loss_fn(y, model(x, training=True)) + regularization(model)
                grads = tape.gradient(loss, model.trainable_variables)
                optimizer.apply_gradients(zip(grads, model.trainable_variables))
                losses.append(loss)
        with tf.device(devices[0]):
            return tf.add_n(losses) / len(losses)

    return Mode("independent", len(devices), lambda: float(step()), replicas[0][0])


def mirrored_custom(setup, devices):
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
            loss += regularization(model) / strategy.num_replicas_in_sync
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def step():
        losses = strategy.run(replica_step, args=(x, y))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    return Mode("mirrored_custom", len(devices), lambda: float(step()), model,
                {"cross_device_ops": cross_device_ops})


def mirrored_fit(setup, devices):
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
    all_gpus = all("GPU" in devices_lib.canonical_name(d) for d in devices)
    if all_gpus and len(physical_gpus) == len(logical_gpus) and len(devices) > 1:
        cross_device_ops = tf.distribute.NcclAllReduce()
    else:
        cross_device_ops = tf.distribute.ReductionToOneDevice()
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=cross_device_ops)
    return strategy, type(cross_device_ops).__name__


BUILDERS = {"independent": independent, "mirrored_custom": mirrored_custom,
            "mirrored_fit": mirrored_fit}
