"""jit_compile=True: each tower's forward and backward is one XLA computation on its
device; the weights still equal one device's on the whole batch."""

import os
import subprocess
import sys
import tempfile
import textwrap

import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import towers
from tests import reference

DEVICES = [f"/device:CPU:{i}" for i in range(4)]
TOLERANCE = 1e-5
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Uneven over 3 and 4 towers, a tower left empty (3 over 4), and a short last batch.
BATCH_SIZES = (12, 10, 3, 12, 7)


def _batches():
    return [b for size in BATCH_SIZES for b in reference.make_batches(size, num_steps=1,
                                                                      seed=size)]


class XlaEquivalenceTest(tf.test.TestCase, parameterized.TestCase):

    def _assert_matches_one_device(self, devices, **options):
        """jit_compile=True on `devices` (with `options`, `model` meaning the model) equals
        a plain one-device GradientTape loop over _batches()."""
        batches = _batches()
        expected = reference.single_device_weights(
            reference.make_model(), reference.OPTIMIZERS["adam"](), reference.make_loss(),
            batches)
        model = reference.make_model()
        if "pipeline_cuts" in options:  # cut after the first layer, whatever its name
            options["pipeline_cuts"] = [model.layers[0].name]
        trainer = towers.TowerTrainer(model, reference.make_loss(),
                                      reference.OPTIMIZERS["adam"](), devices=devices,
                                      jit_compile=True, **options)
        for batch in batches:
            trainer.train_step(batch)
        for want, got in zip(expected, model.weights):
            self.assertAllClose(want, got, atol=TOLERANCE, rtol=TOLERANCE, msg=got.path)

    @parameterized.parameters(1, 2, 3, 4)
    def test_matches_one_device(self, num_towers):
        self._assert_matches_one_device(DEVICES[:num_towers])

    def test_batchnorm_and_accumulation_match_the_same_towers_without_xla(self):
        # (Not dropout: XLA's random number kernels draw other masks than TensorFlow's.)
        def model_fn():
            keras.utils.set_random_seed(0)
            return keras.Sequential([
                keras.Input((reference.NUM_FEATURES,)), keras.layers.Dense(6),
                keras.layers.BatchNormalization(momentum=0.5),
                keras.layers.Dense(reference.NUM_CLASSES)])

        models = []
        for jit_compile in (False, True):
            models.append(model_fn())
            trainer = towers.TowerTrainer(models[-1], reference.make_loss(),
                                          keras.optimizers.SGD(0.1), devices=DEVICES[:2],
                                          accum_steps=2, jit_compile=jit_compile)
            for batch in _batches()[:2]:
                trainer.train_step(batch)
        for want, got in zip(*[m.weights for m in models]):
            self.assertAllClose(want, got, atol=TOLERANCE, rtol=TOLERANCE, msg=got.path)

    @parameterized.parameters("gpipe", "1f1b")
    def test_pipeline_stages_match_one_device(self, schedule):
        # 2 towers x 2 stages, 2 micro-batches: each stage's forward and backward per
        # micro-batch is an XLA computation on its device.
        self._assert_matches_one_device([DEVICES[:2], DEVICES[2:]], pipeline_cuts=True,
                                        micro_batches=2, pipeline_schedule=schedule)


