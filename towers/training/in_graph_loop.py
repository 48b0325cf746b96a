"""The in-graph loop: several training steps in one call of one compiled function.

`compiled_loop` is the loop TowerTrainer.train_steps compiles: a tf.while_loop over a
tf.data iterator, each step a call of the one train_step compiled (its Python is not
traced again); a batch too small for every micro-batch comes back to the host
(`with_held_step`). It is written as tf.while_loop and tf.cond, not converted by
autograph: converting its Python took 0.6 s of the first call in every process
(benchmarks/RESULTS.md, "The in-graph loop without autograph"). The trainer's first
call of train_steps ever runs one step as train_step runs it (`first_call`).
"""

import functools

import tensorflow as tf

from towers import errors
from towers.data_parallel import split
from towers.training import compiled_steps, prefetch


def compiled_loop(trainer, iterator, num_steps):
    """Up to num_steps of the trainer's compiled step, in a tf.while_loop over `iterator`.

    Call it inside a tf.function (autograph off); an iteration sets `done` where a
    Python loop would break. Returns the logs trainer.train_steps reads: loss (the
    mean over the examples in the logs) and each loss term's (the mean
    over the steps in the logs, as Keras's per-output trackers read), steps,
    examples and logged_steps (those in the logs: a step that is not finite
    enters none), skipped, nonfinite and the metric results, all Tensors. With a
    cluster, examples are every worker's, stop_requested ends the loop after the
    step every worker sees it in, and the end of this worker's data does not end
    it: the worker takes part with an empty part until every worker's data has
    ended. That last step, which trains on nothing, ends the loop uncounted with
    data_ended; worker_batches counts the steps this worker had a batch for.

    A batch the step refuses ends the loop before it, uncounted, the steps before it
    applied: without a cluster, a batch of no rows (empty_batch; Keras's fit would
    apply an optimizer step of zero gradients, which moves Adam's weights), and
    float class ids that are not whole numbers (fractional_label, NaN where none).
    Where _hands_back_small_batches, a batch too small to give every micro-batch a row
    ends it too, uncounted: it returns (logs with "holds", that batch or an empty one).
    """
    names, cluster = trainer.objective.names, trainer.cluster
    zero, no = tf.constant(0.0), tf.constant(False)
    totals = {"steps": tf.constant(0), "skipped": tf.constant(0), "logged_steps": zero,
              "examples": zero, "loss_sum": zero, "sums": {name: zero for name in names}}
    ends = {"nonfinite": no, "empty_batch": no, "fractional_label": tf.constant(float("nan"))}
    if cluster is not None:
        totals["worker_batches"] = tf.constant(0)
        ends.update(stop_requested=no, data_ended=no)
    # Each step is the one train_step compiled for such batches, called, not traced
    # again. With a cluster its Python is traced into the loop, as it was.
    step = (trainer.traced_step_logs if cluster is None
            else functools.partial(compiled_steps.train_step, trainer))
    hands_back = _hands_back_small_batches(trainer, iterator)
    if hands_back:
        ends.update(holds=no, held=_loop_value(
            prefetch.no_batch_yet(iterator, trainer.input_devices)))

    def stepped(batch, totals, ends):
        """(totals, ends, done) after a step on batch, counted unless refused."""
        logs = (step(batch, False) if hands_back
                else compiled_steps.train_step_any_rows(trainer, batch, step))
        refused = tf.constant(False)
        ends = dict(ends)
        if cluster is not None:  # every worker's data has ended: a step of nothing
            ends["data_ended"] = refused = logs["data_ended"]
        if "fractional_label" in logs:  # not NaN: the step applied nothing
            ends["fractional_label"] = logs["fractional_label"]  # NaN before: no step refused
            refused |= tf.logical_not(tf.math.is_nan(logs["fractional_label"]))
        size = logs["examples"]  # 0 for a step that is not finite (its loss may be NaN)
        logged = tf.cast(size > 0, tf.float32)
        counted = {"steps": totals["steps"] + 1, "examples": totals["examples"] + size,
                   "logged_steps": totals["logged_steps"] + logged,
                   "loss_sum": totals["loss_sum"] + tf.math.multiply_no_nan(logs["loss"], size),
                   "skipped": totals["skipped"] + tf.cast(tf.logical_not(logs["applied"]),
                                                          tf.int32),
                   "sums": {name: totals["sums"][name]
                            + tf.math.multiply_no_nan(logs[name], logged) for name in names}}
        totals = {key: tf.nest.map_structure(functools.partial(tf.where, refused), value,
                                             counted[key]) if key in counted else value
                  for key, value in totals.items()}
        done = refused
        if trainer.options.on_nonfinite == "raise":
            ends["nonfinite"] = tf.logical_not(refused | logs["finite"])
            done |= ends["nonfinite"]
        if cluster is not None:
            ends["stop_requested"] = tf.logical_not(refused) & logs["stop_requested"]
            done |= ends["stop_requested"]
        return totals, ends, done

    def with_batch(batch, totals, ends):
        """The step on batch, or the loop's end before it: without a cluster, a batch of
        no rows (no step: train_step refuses it too), or one too small that is held
        back. A cluster's worker takes part with an empty part."""
        if cluster is not None:
            return stepped(batch, totals, ends)
        stops = {"empty_batch": tf.equal(split.batch_size(batch), 0)}
        if hands_back:  # a batch of rows, too few
            stops["holds"] = tf.logical_not(stops["empty_batch"]) & tf.logical_not(
                compiled_steps.fills_every_micro_batch(trainer.setup, batch))
        stop = functools.reduce(tf.logical_or, stops.values())

        def ended():
            held = {"held": _loop_value(batch)} if hands_back else {}
            return totals, {**ends, **stops, **held}, tf.constant(True)

        return tf.cond(stop, ended, lambda: stepped(batch, totals, ends))

    def body(i, totals, ends, done):
        has_batch, get_batch = prefetch.get_next_as_optional(
            iterator, trainer.input_devices, or_empty=cluster is not None)
        if cluster is not None:
            ended = trainer.signals.data_ended.assign(
                tf.cast(tf.logical_not(has_batch), tf.float32))
            totals = {**totals, "worker_batches": totals["worker_batches"]
                      + tf.cast(has_batch, tf.int32)}
            with tf.control_dependencies([ended]):
                totals, ends, done = with_batch(get_batch(), totals, ends)
        else:
            totals, ends, done = tf.cond(
                has_batch, lambda: with_batch(get_batch(), totals, ends),
                lambda: (totals, ends, tf.constant(True)))
        return i + 1, totals, ends, done

    _, totals, ends, _ = tf.while_loop(
        lambda i, totals, ends, done: tf.logical_and(i < num_steps, tf.logical_not(done)),
        body, (tf.constant(0), totals, ends, tf.constant(False)))
    logs = {"loss": tf.math.divide_no_nan(totals["loss_sum"], totals["examples"]),
            **{name: tf.math.divide_no_nan(totals["sums"][name], totals["logged_steps"])
               for name in names},
            **{key: totals[key] for key in ("steps", "examples", "logged_steps", "skipped")},
            **{key: ends[key] for key in ("nonfinite", "empty_batch", "fractional_label")},
            **trainer.metrics.results()}
    if cluster is not None:
        logs.update(stop_requested=ends["stop_requested"], data_ended=ends["data_ended"],
                    worker_batches=totals["worker_batches"])
    if compiled_steps.loss_scale(trainer.optimizer) is not None:
        logs["loss_scale"] = trainer.optimizer.dynamic_scale.value
    if hands_back:
        return {**logs, "holds": ends["holds"]}, ends["held"]
    return logs


