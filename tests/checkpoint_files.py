"""Reading what a towers-train run left in its --checkpoint_dir."""

import tensorflow as tf


def checkpoint_values(directory):
    """Every tensor of the newest checkpoint in `directory`, by name."""
    reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(directory))
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()
            if not name.startswith("save_counter")}


def position(values):
    """(epoch, batch_in_epoch): where the checkpointed run goes on."""
    return tuple(int(values[f"{name}/.ATTRIBUTES/VARIABLE_VALUE"])
                 for name in ("epoch", "batch_in_epoch"))
