"""The towers-train command line: learning, crash safety, TensorBoard, bad input."""

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from unittest import mock

import keras
import numpy as np
import tensorflow as tf
from absl import app, flags
from absl.testing import flagsaver, parameterized

from tests.checkpoint_files import checkpoint_values, position
from towers.cli import model_spec, train

if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICK = dict(model="mlp", num_towers=4, global_batch_size=64)
EXAMPLE_MODEL = "examples.my_model:small_cnn"
# Models of a user's own module, good and bad, for --model=towers_test_models:FUNCTION.
USER_MODULE = "towers_test_models"
USER_MODELS = textwrap.dedent("""
    import keras
    from keras import layers

    def small_cnn_tanh(input_shape, num_classes):
        # examples.my_model.small_cnn with tanh: the same variables, another model.
        images = keras.Input(input_shape)
        x = layers.Conv2D(16, 3, padding="same", activation="tanh")(images)
        x = layers.MaxPooling2D(2, padding="same")(x)
        x = layers.Conv2D(32, 3, padding="same", activation="tanh")(x)
        x = layers.GlobalAveragePooling2D()(x)
        return keras.Model(images, layers.Dense(num_classes)(x))

    class Subclassed(keras.Model):
        def __init__(self, num_classes):
            super().__init__()
            self.flatten = layers.Flatten()
            self.hidden = layers.Dense(16, activation="relu")
            self.logits = layers.Dense(num_classes)

        def call(self, images):
            return self.logits(self.hidden(self.flatten(images)))

    def subclassed(input_shape, num_classes):
        return Subclassed(num_classes)

    def not_a_model(input_shape, num_classes):
        return "a model"

    def too_wide(input_shape, num_classes):
        return keras.Sequential([keras.Input(input_shape), layers.Flatten(),
                                 layers.Dense(num_classes + 1)])

    def for_mnist(input_shape, num_classes):
        return keras.Sequential([keras.Input((28, 28, 1)), layers.Flatten(),
                                 layers.Dense(num_classes)])
""")


