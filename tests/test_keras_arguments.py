"""fit and evaluate take keras.Model's arguments and mean what Keras means by them: arrays
batched by batch_size, validation_split, validation_data / _steps / _freq / _batch_size,
sample_weight, initial_epoch, shuffle, evaluate's steps and return_dict, and data that runs
out under steps_per_epoch. Each against Keras's own compile + fit / evaluate on one device
(logs by name and value, weights), on 1 and 3 towers with uneven batches."""

import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import towers

DEVICES = [f"/device:CPU:{i}" for i in range(3)]
CLASSES = 3


def _sequential():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(6, activation="tanh"),
                             keras.layers.Dense(CLASSES)])


def _two_inputs_two_outputs():
    """Named inputs "a" (4 features) and "b" (2), outputs "label" (logits) and "value"."""
    keras.utils.set_random_seed(0)
    a, b = keras.Input((4,), name="a"), keras.Input((2,), name="b")
    hidden = keras.layers.Dense(5, activation="relu")(keras.layers.Concatenate()([a, b]))
    return keras.Model({"a": a, "b": b},
                       {"label": keras.layers.Dense(CLASSES, name="label")(hidden),
                        "value": keras.layers.Dense(1, name="value")(hidden)})


def _loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _arrays(rows, seed=0):
    data = np.random.default_rng(seed)
    return (data.normal(size=(rows, 4)).astype("float32"), np.arange(rows) % CLASSES,
            data.uniform(0.5, 2.0, size=rows).astype("float32"))


def _compiled(model, loss, **compile_args):
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss=loss, **compile_args)
    return model


class _Steps(keras.callbacks.History):
    """Keras's History, counting the batches Keras trained on."""

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        self.keras_steps = 0

    def on_train_batch_end(self, batch, logs=None):
        self.keras_steps += 1


def _keras_fit(model, *args, **kwargs):
    history = _Steps()
    model.fit(*args, callbacks=[history], **kwargs)
    return history


def _trainer(model, loss, num_towers, **options):
    return towers.TowerTrainer(model, loss, keras.optimizers.SGD(0.05),
                               devices=DEVICES[:num_towers], **options)


