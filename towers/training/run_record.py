"""A checkpoint folder belongs to one run: `run.json` beside the checkpoints says which.

Restoring matches the checkpoint's values with the variables (checkpoint_match),
which two models of the same shapes pass, and which say nothing of the order in
which the run reads its data. So the first save writes a record of the run: the
model (its name and its variables' paths and shapes, Keras's numbering of
repeated names left out: "dense_3" is "dense"), the optimizer's class, the data
order (RunIdentity.data_order: a seed, the global batch size, the dataset) and the
settings that may change (RunIdentity.settings, and the optimizer's config: its
learning rate). Every resume and every save compares the run with the record:
another model, optimizer class or data order is refused in one line naming what
differs and both values; changed settings are applied and said in one log line;
the record is rewritten after every save, so it holds the settings of the run that
wrote the newest checkpoint. A folder whose checkpoints predate the record is
resumed on the variables alone. JSON only, written atomically (a temporary file
renamed over it).
"""

import dataclasses
import json
import os
import re
import tempfile

from absl import logging

RECORD_FILE = "run.json"
LEARNING_RATE = "learning_rate"  # the setting that a restore would otherwise undo
_NUMBERED = re.compile(r"_\d+$")  # Keras's suffix for a repeated name: dense_3
_START_OVER = ("delete the folder or give another checkpoint directory to start over. "
               "Nothing was restored or overwritten.")


@dataclasses.dataclass(frozen=True)
class RunIdentity:
    """What a run tells its checkpoint folder beside the model and optimizer.

    Attributes:
      data_order: {name: value} of what decides which examples each step reads
        (the seed that shuffles, the global batch size, the dataset). A resume
        whose value for a name differs from the one recorded is refused; a name
        on one side only is not compared.
      settings: {name: value} of what may change on a resume (epochs, steps,
        logging): a change is said in one log line with the optimizer's.
      flag_prefix: put before each name in messages: "--" for a command line's flags
        (the optimizer's learning rate is then "--learning_rate").
    Values are JSON's: str, int, float, bool, None, lists and dicts of them.
    """
    data_order: dict = dataclasses.field(default_factory=dict)
    settings: dict = dataclasses.field(default_factory=dict)
    flag_prefix: str = ""

    def __post_init__(self):
        for field in ("data_order", "settings"):
            values = getattr(self, field)
            if not isinstance(values, dict) or not all(isinstance(k, str) for k in values):
                raise ValueError(f"RunIdentity {field} must be a dict with str keys, got "
                                 f"{values!r}.")
            try:
                json.dumps(values)
            except (TypeError, ValueError) as error:
                raise ValueError(f"RunIdentity {field} must hold JSON values (str, numbers, "
                                 f"bool, None, lists, dicts): {error}.") from None


def given_settings(optimizer, identity):
    """The settings a run was given: the optimizer's config (its learning rate among them)
    as it was made, and identity.settings. Taken when the Checkpointer is made, before a
    restore sets the learning rate and callbacks change it."""
    config = _innermost(optimizer).get_config()
    config.pop("name", None)
    return _as_json({**config, **identity.settings})


def describe(model, optimizer_class, identity, settings):
    """The record of a run of `model` (the one the checkpoint saves), an optimizer of
    `optimizer_class`, given `settings` (given_settings')."""
    return {"model": {"name": _unnumbered(model.name),
                      "variables": [[_unnumbered(v.path), list(v.shape)]
                                    for v in model.weights]},
            "optimizer": optimizer_class,
            "data_order": _as_json(identity.data_order),
            "settings": settings}


def read(directory):
    """The folder's record, or None when it has none."""
    path = os.path.join(directory, RECORD_FILE)
    try:
        with open(path) as f:
            record = json.load(f)
        if not all(key in record for key in ("model", "optimizer", "data_order", "settings")):
            raise ValueError("fields are missing")
        return record
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as error:
        raise ValueError(f"cannot read {path} ({type(error).__name__}: "
                         f"{str(error).splitlines()[0] if str(error) else ''}), which records "
                         "the run that wrote the checkpoints beside it; put it back, or "
                         f"{_START_OVER}") from None


