"""One live writer per checkpoint folder.

Two runs writing one folder would overwrite each other's checkpoints, and a later
resume would continue from the other run's weights. So the process that writes
a folder holds an advisory lock on a file in it (flock): a second process's
`acquire` is refused in one line while the first lives. The kernel releases the
lock when the process ends, however it ends (SIGKILL, a lost machine), so a
killed run never leaves the folder locked. The file is made once and never written
(its times stay those of the first run), so a refused run changes nothing in the
folder; `fuser` names the process that holds it.

In one process the lock is taken once per folder and kept while any Checkpointer
that took it lives: fitting again in a notebook, or after a refused fit whose
traceback still holds the old Checkpointer, is not a second run.

This module imports nothing of towers (tests load it in a bare subprocess).
"""

import os
import weakref

try:
    import fcntl
except ImportError:  # not on POSIX: no lock (docs/api.md section 6 says so)
    fcntl = None

LOCK_FILE = ".writer.lock"  # beside the checkpoints

_held = {}  # {real path of a folder: [its open lock file, Checkpointers holding it]}


def acquire(directory, owner=None):
    """Takes `directory`'s lock for this process until `owner` (any object) is
    collected, or for the life of the process when `owner` is None.

    Raises:
      ValueError: another live process holds it; one line naming that process.
    """
    if fcntl is None:
        return
    key = os.path.realpath(directory)
    if key not in _held:
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, LOCK_FILE)
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o644))
        # Held open for the run's life, for reading: flock needs no more, and a file open
        # for writing would keep its disk from being remounted read-only or unmounted.
        lock = open(path)  # noqa: SIM115
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # BlockingIOError: held by a live process
            lock.close()
            raise ValueError(
                f"another run is writing checkpoints to {directory}: a live process holds "
                f"its lock {path} (`fuser {path}` names it); wait for it to end, or give "
                "this run another checkpoint directory. Nothing was restored or written."
            ) from None
        _held[key] = [lock, 0]
    _held[key][1] += 1
    if owner is not None:
        weakref.finalize(owner, _release, key)


def _release(key):
    held = _held.get(key)
    if held is None:
        return
    held[1] -= 1
    if held[1] <= 0:
        del _held[key]
        held[0].close()  # closing the file releases the flock
