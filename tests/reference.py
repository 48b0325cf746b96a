"""Independent references the tower trainer is checked against.

Nothing here imports towers: the expected weights come from a plain
single-device GradientTape loop and from tf.distribute.MirroredStrategy.
"""

import copy
import keras
import numpy as np
import tensorflow as tf

NUM_FEATURES = 5
NUM_CLASSES = 3


def make_model(seed=0, l2=0.01):
    """A tiny MLP with an L2-regularised hidden layer, same weights for the same seed."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((NUM_FEATURES,)),
        keras.layers.Dense(6, activation="tanh",
                           kernel_regularizer=keras.regularizers.L2(l2)),
        keras.layers.Dense(NUM_CLASSES),
    ])


def make_up_down_model(seed=0):
    """Dense "up" 8 (relu, L2) -> Dense "down" 7 (tanh) -> Dense "out" logits: a
    column -> row pair, a layer to place, layers to freeze by name."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((NUM_FEATURES,))
    hidden = keras.layers.Dense(8, activation="relu", name="up",
                                kernel_regularizer=keras.regularizers.L2(0.01))(inputs)
    hidden = keras.layers.Dense(7, activation="tanh", name="down")(hidden)
    return keras.Model(inputs, keras.layers.Dense(NUM_CLASSES, name="out")(hidden))


