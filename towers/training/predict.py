"""TowerTrainer.predict: keras.Model.predict over towers, every tower its shard of each batch.

Keras's predict (keras/src/backend/tensorflow/trainer.py) turns x into batches (its
epoch iterator: arrays sliced into batches of `batch_size`, 32 by default; a
tf.data.Dataset, a keras.utils.PyDataset or a generator read as they come, each element
x, (x,), (x, y) or (x, y, sample_weight), of which it takes x), runs `predict_step` on
each, at most `steps` of them, calls the on_predict_* callbacks around them, and
concatenates the outputs in row order as NumPy. This module does the same, each batch
through TowerTrainer.predict_on_batch: step 1's split, then every tower's forward in
inference mode on its copies of the weights (compiled_steps.predict_step).

A PyDataset's on_epoch_begin and on_epoch_end are called once, around the batches, as
Keras's predict calls them (not on_epoch_end after a callback stopped it early).
"""

import itertools

import keras
import numpy as np
import tensorflow as tf

from towers import errors
from towers.training import callbacks as callbacks_lib, inputs, overrides, py_datasets


def predict(trainer, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
    """The model's outputs for every row of `x`, as keras.Model.predict returns them.

    Args:
      trainer: a TowerTrainer.
      x: the inputs: an array or Tensor, or a list or dict of them (one per model
        input), cut into batches of `batch_size` rows; or a tf.data.Dataset, a
        keras.utils.PyDataset or a generator of batches, each x, (x,), (x, y) or
        (x, y, sample_weight) (y and sample_weight ignored, as Keras ignores them).
      batch_size: rows per batch of arrays; None = 32, or with `steps` the rows divided
        into `steps` batches, as Keras. Not with batches already made (refused).
      verbose: "auto" or 1 (a progress bar, Keras's ProgbarLogger), 0 (silent), 2.
      steps: at most this many batches; None = until the data ends.
      callbacks: None, a list of keras.callbacks.Callback objects or a
        keras.callbacks.CallbackList: on_predict_begin, on_predict_batch_begin,
        on_predict_batch_end (logs {"outputs": the batch's, as NumPy}) and
        on_predict_end, as keras.Model.predict calls them; setting
        model.stop_predicting in one stops after that batch.

    Returns:
      NumPy arrays in the model's output structure (one array, a list or a dict), each
      batch's rows in order.

    Raises:
      ValueError: in one line: a model overriding predict_step, an argument Keras
        would not take, x of no rows or batches, a batch the model does not take (as
        train_step says it of x), or outputs whose shapes beyond dim 0 differ between
        batches (Keras returns a tf.RaggedTensor for those).
    """
    overrides.check_can_predict(trainer.model)
    if verbose not in ("auto", 0, 1, 2):  # True and False are 1 and 0
        raise ValueError(f"verbose must be 'auto', 0 (silent), 1 (a progress bar) or 2, as "
                         f"keras.Model.predict takes it, got {verbose!r}.")
    steps = None if steps is None else errors.positive_integer("steps", steps)
    batches, num_batches = inputs.predict_data(x, batch_size, steps)
    trainer.row_counts.from_source("predict", batches)
    hooks = py_datasets.EpochHooks(batches)  # refuses a PyDataset asking for parallel loading
    callbacks = _callback_list(trainer, callbacks, verbose, steps or num_batches)
    model = trainer.model
    model.stop_predicting = False
    callbacks.on_predict_begin()
    hooks.epoch_begins()
    outputs = []
    for index, batch in enumerate(itertools.islice(batches, steps)):
        callbacks.on_predict_batch_begin(index)
        outputs.append(trainer.predict_on_batch(_inputs_of(batch)))
        callbacks.on_predict_batch_end(index, {"outputs": outputs[-1]})
        if model.stop_predicting:
            break
    else:
        hooks.epoch_ends()
    callbacks.on_predict_end()
    if not outputs:
        raise ValueError("predict got no batches: x is an empty dataset; pass inputs with "
                         "at least one row.")
    return tf.nest.map_structure(_concatenated, *outputs)


def _inputs_of(element):
    """x of a batch that is x, (x,), (x, y) or (x, y, sample_weight), as Keras's
    unpack_x_y_sample_weight reads it (a list as a tuple)."""
    if isinstance(element, list):
        element = tuple(element)
    if not isinstance(element, tuple):
        return element
    if len(element) not in (1, 2, 3):
        raise ValueError(f"a batch of x must be x, (x,), (x, y) or (x, y, sample_weight), "
                         f"got a tuple of length {len(element)}.")
    return element[0]


def _callback_list(trainer, callbacks, verbose, num_batches):
    """Keras's CallbackList as keras.Model.predict builds it (a ProgbarLogger unless
    verbose is 0), or `callbacks` itself where it is one."""
    if isinstance(callbacks, keras.callbacks.CallbackList):
        return callbacks
    return keras.callbacks.CallbackList(callbacks_lib.checked(callbacks),
                                        add_progbar=verbose != 0,
                                        verbose=verbose, epochs=1, steps=num_batches,
                                        model=trainer.model)


def _concatenated(*pieces):
    """One output's batches joined along dim 0; ValueError where they differ beyond it."""
    if len({piece.shape[1:] for piece in pieces}) > 1:
        raise ValueError(
            f"an output's batches differ in shape beyond dim 0 "
            f"({sorted({piece.shape[1:] for piece in pieces})}), which keras.Model.predict "
            "returns as a tf.RaggedTensor and TowerTrainer.predict does not: predict "
            "batches of one shape (pad them to one length).")
    return np.concatenate(pieces)
