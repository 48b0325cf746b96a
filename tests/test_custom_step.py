"""towers.tower_step: research loops on 4 towers with uneven shards, each against the
same loop written for one device (a plain GradientTape on the whole batch)."""

import keras
import numpy as np
import tensorflow as tf

import towers

DEVICES = [f"/device:CPU:{i}" for i in range(4)]
TOLERANCE = 1e-5
BCE = keras.losses.BinaryCrossentropy(from_logits=True, reduction=None)


def _dense_stack(inputs, *units, name=None):
    layers = [keras.Input((inputs,))]
    layers += [keras.layers.Dense(u, activation="relu") for u in units[:-1]]
    return keras.Sequential(layers + [keras.layers.Dense(units[-1])], name=name)


def _twins(make):
    """Two copies of what make() builds, with the same weights."""
    keras.utils.set_random_seed(3)
    first, second = make(), make()
    for a, b in zip(tf.nest.flatten(first), tf.nest.flatten(second)):
        for va, vb in zip(a.weights, b.weights):
            vb.assign(va)
    return first, second


def _batches(*widths, rows=10, steps=3, seed=0):
    rng = np.random.default_rng(seed)
    return [tuple(rng.normal(size=(rows, w)).astype("float32") for w in widths)
            for _ in range(steps)]


class Counter(keras.layers.Layer):
    """Counts the rows it sees (aggregation="sum": the towers' counts add up), keeps an
    exponential moving average of its inputs' mean (the towers' means, weighted by
    rows, are the batch's), and updates a metric in call (with_metric)."""

    def __init__(self, with_metric=True, **kwargs):
        super().__init__(**kwargs)
        self.with_metric = with_metric

    def build(self, input_shape):
        self.seen = self.add_weight(shape=(), initializer="zeros", trainable=False,
                                    aggregation="sum", name="seen")
        self.average = self.add_weight(shape=(), initializer="zeros", trainable=False,
                                       name="average")
        self.mean_input = keras.metrics.Mean(name="mean_input") if self.with_metric else None

    def call(self, x):
        self.seen.assign_add(tf.cast(tf.shape(x)[0], "float32"))
        self.average.assign(0.9 * self.average + 0.1 * tf.reduce_mean(x))
        if self.mean_input is not None:
            self.mean_input.update_state(tf.reduce_mean(x, -1))
        return x


class Tempered(keras.Model):
    """Logits divided by a call argument, temperature."""

    def __init__(self):
        super().__init__()
        self.hidden, self.out = keras.layers.Dense(6, activation="relu"), keras.layers.Dense(3)

    def call(self, x, temperature=1.0):
        return self.out(self.hidden(x)) / temperature


def _counting_calls(model):
    """A list that gets an entry each time model.call's Python runs (a trace)."""
    runs, call = [], model.call

    def counted(*args, **kwargs):
        runs.append(None)
        return call(*args, **kwargs)

    model.call = counted
    return runs


class MaskedHead(keras.Model):
    """An LSTM over the masked steps, then a Dense: its outputs carry the mask on."""

    def __init__(self):
        super().__init__()
        self.supports_masking = True
        self.lstm = keras.layers.LSTM(4, return_sequences=True)
        self.out = keras.layers.Dense(3)

    def call(self, x, mask=None):
        return self.out(self.lstm(x, mask=mask))


class Shifted(keras.layers.Layer):
    """Adds its attribute `shift`, a scalar tensor set from outside."""

    shift = 0.0

    def call(self, x):
        return x + self.shift


