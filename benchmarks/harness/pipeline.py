"""run_pipeline_benchmark: every (K stages, M micro-batches) timed, traced and weighed.

Every configuration trains the same model (same seed) on the same synthetic
global batch with SGD. All are built and warmed up first (the first step,
which compiles, also records the step's graphs: which device runs each op);
then each is timed in turn in interleaved rounds, so drift of the machine hits
all alike; then a few steps of each are traced with tf.profiler for the idle
share of each stage device (the bubble) and the boxes of the timeline.
"""

import dataclasses
import os
import statistics

import keras
import numpy as np
import tensorflow as tf
from absl import logging

import towers
from benchmarks.harness import compare, measure, mode as mode_lib, pipeline_profile, report
from benchmarks.harness import tied_table, traces
from towers.cli import models as models_lib
from towers.model_parallel import schedule

NUM_CLASSES = compare.NUM_CLASSES


@dataclasses.dataclass(frozen=True)
class Config:
    """One pipeline set-up: K stages, M micro-batches, a schedule."""
    num_stages: int
    micro_batches: int
    schedule: str

    @property
    def name(self):
        return f"K{self.num_stages}_M{self.micro_batches}_{self.schedule}"

    @property
    def bubble_formula(self):
        """GPipe's idle share of each stage: (K - 1) / (M + K - 1)."""
        return (self.num_stages - 1) / (self.micro_batches + self.num_stages - 1)

    def uneven_bubble_formula(self, stage_costs):
        """GPipe's mean idle share of the stages when stage k costs stage_costs[k] per micro-batch.

        A pass of M micro-batches through stages of costs t_k takes sum(t) +
        (M - 1) max(t) (the slowest stage sets the pace), of which stage k is
        busy M t_k; equal costs give (K - 1) / (M + K - 1).
        """
        pass_time = sum(stage_costs) + (self.micro_batches - 1) * max(stage_costs)
        return 1 - self.micro_batches * sum(stage_costs) / (self.num_stages * pass_time)


@dataclasses.dataclass
class _Built:
    config: Config
    grid: list            # one row of stage devices per tower
    trainer: towers.TowerTrainer
    mode: mode_lib.Mode      # what harness times
    op_devices: dict      # node name -> device, from the compiled step's graphs


def run_pipeline_benchmark(model_name, stages, micro_batches, devices, output_dir, *,
                           schedule_name="gpipe", num_towers=1, global_batch_size=256, steps=30,
                           warmup_steps=3, rounds=5, trace_steps=3, timeline=(4, 4),
                           input_shape=(32, 32, 3), seed=0, tied=None):
    """Times, traces and weighs every (K, M); writes the outputs; returns the results dict.

    Args:
      model_name: one of towers.models.MODELS.
      stages, micro_batches: the K and M values; every pair is one configuration.
      devices: at least num_towers * max K device names; tower t's stage k is
        devices[t * K + k].
      output_dir: where results.json, results.md, timeline.png and trace/ go.
      schedule_name: the schedule of the sweep, one of towers.schedule.SCHEDULES.
      num_towers: data-parallel towers, each a pipeline of K stage devices.
      global_batch_size: examples per step, split over towers, then micro-batches.
      steps, warmup_steps, rounds: timed steps per configuration (in `rounds`
        interleaved blocks) and untimed steps before them.
      trace_steps: steps traced per configuration for the bubble and the boxes.
      timeline: (K, M) drawn in timeline.png, under every schedule (added to the
        configurations if not among them).
      input_shape: (H, W, C) of the synthetic images; seed: weights and data.
      tied: keyword arguments of tied_table.run_tied_table_benchmark (keras_hub's GPT-2,
        its tied table read in two stages, on devices[:2]); None skips it.
    """
    configs = _configs(stages, micro_batches, schedule_name, timeline)
    _check_arguments(configs, devices, num_towers, global_batch_size, steps, rounds, trace_steps)
    # Before the sweep: once its graphs were collected and its steps profiled, tfdbg no
    # longer records the sizes of some tensors a later step sends (transfers.py raises).
    tied_results = None if tied is None else tied_table.run_tied_table_benchmark(
        devices[:2], **tied, steps=steps, rounds=rounds, seed=seed)
    rng = np.random.default_rng(seed)
    with tf.device(devices[0]):
        batch = (tf.constant(rng.uniform(size=(global_batch_size, *input_shape)), tf.float32),
                 tf.constant(rng.integers(0, NUM_CLASSES, size=global_batch_size), tf.int32))
    trace_dir = os.path.join(output_dir, "trace")
    built = [_build(config, model_name, input_shape, devices, num_towers, batch, seed,
                    warmup_steps, os.path.join(trace_dir, config.name)) for config in configs]
    logging.info("%d configurations built; timing %d steps each in %d rounds",
                 len(built), steps, rounds)
    times = measure.time_interleaved([b.mode for b in built], steps, rounds, seed)
    rows = [{**_describe(b), **_timing(t, global_batch_size),
             **_profile(b, trace_steps, os.path.join(trace_dir, b.config.name)),
             **_variable_bytes(b)} for b, t in zip(built, times)]
    results = {
        "config": {"model": model_name, "stages": list(stages), "micro_batches": list(micro_batches),
                   "schedule": schedule_name, "num_towers": num_towers,
                   "global_batch_size": global_batch_size, "steps": steps,
                   "warmup_steps": warmup_steps, "rounds": rounds, "trace_steps": trace_steps,
                   "timeline": list(timeline), "input_shape": list(input_shape),
                   "num_classes": NUM_CLASSES, "seed": seed, "optimizer": "sgd",
                   "learning_rate": mode_lib.LEARNING_RATE, "momentum": mode_lib.MOMENTUM},
        "machine": measure.machine_info(devices),
        "rows": rows,
    }
    if tied_results is not None:
        results["tied_table"] = tied_results
    _write_all(results, output_dir)
    return results


