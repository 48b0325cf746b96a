"""What changes when you split a batch: sparse gradients, BatchNorm state, dropout,
mixed precision, clipping and micro-batch accumulation, each against a reference."""

import warnings

import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import towers
from tests import reference

DEVICES = [f"/device:CPU:{i}" for i in range(4)]
VOCAB, SEQUENCE = 50, 4


def _text_model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((SEQUENCE,), dtype="int32"), keras.layers.Embedding(VOCAB, 3),
        keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(2)])


def _text_batches(size, steps=3):
    rng = np.random.default_rng(2)
    return [(rng.integers(0, VOCAB, (size, SEQUENCE)).astype(np.int32),
             rng.integers(0, 2, size)) for _ in range(steps)]


def _bn_model(seed=0, momentum=0.9):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((reference.NUM_FEATURES,)), keras.layers.Dense(6),
        keras.layers.BatchNormalization(momentum=momentum), keras.layers.Activation("relu"),
        keras.layers.Dense(reference.NUM_CLASSES)])


def _train(model, batches, devices=DEVICES, optimizer=None, **options):
    trainer = towers.TowerTrainer(model, reference.make_loss(),
                                  optimizer or keras.optimizers.SGD(0.1), devices=devices,
                                  **options)
    for batch in batches:
        trainer.train_step(batch)
    return trainer


def _assert_weights_close(test, expected_model, actual_model, tolerance):
    for want, got in zip(expected_model.weights, actual_model.weights):
        test.assertAllClose(want, got, atol=tolerance, rtol=tolerance, msg=want.path)


class SparseGradientTest(tf.test.TestCase, parameterized.TestCase):

    @staticmethod
    def _one_device(batches, optimizer_name, dense):
        """One device on whole batches, the embedding gradient densified or not."""
        model, optimizer = _text_model(), reference.OPTIMIZERS[optimizer_name]()
        for x, y in batches:
            with tf.GradientTape() as tape:
                value = reference.make_loss()(y, model(x, training=True))
            grads = tape.gradient(value, model.trainable_variables)
            if dense:
                grads = [tf.convert_to_tensor(g) for g in grads]
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return model

    @parameterized.product(optimizer_name=["sgd", "adam"], policy=["keep", "dense", 0.5])
    def test_each_policy_equals_one_device(self, optimizer_name, policy):
        # Keras applies IndexedSlices lazily (Adam leaves rows nobody looked up,
        # moments included, untouched), so "keep" and "dense" differ under Adam
        # exactly as a sparse and a dense gradient do on one device.
        batches = _text_batches(10)
        expected = self._one_device(batches, optimizer_name, dense=policy == "dense")
        model = _text_model()
        _train(model, batches, optimizer=reference.OPTIMIZERS[optimizer_name](),
               sparse_policy=policy)  # 0.5: 10 of 50 rows per tower stay sparse
        _assert_weights_close(self, expected, model, 1e-5)

    def test_sparse_mean_equals_dense_mean(self):
        model = _text_model()

        @tf.function
        def gradients(batch, policy):
            grads, _ = towers.tower_gradients(model, reference.make_loss(), batch, DEVICES)
            return tf.convert_to_tensor(grads[0]) if policy == "to_dense" else grads[0]

        (batch,) = _text_batches(10, steps=1)
        sparse = gradients(batch, "keep")
        self.assertIsInstance(sparse, tf.IndexedSlices)
        with tf.GradientTape() as tape:
            value = reference.make_loss()(batch[1], model(batch[0]))
        expected = tf.convert_to_tensor(tape.gradient(value, model.trainable_variables)[0])
        self.assertAllClose(expected, tf.convert_to_tensor(sparse), atol=1e-7)

    def test_average_stays_sparse_and_optimizer_gets_slices(self):
        model, seen = _text_model(), []

        class SpySGD(keras.optimizers.SGD):
            def apply_gradients(self, grads_and_vars):
                grads_and_vars = list(grads_and_vars)
                seen.extend(type(g).__name__ for g, _ in grads_and_vars)
                return super().apply_gradients(grads_and_vars)

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _train(model, _text_batches(10, steps=1), optimizer=SpySGD(0.1))
        self.assertEqual(seen[0], "IndexedSlices")  # the embedding table
        self.assertFalse([w for w in caught if "IndexedSlices" in str(w.message)])

    def test_density_threshold_decides_per_variable(self):
        # 12 examples on 4 towers: a tower looks up 3 * 4 = 12 of 50 rows (24%).
        batches = _text_batches(12, steps=1)
        low = _train(_text_model(), batches, sparse_policy=0.1)
        high = _train(_text_model(), batches, sparse_policy=0.5)
        self.assertEqual(low.setup.densify, [True, False, False])
        self.assertEqual(high.setup.densify, [False, False, False])

    def test_bad_policy(self):
        with self.assertRaisesRegex(ValueError, "sparse_policy must be one of"):
            _train(_text_model(), [], sparse_policy="sometimes")


class BatchNormStateTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.parameters(12, 10, 3)  # even, uneven, an empty tower
    def test_mean_policy_moving_mean_equals_one_device(self, global_batch_size):
        (batch,) = reference.make_batches(global_batch_size, num_steps=1, sample_weights=False)
        expected = _bn_model()
        reference.single_device_weights(expected, keras.optimizers.SGD(0.0),
                                        reference.make_loss(), [batch])
        model = _bn_model()
        _train(model, [batch], optimizer=keras.optimizers.SGD(0.0))
        moving_mean = [i for i, v in enumerate(model.weights) if "moving_mean" in v.path][0]
        self.assertAllClose(expected.weights[moving_mean], model.weights[moving_mean], atol=1e-6)
        self.assertTrue(all(np.isfinite(v.numpy()).all() for v in model.weights))

    def test_first_tower_policy_uses_tower_zero_statistics(self):
        (batch,) = reference.make_batches(12, num_steps=1, sample_weights=False)
        expected = _bn_model()
        reference.single_device_weights(expected, keras.optimizers.SGD(0.0),
                                        reference.make_loss(), [tuple(p[:3] for p in batch)])
        model = _bn_model()
        _train(model, [batch], optimizer=keras.optimizers.SGD(0.0), state_policy="first_tower")
        for want, got in zip(expected.non_trainable_variables, model.non_trainable_variables):
            self.assertAllClose(want, got, atol=1e-6)

    @parameterized.product(num_towers=[2, 4], state_policy=["first_tower", "mean"])
    def test_batchnorm_training_matches_mirrored_strategy(self, num_towers, state_policy):
        # Keras 3 creates BatchNorm's moving statistics with aggregation="none", so
        # under MirroredStrategy they keep replica 0's values: "first_tower" exactly.
        # Training uses each tower's own batch statistics in both, so the trainable
        # weights agree with either policy.
        batches = reference.make_batches(12, num_steps=5)
        expected = reference.mirrored_weights(_bn_model, reference.OPTIMIZERS["sgd"],
                                              DEVICES[:num_towers], batches)
        model = _bn_model()
        _train(model, batches, devices=DEVICES[:num_towers],
               optimizer=reference.OPTIMIZERS["sgd"](), state_policy=state_policy)
        for want, got in zip(expected, model.weights):
            if state_policy == "first_tower" or got.trainable:
                self.assertAllClose(want, got, atol=1e-4, rtol=1e-4, msg=got.path)

    def test_partial_last_batch_with_batchnorm(self):
        batches = reference.make_batches(12, num_steps=2) + reference.make_batches(3, 1)
        model = _bn_model()
        trainer = _train(model, batches)
        self.assertEqual(trainer.step, 3)
        self.assertTrue(all(np.isfinite(v.numpy()).all() for v in model.weights))