def _run_cli(*args, timeout=300):
    """Runs `python -m towers.train ARGS` in a fresh process; returns CompletedProcess."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    return subprocess.run([sys.executable, "-m", "towers.train", *args], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=timeout)


class LearningTest(tf.test.TestCase):

    def test_default_command_reaches_95_percent_on_digits(self):
        output = os.path.join(self.create_tempdir().full_path, "out.json")
        result = _run_cli(f"--output_json={output}")
        self.assertEqual(result.returncode, 0, result.stderr[-2000:])
        with open(output) as f:
            results = json.load(f)
        self.assertGreaterEqual(results["eval_accuracy"], 0.95)
        self.assertEqual((results["num_towers"], results["dataset"]), (4, "digits"))
        for key in ("eval_loss", "train_loss", "steps", "examples_per_sec"):
            self.assertGreater(results[key], 0)
        self.assertIn(f"test accuracy {results['eval_accuracy']:.4f}", result.stdout)


class CrashSafetyTest(tf.test.TestCase):

    def _sigkill_at_first_checkpoint_then_rerun(self, args, directory):
        """Runs `towers-train ARGS --checkpoint_dir=DIRECTORY`, SIGKILLs it as soon as its
        first checkpoint exists, and reruns the same command to the end.

        Returns the (epoch, batch) the rerun resumed from and the rerun's --output_json.
        """
        command = [sys.executable, "-m", "towers.train", *args, f"--checkpoint_dir={directory}"]
        process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while not os.path.exists(os.path.join(directory, "checkpoint")):
            self.assertIsNone(process.poll(), "the run ended before its first checkpoint")
            self.assertLess(time.monotonic(), deadline)
            time.sleep(0.02)
        process.send_signal(signal.SIGKILL)
        process.wait()
        killed_at = position(checkpoint_values(directory))

        output = os.path.join(directory, "out.json")
        resumed = _run_cli(*args, f"--checkpoint_dir={directory}", f"--output_json={output}")
        self.assertEqual(resumed.returncode, 0, resumed.stderr[-2000:])
        with open(output) as f:
            return killed_at, json.load(f)

    def _assert_same_weights(self, uninterrupted, interrupted, killed_at, first_checkpoint):
        """The two runs' final checkpoints hold identical tensors, and the interrupted one
        was killed at or after `first_checkpoint` (epoch, batch) but before the end."""
        expected, actual = checkpoint_values(uninterrupted), checkpoint_values(interrupted)
        self.assertBetween(killed_at, first_checkpoint, position(expected))
        self.assertNotEqual(killed_at, position(expected))
        self.assertEqual(sorted(expected), sorted(actual))
        for name in expected:
            self.assertAllEqual(expected[name], actual[name], msg=name)

    def test_sigkill_then_rerun_gives_the_uninterrupted_weights(self):
        # The killed run takes 5 steps per call, checkpointing between calls; the
        # uninterrupted one takes single steps: the weights must still be the same.
        args = ["--model=mlp", "--steps=300", "--checkpoint_every=20", "--deterministic",
                "--global_batch_size=32"]
        interrupted = self.create_tempdir().full_path
        killed_at, resumed = self._sigkill_at_first_checkpoint_then_rerun(
            [*args, "--steps_per_execution=5"], interrupted)
        self.assertEqual((resumed["steps"], resumed["steps_per_execution"]), (300, 5))

        uninterrupted = self.create_tempdir().full_path
        straight = _run_cli(*args, f"--checkpoint_dir={uninterrupted}")
        self.assertEqual(straight.returncode, 0, straight.stderr[-2000:])
        self._assert_same_weights(uninterrupted, interrupted, killed_at, first_checkpoint=(0, 20))

    def test_pipeline_of_2_towers_x_2_stages_learns_and_resumes_after_sigkill(self):
        # The 4 devices of 2 towers x 2 stages; 10 epochs of 23 steps on digits. The
        # thread flags must reach TensorFlow before its runtime starts, or the run fails.
        args = ["--num_towers=2", "--pipeline_stages=2", "--micro_batches=2",
                "--pipeline_schedule=1f1b", "--steps=230", "--checkpoint_every=20",
                "--deterministic", "--intra_op_threads=2", "--inter_op_threads=2"]
        uninterrupted = self.create_tempdir().full_path
        output = os.path.join(uninterrupted, "out.json")
        straight = _run_cli(*args, f"--checkpoint_dir={uninterrupted}", f"--output_json={output}")
        self.assertEqual(straight.returncode, 0, straight.stderr[-2000:])
        self.assertIn("on 2 towers x 2 pipeline stages", straight.stdout)
        self.assertIn("balanced by estimated compute", straight.stderr)
        with open(output) as f:
            results = json.load(f)
        self.assertGreaterEqual(results["eval_accuracy"], 0.95)
        self.assertEqual(
            {key: results[key] for key in ("num_towers", "pipeline_stages", "micro_batches",
                                           "pipeline_schedule", "steps", "model")},
            {"num_towers": 2, "pipeline_stages": 2, "micro_batches": 2,
             "pipeline_schedule": "1f1b", "steps": 230, "model": "cnn"})
        self.assertLen(results["pipeline_cuts"], 1)
        self.assertEqual([len(row) for row in results["devices"]], [2, 2])  # towers x stages
        self.assertLen(set(sum(results["devices"], [])), 4)

        interrupted = self.create_tempdir().full_path
        killed_at, resumed = self._sigkill_at_first_checkpoint_then_rerun(args, interrupted)
        self.assertEqual(resumed["steps"], 230)
        self._assert_same_weights(uninterrupted, interrupted, killed_at, first_checkpoint=(0, 20))


class InProcessTest(tf.test.TestCase, parameterized.TestCase):
    """Runs train.train() under flagsaver: one TensorFlow start for many runs."""

    def tearDown(self):
        keras.mixed_precision.set_global_policy("float32")
        super().tearDown()

    def test_accumulation_xla_execution_and_prefetch_flags_give_the_same_model(self):
        results = []
        # With one pipeline stage, --micro_batches is gradient accumulation too.
        for options in (dict(), dict(accum_steps=3), dict(micro_batches=3),
                        dict(jit_compile=True, steps_per_execution=3),
                        dict(prefetch_to_devices="on")):
            with flagsaver.flagsaver(**QUICK, steps=8, **options):
                results.append(train.train())
        for result in results[1:]:
            self.assertAllClose(results[0]["eval_loss"], result["eval_loss"], atol=1e-5)
        self.assertEqual((results[3]["jit_compile"], results[3]["steps_per_execution"],
                          results[3]["steps"]), (True, 3, 8))
        # auto: off on CPU towers.
        self.assertEqual([r["prefetch_to_devices"] for r in results], [False] * 4 + [True])

    def test_global_batch_statistics_flag_trains_the_one_device_model(self):
        """--batch_statistics=global on 2 uneven towers (16 and 15 rows): the resnet
        (BatchNorm in every block) ends where one tower (one device's statistics) does."""
        results = []
        for num_towers, statistics in ((1, "per_tower"), (2, "global")):
            with flagsaver.flagsaver(model="resnet", num_towers=num_towers, global_batch_size=31,
                                     steps=4, batch_statistics=statistics):
                results.append(train.train())
        self.assertAllClose(results[0]["eval_loss"], results[1]["eval_loss"], atol=1e-5)
        self.assertEqual(results[1]["batch_statistics"], "global")

    @parameterized.parameters("mixed_float16", "mixed_bfloat16")
    def test_mixed_precision_flag(self, policy):
        with flagsaver.flagsaver(**QUICK, steps=8, mixed_precision=policy, clip_global_norm=1.0):
            results = train.train()
        self.assertEqual(results["mixed_precision"], policy)
        self.assertTrue(np.isfinite(results["eval_loss"]))

    def test_resume_skips_half_written_and_unreadable_checkpoints(self):
        directory = self.create_tempdir().full_path
        with flagsaver.flagsaver(**QUICK, steps=30, checkpoint_every=10,
                                 checkpoint_dir=directory):
            train.train()
        # A save killed before it updated the index leaves files the index does not name.
        for suffix in ("index", "data-00000-of-00001"):
            with open(os.path.join(directory, f"ckpt-99.{suffix}"), "wb") as f:
                f.write(b"half written")
        newest = tf.train.latest_checkpoint(directory)
        with open(newest + ".data-00000-of-00001", "wb") as f:
            f.write(b"corrupted")  # and the newest complete one is damaged on disk
        with flagsaver.flagsaver(**QUICK, steps=40, checkpoint_every=10,
                                 checkpoint_dir=directory):
            with self.assertLogs("absl", "WARNING") as logs:
                results = train.train()
        self.assertEqual(results["steps"], 40)
        self.assertTrue(any("unreadable" in line for line in logs.output))

    def test_spread_checkpoint_resumes_in_main_placement(self):
        # 4 towers with spread placement hold the mlp's variables as slabs; its
        # checkpoints are whole, so a run in main placement resumes from them and the
        # same 20 steps in one main-placement run end on the same weights.
        directory = self.create_tempdir().full_path
        with flagsaver.flagsaver(**QUICK, steps=10, checkpoint_every=10,
                                 checkpoint_dir=directory, variable_placement="spread"):
            train.train()
        reader = tf.train.load_checkpoint(directory)
        kernel = "optimizer/_trainable_variables/0/.ATTRIBUTES/VARIABLE_VALUE"
        self.assertLen(reader.get_variable_to_shape_map()[kernel], 2)
        with flagsaver.flagsaver(**QUICK, steps=20, checkpoint_dir=directory):
            resumed = train.train()
        with flagsaver.flagsaver(**QUICK, steps=20):
            whole = train.train()
        self.assertEqual(resumed["steps"], 20)
        self.assertAllClose(resumed["eval_loss"], whole["eval_loss"], atol=1e-5, rtol=0)

    def test_checkpoint_of_another_model_is_refused_and_kept(self):
        directory = self.create_tempdir().full_path
        with flagsaver.flagsaver(**QUICK, steps=5, checkpoint_dir=directory):
            train.train()
        # Refused by the model the directory records, and, without that record (a
        # checkpoint written before it existed), by the checkpoint's variables.
        for remove_record in (False, True):
            if remove_record:
                os.remove(os.path.join(directory, model_spec.RECORD_FILE))
            before = {name: os.path.getmtime(os.path.join(directory, name))
                      for name in os.listdir(directory)}
            with flagsaver.flagsaver(**{**QUICK, "model": "cnn"}, steps=5,
                                     checkpoint_dir=directory):
                with self.assertRaisesRegex(ValueError, "does not match this model"):
                    train.train()
            after = {name: os.path.getmtime(os.path.join(directory, name))
                     for name in os.listdir(directory)}
            self.assertEqual(before, after)

    def test_unwritable_checkpoint_dir_fails_before_training(self):
        not_a_directory = self.create_tempfile().full_path
        with flagsaver.flagsaver(**QUICK, steps=5,
                                 checkpoint_dir=os.path.join(not_a_directory, "ckpt")):
            with self.assertRaisesRegex(ValueError, "cannot write checkpoints"):
                train.train()

    def test_global_batch_smaller_than_towers_works_with_a_warning(self):
        with flagsaver.flagsaver(**{**QUICK, "global_batch_size": 3}, steps=4):
            with self.assertLogs("absl", "WARNING") as logs:
                results = train.train()
        self.assertEqual(results["steps"], 4)
        self.assertTrue(any("smaller than the 4 towers" in line for line in logs.output))

    def test_npz_data_and_output_json(self):
        rng = np.random.default_rng(0)
        path = os.path.join(self.create_tempdir().full_path, "mine.npz")
        x = rng.integers(0, 256, size=(40, 6, 6), dtype=np.uint8)
        np.savez(path, x_train=x[:30], y_train=(x[:30, 0, 0] > 127).astype(np.int64),
                 x_test=x[30:], y_test=(x[30:, 0, 0] > 127).astype(np.int64))
        output = os.path.join(self.create_tempdir().full_path, "out.json")
        with flagsaver.flagsaver(**QUICK, data_npz=path, epochs=2, output_json=output):
            train.train()
        with open(output) as f:
            results = json.load(f)
        self.assertEqual((results["dataset"], results["steps"]), ("npz", 2))
        self.assertBetween(results["eval_accuracy"], 0.0, 1.0)
        self.assertEqual(
            {key: results[key] for key in ("pipeline_stages", "micro_batches",
                                           "pipeline_schedule", "pipeline_cuts")},
            {"pipeline_stages": 1, "micro_batches": 1, "pipeline_schedule": "gpipe",
             "pipeline_cuts": []})
        self.assertLen(results["devices"], 4)  # flat: one device per tower

    def test_npz_without_test_split_evaluates_on_a_held_out_tenth(self):
        rng = np.random.default_rng(0)
        path = os.path.join(self.create_tempdir().full_path, "mine.npz")
        x = rng.integers(0, 256, size=(40, 6, 6), dtype=np.uint8)
        np.savez(path, x_train=x, y_train=np.arange(40) % 4)
        with flagsaver.flagsaver(**QUICK, data_npz=path, steps=1):
            with self.assertLogs("absl", "INFO") as logs:
                results = train.train()
        self.assertTrue(any("holding out 4 of the 40 training examples" in line
                            for line in logs.output))
        self.assertEqual(results["steps"], 1)
        self.assertBetween(results["eval_accuracy"], 0.0, 1.0)

    @parameterized.named_parameters(
        ("replicated_variables", dict(variable_placement="replicated"),
         "--pipeline_stages=2 cannot be combined with --variable_placement=replicated"))
    def test_pipeline_refuses_before_any_work(self, flag_values, message):
        with flagsaver.flagsaver(**QUICK, steps=1, pipeline_stages=2, **flag_values):
            with self.assertRaisesRegex(ValueError, message):
                train.train()

    def test_thread_flags_after_the_runtime_started_are_refused(self):
        # conftest.py started this process's runtime; a fresh towers-train has not.
        with flagsaver.flagsaver(**QUICK, steps=1, intra_op_threads=1):
            with self.assertRaisesRegex(ValueError, "--intra_op_threads=1 comes too late"):
                train.train()

    def test_tensorboard_scalars(self):
        log_dir = self.create_tempdir().full_path
        with flagsaver.flagsaver(**QUICK, steps=23, log_dir=log_dir):
            train.train()
        tags = set()
        for name in os.listdir(log_dir):
            for record in tf.data.TFRecordDataset(os.path.join(log_dir, name)):
                event = tf.compat.v1.Event.FromString(record.numpy())
                tags.update(value.tag for value in event.summary.value)
        self.assertContainsSubset(
            {"train/loss", "train/accuracy", "train/learning_rate", "train/examples_per_sec",
             "eval/loss", "eval/accuracy"}, tags)


class OwnModelTest(tf.test.TestCase, parameterized.TestCase):
    """--model=PACKAGE.MODULE:FUNCTION and --model=PATH.keras, in-process."""

    def setUp(self):
        super().setUp()
        self.directory = self.create_tempdir().full_path
        with open(os.path.join(self.directory, f"{USER_MODULE}.py"), "w") as f:
            f.write(USER_MODELS)
        with open(os.path.join(self.directory, "towers_test_broken.py"), "w") as f:
            f.write("import towers_test_no_such_package\n")
        with open(os.path.join(self.directory, "not_a_model.keras"), "w") as f:
            f.write("weights, honest")
        self.tiny_keras = os.path.join(self.directory, "tiny.keras")
        keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(),
                          keras.layers.Dense(10)]).save(self.tiny_keras)
        lambda_model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(),
                                         keras.layers.Lambda(lambda x: 2 * x),
                                         keras.layers.Dense(10)])
        lambda_model.save(os.path.join(self.directory, "lambda.keras"))
        self.enter_context(mock.patch.object(sys, "path", [self.directory] + sys.path))
        for name in (USER_MODULE, "towers_test_broken"):
            self.addCleanup(sys.modules.pop, name, None)

    def _main_stderr(self, **flag_values):
        """Runs towers-train's main() with these flags; returns (exit status, stderr)."""
        stderr = io.StringIO()
        with flagsaver.flagsaver(**{**QUICK, "steps": 1, **flag_values}):
            with contextlib.redirect_stderr(stderr):
                status = train.main(["towers-train"])
        return status, stderr.getvalue()

    def test_function_keras_file_and_subclassed_model_train(self):
        output = os.path.join(self.directory, "out.json")
        for spec, name in ((EXAMPLE_MODEL, "small_cnn"), (self.tiny_keras, "sequential"),
                           (f"{USER_MODULE}:subclassed", "subclassed")):
            with flagsaver.flagsaver(**{**QUICK, "model": spec}, steps=2, output_json=output):
                with self.assertLogs("absl", "INFO") as logs:
                    train.train()
            with open(output) as f:
                results = json.load(f)
            self.assertEqual((results["model"], results["steps"]), (spec, 2))
            self.assertTrue(np.isfinite(results["eval_loss"]))
            self.assertTrue(any(f"from {spec}: " in line and f"model '{name}" in line
                                for line in logs.output), logs.output)

    def test_own_model_is_cut_into_pipeline_stages_and_compiled_by_xla(self):
        with flagsaver.flagsaver(**{**QUICK, "model": EXAMPLE_MODEL, "num_towers": 2},
                                 steps=2, pipeline_stages=2, micro_batches=2, jit_compile=True):
            results = train.train()
        self.assertLen(results["pipeline_cuts"], 1)
        self.assertEqual((results["steps"], results["jit_compile"]), (2, True))
        self.assertTrue(np.isfinite(results["eval_loss"]))

    @parameterized.named_parameters(
        ("none_of_the_forms", dict(model="vgg"),
         r"'vgg' is none of the three forms: a built-in model \(mlp\|cnn\|resnet\|text\), "
         "PACKAGE.MODULE:FUNCTION"),
        ("module_that_does_not_import", dict(model="towers_test_broken:model"),
         "cannot import module 'towers_test_broken': ModuleNotFoundError: No module named "
         "'towers_test_no_such_package'"),
        ("no_such_function", dict(model=f"{USER_MODULE}:missing"),
         f"module '{USER_MODULE}' (.*) has no function 'missing'; it defines "
         "Subclassed, for_mnist, not_a_model, small_cnn_tanh, subclassed, too_wide"),
        ("not_a_keras_model", dict(model=f"{USER_MODULE}:not_a_model"),
         r"not_a_model\(input_shape=\(8, 8, 1\), num_classes=10\) returned builtins.str, "
         "not a keras.Model"),
        ("output_width", dict(model=f"{USER_MODULE}:too_wide"),
         r"outputs shape \(None, 11\); it must output logits of shape \(None, 10\)"),
        ("input_shape", dict(model=f"{USER_MODULE}:for_mnist"),
         r"takes inputs of shape \(None, 28, 28, 1\) but the data's examples come in "
         r"batches of shape \(None, 8, 8, 1\)"),
        ("missing_file", dict(model="/no/such/model.keras"),
         "model file '/no/such/model.keras' does not exist"),
        ("file_that_is_not_keras", dict(model="{directory}/not_a_model.keras"),
         "not_a_model.keras' is not a Keras .keras archive"),
        ("file_with_a_lambda", dict(model="{directory}/lambda.keras"),  # safe_mode stays on
         "lambda.keras' does not load: ValueError: Requested the deserialization of a "
         "`Lambda` layer"),
        ("subclassed_model_in_stages", dict(model=f"{USER_MODULE}:subclassed",
                                            pipeline_stages=2, num_towers=2),
         "--pipeline_stages=2 cannot cut this model: model .* is a subclassed keras.Model"),
    )
    def test_bad_model_exits_with_one_line(self, flag_values, message):
        flag_values["model"] = flag_values["model"].format(directory=self.directory)
        status, stderr = self._main_stderr(**flag_values)
        self.assertEqual(status, 1)
        self.assertLen(stderr.splitlines(), 1, stderr)
        self.assertRegex(stderr, "^towers-train: error: --(model|pipeline_stages)")
        self.assertRegex(stderr, message)

    def test_checkpoint_of_another_own_model_is_refused_and_kept(self):
        directory = os.path.join(self.directory, "run")
        with flagsaver.flagsaver(**{**QUICK, "model": EXAMPLE_MODEL}, steps=2,
                                 checkpoint_dir=directory):
            train.train()
        before = {name: os.path.getmtime(os.path.join(directory, name))
                  for name in os.listdir(directory)}
        # The same variables in another model: restoring alone would take it.
        other = f"{USER_MODULE}:small_cnn_tanh"
        with flagsaver.flagsaver(**{**QUICK, "model": other}, steps=3, checkpoint_dir=directory):
            with self.assertRaisesRegex(ValueError, f"does not match this model: it holds model "
                                                    f"'{EXAMPLE_MODEL}', not '{other}'"):
                train.train()
        after = {name: os.path.getmtime(os.path.join(directory, name))
                 for name in os.listdir(directory)}
        self.assertEqual(before, after)
        with flagsaver.flagsaver(**{**QUICK, "model": EXAMPLE_MODEL}, steps=3,
                                 checkpoint_dir=directory):
            self.assertEqual(train.train()["steps"], 3)  # the same model resumes


