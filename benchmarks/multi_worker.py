"""Several workers against one process with the same number of towers, and the exchange's cost.

    python benchmarks/multi_worker.py --models=mlp,cnn --num_workers=2 \
        --towers_per_worker=2 --global_batch_size=256 --steps=30

For each model and round: one process with num_workers x towers_per_worker
towers, then num_workers worker processes on 127.0.0.1 ports with
towers_per_worker towers each, all on the same global batch. Each worker also
times the cross-worker all-reduce alone (exchange.mean_across_workers on
buffers of the gradients' size): the cost the extra processes add. On one
machine the workers share its cores and talk over loopback, so this measures
the mechanism's overhead, not a network.
"""

import json
import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.harness import child_process  # noqa: E402

MODELS = flags.DEFINE_list("models", ["mlp", "cnn"], "Models from towers.models.")
NUM_WORKERS = flags.DEFINE_integer("num_workers", 2, "Worker processes.", lower_bound=2)
TOWERS_PER_WORKER = flags.DEFINE_integer("towers_per_worker", 2, "Towers in each worker.",
                                         lower_bound=1)
GLOBAL_BATCH_SIZE = flags.DEFINE_integer("global_batch_size", 256, "Examples per step.",
                                         lower_bound=1)
STEPS = flags.DEFINE_integer("steps", 30, "Timed steps per configuration.", lower_bound=1)
ROUNDS = flags.DEFINE_integer("rounds", 2, "Times each configuration runs, alternating.",
                              lower_bound=1)
OUTPUT = flags.DEFINE_string("output", None, "Write the results here as JSON.")
CHILD_CONFIG = flags.DEFINE_string("child_config", None, "Internal: run one process.")


def measure(config):
    """Child: one process (or one worker) trains; returns step and exchange times (ms)."""
    import numpy as np
    import towers
    devices = towers.configure_devices(config["num_towers"], "cpu")
    cluster = None
    if "worker_hosts" in config:
        cluster = towers.Cluster(config["worker_hosts"], config["task_index"])
        towers.join_cluster(cluster)
    import keras
    import tensorflow as tf
    from towers.data_parallel import exchange
    from towers.cli import models

    with tf.device(devices[0]):
        model = models.build_model(config["model"], (32, 32, 3), 10, seed=0)
    trainer = towers.TowerTrainer(
        model, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        keras.optimizers.SGD(0.01), devices=devices, cluster=cluster)
    rng = np.random.default_rng(0)
    batch = (rng.random((config["global_batch_size"], 32, 32, 3), dtype=np.float32),
             rng.integers(0, 10, config["global_batch_size"]))
    if cluster is not None:
        batch = towers.split_batch(batch, cluster.num_workers)[cluster.task_index]
    result = child_process.time_steps(lambda: trainer.train_step(batch), config["steps"], 3)
    result["gradient_mb"] = sum(v.shape.num_elements() * 4
                                for v in model.trainable_variables) / 2**20
    if cluster is not None:
        with tf.device(devices[0]):
            values = [tf.ones(v.shape) for v in model.trainable_variables] + [tf.ones([])]
        all_reduce = tf.function(lambda: exchange.mean_across_workers(
            values, 1.0, cluster, devices[0])[1])
        exchange_times = child_process.time_steps(all_reduce, config["steps"], 3)
        result["exchange_ms"] = exchange_times["median_ms"]
        result["exchange_uncertainty_ms"] = exchange_times["uncertainty_ms"]
    return result


def run_workers(script, config, num_workers):
    """Runs num_workers worker children together; returns their results."""
    from towers.multi_worker import launch
    hosts = [f"127.0.0.1:{port}" for port in launch.free_ports(num_workers)]
    children = [child_process.start_child(script, {**config, "worker_hosts": hosts,
                                                   "task_index": i})
                for i in range(num_workers)]
    return [child_process.child_result(child) for child in children]


def main(argv):
    del argv
    if CHILD_CONFIG.value:
        child_process.report(measure(json.loads(CHILD_CONFIG.value)))
        return
    script = os.path.abspath(__file__)
    workers, per_worker = NUM_WORKERS.value, TOWERS_PER_WORKER.value
    rows = []
    for model in MODELS.value:
        config = {"model": model, "steps": STEPS.value,
                  "global_batch_size": GLOBAL_BATCH_SIZE.value}
        for round_index in range(ROUNDS.value):
            single = child_process.run_child(script, {**config,
                                                      "num_towers": workers * per_worker})
            several = run_workers(script, {**config, "num_towers": per_worker}, workers)
            chief = several[0]
            rows.append({"model": model, "round": round_index, "single": single,
                         "workers": several,
                         "ratio": chief["median_ms"] / single["median_ms"],
                         "exchange_share": chief["exchange_ms"] / chief["median_ms"]})
    _print_table(rows, workers, per_worker)
    if OUTPUT.value:
        with open(OUTPUT.value, "w") as f:
            json.dump({"config": {"num_workers": workers, "towers_per_worker": per_worker,
                                  "global_batch_size": GLOBAL_BATCH_SIZE.value,
                                  "steps": STEPS.value, "rounds": ROUNDS.value},
                       "rows": rows}, f, indent=2)


def _print_table(rows, workers, per_worker):
    ring_factor = 2 * (workers - 1) / workers
    print(f"global batch {GLOBAL_BATCH_SIZE.value}: 1 process x {workers * per_worker} towers "
          f"against {workers} workers x {per_worker} towers\n")
    print("| model | round | gradients (MiB) | 1 process step (ms) | workers step (ms) "
          "| x 1 process | all-reduce alone (ms) | share of step | ring bytes/worker (MiB) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        single, chief = row["single"], row["workers"][0]
        print(f"| {row['model']} | {row['round'] + 1} | {single['gradient_mb']:.2f} | "
              f"{single['median_ms']:.1f} ± {single['uncertainty_ms'] or 0:.1f} | "
              f"{chief['median_ms']:.1f} ± {chief['uncertainty_ms'] or 0:.1f} | "
              f"{row['ratio']:.2f} | {chief['exchange_ms']:.2f} ± "
              f"{chief['exchange_uncertainty_ms'] or 0:.2f} | {row['exchange_share']:.0%} | "
              f"{ring_factor * single['gradient_mb']:.2f} |")


if __name__ == "__main__":
    app.run(main)
