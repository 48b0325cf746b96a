"""Layers frozen or unfrozen between steps train exactly the new trainable set, as Keras
does after recompiling (issue 23, part 3); a newly trainable variable gets its optimizer
slots next to it."""

import functools

import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import towers
from tests import reference

CPU = [f"/device:CPU:{i}" for i in range(4)]
TOLERANCE = 1e-5
BATCH = 7  # uneven over 3 towers: 3, 2, 2
# Before step i, set these layers' trainable flags: freeze up after one step, unfreeze
# it after two more.
FREEZE_THEN_UNFREEZE = {1: {"up": False}, 3: {"up": True}}
# down starts frozen and is unfrozen after the first step: it has no slots until then.
UNFREEZE_LATER = {0: {"down": False}, 1: {"down": True}}
MLP_PLAN = {"up": "column", "down": "row", "out": 0}
GRIDS = {1: [CPU[:2]], 3: [CPU[:2], CPU[2:], CPU[1:3]]}  # rows of (stage 0, stage 1)


def _batches():
    return reference.make_batches(BATCH, num_steps=4)


def _set_trainable(model, flags):
    for name, trainable in flags.items():
        model.get_layer(name).trainable = trainable


@functools.lru_cache(maxsize=None)
def _keras_run(optimizer_name, schedule_name):
    """(weights, each step's loss) of Keras's compile + train_on_batch on each batch,
    recompiling after each change of the schedule; its optimizer is built on every
    variable first, so that Keras accepts unfreezing one it would not know."""
    schedule = SCHEDULES[schedule_name]
    model, optimizer = reference.make_up_down_model(), reference.OPTIMIZERS[optimizer_name]()
    optimizer.build(model.trainable_variables)
    losses = []
    for step, (x, y, w) in enumerate(_batches()):
        if step in schedule or step == 0:
            _set_trainable(model, schedule.get(step, {}))
            model.compile(optimizer=optimizer, loss=reference.make_loss())
        losses.append(model.train_on_batch(x, y, sample_weight=w))
    return model.get_weights(), losses


SCHEDULES = {"freeze_then_unfreeze": FREEZE_THEN_UNFREEZE, "unfreeze_later": UNFREEZE_LATER}


def _train(trainer, schedule, steps=None):
    """Trains on the batches of `steps` (None: all), first setting trainable flags as
    `schedule` says; returns the steps' losses."""
    batches, losses = _batches(), []
    for step in steps or range(len(batches)):
        _set_trainable(trainer.model, schedule.get(step, {}))
        losses.append(trainer.train_step(batches[step])["loss"])
    return losses


def _slots(optimizer, variable):
    """The optimizer variables Keras names after `variable` (its momentum, velocity)."""
    prefix = variable.path.replace("/", "_") + "_"
    return [v for v in optimizer.variables if v.name.startswith(prefix)]


def _device_of(variable):
    return towers.devices.canonical_name(variable.value.device)


class KerasTestCase(tf.test.TestCase, parameterized.TestCase):

    def assert_equal_keras(self, optimizer_name, schedule_name, weights, losses):
        want_weights, want_losses = _keras_run(optimizer_name, schedule_name)
        for want, got in zip(want_weights, weights):
            self.assertAllClose(got, want, atol=TOLERANCE, rtol=0)
        # A frozen layer's L2 penalty is not in the loss, as in Keras.
        self.assertAllClose(losses, want_losses, atol=TOLERANCE, rtol=0)