def check(recorded, current, directory, prefix):
    """Raises ValueError, in one line, when `current` (describe's) is another run than
    the `recorded` one: another model, optimizer class or data order."""
    def refuse(what, fix=""):
        raise ValueError(f"the checkpoints in {directory} belong to another run: {what}; "
                         f"{fix + ', or ' if fix else ''}{_START_OVER}")

    was, now = recorded["model"], current["model"]
    if was["name"] != now["name"]:
        refuse(f"it trained model {was['name']!r}, and this one is {now['name']!r}")
    if was["variables"] != now["variables"]:
        pairs = list(zip(was["variables"], now["variables"]))
        first = next(((a, b) for a, b in pairs if a != b), None)
        refuse(f"it trained a model with variable {_variable(first[0])} where this one has "
               f"{_variable(first[1])}" if first else
               f"it trained a model of {len(was['variables'])} variables, and this one has "
               f"{len(now['variables'])}")
    if recorded["optimizer"] != current["optimizer"]:
        refuse(f"it was written with optimizer {recorded['optimizer']}, and this one is "
               f"{current['optimizer']}")
    for name, value in current["data_order"].items():
        if name in recorded["data_order"] and recorded["data_order"][name] != value:
            flag, old = prefix + name, recorded["data_order"][name]
            refuse(f"it read its data with {flag}={_shown(old)}, and this run with "
                   f"{flag}={_shown(value)} (a resume reads the rest of the data in the "
                   "order it started)", f"rerun with {flag}={_shown(old)}")


def changes(recorded, current, prefix):
    """The settings `current` changes from `recorded`, as "name old -> new" phrases."""
    was = recorded["settings"]
    return [f"{prefix}{name} {_shown(was[name])} -> {_shown(value)}"
            for name, value in current["settings"].items()
            if name in was and was[name] != value]


def write(directory, record):
    """Writes `record` as the folder's RECORD_FILE (write_json)."""
    write_json(os.path.join(directory, RECORD_FILE), record)


def write_json(path, value):
    """Writes `value` as JSON to `path` atomically (a temporary file beside it renamed
    over it: never half a file); no temporary file is left behind, written or not."""
    folder, name = os.path.split(path)
    handle, temporary = tempfile.mkstemp(dir=folder or ".", prefix=f".{name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w") as f:
            json.dump(value, f, indent=1)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise


def apply_learning_rate(optimizer, recorded, settings):
    """After a restore, which brought back the rate the checkpoint holds: puts back the
    rate this run was given (in `settings`), where it is not the one the recorded run was
    given (an unchanged rate stays as restored, with what callbacks did to it). A rate a
    schedule gives is the schedule's own and is not restored."""
    was, given = recorded["settings"].get(LEARNING_RATE), settings.get(LEARNING_RATE)
    if _is_number(was) and _is_number(given) and was != given:
        _innermost(optimizer).learning_rate = given


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def log_changes(path, changed):
    if changed:
        logging.info("resumed from %s with changed settings: %s.", path, ", ".join(changed))


def _as_json(values):
    """`values` as they read back from JSON (a tuple as a list), so that a record compares
    equal to itself."""
    return json.loads(json.dumps(values, default=str))


def _innermost(optimizer):
    """The optimizer a LossScaleOptimizer wraps (or the optimizer itself)."""
    inner = getattr(optimizer, "inner_optimizer", None)
    return optimizer if inner is None else _innermost(inner)


def _unnumbered(path):
    return "/".join(_NUMBERED.sub("", part) for part in path.split("/"))


def _variable(entry):
    path, shape = entry
    return f"{path} {tuple(shape)}"


def _shown(value):
    if isinstance(value, float):
        return f"{value:.6g}"
    return json.dumps(value) if isinstance(value, str) else str(value)