def _configs(stages, micro_batches, schedule_name, timeline):
    sweep = [Config(k, m, schedule_name) for k in stages for m in micro_batches]
    drawn = [Config(*timeline, name) for name in schedule.SCHEDULES]
    return list(dict.fromkeys(sweep + drawn))


def _build(config, model_name, input_shape, devices, num_towers, batch, seed, warmup_steps,
           log_dir):
    """A trainer for `config`, its first step compiled (with its graphs recorded) and warmed up."""
    k = config.num_stages
    grid = [list(devices[t * k:(t + 1) * k]) for t in range(num_towers)]
    with tf.device(grid[0][0]):
        model = models_lib.build_model(model_name, input_shape, NUM_CLASSES, seed=seed)
    cuts = models_lib.pipeline_cuts(model, k) or None  # one stage: no cuts, plain towers
    trainer = towers.TowerTrainer(
        model, mode_lib.make_loss(), mode_lib.make_optimizer(),
        devices=grid if cuts else [row[0] for row in grid], pipeline_cuts=cuts,
        micro_batches=config.micro_batches, pipeline_schedule=config.schedule)

    def step():
        return trainer.train_step(batch)["loss"]  # a Python float: one host sync per step

    logging.info("building %s", config.name)
    op_devices = pipeline_profile.record_op_devices(step, os.path.join(log_dir, "graph"))
    mode = mode_lib.Mode(config.name, num_towers, step, model)
    mode.run(warmup_steps)
    return _Built(config, grid, trainer, mode, op_devices)


def _describe(built):
    config, model, cuts = built.config, built.trainer.model, built.trainer.pipeline_cuts or []
    # Keras numbers layer names per process (conv2d_3, ...), so cuts are also given by position.
    cut_positions = [model.layers.index(model.get_layer(cut)) for cut in cuts]
    costs = _stage_costs(model, cut_positions)
    return {"name": config.name, "num_stages": config.num_stages,
            "micro_batches": config.micro_batches, "schedule": config.schedule,
            "num_towers": len(built.grid), "pipeline_cuts": cuts, "cut_positions": cut_positions,
            "cut_layer_types": [type(model.layers[p]).__name__ for p in cut_positions],
            "devices": built.grid, "stage_cost_shares": [cost / sum(costs) for cost in costs],
            "bubble_formula": config.bubble_formula,
            "bubble_formula_uneven": config.uneven_bubble_formula(costs)}