class FreezeBetweenStepsTest(KerasTestCase):

    @parameterized.named_parameters(
        ("one_tower_sgd", 1, "sgd", {}), ("one_tower_adam", 1, "adam", {}),
        ("three_towers_sgd", 3, "sgd", {}), ("three_towers_adam", 3, "adam", {}),
        ("pipeline_one_tower_adam", 1, "adam", {"pipeline_cuts": ["up"]}),
        ("pipeline_three_towers_sgd", 3, "sgd", {"pipeline_cuts": ["up"]}),
        ("accumulation_one_tower_sgd", 1, "sgd", {"accum_steps": 2}),
        ("accumulation_three_towers_adam", 3, "adam", {"accum_steps": 2}),
        ("replicated_three_towers_adam", 3, "adam", {"variable_placement": "replicated"}),
        ("xla_one_tower_sgd", 1, "sgd", {"jit_compile": True}))
    def test_freeze_then_unfreeze_as_keras(self, num_towers, optimizer, options):
        devices = GRIDS[num_towers] if "pipeline_cuts" in options else CPU[:num_towers]
        trainer = towers.TowerTrainer(reference.make_up_down_model(), reference.make_loss(),
                                      reference.OPTIMIZERS[optimizer](), devices=devices,
                                      **options)
        losses = _train(trainer, FREEZE_THEN_UNFREEZE)
        self.assert_equal_keras(optimizer, "freeze_then_unfreeze", trainer.model.get_weights(),
                                losses)
        self.assertEqual(trainer.step, len(_batches()))

    def test_frozen_layer_stays_and_nothing_retraces_without_a_change(self):
        trainer = towers.TowerTrainer(reference.make_up_down_model(), reference.make_loss(),
                                      keras.optimizers.SGD(0.1, momentum=0.9), devices=CPU[:2])
        batches = _batches()
        trainer.train_step(batches[0])
        trainer.evaluate(batches[3])  # traced for every layer trainable
        up = trainer.model.get_layer("up")
        up.trainable = False
        # Keras's evaluation with up frozen: its L2 penalty is not in the loss.
        expected = reference.make_up_down_model()
        expected.set_weights(trainer.model.get_weights())
        expected.get_layer("up").trainable = False
        expected.compile(loss=reference.make_loss())
        x, y, w = batches[3]
        self.assertAllClose(trainer.evaluate(batches[3])["loss"],
                            expected.evaluate(x, y, sample_weight=w, verbose=0),
                            atol=TOLERANCE, rtol=0)
        kernel = up.kernel.numpy()
        for batch in batches[1:3]:
            trainer.train_step(batch)
        self.assertAllEqual(up.kernel.numpy(), kernel)
        # The evaluation and the step, each traced once for the frozen set, and kept.
        self.assertEqual([f.experimental_get_tracing_count()
                          for f in trainer._compiled.functions()], [1, 1])

    @parameterized.parameters("adam", "loss_scaled_adam")
    def test_newly_trainable_variable_gets_slots_on_its_stage_device(self, optimizer):
        adam = reference.OPTIMIZERS["adam"]()
        trainer = towers.TowerTrainer(
            reference.make_up_down_model(), reference.make_loss(),
            keras.optimizers.LossScaleOptimizer(adam) if optimizer != "adam" else adam,
            devices=GRIDS[3], pipeline_cuts=["up"])
        down = trainer.model.get_layer("down")
        losses = _train(trainer, UNFREEZE_LATER, steps=[0])
        self.assertEmpty(_slots(adam, down.kernel))
        losses += _train(trainer, UNFREEZE_LATER, steps=range(1, len(_batches())))
        self.assert_equal_keras("adam", "unfreeze_later", trainer.model.get_weights(), losses)
        for variable in down.trainable_weights:  # stage 1's: kernel and bias
            self.assertEqual(_device_of(variable), CPU[1])
            slots = _slots(adam, variable)
            self.assertEqual([s.name.rsplit("_", 1)[-1] for s in slots],
                             ["momentum", "velocity"])
            self.assertEqual([_device_of(s) for s in slots], [CPU[1]] * 2)
        self.assertEqual(trainer.step, len(_batches()))

    def test_no_trainable_variable_left_is_refused_in_one_line(self):
        trainer = towers.TowerTrainer(reference.make_up_down_model(), reference.make_loss(),
                                      keras.optimizers.SGD(0.1), devices=CPU[:2])
        batch = _batches()[0]
        trainer.train_step(batch)
        weights = trainer.model.get_weights()
        trainer.model.trainable = False
        with self.assertRaisesRegex(ValueError, "has no trainable weights"):
            trainer.train_step(batch)
        for want, got in zip(weights, trainer.model.get_weights()):
            self.assertAllEqual(got, want)
        self.assertEqual(trainer.step, 1)


