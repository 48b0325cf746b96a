"""TowerTrainer's arguments as a Keras user types them: an optimizer by name as
keras.Model.compile takes it, and the keyword options (compile's, the trainer's own,
TowerOptions' fields) told apart."""

import keras

from towers.engine.options import TowerOptions

# The trainer's own keyword options and their defaults, in the order __init__ takes them.
_OWN_KEYWORDS = {"metrics": (), "weighted_metrics": None, "loss_weights": None,
                 "jit_compile": False, "cluster": None, "pipeline_cuts": None,
                 "steps_per_execution": 1, "prefetch_to_devices": "auto"}


def trainer_keywords(keywords):
    """(every one of _OWN_KEYWORDS, given or its default; TowerOptions' fields given).

    Raises:
      TypeError: a keyword that is neither, as Python says of an unknown keyword.
    """
    fields = TowerOptions.field_names()
    unknown = sorted(set(keywords) - set(_OWN_KEYWORDS) - set(fields))
    if unknown:
        raise TypeError(f"TowerTrainer got an unexpected keyword argument {unknown[0]!r}; it "
                        f"takes {', '.join(_OWN_KEYWORDS)}, options= and TowerOptions' "
                        f"fields ({', '.join(fields)}).")
    own = {name: keywords.get(name, default) for name, default in _OWN_KEYWORDS.items()}
    return own, {name: value for name, value in keywords.items() if name in fields}


def keras_optimizer(given):
    """`given`, or the Keras optimizer its name names with Keras's defaults, as
    keras.Model.compile takes one ("adam").

    Raises:
      ValueError: neither a keras.optimizers.Optimizer nor a Keras optimizer's name.
    """
    if isinstance(given, str):
        try:
            return keras.optimizers.get(given)
        except ValueError:
            raise ValueError(f"optimizer {given!r} names no Keras optimizer; pass one, e.g. "
                             "keras.optimizers.Adam(1e-3), or a name such as 'adam'.") from None
    if not isinstance(given, keras.optimizers.Optimizer):
        raise ValueError(
            f"optimizer must be a keras.optimizers.Optimizer, got {type(given).__name__}.")
    return given
