"""run_benchmark: every mode on the same batch, timed interleaved, compared with `plain`.

For each model: build every mode for every tower count, warm each one up, run
one more untimed step of each once all are built, then for each round time a
block of steps of every mode in turn (the order shuffled per round), so that drift of the machine (clocks, heat, other jobs) hits all
modes alike. Then compare the final weights with plain's, and trace a few
steps of the default towers mode to split its step into phases.
"""

import os
import re

import numpy as np
import tensorflow as tf
from absl import logging

import towers
from benchmarks.harness import measure, mode as mode_lib, model_setup, modes as modes_lib, phases
from benchmarks.harness import report, traces

NUM_CLASSES = 10  # of the built-in models and FUNCTIONs unless told
BASELINE = "plain"
TRACED_MODE = "towers"


def run_benchmark(models, num_towers, global_batch_size, steps, *, warmup_steps=5, rounds=5,
                  devices=None, modes=None, input_shape=(32, 32, 3), num_classes=NUM_CLASSES,
                  seed=0, output_dir=None, trace_steps=3, trace_dir=None):
    """Benchmarks every mode on every model and tower count; returns the results dict.

    Args:
      models: models in the forms towers-train --model takes (harness/model_setup.py):
        built-in names from towers.models.MODELS, "PACKAGE.MODULE:FUNCTION" or
        "PATH.keras", e.g. ["mlp", "examples.my_model:small_cnn"]. Every one is
        loaded and checked before any is timed.
      num_towers: tower counts, e.g. [1, 2, 4]; each uses the first N of `devices`.
      global_batch_size: examples per step, the same for every mode and N.
      steps: timed steps per mode, split over `rounds` interleaved blocks.
      warmup_steps: untimed steps per mode first (tracing, allocation).
      rounds: interleaved timing rounds (<= steps).
      devices: tower device names; None = the configured / visible ones.
      modes: names from modes.MODES; None = all. plain always runs.
      input_shape: one example's shape, (H, W, C) for the built-in models, and
        num_classes the classes, for built-ins and FUNCTIONs (a .keras file has its own).
      seed: seeds the weights (identical in every mode) and the synthetic batch.
      output_dir: if given, results.json, results.md and results.png go there.
      trace_steps: steps of the towers mode traced with tf.profiler per N; 0 = none.
      trace_dir: where traces go; None = output_dir/trace (no trace without either).

    Returns:
      dict with "config", "machine", "matmul_flops_per_sec" and per model, under
      its name as given, {"input": what its synthetic batch is (model_setup.setup_for),
      "flops_per_step", "rows": one per mode and N, "not_run", "phases"}.

    Raises:
      model_setup.ModelError: a model that does not load or does not fit (one line).
    """
    devices = list(devices or towers.devices.default_devices())
    modes = _check_arguments(models, num_towers, global_batch_size, steps, rounds, devices, modes)
    if trace_dir is None and output_dir:
        trace_dir = os.path.join(output_dir, "trace")
    setups = {name: model_setup.setup_for(name, global_batch_size, input_shape, num_classes, seed)
              for name in models}
    peak = measure.matmul_flops_per_sec(devices[0])
    results = {
        "config": {"models": list(models), "num_towers": list(num_towers),
                   "global_batch_size": global_batch_size, "steps": steps,
                   "warmup_steps": warmup_steps, "rounds": rounds, "modes": list(modes),
                   "input_shape": list(input_shape), "num_classes": num_classes, "seed": seed,
                   "learning_rate": mode_lib.LEARNING_RATE, "momentum": mode_lib.MOMENTUM},
        "machine": measure.machine_info(devices),
        "matmul_flops_per_sec": peak,
        "models": {},
    }
    for name, (setup, description) in setups.items():
        logging.info("benchmarking %s", name)
        results["models"][name] = {"input": description, **_benchmark_model(
            name, setup, num_towers, steps, warmup_steps, rounds, devices, modes, seed, peak,
            trace_steps if trace_dir else 0, trace_dir)}
    if output_dir:
        report.write_all(results, output_dir)
    return results


def _benchmark_model(name, setup, num_towers, steps, warmup_steps, rounds, devices, modes, seed,
                     peak, trace_steps, trace_dir):
    global_batch_size = setup.global_batch_size
    built, not_run = _build_and_warm_up(setup, devices, num_towers, modes, warmup_steps)
    logging.info("%s: %d modes built and warmed up, timing %d steps each in %d rounds",
                 name, len(built), steps, rounds)
    times = measure.time_interleaved(built, steps, rounds, seed)
    reference = built[0].weights()  # plain's
    flops = measure.training_flops_per_example(built[0].model) * global_batch_size
    rows = [_row(mode, times[i], reference, flops, peak, global_batch_size, devices)
            for i, mode in enumerate(built)]
    _add_ratios(rows)
    traced = {} if not trace_steps else {
        str(mode.num_towers): _trace(mode, trace_steps, trace_dir, name)
        for mode in built if mode.name == TRACED_MODE}
    return {"flops_per_step": flops, "rows": rows, "not_run": not_run, "phases": traced}