class KeyedSGD(keras.optimizers.Optimizer):
    """Plain SGD that keeps a slot per variable in a dict by path, not in a list."""

    def build(self, variables):
        super().build(variables)
        self.unused = {v.path: self.add_variable_from_reference(v, "unused") for v in variables}

    def update_step(self, gradient, variable, learning_rate):
        self.assign_sub(variable, learning_rate * gradient)


class RefusedOptimizerTest(tf.test.TestCase):

    def test_optimizer_that_cannot_take_a_new_variable_is_refused_in_one_line(self):
        trainer = towers.TowerTrainer(reference.make_up_down_model(), reference.make_loss(),
                                      KeyedSGD(0.1), devices=CPU[:2])
        _train(trainer, UNFREEZE_LATER, steps=[0])
        weights = trainer.model.get_weights()
        with self.assertRaisesRegex(ValueError, "cannot give the newly trainable 'down/kernel' "
                                                "its slots in a KeyedSGD"):
            _train(trainer, UNFREEZE_LATER, steps=[1])
        for want, got in zip(weights, trainer.model.get_weights()):
            self.assertAllEqual(got, want)


def _split_model(seed=0):
    return towers.split_layers(reference.make_up_down_model(seed), MLP_PLAN, CPU[1:])


class SplitLayerTest(KerasTestCase):

    @parameterized.parameters(1, 2)
    def test_split_layer_frozen_then_unfrozen_as_keras(self, num_towers):
        trainer = towers.TowerTrainer(_split_model(), reference.make_loss(),
                                      reference.OPTIMIZERS["adam"](), devices=CPU[:num_towers])
        losses = _train(trainer, FREEZE_THEN_UNFREEZE)
        self.assert_equal_keras("adam", "freeze_then_unfreeze",
                                towers.join_layers(trainer.model).get_weights(), losses)


class Unfreeze(keras.callbacks.Callback):
    """Unfreezes down when epoch 1 begins; with `recompile` (Keras's fit) retraces too."""

    def __init__(self, recompile=False):
        super().__init__()
        self.recompile = recompile

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 1:
            self.model.get_layer("down").trainable = True
            if self.recompile:
                self.model.make_train_function(force=True)


def _dataset():
    x, y, w = (np.concatenate(parts) for parts in zip(*reference.make_batches(9, 2)))
    return tf.data.Dataset.from_tensor_slices((x, y, w)).batch(BATCH)  # 7, 7, 4


class FitCallbackTest(tf.test.TestCase, parameterized.TestCase):

    # The in-graph loop (3 steps per call) traces slowly on several towers: one here.
    @parameterized.parameters((1, 3), (3, 1))
    def test_callback_unfreezes_at_an_epoch_as_in_keras_fit(self, steps_per_execution,
                                                            num_towers):
        expected, optimizer = reference.make_up_down_model(), reference.OPTIMIZERS["adam"]()
        optimizer.build(expected.trainable_variables)
        expected.get_layer("down").trainable = False
        expected.compile(optimizer=optimizer, loss=reference.make_loss())
        expected.fit(_dataset(), epochs=2, callbacks=[Unfreeze(recompile=True)], verbose=0,
                     shuffle=False)
        model = reference.make_up_down_model()
        model.get_layer("down").trainable = False
        trainer = towers.TowerTrainer(model, reference.make_loss(),
                                      reference.OPTIMIZERS["adam"](),
                                      devices=CPU[:num_towers],
                                      steps_per_execution=steps_per_execution)
        trainer.fit(_dataset(), epochs=2, callbacks=[Unfreeze()], verbose=False)
        for want, got in zip(expected.get_weights(), model.get_weights()):
            self.assertAllClose(got, want, atol=TOLERANCE, rtol=0)
        self.assertEqual(trainer.step, 6)