class XlaCompilationTest(tf.test.TestCase):

    def _executables_per_epoch(self, trainer_options):
        """Runs 3 epochs of _batches() on a TowerTrainer(jit_compile=True, **trainer_options)
        in a fresh process; the number of XLA executables after each epoch."""
        # XLA writes each executable it compiles to its persistent cache: count them.
        cache = tempfile.mkdtemp(dir=self.get_temp_dir())
        script = textwrap.dedent(f"""
            import os
            import tests.conftest
            import towers
            from tests import reference
            from tests.test_xla import DEVICES, _batches
            model = reference.make_model()
            options = {trainer_options!r}
            if "pipeline_cuts" in options:  # cut after the first layer, whatever its name
                options["pipeline_cuts"] = [model.layers[0].name]
            trainer = towers.TowerTrainer(model, reference.make_loss(),
                                          reference.OPTIMIZERS["sgd"](), jit_compile=True,
                                          **options)
            for _ in range(3):
                for batch in _batches():
                    trainer.train_step(batch)
                print(len(os.listdir({cache!r})))
            """)
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2",
               "TF_XLA_FLAGS": f"--tf_xla_persistent_cache_directory={cache}"}
        result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env,
                                capture_output=True, text=True, timeout=300)
        self.assertEqual(result.returncode, 0, result.stderr[-2000:])
        return [int(line) for line in result.stdout.split()]

    def test_one_compilation_per_shard_size_shared_by_every_tower(self):
        # One executable per shard size, whatever the step (a batch that leaves a tower
        # without a row leaves that tower out), and one more for the first batch's step,
        # traced for its rows (the step for any rows takes the others).
        compiled = set()
        for batch in BATCH_SIZES:
            compiled |= set(towers.split.shard_sizes(batch, len(DEVICES))) - {0}
        self.assertEqual(compiled, {3, 2, 1})
        # Nothing new to compile after the first epoch.
        self.assertEqual(self._executables_per_epoch({"devices": DEVICES}),
                         [len(compiled) + 1] * 3)

    def test_pipeline_compilations_stay_bounded(self):
        executables = self._executables_per_epoch({
            "devices": [DEVICES[:2], DEVICES[2:]], "pipeline_cuts": True, "micro_batches": 2})
        micro_batch_sizes = {micro for batch in BATCH_SIZES
                             for shard in towers.split.shard_sizes(batch, 2)
                             for micro in towers.split.shard_sizes(shard, 2)}
        self.assertEqual(micro_batch_sizes, {3, 2, 1, 0})
        # At most a forward and a backward per stage and micro-batch size, all in epoch 1.
        self.assertLessEqual(executables[0], 2 * 2 * len(micro_batch_sizes))
        self.assertEqual(executables, executables[:1] * 3)


class XlaErrorTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.parameters(False, True)  # one stage, or the op alone in stage 0
    def test_an_op_xla_cannot_compile_is_one_line_and_changes_nothing(self, stages):
        keras.utils.set_random_seed(0)
        host_only = keras.layers.Lambda(
            lambda x: tf.ensure_shape(tf.numpy_function(lambda a: a, [x], tf.float32,
                                                        stateful=False), x.shape),
            output_shape=(reference.NUM_FEATURES,))
        model = keras.Sequential([keras.Input((reference.NUM_FEATURES,)), host_only,
                                  keras.layers.Dense(reference.NUM_CLASSES)])
        options = (dict(devices=[DEVICES[:2], DEVICES[2:]], pipeline_cuts=[host_only.name])
                   if stages else dict(devices=DEVICES[:2]))
        trainer = towers.TowerTrainer(model, reference.make_loss(), keras.optimizers.Adam(),
                                      jit_compile=True, **options)
        before = [v.numpy() for v in model.weights]
        with self.assertRaisesRegex(ValueError, r"XLA cannot compile this model's tower step: "
                                                r"Detected unsupported operations.*"
                                                r"PyFuncStateless.*Pass jit_compile=False") \
                as caught:
            trainer.train_step(reference.make_batches(4, num_steps=1)[0])
        for want, got in zip(before, model.weights):
            self.assertAllEqual(want, got)
        self.assertEqual(trainer.step, 0)
        self.assertIsInstance(caught.exception.__cause__, tf.errors.InvalidArgumentError)

    def test_an_error_at_run_time_keeps_its_cause_and_no_xla_advice(self):
        # The second batch's x has a row more than its y: with shapes known only at
        # run time, the step's own check fails inside the compiled loop.
        good, bad = reference.make_batches(4, num_steps=2)
        bad = (np.concatenate([bad[0], bad[0][:1]]), bad[1], bad[2])
        spec = tuple(tf.TensorSpec([None, *np.shape(part)[1:]], tf.as_dtype(part.dtype))
                     for part in good)
        iterator = iter(tf.data.Dataset.from_generator(lambda: iter([good, bad]),
                                                       output_signature=spec))
        model = reference.make_model()
        trainer = towers.TowerTrainer(model, reference.make_loss(), keras.optimizers.Adam(),
                                      devices=DEVICES[:2], jit_compile=True)
        trainer.train_steps(iterator, 1)
        before = [v.numpy() for v in model.weights]
        with self.assertRaisesRegex(ValueError, r"^the step failed: the fields of the batch "
                                                r"disagree on batch size \(dim 0\); rows of x, y, "
                                                r"sample_weight: 5 4 4\.$") as caught:
            trainer.train_steps(iterator, 1)
        self.assertNotIn("XLA", str(caught.exception))
        self.assertIsInstance(caught.exception.__cause__, tf.errors.InvalidArgumentError)
        for want, got in zip(before, model.weights):
            self.assertAllEqual(want, got)
        self.assertEqual(trainer.step, 1)


if __name__ == "__main__":
    tf.test.main()
