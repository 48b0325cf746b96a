"""Steps 3, 4 and 7, and `TowerTrainer`, which runs all seven in one compiled step."""

import collections
import inspect

import keras
import tensorflow as tf
from absl import logging

from towers import aggregate, devices as devices_lib, losses, loop, split
from towers.errors import NonFiniteError

ON_NONFINITE = ("raise", "skip")

TowerResult = collections.namedtuple("TowerResult", ["grads", "loss", "state", "y_pred"])
TowerResult.__doc__ = """Steps 1-6 of one global batch, everything on the main device.

grads: mean gradient per model.trainable_variables entry (None where unused).
loss: scalar float32, mean loss over the global batch plus regularisation.
state: new value per model.non_trainable_variables entry (None where unchanged).
y_pred: model outputs for the whole batch, rows in batch order.
"""


def tower_gradients(model, loss, batch, devices, main_device=None):
    """Steps 1-6: the shard-weighted mean gradient of `loss` on the whole batch.

    Call it inside your own tf.function and apply the gradients yourself. The
    model's non-trainable state (BatchNorm statistics) is updated, as calling
    the model in training mode would.

    Args:
      model: a built keras.Model.
      loss: a keras.losses.Loss or callable(y_true, y_pred) -> per-example losses.
      batch: (x, y) or (x, y, sample_weight), dim 0 = global batch.
      devices: tower device names, one shard each.
      main_device: where gradients are gathered and averaged; None = devices[0].

    Returns:
      (grads, logs): one gradient per model.trainable_variables entry, on
      main_device, and {"loss": scalar Tensor}.
    """
    result = run_towers(model, loss, batch, list(devices), main_device or devices[0])
    assign_state(model, result.state)
    return result.grads, {"loss": result.loss}


def run_towers(model, loss, batch, devices, main_device):
    """Steps 1-6 of the tower algorithm on one global batch; returns a TowerResult."""
    shards = split.split_batch(batch, len(devices))                           # 1
    shard_sizes = [split.batch_size(shard) for shard in shards]
    weights = [v.value for v in model.trainable_variables]
    state = [v.value for v in model.non_trainable_variables]
    tower_grads, tower_losses, tower_states, tower_outputs = [], [], [], []
    for i, (tower, shard) in enumerate(zip(devices, shards)):
        with tf.device(tower), tf.name_scope(f"tower_{i}"):
            tower_weights = devices_lib.broadcast_weights(weights, tower)     # 2
            tower_state = devices_lib.broadcast_weights(state, tower)
            with tf.GradientTape() as tape:
                tape.watch(tower_weights)
                y_pred, new_state, regularization = forward(                  # 3
                    model, tower_weights, tower_state, shard[0], training=True)
                tower_loss = shard_loss(loss, shard, y_pred, regularization)
            tower_grads.append(tape.gradient(tower_loss, tower_weights))      # 4
        tower_losses.append([tower_loss])
        tower_states.append(new_state)
        tower_outputs.append(y_pred)
    tower_grads = aggregate.gather_gradients(tower_grads, main_device)        # 5
    grads = aggregate.average_gradients(tower_grads, shard_sizes, main_device)  # 6
    with tf.device(main_device):
        return TowerResult(
            grads=grads,
            loss=aggregate.average_gradients(tower_losses, shard_sizes)[0],
            state=aggregate.average_state(tower_states, shard_sizes),
            y_pred=tf.nest.map_structure(lambda *parts: tf.concat(parts, 0), *tower_outputs))


def forward(model, weights, state, x, training):
    """Step 3: the model's forward pass on the current device, writing no variable.

    Args:
      weights, state: values for model.trainable_variables and
        model.non_trainable_variables, already on this tower.
      x: this tower's inputs.

    Returns:
      (y_pred, new_state, regularization): outputs; the new non-trainable
      values (None where the layer did not change them); the sum of the model's
      regularisation losses, a float32 scalar (0 when it has none).
    """
    kwargs = {"training": training} if _accepts_training(model) else {}
    y_pred, new_state, extra_losses = model.stateless_call(
        weights, state, x, return_losses=True, **kwargs)
    new_state = [new if new is not old else None for new, old in zip(new_state, state)]
    regularization = tf.add_n([tf.cast(l, tf.float32) for l in extra_losses]
                              ) if extra_losses else tf.constant(0.0)
    return y_pred, new_state, regularization


def shard_loss(loss, shard, y_pred, regularization):
    """Mean per-example loss of one shard plus the regularisation, a float32 scalar.

    An empty shard gives just the regularisation; its weight in the average is 0.
    Averaging these over towers by shard size gives the global-batch mean plus
    the regularisation counted once.
    """
    _, y, sample_weight = split.unpack_batch(shard)
    per_example = losses.per_example_loss(loss, y, y_pred, sample_weight)
    count = tf.maximum(tf.cast(tf.shape(per_example)[0], tf.float32), 1.0)
    return tf.reduce_sum(per_example) / count + regularization


