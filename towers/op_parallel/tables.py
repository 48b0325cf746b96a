"""Embedding look-ups where the table lives: towers send ids and receive rows.

Step 2 gives every tower its own copy of every weight; for an embedding table
that is the whole table, every step, for the few rows a tower looks up. A table
looked up where it lives is not copied: the tower's stateless call maps it to
the variable itself, and its look-up (the `tf.gather` Keras's Embedding does)
reads it with a ResourceGather on the table's device, so only the rows looked
up travel to the tower. The gradient of that read is a tf.IndexedSlices of those
rows, so only rows travel back (sparse_policy="keep").
"""

import functools

import keras
import tensorflow as tf

from towers import compat

LOOKUPS = ("table", "copy")


def tables_of(model, variables):
    """Per entry of `variables` (the model's trainable ones, as they are held), whether it
    is an embedding table (of an Embedding layer, a vocab part's too) to be looked up
    where it lives; a table held as slabs (spread placement) is not: it is copied."""
    tables = set()
    for layer in compat.nested_layers(model):  # a vocab part inside its form too
        if isinstance(layer, keras.layers.Embedding) and layer.trainable \
                and not layer.lora_enabled:  # with LoRA the look-up reads a sum, not the table
            tables.add(id(layer.embeddings))
    return [id(v) in tables for v in variables]


def reads_where_they_live(variables, tables):
    """[(table, {attribute: replacement})] for each of `variables` that `tables` (one
    bool each, tables_of's) marks: while they are set, tf.gather(table, ids) reads the
    rows where the table lives (compat.gather_hooks). The trainer sets them only while
    it traces its step (training/placement.step_hooks)."""
    return [compat.gather_hooks(table, functools.partial(_sparse_read, table))
            for table, is_table in zip(variables, tables) if is_table]


def _sparse_read(table, indices, name=None):
    """The rows `indices` of `table` (a keras.Variable): read on the table's device from
    the variable itself where the tower's stateless call maps the table to it, or
    outside any call; else gathered from the tensor the call maps it to."""
    value = table.value
    if isinstance(value, tf.Variable):
        with tf.device(value.device):
            return value.sparse_read(indices, name=name)
    return tf.gather(value, indices, name=name)
