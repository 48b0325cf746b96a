"""Starts N towers-train workers on this machine, a cluster on 127.0.0.1 ports.

    python towers/multi_worker/launch.py N [towers-train flags]    (scripts/launch_local_workers)

Run as a file it needs no TensorFlow (python -m towers.multi_worker.launch works too, but
importing the package loads it). Every worker runs `python -m towers.train`
with the same flags plus its own --worker_hosts and --task_index; its output
lines are prefixed "[worker i]". On a machine with GPUs each worker gets its
own equal share of them (CUDA_VISIBLE_DEVICES). The launcher waits for all of
them and exits 0 only if every worker did (75, as a worker does, when every
worker stopped on SIGTERM/SIGINT; a signal to the launcher is passed on to
every worker as SIGTERM). A worker that fails makes the
others stop by themselves (within --peer_timeout_s); any still running
GRACE_S seconds after the first failure are terminated. Rerunning the same
command with --checkpoint_dir resumes every worker.
"""

import os
import signal
import socket
import subprocess
import sys
import threading
import time

GRACE_S = 120.0
PREEMPTED_EXIT_STATUS = 75  # towers.train's, repeated: this file runs without TensorFlow
USAGE = "usage: scripts/launch_local_workers NUM_WORKERS [towers-train flags]"


def main(argv):
    if len(argv) < 2 or not argv[1].isdigit() or int(argv[1]) < 1:
        print(f"{USAGE}\nlaunch: error: NUM_WORKERS must be a positive integer, got "
              f"{argv[1] if len(argv) > 1 else 'nothing'}.", file=sys.stderr)
        return 2
    num_workers, train_flags = int(argv[1]), argv[2:]
    taken = [f for f in train_flags if f.startswith(("--worker_hosts", "--task_index"))]
    if taken:
        print(f"launch: error: {taken[0]} is set by the launcher for each worker; remove it.",
              file=sys.stderr)
        return 2
    on_cpu = "--device_type=cpu" in train_flags or ("--device_type", "cpu") in zip(
        train_flags, train_flags[1:])
    try:
        gpu_shares = [gpu_share(i, num_workers, 0 if on_cpu else _count_gpus())
                      for i in range(num_workers)]
    except ValueError as error:
        print(f"launch: error: {error}", file=sys.stderr)
        return 2
    hosts = ",".join(f"127.0.0.1:{port}" for port in free_ports(num_workers))
    workers = []
    for index in range(num_workers):
        command = [sys.executable, "-m", "towers.train", *train_flags,
                   f"--worker_hosts={hosts}", f"--task_index={index}"]
        environment = dict(os.environ)
        if gpu_shares[index] is not None:
            environment["CUDA_VISIBLE_DEVICES"] = gpu_shares[index]
        workers.append(subprocess.Popen(command, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, errors="replace",
                                        env=environment))
    for index, worker in enumerate(workers):  # these lines first, then the workers' output
        print(f"launch: worker {index} pid {worker.pid} on {hosts.split(',')[index]}",
              flush=True)
    for index, worker in enumerate(workers):
        threading.Thread(target=_relay, args=(index, worker.stdout), daemon=True).start()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: _terminate(workers))
    codes = _wait(workers)
    failed = [i for i, code in enumerate(codes) if code != 0]
    for i in failed:
        print(f"launch: worker {i} exited with status {codes[i]}", file=sys.stderr, flush=True)
    print(f"launch: {num_workers - len(failed)} of {num_workers} workers succeeded", flush=True)
    if failed and all(code == PREEMPTED_EXIT_STATUS for code in codes):
        return PREEMPTED_EXIT_STATUS  # all stopped on a signal, checkpointed: rerun to resume
    return 1 if failed else 0


def gpu_share(index, num_workers, num_gpus):
    """CUDA_VISIBLE_DEVICES for worker `index`, e.g. "2,3"; None = leave it as it is.

    Each worker takes an equal share; GPUs are not shared between workers
    (each would claim most of a GPU's memory for its towers).
    """
    if num_gpus == 0 or "CUDA_VISIBLE_DEVICES" in os.environ:
        return None
    if num_gpus < num_workers:
        raise ValueError(
            f"{num_workers} workers but {num_gpus} GPU(s): workers cannot share a GPU here. "
            f"Start at most {num_gpus} workers (each splits its GPU into --num_towers "
            "towers), or add --device_type=cpu.")
    share = num_gpus // num_workers
    return ",".join(str(g) for g in range(index * share, (index + 1) * share))


def _count_gpus():
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                                 timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in listing.stdout.splitlines())


def free_ports(count):
    """`count` distinct ports that are free on this machine now."""
    sockets = []
    try:
        for _ in range(count):
            probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            probe.bind(("127.0.0.1", 0))
            sockets.append(probe)
        return [probe.getsockname()[1] for probe in sockets]
    finally:
        for probe in sockets:
            probe.close()


def _relay(index, stream):
    for line in stream:
        sys.stdout.write(f"[worker {index}] {line}")
        sys.stdout.flush()


def _wait(workers):
    """Exit codes of all workers; stragglers are terminated GRACE_S after a failure."""
    first_failure = None
    while any(w.poll() is None for w in workers):
        if first_failure is None and any(w.poll() not in (None, 0) for w in workers):
            first_failure = time.monotonic()
        if first_failure is not None and time.monotonic() - first_failure > GRACE_S:
            print(f"launch: workers still running {GRACE_S:.0f} s after a failure; "
                  "terminating them", file=sys.stderr, flush=True)
            _terminate(workers)
        time.sleep(0.2)
    return [w.returncode for w in workers]


def _terminate(workers):
    for worker in workers:
        if worker.poll() is None:
            worker.terminate()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
