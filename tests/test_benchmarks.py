"""The benchmark harness (benchmarks/): a tiny run of every mode, its outputs, its flags."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from unittest import mock

import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

from benchmarks.harness import compare, first_step, mode as mode_lib, model_setup, modes, phases
from towers.cli import models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICES = ["/device:CPU:0", "/device:CPU:1"]
DEVICES_4 = [f"/device:CPU:{i}" for i in range(4)]  # tests/conftest.py makes 4
RUN_MODES = ["plain", "plain_xla", "keras_fit", "keras_fit_xla", "keras_fit_xla_spe10", "bare",
             "bare_loop", "bare_xla", "towers", "towers_packed", "towers_xla", "towers_spe10",
             "towers_staged", "towers_spe10_staged", "towers_fit", "towers_fit_spe10",
             "independent", "mirrored_custom", "mirrored_fit"]


class RunBenchmarkTest(tf.test.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.output_dir = tempfile.mkdtemp(prefix="test_benchmarks_")  # private: runs may overlap
        cls.results = compare.run_benchmark(
            ["mlp"], [1, 2], global_batch_size=8, steps=2, warmup_steps=1, rounds=2,
            devices=DEVICES, modes=RUN_MODES, input_shape=(8, 8, 1), output_dir=cls.output_dir,
            trace_steps=1)
        cls.model = cls.results["models"]["mlp"]
        cls.rows = {(r["mode"], r["num_towers"]): r for r in cls.model["rows"]}

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.output_dir, ignore_errors=True)
        super().tearDownClass()

    def test_writes_json_markdown_and_plot(self):
        with open(os.path.join(self.output_dir, "results.json")) as f:
            self.assertEqual(json.load(f)["config"]["global_batch_size"], 8)
        with open(os.path.join(self.output_dir, "results.md")) as f:
            self.assertIn("| mirrored_custom | 2 |", f.read())
        has_matplotlib = importlib.util.find_spec("matplotlib") is not None
        self.assertEqual(os.path.exists(os.path.join(self.output_dir, "results.png")),
                         has_matplotlib)

    def test_every_mode_ran_or_says_why_not(self):
        self.assertEqual([r for r in self.model["not_run"] if r["status"] == "failed"], [])
        not_run = {(r["mode"], r["num_towers"]) for r in self.model["not_run"]}
        for mode in RUN_MODES:
            for n in ([1] if mode in modes.SINGLE_DEVICE_MODES else [1, 2]):
                self.assertIn((mode, n), set(self.rows) | not_run)
        self.assertNotIn(("plain", 2), self.rows)  # single-device modes run once

    def test_times_are_real_and_plain_is_the_baseline(self):
        for row in self.rows.values():
            self.assertGreater(row["median_ms"], 0.0, row["mode"])
            self.assertGreater(row["examples_per_sec"], 0.0, row["mode"])
            self.assertEqual(row["n"], 2)
        self.assertEqual(self.rows["plain", 1]["speedup"], 1.0)
        self.assertEqual(self.rows["mirrored_custom", 2]["vs_mirrored_custom"], 1.0)
        self.assertGreater(self.model["flops_per_step"], 0)

    def test_weights_match_plain_except_independent(self):
        # The XLA modes too, and fit and towers with steps_per_execution=10 ran exactly the
        # steps asked (4 here: 10 more would move the weights far more than this).
        for key in [("towers", 1), ("towers", 2), ("mirrored_custom", 1),
                    ("mirrored_custom", 2), ("keras_fit", 1), ("mirrored_fit", 2),
                    ("plain_xla", 1), ("keras_fit_xla", 1), ("keras_fit_xla_spe10", 1),
                    ("towers_xla", 1), ("towers_xla", 2), ("towers_spe10", 1),
                    ("towers_spe10", 2), ("towers_staged", 2), ("towers_spe10_staged", 2),
                    ("bare", 1), ("bare", 2), ("bare_loop", 1), ("bare_loop", 2),
                    ("bare_xla", 2), ("towers_fit", 1), ("towers_fit", 2),
                    ("towers_fit_spe10", 1), ("towers_fit_spe10", 2)]:
            self.assertLess(self.rows[key]["max_abs_weight_diff"], 1e-4, key)
        # Tower 0 of independent trained on half the batch only.
        self.assertGreater(self.rows["independent", 2]["max_abs_weight_diff"], 0.0)

    def test_xla_and_steps_per_execution_rows_say_their_options(self):
        self.assertEqual(self.rows["plain_xla", 1]["options"], {"jit_compile": True})
        self.assertEqual(self.rows["towers_xla", 2]["options"], {"jit_compile": True})
        self.assertEqual(self.rows["keras_fit_xla_spe10", 1]["options"],
                         {"jit_compile": True, "steps_per_execution": 10})
        self.assertEqual(self.rows["towers_spe10", 2]["options"],
                         {"steps_per_execution": 10, "input": "tf.data"})
        self.assertEqual(self.rows["bare_loop", 2]["options"], {"steps_per_execution": 10})
        self.assertEqual(self.rows["bare_xla", 2]["options"], {"jit_compile": True})
        self.assertEqual(self.rows["towers_fit_spe10", 2]["options"],
                         {"steps_per_execution": 10, "input": "fit"})
        with open(os.path.join(self.output_dir, "results.md")) as f:
            self.assertIn("| towers_xla | 2 |", f.read())

    def test_phase_breakdown_and_chrome_trace(self):
        table = self.model["phases"]["2"]
        names = {p["phase"] for p in table["phases"]}
        self.assertContainsSubset({"tower 0 forward", "tower 1 backward"}, names)
        self.assertGreater(table["step_ms"], 0.0)
        with open(table["chrome_trace"]) as f:
            self.assertNotEmpty(json.load(f)["traceEvents"])


class PiecesTest(tf.test.TestCase, parameterized.TestCase):

    def test_unknown_trainer_option_is_unsupported(self):
        setup = mode_lib.Setup(make_model=lambda: models.build_model("mlp", (2, 2, 1), 2, seed=0),
                            x=np.zeros((4, 2, 2, 1), np.float32), y=np.zeros(4, np.int32))
        with mock.patch.dict(modes.TOWER_CONFIGS, {"towers_new": {"no_such_option": True}}):
            with self.assertRaisesRegex(mode_lib.Unsupported, "no_such_option"):
                modes.build("towers_new", setup, DEVICES)

    @parameterized.named_parameters(
        # The trainer's first call runs one step, then one call of 10, then the last one.
        ("towers_spe10", "towers_spe10", 3),
        ("bare_loop", "bare_loop", 2),  # 10, then 2
        ("towers_fit_spe10", "towers_fit_spe10", 3),  # as towers_spe10, through fit's loop
    )
    def test_steps_per_execution_mode_runs_calls_of_k_steps_and_matches_plain(self, mode, calls):
        setup = mode_lib.Setup(make_model=lambda: models.build_model("mlp", (2, 2, 1), 2, seed=0),
                            x=np.linspace(0, 1, 16, dtype=np.float32).reshape(4, 2, 2, 1),
                            y=np.array([0, 1, 1, 0], np.int32))
        # One tower: the loop is the same on more (the run above has these modes on two).
        plain, spe = (modes.build(name, setup, DEVICES[:1]) for name in ("plain", mode))
        plain.run(12)
        self.assertLen(spe.run(12), calls)  # one sample per call
        for a, b in zip(spe.weights(), plain.weights()):
            self.assertAllClose(a, b, atol=1e-5)

    @parameterized.parameters(
        ("split:SplitV", "split"),
        ("tower_1/Identity_4/ReadVariableOp:ReadVariableOp", "tower 1 broadcast"),
        ("tower_0/dense/Relu:_FusedMatMul", "tower 0 forward"),
        ("gradient_tape/tower_1/dense/MatMul/MatMul:MatMul", "tower 1 backward"),
        ("gradient_tape/tower_1/dense/BiasAdd/BiasAddGrad/_21:_Send", "gather"),
        ("multiply_no_nan_3:MulNoNan", "reduce"),
        ("cond/then/_0/cond/sgd/Mul:Mul", "apply"),
        ("gather/Identity_3:Identity", "gather"),
        ("Sum_2:Sum", "other"),
    )
    def test_ops_are_sorted_into_phases(self, op_name, phase):
        self.assertEqual(phases.classify(op_name), phase)

    def test_bad_models_value_exits_with_one_line_naming_the_flag(self):
        # One case only: each costs a fresh process that imports TensorFlow. A function the
        # module lacks is found only once TensorFlow runs, the later of the two checks.
        result = subprocess.run(
            [sys.executable, os.path.join(ROOT, "benchmarks", "compare_strategies.py"),
             "--models=mlp,examples.my_model:no_such_function"], capture_output=True, text=True,
            cwd=ROOT, timeout=120, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
        self.assertNotEqual(result.returncode, 0)
        message = [line for line in result.stderr.splitlines() if "--models" in line]
        self.assertLen(message, 1, result.stderr[-2000:])
        self.assertIn("no function 'no_such_function'; it defines small_cnn", message[0])
        self.assertNotIn("Traceback", result.stderr)

    def test_a_model_of_none_of_the_forms_stops_the_run_before_anything_is_timed(self):
        with self.assertRaisesRegex(model_setup.ModelError, "'vgg' is none of the three forms"):
            compare.run_benchmark(["mlp", "vgg"], [1], global_batch_size=4, steps=1, rounds=1,
                                  devices=DEVICES, modes=["plain"], trace_steps=0)


def save_token_model(path):
    """A saved model of int32 token ids (6 per example, a vocabulary of 20) -> 3 logits."""
    tokens = keras.Input((6,), dtype="int32")
    features = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(20, 4)(tokens))
    keras.Model(tokens, keras.layers.Dense(3)(features), name="tokens").save(path)


class UserModelBenchmarkTest(tf.test.TestCase):
    """--models with a user's FUNCTION and a user's .keras file: one tiny run of both."""

    FUNCTION = "examples.my_model:small_cnn"

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.output_dir = tempfile.mkdtemp(prefix="test_user_models_")
        cls.saved = os.path.join(cls.output_dir, "tokens.keras")
        save_token_model(cls.saved)
        cls.results = compare.run_benchmark(
            [cls.FUNCTION, cls.saved], [2], global_batch_size=8, steps=1, warmup_steps=1,
            rounds=1, devices=DEVICES, modes=["plain", "bare", "towers"], input_shape=(8, 8, 1),
            num_classes=5, output_dir=cls.output_dir, trace_steps=0)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.output_dir, ignore_errors=True)
        super().tearDownClass()

    def test_results_name_each_model_as_written(self):
        self.assertEqual(list(self.results["models"]), [self.FUNCTION, self.saved])
        with open(os.path.join(self.output_dir, "results.md")) as f:
            markdown = f.read()
        for name in (self.FUNCTION, self.saved):
            section = markdown.split(f"## {name}\n")[1]
            self.assertIn("| towers | 2 |", section.split("\n## ")[0])
        has_matplotlib = importlib.util.find_spec("matplotlib") is not None
        self.assertEqual(os.path.exists(os.path.join(self.output_dir, "results.png")),
                         has_matplotlib)  # titled "tokens.keras": the path's file name

    def test_every_mode_starts_from_the_same_weights_and_matches_plain(self):
        for name, model in self.results["models"].items():
            self.assertEqual(model["not_run"], [], name)
            rows = {r["mode"]: r for r in model["rows"]}
            self.assertCountEqual(rows, ["plain", "bare", "towers"])
            for mode in ("bare", "towers"):
                self.assertGreater(rows[mode]["median_ms"], 0.0)
                self.assertLess(rows[mode]["max_abs_weight_diff"], 1e-4, (name, mode))

    def test_a_function_gets_the_flags_shapes_a_file_its_own(self):
        models_run = self.results["models"]
        self.assertEqual(models_run[self.FUNCTION]["input"],
                         {"input_shape": [8, 8, 1], "input_dtype": "float32", "num_classes": 5,
                          "x_range": [0, 1], "x_values": "uniform in [0, 1)"})
        self.assertGreater(models_run[self.FUNCTION]["flops_per_step"], 0)
        described = models_run[self.saved]["input"]
        self.assertEqual((described["input_shape"], described["input_dtype"],
                          described["num_classes"], described["x_range"]), ([6], "int32", 3, [0, 20]))

    def test_token_ids_lie_in_the_embeddings_range_and_labels_in_the_classes(self):
        setup, _ = model_setup.setup_for(self.saved, 256, (8, 8, 1), 5, seed=0)
        self.assertEqual((setup.x.shape, setup.x.dtype), ((256, 6), np.int32))
        self.assertEqual((setup.x.min(), setup.x.max()), (0, 19))  # 256 x 6 draws hit both ends
        self.assertEqual((setup.y.min(), setup.y.max()), (0, 2))


class PipelineBenchmarkTest(tf.test.TestCase):
    """benchmarks/pipeline.py run as its users run it, on tiny sizes (about 20 s, and
    about 35 s more for the tied table's GPT-2, most of it tfdbg recording its step)."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.output_dir = tempfile.mkdtemp(prefix="test_pipeline_benchmark_")
        cls.input_shape = (8, 8, 1)
        result = subprocess.run(
            [sys.executable, os.path.join(ROOT, "benchmarks", "pipeline.py"), "--model=cnn",
             "--stages=1,2", "--micro_batches=1,2", "--timeline=2,2", "--steps=2", "--rounds=1",
             "--warmup_steps=0", "--trace_steps=2", "--global_batch_size=8",
             "--input_shape=" + ",".join(map(str, cls.input_shape)),
             "--tied_layers=2", "--tied_vocab=40", "--tied_heads=2", "--tied_width=8",
             "--tied_length=4", "--tied_batch_size=4", "--tied_micro_batches=2",
             f"--output_dir={cls.output_dir}"],
            capture_output=True, text=True, cwd=ROOT, timeout=240,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
        assert result.returncode == 0, result.stderr[-3000:]
        with open(os.path.join(cls.output_dir, "results.json")) as f:
            cls.results = json.load(f)
        cls.rows = {(r["num_stages"], r["micro_batches"], r["schedule"]): r
                    for r in cls.results["rows"]}

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.output_dir, ignore_errors=True)
        super().tearDownClass()

    def test_writes_json_markdown_and_timeline(self):
        with open(os.path.join(self.output_dir, "results.md")) as f:
            self.assertIn("| 2 | 2 | 1f1b |", f.read())
        has_matplotlib = importlib.util.find_spec("matplotlib") is not None
        self.assertEqual(os.path.exists(os.path.join(self.output_dir, "timeline.png")),
                         has_matplotlib)

    def test_every_configuration_and_the_drawn_one_under_both_schedules(self):
        self.assertCountEqual(self.rows, [(k, m, "gpipe") for k in (1, 2) for m in (1, 2)]
                              + [(2, 2, "1f1b")])
        for row in self.rows.values():
            self.assertGreater(row["median_ms"], 0.0)
            self.assertEqual(row["n"], 2)
            self.assertLen(row["devices"], 1)  # one tower
            self.assertLen(row["devices"][0], row["num_stages"])

    def test_bubble_is_a_share_next_to_the_formula(self):
        for (k, m, _), row in self.rows.items():
            self.assertAlmostEqual(row["bubble_formula"], (k - 1) / (m + k - 1))
            self.assertCountEqual(row["idle_share_per_device"], row["devices"][0])
            for idle in [row["bubble_measured"], *row["idle_share_per_device"].values()]:
                self.assertBetween(idle, 0.0, 1.0)
            self.assertEqual(row["unattributed_op_share"], 0.0)  # every op has its device

    def test_bytes_per_device_add_up_to_the_model_and_optimizer(self):
        model = models.build_model("cnn", self.input_shape, 10, seed=0)
        weight_bytes = 4 * model.count_params()  # float32
        for row in self.rows.values():
            self.assertEqual(row["model_bytes"], weight_bytes)
            self.assertEqual(sum(row["bytes_per_device"].values()), row["total_bytes"])
            # SGD with momentum: one slot per weight, plus its step count and learning rate.
            self.assertBetween(row["optimizer_bytes"], weight_bytes, weight_bytes + 64)
            self.assertAlmostEqual(row["ideal_bytes_per_stage"],
                                   row["total_bytes"] / row["num_stages"])
        stage_bytes = self.rows[2, 2, "gpipe"]["bytes_per_device"]
        self.assertTrue(all(stage_bytes.values()), stage_bytes)  # both stages hold weights

    def test_tied_table_moves_once_per_micro_batch_and_its_gradient_once(self):
        # One measured configuration: tfdbg's record of a keras_hub step takes most of
        # the seconds this adds.
        rows = self.results["tied_table"]["rows"]
        self.assertEqual([(r["stages"], r["micro_batches"]) for r in rows], [(1, 1), (2, 2)])
        self.assertEqual(rows[0]["x_one_device"], 1.0)
        for row in rows[1:]:
            # The table (40 x 8 floats) out to stage 1 per micro-batch, its gradient back.
            self.assertEqual(row["moved_table"], (row["micro_batches"] + 1) * 40 * 8 * 4)
            self.assertEqual(row["moved"], row["formula"])
            self.assertGreater(row["median_ms"], 0.0)
        with open(os.path.join(self.output_dir, "results.md")) as f:
            self.assertIn("## A layer called in two stages", f.read())

    def test_timeline_boxes_one_per_micro_batch_forward_and_backward(self):
        for schedule in ("gpipe", "1f1b"):
            boxes = self.rows[2, 2, schedule]["boxes"]
            self.assertCountEqual([(b["stage"], b["kind"], b["micro_batch"]) for b in boxes],
                                  [(k, kind, m) for k in (0, 1) for kind in "FB" for m in (0, 1)])
            for box in boxes:
                self.assertLessEqual(0.0, box["start"])
                self.assertLessEqual(box["start"], box["end"])


if __name__ == "__main__":
    tf.test.main()


class FirstStepBenchmarkTest(tf.test.TestCase):
    """benchmarks/first_step.py run as its users run it, on tiny sizes: three fresh
    processes (Keras on one device, towers on 1 and 2), one round; no speed asserted."""

    def test_every_configuration_reports_its_stamps_in_order_and_the_ratios(self):
        output_dir = tempfile.mkdtemp(prefix="test_first_step_")
        self.addCleanup(shutil.rmtree, output_dir, ignore_errors=True)
        result = subprocess.run(
            [sys.executable, os.path.join(ROOT, "benchmarks", "first_step.py"), "--models=mlp",
             "--num_towers=1,2", "--mirrored_towers=", "--steps=2", "--batch_size=4",
             "--rounds=1", f"--output_dir={output_dir}"],
            capture_output=True, text=True, cwd=ROOT, timeout=240,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        with open(os.path.join(output_dir, "results.json")) as f:
            results = json.load(f)
        self.assertCountEqual(results["medians"], ["mlp/keras/1", "mlp/towers/1", "mlp/towers/2"])
        self.assertEqual(results["config"]["micro_batches"], first_step.MICRO_BATCHES)
        for row in results["medians"].values():
            stamps = [row[name] for name in first_step.STAMPS]
            self.assertEqual(stamps, sorted(stamps))  # imported, ..., first epoch: in turn
            self.assertGreater(row["second_fit"], 0.0)
        ratios = results["ratios"]["mlp"]
        medians = results["medians"]
        self.assertAlmostEqual(ratios["towers_2_over_keras"], medians["mlp/towers/2"][
            "first_step"] / medians["mlp/keras/1"]["first_step"])
        with open(os.path.join(output_dir, "results.md")) as f:
            self.assertIn("| mlp | towers | 2 | 2 |", f.read())
        has_matplotlib = importlib.util.find_spec("matplotlib") is not None
        self.assertEqual(os.path.exists(os.path.join(output_dir, "first_step.png")),
                         has_matplotlib)

    def test_each_model_s_towers_take_their_stages_and_parts_in_device_order(self):
        """Tower i's device for stage k's part j: devices[(i * stages + k) * parts + j]."""
        self.assertEqual([first_step.devices_needed({"model": name, "way": "towers",
                                                     "num_towers": 4})
                          for name in first_step.MODELS], [4, 4, 4, 8, 8, 16])
        for name, tower_0 in [("split_transformer", [DEVICES_4[:2]]),
                              ("pipeline", [[DEVICES_4[0]], [DEVICES_4[1]]]),
                              ("split_pipeline", [DEVICES_4[:2], DEVICES_4[2:]])]:
            trainer = first_step._trainer(
                {"model": name, "num_towers": 1}, first_step.transformer(blocks=2),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                keras.optimizers.SGD(0.1), DEVICES_4)
            mesh = trainer.setup.mesh
            parts = [[[device] for device in tower] for tower in mesh.grid]
            self.assertEqual((mesh.parts or parts)[0], tower_0, name)
        for given, micro_batches in [({}, first_step.MICRO_BATCHES), ({"micro_batches": 3}, 3)]:
            trainer = first_step._trainer(
                {"model": "pipeline", "num_towers": 1, **given}, first_step.transformer(blocks=2),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                keras.optimizers.SGD(0.1), DEVICES_4)
            self.assertEqual(trainer.options.micro_batches, micro_batches)  # --micro_batches


class OpParallelHubAndVocabLossTest(tf.test.TestCase):
    """benchmarks/op_parallel.py's keras_hub GPT-2 and LM-head loss parts (its harness),
    in-process on tiny sizes, against counts by hand."""

    def test_gpt2_holds_and_moves_what_its_plan_splits(self):
        from benchmarks.harness import op_parallel
        sizes = {"vocab": 40, "layers": 1, "heads": 2, "width": 8, "intermediate": 12,
                 "length": 4}
        results = op_parallel.run_hub_benchmark([2], DEVICES, **sizes, global_batch_size=2,
                                                steps=1, rounds=1)
        parted = results["rows"][0]["bytes_per_device"]
        weight_bytes = 4 * op_parallel.gpt2(**sizes).count_params()  # the unsplit model's
        self.assertEqual(sum(v for v, _ in parted.values()), weight_bytes)
        # Part 1: half the tied table (20 x 8); one of the 2 heads of 4: its query, key and
        # value kernels (8 x 1 x 4) and biases (1 x 4), its slice of the output kernel
        # (1 x 4 x 8), no output bias; half the feed-forward pair, the column's kernel
        # (8 x 6) and bias (6) and the row's kernel (6 x 8); Adam's two slots beside each.
        part_1 = 4 * (20 * 8 + 3 * (8 * 4 + 4) + 4 * 8 + 8 * 6 + 6 + 6 * 8)
        self.assertEqual(parted[DEVICES[1]], [part_1, 2 * part_1])
        # Bytes moved, measured as TensorFlow sent them, next to the formula: no logits
        # (8 tokens x 20 rows) gathered, the column -> row pair paired.
        row = results["rows"][0]
        self.assertEqual(row["gathered_columns"], 0)
        self.assertAllClose(row["moved"], row["formula"], rtol=0.05)

    def test_grouped_query_attention_moves_what_the_formula_says_both_ways(self):
        from benchmarks.harness import grouped_heads
        results = grouped_heads.run_grouped_heads_benchmark(
            [2], DEVICES, vocab=40, layers=1, query_heads=4, kv_heads=2, width=8,
            intermediate=8, length=4, global_batch_size=2, steps=1, rounds=1)
        rows = {row["plan"]: row for row in results["rows"]}
        self.assertEqual(list(rows), ["unsplit", "heads", "projections"])
        self.assertEqual((rows["unsplit"]["moved"], rows["unsplit"]["x_unsplit"]), (0, 1.0))
        # 8 tokens of width 8, heads of 2: heads sends h (8 x 8) to part 1 and its
        # partial output back, and both gradients, and the mask (2 x 4 x 4 int32) once;
        # projections also sends q, k, v's part-1 heads (2 query, 1 key/value) back, the
        # output's slice (2 heads) out, their gradients, and the gradient of h from each
        # of the three column splits back. Adam's 12 bytes to each of the 4 kernels.
        adam = 4 * 12
        self.assertEqual(rows["heads"]["moved"], 4 * 8 * 8 * 4 + 4 * 2 * 4 * 4 + adam)
        self.assertEqual(rows["projections"]["moved"], 4 * 8 * (6 * 8 + 4 * (2 + 1) * 2) + adam)
        for row in rows.values():
            self.assertEqual(row["moved"], row["formula"], row["plan"])

    def test_vocab_loss_both_ways_equal_one_device_and_move_what_the_formula_says(self):
        from benchmarks.harness import vocab_loss
        results = vocab_loss.run_vocab_loss_benchmark(
            DEVICES_4, vocabs=(10,), parts=(3,), tokens=6, width=4, steps=1, rounds=1)
        gather, split = results["rows"]
        self.assertEqual((gather["way"], split["way"]), ("gather", "vocab_parallel"))
        # Rows 4, 3, 3: both send h (6 x 4) to parts 1 and 2 and its gradient back; gather
        # part 1's and 2's logits (6 x 6) and their gradient; vocab_parallel the targets,
        # three reductions and log Z, 6 each, per part.
        hidden = 4 * 2 * 6 * 4 * 2
        self.assertEqual(gather["measured"], hidden + 4 * 2 * 6 * 6)
        self.assertEqual(split["measured"], hidden + 4 * 5 * 6 * 2)
        for row in results["rows"]:
            self.assertEqual(row["measured"], row["formula"])
            self.assertLessEqual(row["max_difference"], vocab_loss.TOLERANCE)

    def test_vocab_loss_check_refuses_a_wrong_gradient(self):
        from benchmarks.harness import vocab_loss
        rng = np.random.default_rng(0)
        h, table = rng.normal(size=(3, 2)).astype(np.float32), rng.normal(size=(5, 2))
        loss, hidden_grad, table_grad = vocab_loss.reference(h, np.array([0, 4, 2]),
                                                             table.astype(np.float32))
        wrong = table_grad.numpy().copy()
        wrong[4, 1] += 1e-4
        with self.assertRaisesRegex(AssertionError, "loss, dh, dE differ"):
            vocab_loss.check_equal((loss, hidden_grad, [wrong[:3], wrong[3:]]),
                                   (loss, hidden_grad, table_grad))


class MemoryBenchmarkTest(tf.test.TestCase):
    """benchmarks/memory.py's counts (its harness), in-process on one small configuration
    each."""

    def _measure(self, name):
        from benchmarks.harness import memory
        return memory.measure({**memory.CONFIGS[name], "name": name, "width": 8, "layers": 2,
                               "global_batch_size": 6, "steps": 1})

    def test_bytes_held_where_each_variable_lives(self):
        # MLP 256 -> 8 -> 8 -> 10: its variables' bytes, counted by hand.
        variables = 4 * (256 * 8 + 8 + 8 * 8 + 8 + 8 * 10 + 10)
        held = self._measure("towers_2")["held"]
        self.assertEqual(list(held), ["/device:CPU:0"])  # main placement: all on the main device
        self.assertEqual(held["/device:CPU:0"]["variables"], variables)
        self.assertEqual(held["/device:CPU:0"]["gradient_sums"], variables)
        self.assertBetween(held["/device:CPU:0"]["slots"] - 2 * variables, 0, 64)  # Adam's m, v
        split = self._measure("split_t2")["held"]
        self.assertEqual(sorted(split), ["/device:CPU:0", "/device:CPU:1"])
        self.assertEqual(sum(kinds["variables"] for kinds in split.values()), variables)
        # The column layer's kernel and bias, and the row layer's kernel, halved; the row
        # bias and the logits layer on part 0.
        self.assertEqual(split["/device:CPU:1"]["variables"], 4 * (256 * 4 + 4 + 4 * 8))

    def test_recompute_holds_what_the_pipeline_holds(self):
        # Recomputation changes what a step keeps alive, not where state lives.
        kept, rerun = self._measure("pipeline_2x2_m4"), self._measure("pipeline_2x2_m4_recompute")
        self.assertEqual(kept["held"], rerun["held"])
        self.assertEqual(sorted(kept["held"]), ["/device:CPU:0", "/device:CPU:1"])
        # Stage 1 (CPU:1) holds hidden_1 (8 x 8) and the logits layer (8 x 10), with biases.
        self.assertEqual(rerun["held"]["/device:CPU:1"]["variables"], 4 * (8 * 8 + 8 + 8 * 10 + 10))
        # CPU's default allocator counts nothing ({}); once, in a full CI run, an earlier test
        # of the same process had turned its statistics on and the main device's was measured
        # (what turns them on is not found: not the profiler, tfdbg or trace_on alone).
        self.assertLessEqual(set(rerun["cpu_peak_bytes"]), {"/device:CPU:0"})
        self.assertTrue(all(peak >= 0 for peak in rerun["cpu_peak_bytes"].values()))

    def test_grid_holds_each_part_where_it_lives(self):
        # The whole command, as the README runs it: 2 towers x 2 stages x 2 parts need 8
        # logical devices, more than this process has, so its child makes them.
        output_dir = tempfile.mkdtemp(prefix="test_memory_benchmark_")
        self.addCleanup(shutil.rmtree, output_dir, ignore_errors=True)
        result = subprocess.run(
            [sys.executable, os.path.join(ROOT, "benchmarks", "memory.py"),
             "--configs=grid_2x2x2", "--width=8", "--layers=4", "--global_batch_size=8",
             "--steps=1", f"--output_dir={output_dir}"],
            capture_output=True, text=True, timeout=300, check=False)
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        with open(os.path.join(output_dir, "results.json")) as f:
            held = json.load(f)["results"][0]["held"]
        # MLP 256 -> 4 x 8 -> 10, hidden_0/2 by columns and hidden_1/3 by rows, cut after
        # hidden_1: tower 0's stage 0 on CPU:0-1, stage 1 (and the logits, on its part 0)
        # on CPU:2-3; part 0 also holds each row layer's bias. Tower 1's devices hold none.
        self.assertEqual({device: kinds["variables"] for device, kinds in held.items()}, {
            "/device:CPU:0": 4 * (256 * 4 + 4 + 4 * 8 + 8),
            "/device:CPU:1": 4 * (256 * 4 + 4 + 4 * 8),
            "/device:CPU:2": 4 * (8 * 4 + 4 + 4 * 8 + 8 + 8 * 10 + 10),
            "/device:CPU:3": 4 * (8 * 4 + 4 + 4 * 8)})
        for kinds in held.values():
            self.assertEqual(kinds["gradient_sums"], kinds["variables"])
        has_matplotlib = importlib.util.find_spec("matplotlib") is not None
        self.assertEqual(os.path.exists(os.path.join(output_dir, "memory.png")), has_matplotlib)

    def test_spread_fills_each_tower_to_a_quarter(self):
        # MLP 256 -> 8 -> 8 -> 10 on 4 towers, variables by bytes: 256 x 8 kernel 8192,
        # 8 x 10 kernel 320, 8 x 8 kernel 256, logits bias 40, two biases of 8: 32 each;
        # 8872 in all, 2218 a tower. Laid end to end, largest first, the first kernel's 256
        # rows of 32 bytes are held as slabs of 69, 70, 69 and 48 rows (each row to the
        # tower holding its middle), and tower 3 takes the rest whole.
        held = self._measure("spread_4")["held"]
        variables = {"/device:CPU:0": 69 * 32, "/device:CPU:1": 70 * 32,
                     "/device:CPU:2": 69 * 32, "/device:CPU:3": 48 * 32 + 320 + 256 + 40 + 64}
        self.assertEqual({device: kinds["variables"] for device, kinds in held.items()},
                         variables)
        for device, kinds in held.items():
            self.assertEqual(kinds["gradient_sums"], variables[device])
            self.assertBetween(kinds["slots"] - 2 * variables[device], 0, 64)  # Adam's m, v
