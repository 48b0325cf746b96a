"""Keras callbacks in TowerTrainer.fit, called as keras.Model.fit calls them.

A callback sees `callback.model`, the trainer's Keras model, with
`model.optimizer` the optimizer the compiled step uses (so a new learning
rate takes effect at the next step, without retracing) and
`model.stop_training`, which fit checks after every step and epoch.
"""

import sys

import keras


def callback_list(trainer, callbacks, epochs, steps_per_epoch, verbose):
    """Checks `callbacks`; returns (history, keras.callbacks.CallbackList, own_progress).

    own_progress: whether fit prints its own progress (no ProgbarLogger given).

    Raises:
      ValueError: not a list, something in it that is not a keras.callbacks.Callback, or a
        BackupAndRestore (fit's checkpointer does that job, exactly).
    """
    callbacks = checked(callbacks)
    for callback in callbacks:
        if isinstance(callback, keras.callbacks.BackupAndRestore):
            raise ValueError(
                "keras.callbacks.BackupAndRestore is not supported: it restarts an "
                "interrupted epoch from its first batch. Pass "
                "checkpointer=towers.Checkpointer(directory, model, optimizer, every_steps=N) "
                "to fit instead: it resumes at the exact batch, no step lost or repeated.")
    history = next((c for c in callbacks if isinstance(c, keras.callbacks.History)), None)
    if history is None:
        history = keras.callbacks.History()
        callbacks.append(history)
    own_progress = not any(isinstance(c, keras.callbacks.ProgbarLogger) for c in callbacks)
    model = trainer.model
    # Keras's callbacks reach the optimizer through the model, as after compile().
    model.optimizer = trainer.optimizer
    model.stop_training = False
    return history, keras.callbacks.CallbackList(
        callbacks, model=model, verbose=1 if verbose else 0, epochs=epochs,
        steps=steps_per_epoch), own_progress


def checked(callbacks):
    """`callbacks` (None or a list of keras.callbacks.Callback objects) as a new list;
    ValueError, in one line, for one Callback alone, not a list, or what is not one."""
    if isinstance(callbacks, keras.callbacks.Callback):
        raise ValueError(f"callbacks must be a list of keras.callbacks.Callback objects, got "
                         f"one {type(callbacks).__name__}: pass callbacks=[it].")
    try:
        callbacks = list(callbacks or [])
    except TypeError:
        raise ValueError(f"callbacks must be a list of keras.callbacks.Callback objects, got "
                         f"a {type(callbacks).__name__}.") from None
    for callback in callbacks:
        if not isinstance(callback, keras.callbacks.Callback):
            raise ValueError(f"callbacks must be keras.callbacks.Callback objects, got "
                             f"{type(callback).__name__}.")
    return callbacks


def evaluate_list(trainer, callbacks, verbose, steps):
    """evaluate's callbacks, checked as callback_list checks them, as a CallbackList with
    Keras's progress bar where verbose asks for one (1, or "auto" on a terminal; 2 and 0
    print nothing). steps: the batches it will run, None where unknown."""
    if verbose not in ("auto", 0, 1, 2):
        raise ValueError(f"verbose must be 'auto', 0, 1 or 2, as keras.Model.evaluate takes "
                         f"it, got {verbose!r}.")
    callbacks = callback_list(trainer, callbacks, 1, steps, 0)[1]
    if verbose == 1 or verbose == "auto" and sys.stdout.isatty():
        progress = keras.callbacks.ProgbarLogger()
        progress.set_model(trainer.model)
        progress.set_params({"verbose": 1, "epochs": 1, "steps": steps})
        callbacks.callbacks.append(progress)
    return callbacks
