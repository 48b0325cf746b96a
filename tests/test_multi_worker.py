"""Several workers: 2 processes x 2 towers train exactly as 1 process x 4 towers.

Worker processes run on 127.0.0.1 ports of this machine; tests that need none
check the cluster description and the errors a user can make.
"""

import collections
import functools
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from unittest import mock

import numpy as np
import tensorflow as tf
from absl import flags
from absl.testing import flagsaver, parameterized

import towers
from tests import multi_worker_job, reference
from tests.checkpoint_files import checkpoint_values, position
from towers.cli import train
from towers.data_parallel import collectives
from towers.multi_worker import launch

if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
TOLERANCE = 1e-5
# The training every CLI test runs: 2 workers x 2 towers, checkpoints every 20 steps.
CLI_ARGS = ["--model=mlp", "--num_towers=2", "--global_batch_size=32", "--steps=120",
            "--checkpoint_every=20", "--deterministic"]


def _hosts(count):
    return [f"127.0.0.1:{port}" for port in launch.free_ports(count)]


def _start_worker(test, hosts, index, *args):
    """One `towers-train` worker process, its stderr captured, killed when `test` ends."""
    return _started(test, subprocess.Popen(
        [sys.executable, "-m", "towers.train", *args, f"--worker_hosts={','.join(hosts)}",
         f"--task_index={index}"], cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True))


def _started(test, process):
    """`process`, killed when `test` ends if it still runs (a failed or hung test leaves
    no worker behind to load the machine for the tests after it)."""
    test.addCleanup(lambda: process.poll() is None and process.kill())
    return process


LAUNCHER = [sys.executable, os.path.join(ROOT, "towers", "multi_worker", "launch.py")]


def _launch(*args, timeout=300):
    return subprocess.run([*LAUNCHER, *args], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=timeout)


def _error_line(stderr):
    lines = [line for line in stderr.splitlines() if line.startswith("towers-train: error:")]
    return lines[-1] if lines else stderr[-2000:]


def _read_until(stream, pattern, timeout_s):
    """Reads `stream` line by line up to the first line that matches `pattern`.

    Returns the text read, that line included. A watchdog test times its run to
    this line, the error being reported, not to the process's exit, whose
    TensorFlow teardown a loaded machine stretches by tens of seconds.
    """
    found, lines = queue.Queue(), []

    def read():
        for line in stream:
            lines.append(line)
            if re.search(pattern, line):
                break
        found.put("".join(lines))

    threading.Thread(target=read, daemon=True).start()
    return found.get(timeout=timeout_s)


def _wait_for_checkpoint(directory, processes, timeout_s=120):
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(os.path.join(directory, "checkpoint")):
        assert all(p.poll() is None for p in processes), "a worker ended before a checkpoint"
        assert time.monotonic() < deadline, "no checkpoint in time"
        time.sleep(0.02)


@functools.lru_cache(maxsize=None)
def _uninterrupted_run():
    """The checkpoint directory of CLI_ARGS run to the end by 2 workers (run once)."""
    directory = tempfile.mkdtemp()
    straight = _launch("2", *CLI_ARGS, f"--checkpoint_dir={directory}")
    assert straight.returncode == 0, straight.stdout[-3000:]
    return directory


class EquivalenceTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.named_parameters(
        # A batch of 1 leaves worker 1 empty: its convolution must not run.
        ("main", "conv", "main", False, (2, 2)),
        # Worker 0 alone traces a function with collectives across workers first.
        ("collective_packed_chief_traces_more", "dense", "collective", True, (2, 2), None, 1,
         True),
        # XLA compiles each tower; the all-reduce across workers stays outside.
        ("different_tower_counts_xla", "dense", "main", False, (1, 3), {"jit_compile": True}),
        # Each worker a grid of 1 tower x 2 stages, 2 micro-batches (1f1b).
        ("pipeline_stages", "dense", "main", False, (1, 1),
         {"pipeline_cuts": [0], "micro_batches": 2, "pipeline_schedule": "1f1b"}, 2),
        # Each worker a grid of 1 tower x 2 parts: the table split by rows, the logits
        # by columns; sparse rows and dense columns both meet across workers.
        ("split_layers", "embedding", "main", False, (1, 1),
         {"split_plan": {0: "vocab", 2: "column"}}, 2),
        # Padded sequences: the loss is over the global batch's unmasked tokens, counted
        # across workers (worker 1's part of the first batch is empty), on 1 and 3 towers.
        # Adam updates only the rows a sparse gradient names: the workers' rows of the
        # table must arrive as one device's would, not densified.
        ("masked_tokens_sparse_table", "masked", "main", False, (1, 3)),
        # Each worker holds half the optimizer state (ZeRO-2 across workers): the
        # gradients reduce-scattered, the updated halves all-gathered; the logits'
        # kernel is slabbed across the workers (10 rows and 6), each worker's rows a slab.
        ("spread", "conv", "main", False, (2, 2), {"variable_placement": "spread"}),
        # The table slabbed across the workers: its sparse rows gathered, each worker
        # applying those of its own slab.
        ("spread_sparse_table", "embedding", "main", False, (1, 3),
         {"variable_placement": "spread"}),
        # A loss with reduction="sum": each worker's share scaled by the global rows over
        # its own (an all-reduce before the towers), on XLA towers.
        ("sum_loss_xla", "dense", "main", False, (1, 3),
         {"loss_reduction": "sum", "jit_compile": True}),
        # reduction=None: the gradients times the unreduced values' entries, counted
        # across workers (padded tokens counted as 0).
        ("unreduced_loss", "masked", "main", False, (2, 1), {"loss_reduction": None}))
    def test_two_workers_of_two_towers_match_one_process_of_four(
            self, model, aggregation, pack, towers_per_worker, more_options=None,
            devices_per_tower=1, trace_on_chief_first=False):
        options = {"aggregation": aggregation, "pack_gradients": pack, **(more_options or {})}
        results, _ = _run_jobs(self, [{
            "num_towers": towers_per_worker[i], "devices_per_tower": devices_per_tower,
            "model": model, "options": options, "trace_on_chief_first": trace_on_chief_first}
            for i in range(2)])

        batches = multi_worker_job.global_batches(model)
        reduction = options.get("loss_reduction", "sum_over_batch_size")
        single = multi_worker_job.make_trainer([f"/device:CPU:{i}" for i in range(4)], model,
                                               loss_reduction=reduction)
        losses = [single.train_step(batch)["loss"] for batch in batches]
        expected = [v.numpy() for v in single.model.weights]
        plain = reference.single_device_weights(
            multi_worker_job.make_model(model), reference.OPTIMIZERS["adam"](),
            multi_worker_job.make_loss(reduction), batches)
        for result in results:
            self.assertEqual(int(result["steps"]), len(batches))
            weights = [result[f"w{i}"] for i in range(len(expected))]
            self.assertAllClose(weights, expected, atol=TOLERANCE, rtol=0)
            self.assertAllClose(weights, plain, atol=TOLERANCE, rtol=0)
            self.assertAllClose(result["losses"], losses, atol=TOLERANCE, rtol=0)
            self.assertAllClose(result["accuracy"], single.metrics[0].result(), atol=1e-6)
        # Every worker applies the same all-reduced update: the copies stay identical.
        for name in set(results[0].files) - {"slot_bytes"}:
            self.assertAllEqual(results[0][name], results[1][name], msg=name)
        # Adam's 2 slots per weight: all on each worker, or spread, each its own half
        # (give or take half a row at each end of its run).
        spread = options.get("variable_placement") == "spread"
        slots = [result["slot_bytes"] / (2 * result["model_bytes"]) for result in results]
        self.assertAllClose(slots, [0.5, 0.5] if spread else [1.0, 1.0], atol=0.1)
        self.assertAllClose(sum(slots), 1.0 if spread else 2.0)
        # Saving would need every worker's slots on the chief: fit refuses a checkpointer.
        self.assertEqual("checkpointer cannot save" in str(results[0]["checkpoint_refusal"]),
                         spread)

    def test_workers_given_3_and_4_batches_stop_after_the_same_step(self):
        # Both fit 2 epochs: worker 0's data ends a step before worker 1's in each.
        results, stderrs = _run_jobs(self, [{"num_towers": 2, "uneven_data": True}] * 2)

        single = multi_worker_job.make_trainer([f"/device:CPU:{i}" for i in range(4)], "dense")
        validation = multi_worker_job.uneven_validation_batch()
        losses, epoch_losses, accuracies, val_losses, batches = [], [], [], [], []
        for epoch in range(multi_worker_job.UNEVEN_EPOCHS):
            single.metrics.reset()  # as fit does at each epoch's start
            epoch_batches = multi_worker_job.uneven_global_batches(epoch)
            sizes = [len(batch[1]) for batch in epoch_batches]
            losses.append([single.train_step(batch)["loss"] for batch in epoch_batches])
            epoch_losses.append(np.dot(losses[-1], sizes) / sum(sizes))
            accuracies.append(single.metrics[0].result())
            val_losses.append(single.evaluate(validation)["loss"])
            batches += epoch_batches
        expected = [v.numpy() for v in single.model.weights]
        plain = reference.single_device_weights(
            multi_worker_job.make_model("dense"), reference.OPTIMIZERS["adam"](),
            reference.make_loss(), batches)
        for result in results:
            for fit in ("step", "in_graph"):
                self.assertEqual(int(result[f"{fit}_step"]), len(batches))
                weights = [result[f"{fit}_w{i}"] for i in range(len(expected))]
                self.assertAllClose(weights, expected, atol=TOLERANCE, rtol=0)
                self.assertAllClose(weights, plain, atol=TOLERANCE, rtol=0)
                self.assertAllClose(result[f"{fit}_val_loss"], val_losses, atol=TOLERANCE, rtol=0)
            self.assertAllClose(result["step_loss"], epoch_losses, atol=TOLERANCE, rtol=0)
            self.assertAllClose(result["step_accuracy"], accuracies, atol=1e-6, rtol=0)
            # Resumed after batch 3 of epoch 1: that epoch's mean is batch 4's loss.
            self.assertAllClose(result["in_graph_loss"], [losses[0][3], epoch_losses[1]],
                                atol=TOLERANCE, rtol=0)
        for name in results[0].files:
            self.assertAllEqual(results[0][name], results[1][name], msg=name)
        # Once per epoch and fit: the worker whose data ended says so; the other not.
        said = r"worker (\d) has no batches left in epoch (\d) after batch (\d)"
        self.assertEqual(re.findall(said, stderrs[0]), [("0", "1", "3"), ("0", "2", "3")] * 2)
        self.assertEqual(re.findall(said, stderrs[1]), [])


