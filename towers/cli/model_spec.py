"""What `--model` names: a built-in model, your own function, or a saved Keras model.

    mlp | cnn | resnet | text     a model of towers.models
    PACKAGE.MODULE:FUNCTION       FUNCTION(input_shape, num_classes) -> keras.Model
    PATH.keras                    a model saved with model.save("PATH.keras")

`load_model` turns any of them into a checked keras.Model: one input that
takes the data's examples, one output of logits (B, num_classes). Every
problem is a ValueError of one line that says what to change. A checkpoint
directory records which model its checkpoints hold (`claim_checkpoint_dir`),
because two models with the same variable shapes (a relu and a tanh MLP) would
otherwise restore into each other without complaint.
"""

import importlib
import json
import os
import sys
import zipfile

import keras
import tensorflow as tf
from absl import logging

from towers.cli import models
from towers.training import checkpoint_folder, run_record

KERAS_SUFFIX = ".keras"
FORMS = (f"a built-in model ({'|'.join(models.MODELS)}), PACKAGE.MODULE:FUNCTION (your "
         "FUNCTION(input_shape, num_classes) returning a keras.Model that outputs logits), or "
         f"PATH{KERAS_SUFFIX} (a model saved with model.save)")
RECORD_FILE = "model_spec.json"  # beside the checkpoints; names the model they hold
_MAX_DETAIL = 300  # characters of a foreign error message kept in our one line


def form_of(spec):
    """Which form `spec` has: "builtin", "function" or "file"; ValueError for none."""
    if isinstance(spec, str):
        if spec in models.MODELS:
            return "builtin"
        if spec.endswith(KERAS_SUFFIX):  # before ":", which a Windows path may hold
            return "file"
        module, colon, function = spec.partition(":")
        if colon and function.isidentifier() and all(
                part.isidentifier() for part in module.split(".")):
            return "function"
    hint = ""
    if isinstance(spec, str) and spec.endswith(".h5"):
        hint = f" (a legacy .h5 file: load it and save it again as {KERAS_SUFFIX})"
    raise ValueError(f"model {spec!r} is none of the three forms{hint}: {FORMS}.")


def load_model(spec, input_shape, num_classes, seed=None):
    """The keras.Model `spec` names, built for examples of `input_shape`.

    Build it under `tf.device(main_device)`: its variables are created where
    the call runs.

    Args:
      spec: a built-in name, "PACKAGE.MODULE:FUNCTION" or "PATH.keras". The
        module is imported with the current directory on sys.path, as
        `python -m` has it, so a module beside where you run is found.
      input_shape: (H, W, C) of one example, as the data has it.
      num_classes: the number of classes, the width of the logits.
      seed: the built-in models' weight seed (see models.build_model). A
        FUNCTION's layers draw from Keras's global seed instead
        (keras.utils.set_random_seed); a saved model keeps its weights.

    Returns:
      A built keras.Model: (B, *input_shape) -> (B, num_classes) logits.

    Raises:
      ValueError: a spec of none of the forms, a module that does not import,
        no such function, a result that is not a keras.Model, a file that does
        not load, or a model whose input or output shape does not fit the data.
    """
    form = form_of(spec)
    if form == "builtin":
        return models.build_model(spec, input_shape, num_classes, seed=seed)
    input_shape = tuple(int(d) for d in input_shape)
    model = _call_function(spec, input_shape, num_classes) if form == "function" \
        else load_file(spec)
    _check_fits(model, input_shape, num_classes)
    logging.info("model %r from %s: %s parameters, (B, %s) -> logits (B, %d).", model.name,
                 spec, f"{model.count_params():,}", ", ".join(map(str, input_shape)),
                 num_classes)
    return model


def _call_function(spec, input_shape, num_classes):
    module_name, _, function_name = spec.partition(":")
    # `python -m` puts the current directory first on sys.path; the towers-train
    # console script does not, so without this examples.my_model would not import.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # ImportError, or any error the module raises as it runs
        hint = (" (name the module as Python imports it, e.g. examples.my_model, not its "
                "file)" if module_name.endswith(".py") else "")
        raise ValueError(f"cannot import module {module_name!r}: {_one_line(error)}{hint}"
                         ) from None
    function = getattr(module, function_name, None)
    if not callable(function):
        public = sorted(name for name, value in vars(module).items()
                        if callable(value) and not name.startswith("_")
                        and getattr(value, "__module__", None) == module.__name__)
        raise ValueError(f"module {module_name!r} ({module.__file__}) has no function "
                         f"{function_name!r}; it defines {', '.join(public) or 'nothing to call'}"
                         ".")
    call = f"{function_name}(input_shape={input_shape}, num_classes={num_classes})"
    try:
        model = function(input_shape, num_classes)
    except Exception as error:
        raise ValueError(f"{call} raised {_one_line(error)}") from None
    if not isinstance(model, keras.Model):
        raise ValueError(f"{call} returned {type(model).__module__}.{type(model).__qualname__}"
                         ", not a keras.Model; return keras.Model(inputs, logits), a "
                         "keras.Sequential or a keras.Model subclass.")
    return model