def apply_update(optimizer, grads, variables, main_device):
    """Step 7: the optimizer applies the averaged gradients, once, on the main device."""
    with tf.device(main_device):
        optimizer.apply_gradients(zip(grads, variables))


def assign_state(model, state):
    """Writes the merged non-trainable values (None = unchanged) into the model."""
    for variable, value in zip(model.non_trainable_variables, state):
        if value is not None:
            variable.assign(value)


def _accepts_training(model):
    parameters = inspect.signature(model.call).parameters
    return "training" in parameters or any(
        p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters.values())


class TowerTrainer:
    """Trains a Keras model data-parallel over tower devices, one explicit step at a time.

    Attributes:
      model, loss, optimizer: as given.
      devices: tower device names, e.g. ["/device:CPU:0", "/device:CPU:1"].
      main_device: where the variables live and the gradients are averaged.
      on_nonfinite: "raise" (NonFiniteError, nothing applied) or "skip"
        (nothing applied, counted in logs["skipped_steps"]).
      metrics: Keras metrics updated on every train and evaluation batch.
    """

    def __init__(self, model, loss, optimizer, devices=None, main_device=None, *,
                 metrics=(), on_nonfinite="raise"):
        if not isinstance(model, keras.Model):
            raise ValueError(f"model must be a keras.Model, got {type(model).__name__}.")
        losses.check_loss(loss)
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise ValueError(
                f"optimizer must be a keras.optimizers.Optimizer, got {type(optimizer).__name__}.")
        if on_nonfinite not in ON_NONFINITE:
            raise ValueError(f"on_nonfinite must be one of {ON_NONFINITE}, got {on_nonfinite!r}.")
        devices = devices_lib.default_devices() if devices is None else list(devices)
        if not devices:
            raise ValueError("devices is empty; give at least one tower device.")
        self.devices = [devices_lib.canonical_name(d) for d in devices]
        self.main_device = devices_lib.canonical_name(main_device or self.devices[0])
        devices_lib.check_devices_exist(self.devices + [self.main_device])
        self.model, self.loss, self.optimizer = model, loss, optimizer
        self.on_nonfinite = on_nonfinite
        self.metrics = loop.resolve_metrics(metrics)
        self._skipped_steps = 0
        self._functions = {}  # (kind, batch spec text) -> compiled step
        self._train_spec = None
        if model.built:
            self._check_model()

    @property
    def step(self):
        """Optimizer steps applied so far (int); skipped steps do not count."""
        return int(self.optimizer.iterations.numpy())

    def train_step(self, batch):
        """Runs one tower step on a global batch; returns logs as Python floats.

        Args:
          batch: (x, y) or (x, y, sample_weight); arrays or Tensors, dim 0 = the
            global batch size, any size >= 1.

        Returns:
          {"loss": mean loss over the batch (+ regularisation), metric results...,
           "skipped_steps": steps skipped as non-finite so far}.

        Raises:
          ValueError: a malformed batch; nothing runs.
          NonFiniteError: on_nonfinite="raise" and the loss or gradients are
            NaN/Inf; weights and optimizer state are left as they were.
        """
        batch, train_function = self._prepare(batch, "train")
        logs = train_function(batch)
        if not bool(logs.pop("applied")):
            if self.on_nonfinite == "raise":
                raise NonFiniteError(
                    f"step {self.step + 1}: the loss or the averaged gradients are NaN or "
                    "Inf, so nothing was applied. Lower the learning rate, check the data, "
                    "or pass on_nonfinite='skip' to skip such steps.")
            self._skipped_steps += 1
        logs = {name: float(value) for name, value in logs.items()}
        logs["skipped_steps"] = self._skipped_steps
        return logs

    def evaluate(self, data):
        """Mean loss (+ metrics) over a batch, a tf.data.Dataset or an iterable of batches."""
        return loop.evaluate(self, data)

    def fit(self, dataset, epochs=1, steps_per_epoch=None, validation_data=None, *,
            max_steps=None, checkpointer=None, log_dir=None, verbose="auto"):
        """Trains for `epochs` epochs over `dataset`; returns a loop.History.

        See towers.loop.fit for every argument: `dataset` may be a callable
        epoch -> batches, `checkpointer` resumes and saves, `log_dir` gets
        TensorBoard summaries.
        """
        return loop.fit(self, dataset, epochs=epochs, steps_per_epoch=steps_per_epoch,
                        validation_data=validation_data, max_steps=max_steps,
                        checkpointer=checkpointer, log_dir=log_dir, verbose=verbose)

    def eval_step(self, batch):
        """Sum of per-example losses, example count and regularisation for one batch."""
        batch, eval_function = self._prepare(batch, "eval")
        return eval_function(batch)

    def _compiled_train_step(self, batch):
        result = run_towers(self.model, self.loss, batch, self.devices, self.main_device)
        finite = aggregate.all_finite([result.loss] + result.grads)

        def apply():  # step 7, only for a finite step
            apply_update(self.optimizer, result.grads, self.model.trainable_variables,
                         self.main_device)
            assign_state(self.model, result.state)
            return tf.constant(True)

        applied = tf.cond(finite, apply, lambda: tf.constant(False))
        logs = {"loss": result.loss, "applied": applied}
        logs.update(loop.update_metrics(self.metrics, batch, result.y_pred, self.main_device))
        return logs

    def _compiled_eval_step(self, batch):
        shards = split.split_batch(batch, len(self.devices))
        weights = [v.value for v in self.model.trainable_variables]
        state = [v.value for v in self.model.non_trainable_variables]
        loss_sums, outputs = [], []
        for i, (tower, shard) in enumerate(zip(self.devices, shards)):
            with tf.device(tower), tf.name_scope(f"tower_{i}"):
                y_pred, _, regularization = forward(
                    self.model, devices_lib.broadcast_weights(weights, tower),
                    devices_lib.broadcast_weights(state, tower), shard[0], training=False)
                _, y, sample_weight = split.unpack_batch(shard)
                loss_sums.append(tf.reduce_sum(
                    losses.per_example_loss(self.loss, y, y_pred, sample_weight)))
                outputs.append(y_pred)
        with tf.device(self.main_device):
            y_pred = tf.nest.map_structure(lambda *parts: tf.concat(parts, 0), *outputs)
            loop.update_metrics(self.metrics, batch, y_pred, self.main_device)
            return tf.add_n(loss_sums), tf.cast(split.batch_size(batch), tf.float32), regularization

    def _prepare(self, batch, kind):
        """Checks a batch; returns it as Tensors and the compiled `kind` step for it.

        The step is traced once per batch structure with dim 0 left as None, so
        uneven and short batches reuse it. Training batches must all share the
        structure, dtypes and feature shapes of the first one.
        """
        split.unpack_batch(batch)
        batch = tuple(tf.nest.map_structure(_as_tensor, tuple(batch)))
        if split.batch_size(batch) == 0:
            raise ValueError("the batch is empty (batch size 0); give at least one example.")
        spec = tf.nest.map_structure(
            lambda t: tf.TensorSpec([None] + t.shape[1:].as_list(), t.dtype), batch)
        if not self._functions:
            self._first_batch_setup(batch)
        if kind == "train" and self._train_spec is None:
            self._train_spec = spec
        if kind == "train" and not _same_spec(spec, self._train_spec):
            raise ValueError(
                f"this batch's structure, dtypes or feature shapes {_spec_text(spec)} differ "
                f"from the first batch's {_spec_text(self._train_spec)}; every batch must "
                "match (only the batch size may change).")
        key = (kind, _spec_text(spec))
        if key not in self._functions:
            step = self._compiled_train_step if kind == "train" else self._compiled_eval_step
            self._functions[key] = tf.function(step, input_signature=[spec])
        return batch, self._functions[key]

    def _first_batch_setup(self, batch):
        """Builds model and optimizer on the main device and checks the loss, eagerly."""
        x, y, sample_weight = split.unpack_batch(tf.nest.map_structure(lambda t: t[:1], batch))
        with tf.device(self.main_device):
            try:
                y_pred = self.model(x, training=False)
                losses.per_example_loss(self.loss, y, y_pred, sample_weight)
            except (tf.errors.OpError, TypeError) as error:
                message = getattr(error, "message", str(error)).strip().splitlines()[0]
                raise ValueError(
                    f"the model or the loss failed on the first example of the batch: "
                    f"{message}. Check that x matches the model's inputs and y its outputs.") from None
            self._check_model()
            if not self.optimizer.built:
                self.optimizer.build(self.model.trainable_variables)
        loop.build_metrics(self.metrics, y, y_pred)

    def _check_model(self):
        if not self.model.trainable_variables:
            raise ValueError(
                f"model {self.model.name!r} has no trainable weights, so there is nothing to "
                "train; check that its layers are built and not frozen (trainable=False).")
        misplaced = sorted({v.value.device for v in self.model.variables
                            if devices_lib.canonical_name(v.value.device) != self.main_device})
        if misplaced:
            logging.warning(
                "model %r has variables on %s, not on main_device %s; they stay there. To "
                "keep them on the main device, build the model inside `with tf.device(%r):`.",
                self.model.name, misplaced, self.main_device, self.main_device)


def _as_tensor(value):
    tensor = tf.convert_to_tensor(value)
    # NumPy's default float64 would make a float64 graph; Keras models compute in floatx.
    return tf.cast(tensor, keras.config.floatx()) if tensor.dtype == tf.float64 else tensor


def _same_spec(a, b):
    try:
        tf.nest.assert_same_structure(a, b)
    except (ValueError, TypeError):
        return False
    return all(x == y for x, y in zip(tf.nest.flatten(a), tf.nest.flatten(b)))


def _spec_text(spec):
    return str(tf.nest.map_structure(lambda s: f"{s.dtype.name}{s.shape.as_list()}", spec))