def _run_jobs(test, configs, timeout_s=300, returncode=0):
    """Runs tests.multi_worker_job as a cluster, one worker per config (each gets the
    cluster, its index, a shared checkpoint_dir and its output added); returns
    each worker's saved .npz (returncode 0) and stderr. A worker that hangs, or exits
    with another code than `returncode`, fails the test."""
    hosts, directory = _hosts(len(configs)), test.create_tempdir().full_path
    paths = [os.path.join(directory, f"worker{i}") for i in range(len(configs))]
    workers = []
    for i, config in enumerate(configs):
        with open(f"{paths[i]}.stderr", "w") as stderr:  # a file: a full pipe would block
            workers.append(_started(test, subprocess.Popen(
                [sys.executable, "-m", "tests.multi_worker_job", json.dumps({
                    **config, "worker_hosts": hosts, "task_index": i,
                    "checkpoint_dir": os.path.join(directory, "checkpoints"),
                    "output": f"{paths[i]}.npz"})], cwd=ROOT, env=ENV, stderr=stderr)))
    stderrs = []
    for i, (worker, path) in enumerate(zip(workers, paths)):
        try:
            worker.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            test.fail(f"worker {i} still runs after {timeout_s} s: it hangs")
        with open(f"{path}.stderr") as stderr:
            stderrs.append(stderr.read())
        test.assertEqual(worker.returncode, returncode, stderrs[-1][-3000:])
    return [np.load(f"{path}.npz") for path in paths if not returncode], stderrs