class DropoutTest(tf.test.TestCase):

    def _gradient(self, batch, devices, seed=0):
        keras.utils.set_random_seed(seed)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, use_bias=False),
                                  keras.layers.Dropout(0.5)])

        @tf.function
        def step(batch):
            grads, _ = towers.tower_gradients(model, lambda y, p: tf.reduce_sum(p, -1),
                                              batch, devices)
            return grads[0]

        return step(batch).numpy()

    def test_towers_draw_different_reproducible_masks(self):
        shard = (np.ones((2, 8), np.float32), np.zeros(2, np.float32))
        twice = tuple(np.concatenate([part, part]) for part in shard)
        one_tower = self._gradient(shard, DEVICES[:1])
        two_towers = self._gradient(twice, DEVICES[:2])
        tower_1 = 2 * two_towers - one_tower  # the mean of two towers minus tower 0's part
        self.assertNotAllClose(one_tower, tower_1)  # a copied mask would make them equal
        self.assertGreater(np.mean(one_tower == 0), 0.2)  # dropout really dropped units
        self.assertAllEqual(two_towers, self._gradient(twice, DEVICES[:2]))


    def test_tower_step_draws_each_towers_mask_from_its_offset_seed(self):
        """tower_step's towers share one trace of the model's call, but each draws
        Keras's mask for its own seed: the model's seed state offset by (i, 0)."""
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, use_bias=False),
                                  keras.layers.Dropout(0.5)])
        x = np.ones((8, 8), np.float32)  # 2 rows per tower
        weights = [v.numpy() for v in model.trainable_variables]
        (seed,) = [v.numpy() for v in model.non_trainable_variables]

        @tf.function
        def step(x):
            def fn(tower, shard):
                outputs = tower(model, shard, training=True)
                return {"sum": tf.reduce_sum(outputs, -1)}, outputs

            return towers.tower_step(fn, x, DEVICES, {"sum": model.trainable_variables}).aux

        outputs = step(x).numpy()
        for i in range(4):
            want, _ = model.stateless_call(weights, [seed + np.array([i, 0], seed.dtype)],
                                           x[2 * i:2 * i + 2], training=True)
            self.assertAllClose(want, outputs[2 * i:2 * i + 2], atol=1e-6)
        self.assertNotAllClose(outputs[:2], outputs[2:4])  # a shared seed would draw one mask

class MixedPrecisionTest(tf.test.TestCase, parameterized.TestCase):

    def tearDown(self):
        keras.mixed_precision.set_global_policy("float32")
        super().tearDown()

    def _regression_model(self, policy):
        keras.mixed_precision.set_global_policy(policy)
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"),
                                 keras.layers.Dense(1, dtype="float32")])

    @parameterized.parameters("mixed_float16", "mixed_bfloat16")
    def test_close_to_single_device_with_same_policy(self, policy):
        rng = np.random.default_rng(0)
        batches = [(rng.normal(size=(10, 5)).astype(np.float32),
                    rng.normal(size=(10, 1)).astype(np.float32)) for _ in range(3)]
        expected = self._regression_model(policy)
        optimizer = keras.optimizers.SGD(0.05)
        if policy == "mixed_float16":
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
        for x, y in batches:
            with tf.GradientTape() as tape:
                value = keras.losses.MeanSquaredError()(y, expected(x, training=True))
                scaled = optimizer.scale_loss(value) if policy == "mixed_float16" else value
            optimizer.apply_gradients(zip(tape.gradient(scaled, expected.trainable_variables),
                                          expected.trainable_variables))
        model = self._regression_model(policy)
        trainer = towers.TowerTrainer(model, keras.losses.MeanSquaredError(),
                                      keras.optimizers.SGD(0.05), devices=DEVICES)
        for batch in batches:
            logs = trainer.train_step(batch)
        self.assertEqual(isinstance(trainer.optimizer, keras.optimizers.LossScaleOptimizer),
                         policy == "mixed_float16")
        self.assertEqual("loss_scale" in logs, policy == "mixed_float16")
        tolerance = 2e-3 if policy == "mixed_float16" else 2e-2
        _assert_weights_close(self, expected, model, tolerance)

    def test_overflow_in_one_tower_skips_the_step_everywhere_and_lowers_the_scale(self):
        model = self._regression_model("mixed_float16")
        trainer = towers.TowerTrainer(model, keras.losses.MeanSquaredError(),
                                      keras.optimizers.SGD(0.01), devices=DEVICES)
        rng = np.random.default_rng(0)
        x = rng.normal(size=(8, 5)).astype(np.float32)
        y = rng.normal(size=(8, 1)).astype(np.float32)
        first = trainer.train_step((x, y))
        loss_scale_state = ("dynamic_scale", "step_counter")
        before = [v.numpy() for v in model.weights + trainer.optimizer.variables
                  if not v.path.endswith(loss_scale_state)]
        huge = y.copy()
        huge[7] = 6e4  # tower 3 only: its scaled float16 gradient overflows
        logs = trainer.train_step((x, huge))
        self.assertTrue(np.isfinite(logs["loss"]))
        self.assertEqual(logs["loss_scale"], first["loss_scale"] / 2)
        self.assertEqual((logs["skipped_steps"], trainer.step), (1, 1))
        after = [v.numpy() for v in model.weights + trainer.optimizer.variables
                 if not v.path.endswith(loss_scale_state)]
        for want, got in zip(before, after):
            self.assertAllEqual(want, got)
        trainer.train_step((x, y))
        self.assertEqual(trainer.step, 2)