def make_conv_lstm_model(seed=0):
    """(6, 4) sequences -> Conv1D "conv" 5 (relu) -> LSTM 6 -> Dense logits: a
    convolution, a recurrent layer's while loop, a cut after "conv"."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6, 4))
    convolved = keras.layers.Conv1D(5, 3, activation="relu", name="conv")(inputs)
    recurrent = keras.layers.LSTM(6)(convolved)
    return keras.Model(inputs, keras.layers.Dense(NUM_CLASSES)(recurrent))


def subclassed_model():
    """A built subclassed keras.Model of one Dense layer named "dense": no layer graph."""
    class Subclassed(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(2)

        def call(self, x):
            return self.dense(x)

    model = Subclassed()
    model(np.zeros((1, 3), np.float32))
    return model


def make_loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(learning_rate=0.1, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(learning_rate=0.01),
}


def make_batches(global_batch_size, num_steps=5, seed=1, sample_weights=True):
    """`num_steps` batches (x, y[, sample_weight]) of float32 features and int labels."""
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(num_steps):
        x = rng.normal(size=(global_batch_size, NUM_FEATURES)).astype("float32")
        y = rng.integers(0, NUM_CLASSES, size=(global_batch_size,))
        w = rng.uniform(0.5, 2.0, size=(global_batch_size,)).astype("float32")
        batches.append((x, y, w) if sample_weights else (x, y))
    return batches


def single_device_weights(model, optimizer, loss, batches):
    """Trains `model` with a plain GradientTape step on each whole batch; returns weights."""
    for batch in batches:
        x, y = batch[0], batch[1]
        sample_weight = batch[2] if len(batch) == 3 else None
        with tf.GradientTape() as tape:
            value = loss(y, model(x, training=True), sample_weight=sample_weight)
            value += tf.add_n(model.losses) if model.losses else 0.0
        grads = tape.gradient(value, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return [v.numpy() for v in model.weights]


def mirrored_weights(make_model_fn, make_optimizer_fn, devices, batches):
    """The same training with MirroredStrategy's custom loop on `devices`.

    Each replica gets an explicit np.array_split shard; its loss is the sum of
    its per-example losses over the global batch size (plus the regularisation
    divided by the replica count), and the strategy sums gradients.
    """
    # ReductionToOneDevice: the default collective all-reduce keys its groups by
    # order of creation, so strategies of different sizes in one test process clash.
    strategy = tf.distribute.MirroredStrategy(
        devices, cross_device_ops=tf.distribute.ReductionToOneDevice())
    with strategy.scope():
        model = make_model_fn()
        optimizer = make_optimizer_fn()
        optimizer.build(model.trainable_variables)
    per_example = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

    @tf.function
    def step(shards, global_batch_size):
        def replica_step(x, y, w):
            with tf.GradientTape() as tape:
                losses = per_example(y, model(x, training=True)) * w
                value = tf.reduce_sum(losses) / global_batch_size
                if model.losses:
                    value += tf.add_n(model.losses) / strategy.num_replicas_in_sync
            grads = tape.gradient(value, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
        strategy.run(replica_step, args=shards)

    for x, y, w in batches:
        index_shards = np.array_split(np.arange(len(x)), len(devices))
        shards = strategy.experimental_distribute_values_from_function(
            lambda ctx: tuple(a[index_shards[ctx.replica_id_in_sync_group]] for a in (x, y, w)))
        step(shards, float(len(x)))
    return [v.numpy() for v in model.weights]


def per_shard_weights(model, optimizer, loss, batches, num_shards):
    """As single_device_weights, but each np.array_split shard runs on its own.

    What the docs promise for BatchNorm: each non-empty shard normalises with
    its own statistics; gradients and the new moving statistics are averaged
    weighted by shard size (state_policy="mean"). Without BatchNorm this is
    the one-device step.
    """
    for batch in batches:
        total = len(batch[0])
        before = [v.numpy() for v in model.non_trainable_variables]
        grads, states = None, []
        for rows in np.array_split(np.arange(total), num_shards):
            if not len(rows):
                continue
            for variable, value in zip(model.non_trainable_variables, before):
                variable.assign(value)
            x, y, *w = (part[rows] for part in batch)
            with tf.GradientTape() as tape:
                value = loss(y, model(x, training=True), sample_weight=w[0] if w else None)
                value += tf.add_n(model.losses) if model.losses else 0.0
            fraction = len(rows) / total
            shard_grads = [g * fraction for g in tape.gradient(value, model.trainable_variables)]
            grads = shard_grads if grads is None else [a + b for a, b in zip(grads, shard_grads)]
            states.append([v.numpy() * fraction for v in model.non_trainable_variables])
        for variable, parts in zip(model.non_trainable_variables, zip(*states)):
            variable.assign(np.sum(parts, axis=0))
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return [v.numpy() for v in model.weights]


def untouched_copy(model, optimizer, make_model):
    """(a model from make_model(), an optimizer of `optimizer`'s class and config) holding
    `model`'s weights and `optimizer`'s state, that no trainer has ever seen."""
    copy = make_model()
    copy.set_weights(model.get_weights())
    copy_optimizer = type(optimizer).from_config(optimizer.get_config())
    copy_optimizer.build(copy.trainable_variables)
    for mine, theirs in zip(copy_optimizer.variables, optimizer.variables):
        mine.assign(theirs)
    return copy, copy_optimizer


def plain_keras_steps(model, optimizer, loss, batch):
    """A GradientTape step with optimizer.apply_gradients on (x, y) = batch[:2], then
    model.compile(optimizer, loss) and train_on_batch; returns the weights and the
    optimizer's variables after both, as arrays."""
    x, y = batch[0], batch[1]
    with tf.GradientTape() as tape:
        value = loss(y, model(x, training=True))
        value += tf.add_n(model.losses) if model.losses else 0.0
    optimizer.apply_gradients(zip(tape.gradient(value, model.trainable_variables),
                                  model.trainable_variables))
    model.compile(optimizer=optimizer, loss=loss)
    model.train_on_batch(x, y)
    return [v.numpy() for v in model.weights + optimizer.variables]


# A matrix product's ops in traced_nodes: as traced, or as grappler fused it with what
# follows (a bias, an activation) in a tower's work optimised once (engine/tower_trace.py).
MATMUL_OPS = ("MatMul", "BatchMatMulV2", "_FusedMatMul", "_FusedBatchMatMulV2")


def traced_nodes(trainer):
    """The NodeDefs of every function a TowerTrainer has traced, a nested function's (a
    tf.cond's branches, the tower's work traced once and called on each tower, or a
    tower's copy of it) once per call, each named under its caller's name and on its
    caller's device where it names none (as the runtime inlines and places it)."""
    return [node for function in trainer._compiled.functions()
            for concrete in function._list_all_concrete_functions()
            for node in function_nodes(concrete)]


def function_nodes(concrete):
    """The NodeDefs of a ConcreteFunction and of the functions it calls (traced_nodes')."""
    graph = concrete.graph.as_graph_def()
    library = {f.signature.name: f for f in graph.library.function}
    return _called_nodes(graph.node, library, "", "")


def _called_nodes(nodes, library, device, scope):
    """`nodes` and those of the library functions they call, each named `scope` + its
    name and on `device` where it names none."""
    called = []
    for node in nodes:
        if (not node.device and device) or scope:
            node = copy.deepcopy(node)
            node.device = node.device or device
            node.name = scope + node.name
        called.append(node)
        for value in node.attr.values():
            for name in [value.func.name] + [f.name for f in value.list.func]:
                if name in library:
                    called += _called_nodes(library[name].node_def, library, node.device,
                                            node.name + "/")
    return called


def keras_step_logs(model, batches, learning_rate, **compile_args):
    """Compiles `model` on one device (SGD(learning_rate), `compile_args`), trains it
    with train_on_batch on `batches`; the logs of each step, by name."""
    model.compile(optimizer=keras.optimizers.SGD(learning_rate), **compile_args)
    return [model.train_on_batch(*batch, return_dict=True) for batch in batches]


class SameTraining:
    """A tf.test.TestCase mixin: a trainer against keras_step_logs' model."""

    def assert_same_training(self, keras_model, keras_logs, trainer, batches,
                             joined=lambda model: model, atol=1e-5):
        """Trains `trainer` on `batches`: each step's logs, by name, and the weights
        against Keras's (`joined(trainer.model)`'s: a split model joined again)."""
        for batch, expected in zip(batches, keras_logs):
            logs = trainer.train_on_batch(*batch, return_dict=True)
            for name, value in expected.items():
                self.assertAllClose(logs[name], value, atol=atol, msg=name)
        for want, got in zip(keras_model.get_weights(), joined(trainer.model).get_weights()):
            self.assertAllClose(want, got, atol=atol)