class InstanceKeyTest(tf.test.TestCase):
    """The instance keys traces take; nothing runs. TensorFlow keeps each (group, key)'s
    shape and type for the life of the process: two ops sharing one fail or hang."""

    GROUPS = [collectives.workers_group_key("/device:CPU:0"),
              collectives.workers_group_key("/device:GPU:0")]

    @staticmethod
    def _signature(i):
        # As cluster.model_signature: names that differ in more than a digit.
        return [(f"sequential_{i}/dense_{2 * i}/kernel", (5 + i, 6), "float32"),
                (f"sequential_{i}/dense_{2 * i}/bias", (6,), "float32")]

    @classmethod
    def _trace(cls, name, places):
        """Per (group, place): the keys [first, first + slots) of a function traced under
        `name`; every 10th op a gather (SHAPE_KEYS keys), the groups' ops interleaved."""
        taken = {}
        with collectives.instance_keys(name):
            for place in range(places):
                for group in cls.GROUPS:
                    slots = collectives.SHAPE_KEYS if place % 10 == 0 else 1
                    first = collectives.instance_key(group, slots)
                    taken[group, place] = range(first, first + slots)
        return taken

    @staticmethod
    def _keys(taken, group):
        return [key for (g, _), slots in taken.items() if g == group for key in slots]

    @staticmethod
    def _new_process():
        """The key registry of a process that has traced nothing yet."""
        return mock.patch.multiple(collectives, _counted_ranges={},
                                   _named_ranges=collections.defaultdict(dict))

    def test_thousands_of_ops_of_several_functions_never_share_a_key(self):
        names = [("train_step", self._signature(i)) for i in range(4)] + [("check_same", ("x",))]
        with self._new_process():
            counted = [collectives.instance_key(group) for group in self.GROUPS]  # eager ops
            traced = [self._trace(name, 5000) for name in names]
        for group, counted_key in zip(self.GROUPS, counted):
            keys = [key for taken in traced for key in self._keys(taken, group)] + [counted_key]
            self.assertLen(set(keys), len(keys))  # 5 x 5000 ops, 500 of them gathers
            self.assertBetween(min(keys), 1, 2**31 - 1)
            self.assertBetween(max(keys), 1, 2**31 - 1)  # instance keys are int32
        # Another worker traced something else first, and these in another order.
        with self._new_process():
            collectives.instance_key(self.GROUPS[0])
            self._trace(("evaluate", self._signature(9)), 10)
            again = [self._trace(name, 5000) for name in reversed(names)][::-1]
        self.assertEqual(traced, again)

    def test_limits_are_one_clear_error(self):
        with self._new_process(), mock.patch.object(collectives, "_NAMED_RANGES", 2):
            first, second = (self._trace(("f", i), 3) for i in range(2))
            for group in self.GROUPS:  # whether or not their hashes meet
                self.assertFalse(set(self._keys(first, group)) & set(self._keys(second, group)))
            with self.assertRaisesRegex(ValueError, "2 functions with collective ops"):
                self._trace(("f", 2), 3)
        with self._new_process(), mock.patch.object(collectives, "_KEYS_PER_NAME", 130):
            with self.assertRaisesRegex(ValueError, "more than 130 instance keys"):
                self._trace(("f", 0), 11)  # per group 64 + 9 keys, then 64 more