def load_file(path):
    """The model saved at `path` (PATH.keras), as it is: unchecked, its own shapes.

    Raises:
      ValueError: the file is missing, not a Keras archive, or does not load.
    """
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        raise ValueError(f"model file {path!r} does not exist; save one with "
                         f"model.save({os.path.basename(path)!r}).")
    if not zipfile.is_zipfile(path):  # Keras would call it "File not found"
        raise ValueError(f"model file {path!r} is not a Keras {KERAS_SUFFIX} archive; save "
                         "one with model.save(path).")
    try:
        # safe_mode stays on: a Lambda layer's serialized Python bytecode is refused, not run.
        # compile=False: training brings its own loss and optimizer.
        return keras.models.load_model(path, compile=False, safe_mode=True)
    except Exception as error:
        raise ValueError(
            f"model file {path!r} does not load: {_one_line(error)} (to load a model with "
            "custom or Lambda layers, return it from your own PACKAGE.MODULE:FUNCTION)"
        ) from None


def _check_fits(model, input_shape, num_classes):
    """One input that takes (B, *input_shape), one output (B, num_classes), or ValueError."""
    data_batch = (None,) + input_shape
    if isinstance(model, keras.Sequential) and not model.built:
        # Built by a first call, a Sequential would fix that call's batch size in its graph.
        try:
            model.build(data_batch)
        except Exception as error:
            raise ValueError(f"the model cannot be built for batches of the data's shape "
                             f"{data_batch}: {_one_line(error)}") from None
    inputs = _symbolic(model, "inputs")
    if inputs is not None:  # functional, or a Sequential with an Input
        if len(inputs) != 1:
            raise ValueError(f"the model takes {len(inputs)} inputs; give it one, the images "
                             f"{data_batch}.")
        expected = tuple(inputs[0].shape)
        if len(expected) != len(data_batch) or any(
                e is not None and e != d for e, d in zip(expected[1:], input_shape)):
            raise ValueError(f"the model takes inputs of shape {expected} but the data's "
                             f"examples come in batches of shape {data_batch}; build it for "
                             f"input_shape={input_shape}.")
        outputs = _symbolic(model, "outputs")
        output_shapes = [tuple(t.shape) for t in outputs]
    else:  # subclassed: a first call builds it
        try:
            outputs = model(tf.zeros((2,) + input_shape), training=False)
        except Exception as error:
            raise ValueError(f"the model fails on a batch of the data's shape "
                             f"{(2,) + input_shape}: {_one_line(error)}") from None
        outputs = tf.nest.flatten(outputs)
        output_shapes = [(None,) + tuple(t.shape[1:]) for t in outputs]
    if len(output_shapes) != 1 or output_shapes[0] != (None, num_classes):
        shown = output_shapes[0] if len(output_shapes) == 1 else output_shapes
        raise ValueError(f"the model outputs shape {shown}; it must output logits of shape "
                         f"(None, {num_classes}), one per class of the data.")
    last = model.layers[-1] if model.layers else None
    if getattr(last, "activation", None) is keras.activations.softmax:
        logging.warning("model %r ends in a softmax; its outputs are taken as logits "
                        "(from_logits=True), so drop the softmax to learn well.", model.name)


def _symbolic(model, attribute):
    """model.inputs or model.outputs when the model is a graph of layers, else None."""
    try:
        return getattr(model, attribute)
    except (AttributeError, ValueError):  # a subclassed model: no graph until it is called
        return None


def _one_line(error):
    """`TypeName: first line of the message`; its first sentence if that is too long."""
    # Keras wraps a failed deserialization in pages of config; the cause follows this.
    message = str(error).rpartition("Exception encountered:")[2]
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    line = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    if len(line) > _MAX_DETAIL:
        line = line.split(". ")[0] + "."
    return line if len(line) <= _MAX_DETAIL else line[:_MAX_DETAIL - 3] + "..."


def claim_checkpoint_dir(directory, spec, writer=True):
    """Refuses a directory whose checkpoints hold another model; records `spec` in a new one.

    Restoring compares variable shapes only, so the model is recorded by name
    (a .keras file by its absolute path) in RECORD_FILE. It is written only
    while the directory holds no checkpoint, so it always names the model of
    the run that wrote the checkpoints; one written before this record
    existed is resumed on the shapes alone.

    Args:
      directory: the checkpoint directory (need not exist yet).
      spec: the model, as load_model takes it.
      writer: False on workers that only read the chief's checkpoints.

    Raises:
      ValueError: the checkpoints hold another model; nothing is written then.
    """
    name = os.path.abspath(os.path.expanduser(spec)) if form_of(spec) == "file" else spec
    record = os.path.join(directory, RECORD_FILE)
    # A folder without an index may still hold checkpoints (checkpoint_folder).
    newest = tf.train.latest_checkpoint(directory) if os.path.isdir(directory) else None
    newest = newest or next(reversed(checkpoint_folder.unindexed(directory)), None)
    if newest is None:
        if writer:
            try:
                os.makedirs(directory, exist_ok=True)
                run_record.write_json(record, {"model": name})
            except OSError as error:
                raise ValueError(f"cannot write {record}: {error.strerror or error}; choose a "
                                 "writable checkpoint directory.") from None
        return
    try:
        with open(record) as f:
            recorded = json.load(f)["model"]
    except FileNotFoundError:
        return
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"cannot read {record} ({_one_line(error)}), which names the model "
                         f"of the checkpoint {newest}; restore or delete it.") from None
    if recorded != name:
        raise ValueError(f"the checkpoint {newest} does not match this model: it holds model "
                         f"{recorded!r}, not {name!r}; use another --checkpoint_dir, or delete "
                         "this one to start over. Nothing was overwritten.")