class ClippingTest(tf.test.TestCase, parameterized.TestCase):

    def test_clips_the_averaged_gradient_like_one_device(self):
        batches = reference.make_batches(10, num_steps=3)
        expected, optimizer, loss = reference.make_model(), keras.optimizers.SGD(0.5), \
            reference.make_loss()
        for x, y, w in batches:
            with tf.GradientTape() as tape:
                value = loss(y, expected(x, training=True), sample_weight=w) \
                    + tf.add_n(expected.losses)
            grads = tape.gradient(value, expected.trainable_variables)
            grads, norm = tf.clip_by_global_norm(grads, 0.05)
            self.assertGreater(float(norm), 0.05)  # the clip really bites
            optimizer.apply_gradients(zip(grads, expected.trainable_variables))
        model = reference.make_model()
        _train(model, batches, optimizer=keras.optimizers.SGD(0.5), clip_global_norm=0.05)
        _assert_weights_close(self, expected, model, 1e-5)

    @parameterized.product(num_towers=[1, 2, 3], sparse_policy=["keep", "dense"])
    def test_clips_sparse_gradients_by_the_dense_norm(self, num_towers, sparse_policy):
        # Ids from 6 of the 50 rows: every batch looks up rows many times over, in
        # one tower and across towers. The norm is the dense gradient's, whose
        # repeated rows are added before squaring.
        rng = np.random.default_rng(3)
        batches = [(rng.integers(0, 6, (7, SEQUENCE)).astype(np.int32), rng.integers(0, 2, 7))
                   for _ in range(3)]
        expected, optimizer = _text_model(), keras.optimizers.SGD(0.5)
        for x, y in batches:
            with tf.GradientTape() as tape:
                value = reference.make_loss()(y, expected(x, training=True))
            grads = [tf.convert_to_tensor(g)
                     for g in tape.gradient(value, expected.trainable_variables)]
            grads, norm = tf.clip_by_global_norm(grads, 0.05)
            self.assertGreater(float(norm), 0.05)  # the clip really bites
            optimizer.apply_gradients(zip(grads, expected.trainable_variables))
        model = _text_model()
        _train(model, batches, devices=DEVICES[:num_towers], optimizer=keras.optimizers.SGD(0.5),
               clip_global_norm=0.05, sparse_policy=sparse_policy)
        _assert_weights_close(self, expected, model, 1e-5)

    def test_bad_clip(self):
        with self.assertRaisesRegex(ValueError, "clip_global_norm must be a positive number"):
            _train(reference.make_model(), [], clip_global_norm=-1.0)


class AccumulationTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.parameters((2, 10, 3), (4, 10, 2), (3, 7, 4))  # micro-batches of 2, 2, 1 ...
    def test_equals_one_micro_batch(self, num_towers, global_batch_size, accum_steps):
        batches = reference.make_batches(global_batch_size)
        expected, model = reference.make_model(), reference.make_model()
        _train(expected, batches, devices=DEVICES[:num_towers], optimizer=keras.optimizers.Adam(0.01))
        _train(model, batches, devices=DEVICES[:num_towers], optimizer=keras.optimizers.Adam(0.01),
               accum_steps=accum_steps)
        _assert_weights_close(self, expected, model, 1e-5)

    def test_single_device_gets_the_effective_batch_of_many(self):
        batches = _text_batches(12)
        expected = _text_model()
        reference.single_device_weights(expected, keras.optimizers.SGD(0.1),
                                        reference.make_loss(), batches)
        model = _text_model()
        _train(model, batches, devices=DEVICES[:1], accum_steps=4)
        _assert_weights_close(self, expected, model, 1e-5)

    def test_bad_accum_steps(self):
        with self.assertRaisesRegex(ValueError, "accum_steps must be an integer >= 1"):
            _train(reference.make_model(), [], accum_steps=0)


if __name__ == "__main__":
    tf.test.main()
