"""TowerTrainer: the tower step compiled once, with batch checks, metrics and the loop."""

import contextlib
import functools

import tensorflow as tf

from towers import errors
from towers.data_parallel import split
from towers.engine import losses
from towers.engine.options import TowerOptions
from towers.model_parallel import stages as stages_lib
from towers.multi_worker import cluster as cluster_lib
from towers.op_parallel import grid as op_grid
from towers.training import arguments, callbacks as callbacks_lib, compiled, compiled_steps
from towers.training import executions, first_batch, graph_rewrites, in_graph_loop, inputs
from towers.training import loop
from towers.training import metrics as metrics_lib, on_batch, outcomes, overrides, placement
from towers.training import predict as predict_lib, prefetch
from towers.training import recompute as recompute_lib, row_counts, trainable, worker_signals


class TowerTrainer:
    """Trains a Keras model data-parallel over tower devices, one explicit step at a time.

    Attributes:
      model, loss: as given (loss set once: reassigning it is refused).
      objective: the loss as computed (a losses.Objective): `loss` and
        `loss_weights` in every form keras.Model.compile takes them.
      optimizer: as given, wrapped in keras.optimizers.LossScaleOptimizer when
        the model computes in float16 (a mixed_float16 policy) and it is not one.
      devices: tower device names, e.g. ["/device:CPU:0", "/device:CPU:1"]; with
        pipeline_cuts a grid, one row per tower and one device per stage (with
        split layers, each tower's first part's device).
      main_device: where the variables live and the gradients are averaged
        (with pipeline stages: stage 0's; stage k's is devices[0][k]).
      pipeline_cuts: None, or the names or paths of the layers the model is cut after
        (towers.split_model); stage k's variables and optimizer slots then
        live on devices[0][k], and its update is applied there.
      options: a TowerOptions (engine/options.py), the one given as options= or built
        from the keyword options (aggregation, variable_placement, accum_steps,
        recompute, batch_statistics, ...).
      recomputed_layers: the layers recompute names ([] for False or "stages").
      metrics: a metrics.Metrics: `metrics` and `weighted_metrics` in every form
        keras.Model.compile takes them, updated on every train and evaluation
        batch; indexing or iterating it gives the Keras metric objects.
      jit_compile: whether each tower's forward and backward is compiled by XLA on
        its device (with stages: each stage's, per micro-batch).
      steps_per_execution: steps fit runs per call of one compiled function (an
        in-graph loop over a tf.data iterator; see train_steps).
      prefetch_to_devices: whether fit stages each shard of a tf.data.Dataset's batch on
        its tower's device while the previous step runs ("auto": where it is a GPU).
      cluster: None, or the joined towers.Cluster this process is a worker of: each
        batch is then this worker's batch, and every worker applies the same update
        of the whole global batch.
      num_towers: towers in a step: this process's, or with a cluster every
        worker's (counted at the first step; before it, this worker's).
      setup: the step's engine.step.StepSetup (devices, stages, options;
        its first-batch fields are filled in by the first step).
      signals: with a cluster, its worker_signals.WorkerSignals (the stop request
        and the end of this worker's data, which every step all-reduces), else None.
      row_counts: a row_counts.RowCounts: whether a step is traced for its batch's rows
        (where its batches keep them) or for any rows; fit, evaluate and predict tell it.
    """
    loss = arguments.SetOnce()

    def __init__(self, model, loss=None, optimizer=None, devices=None, main_device=None, *,
                 options=None, **keywords):
        """keywords: compile's (metrics, weighted_metrics, loss_weights), the trainer's
        own (jit_compile, cluster, pipeline_cuts, steps_per_execution,
        prefetch_to_devices) and TowerOptions' fields, each as the attributes say;
        TowerOptions' fields either as keywords or as one `options`. A compiled model
        gives what compile was given where loss, optimizer or compile's keywords are not."""
        loss, optimizer, compiled = arguments.compiled_defaults(model, loss, optimizer)
        keywords, option_keywords = arguments.trainer_keywords(keywords, compiled)
        metrics, weighted_metrics, loss_weights, jit_compile, cluster, pipeline_cuts, \
            steps_per_execution, prefetch_to_devices = keywords.values()
        arguments.check_model(model, jit_compile)
        output_names = getattr(model, "output_names", None)
        self.objective = losses.Objective(loss, loss_weights, output_names)
        self.metrics = metrics_lib.Metrics(metrics, weighted_metrics, output_names)
        optimizer = arguments.keras_optimizer(optimizer, model)
        self.options = TowerOptions.given(options, option_keywords)
        placement_option = self.options.variable_placement
        self.pipeline_cuts = stages_lib.check_pipeline(pipeline_cuts, main_device,
                                                       placement_option)
        op_grid.check_split_model(model, optimizer, placement_option, jit_compile)
        arguments.check_cluster_placement(cluster, self.options, model)
        self.recomputed_layers = recompute_lib.recomputed_layers(model, self.options.recompute,
                                                                 jit_compile)
        self.setup, self.devices = placement.step_setup(model, devices, main_device,
                                                        self.pipeline_cuts, self.options, cluster)
        self.main_device = self.setup.main_device
        self.steps_per_execution = executions.check_steps_per_execution(steps_per_execution)
        self.prefetch_to_devices = prefetch.resolved(prefetch_to_devices, self.input_devices)
        self.jit_compile = jit_compile
        self.cluster = cluster
        self._watchdog = None if cluster is None else cluster_lib.watchdog(cluster)
        self.signals = None if cluster is None else worker_signals.WorkerSignals(cluster)
        self.num_towers = self.setup.mesh.num_towers
        self.model, self.loss, self.optimizer = model, loss, optimizer
        self._skipped_steps = 0
        self.graph_rewrites = graph_rewrites.GraphRewrites(
            self.setup.mesh.all_devices() + [self.main_device],
            lambda: self.setup.compiled_tower is not None and self.setup.compiled_tower.optimised,
            lambda: compiled_steps.inference_traced_once(self.setup))
        self.row_counts = row_counts.RowCounts()
        self._compiled = self._no_compiled_functions()
        # A subclass built by model.build(shape) may hold no variable yet: its layers
        # build on the first batch, where it is checked, as Keras's fit builds them.
        if model.built and model.variables:
            first_batch.check_model(self)

    @property
    def num_stages(self):
        """Pipeline stages each tower's model is cut into (1 without pipeline_cuts)."""
        return self.setup.mesh.num_stages

    @property
    def input_devices(self):
        """Where each tower's shard enters it: its device (with stages, its first stage's)."""
        return self.setup.mesh.stage(0)

    @property
    def optimized_variables(self):
        """The variables the optimizer updates, and builds its slots for:
        model.trainable_variables, except that a variable variable_placement="spread"
        holds as slabs across towers is there as its slabs (one per tower holding rows of
        it); in a cluster, only this worker's own of those (Columns.owned_variables)."""
        if self.setup.columns is None:  # not built yet: nothing is held as slabs
            return self.model.trainable_variables
        return self.setup.columns.owned_variables()

    @property
    def step(self):
        """Optimizer steps applied so far (int); skipped steps do not count."""
        return int(self.optimizer.iterations.numpy())

    def train_step(self, batch, data_ended=False):
        """Runs one tower step on a global batch; returns logs as Python floats.

        Args:
          batch: (x, y) or (x, y, sample_weight); arrays or Tensors, dim 0 = the
            global batch size, any size >= 1. Or the batch's split.Shards, one
            per tower, from shard_iterator.
          data_ended: with a cluster, True where this worker has no batch left
            while others may: `batch` is then its empty part
            (split.empty_like(a batch)), or None for the last batch's.

        Returns:
          {"loss": the batch's loss as keras.Model.train_on_batch computes it
           (+ regularisation), each loss term's ("cls_loss", ...) where the loss
           has several, "examples": the batch's rows (0 for a step skipped as not
           finite, which enters no log and no metric), metric results...,
           "skipped_steps": steps skipped so far (non-finite, or a float16
           overflow that lowered the loss scale), "loss_scale" with loss scaling}.

        With a cluster, `batch` is this worker's batch (it may be empty), "loss",
        "examples" are the global batch's, "stop_requested" is 1.0 once any worker
        called request_stop, and "data_ended" is 1.0 when every worker's data has
        ended: the step then had no rows, applied nothing and counts for nothing.

        Raises:
          ValueError: a malformed batch; nothing runs.
          WorkerLostError: with a cluster, another worker stopped answering.
          NonFiniteError: on_nonfinite="raise" and the loss or gradients are
            NaN/Inf (with loss scaling: the loss); weights and optimizer state
            are left as they were. With "skip": weights made NaN/Inf outside the
            step (outcomes.check_weights_finite).
        """
        if not isinstance(data_ended, bool):
            raise ValueError(f"data_ended must be True or False, got {type(data_ended).__name__}; "
                             "train_step takes the batch as one argument: train_step((x, y)).")
        if data_ended and self.cluster is None:
            raise ValueError("data_ended=True is for a worker of a cluster whose data "
                             "ended before the others'; without a cluster stop stepping.")
        if self.signals is not None:
            batch = self.signals.mark_data_ended(batch, data_ended)
        with self._watched():
            batch, key = self._prepare(batch, "train")
            logs = self._compiled.call(key, batch)
        finite, applied = bool(logs.pop("finite")), bool(logs.pop("applied"))
        self._skipped_steps += outcomes.after_step(self, logs, finite, applied)
        logs["skipped_steps"] = self._skipped_steps
        return logs

    def reset_metrics(self):
        """Resets the metrics, as keras.Model.reset_metrics: train_step's and
        train_steps' metric logs run over every call since the last reset (fit and
        evaluate reset them at each epoch's start and each evaluation's)."""
        self.metrics.reset()

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

        One compiled function loops over the iterator in the graph (no Python between
        steps; the end of the data ends it early), each step exactly train_step's; the
        first call ever runs one step eagerly set up, as train_step does. `iterator` may
        be a shard_iterator. A batch too small to give every micro-batch a row ends the
        loop and runs after it, as train_step runs it (in_graph_loop.compiled_loop). With a
        cluster the end of this worker's data does not end the call: it takes part in the
        others' steps with empty parts until every worker's has ended (that step trains on
        nothing, is not counted and sets "data_ended").

        Returns:
          train_step's logs over the steps run: "loss" their mean over their
          examples, each loss term's the mean over the steps (as Keras's reads),
          plus "steps" (how many ran, 0 when the data had ended), "examples" and
          "logged_steps" (those in the logs); with a cluster "worker_batches",
          the steps this worker had a batch for.

        Raises:
          ValueError: `iterator` is not a tf.data iterator or shard_iterator,
            `num_steps` not an integer >= 1, or its batches (their element_spec,
            of a structure not seen before) do not fit the model or the loss, as
            train_step says of such a batch; nothing runs, no batch is taken.
          ValueError / NonFiniteError: a batch of no rows or fractional class ids
            (outcomes.py), or on_nonfinite="raise" and a step not finite; the steps
            before it in this call are applied, it and later ones not.
        """
        in_graph_loop.check_call(iterator, num_steps)
        if self.setup.trainable_ids is None:
            return in_graph_loop.first_call(self, iterator)
        self._follow_trainable()
        if isinstance(iterator, prefetch.ShardIterator):
            iterator = iterator.multi_device_iterator  # a tf.function argument, like tf.data's
        key = ("steps", type(iterator).__name__, compiled.spec_text(iterator.element_spec))
        # Batches of a new structure are checked before the loop is traced for them, as
        # train_step checks a new batch, on their element_spec: no batch is taken.
        self._compiled.add(key, in_graph_loop.compiled_loop, self, check=functools.partial(
            first_batch.check_spec, self, iterator.element_spec))
        with self._watched():
            logs = self._compiled.call(key, iterator, tf.constant(num_steps, tf.int32))
        logs, held = logs if isinstance(logs, tuple) else (logs, None)
        if self.signals is not None:
            self.signals.looped()
        steps, skipped = int(logs.pop("steps")), int(logs.pop("skipped"))
        self._skipped_steps += skipped
        outcomes.after_steps(self, logs, steps, skipped)
        logs, steps = in_graph_loop.with_held_step(self, logs, steps, held)
        return {**logs, "steps": steps, "skipped_steps": self._skipped_steps}

    def request_stop(self):
        """Asks every worker to stop after the next step (fit calls it on SIGTERM/SIGINT).

        The step all-reduces the request, so all workers see it after the same
        step and its "stop_requested" log is True on each. Without a cluster
        there is nothing to agree on, and fit stops by itself.
        """
        if self.signals is not None:
            self.signals.stop_requested.assign(1.0)

    def evaluate(self, x=None, y=None, batch_size=None, verbose="auto", sample_weight=None,
                 steps=None, callbacks=None, return_dict=True):
        """keras.Model.evaluate, its arguments and result (a dict of floats; Keras's list
        with return_dict=False): the data in any form training/inputs.py lists, at most
        `steps` batches, callbacks' on_test_* hooks called (see loop.evaluate)."""
        data = inputs.data("x", x, y, sample_weight, batch_size=batch_size)
        steps = None if steps is None else errors.positive_integer("steps", steps)
        logs = loop.evaluate(self, data, steps, callbacks_lib.evaluate_list(
            self, callbacks, verbose, steps or data.num_batches))
        return loop.keras_logs(self, logs, return_dict)

    def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None,
            validation_split=0.0, validation_data=None, shuffle=True, class_weight=None,
            sample_weight=None, initial_epoch=0, steps_per_epoch=None, validation_steps=None,
            validation_batch_size=None, validation_freq=1, *, max_steps=None,
            checkpointer=None, log_dir=None):
        """Trains for `epochs` epochs; returns a keras.callbacks.History.

        keras.Model.fit's arguments, meant as it means them (x may also be a callable
        epoch -> batches), then towers' own: `max_steps`, `checkpointer` (resumes and
        saves), `log_dir` (TensorBoard summaries). See towers.training.loop.fit.
        """
        return loop.fit(self, x, y, batch_size, epochs, verbose, callbacks, validation_split,
                        validation_data, shuffle, class_weight, sample_weight, initial_epoch,
                        steps_per_epoch, validation_steps, validation_batch_size,
                        validation_freq, max_steps=max_steps, checkpointer=checkpointer,
                        log_dir=log_dir)

    def predict(self, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
        """keras.Model.predict, every tower its shard of each batch (training/predict.py)."""
        return predict_lib.predict(self, x, batch_size, verbose, steps, callbacks)

    def predict_on_batch(self, x):
        """keras.Model.predict_on_batch: each tower's outputs for its shard, in row order."""
        overrides.check_can_predict(self.model)
        batch, key = self._prepare((x,), "predict")
        return self._compiled.call(key, batch)

    def train_on_batch(self, x, y=None, sample_weight=None, class_weight=None,
                       return_dict=False):
        """keras.Model.train_on_batch: train_step, the metrics reset first (on_batch.py)."""
        return on_batch.train_on_batch(self, x, y, sample_weight, class_weight, return_dict)

    def test_on_batch(self, x, y=None, sample_weight=None, return_dict=False):
        """keras.Model.test_on_batch: eval_step, the metrics reset first (on_batch.py)."""
        return on_batch.test_on_batch(self, x, y, sample_weight, return_dict)

    def eval_step(self, batch):
        """One evaluation batch: its logs as train_step computes them, without a step
        ("loss", each loss term's, "examples", the metrics' results), as floats."""
        batch, key = self._prepare(batch, "eval")
        return outcomes.after_eval(self._compiled.call(key, batch))

    def _watched(self):
        """With a cluster: the next call under the watchdog (a lost worker ends it)."""
        return self._watchdog.step(self.step + 1) if self._watchdog else contextlib.nullcontext()

    def sync_replicas(self):
        """Does nothing: kept for code written when replicas (variable_placement="replicated")
        needed this after set_weights. Every step now refreshes them before the towers read."""

    def _prepare(self, batch, kind):
        """Checks a batch; returns it as Tensors and the key of the compiled `kind` step
        ("train", "eval", or "predict", whose batch is (x,)) for it, traced once per batch
        structure and variant (_step_for; compiled_steps.variant)."""
        self._follow_trainable()
        if compiled.is_checkable(batch):  # Tensors: a batch of a known shape is cheap
            key = self._compiled.known(kind, batch)
            if key is not None:
                return batch, key
        if isinstance(batch, split.Shards):
            batch = split.Shards(split.checked_batch(shard) for shard in batch)
        else:  # predict's batch is (x,)
            batch = split.as_batch(batch) if kind == "predict" else split.checked_batch(batch)
        if self.cluster is None:
            split.check_not_empty(batch)
        if self.signals is not None and kind == "train":
            self.signals.trained_on(batch)
        # A batch of a new structure is checked before its step is traced: the first by
        # set_up, later ones by check_batch (a trace would say what fails in 20 lines).
        check = functools.partial(first_batch.check_batch, self)
        if kind == "predict" and self.setup.trainable_ids is None:  # before the first step
            first_batch.set_up_to_predict(self, batch)
        elif self.setup.trainable_ids is None:
            first_batch.set_up(self, batch)
            check = None
        if kind == "train":
            self.setup.statistics.warn_single_rows(compiled_steps.micro_batch_rows(self.setup,
                                                                                   batch))
        return batch, self._step_for(kind, batch, check)

    def _step_for(self, kind, batch, check=None, may_be_empty=None):
        """The key of the compiled `kind` step for batches as `batch`, traced now where
        new: its compiled_steps.variant, or where its rows are known only when it runs
        the one for any rows that skips empty micro-batches where may_be_empty says."""
        variant = compiled_steps.variant(self.setup, kind, batch, self.row_counts)
        if may_be_empty is not None and not variant.rows_known:
            variant = compiled_steps.any_rows_variant(kind, may_be_empty)
        return self._compiled.for_batch(
            kind, batch, compiled_steps.body(self, kind, variant), check,
            packed=kind != "predict", name=variant.name, rows_known=variant.rows_known)

    def traced_step_logs(self, batch, may_be_empty):
        """In a function as it is traced (in_graph_loop.compiled_loop): the logs of the
        train step compiled for batches as `batch`, called, its Python not run again."""
        return self._compiled.logs_within(self._step_for("train", batch,
                                                         may_be_empty=may_be_empty), batch)

    def _follow_trainable(self):
        """After the first batch: a layer frozen or unfrozen since the steps were set up
        sets them up again for the new trainable set, to be traced anew. A variable this
        trainer held as slabs and someone made whole is refused (Columns.check_held)."""
        if self.setup.columns is not None:
            self.setup.columns.check_held()
        if self.setup.trainable_ids is not None and trainable.changed(self):
            trainable.set_up_for_trainable(self)
            self._compiled = self._no_compiled_functions()

    def _no_compiled_functions(self):
        """A fresh set of compiled functions: traced under the step's hooks (placement),
        optimised with graph_rewrites'."""
        return compiled.CompiledFunctions(functools.partial(placement.step_hooks, self),
                                          self.graph_rewrites.calls, self.jit_compile)
