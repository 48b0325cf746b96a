"""What a checkpoint folder holds, read before anything is restored or written: never a
silent step 0.

tf.train.CheckpointManager finds checkpoints through the folder's index, the
`checkpoint` file. An index that is there but unreadable (truncated, garbage,
empty) would make it find none, and training would start again from step 0 and
overwrite the checkpoints: such a folder is refused in one line. An index that is
missing, beside complete checkpoints (`ckpt-N.index` is written last of a
checkpoint's files), is what a run killed between its first checkpoint and the
index's first write leaves: the newest readable of them is restored, and a log line
says so. A folder whose checkpoints are all unreadable is refused.
"""

import os
import re

import tensorflow as tf

INDEX_FILE = "checkpoint"  # tf.train.CheckpointManager's index of the checkpoints
PREFIX = "ckpt"  # its checkpoints' names: ckpt-1, ckpt-2, ...
_NAMED = re.compile(rf"^{PREFIX}-(\d+)\.index$")
_START_OVER = ("delete the folder or give another checkpoint directory to start over. "
               "Nothing was restored or overwritten.")


def check_index(directory):
    """Raises ValueError, in one line, when `directory` has an index that names no
    checkpoint (truncated, garbage or empty)."""
    index = os.path.join(directory, INDEX_FILE)
    if not os.path.isfile(index):
        return
    try:
        state = tf.train.get_checkpoint_state(directory)  # None for text it cannot parse
    except (ValueError, tf.errors.OpError):
        state = None
    if state is not None and state.model_checkpoint_path:
        return
    files = unindexed(directory)
    named = ", ".join(os.path.basename(path) for path in files) or "no checkpoint files"
    newest = os.path.basename(files[-1]) if files else None
    repair = (f"to resume from {newest}, write the line 'model_checkpoint_path: \"{newest}\"' "
              "into it; " if newest else "")
    raise ValueError(f"the checkpoint index {index} is unreadable (truncated or not an index), "
                     f"beside {named}; {repair}or {_START_OVER}")


def unindexed(directory):
    """The complete checkpoints in `directory` by their files alone (each a path prefix
    whose .index file exists), oldest first."""
    if not os.path.isdir(directory):
        return []
    numbers = sorted(int(match.group(1)) for match in map(_NAMED.match, os.listdir(directory))
                     if match)
    return [os.path.join(directory, f"{PREFIX}-{number}") for number in numbers]


def none_readable(directory, paths, reason):
    """The ValueError for a folder whose checkpoints `paths` are all unreadable (`reason`:
    the newest's error, in a phrase)."""
    named = ", ".join(os.path.basename(path) for path in paths)
    return ValueError(f"{directory} holds checkpoints ({named}) and none of them is readable "
                      f"({os.path.basename(paths[-1])}: {reason}); put back readable files, "
                      f"or {_START_OVER}")
