"""A model overriding Keras's step methods (train_step, test_step, compute_loss,
compute_metrics) is refused in one line naming the class, the methods and tower_step, and
one overriding predict_step trains but TowerTrainer.predict refuses it in one line;
Sequential, functional and a subclass overriding only call and build train as one device."""

import re

import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import towers
from tests import reference

DEVICES = [f"/device:CPU:{i}" for i in range(2)]


class Mlp(keras.Model):
    """reference.make_model's MLP written as a subclass: its own __init__, build and call."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(6, activation="tanh",
                                         kernel_regularizer=keras.regularizers.L2(0.01))
        self.out = keras.layers.Dense(reference.NUM_CLASSES)

    def build(self, input_shape):
        self.hidden.build(input_shape)
        self.out.build((None, 6))

    def call(self, x):
        return self.out(self.hidden(x))


def _mlp(seed=0):
    keras.utils.set_random_seed(seed)
    model = Mlp()
    model.build((None, reference.NUM_FEATURES))
    return model


def _overriding(name):
    """A subclass of Mlp whose `name` returns what keras.Model's does: the override alone
    is refused, whatever it computes."""
    def method(self, *args, **kwargs):
        return getattr(keras.Model, name)(self, *args, **kwargs)
    return type(f"With_{name}", (Mlp,), {name: method})


def _trainer(model):
    return towers.TowerTrainer(model, reference.make_loss(), keras.optimizers.SGD(0.1),
                               devices=DEVICES)


class RefusedTest(tf.test.TestCase, parameterized.TestCase):

    def assertRefused(self, model, *named):
        """TowerTrainer(model) raises a one-line ValueError naming the model's class, each
        of `named` and towers.tower_step."""
        with self.assertRaises(ValueError) as raised:
            _trainer(model)
        text = str(raised.exception)
        self.assertNotIn("\n", text)
        self.assertRegex(text, rf"^model {re.escape(type(model).__name__)} overrides ")
        for name in named:
            self.assertIn(name, text)
        self.assertIn("towers.tower_step", text)

    @parameterized.parameters("train_step", "test_step", "compute_loss", "compute_metrics")
    def test_each_method_overridden(self, name):
        self.assertRefused(_overriding(name)(), name)

    def test_compute_loss_alone_on_a_built_model(self):
        model = _overriding("compute_loss")()
        model.build((None, reference.NUM_FEATURES))
        self.assertRefused(model, "compute_loss")

    def test_several_methods_all_named(self):
        class Custom(Mlp):
            def train_step(self, data):
                return {}

            def compute_metrics(self, x, y, y_pred, sample_weight=None):
                return {}

        self.assertRefused(Custom(), "train_step, compute_metrics")

    def test_a_subclass_of_a_subclass_names_where_the_override_is(self):
        class Child(_overriding("compute_loss")):
            def call(self, x):
                return super().call(x)

        self.assertRefused(Child(), "compute_loss (in With_compute_loss)")

    def test_a_sequential_subclass_overriding_train_step(self):
        class Stepped(keras.Sequential):
            def train_step(self, data):
                return super().train_step(data)

        self.assertRefused(Stepped([keras.Input((reference.NUM_FEATURES,)),
                                    keras.layers.Dense(reference.NUM_CLASSES)]),
                           "train_step")


class AcceptedTest(tf.test.TestCase):

    def test_sequential_and_functional(self):
        batch = reference.make_batches(6, num_steps=1)[0]
        for model in (reference.make_model(), reference.make_up_down_model()):
            trainer = _trainer(model)
            self.assertIn("loss", trainer.train_step(batch))
            self.assertEqual(trainer.step, 1)

    def test_a_subclass_overriding_call_and_build_trains_as_one_device(self):
        batches = reference.make_batches(7, num_steps=3)  # shards of 4 and 3 rows
        expected = reference.single_device_weights(
            _mlp(), keras.optimizers.SGD(0.1), reference.make_loss(), batches)
        model = _mlp()
        trainer = _trainer(model)
        for batch in batches:
            trainer.train_step(batch)
        for want, got in zip(expected, model.weights):
            self.assertAllClose(want, got.numpy(), atol=1e-6, rtol=1e-6)

    def test_predict_step_overridden_trains_and_refuses_predict(self):
        # Training never calls predict_step: the model trains, and model.predict still
        # runs the override. TowerTrainer.predict would call it on each tower's shard,
        # not on the whole batch as Keras does: refused in one line naming it.
        class Decoding(Mlp):
            def predict_step(self, data):
                return keras.ops.argmax(super().predict_step(data), axis=-1)

        class Subclass(Decoding):  # inherits the override
            pass

        model = Decoding()
        trainer = _trainer(model)
        x, y, w = reference.make_batches(6, num_steps=1)[0]
        trainer.train_step((x, y, w))
        predicted = model.predict(x, verbose=0)
        self.assertAllEqual(predicted, np.argmax(model(x), axis=-1))
        for model, named in ((model, "predict_step"), (Subclass(), "predict_step (in Decoding)")):
            for call in (lambda: _trainer(model).predict(x, verbose=0),
                         lambda: _trainer(model).predict_on_batch(x)):
                with self.assertRaises(ValueError) as raised:
                    call()
                text = str(raised.exception)
                self.assertNotIn("\n", text)
                self.assertRegex(text, rf"^model {type(model).__name__} overrides keras.Model's "
                                       rf"{re.escape(named)}, ")


if __name__ == "__main__":
    tf.test.main()
