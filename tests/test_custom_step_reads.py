"""towers.tower_step: what fn reads is the tower's. On 3 towers with uneven shards (7 rows:
3, 2, 2), each against the same loop written for one device (a plain GradientTape on the
whole batch, same initial weights, 3 steps): a penalty over model.trainable_variables, a
model called directly, a per-example MAML inner step; BatchNorm called directly merges as
through tower(...); a wrt list the loss does not read is refused."""

from absl.testing import parameterized
import keras
import numpy as np
import tensorflow as tf

import towers

DEVICES = [f"/device:CPU:{i}" for i in range(3)]
TOLERANCE = 1e-5
OPTIMIZERS = {"sgd": lambda: keras.optimizers.SGD(0.1),
              "adam": lambda: keras.optimizers.Adam(1e-3)}
CROSS_ENTROPY = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)


def _twins(make):
    keras.utils.set_random_seed(5)
    first, second = make(), make()
    for a, b in zip(first.weights, second.weights):
        b.assign(a)
    return first, second


def _classifier(batch_norm=False):
    middle = [keras.layers.BatchNormalization()] if batch_norm else []
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="tanh"),
                             *middle, keras.layers.Dense(3)])


def _labelled(rows, steps=3, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(rows, 4)).astype("float32"), rng.integers(0, 3, size=(rows,)))
            for _ in range(steps)]


def _tasks(rows=7, steps=3):
    """Per row one regression task: 2 support and 2 query examples of 4 features."""
    rng = np.random.default_rng(1)
    return [tuple(rng.normal(size=shape).astype("float32")
                  for shape in [(rows, 2, 4), (rows, 2), (rows, 2, 4), (rows, 2)])
            for _ in range(steps)]


def _penalized(call, model, batch):
    """Cross-entropy per row plus an L2 penalty written over the model's variables."""
    x, y = batch
    l2 = tf.add_n([tf.reduce_sum(tf.square(w)) for w in model.trainable_variables])
    return CROSS_ENTROPY(y, call(model, x)) + 1e-2 * l2


def _maml(call, model, tasks, head_only=False):
    """Per task (row): the model's loss on its support examples (through `call`), plus
    the loss on its queries after one inner SGD step on its support examples,
    differentiated through the inner step. head_only (ANIL): the inner step adapts the
    last layer alone, through a StatelessScope of the test's that maps only its weights,
    so the layers before it are read as they are."""
    adapting = model.layers[-1] if head_only else model

    def adapted_call(weights, x):
        if not head_only:
            return model.stateless_call(weights, [], x)[0][:, 0]
        with keras.StatelessScope(list(zip(adapting.trainable_variables, weights))):
            return model(x)[:, 0]

    def one_task(task):
        support_x, support_y, query_x, query_y = task
        weights = [w.value for w in adapting.trainable_variables]  # in fn: the tower's copies
        with tf.GradientTape() as inner:
            inner.watch(weights)
            inner_loss = tf.reduce_mean(tf.square(adapted_call(weights, support_x) - support_y))
        adapted = [w - 0.5 * g for w, g in zip(weights, inner.gradient(inner_loss, weights))]
        return tf.reduce_mean(tf.square(adapted_call(adapted, query_x) - query_y))

    queries = tf.map_fn(one_task, tasks, fn_output_signature=tf.float32)  # read first here
    support_x, support_y = tasks[0], tasks[1]
    support = tf.reshape(call(model, tf.reshape(support_x, [-1, 4])), tf.shape(support_y))
    return tf.reduce_mean(tf.square(support - support_y), -1) + queries


def _anil(call, model, tasks):
    return _maml(call, model, tasks, head_only=True)


def _regressor():
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="tanh"),
                             keras.layers.Dense(1)])


def _direct(model, *args, **kwargs):
    return model(*args, training=True, **kwargs)