class TowerStepTest(tf.test.TestCase):

    def assertSameWeights(self, one, many):
        for a, b in zip(tf.nest.flatten(one), tf.nest.flatten(many)):
            for va, vb in zip(a.weights, b.weights):
                self.assertAllClose(va.numpy(), vb.numpy(), atol=TOLERANCE, rtol=0)

    def test_gan_with_two_optimizers_runs_one_forward_per_tower(self):
        def make():
            return _dense_stack(3, 8, 4, name="g"), _dense_stack(4, 8, 1, name="d")

        (g1, d1), (g4, d4) = _twins(make)
        optimizers = {m: (keras.optimizers.Adam(0.01), keras.optimizers.Adam(0.01))
                      for m in ("one", "four")}

        def gan_losses(call, generator, discriminator, real, noise):
            fake = call(generator, noise)
            d_real, d_fake = call(discriminator, real), call(discriminator, fake)
            return {"d": BCE(tf.ones_like(d_real), d_real) + BCE(tf.zeros_like(d_fake), d_fake),
                    "g": BCE(tf.ones_like(d_fake), d_fake)}

        def apply(pair, grads, g, d):
            pair[0].apply_gradients(zip(grads["d"], d.trainable_variables))
            pair[1].apply_gradients(zip(grads["g"], g.trainable_variables))

        @tf.function
        def one_device(real, noise):
            with tf.GradientTape(persistent=True) as tape:
                losses = gan_losses(lambda m, x: m(x), g1, d1, real, noise)
                mean = {k: tf.reduce_mean(v) for k, v in losses.items()}
            apply(optimizers["one"], {"d": tape.gradient(mean["d"], d1.trainable_variables),
                                      "g": tape.gradient(mean["g"], g1.trainable_variables)},
                  g1, d1)
            return mean

        towers_run = []

        @tf.function
        def four_towers(real, noise):
            def fn(tower, shard):
                towers_run.append(tower.index)
                return gan_losses(tower, g4, d4, *shard), None

            out = towers.tower_step(fn, (real, noise), DEVICES,
                                    {"d": d4.trainable_variables, "g": g4.trainable_variables})
            apply(optimizers["four"], out.grads, g4, d4)
            return out.losses

        for real, noise in _batches(4, 3):
            want, got = one_device(real, noise), four_towers(real, noise)
            self.assertAllClose(want, got, atol=TOLERANCE, rtol=0)
        self.assertSameWeights([g1, d1], [g4, d4])
        self.assertEqual(towers_run[:4], [0, 1, 2, 3])  # fn once per tower, per trace
        self.assertEqual(len(towers_run) % 4, 0)

    def test_fn_and_batch_losses_converted_as_the_callers_own_code(self):
        # A Python `if` on a tensor, in a function fn calls and in a batch loss: it works
        # where the caller's tf.function converts its code (autograph on, the default) and
        # fails where it does not, as it would in the caller's own code.
        keras.utils.set_random_seed(0)
        model = _dense_stack(3, 2)

        def flipped(out):
            if tf.reduce_sum(out) > 0:
                return out
            return -out

        def whole(aux):
            if tf.reduce_mean(aux) > 100.0:
                return tf.reduce_mean(aux)
            return tf.reduce_mean(aux * aux)

        def fn(tower, shard):
            out = flipped(tower(model, shard))
            return {"l": tf.reduce_sum(out * out, axis=1)}, out

        def step(x):
            return towers.tower_step(fn, x, DEVICES, {"l": model.trainable_variables,
                                                      "w": model.trainable_variables},
                                     batch_losses={"w": whole}).losses

        x = _batches(3, rows=7, steps=1)[0][0]
        got = tf.function(step)(x)
        shards = np.split(model(x).numpy(), [2, 4, 6])  # 7 rows: 2, 2, 2, 1; each flips alone
        flips = np.concatenate([s if s.sum() > 0 else -s for s in shards])
        self.assertAllClose(got["l"], np.mean(np.sum(flips ** 2, axis=1)), atol=TOLERANCE)
        self.assertAllClose(got["w"], np.mean(flips ** 2), atol=TOLERANCE)
        with self.assertRaises(tf.errors.OperatorNotAllowedInGraphError):
            tf.function(step, autograph=False)(x)

    def test_pcgrad_from_two_named_losses_of_one_forward(self):
        def make():
            inputs = keras.Input((5,))
            trunk = keras.layers.Dense(8, activation="tanh", kernel_regularizer="l2")(
                Counter()(inputs))
            return keras.Model(inputs, [keras.layers.Dense(1)(trunk), keras.layers.Dense(1)(trunk)])

        one, four = _twins(make)
        opt_one, opt_four = keras.optimizers.SGD(0.1), keras.optimizers.SGD(0.1)

        def task_losses(outputs, y, regularization):
            return {"a": tf.square(outputs[0][:, 0] - y[:, 0]) + regularization,
                    "b": tf.abs(outputs[1][:, 0] + y[:, 0])}

        def pcgrad(grads_a, grads_b):
            flat_a = tf.concat([tf.reshape(g, [-1]) for g in grads_a], 0)
            flat_b = tf.concat([tf.reshape(g, [-1]) for g in grads_b], 0)
            dot = tf.reduce_sum(flat_a * flat_b)
            scale = tf.minimum(dot, 0.0) / tf.reduce_sum(flat_b * flat_b)
            return [a - scale * b + b for a, b in zip(grads_a, grads_b)]

        def shared(model, grads):
            return [tf.zeros_like(v) if g is None else g
                    for g, v in zip(grads, model.trainable_variables)]

        @tf.function
        def one_device(x, y):
            with tf.GradientTape(persistent=True) as tape:
                losses = task_losses(one(x), y, tf.add_n(one.losses))
                mean = {k: tf.reduce_mean(v) for k, v in losses.items()}
            grads = [shared(one, tape.gradient(mean[k], one.trainable_variables)) for k in "ab"]
            opt_one.apply_gradients(zip(pcgrad(*grads), one.trainable_variables))

        @tf.function
        def four_towers(x, y):
            def fn(tower, shard):  # tower.losses: the regularisation of the calls so far
                outputs = tower(four, shard[0])
                return task_losses(outputs, shard[1], tower.losses), None

            out = towers.tower_step(fn, (x, y), DEVICES, {k: four.trainable_variables for k in "ab"})
            grads = [shared(four, out.grads[k]) for k in "ab"]
            opt_four.apply_gradients(zip(pcgrad(*grads), four.trainable_variables))

        for x, y in _batches(5, 1):
            one_device(x, y)
            four_towers(x, y)
        self.assertSameWeights(one, four)  # the average is updated once per step
        counter = four.layers[1]
        self.assertEqual(float(counter.seen.numpy()), 30.0)  # 3 steps of 10 rows, summed
        self.assertAllClose(counter.mean_input.result(), one.layers[1].mean_input.result(),
                            atol=TOLERANCE)

    def test_infonce_with_in_batch_negatives(self):
        one, four = _twins(lambda: _dense_stack(4, 8, 6))
        opt_one, opt_four = keras.optimizers.SGD(0.5), keras.optimizers.SGD(0.5)

        def info_nce(embeddings):
            anchors, positives = (tf.math.l2_normalize(e, -1) for e in embeddings)
            logits = tf.matmul(anchors, positives, transpose_b=True) / 0.1
            labels = tf.range(tf.shape(logits)[0])
            return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
                labels, logits, from_logits=True))

        @tf.function
        def one_device(a, b):
            with tf.GradientTape() as tape:
                loss = info_nce((one(a), one(b)))
            opt_one.apply_gradients(zip(tape.gradient(loss, one.trainable_variables),
                                        one.trainable_variables))
            return loss

        @tf.function
        def four_towers(a, b):
            out = towers.tower_step(lambda tower, s: ({}, (tower(four, s[0]), tower(four, s[1]))),
                                    (a, b), DEVICES, {"nce": four.trainable_variables},
                                    batch_losses={"nce": info_nce})
            opt_four.apply_gradients(zip(out.grads["nce"], four.trainable_variables))
            self.assertEqual(out.aux[0].shape[0], a.shape[0])
            return out.losses["nce"]

        # 10 rows: shards of 3, 3, 2, 2; 3 rows: one tower with none.
        for a, b in _batches(4, 4) + _batches(4, 4, rows=3, steps=1, seed=1):
            self.assertAllClose(one_device(a, b), four_towers(a, b), atol=TOLERANCE, rtol=0)
        self.assertSameWeights(one, four)

    def test_a_mask_crosses_models_called_once_per_shard_shape(self):
        """An embedder's Keras mask reaches the next model's LSTM and a Keras loss, as on
        one device; each model's call is traced once per shard shape for every tower
        (shards of 3, 3, 2, 2 rows: 2 traces, not 4)."""
        def make():
            embedder = keras.Sequential([keras.Input((6,), dtype="int32"),
                                         keras.layers.Embedding(20, 5, mask_zero=True)])
            head = MaskedHead()
            head(embedder(np.ones((1, 6), "int32")))
            return embedder, head

        (e1, h1), (e4, h4) = _twins(make)
        scce = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

        def per_example(call, embedder, head, x, y):
            return tf.reduce_sum(scce(y, call(head, call(embedder, x))), axis=-1)

        @tf.function
        def one_device(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(per_example(lambda m, v: m(v), e1, h1, x, y))
            return loss, tape.gradient(loss, e1.trainable_variables + h1.trainable_variables)

        @tf.function
        def four_towers(x, y):
            out = towers.tower_step(lambda tower, s: ({"loss": per_example(tower, e4, h4, *s)},
                                                      None), (x, y), DEVICES,
                                    {"loss": e4.trainable_variables + h4.trainable_variables})
            return out.losses["loss"], out.grads["loss"]

        rng = np.random.default_rng(4)
        x = rng.integers(1, 20, size=(10, 6)).astype("int32")
        x[:, 4:] = 0  # padding: masked steps
        y = rng.integers(0, 3, size=(10, 6))
        want_loss, want_grads = one_device(x, y)
        head_traces = _counting_calls(h4)
        loss, grads = four_towers(x, y)
        self.assertLen(head_traces, 2)
        self.assertAllClose(want_loss, loss, atol=TOLERANCE, rtol=0)
        for want, got in zip(want_grads, grads):
            self.assertAllClose(tf.convert_to_tensor(want), tf.convert_to_tensor(got),
                                atol=TOLERANCE, rtol=0)

    def test_gradient_penalty_differentiates_the_shared_call_twice(self):
        """WGAN-GP's critic loss: the gradient of a tower(...) call with respect to its
        input inside fn, then of that with respect to the weights (second order through
        the call traced once for every tower), as on one device."""
        critic = _dense_stack(3, 8, 1)
        real, fake, mix = _batches(3, 3, 1, steps=1)[0]
        mix = np.abs(mix) / np.abs(mix).max()  # in [0, 1]

        def critic_loss(call, real, fake, mix):
            mixed = mix * real + (1 - mix) * fake
            with tf.GradientTape() as inner:
                inner.watch(mixed)
                score = call(critic, mixed)
            penalty = tf.square(tf.norm(inner.gradient(score, mixed), axis=-1) - 1.0)
            return tf.squeeze(call(critic, fake) - call(critic, real), -1) + 10.0 * penalty

        @tf.function
        def one_device(*batch):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(critic_loss(lambda m, v: m(v), *batch))
            return loss, tape.gradient(loss, critic.trainable_variables)

        @tf.function
        def four_towers(*batch):
            out = towers.tower_step(lambda tower, s: ({"critic": critic_loss(tower, *s)}, None),
                                    batch, DEVICES, {"critic": critic.trainable_variables})
            return out.losses["critic"], out.grads["critic"]

        want, got = one_device(real, fake, mix), four_towers(real, fake, mix)
        self.assertAllClose(want, got, atol=TOLERANCE, rtol=0)

    def test_a_call_reading_a_tensor_of_fn_is_traced_per_tower(self):
        """A layer that reads a tensor fn made on this tower (not an argument) cannot share
        one trace: each tower's call reads its own, as on one device."""
        keras.utils.set_random_seed(6)
        shifted = Shifted()
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), shifted])

        @tf.function
        def four_towers(x):
            def fn(tower, shard):
                shifted.shift = tf.constant(float(tower.index))
                return {"out": tf.reduce_mean(tower(model, shard), axis=-1)}, None

            return towers.tower_step(fn, x, DEVICES, {"out": model.trainable_variables})

        (x,) = _batches(3, steps=1)
        shifts = np.repeat([0.0, 1.0, 2.0, 3.0], [3, 3, 2, 2])  # each row's tower
        want = np.mean(np.mean(model(x), axis=-1) + shifts)
        self.assertAllClose(want, four_towers(x).losses["out"], atol=TOLERANCE, rtol=0)

    def test_call_arguments_and_training_false_with_batch_norm(self):
        def make():
            tempered = Tempered()
            tempered(np.zeros((1, 4), "float32"))
            normed = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5),
                                       keras.layers.BatchNormalization(),
                                       keras.layers.Dropout(0.5), keras.layers.Dense(4)])
            return tempered, normed

        (t1, n1), (t4, n4) = _twins(make)
        opt_one, opt_four = keras.optimizers.SGD(0.1), keras.optimizers.SGD(0.1)
        scce = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

        def step_losses(call, tempered, normed, x, y):
            frozen = call(normed, x, training=False)  # moving statistics, no dropout
            return {"loss": scce(y, call(tempered, frozen, temperature=0.5))}

        variables = [t1.trainable_variables + n1.trainable_variables,
                     t4.trainable_variables + n4.trainable_variables]

        @tf.function
        def one_device(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(step_losses(lambda m, *a, **k: m(*a, **k), t1, n1, x, y)[
                    "loss"])
            opt_one.apply_gradients(zip(tape.gradient(loss, variables[0]), variables[0]))

        @tf.function
        def four_towers(x, y):
            out = towers.tower_step(lambda tower, s: (step_losses(tower, t4, n4, *s), None),
                                    (x, y), DEVICES, {"loss": variables[1]})
            opt_four.apply_gradients(zip(out.grads["loss"], variables[1]))

        rng = np.random.default_rng(2)
        for _ in range(3):
            x = rng.normal(size=(10, 4)).astype("float32")
            y = rng.integers(0, 3, size=(10,))
            one_device(x, y)
            four_towers(x, y)
        self.assertSameWeights([t1, n1], [t4, n4])  # moving statistics untouched too
        self.assertAllEqual(n4.layers[1].moving_mean.numpy(), np.zeros(5))


class ExampleTest(tf.test.TestCase):

    def test_contrastive_example_equals_one_device(self):
        from examples import contrastive
        self.assertLess(contrastive.main(num_steps=3, devices=DEVICES), TOLERANCE)


class TrainerStateTest(tf.test.TestCase):
    """TowerTrainer merges state by the same rules, and refuses what it cannot carry."""

    @staticmethod
    def make(with_metric):
        inputs = keras.Input((5,))
        return keras.Model(inputs, keras.layers.Dense(2)(Counter(with_metric)(inputs)))

    def test_a_counter_adds_up_as_in_keras(self):
        keras_model, towers_model = _twins(lambda: self.make(with_metric=False))
        keras_model.compile(keras.optimizers.SGD(0.1), "mse")
        trainer = towers.TowerTrainer(towers_model, "mse", keras.optimizers.SGD(0.1),
                                      devices=DEVICES)
        for x, y in _batches(5, 2):
            keras_model.train_on_batch(x, y)
            trainer.train_step((x, y))
        for want, got in zip(keras_model.weights, towers_model.weights):
            self.assertAllClose(want.numpy(), got.numpy(), atol=TOLERANCE, rtol=0)
        self.assertEqual(float(towers_model.layers[1].seen.numpy()), 30.0)

    def test_a_metric_updated_in_call_is_refused(self):
        trainer = towers.TowerTrainer(self.make(with_metric=True), "mse",
                                      keras.optimizers.SGD(0.1), devices=DEVICES)
        before = [v.numpy() for v in trainer.model.weights]
        with self.assertRaisesRegex(ValueError, r"call updates the metric variables "
                                    r"\['counter.*/mean_input/total'.*tower_step") as raised:
            trainer.train_step(_batches(5, 2, steps=1)[0])
        self.assertNotIn("\n", str(raised.exception))
        for want, got in zip(before, trainer.model.weights):
            self.assertAllEqual(want, got.numpy())


class TowerStepMisuseTest(tf.test.TestCase):
    """Each mistake is one line, raised while the step is traced: nothing runs."""

    def setUp(self):
        self.model = _dense_stack(3, 2)
        self.x = np.ones((6, 3), "float32")

    def assertOneLine(self, call, message):
        with self.assertRaisesRegex(ValueError, message) as raised:
            call()
        self.assertNotIn("\n", str(raised.exception))

    def step(self, fn, wrt=None, **kwargs):
        return lambda: towers.tower_step(
            fn, self.x, DEVICES, wrt or {"l": self.model.trainable_variables}, **kwargs)

    def test_the_trainers_checks_in_its_words(self):
        fn = lambda t, x: ({"l": t(self.model, x)[:, 0]}, None)  # noqa: E731
        wrt = {"l": self.model.trainable_variables}
        self.assertOneLine(lambda: towers.tower_step(fn, self.x[:0], DEVICES, wrt),
                           r"^the batch is empty \(batch size 0\)")
        self.assertOneLine(lambda: towers.tower_step(fn, self.x, ["/device:CPU:9"], wrt),
                           r"devices \['/device:CPU:9'\] do not exist")
        self.assertOneLine(lambda: towers.tower_step(fn, self.x, [], wrt), "devices is empty")

    def test_a_loss_reduced_to_a_scalar(self):
        self.assertOneLine(self.step(lambda t, x: ({"l": tf.reduce_mean(t(self.model, x))},
                                                   None)),
                           r"fn's loss 'l' has shape \(\) .* use batch_losses=")

    def test_a_named_loss_fn_does_not_give(self):
        self.assertOneLine(self.step(lambda t, x: ({"other": t(self.model, x)[:, 0]}, None)),
                           r"wrt names \['l'\], which neither fn's losses")

    def test_a_batch_loss_that_is_not_a_scalar(self):
        self.assertOneLine(self.step(lambda t, x: ({}, t(self.model, x)),
                                     batch_losses={"l": lambda aux: aux}),
                           r"batch_losses\['l'\] returned shape \(6, 2\)")

    def test_batch_losses_without_aux(self):
        self.assertOneLine(self.step(lambda t, x: ({}, None),
                                     batch_losses={"l": lambda aux: tf.reduce_sum(aux)}),
                           r"fn returned aux None")

    def test_wrt_that_is_not_a_dict_of_variables(self):
        self.assertOneLine(self.step(lambda t, x: ({}, None), wrt=[1]), "wrt must be a dict")

    def test_tower_gradients_takes_no_labels_for_a_callable_and_refuses_a_bare_x(self):
        def no_labels(y_true, y_pred):
            self.assertIsNone(y_true)
            return tf.reduce_sum(tf.square(y_pred), -1)

        grads, logs = towers.tower_gradients(self.model, no_labels, (self.x, None), DEVICES)
        with tf.GradientTape() as tape:
            want = tf.reduce_mean(no_labels(None, self.model(self.x)))
        self.assertAllClose(want, logs["loss"], atol=TOLERANCE)
        self.assertAllClose(tape.gradient(want, self.model.trainable_variables), grads,
                            atol=TOLERANCE)
        self.assertOneLine(lambda: towers.tower_gradients(self.model, "mse", (self.x, None),
                                                          DEVICES),
                           r"y is None, which only a loss callable")
        self.assertOneLine(lambda: towers.tower_gradients(self.model, "mse", self.x, DEVICES),
                           r"a batch must be \(x, y\) or \(x, y, sample_weight\), got a ndarray")

    def test_a_call_that_assigns_a_variable_the_step_would_lose(self):
        outside = keras.Variable(0.0)

        class Leaky(keras.layers.Layer):
            def call(self, x):
                outside.assign_add(1.0)
                return x

        leaky = keras.Sequential([keras.Input((3,)), Leaky()])
        self.assertOneLine(self.step(lambda t, x: ({"l": t(leaky, x)[:, 0]}, None)),
                           r"assigns 1 variable\(s\) that are not weights of its layers")
