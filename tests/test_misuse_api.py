"""Misuse of the Python API: each mistake gets one line naming the argument, before
anything is applied (weights and optimizer.iterations as they were)."""

import re

import keras
import numpy as np
import tensorflow as tf

import towers
from tests import reference

DEVICES = [f"/device:CPU:{i}" for i in range(3)]


def _trainer(model=None, optimizer=None, **kwargs):
    kwargs.setdefault("devices", DEVICES)
    return towers.TowerTrainer(model or reference.make_model(), reference.make_loss(),
                               optimizer or keras.optimizers.SGD(0.1), **kwargs)


def _state(trainer):
    """Every model weight and the optimizer's step count, as numpy arrays."""
    return [v.numpy() for v in trainer.model.weights] + [trainer.optimizer.iterations.numpy()]


class MisuseTest(tf.test.TestCase):
    """One trainer, trained one step, shared where a refused call must leave it as it was."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.x, cls.y, cls.w = reference.make_batches(8, num_steps=1)[0]
        cls.trainer = _trainer()
        cls.trainer.train_step((cls.x, cls.y, cls.w))

    def assertRefused(self, call, argument, message, trainer=None, error=ValueError):
        """`call` raises `error` whose message is one line, names `argument` and matches
        `message`; the trainer's weights and step count are unchanged."""
        trainer = trainer or self.trainer
        before = _state(trainer)
        with self.assertRaisesRegex(error, message) as raised:
            call()
        text = str(raised.exception)
        self.assertNotIn("\n", text)
        self.assertIn(argument, text)
        for want, got in zip(before, _state(trainer)):
            self.assertAllEqual(want, got)

    # tower_gradients: the trainer's checks.

    def test_tower_gradients_on_an_empty_batch(self):
        model = reference.make_model()
        self.assertRefused(lambda: towers.tower_gradients(
            model, reference.make_loss(), (self.x[:0], self.y[:0]), DEVICES),
            "batch", r"^the batch is empty \(batch size 0\)")

    def test_tower_gradients_on_a_device_that_does_not_exist(self):
        model = reference.make_model()
        self.assertRefused(lambda: towers.tower_gradients(
            model, reference.make_loss(), (self.x, self.y), ["/device:CPU:9"]),
            "devices", r"devices \['/device:CPU:9'\] do not exist")

    def test_tower_gradients_on_no_devices(self):
        model = reference.make_model()
        self.assertRefused(lambda: towers.tower_gradients(
            model, reference.make_loss(), (self.x, self.y), []), "devices", "devices is empty")

    def test_tower_gradients_on_rows_known_only_when_it_runs(self):
        # The empty-batch check leaves a batch of unknown size to the graph, and computes.
        model = reference.make_model()
        signature = (tf.TensorSpec([None, reference.NUM_FEATURES]), tf.TensorSpec([None], tf.int64))

        @tf.function(input_signature=[signature])
        def loss_of(batch):
            return towers.tower_gradients(model, reference.make_loss(), batch, DEVICES)[1]["loss"]

        expected = reference.make_loss()(self.y, model(self.x)) + tf.add_n(model.losses)
        self.assertAllClose(loss_of((self.x, self.y)), expected, atol=1e-6)

    # A later batch that does not fit what the first one did: refused before its trace.

    def test_one_hot_labels_for_a_sparse_loss(self):
        one_hot = np.eye(reference.NUM_CLASSES, dtype="float32")[self.y]
        self.assertRefused(lambda: self.trainer.train_step((self.x, one_hot)),
                           "y", r"^y, shape \(8, 3\), does not fit the loss")

    def test_a_batch_of_the_wrong_feature_width(self):
        self.assertRefused(lambda: self.trainer.train_step((self.x[:, :4], self.y)),
                           "x", r"^x has shape \(8, 4\) but model .* takes inputs of shape "
                           r"\(None, 5\)")

    def test_a_batch_of_another_structure(self):
        self.assertRefused(lambda: self.trainer.train_step(((self.x, self.x), self.y)),
                           "x", r"^x holds 2 arrays, shapes \(\(8, 5\), \(8, 5\)\), but model .* "
                           r"takes 1 input\(s\)")

    def test_a_batch_of_a_dict_for_a_model_of_one_input(self):
        self.assertRefused(lambda: self.trainer.train_step(({"a": self.x}, self.y)),
                           "x", r"^model .* failed on x, shapes \{'a': \(8, 5\)\}: The structure")

    def test_train_steps_on_batches_of_a_new_width(self):
        # A later call whose batches have a new structure is checked before its loop is
        # traced, as train_step checks a new batch, and takes no batch from the iterator.
        narrow = (self.x[:, :4], self.y)
        with self.assertRaises(ValueError) as by_train_step:
            self.trainer.train_step(narrow)
        iterator = iter(tf.data.Dataset.from_tensors(narrow))
        self.assertRefused(lambda: self.trainer.train_steps(iterator, 2), "x",
                           f"^{re.escape(str(by_train_step.exception))}$")
        self.assertAllEqual(next(iterator)[0], narrow[0])
        # Batches of varying rows (shards too): dim 0 is None, as in their element_spec.
        batches = tf.data.Dataset.from_tensor_slices(narrow).batch(4)
        for iterator in (iter(batches), self.trainer.shard_iterator(batches)):
            self.assertRefused(lambda: self.trainer.train_steps(iterator, 2), "x",
                               r"^x has shape \(None, 4\) but model .* takes inputs of "
                               r"shape \(None, 5\)")

    def test_evaluate_on_the_wrong_feature_width(self):
        self.assertRefused(lambda: self.trainer.evaluate((self.x[:, :4], self.y)),
                           "x", r"^x has shape \(8, 4\)")

    def test_fit_with_validation_data_of_the_wrong_width_before_any_step(self):
        for trainer in (self.trainer, _trainer()):  # set up, and not yet: fit sets it up
            validation = iter([(self.x[:, :4], self.y)])  # one-shot: its batch is looked at
            self.assertRefused(
                lambda: trainer.fit([(self.x, self.y)] * 2, validation_data=validation,
                                    verbose=False),
                "validation_data", r"^validation_data: x has shape \(8, 4\)", trainer=trainer)

    def test_fit_evaluates_a_one_shot_validation_iterator_whole(self):
        trainer = _trainer()
        batches = [(self.x[:5], self.y[:5]), (self.x[5:], self.y[5:])]
        history = trainer.fit([(self.x, self.y)], validation_data=iter(batches), verbose=False)
        model = reference.make_model()  # the trained weights, evaluated by Keras
        model.set_weights(trainer.model.get_weights())
        expected = reference.make_loss()(self.y, model(self.x)) + tf.add_n(model.losses)
        self.assertAllClose(history.history["val_loss"], [expected], atol=1e-5)

    def test_sample_weights_of_the_wrong_shape(self):
        weights = np.ones((8, 3), "float32")
        self.assertRefused(lambda: self.trainer.train_step((self.x, self.y, weights)),
                           "sample_weight", r"^sample_weight, shape \(8, 3\), does not fit")

    def test_a_ragged_x(self):
        ragged = tf.ragged.constant([[1.0] * reference.NUM_FEATURES] * 8)
        self.assertRefused(lambda: self.trainer.train_step((ragged, self.y)),
                           "x", "^x holds a RaggedTensor")

    def test_python_lists_as_a_batch(self):
        self.assertRefused(lambda: self.trainer.train_step((self.x.tolist(), self.y)),
                           "x", r"^x is a Python list of 40 numbers")

    def test_a_fresh_trainer_on_the_wrong_feature_width(self):
        trainer = _trainer()
        self.assertRefused(lambda: trainer.train_step((self.x[:, :4], self.y)),
                           "x", r"^x has shape \(8, 4\)", trainer=trainer)

    def test_one_target_for_a_model_of_two_outputs(self):
        inputs = keras.Input((reference.NUM_FEATURES,))
        model = keras.Model(inputs, [keras.layers.Dense(3)(inputs), keras.layers.Dense(3)(inputs)])
        trainer = towers.TowerTrainer(model, [reference.make_loss()] * 2,
                                      keras.optimizers.SGD(0.1), DEVICES)
        self.assertRefused(lambda: trainer.train_step((self.x, self.y)), "y",
                           r"^y, shape \(8,\), is one array but model .* has 2 outputs",
                           trainer=trainer)

    def test_a_loss_that_returns_a_scalar(self):
        # The loss's own refusal, not blamed on y.
        trainer = towers.TowerTrainer(reference.make_model(), lambda y, p: tf.reduce_mean(p),
                                      keras.optimizers.SGD(0.1), DEVICES)
        self.assertRefused(lambda: trainer.train_step((self.x, self.y)), "loss",
                           r"^the loss returned a scalar; it must return one loss per example",
                           trainer=trainer)

    def test_one_optimizer_for_two_trainers(self):
        self.assertRefused(lambda: _trainer(optimizer=self.trainer.optimizer), "optimizer",
                           "already updates variables that are not model")

    # Arguments.

    def test_a_device_name_that_is_not_one(self):
        self.assertRefused(lambda: _trainer(devices=["/gpu:banana"]), "device",
                           "'/gpu:banana' is not a device name")

    def test_one_device_name_for_devices(self):
        self.assertRefused(lambda: _trainer(devices="/device:CPU:0"), "devices",
                           r"^devices must be a list of device names")

    def test_metrics_as_one_name(self):
        self.assertRefused(lambda: _trainer(metrics="accuracy"), "metrics",
                           r"^metrics must be a list")

    def test_train_steps_on_a_python_iterator(self):
        self.assertRefused(lambda: self.trainer.train_steps(iter([(self.x, self.y)]), 3),
                           "iterator", r"^iterator must be a tf.data iterator")

    def test_train_steps_num_steps_not_a_positive_integer(self):
        dataset = tf.data.Dataset.from_tensor_slices((self.x, self.y)).batch(4)
        for num_steps in (2.5, -1, 0):
            self.assertRefused(lambda: self.trainer.train_steps(iter(dataset), num_steps),
                               "num_steps", r"^num_steps must be an integer >= 1")

    def test_keras_arguments_that_do_not_fit_the_data(self):
        dataset = tf.data.Dataset.from_tensor_slices((self.x, self.y)).batch(4)
        fit = lambda *args, **kwargs: self.trainer.fit(*args, verbose=0, **kwargs)  # noqa: E731
        for call, argument, message in (
                (lambda: fit(self.x), "y", r"^x is arrays and y is None: give y"),
                (lambda: fit([self.x, self.x]), "y", r"^x is a list of arrays and y is None: give y"),
                (lambda: fit(dataset, self.y), "y", r"^y must be None when x is a \w*Dataset"),
                (lambda: fit(dataset, batch_size=8), "batch_size",
                 r"^batch_size must be None when x is a \w*Dataset: its batches carry their size"),
                (lambda: fit(dataset, sample_weight=self.w), "sample_weight",
                 r"^sample_weight must be None when x is"),
                (lambda: fit(dataset, validation_split=0.5), "validation_split",
                 r"^validation_split holds out the last rows of arrays"),
                (lambda: fit(self.x, self.y, validation_split=1.5), "validation_split",
                 r"^validation_split must be a fraction between 0 and 1"),
                (lambda: fit(self.x, self.y, batch_size=2.5), "batch_size",
                 r"^batch_size must be an integer >= 1"),
                (lambda: fit(self.x, self.y, initial_epoch=-1), "initial_epoch",
                 r"^initial_epoch must be an integer >= 0"),
                (lambda: fit(self.x, self.y, validation_split=0.5, validation_freq=0),
                 "validation_freq", r"^validation_freq must be an integer >= 1"),
                (lambda: fit(self.x, "labels"), "x", r"^x must be arrays with y, .*; got x=ndarray, y=str"),
                (lambda: fit(None), "x", r"^x must be arrays with y, .*; got x=None"),
                (lambda: self.trainer.evaluate(self.x, self.y, steps=0), "steps",
                 r"^steps must be an integer >= 1"),
                (lambda: self.trainer.evaluate(self.x, self.y, verbose=3), "verbose",
                 r"^verbose must be 'auto', 0, 1 or 2")):
            self.assertRefused(call, argument, message)

    def test_fit_counts_not_positive_integers(self):
        for name, value in (("epochs", 2.0), ("epochs", True), ("epochs", 0),
                            ("steps_per_epoch", -1), ("max_steps", np.float32(3))):
            self.assertRefused(lambda: self.trainer.fit([(self.x, self.y)], verbose=False,
                                                        **{name: value}),
                               name, rf"^{name} must be an integer >= 1, got")

    def test_fit_counts_as_numpy_integers(self):
        # np.int64 as a count (a NumPy computation's result) trains as the int would.
        trainer, expected = _trainer(), _trainer()
        expected.fit([(self.x, self.y)] * 4, epochs=2, steps_per_epoch=2, verbose=False)
        history = trainer.fit([(self.x, self.y)] * 4, epochs=np.int64(2),
                              steps_per_epoch=np.int32(2), max_steps=np.int64(10),
                              verbose=False)
        self.assertEqual(trainer.step, 4)
        self.assertLen(history.history["loss"], 2)
        for want, got in zip(_state(expected), _state(trainer)):
            self.assertAllClose(want, got, atol=1e-6)

    def test_keras_habits_get_one_line_naming_the_argument(self):
        self.assertRefused(lambda: self.trainer.train_step(self.x, self.y), "data_ended",
                           r"^data_ended must be True or False, got ndarray; train_step takes "
                           r"the batch as one argument: train_step\(\(x, y\)\)")
        self.assertRefused(
            lambda: towers.TowerTrainer(reference.make_model(), None, keras.optimizers.SGD(0.1),
                                        devices=DEVICES), "loss", r"^loss is None; give")

    def test_spread_in_a_cluster_with_what_needs_every_workers_gradients(self):
        # Refused as the trainer is built, before the cluster is used: a stand-in reaches it.
        keras.mixed_precision.set_global_policy("mixed_float16")
        self.addCleanup(keras.mixed_precision.set_global_policy, "float32")
        float16_model = reference.make_model()
        keras.mixed_precision.set_global_policy("float32")
        for model, options in ((None, {"clip_global_norm": 1.0}), (float16_model, {})):
            self.assertRefused(
                lambda: _trainer(model, cluster=object(), variable_placement="spread",
                                 **options), "variable_placement",
                r"^variable_placement='spread' in a cluster cannot clip to a global norm or "
                r"scale the loss \(a float16 model\) yet.*use 'main'\.$")

    def test_reset_metrics_starts_train_steps_metrics_again(self):
        # A learning rate of 0 keeps the weights, so each step's accuracy is the model's.
        trainer = _trainer(optimizer=keras.optimizers.SGD(0.0), metrics=["accuracy"])
        (a, y_a), (b, y_b) = (self.x[:5], self.y[:5]), (self.x[5:], self.y[5:])
        trainer.train_step((a, y_a))
        right = [np.argmax(trainer.model(part), -1) == labels
                 for part, labels in ((a, y_a), (b, y_b))]
        logs = trainer.train_step((b, y_b))  # the metric runs over both calls
        self.assertAllClose(logs["accuracy"], np.mean(np.concatenate(right)))
        trainer.reset_metrics()
        logs = trainer.train_step((b, y_b))  # this batch's alone
        self.assertAllClose(logs["accuracy"], np.mean(right[1]))

    def test_an_unknown_keyword_is_refused_naming_what_is_taken(self):
        self.assertRefused(lambda: _trainer(micro_batch=2), "micro_batch",
                           r"unexpected keyword argument 'micro_batch'.*micro_batches",
                           error=TypeError)
        model = self.trainer.model
        self.assertRefused(
            lambda: towers.tower_gradients(model, "mse", (self.x, self.y), ["/cpu:0"],
                                           aggregation="tree"),
            "aggregation", r"unexpected keyword argument 'aggregation'.*accum_steps",
            error=TypeError)
        grads, _ = towers.tower_gradients(  # the two it takes
            model, "sparse_categorical_crossentropy", (self.x, self.y), ["/cpu:0", "/cpu:1"],
            accum_steps=2, state_policy="first_tower")
        self.assertLen(grads, len(model.trainable_variables))

    def test_other_counts_as_numpy_integers(self):
        options = towers.TowerOptions(accum_steps=np.int64(2), micro_batches=np.int32(1))
        self.assertEqual((type(options.accum_steps), options.accum_steps), (int, 2))
        self.assertEqual(_trainer(steps_per_execution=np.int64(3)).steps_per_execution, 3)
        checkpointer = towers.Checkpointer(self.create_tempdir().full_path, self.trainer.model,
                                           self.trainer.optimizer, every_steps=np.int64(5))
        self.assertEqual(checkpointer.every_steps, 5)

    def test_fit_with_one_callback_not_in_a_list(self):
        self.assertRefused(
            lambda: self.trainer.fit([(self.x, self.y)], callbacks=keras.callbacks.EarlyStopping()),
            "callbacks", r"^callbacks must be a list .* got one EarlyStopping")