class OwnReadsTest(tf.test.TestCase, parameterized.TestCase):

    def assertSameWeights(self, one, many):
        for a, b in zip(one.weights, many.weights):
            self.assertAllClose(a.numpy(), b.numpy(), atol=TOLERANCE, rtol=0, msg=a.path)

    @parameterized.named_parameters(
        (f"{case[0]}_{optimizer}", *case[1:], optimizer) for optimizer in sorted(OPTIMIZERS)
        for case in [("penalty_through_tower", _classifier, _penalized, "tower", _labelled(7)),
                     ("penalty_model_called_directly", _classifier, _penalized, "direct",
                      _labelled(7)),
                     ("maml_inner_step", _regressor, _maml, "tower", _tasks()),
                     ("anil_inner_step_in_a_scope", _regressor, _anil, "tower", _tasks())])
    def test_equals_one_device(self, make, losses_of, call, batches, optimizer):
        one, many = _twins(make)
        opt_one, opt_many = OPTIMIZERS[optimizer](), OPTIMIZERS[optimizer]()

        @tf.function
        def one_device(batch):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(losses_of(_direct, one, batch))
            opt_one.apply_gradients(zip(tape.gradient(loss, one.trainable_variables),
                                        one.trainable_variables))
            return loss

        @tf.function
        def three_towers(batch):
            def fn(tower, shard):
                return {"loss": losses_of(tower if call == "tower" else _direct, many,
                                          shard)}, None

            out = towers.tower_step(fn, batch, DEVICES, {"loss": many.trainable_variables})
            opt_many.apply_gradients(zip(out.grads["loss"], many.trainable_variables))
            return out.losses["loss"], out.rows

        for batch in batches:
            want = one_device(batch)
            got, rows = three_towers(batch)
            self.assertAllClose(want, got, atol=TOLERANCE, rtol=0)
            self.assertEqual(int(rows), 7)
        self.assertSameWeights(one, many)

    def test_batch_norm_called_directly_merges_as_through_tower(self):
        through, direct = _twins(lambda: _classifier(batch_norm=True))

        def step_of(model, call):
            optimizer = keras.optimizers.SGD(0.1)

            @tf.function(reduce_retracing=True)
            def step(batch):
                def fn(tower, shard):
                    return {"loss": CROSS_ENTROPY(shard[1], call(tower, model, shard[0]))}, None

                out = towers.tower_step(fn, batch, DEVICES, {"loss": model.trainable_variables})
                optimizer.apply_gradients(zip(out.grads["loss"], model.trainable_variables))
            return step

        steps = [step_of(through, lambda tower, m, x: tower(m, x, training=True)),
                 step_of(direct, lambda tower, m, x: m(x, training=True))]
        # 7 rows: shards 3, 2, 2; 3 rows: one each; 2 rows: a tower with none.
        for batch in _labelled(7) + _labelled(3, steps=1) + _labelled(2, steps=1):
            for step in steps:
                step(batch)
        self.assertSameWeights(through, direct)
        for variable in direct.weights:
            self.assertTrue(np.isfinite(variable.numpy()).all(), variable.path)
        self.assertGreater(np.abs(direct.layers[1].moving_mean.numpy()).max(), 1e-3)  # moved


class OwnReadsMisuseTest(tf.test.TestCase):
    """Each is one line, raised while the step is traced (here: run eagerly)."""

    def setUp(self):
        self.model, self.other = _classifier(), _classifier()
        self.x = np.ones((5, 4), "float32")

    def assertOneLine(self, call, message):
        with self.assertRaisesRegex(ValueError, message) as raised:
            call()
        self.assertNotIn("\n", str(raised.exception))

    def test_wrt_of_a_model_the_loss_does_not_read(self):
        fn = lambda tower, x: ({"cls": tower(self.model, x)[:, 0]}, None)  # noqa: E731
        self.assertOneLine(
            lambda: towers.tower_step(fn, self.x, DEVICES, {"cls": self.other.trainable_variables}),
            r"^loss 'cls' reads none of the 4 variables wrt\['cls'\] lists")

    def test_a_gradient_with_respect_to_the_variables_inside_fn(self):
        def fn(tower, x):
            with tf.GradientTape() as inner:
                loss = tf.reduce_sum(self.model(x))
            inner.gradient(loss, self.model.trainable_variables)
            return {"cls": loss[None]}, None

        self.assertOneLine(
            lambda: towers.tower_step(fn, self.x, DEVICES, {"cls": self.model.trainable_variables}),
            r"differentiate with respect to the copies, weights = \[v.value for v")