def _loop_value(batch):
    """A batch as a loop variable holds it: split.Shards as a plain list (tf.nest tells
    the two apart; with_held_step makes it Shards again)."""
    return list(batch) if isinstance(batch, split.Shards) else batch


def _hands_back_small_batches(trainer, iterator):
    """Whether compiled_loop ends before a batch too small to give every micro-batch a
    row and gives it back (held), for the host to run as train_step does: where the
    batches' rows are known only as the loop runs, without a cluster, and with more
    than one micro-batch a step (one is empty only when the batch is: an assert). The
    loop then holds only the step for full batches, and the host's step for such a
    batch, traced for its rows (compiled_steps.variant), is traced only when one comes:
    fit's last batch, if ever."""
    return (trainer.cluster is None and compiled_steps.num_micro_batches(trainer.setup) > 1
            and split.rows_vary(iterator.element_spec))


def with_held_step(trainer, loop_logs, steps, held):
    """(logs, steps) of a train_steps call whose loop ran `steps` steps and gave `held`
    back (or None): then held's step, run as train_step runs it, and the logs of both
    as one call's: the loss a mean over their examples, each loss term's over their
    logged steps; the metric results and loss scale the held step's."""
    if not loop_logs.pop("holds", False):
        return loop_logs, steps
    held = split.Shards(held) if isinstance(held, list) else held  # Shards came back a list
    step_logs = trainer.train_step(held)
    step_logged = float(step_logs["examples"] > 0)  # 0 for a step that is not finite

    def mean(name, weight, step_weight):
        # As the loop's sums (multiply_no_nan): a weight of 0 adds nothing, a NaN neither.
        total = loop_logs[name] * weight + (step_logs[name] * step_weight if step_weight else 0)
        return total / (weight + step_weight) if weight + step_weight else 0.0

    merged = {key: value for key, value in step_logs.items() if key != "skipped_steps"}
    merged.update({name: mean(name, loop_logs["logged_steps"], step_logged)
                   for name in trainer.objective.names})
    merged.update(loss=mean("loss", loop_logs["examples"], step_logs["examples"]),
                  examples=loop_logs["examples"] + step_logs["examples"],
                  logged_steps=loop_logs["logged_steps"] + step_logged)
    return merged, steps + 1


def first_call(trainer, iterator):
    """trainer.train_steps' first call ever: one step run as train_step runs it, which
    sets the trainer up eagerly. A resumed cluster worker whose data has ended takes
    part in the others' step with an empty part."""
    trainer.row_counts.from_source("train", iterator)
    batch = next(iterator, None)
    if batch is None and trainer.cluster is None:
        return {"steps": 0}
    if batch is None:
        logs = trainer.train_step(prefetch.empty_batch(iterator, trainer.input_devices),
                                  data_ended=True)
        steps, logs["worker_batches"] = int(not logs["data_ended"]), 0
    else:
        logs, steps = trainer.train_step(batch), 1
    return {**logs, "steps": steps, "logged_steps": float(logs["examples"] > 0)}


def check_call(iterator, num_steps):
    """Raises ValueError, in one line, for what train_steps cannot loop over: anything
    but a tf.data iterator or a ShardIterator, or num_steps not an integer >= 1."""
    if not isinstance(iterator, (tf.data.Iterator, prefetch.ShardIterator)):
        raise ValueError(
            f"iterator must be a tf.data iterator (iter(dataset)) or trainer.shard_iterator("
            f"dataset), got a {type(iterator).__name__}; call train_step for each of other "
            "batches.")
    errors.positive_integer("num_steps", num_steps)
