"""TowerTrainer: the tower step compiled once, with batch checks, metrics and the loop."""

import contextlib
import functools

import keras
import tensorflow as tf
from absl import logging

from towers import aggregate, cluster as cluster_lib, compiled, devices as devices_lib, errors
from towers import exchange, executions, losses, loop, prefetch, split, stages as stages_lib
from towers import tower
from towers.errors import NonFiniteError
from towers.step import TowerOptions, apply_update, assign_state, broadcast_stages, clip_gradients
from towers.step import run_towers

_EMPTY_BATCH = "the batch is empty (batch size 0); give at least one example."


class TowerTrainer:
    """Trains a Keras model data-parallel over tower devices, one explicit step at a time.

    Attributes:
      model, loss: as given.
      optimizer: as given, wrapped in keras.optimizers.LossScaleOptimizer when
        the model computes in float16 (a mixed_float16 policy) and it is not one.
      devices: tower device names, e.g. ["/device:CPU:0", "/device:CPU:1"]; with
        pipeline_cuts a grid, one row per tower and one device per stage.
      main_device: where the variables live and the gradients are averaged
        (with pipeline stages: stage 0's; stage k's is devices[0][k]).
      pipeline_cuts: None, or the names of the layers the model is cut after
        (towers.split_model); stage k's variables and optimizer slots then
        live on devices[0][k], and its update is applied there.
      options: a TowerOptions (aggregation, pack_gradients, variable_placement,
        accum_steps, clip_global_norm, sparse_policy, state_policy, on_nonfinite,
        micro_batches, pipeline_schedule).
      metrics: Keras metrics updated on every train and evaluation batch.
      jit_compile: whether each tower's forward and backward (all its
        micro-batches) is compiled by XLA as one computation on its device
        (with pipeline stages: each stage's, per micro-batch, on its device);
        split, gather, average and apply stay as they are.
      steps_per_execution: steps fit runs per call of one compiled function (an
        in-graph loop over a tf.data iterator; see train_steps).
      prefetch_to_devices: whether fit splits each batch of a tf.data.Dataset
        in the input pipeline and stages every shard on its tower's device
        while the previous step runs (shard_iterator). The default "auto" is
        True where a tower's input device is not a CPU (a GPU).
      cluster: None, or the joined towers.Cluster this process is a worker of:
        each batch is then this worker's part of the global batch, and every
        worker applies the same update of the whole global batch.
    """

    def __init__(self, model, loss, optimizer, devices=None, main_device=None, *,
                 metrics=(), aggregation="main", pack_gradients=False,
                 variable_placement="main", accum_steps=1, clip_global_norm=None,
                 sparse_policy="keep", state_policy="mean", on_nonfinite="raise",
                 jit_compile=False, cluster=None, pipeline_cuts=None, micro_batches=1,
                 pipeline_schedule="gpipe", steps_per_execution=1,
                 prefetch_to_devices="auto"):
        if not isinstance(model, keras.Model):
            raise ValueError(f"model must be a keras.Model, got {type(model).__name__}.")
        losses.check_loss(loss)
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise ValueError(
                f"optimizer must be a keras.optimizers.Optimizer, got {type(optimizer).__name__}.")
        self.options = TowerOptions(accum_steps=accum_steps, clip_global_norm=clip_global_norm,
                                    sparse_policy=sparse_policy, state_policy=state_policy,
                                    on_nonfinite=on_nonfinite, aggregation=aggregation,
                                    pack_gradients=pack_gradients,
                                    variable_placement=variable_placement,
                                    micro_batches=micro_batches,
                                    pipeline_schedule=pipeline_schedule)
        if model.compute_dtype == "float16" and not isinstance(
                optimizer, keras.optimizers.LossScaleOptimizer):
            # float16 gradients underflow without loss scaling; Keras's compile() wraps too.
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
        devices = devices_lib.default_devices() if devices is None else list(devices)
        self.pipeline_cuts = stages_lib.check_pipeline(pipeline_cuts, main_device,
                                                       variable_placement)
        self._grid = devices_lib.device_grid(
            devices, None if self.pipeline_cuts is None else len(self.pipeline_cuts) + 1)
        self.devices = ([row[0] for row in self._grid] if self.pipeline_cuts is None
                        else self._grid)
        self.main_device = devices_lib.canonical_name(main_device or self._grid[0][0])
        # Stage k's main device: where its variables live and its gradients meet.
        self._stage_devices = [self.main_device] + list(self._grid[0][1:])
        devices_lib.check_devices_exist(sum(self._grid, []) + [self.main_device])
        for k in range(len(self._stage_devices)):
            exchange.check_aggregation(aggregation, [row[k] for row in self._grid])
        if isinstance(steps_per_execution, bool) or not isinstance(steps_per_execution, int) \
                or steps_per_execution < 1:
            raise ValueError(f"steps_per_execution must be an integer >= 1, got "
                             f"{steps_per_execution!r}.")
        self.steps_per_execution = steps_per_execution
        if not (isinstance(prefetch_to_devices, bool) or prefetch_to_devices == "auto"):
            raise ValueError(f"prefetch_to_devices must be True, False or 'auto', got "
                             f"{prefetch_to_devices!r}.")
        if prefetch_to_devices == "auto":
            # Logical CPU devices share the host's memory: staging copies nothing there
            # and only adds host work (benchmarks/RESULTS.md, issue 12).
            prefetch_to_devices = any(tf.DeviceSpec.from_string(d).device_type != "CPU"
                                      for d in self.input_devices)
        self.prefetch_to_devices = prefetch_to_devices
        self.jit_compile = bool(jit_compile)
        self.cluster = cluster
        self._watchdog = None if cluster is None else cluster_lib.watchdog(cluster)
        self._stop_requested = None  # with a cluster: a host variable, 1 once a stop is asked
        if cluster is not None:
            with tf.device(cluster_lib.HOST_DEVICE):
                self._stop_requested = tf.Variable(0.0, trainable=False, name="stop_requested")
        self._first_tower = 0  # global index of this worker's first tower
        self._num_towers = len(self._grid)
        self.model, self.loss, self.optimizer = model, loss, optimizer
        self._stages = None  # a stages.Stages, once the model is built
        self.metrics = loop.resolve_metrics(metrics)
        self._skipped_steps = 0
        self._compiled = compiled.CompiledFunctions()
        self._densify = None  # per variable: densify its sparse gradient on the tower
        self._replicas = None  # a devices.Replicas with variable_placement="replicated"
        self._compiled_tower = None  # with jit_compile: tower.compiled_tower's function
        if len(self._stage_devices) > 1:
            stages_lib.update_on_variable_devices(self.optimizer)
        if model.built:
            self._check_model()

    @property
    def num_stages(self):
        """Pipeline stages each tower's model is cut into (1 without pipeline_cuts)."""
        return len(self._stage_devices)

    @property
    def num_towers(self):
        """Towers in a step: this process's, or with a cluster every worker's.

        Every worker's are counted at the first step; before it, this worker's.
        """
        return self._num_towers

    @property
    def input_devices(self):
        """Where each tower's shard enters it: its device (with stages, its first stage's)."""
        return [row[0] for row in self._grid]

    @property
    def step(self):
        """Optimizer steps applied so far (int); skipped steps do not count."""
        return int(self.optimizer.iterations.numpy())

    def train_step(self, batch):
        """Runs one tower step on a global batch; returns logs as Python floats.

        Args:
          batch: (x, y) or (x, y, sample_weight); arrays or Tensors, dim 0 = the
            global batch size, any size >= 1. Or the batch's split.Shards, one
            per tower, from shard_iterator.

        Returns:
          {"loss": mean loss over the batch (+ regularisation), "examples": the
           batch's rows, metric results..., "skipped_steps": steps skipped so far
           (non-finite, or a float16 overflow that lowered the loss scale),
           "loss_scale" with loss scaling}.

        With a cluster, `batch` is this worker's part of the global batch (it
        may be empty), "loss", "examples" are the global batch's, and
        "stop_requested" is 1.0 once any worker called request_stop.

        Raises:
          ValueError: a malformed batch; nothing runs.
          WorkerLostError: with a cluster, another worker stopped answering.
          NonFiniteError: on_nonfinite="raise" and the loss or gradients are
            NaN/Inf (with loss scaling: the loss); weights and optimizer state
            are left as they were.
        """
        with self._watched():
            batch, key = self._prepare(batch, "train")
            logs = self._call(key, batch)
        finite, applied = bool(logs.pop("finite")), bool(logs.pop("applied"))
        if not finite and self.options.on_nonfinite == "raise":
            raise self._nonfinite_error()
        self._skipped_steps += not applied
        logs["skipped_steps"] = self._skipped_steps
        return logs

    def shard_iterator(self, dataset, buffer_size=1):
        """A prefetch.ShardIterator: `dataset`'s global batches as split.Shards, each
        tower's shard staged on its input device `buffer_size` batches ahead.

        train_step and train_steps take it (or what it yields) as they take a
        dataset's iterator (or a batch), and skip step 1.
        """
        return prefetch.ShardIterator(dataset, self.input_devices,
                                      source_device=cluster_lib.HOST_DEVICE,
                                      buffer_size=buffer_size)

    def train_steps(self, iterator, num_steps):
        """Up to `num_steps` steps on batches from a tf.data iterator, in one call.

        One compiled function loops over the iterator in the graph (no Python
        between steps; the end of the data ends the loop early), each step
        exactly train_step's. The first call ever runs one step eagerly set
        up, as train_step does. `iterator` may be a shard_iterator.

        Returns:
          logs as train_step's, over the steps run: "loss" is their mean over
          their examples (the metrics run on, as ever), plus "steps" (how many
          ran, 0 when the data had ended) and "examples".

        Raises:
          NonFiniteError: on_nonfinite="raise" and a step was not finite; the
            steps before it in this call are applied, it and later ones not.
        """
        if self._compiled.empty:
            batch = next(iterator, None)
            if batch is None:
                return {"steps": 0}
            return {**self.train_step(batch), "steps": 1}
        if isinstance(iterator, prefetch.ShardIterator):
            iterator = iterator.multi_device_iterator  # a tf.function argument, like tf.data's
        key = ("steps", type(iterator).__name__, compiled.spec_text(iterator.element_spec))
        self._compiled.add(key, functools.partial(executions.compiled_loop, self))
        with self._watched():
            logs = self._call(key, iterator, tf.constant(num_steps, tf.int32))
        steps, skipped = int(logs.pop("steps")), int(logs.pop("skipped"))
        self._skipped_steps += skipped
        if logs.pop("nonfinite"):
            raise self._nonfinite_error()
        return {**logs, "steps": steps, "skipped_steps": self._skipped_steps}

    def request_stop(self):
        """Asks every worker to stop after the next step (fit calls it on SIGTERM/SIGINT).

        The step all-reduces the request, so all workers see it after the same
        step and its "stop_requested" log is True on each. Without a cluster
        there is nothing to agree on, and fit stops by itself.
        """
        if self._stop_requested is not None:
            self._stop_requested.assign(1.0)

    def evaluate(self, data):
        """Mean loss (+ metrics) over a batch, a tf.data.Dataset or an iterable of batches."""
        return loop.evaluate(self, data)

    def fit(self, dataset, epochs=1, steps_per_epoch=None, validation_data=None, *,
            max_steps=None, checkpointer=None, log_dir=None, verbose="auto", callbacks=None):
        """Trains for `epochs` epochs over `dataset`; returns a keras.callbacks.History.

        See towers.loop.fit for every argument: `dataset` may be a callable
        epoch -> batches, `checkpointer` resumes and saves, `log_dir` gets
        TensorBoard summaries, `callbacks` are Keras callbacks.
        """
        return loop.fit(self, dataset, epochs=epochs, steps_per_epoch=steps_per_epoch,
                        validation_data=validation_data, max_steps=max_steps,
                        checkpointer=checkpointer, log_dir=log_dir, verbose=verbose,
                        callbacks=callbacks)

    def eval_step(self, batch):
        """Sum of per-example losses, example count and regularisation for one batch."""
        batch, key = self._prepare(batch, "eval")
        return self._call(key, batch)

    def _compiled_train_step(self, batch, may_be_empty):
        # The step's collective ops take keys derived from the step and the model, the
        # same on every worker whatever else each traced (exchange.instance_keys).
        with exchange.instance_keys(("train_step", cluster_lib.model_signature(self.model))):
            return self._train_step_graph(batch, may_be_empty)

    def _compiled_train_step_any_rows(self, batch):
        """The compiled step for a batch whose rows are known only when it runs (an
        in-graph loop's): one tf.cond picks the step that skips empty micro-batches
        only for a batch too small to give each a row."""
        fills = self._fills_every_micro_batch(batch)
        if isinstance(fills, bool):
            return self._compiled_train_step(batch, may_be_empty=not fills)
        if self._num_micro_batches == 1 and self.cluster is None:
            # One micro-batch is empty only when the batch is, which train_step refuses
            # too; an assert costs less than the cond (about 3% of a small step).
            with tf.control_dependencies([tf.debugging.Assert(fills, [_EMPTY_BATCH])]):
                batch = tf.nest.map_structure(tf.identity, batch)
            return self._compiled_train_step(batch, may_be_empty=False)
        return tf.cond(fills, lambda: self._compiled_train_step(batch, may_be_empty=False),
                       lambda: self._compiled_train_step(batch, may_be_empty=True))

    def _fills_every_micro_batch(self, batch):
        """Whether `batch` gives every micro-batch of every tower a row: a bool, or a bool
        scalar Tensor where the rows are known only at run time."""
        micro_batches = self.options.tower_schedule[0]
        return split.smallest_shard_rows(batch, len(self._grid)) >= micro_batches

    @property
    def _num_micro_batches(self):
        """Micro-batches per step: towers x micro-batches per tower."""
        return len(self._grid) * self.options.tower_schedule[0]

    def _train_step_graph(self, batch, may_be_empty):
        scale = self._loss_scale()
        result = run_towers(self._stages, self.loss, batch, self._grid, self._stage_devices,
                            self.options, loss_scale=scale, densify=self._densify,
                            replicas=self._replicas, cluster=self.cluster,
                            first_tower=self._first_tower,
                            compiled_tower=self._compiled_tower,
                            may_be_empty=may_be_empty)                             # 1-6
        with tf.device(self.main_device):
            grads = clip_gradients(result.grads, self.options.clip_global_norm, scale)
            grads_finite = aggregate.all_finite(grads)
            # With loss scaling an overflowing gradient is routine: the
            # LossScaleOptimizer skips it and halves the scale. Only the loss decides.
            finite = aggregate.all_finite([result.loss]) & (grads_finite | (scale is not None))

        def apply():  # step 7, only for a finite step
            apply_update(self.optimizer, grads, self.model.trainable_variables,
                         self.main_device)
            assign_state(self.model, result.state, when=grads_finite)
            return grads_finite

        metric_logs = loop.update_metrics(self.metrics, batch, result.y_pred, self.main_device,
                                          self.cluster)
        exchanged = list(metric_logs.values())
        if self.cluster is not None:
            # A stop signal to any worker stops every worker after this same step.
            [stop_requested] = exchange.all_reduce_across_workers(
                [self._stop_requested.read_value()], self.cluster, cluster_lib.HOST_DEVICE)
            stop_requested = stop_requested > 0
            exchanged.append(stop_requested)
        # Across workers the metrics have an all-reduce of their own: it too comes
        # before the update, so a worker lost during the step leaves the weights alone.
        with tf.control_dependencies(exchanged):
            applied = tf.cond(finite, apply, lambda: tf.constant(False))
        logs = {"loss": result.loss, "finite": finite, "applied": applied,
                "examples": result.examples, **metric_logs}
        if self.cluster is not None:
            logs["stop_requested"] = stop_requested
        if scale is not None:
            logs["loss_scale"] = self.optimizer.dynamic_scale.value
        return logs

    def _call(self, key, *args):
        """Calls the compiled function of `key`; an error that the batch or the model
        caused while it ran becomes a ValueError that says it in one line."""
        try:
            return self._compiled.call(key, *args)
        except (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError) as error:
            if self.jit_compile and errors.is_compile_error(error):
                raise ValueError(  # XLA compiles a tower before it runs: nothing was applied
                    f"XLA cannot compile this model's tower step: {errors.root_cause(error)}. "
                    "Pass jit_compile=False to run it without XLA.") from error
            raise ValueError(f"the step failed: {errors.root_cause(error)}.") from error

    def _watched(self):
        """With a cluster: the next call under the watchdog (a lost worker ends it)."""
        return self._watchdog.step(self.step + 1) if self._watchdog else contextlib.nullcontext()

    def _nonfinite_error(self):
        return NonFiniteError(
            f"step {self.step + 1}: the loss or the averaged gradients are NaN or "
            "Inf, so nothing was applied. Lower the learning rate, check the data, "
            "or pass on_nonfinite='skip' to skip such steps.")

    def _compiled_eval_step(self, batch, may_be_empty):
        shards, shard_sizes, rows = split.shards_of(batch, len(self._grid))
        weights = [v.value for v in self.model.trainable_variables]
        state = [v.value for v in self.model.non_trainable_variables]
        loss_sums, outputs, regularizations = [], [], []
        for i, (row, shard) in enumerate(zip(self._grid, shards)):
            with tf.name_scope(f"tower_{i}"):
                y_pred, regularization = tower.predict(
                    self._stages, broadcast_stages(self._stages, weights, row),
                    broadcast_stages(self._stages, state, row, trainable=False), shard[0],
                    shard_sizes[i], row, may_be_empty)
                with tf.device(row[-1]):
                    _, y, sample_weight = split.unpack_batch(shard)
                    loss_sums.append(tf.reduce_sum(
                        losses.per_example_loss(self.loss, y, y_pred, sample_weight)))
                outputs.append(y_pred)
                regularizations.append(regularization)
        with tf.device(self.main_device):
            loop.update_metrics(self.metrics, batch, tower.concat_rows(outputs), self.main_device)
            # Tower 0 holds the batch's first rows; an empty tower skips its regularisation.
            return tf.add_n(loss_sums), tf.cast(rows, tf.float32), regularizations[0]

    def sync_replicas(self):
        """Does nothing: kept for code written when replicas (variable_placement=
        "replicated") were refreshed after each step and needed this after
        set_weights. Every step now refreshes them before the towers read."""

    def _loss_scale(self):
        """The LossScaleOptimizer's current scale (float32 scalar), or None."""
        if isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer):
            return self.optimizer.dynamic_scale.value
        return None

    def _prepare(self, batch, kind):
        """Checks a batch; returns it as Tensors and the key of the compiled `kind` step
        for it, traced once per batch structure (self._compiled), in two variants: one
        for batches that give every micro-batch a row, one that skips empty ones."""
        if compiled.is_checkable(batch):  # Tensors: a batch of a known shape is cheap
            key = self._compiled.known(self._variant(kind, batch), batch)
            if key is not None:
                return batch, key
        is_shards = isinstance(batch, split.Shards)
        parts = []
        for part in (batch if is_shards else [batch]):
            split.unpack_batch(part)
            parts.append(split.as_batch(part))
        batch = split.Shards(parts) if is_shards else parts[0]
        if split.batch_size(batch) == 0 and self.cluster is None:
            raise ValueError(_EMPTY_BATCH)
        if self._compiled.empty:
            self._first_batch_setup(batch)
        variant = self._variant(kind, batch)
        step = self._compiled_train_step if kind == "train" else self._compiled_eval_step
        may_be_empty = variant != kind
        return batch, self._compiled.for_batch(variant, batch,
                                               lambda batch: step(batch, may_be_empty),
                                               packed=kind == "train")

    def _variant(self, kind, batch):
        """`kind`, or `kind`_with_empty_parts for a batch (Tensors) that leaves a micro-batch
        of a tower without a row."""
        return kind if self._fills_every_micro_batch(batch) is True else f"{kind}_with_empty_parts"

    def _first_batch_setup(self, batch):
        """Builds model and optimizer on the main device and checks the loss, eagerly."""
        shards, _, _ = split.shards_of(batch, len(self._grid))
        first_shard = shards[0]  # holds the batch's first example
        if split.batch_size(first_shard) == 0:  # a worker whose part of the batch is empty
            # One example of zeros builds the model and checks the loss; nothing trains on it.
            first_shard = tf.nest.map_structure(
                lambda t: tf.zeros([1, *t.shape[1:]], t.dtype), first_shard)
        x, y, sample_weight = split.unpack_batch(
            tf.nest.map_structure(lambda t: t[:1], first_shard))
        with tf.device(self.main_device):
            try:
                y_pred = self.model(x, training=False)
                losses.per_example_loss(self.loss, y, y_pred, sample_weight)
            except (tf.errors.OpError, TypeError) as error:
                raise ValueError(
                    f"the model or the loss failed on the first example of the batch: "
                    f"{errors.root_cause(error)}. Check that x matches the model's inputs and y "
                    "its outputs.") from None
            self._check_model()
            if not self.optimizer.built:
                self.optimizer.build(self.model.trainable_variables)
            if self.options.variable_placement == "replicated":
                self._replicas = devices_lib.Replicas(self.model, self.devices)
            self._densify = tower.choose_dense_gradients(
                self.model, self.loss, first_shard, self.options.sparse_policy)
            if self.jit_compile:
                self._compiled_tower = tower.compiled_tower(
                    self._stages, self.loss, *self.options.tower_schedule, self._densify)
        loop.build_metrics(self.metrics, y, y_pred)
        if self.cluster is not None:
            self._first_tower, self._num_towers = cluster_lib.start_together(
                self.cluster, self.model, self.optimizer, self.options, self.main_device,
                len(self._grid))

    def _check_model(self):
        """Checks the built model, cuts it into stages and places each stage's variables."""
        if not self.model.trainable_variables:
            raise ValueError(
                f"model {self.model.name!r} has no trainable weights, so there is nothing to "
                "train; check that its layers are built and not frozen (trainable=False).")
        if self._stages is None:
            self._stages = stages_lib.Stages(self.model, self.pipeline_cuts)
        if self.pipeline_cuts is not None:
            stages_lib.place_variables(self._stages, self._stage_devices, self.optimizer)
        misplaced = sorted({v.value.device for v in self.model.variables
                            if devices_lib.canonical_name(v.value.device) != self.main_device})
        if misplaced and self.pipeline_cuts is None:
            logging.warning(
                "model %r has variables on %s, not on main_device %s; they stay there. To "
                "keep them on the main device, build the model inside `with tf.device(%r):`.",
                self.model.name, misplaced, self.main_device, self.main_device)