class KerasArgumentsTest(tf.test.TestCase, parameterized.TestCase):

    def assertSameTraining(self, keras_model, history, trainer, expected):
        self.assertEqual(sorted(history.history.keys() - {"examples_per_sec"}),
                         sorted(expected.history))
        for name, values in expected.history.items():
            self.assertAllClose(history.history[name], values, atol=1e-5, msg=name)
        # Keras's steps as its callbacks saw them: its optimizer.iterations counts one more
        # where data of an unknown length ran out (the weights show no such step).
        self.assertEqual(trainer.step, expected.keras_steps)
        for want, got in zip(keras_model.get_weights(), trainer.model.get_weights()):
            self.assertAllClose(want, got, atol=1e-5)

    @parameterized.parameters(1, 3)
    def test_arrays_batch_size_validation_split_sample_weight_initial_epoch(self, num_towers):
        # 50 rows: 40 to train in batches of 7 (the last of 5), 10 held out; validated
        # after epochs 2 and 4 only; starting at epoch index 1, so 3 epochs run.
        x, y, weights = _arrays(50)
        arguments = dict(batch_size=7, epochs=4, validation_split=0.2, shuffle=False,
                         sample_weight=weights, initial_epoch=1, validation_freq=2, verbose=0)
        keras_model = _compiled(_sequential(), _loss(), metrics=["accuracy"])
        expected = _keras_fit(keras_model, x, y, **arguments)
        trainer = _trainer(_sequential(), _loss(), num_towers, metrics=["accuracy"])
        history = trainer.fit(x, y, **arguments)
        self.assertEqual(history.epoch, [1, 2, 3])
        self.assertLen(history.history["val_loss"], 2)
        self.assertSameTraining(keras_model, history, trainer, expected)

    def test_named_inputs_and_outputs_with_validation_data_arrays(self):
        x, labels, weights = _arrays(23)
        values = x[:, :1] * 2.0
        inputs = {"a": x, "b": x[:, :2] - 1.0}
        targets = {"label": labels, "value": values}
        val_x, val_labels, _ = _arrays(11, seed=1)
        validation = ({"a": val_x, "b": val_x[:, :2]},
                      {"label": val_labels, "value": val_x[:, 1:2]})
        loss = {"label": _loss(), "value": "mse"}
        compile_args = dict(loss_weights={"label": 1.0, "value": 0.5},
                            metrics={"label": ["accuracy"]})
        arguments = dict(batch_size=6, epochs=3, validation_data=validation,
                         validation_batch_size=4, validation_steps=2, validation_freq=[1, 3],
                         shuffle=False, sample_weight=weights, verbose=0)
        keras_model = _compiled(_two_inputs_two_outputs(), loss, **compile_args)
        expected = _keras_fit(keras_model, inputs, targets, **arguments)
        trainer = _trainer(_two_inputs_two_outputs(), loss, 3, **compile_args)
        history = trainer.fit(inputs, targets, **arguments)
        self.assertSameTraining(keras_model, history, trainer, expected)

    def test_evaluate_batch_size_steps_and_return_dict(self):
        x, labels, weights = _arrays(31)
        targets = {"label": labels, "value": x[:, :1]}
        loss = {"label": _loss(), "value": "mse"}
        compile_args = dict(metrics={"label": ["accuracy"], "value": ["mae"]})
        keras_model = _compiled(_two_inputs_two_outputs(), loss, **compile_args)
        trainer = _trainer(_two_inputs_two_outputs(), loss, 3, **compile_args)
        inputs = {"a": x, "b": x[:, 2:]}
        for arguments in (dict(batch_size=9), dict(batch_size=5, steps=3),
                          dict(sample_weight=weights)):
            expected = keras_model.evaluate(inputs, targets, verbose=0, **arguments)
            got = trainer.evaluate(inputs, targets, return_dict=False, verbose=0, **arguments)
            self.assertAllClose(got, expected, atol=1e-5, msg=str(arguments))
            self.assertEqual(
                trainer.evaluate(inputs, targets, verbose=0, **arguments).keys(),
                keras_model.evaluate(inputs, targets, verbose=0, return_dict=True,
                                     **arguments).keys())
        single = _compiled(_sequential(), _loss())
        trainer = _trainer(_sequential(), _loss(), 3)
        x, y, _ = _arrays(10)
        expected = single.evaluate(x, y, batch_size=4, verbose=0)
        self.assertAllClose(trainer.evaluate(x, y, batch_size=4, return_dict=False), expected,
                            atol=1e-6)
        self.assertIsInstance(trainer.evaluate((x, y), return_dict=False), float)

    @parameterized.named_parameters(
        # 3 batches, 2 per epoch, 3 epochs: 2, then 1 (the data runs out, Keras warns),
        # then 2 from the data's start: 5 steps.
        ("known_length", 21, 2, lambda data: data),
        # The same of a length tf.data does not know (filtered).
        ("unknown_length", 21, 2, lambda data: data.filter(lambda *batch: True)),
        # 4 batches of an unknown length: epoch 3 finds the data ended and gets no step
        # (under Keras too), epoch 4 starts the data again.
        ("unknown_length_ending_with_an_epoch", 28, 4,
         lambda data: data.filter(lambda *batch: True)),
        # Arrays (their length known): 3 batches of 7.
        ("arrays", 21, 2, None),
        # Two steps per call of the compiled loop, of a known length: the data ends inside
        # a call. (Of an unknown length Keras finds the end a call later: docs/api.md.)
        ("known_length_two_steps_per_execution", 21, 2, lambda data: data, 2))
    def test_data_that_runs_out_under_steps_per_epoch(self, rows, epochs, dataset,
                                                       steps_per_execution=1):
        x, y, _ = _arrays(rows)
        data = (dict(x=x, y=y, batch_size=7, shuffle=False) if dataset is None else
                dict(x=dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(7))))
        arguments = dict(epochs=epochs + 1, steps_per_epoch=2, verbose=0)
        keras_model = _compiled(_sequential(), _loss(), metrics=["accuracy"],
                                steps_per_execution=steps_per_execution)
        expected = _keras_fit(keras_model, **data, **arguments)
        if steps_per_execution > 1:  # Keras calls its batch hooks once per call then
            expected.keras_steps = int(keras_model.optimizer.iterations)
        trainer = _trainer(_sequential(), _loss(), 3, metrics=["accuracy"],
                           steps_per_execution=steps_per_execution)
        history = trainer.fit(**data, **arguments)
        self.assertSameTraining(keras_model, history, trainer, expected)

    def test_train_on_batch_and_test_on_batch_as_keras(self):
        # Keras resets the metrics before each call: every log is the batch's own.
        x, labels, weights = _arrays(17)
        inputs, targets = {"a": x, "b": x[:, 1:3]}, {"label": labels, "value": x[:, :1]}
        loss = {"label": _loss(), "value": "mse"}
        compile_args = dict(metrics={"label": ["accuracy"]}, loss_weights=[1.0, 0.3])
        keras_model = _compiled(_two_inputs_two_outputs(), loss, **compile_args)
        trainer = _trainer(_two_inputs_two_outputs(), loss, 3, **compile_args)
        for rows in (slice(0, 7), slice(7, 9), slice(9, 17)):
            batch = ({k: v[rows] for k, v in inputs.items()},
                     {k: v[rows] for k, v in targets.items()})
            for return_dict in (False, True):
                self.assertAllClose(
                    trainer.test_on_batch(*batch, weights[rows], return_dict=return_dict),
                    keras_model.test_on_batch(*batch, weights[rows], return_dict=return_dict),
                    atol=1e-5)
            self.assertAllClose(trainer.train_on_batch(*batch, weights[rows]),
                                keras_model.train_on_batch(*batch, weights[rows]), atol=1e-5)
        for want, got in zip(keras_model.get_weights(), trainer.model.get_weights()):
            self.assertAllClose(want, got, atol=1e-5)
        single, trainer = _compiled(_sequential(), _loss()), _trainer(_sequential(), _loss(), 3)
        class_weight = {0: 2.0, 2: 0.5}
        for rows in (slice(0, 5), slice(5, 17)):
            self.assertAllClose(
                trainer.train_on_batch(x[rows], labels[rows], class_weight=class_weight,
                                       return_dict=True),
                single.train_on_batch(x[rows], labels[rows], class_weight=class_weight,
                                      return_dict=True), atol=1e-5)

    def test_shuffled_arrays_in_one_batch_train_as_keras(self):
        # One batch of every row each epoch: the order Keras draws changes nothing exact.
        x, y, _ = _arrays(20)
        keras_model = _compiled(_sequential(), _loss())
        expected = _keras_fit(keras_model, x, y, batch_size=20, epochs=2, verbose=0)
        trainer = _trainer(_sequential(), _loss(), 3)
        history = trainer.fit(x, y, batch_size=20, epochs=2, verbose=0)
        self.assertSameTraining(keras_model, history, trainer, expected)


if __name__ == "__main__":
    tf.test.main()