def _stage_costs(model, cut_positions):
    """Estimated compute of each stage: towers.models.layer_compute of its layers, the
    estimate pipeline_cuts balances (a cut at position p ends its stage with layer p)."""
    costs = [0] * (len(cut_positions) + 1)
    for position, layer in enumerate(model.layers):
        if not isinstance(layer, keras.layers.InputLayer):
            costs[sum(cut < position for cut in cut_positions)] += models_lib.layer_compute(layer)
    return costs


def _timing(times, global_batch_size):
    stats = measure.step_time_stats(times)
    return {**stats, "examples_per_sec": global_batch_size / (stats["median_ms"] / 1e3)}


def _profile(built, trace_steps, log_dir):
    """Idle share per device (mean over the traced steps) and the boxes of the median step."""
    try:
        space = traces.load_xspace(
            traces.trace_steps(lambda: built.mode.run(1), trace_steps, log_dir))
    except (ImportError, OSError, tf.errors.OpError) as error:
        logging.warning("no trace of %s: %s", built.config.name, error)
        return {"trace_error": f"{type(error).__name__}: {error}"}
    traces.write_chrome_trace(space, os.path.join(log_dir, "trace.json"))
    steps = [ops for ops in pipeline_profile.traced_steps(space, built.op_devices) if ops]
    if not steps:
        return {"trace_error": f"the trace under {log_dir} holds no op of a traced step"}
    devices = [device for row in built.grid for device in row]
    per_step = [pipeline_profile.idle_shares(ops, devices) for ops in steps]
    idle = {device: statistics.fmean(s[device] for s in per_step) for device in devices}
    spans = [pipeline_profile.step_span_ps(ops) for ops in steps]
    durations_ms = [(last - first) / 1e9 for first, last in spans]
    median_step = steps[durations_ms.index(statistics.median_low(durations_ms))]
    return {"idle_share_per_device": idle, "bubble_measured": statistics.fmean(idle.values()),
            "traced_step_ms": statistics.median(durations_ms),
            "unattributed_op_share": max(map(pipeline_profile.unattributed_share, steps)),
            "boxes": pipeline_profile.micro_batch_boxes(median_step, built.grid),
            "trace_dir": log_dir}


def _variable_bytes(built):
    """Bytes of the model's variables and the optimizer's, per device they live on."""
    def size(variable):
        return int(np.prod(variable.shape)) * tf.as_dtype(variable.dtype).size

    per_device = {device: 0 for row in built.grid for device in row}
    model, optimizer = built.trainer.model, built.trainer.optimizer
    for variable in model.variables + optimizer.variables:
        device = towers.devices.canonical_name(variable.value.device)
        per_device[device] = per_device.get(device, 0) + size(variable)
    model_bytes = sum(map(size, model.variables))
    total = sum(per_device.values())
    return {"bytes_per_device": per_device, "model_bytes": model_bytes,
            "optimizer_bytes": total - model_bytes, "total_bytes": total,
            "ideal_bytes_per_stage": total / built.config.num_stages}


def _check_arguments(configs, devices, num_towers, global_batch_size, steps, rounds, trace_steps):
    """Fails early, with the values."""
    if min(min(c.num_stages, c.micro_batches) for c in configs) < 1 or num_towers < 1:
        raise ValueError(f"stages, micro_batches and num_towers must be >= 1, got "
                         f"{[(c.num_stages, c.micro_batches) for c in configs]}, {num_towers}.")
    needed = num_towers * max(c.num_stages for c in configs)
    if needed > len(devices):
        raise ValueError(f"{num_towers} tower(s) x {needed // num_towers} stages need {needed} "
                         f"devices, but only {len(devices)} are given: {devices}.")
    most = num_towers * max(c.micro_batches for c in configs)
    if global_batch_size < most:
        raise ValueError(f"global_batch_size {global_batch_size} is smaller than {num_towers} "
                         f"tower(s) x {most // num_towers} micro-batches; every micro-batch "
                         "needs an example.")
    if not 1 <= rounds <= steps or trace_steps < 1:
        raise ValueError(f"need 1 <= rounds <= steps and trace_steps >= 1, got rounds={rounds}, "
                         f"steps={steps}, trace_steps={trace_steps}.")


