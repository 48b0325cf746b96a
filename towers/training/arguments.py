"""TowerTrainer's arguments as a Keras user types them: an optimizer by name as
keras.Model.compile takes it, and the keyword options (compile's, the trainer's own,
TowerOptions' fields) told apart; and the arguments a trainer refuses as built."""

import keras

from towers.engine.options import TowerOptions
from towers.training import overrides

# The trainer's own keyword options and their defaults, in the order __init__ takes them.
_OWN_KEYWORDS = {"metrics": (), "weighted_metrics": None, "loss_weights": None,
                 "jit_compile": False, "cluster": None, "pipeline_cuts": None,
                 "steps_per_execution": 1, "prefetch_to_devices": "auto"}


def trainer_keywords(keywords, defaults=None):
    """(every one of _OWN_KEYWORDS, given, else from `defaults` (a compiled model's:
    compiled_defaults), else its default; TowerOptions' fields given).

    Raises:
      TypeError: a keyword that is neither, as Python says of an unknown keyword.
    """
    fields = TowerOptions.field_names()
    unknown = sorted(set(keywords) - set(_OWN_KEYWORDS) - set(fields))
    if unknown:
        raise TypeError(f"TowerTrainer got an unexpected keyword argument {unknown[0]!r}; it "
                        f"takes {', '.join(_OWN_KEYWORDS)}, options= and TowerOptions' "
                        f"fields ({', '.join(fields)}).")
    defaults = {**_OWN_KEYWORDS, **(defaults or {})}
    own = {name: keywords.get(name, default) for name, default in defaults.items()}
    return own, {name: value for name, value in keywords.items() if name in fields}


def check_model(model, jit_compile):
    """Refuses a model that is not a keras.Model, one whose train_step, compute_loss or
    the like a trainer would ignore (overrides.check_not_overridden), and a jit_compile
    that is not a bool."""
    if not isinstance(model, keras.Model):
        raise ValueError(f"model must be a keras.Model, got {type(model).__name__}.")
    overrides.check_not_overridden(model)
    if not isinstance(jit_compile, bool):
        raise ValueError(f"jit_compile must be True or False, got {jit_compile!r}.")


def check_cluster_placement(cluster, options, model):
    """Refuses variable_placement="spread" in a cluster (`cluster` not None) with what
    needs every worker's gradients at once: clipping to a global norm (`options`, a
    TowerOptions) or loss scaling (a float16 model)."""
    if cluster is not None and options.variable_placement == "spread" and (
            options.clip_global_norm is not None or model.compute_dtype == "float16"):
        raise ValueError("variable_placement='spread' in a cluster cannot clip to a "
                         "global norm or scale the loss (a float16 model) yet: each "
                         "worker has only its own gradients; use 'main'.")


def keras_optimizer(given, model):
    """`given`, or the Keras optimizer its name names with Keras's defaults, as
    keras.Model.compile takes one ("adam"); wrapped in a LossScaleOptimizer where
    `model` computes in float16 and it is not one.

    Raises:
      ValueError: neither a keras.optimizers.Optimizer nor a Keras optimizer's name.
    """
    if isinstance(given, str):
        try:
            given = keras.optimizers.get(given)
        except ValueError:
            raise ValueError(f"optimizer {given!r} names no Keras optimizer; pass one, e.g. "
                             "keras.optimizers.Adam(1e-3), or a name such as 'adam'.") from None
    if not isinstance(given, keras.optimizers.Optimizer):
        raise ValueError(
            f"optimizer must be a keras.optimizers.Optimizer, got {type(given).__name__}.")
    if model.compute_dtype == "float16" and not isinstance(
            given, keras.optimizers.LossScaleOptimizer):
        # float16 gradients underflow without loss scaling; Keras's compile() wraps too.
        return keras.optimizers.LossScaleOptimizer(given)
    return given


def compiled_defaults(model, loss, optimizer):
    """(loss, optimizer, keyword defaults) from what `model.compile` was given, where the
    model is compiled: its loss and optimizer where `loss` and `optimizer` are None, and
    its metrics, weighted_metrics, loss_weights and steps_per_execution as the defaults of
    the trainer's keywords (a keyword given wins). Where it is not compiled, the three as
    they are and no defaults."""
    if not getattr(model, "compiled", False):
        return loss, optimizer, {}
    config = model.get_compile_config()  # what compile was given, serialized
    defaults = {name: _deserialized(config[name]) for name in
                ("metrics", "weighted_metrics", "loss_weights") if config.get(name) is not None}
    defaults["steps_per_execution"] = config.get("steps_per_execution", 1)
    return (model.loss if loss is None else loss,
            model.optimizer if optimizer is None else optimizer, defaults)


def _deserialized(value):
    """A compile config's metrics (names, serialized metrics, in lists or dicts) as
    compile takes them: each serialized metric a new metric object."""
    if isinstance(value, dict) and "class_name" in value:
        return keras.metrics.get(value)
    if isinstance(value, dict):
        return {key: _deserialized(entry) for key, entry in value.items()}
    if isinstance(value, (list, tuple)):
        return [_deserialized(entry) for entry in value]
    return value


class SetOnce:
    """A TowerTrainer attribute set once, in __init__, and refused in one line after:
    what its steps were built from (the loss: trainer.objective computes it), which a
    later assignment would otherwise leave silently unused."""

    def __set_name__(self, owner, name):
        self._name = name

    def __get__(self, trainer, owner=None):
        return self if trainer is None else trainer.__dict__[self._name]

    def __set__(self, trainer, value):
        if self._name in trainer.__dict__:
            raise AttributeError(
                f"trainer.{self._name} cannot be changed once the trainer is built: its "
                f"steps compute the {self._name} it was given. Build a new TowerTrainer("
                f"model, {self._name}=..., optimizer=...) with the new one; the model and "
                "the optimizer carry on.")
        trainer.__dict__[self._name] = value
