"""A model that overrides Keras's step methods is refused, never trained as if it did not.

keras.Model.fit trains by calling the model's own `train_step`, which calls its
`compute_loss` and `compute_metrics`; evaluate calls its `test_step`. TowerTrainer calls
none of them: its step is steps 1-6 over towers (compiled_steps.py), the loss compile's
(engine/losses.py), the metrics its own (metrics.py). A subclass that overrides one of them
would be trained as if it had not, and differ from fit without a word. So TowerTrainer
refuses it, in one line naming the class and the methods, and points to `towers.tower_step`,
the tower step around one's own function.

An override is a method that type(model) resolves to anything other than keras.Model's
own: defined by the model's class or any class between it and keras.Model (a subclass of a
user's subclass is covered). Keras's own subclasses, Sequential and the functional Model,
inherit all five from keras.Model, so they resolve to the same functions and pass; so does
a subclass that overrides only `call`, `build` or `__init__`.

`predict_step` refuses `TowerTrainer.predict` (and `predict_on_batch`) only, not the
trainer: Keras's predict calls `predict_step(data)` on the whole batch, and an override
may do anything across its rows (sort them, normalise over them, decode a beam), so
calling it on each tower's shard would differ from model.predict without a word. Training
and evaluation never call it; model.predict still runs it on one device.

Future work: honour an override where it can be exact. Each is its own question: a
`compute_loss` is the batch's reduced loss, which towers would have to split into shares
that add up to it; a `train_step` owns the whole step, devices and all; a `predict_step`
that treats rows one by one could run on each shard, but its code does not say so.
"""

import keras

# Keras's step methods that fit and evaluate call and TowerTrainer does not.
REFUSED = ("train_step", "test_step", "compute_loss", "compute_metrics")


def check_can_predict(model):
    """Refuses, in one line, predicting with a model whose class overrides predict_step.

    Raises:
      ValueError: naming the class (and the class defining it where that is another) and
        why: the override sees the whole batch, a tower only its shard.
    """
    if getattr(type(model), "predict_step", None) is getattr(keras.Model, "predict_step"):
        return
    model_class = type(model)
    owner = next(cls for cls in model_class.__mro__ if "predict_step" in vars(cls))
    where = "" if owner is model_class else f" (in {owner.__name__})"
    raise ValueError(
        f"model {model_class.__name__} overrides keras.Model's predict_step{where}, which "
        "keras.Model.predict calls on the whole batch and TowerTrainer.predict could call "
        "only on each tower's shard, which differs for an override that looks across rows: "
        "call model.predict (one device), or predict with a model that does not override "
        "it and post-process its outputs.")


def overridden(model):
    """The names in REFUSED that type(model) resolves to other than keras.Model's own."""
    return [name for name in REFUSED
            if getattr(type(model), name, None) is not getattr(keras.Model, name)]


def check_not_overridden(model):
    """Refuses, in one line, a model whose class overrides one of REFUSED.

    Raises:
      ValueError: naming the class, each method overridden (and the class defining it
        where that is another) and towers.tower_step.
    """
    names = overridden(model)
    if not names:
        return
    model_class = type(model)
    where = []
    for name in names:
        owner = next(cls for cls in model_class.__mro__ if name in vars(cls))
        where.append(name if owner is model_class else f"{name} (in {owner.__name__})")
    raise ValueError(
        f"model {model_class.__name__} overrides keras.Model's {', '.join(where)}, which "
        "TowerTrainer does not call: it would train as if not overridden, unlike "
        "keras.Model.fit. Write your own step with towers.tower_step (docs/api.md, "
        "section 2), or remove the override.")
