"""Keras callbacks in TowerTrainer.fit on 2 towers, each against keras.Model.fit or a
plain GradientTape loop on one device."""

import csv
import os

import keras
import numpy as np
import tensorflow as tf

import towers
from tests import reference

DEVICES = ["/device:CPU:0", "/device:CPU:1"]
TOLERANCE = 1e-5


class Recorder(keras.callbacks.Callback):
    """A user's own Callback: records every hook with its arguments, logs rounded."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __getattribute__(self, name):
        hook = object.__getattribute__(self, name)
        if not name.startswith("on_"):
            return hook

        def record(*args, **kwargs):
            logs = kwargs.get("logs", args[-1] if args and isinstance(args[-1], dict) else None)
            index = [a for a in args if isinstance(a, int)]
            self.calls.append((name, index, {k: round(float(v), 4) for k, v in (logs or {}).items()
                                             if k != "examples_per_sec"}))
            return hook(*args, **kwargs)

        return record


def _data(size=20, seed=0):
    x, y, _ = reference.make_batches(size, num_steps=1, seed=seed)[0]
    return x, y, tf.data.Dataset.from_tensor_slices((x, y)).batch(8)  # 8, 8, 4


def _dataset(batches):
    """A tf.data.Dataset of these (x, y) batches, in order."""
    return tf.data.Dataset.from_generator(
        lambda: iter(batches), output_signature=(
            tf.TensorSpec((None, reference.NUM_FEATURES), tf.float32),
            tf.TensorSpec((None,), tf.int64)))


def _keras_model(learning_rate=0.05):
    model = reference.make_model()
    model.compile(keras.optimizers.Adam(learning_rate), reference.make_loss(),
                  metrics=["accuracy"])
    return model


def _trainer(learning_rate=0.05, optimizer=None, **options):
    return towers.TowerTrainer(reference.make_model(), reference.make_loss(),
                               optimizer or keras.optimizers.Adam(learning_rate),
                               devices=DEVICES, metrics=["accuracy"], **options)


def _assert_weights_close(test, expected, actual):
    for want, got in zip(expected, actual):
        test.assertAllClose(want, got, atol=TOLERANCE, rtol=TOLERANCE)


class CallbackOrderTest(tf.test.TestCase):

    def test_hooks_and_logs_equal_keras_fit(self):
        _, _, train = _data()
        _, _, validation = _data(10, seed=5)
        expected, actual = Recorder(), Recorder()
        keras_model = _keras_model()
        keras_history = keras_model.fit(train, epochs=2, validation_data=validation,
                                        callbacks=[expected], verbose=0)
        trainer = _trainer()
        history = trainer.fit(train, epochs=2, validation_data=validation,
                              callbacks=[actual], verbose=False)
        self.assertEqual([c[:2] for c in actual.calls], [c[:2] for c in expected.calls])
        for want, got in zip(expected.calls, actual.calls):
            self.assertEqual(sorted(want[2]), sorted(got[2]), want[0])
            self.assertAllClose(want[2], got[2], atol=2e-4, msg=want[0])
        self.assertIsInstance(history, keras.callbacks.History)
        self.assertEqual(history.epoch, keras_history.epoch)
        self.assertAllClose(history.history["val_loss"], keras_history.history["val_loss"],
                            atol=TOLERANCE)
        self.assertIs(actual.model, trainer.model)
        self.assertIs(actual.model.optimizer, trainer.optimizer)
        _assert_weights_close(self, keras_model.weights, trainer.model.weights)


class StoppingTest(tf.test.TestCase):

    def test_early_stopping_stops_and_restores_like_keras(self):
        _, _, train = _data(24)
        _, _, validation = _data(12, seed=9)  # other labels: validation loss soon rises

        def early_stopping():
            return keras.callbacks.EarlyStopping("val_loss", patience=1,
                                                 restore_best_weights=True)

        keras_model = _keras_model(0.3)
        keras_history = keras_model.fit(train, epochs=20, validation_data=validation,
                                        callbacks=[early_stopping()], verbose=0)
        trainer = _trainer(0.3, variable_placement="replicated")
        history = trainer.fit(train, epochs=20, validation_data=validation,
                              callbacks=[early_stopping()], verbose=False)
        self.assertLess(len(keras_history.epoch), 20)  # it really stopped early
        self.assertEqual(history.epoch, keras_history.epoch)
        _assert_weights_close(self, keras_model.weights, trainer.model.weights)
        # The towers' replicas hold the restored best weights too: one more step agrees.
        x, y = next(iter(train))
        keras_model.train_on_batch(x, y)
        trainer.train_step((x, y))
        _assert_weights_close(self, keras_model.weights, trainer.model.weights)

    def test_a_skipped_step_enters_no_log(self):
        # on_nonfinite="skip" is the user's choice: the broken step's NaN loss must not
        # reach the epoch's loss, the metrics or TerminateOnNaN, at 1 or 2 steps per call.
        batches = reference.make_batches(8, num_steps=4, sample_weights=False)
        broken = (batches[2][0].copy(), batches[2][1])
        broken[0][3, 1] = np.nan
        kept = batches[:2] + batches[3:]
        keras_model = _keras_model()
        keras_history = keras_model.fit(_dataset(kept), epochs=1, verbose=0)
        for steps_per_execution in (1, 2):
            trainer = _trainer(on_nonfinite="skip", steps_per_execution=steps_per_execution)
            history = trainer.fit(_dataset(batches[:2] + [broken] + batches[3:]), epochs=1,
                                  callbacks=[keras.callbacks.TerminateOnNaN()], verbose=False)
            self.assertEqual(trainer.step, 3)
            for name in ("loss", "accuracy"):
                self.assertAllClose(history.history[name], keras_history.history[name],
                                    atol=TOLERANCE)
            _assert_weights_close(self, keras_model.weights, trainer.model.weights)


class LearningRateTest(tf.test.TestCase):

    def _tape_loop(self, batches, rate_of_epoch, epochs):
        model, optimizer, loss = reference.make_model(), keras.optimizers.SGD(0.1), \
            reference.make_loss()
        for epoch in range(epochs):
            optimizer.learning_rate = rate_of_epoch(epoch)
            for x, y in batches:
                with tf.GradientTape() as tape:
                    value = loss(y, model(x, training=True)) + tf.add_n(model.losses)
                optimizer.apply_gradients(zip(tape.gradient(value, model.trainable_variables),
                                              model.trainable_variables))
        return model.weights

    def test_scheduler_and_plateau_use_the_new_rate_without_retracing(self):
        batches = reference.make_batches(10, num_steps=3, sample_weights=False)
        for callback, rate_of_epoch in [
                (keras.callbacks.LearningRateScheduler(lambda epoch: 0.1 * 0.5 ** epoch),
                 lambda epoch: 0.1 * 0.5 ** epoch),
                # min_delta so large that no epoch improves: the rate halves after each
                # epoch from the second on.
                (keras.callbacks.ReduceLROnPlateau("loss", factor=0.5, patience=0,
                                                   min_delta=100.0),
                 lambda epoch: 0.1 * 0.5 ** max(epoch - 1, 0))]:
            trainer = _trainer(optimizer=keras.optimizers.SGD(0.1))
            trainer.fit(batches, epochs=4, callbacks=[callback], verbose=False)
            _assert_weights_close(self, self._tape_loop(batches, rate_of_epoch, 4),
                                  trainer.model.weights)
            [step] = trainer._compiled.functions()
            self.assertEqual(step.experimental_get_tracing_count(), 1)


class FilesTest(tf.test.TestCase):

    def test_model_checkpoint_csv_logger_tensorboard_lambda(self):
        directory = self.get_temp_dir()
        _, _, train = _data()
        epochs_seen = []
        trainer = _trainer()
        trainer.fit(train, epochs=2, validation_data=train, verbose=False, callbacks=[
            keras.callbacks.ModelCheckpoint(os.path.join(directory, "best.weights.h5"),
                                            save_weights_only=True),
            keras.callbacks.ModelCheckpoint(os.path.join(directory, "model.keras")),
            keras.callbacks.CSVLogger(os.path.join(directory, "log.csv")),
            keras.callbacks.TensorBoard(os.path.join(directory, "tensorboard")),
            keras.callbacks.LambdaCallback(on_epoch_end=lambda e, logs: epochs_seen.append(e))])
        self.assertEqual(epochs_seen, [0, 1])
        fresh = reference.make_model(seed=3)
        fresh.load_weights(os.path.join(directory, "best.weights.h5"))
        loaded = keras.models.load_model(os.path.join(directory, "model.keras"))
        for model in (fresh, loaded):
            for want, got in zip(trainer.model.weights, model.weights):
                self.assertAllEqual(want, got)
        with open(os.path.join(directory, "log.csv")) as f:
            rows = list(csv.DictReader(f))
        self.assertEqual([r["epoch"] for r in rows], ["0", "1"])
        self.assertIn("val_loss", rows[0])
        written = [f for _, _, files in os.walk(os.path.join(directory, "tensorboard"))
                   for f in files]
        self.assertTrue(any(f.startswith("events.out.tfevents") for f in written), written)

    def test_backup_and_restore_is_refused(self):
        with self.assertRaisesRegex(ValueError, "BackupAndRestore is not supported.*Checkpointer"):
            _trainer().fit([], callbacks=[keras.callbacks.BackupAndRestore(self.get_temp_dir())])

    def test_not_a_callback(self):
        with self.assertRaisesRegex(ValueError, "keras.callbacks.Callback objects, got function"):
            _trainer().fit([], callbacks=[lambda: None])


if __name__ == "__main__":
    tf.test.main()