def _build_and_warm_up(setup, devices, num_towers, modes, warmup_steps):
    """Every wanted (mode, N), built and warmed up; returns (modes, not_run records).

    plain comes first. A mode the library does not support, or one that fails to
    build or warm up, is left out and recorded with its error; plain failing stops all.
    """
    wanted = [(BASELINE, 1)] + [(m, 1) for m in modes_lib.SINGLE_DEVICE_MODES
                                if m in modes and m != BASELINE]
    wanted += [(m, n) for n in num_towers for m in modes_lib.MULTI_DEVICE_MODES if m in modes]
    built, not_run = [], []
    for mode_name, n in wanted:
        logging.info("building %s on %d tower(s)", mode_name, n)
        try:
            mode = modes_lib.build(mode_name, setup, devices[:n])
            mode.run(warmup_steps)
        except mode_lib.Unsupported as error:
            not_run.append({"mode": mode_name, "num_towers": n, "status": "unsupported",
                            "message": str(error)})
            continue
        except Exception as error:  # noqa: BLE001 - one broken mode must not end the run
            if mode_name == BASELINE:
                raise
            logging.warning("mode %s on %d towers failed: %s", mode_name, n, error)
            not_run.append({"mode": mode_name, "num_towers": n, "status": "failed",
                            "message": f"{type(error).__name__}: {_first_line(error)}"})
            continue
        built.append(mode)
    # A mode's first call after the others were built is slow once (tens of ms on CPU, in
    # every mode): this untimed one keeps it out of the first round, where a mode of 10
    # steps per call, with a sample per call, would take it into its median.
    for mode in built:
        mode.run(1)
    return built, not_run


def _row(mode, times, reference, flops, peak, global_batch_size, devices):
    stats = measure.step_time_stats(times)
    seconds = stats["median_ms"] / 1e3
    achieved = flops / seconds
    ceiling = peak * measure.physical_device_count(devices[:mode.num_towers])
    return {"mode": mode.name, "num_towers": mode.num_towers, **stats,
            "examples_per_sec": global_batch_size / seconds,
            "flops_per_sec": achieved, "fraction_of_matmul_peak": achieved / ceiling,
            "max_abs_weight_diff": max(float(np.max(np.abs(a - b)))
                                       for a, b in zip(mode.weights(), reference)),
            **mode.info}


def _add_ratios(rows):
    """Speedup over plain, efficiency (speedup / N), and speed relative to mirrored_custom
    and to independent at the same N (reference time / this time: > 1 is faster)."""
    plain = next(r["median_ms"] for r in rows if r["mode"] == BASELINE)
    by_mode = {(r["mode"], r["num_towers"]): r["median_ms"] for r in rows}
    for row in rows:
        row["speedup"] = plain / row["median_ms"]
        row["efficiency"] = row["speedup"] / row["num_towers"]
        for reference in ("mirrored_custom", "independent"):
            other = by_mode.get((reference, row["num_towers"]))
            row[f"vs_{reference}"] = other / row["median_ms"] if other else None


def _trace(mode, num_steps, trace_dir, model_name):
    """Traces `num_steps` steps of `mode`; returns its phase table and trace paths."""
    # A model named by a path or PACKAGE.MODULE:FUNCTION: one folder, no ":".
    folder = re.sub(r"[^\w.-]+", "_", report.short_name(model_name))
    log_dir = os.path.join(trace_dir, f"{folder}_{mode.num_towers}towers")
    try:
        space = traces.load_xspace(traces.trace_steps(lambda: mode.run(1), num_steps, log_dir))
    except (ImportError, OSError, tf.errors.OpError) as error:
        logging.warning("no phase breakdown for %s on %d towers: %s", model_name,
                        mode.num_towers, error)
        return {"error": _first_line(error)}
    chrome_trace = os.path.join(log_dir, "trace.json")
    traces.write_chrome_trace(space, chrome_trace)
    return {**phases.phase_table(space, num_steps), "chrome_trace": chrome_trace,
            "profile_dir": log_dir}


def _check_arguments(models, num_towers, global_batch_size, steps, rounds, devices, modes):
    """Fails early with the values; returns the modes to run."""
    if not models:
        raise ValueError("models must name at least one model.")
    if not num_towers or min(num_towers) < 1:
        raise ValueError(f"num_towers must be positive tower counts, got {num_towers}.")
    if max(num_towers) > len(devices):
        raise ValueError(f"num_towers {max(num_towers)} needs {max(num_towers)} devices, but only "
                         f"{len(devices)} are given: {devices}.")
    if global_batch_size < max(num_towers):
        raise ValueError(f"global_batch_size {global_batch_size} is smaller than "
                         f"{max(num_towers)} towers; every tower needs an example.")
    if not 1 <= rounds <= steps:
        raise ValueError(f"need 1 <= rounds <= steps, got rounds={rounds}, steps={steps}.")
    modes = list(modes_lib.MODES if modes is None else modes)
    unknown = [m for m in modes if m not in modes_lib.MODES]
    if unknown:
        raise ValueError(f"unknown modes {unknown}; choose from {modes_lib.MODES}.")
    return modes


def _first_line(error):
    text = str(getattr(error, "message", None) or error).strip()
    return text.splitlines()[0] if text else type(error).__name__