class StepsWithoutAWordTest(tf.test.TestCase):
    """Issue 38: what once trained on, or stopped, without a word."""

    def setUp(self):
        super().setUp()
        self.x, self.y, _ = reference.make_batches(8, num_steps=1)[0]

    def test_an_empty_batch_is_no_step_at_several_steps_per_call(self):
        # Keras's fit applies an empty batch as an optimizer step of zero gradients, which
        # moves Adam's weights; train_step refuses one, and so does every path.
        batch = tf.data.Dataset.from_tensors((self.x, self.y))
        empty = tf.data.Dataset.from_tensors((self.x[:0], self.y[:0]))
        trainer = _trainer(optimizer=keras.optimizers.Adam(0.01), steps_per_execution=3)
        with self.assertRaisesRegex(ValueError, r"^the batch is empty \(batch size 0\): batch 2 "
                                    r"of this call of train_steps; .*The 1 step\(s\) before it "
                                    r"were applied, nothing of it or after it\.$"):
            trainer.fit(batch.concatenate(batch).concatenate(empty).concatenate(batch),
                        verbose=False)
        expected = _trainer(optimizer=keras.optimizers.Adam(0.01))
        for _ in range(2):  # fit's first step runs alone, then a call of up to 3
            expected.train_step((self.x, self.y))
        self.assertEqual(trainer.step, 2)
        for want, got in zip(_state(expected), _state(trainer)):
            self.assertAllClose(want, got, atol=1e-6)

    def test_nan_weights_from_a_callback_stop_a_run_that_skips_nonfinite_steps(self):
        class MakesNaN(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if batch == 1:
                    kernel = self.model.trainable_variables[0]
                    kernel.assign(np.full(kernel.shape, np.nan, "float32"))

        trainer = _trainer(on_nonfinite="skip")
        directory = self.create_tempdir().full_path
        checkpointer = towers.Checkpointer(directory, trainer.model, trainer.optimizer,
                                           every_steps=1)
        with self.assertRaisesRegex(towers.NonFiniteError,
                                    r"^step 3: the model's weights \['.*kernel'\] hold NaN or "
                                    r"Inf, set outside the step \(a callback, set_weights\)"):
            trainer.fit([(self.x, self.y)] * 4, verbose=False, callbacks=[MakesNaN()],
                        checkpointer=checkpointer)
        restored = _trainer()
        restored.optimizer.build(restored.model.trainable_variables)
        towers.Checkpointer(directory, restored.model, restored.optimizer).restore()
        self.assertEqual(restored.step, 2)  # the newest checkpoint: before the NaN
        self.assertTrue(all(np.isfinite(w).all() for w in restored.model.get_weights()))

    def test_a_keyboard_interrupt_from_a_callback_stops_as_sigint_does(self):
        class Interrupts(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if batch == 1:
                    raise KeyboardInterrupt

        trainer, directory = _trainer(), self.create_tempdir().full_path
        checkpointer = towers.Checkpointer(directory, trainer.model, trainer.optimizer)
        with self.assertRaisesRegex(towers.Preempted, r"^stopped by KeyboardInterrupt from a "
                                    r"callback after step 2: a checkpoint is saved in "):
            trainer.fit([(self.x, self.y)] * 4, verbose=False, callbacks=[Interrupts()],
                        checkpointer=checkpointer)
        restored = _trainer()
        restored.optimizer.build(restored.model.trainable_variables)
        checkpoint = towers.Checkpointer(directory, restored.model, restored.optimizer)
        checkpoint.restore()
        self.assertEqual((restored.step, int(checkpoint.batch_in_epoch)), (2, 2))

    def test_logical_devices_are_taken_by_name(self):
        devices = tf.config.list_logical_devices("CPU")[:3]
        self.assertEqual(_trainer(devices=devices).devices, DEVICES)

    def test_a_dataset_of_unknown_feature_width_trains_at_several_steps_per_call(self):
        # A generator's dataset: tf.TensorSpec([None, None]); its batches fit the model.
        def batches():
            for _ in range(3):
                yield self.x, self.y

        spec = (tf.TensorSpec([None, None], tf.float32), tf.TensorSpec([None], tf.int64))
        dataset = tf.data.Dataset.from_generator(batches, output_signature=spec)
        trainer, expected = _trainer(steps_per_execution=3), _trainer()
        trainer.fit(dataset, verbose=False)
        expected.fit([(self.x, self.y)] * 3, verbose=False)
        self.assertEqual(trainer.step, 3)
        for want, got in zip(_state(expected), _state(trainer)):
            self.assertAllClose(want, got, atol=1e-6)
