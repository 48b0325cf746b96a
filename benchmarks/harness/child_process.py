"""Runs one benchmark configuration in a fresh Python process, for an honest peak memory.

Peak resident memory (ru_maxrss) only ever grows within a process, so each
configuration gets its own: the parent passes a JSON config on the command
line, the child prints one JSON line of results and exits.
"""

import json
import resource
import subprocess
import sys

RESULT_PREFIX = "RESULT "


def run_child(script, config, timeout_s=600):
    """Runs `python script --child_config=JSON`; returns the dict the child reported."""
    return child_result(start_child(script, config), timeout_s)


def start_child(script, config):
    """Starts `python script --child_config=JSON` (for children that must run together)."""
    return subprocess.Popen([sys.executable, script, f"--child_config={json.dumps(config)}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def child_result(child, timeout_s=600):
    """Waits for a started child; returns the dict it reported."""
    stdout, stderr = child.communicate(timeout=timeout_s)
    for line in stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    raise RuntimeError(f"{' '.join(child.args[:2])} {child.args[2]} failed "
                       f"(exit {child.returncode}):\n{stderr[-3000:]}")


def report(result):
    """Child side: prints `result` for the parent to read."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def peak_rss_mb():
    """This process's peak resident memory so far, in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def time_steps(step, steps, warmup_steps=1, after_warmup=None):
    """Runs `step()` warmup_steps times, then `after_warmup()` (None: nothing), then times
    `steps` calls.

    Returns:
      dict: setup_mb (peak MiB before the first call), peak_mb, step_mb (their
      difference: what running the step needed), and the step-time statistics
      of benchmarks.measure.step_time_stats (milliseconds).
    """
    from benchmarks.harness import measure
    setup_mb = peak_rss_mb()
    for _ in range(warmup_steps):
        step()
    if after_warmup is not None:
        after_warmup()
    times = measure.wall_times(step, steps)
    peak_mb = peak_rss_mb()
    return {"setup_mb": setup_mb, "peak_mb": peak_mb, "step_mb": peak_mb - setup_mb,
            **measure.step_time_stats(times)}
