"""The benchmark's outputs: results.json (everything), results.md (tables), results.png (plots)."""

import json
import os

from absl import logging

NOTES = """\
- Every mode trains the same model (same seed, same initial weights) with SGD on the
  same synthetic global batch, made once and reused every step; each step fetches its
  loss as a Python float, so every mode pays one host sync per step, except
  keras_fit_xla_spe10, towers_spe10..., towers_fit_spe10 (fit / TowerTrainer.train_steps
  / TowerTrainer.fit with steps_per_execution=10) and bare_loop: one per 10 steps; each
  of their samples is one call's time / its steps, so their n counts calls.
- bare... is the floor: the seven steps written plainly without the library
  (benchmarks/harness/bare.py: split, copy the weights, forward and backward per tower, average
  on the main device, a finite check, apply), so a towers row's time over bare's at the
  same N is what the library adds. bare_loop runs 10 of those steps per call over
  tf.data (compare towers_spe10), bare_xla each tower's forward and backward with XLA
  (compare towers_xla). Its new BatchNorm statistics are tower 0's, not the average.
- plain... and keras_fit... run on one device; speedup = plain's time / this time at
  the same global batch; efficiency = speedup / N; x mirrored and x independent = their
  time / this time at the same N (> 1: this mode is faster).
- independent exchanges no gradients (each tower trains its own copy on its shard):
  the hardware's upper bound. Its max |Δw| (tower 0's copy against plain) is expected
  to be far from 0. Keras fit may differ from plain by float32 round-off. With
  BatchNorm (resnet) each tower, like each MirroredStrategy replica, normalises with
  its own shard's statistics, so there Δw > 0 for N > 1 is expected too.
- towers_fit and towers_fit_spe10 train with TowerTrainer.fit, timed per call by a
  callback; against towers_tfdata and towers_spe10 (the same steps through train_step /
  train_steps) they show what fit's outer loop costs per step.
- Keras fit modes and towers_tfdata/_staged/_spe10.../_fit... read the batch through tf.data
  (_staged: split in the input pipeline, each shard staged on its tower's device ahead
  of the step, as TowerTrainer.fit does); the others from tensors already on their
  devices. Only modes named *_xla use XLA: plain_xla and
  keras_fit_xla... compile the whole step; towers_xla each tower's forward and backward
  (split, gather, average and apply run without XLA).
- Logical CPU devices share the same cores, so on a CPU more towers cannot add
  compute: CPU numbers show each mode's overhead, not scaling.
- % peak: achieved FLOP/s (3 x forward FLOPs of the Dense/Conv layers, counted
  analytically) over the best float32 matmul FLOP/s of one device, times the number
  of physical devices used.
"""


def write_all(results, output_dir):
    """Writes results.json, results.md and results.png (when matplotlib is there) to output_dir."""
    write_json_and_markdown(results, markdown(results), output_dir)
    write_plot(results, os.path.join(output_dir, "results.png"))


def write_json_and_markdown(results, markdown_text, output_dir):
    """Writes `results` as output_dir/results.json and `markdown_text` as results.md."""
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    with open(os.path.join(output_dir, "results.md"), "w") as f:
        f.write(markdown_text)


def markdown(results):
    """All results as Markdown: machine, one table per model, not-run modes, phases."""
    config, machine = results["config"], results["machine"]
    lines = ["# towers benchmark: compare_strategies", "",
             f"TensorFlow {machine['tensorflow']}, Keras {machine['keras']}, "
             f"{machine['cpu_count']} CPUs, GPUs: {', '.join(machine['physical_gpus']) or 'none'}; "
             f"towers on {', '.join(machine['tower_devices'])}.",
             f"Global batch {config['global_batch_size']}, "
             f"{config['warmup_steps']} warm-up + {config['steps']} timed steps per mode in "
             f"{config['rounds']} interleaved rounds. Matmul peak of one device: "
             f"{results['matmul_flops_per_sec'] / 1e9:.1f} GFLOP/s.", "", NOTES]
    for name, model in results["models"].items():
        lines += model_markdown(name, model)
    return "\n".join(lines) + "\n"