def _main_in_process(*args):
    """`towers-train ARGS` in this process: its flags parsed as app.run parses them, then
    main; returns (exit status, stderr). absl lets a process call app.run only once.
    The flags are restored after."""
    stderr = io.StringIO()
    with flagsaver.flagsaver(), contextlib.redirect_stderr(stderr):
        try:
            status = train.main(app.parse_flags_with_usage(["towers-train", *args]))
        except SystemExit as exited:  # a flag value absl refuses
            status = exited.code
    return status, stderr.getvalue()


BAD_FLAGS = (
    ("unknown_dataset", "--dataset=imagenet", "--dataset", "digits|synthetic"),
    ("unknown_model", "--model=vgg", "--model", "mlp|cnn|resnet|text"),
    ("zero_towers", "--num_towers=0", "--num_towers", "not an integer in the range [1, 256]"),
    ("missing_npz", "--data_npz=/no/such/file.npz", "towers-train: error", "/no/such/file.npz"),
    ("zero_pipeline_stages", "--pipeline_stages=0", "--pipeline_stages", "positive integer"),
    ("zero_micro_batches", "--micro_batches=0", "--micro_batches", "positive integer"),
    ("unknown_schedule", "--pipeline_schedule=bogus", "--pipeline_schedule", "gpipe|1f1b"),
    ("accum_steps_and_micro_batches", "--accum_steps=2 --micro_batches=2", "--micro_batches",
     "set only one"),
)
# Its 5 devices are made first thing in a fresh process: too late in this one.
TOO_MANY_STAGES = ("more_stages_than_layers", "--model=mlp --num_towers=1 --pipeline_stages=5",
                   "--pipeline_stages", "from 1 to 4")


class BadFlagsTest(tf.test.TestCase, parameterized.TestCase):

    def assert_one_line(self, status, stderr, name, allowed):
        self.assertNotEqual(status, 0)
        message = [line for line in stderr.splitlines() if name in line]
        self.assertLen(message, 1, stderr[-2000:])
        self.assertIn(allowed, message[0])
        self.assertNotIn("Traceback", stderr)

    @parameterized.named_parameters(*BAD_FLAGS)
    def test_bad_flag_exits_with_one_line_naming_it(self, flags_given, name, allowed):
        self.assert_one_line(*_main_in_process(*flags_given.split(), "--steps=1"), name,
                             allowed)

    # The real program, in a fresh process: a value absl refuses, and two main refuses.
    @parameterized.named_parameters(TOO_MANY_STAGES, *(bad for bad in BAD_FLAGS
                                                       if bad[0] in ("zero_towers",
                                                                     "missing_npz")))
    def test_the_program_exits_with_that_line(self, flags_given, name, allowed):
        result = _run_cli(*flags_given.split(), "--steps=1")
        self.assert_one_line(result.returncode, result.stderr, name, allowed)


if __name__ == "__main__":
    tf.test.main()