class FaultTest(tf.test.TestCase):

    def test_killed_worker_stops_the_others_and_a_relaunch_resumes(self):
        directory = self.create_tempdir().full_path
        args = [*CLI_ARGS, f"--checkpoint_dir={directory}", "--peer_timeout_s=5"]
        launcher = subprocess.Popen([*LAUNCHER, "2", *args],
                                    cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
        pids = [int(launcher.stdout.readline().split()[4]) for _ in range(2)]
        _wait_for_checkpoint(directory, [launcher])
        os.kill(pids[1], signal.SIGKILL)
        killed = time.monotonic()
        output = _read_until(launcher.stdout, r"\[worker 0\] towers-train: error:", 120)
        self.assertLess(time.monotonic() - killed, 5 + 30)  # peer timeout + slack
        output += launcher.communicate(timeout=120)[0]
        self.assertEqual(launcher.returncode, 1, output[-3000:])
        self.assertRegex(output, r"\[worker 0\] towers-train: error: step \d+: worker 1 "
                                 r"\(127.0.0.1:\d+\) stopped answering .*Restart every worker")
        self.assertIn("launch: worker 1 exited with status -9", output)
        killed_at = position(checkpoint_values(directory))
        self.assertBetween(killed_at, (0, 20), (2, 29))  # 45 batches an epoch: not finished

        result_file = os.path.join(directory, "out.json")
        resumed = subprocess.run(  # as a user relaunches: the script the README gives
            ["bash", "scripts/launch_local_workers", "2", *args, f"--output_json={result_file}"],
            cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
        self.assertEqual(resumed.returncode, 0, resumed.stdout[-3000:])
        with open(result_file) as f:
            self.assertEqual(json.load(f)["steps"], 120)
        expected, actual = checkpoint_values(_uninterrupted_run()), checkpoint_values(directory)
        self.assertEqual(sorted(expected), sorted(actual))
        for name in expected:
            self.assertAllEqual(expected[name], actual[name], msg=name)

    def test_sigterm_to_one_worker_stops_all_after_the_same_step_and_a_relaunch_resumes(self):
        directory = self.create_tempdir().full_path
        # No periodic checkpoint comes round in 120 steps: only the stop saves one. Four
        # steps per call, the all-reduces inside the in-graph loop: the uninterrupted
        # run, a step per call, must still be met bit for bit.
        args = [*CLI_ARGS, "--checkpoint_every=1000", "--steps_per_execution=4",
                f"--checkpoint_dir={directory}"]
        launcher = subprocess.Popen([*LAUNCHER, "2", *args], cwd=ROOT, env=ENV,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        pids = [int(launcher.stdout.readline().split()[4]) for _ in range(2)]
        for line in launcher.stdout:  # the progress lines start once steps run
            if line.startswith("[worker 0]") and "batch" in line:
                break
        os.kill(pids[1], signal.SIGTERM)
        output, _ = launcher.communicate(timeout=120)
        self.assertEqual(launcher.returncode, 75, output[-3000:])
        stops = re.findall(r"\[worker (\d)\] towers-train: stopped by SIGTERM or SIGINT to a "
                           r"worker after step (\d+): a checkpoint is saved in (\S+); rerun "
                           r"the same command to resume\.", output)
        self.assertEqual(sorted(w for w, _, _ in stops), ["0", "1"], output[-3000:])
        self.assertEqual(len({(step, where) for _, step, where in stops}), 1)  # the same line
        step = int(stops[0][1])
        self.assertEqual(position(checkpoint_values(directory)), divmod(step, 45))

        relaunched = _launch("2", *args)
        self.assertEqual(relaunched.returncode, 0, relaunched.stdout[-3000:])
        expected, actual = checkpoint_values(_uninterrupted_run()), checkpoint_values(directory)
        self.assertEqual(sorted(expected), sorted(actual))
        for name in expected:
            self.assertAllEqual(expected[name], actual[name], msg=name)

    def test_hung_worker_is_noticed_within_the_peer_timeout(self):
        hosts, directory = _hosts(2), self.create_tempdir().full_path
        args = [*CLI_ARGS, f"--checkpoint_dir={directory}", "--peer_timeout_s=3"]
        workers = [_start_worker(self, hosts, i, *args) for i in range(2)]
        try:
            _wait_for_checkpoint(directory, workers)
            os.kill(workers[1].pid, signal.SIGSTOP)  # alive, holding its port, silent
            stopped = time.monotonic()
            stderr = _read_until(workers[0].stderr, "^towers-train: error:", 60)
            self.assertLess(time.monotonic() - stopped, 3 + 20)
            stderr += workers[0].communicate(timeout=60)[1]
            self.assertEqual(workers[0].returncode, 1)
            self.assertRegex(_error_line(stderr),
                             r"towers-train: error: step \d+: worker 1 \(127.0.0.1:\d+\) "
                             r"stopped answering")
        finally:
            workers[1].kill()
            workers[1].wait()


class BadClusterTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.named_parameters(
        ("other_spelling", lambda hosts: [hosts[0], hosts[1].replace("127.0.0.1", "localhost")],
         "the workers disagree on: cluster addresses"),
        # Whichever worker forms the group first, the other is told the two sizes, in
        # its order: which one comes first is timing (it failed a loaded machine).
        ("one_more_worker", lambda hosts: hosts + ["127.0.0.1:1"],
         "could not agree on the cluster .*joining a group with "
         "(size3, but that group has size 2|size2, but that group has size 3)"),
    )
    def test_workers_with_different_clusters_both_refuse(self, other_cluster, message):
        hosts = _hosts(2)
        workers = [_start_worker(self, hosts, 0, *CLI_ARGS),
                   _start_worker(self, other_cluster(hosts), 1, *CLI_ARGS)]
        for worker in workers:
            _, stderr = worker.communicate(timeout=120)
            self.assertEqual(worker.returncode, 1)
            self.assertRegex(_error_line(stderr), message)

    @parameterized.named_parameters(
        ("learning_rate", ["--learning_rate=0.01", "--learning_rate=0.02"], "--learning_rate"),
        ("seed", ["--seed=1", "--seed=2"], "--seed"),
        # Steps of other shapes: these once hung both workers with no line.
        ("steps_per_execution", ["--steps_per_execution=1", "--steps_per_execution=3"],
         "--steps_per_execution"),
    )
    def test_workers_with_different_flags_both_refuse(self, flag_per_worker, what):
        hosts = _hosts(2)
        workers = [_start_worker(self, hosts, i, *CLI_ARGS, flag)
                   for i, flag in enumerate(flag_per_worker)]
        for worker in workers:
            _, stderr = worker.communicate(timeout=120)
            self.assertEqual(worker.returncode, 1)
            self.assertIn(f"the workers disagree on: {what}", _error_line(stderr))

    def test_trainers_whose_steps_differ_in_shape_both_refuse(self):
        # From Python, where towers-train's flags are not there to compare.
        _, stderrs = _run_jobs(self, [{"num_towers": 1, "model": "dense", "options": {
            "steps_per_execution": count}} for count in (1, 3)], returncode=1)
        for stderr in stderrs:
            self.assertIn("the workers disagree on: the trainer's steps_per_execution.",
                          stderr)

    def test_a_call_past_the_step_timeout_ends_on_every_worker(self):
        # One call of all 120 steps, its tracing included, takes far longer than 1 s.
        hosts = _hosts(2)
        workers = [_start_worker(self, hosts, i, *CLI_ARGS, "--steps_per_execution=120",
                                 "--step_timeout_s=1") for i in range(2)]
        for worker in workers:
            _, stderr = worker.communicate(timeout=120)
            self.assertEqual(worker.returncode, 1)
            self.assertRegex(_error_line(stderr), r"step 1: no worker finished it within "
                             r"step_timeout_s=1 s, every worker answering")

    def test_missing_worker_times_out_at_startup(self):
        worker = _start_worker(self, _hosts(2), 0, *CLI_ARGS, "--startup_timeout_s=2")
        _, stderr = worker.communicate(timeout=120)
        self.assertEqual(worker.returncode, 1)
        self.assertIn("not every one of the 2 workers", _error_line(stderr))
        self.assertIn("joined within 2 s", _error_line(stderr))

    def test_port_in_use_is_refused_before_anything_starts(self):
        with socket.socket() as holder:
            holder.bind(("127.0.0.1", 0))
            holder.listen()
            port = holder.getsockname()[1]
            cluster = towers.Cluster([f"127.0.0.1:{port}", "127.0.0.1:1"], 0)
            with self.assertRaisesRegex(ValueError, f"port {port} of worker 0 .* is in use"):
                towers.join_cluster(cluster)

    def test_spread_in_a_cluster_refuses_global_norm_clipping(self):
        # Each worker has only its own pieces' gradients: no global norm to clip by.
        cluster = towers.Cluster(["127.0.0.1:1", "127.0.0.1:2"], 1)
        with self.assertRaisesRegex(ValueError, "spread' in a cluster cannot clip"):
            towers.TowerTrainer(reference.make_model(), reference.make_loss(),
                                reference.OPTIMIZERS["sgd"](), cluster=cluster,
                                variable_placement="spread", clip_global_norm=1.0)

    def test_trainer_needs_a_joined_cluster(self):
        cluster = towers.Cluster(["127.0.0.1:1", "127.0.0.1:2"], 1)
        with self.assertRaisesRegex(ValueError, "join_cluster"):
            towers.TowerTrainer(reference.make_model(), reference.make_loss(),
                                reference.OPTIMIZERS["sgd"](), cluster=cluster)

    def test_tf_config_chief_and_workers(self):
        config = {"cluster": {"chief": ["a:1"], "worker": ["b:2", "c:3"]},
                  "task": {"type": "worker", "index": 1}}
        cluster = towers.cluster_from_tf_config(json.dumps(config), peer_timeout_s=7)
        self.assertEqual(cluster.workers, ("a:1", "b:2", "c:3"))
        self.assertEqual((cluster.task_index, cluster.is_chief, cluster.peer_timeout_s),
                         (2, False, 7))
        self.assertIsNone(towers.cluster_from_tf_config(""))

    @parameterized.named_parameters(
        ("not_json", "{cluster:", "not valid JSON"),
        ("no_task", '{"cluster": {"worker": ["a:1"]}}', 'needs a "cluster" object and a "task"'),
        ("parameter_server", '{"cluster": {"worker": ["a:1"], "ps": ["b:2"]}, '
                             '"task": {"type": "worker", "index": 0}}', r"jobs \['ps'\]"),
        ("index_out_of_range", '{"cluster": {"worker": ["a:1", "b:2"]}, '
                               '"task": {"type": "worker", "index": 2}}',
         "index 2 is out of range"),
        ("unknown_task_type", '{"cluster": {"worker": ["a:1"]}, '
                              '"task": {"type": "chief", "index": 0}}', "task type 'chief'"),
        ("bad_address", '{"cluster": {"worker": ["a:1", "b"]}, '
                        '"task": {"type": "worker", "index": 0}}', "'b' is not 'host:port'"),
        ("duplicate", '{"cluster": {"worker": ["a:1", "a:1"]}, '
                      '"task": {"type": "worker", "index": 0}}', "more than once"),
    )
    def test_bad_tf_config(self, text, message):
        with self.assertRaisesRegex(ValueError, message):
            towers.cluster_from_tf_config(text)

    def test_bad_timeouts(self):
        with self.assertRaisesRegex(ValueError, "peer_timeout_s must be a positive number"):
            towers.Cluster(["a:1"], 0, peer_timeout_s=0)

    @parameterized.named_parameters(
        ("hosts_without_index", {"worker_hosts": ["a:1", "b:2"]}, "needs --task_index"),
        ("index_without_hosts", {"task_index": 1}, "--task_index needs --worker_hosts"),
        ("index_out_of_range", {"worker_hosts": ["a:1", "b:2"], "task_index": 2},
         "task index 2 is not a worker"),
    )
    def test_bad_cluster_flags(self, flag_values, message):
        with flagsaver.flagsaver(**flag_values):
            with self.assertRaisesRegex(ValueError, message):
                train.train()  # refused before any work

    def test_launcher_gives_each_worker_its_own_gpus(self):
        with mock.patch.dict(os.environ):
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            self.assertEqual([launch.gpu_share(i, 2, 4) for i in range(2)], ["0,1", "2,3"])
            self.assertEqual([launch.gpu_share(i, 3, 4) for i in range(3)], ["0", "1", "2"])
            self.assertIsNone(launch.gpu_share(0, 2, 0))
            with self.assertRaisesRegex(ValueError, "2 workers but 1 GPU.*--device_type=cpu"):
                launch.gpu_share(0, 2, 1)

    def test_launcher_rejects_what_it_sets_itself(self):
        self.assertEqual(launch.main(["launch", "2", "--task_index=1"]), 2)
        self.assertEqual(launch.main(["launch", "zero"]), 2)