def model_markdown(name, model):
    """One model's table, then the modes not run and the towers phase tables."""
    lines = [f"## {name}", "", input_line(model["input"]),
             f"{model['flops_per_step'] / 1e9:.3g} GFLOP per training step (analytic, 3 x forward).",
             "", "| mode | N | median ms ± unc | jitter ms | ex/s | speedup | efficiency "
             "| × mirrored | × independent | % peak | max abs Δw |",
             "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for row in sorted(model["rows"], key=lambda r: (r["num_towers"], r["mode"] != "plain")):
        lines.append(
            f"| {row['mode']} | {row['num_towers']} | {row['median_ms']:.2f} ± "
            f"{_number(row['uncertainty_ms'], '.2f')} | {row['jitter_ms']:.2f} | "
            f"{row['examples_per_sec']:.0f} | {row['speedup']:.2f} | {row['efficiency']:.2f} | "
            f"{_number(row['vs_mirrored_custom'], '.2f')} | {_number(row['vs_independent'], '.2f')} | "
            f"{100 * row['fraction_of_matmul_peak']:.1f} | {row['max_abs_weight_diff']:.1e} |")
    lines += _not_run_lines(model["not_run"])
    for num_towers, table in model["phases"].items():
        lines += phase_markdown(name, num_towers, table)
    return lines + [""]


def input_line(description):
    """What a model's synthetic batch is, in one line (see model_setup.setup_for)."""
    return (f"Synthetic input (B, {', '.join(map(str, description['input_shape']))}) "
            f"{description['input_dtype']}, {description['x_values']}; labels: class ids in "
            f"[0, {description['num_classes']}).")


def short_name(model):
    """A model as the plot names it: a .keras path by its file name, anything else as given."""
    return os.path.basename(model)


def phase_markdown(name, num_towers, table):
    """The phase table of one traced towers step."""
    if "error" in table:
        return ["", f"No phase breakdown for towers on {num_towers}: {table['error']}"]
    lines = ["", f"### {name}: one towers step on {num_towers} tower(s), from tf.profiler", "",
             f"Traced step: {table['step_ms']:.2f} ms wall (profiler on). Its TensorFlow ops add "
             f"up to {table['busy_ms']:.2f} ms of busy time over all threads and devices: ops that "
             "run at the same time each count, so busy can exceed wall; far below wall, the "
             "step waits on the host (Python, dispatch, the loss fetch). "
             f"Chrome trace: `{table['chrome_trace']}`.", "",
             "| phase | ops/step | busy ms/step |", "|---|--:|--:|"]
    lines += [f"| {p['phase']} | {p['ops']:.0f} | {p['busy_ms']:.3f} |" for p in table["phases"]]
    return lines


def write_plot(results, path):
    """Step time and scaling efficiency against tower count, per mode, one row per model."""
    try:
        import matplotlib  # pylint: disable=g-import-not-at-top
        matplotlib.use("Agg")
        from matplotlib import pyplot  # pylint: disable=g-import-not-at-top
    except ImportError:
        logging.warning("matplotlib is not installed, so %s is not drawn; install it with "
                        "`pip install matplotlib` (or `pip install -e .[bench]`).", path)
        return
    names = list(results["models"])
    all_modes = dict.fromkeys(r["mode"] for name in names for r in results["models"][name]["rows"])
    palette = matplotlib.colormaps["tab20"].colors  # 20 distinct colours, one per mode
    colors = {mode: palette[i % len(palette)] for i, mode in enumerate(all_modes)}
    figure, axes = pyplot.subplots(len(names), 2, figsize=(13, 4 * len(names)), squeeze=False)
    for (time_axis, efficiency_axis), name in zip(axes, names):
        rows = results["models"][name]["rows"]
        for mode in dict.fromkeys(r["mode"] for r in rows):
            points = sorted((r["num_towers"], r["median_ms"], r["efficiency"])
                            for r in rows if r["mode"] == mode)
            n, ms, efficiency = zip(*points)
            if len(points) == 1:  # a single-device mode: a level line to compare against
                time_axis.axhline(ms[0], linestyle="--", linewidth=1.5, label=mode,
                                  color=colors[mode])
                continue
            time_axis.plot(n, ms, marker="o", label=mode, color=colors[mode])
            efficiency_axis.plot(n, efficiency, marker="o", label=mode, color=colors[mode])
        efficiency_axis.axhline(1.0, linestyle=":", linewidth=1, color="black")
        title = short_name(name)
        time_axis.set(title=f"{title}: step time", xlabel="towers (N)", ylabel="median ms / step")
        efficiency_axis.set(title=f"{title}: scaling efficiency (dotted: ideal)",
                            xlabel="towers (N)", ylabel="speedup over plain / N")
        for axis in (time_axis, efficiency_axis):
            axis.set_xticks(sorted({r["num_towers"] for r in rows}))
            axis.grid(alpha=0.3)
    handles = {label: handle for axis in axes[:, 0]
               for handle, label in zip(*axis.get_legend_handles_labels())}
    figure.legend(handles.values(), handles.keys(), loc="center right", fontsize=8)
    figure.tight_layout(rect=(0, 0, 0.8, 1))  # the right fifth holds the legend
    figure.savefig(path, dpi=100)
    pyplot.close(figure)


def _not_run_lines(not_run):
    """One line per mode not run, with its tower counts and message."""
    grouped = {}
    for record in not_run:
        key = (record["mode"], record["status"], record["message"])
        grouped.setdefault(key, []).append(str(record["num_towers"]))
    if not grouped:
        return []
    return ["", "Not run:"] + [f"- {mode} (N={','.join(ns)}): {status}, {message}"
                               for (mode, status, message), ns in grouped.items()]


def _number(value, spec):
    return "–" if value is None else format(value, spec)