def _write_all(results, output_dir):
    report.write_json_and_markdown(results, markdown(results), output_dir)
    path = os.path.join(output_dir, "timeline.png")
    panels = pipeline_profile.timeline_panels(results["rows"], *results["config"]["timeline"])
    if panels and not pipeline_profile.draw_timeline(panels, path):
        logging.warning("matplotlib is not installed, so %s is not drawn; install it with "
                        "`pip install -e .[bench]`.", path)


def markdown(results):
    """The results as Markdown: set-up, how to read them, one row per configuration."""
    config, machine = results["config"], results["machine"]
    devices = sorted({d for row in results["rows"] for tower in row["devices"] for d in tower})
    physical = measure.physical_device_count(devices)
    lines = [
        "# towers benchmark: pipeline stages", "",
        f"TensorFlow {machine['tensorflow']}, Keras {machine['keras']}, {machine['cpu_count']} "
        f"CPUs, GPUs: {', '.join(machine['physical_gpus']) or 'none'}. Model {config['model']}, "
        f"synthetic input {config['input_shape']}, global batch {config['global_batch_size']}, "
        f"{config['num_towers']} tower(s), SGD with momentum. {config['warmup_steps']} warm-up + "
        f"{config['steps']} timed steps per configuration in {config['rounds']} interleaved "
        f"rounds; bubble and boxes from {config['trace_steps']} traced steps.", "",
        "- step ms: median wall time of a step ± its uncertainty (std / sqrt(n)).",
        "- bubble: per stage device, 1 - (time in which an op ran on it) / (the traced step "
        "from its first op to its last, on any device); `measured` is the mean over the "
        "devices, `idle per device` lists them in stage order. GPipe's (K-1)/(M+K-1) assumes "
        "equal stages and free communication; `formula, these stages` puts in the stages' "
        "estimated compute t_k: 1 - M sum(t) / (K (sum(t) + (M-1) max(t))). Which device ran "
        "an op comes from the compiled step's partition graphs (a CPU trace does not say).",
        "- KiB per device: the model's variables plus the optimizer's (one momentum slot per "
        "weight, the step count and learning rate), by the device they live on; 1/K: their "
        "total over K.",
    ]
    if machine["physical_gpus"]:
        lines.append("- On GPUs the op events read here are the host's kernel launches, not "
                     "the kernels (which are on the GPU planes of the trace): the bubble and "
                     "the boxes are not yet meaningful there.")
    if physical < len(devices):
        lines.append(f"- The {len(devices)} devices stand on {physical} physical device(s): "
                     "stages that overlap in time share the same hardware, so overlap cannot "
                     "shorten a step here.")
    lines += ["", "Stages (towers.models.pipeline_cuts; estimated compute per stage, the "
              "estimate the cuts balance):", ""]
    for row in {r["num_stages"]: r for r in results["rows"]}.values():
        cuts = ", ".join(f"model.layers[{p}] ({t})"
                         for p, t in zip(row["cut_positions"], row["cut_layer_types"]))
        lines.append(f"- K={row['num_stages']}: " + (f"cut after {cuts}; " if cuts else "")
                     + " / ".join(f"{share:.0%}" for share in row["stage_cost_shares"]))
    lines += ["", "| K | M | schedule | step ms ± unc | ex/s | bubble measured | (K-1)/(M+K-1) "
              "| formula, these stages | idle per device | KiB per device | 1/K KiB |",
              "|--:|--:|---|--:|--:|--:|--:|--:|---|---|--:|"]
    for row in results["rows"]:
        idle = row.get("idle_share_per_device")
        lines.append(
            f"| {row['num_stages']} | {row['micro_batches']} | {row['schedule']} | "
            f"{row['median_ms']:.1f} ± {row['uncertainty_ms'] or 0:.1f} | "
            f"{row['examples_per_sec']:.0f} | "
            + (f"{row['bubble_measured']:.2f} | " if idle else "– | ")
            + f"{row['bubble_formula']:.2f} | {row['bubble_formula_uneven']:.2f} | "
            + (" / ".join(f"{v:.2f}" for v in idle.values()) if idle else row["trace_error"])
            + f" | {' / '.join(f'{b / 1024:.0f}' for b in row['bytes_per_device'].values())} | "
            f"{row['ideal_bytes_per_stage'] / 1024:.0f} |")
    if "tied_table" in results:
        lines += tied_table.markdown(results["tied_table"])
    return "\n".join(lines) + "\n"
