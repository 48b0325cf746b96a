"""Steps 3 and 4 on one tower: its micro-batches forward and back through its stages.

A `Flight` holds what is in flight on one tower during a step: every
micro-batch's tensors per stage, run in the schedule's order (a control
dependency orders each stage's actions). Activations flow forward from stage to
stage and their gradients flow back.

A loss term whose denominator is counted (a Keras mask: the batch's unmasked
entries) needs every tower's count before its gradient can be scaled. Where the
schedule runs every forward before the first backward (GPipe, or one
micro-batch), the flight stops there (`start`), the step counts every tower's
terms, and the backwards start from each term scaled by its count (`finish`):
one backward, as without a mask. Where a backward must come first (1F1B with
several micro-batches, or a tower compiled whole by XLA), each counted term
gets a backward of its own, its gradients scaled afterwards
(TowerOutput.term_grads, denominators.fold).

With recompute_stages (TowerTrainer's recompute="stages", GPipe's
rematerialisation) a forward records nothing: only each stage's inputs and the
state it read are kept, and its backward runs the forward again under a tape,
after the next stage's cotangents have arrived (training/recompute.py).

The flight runs the schedule; what a stage computes is given to it, as
torch.distributed.pipelining is given the stage module and the loss. `work`
(engine/tower.py's StageWork) has, for the tower's micro-batches:
  micro_batches: how many; counted: the loss terms whose count every tower gives
    (None: not known yet, any may be);
  inputs(m): micro-batch m's model inputs;
  forward(k, m, weights, state, inputs, several_backwards): stage k's forward
    on micro-batch m -> (outputs, new_state, regularization), outputs (y_pred,
    masks) as engine/forward.py's; several_backwards: whether the tape that
    records it may be differentiated more than once;
  targets(k, m, outputs, regularization) -> (share, terms, targets): stage k's share
    of the batch's loss (unscaled; None: nothing), its loss terms on the last
    stage (else None), and what its backward starts from ([share] + the counted
    terms, times the loss scale);
  total(per_micro_terms): the shard's terms; counted_losses(scales, terms): the
    counted terms weighed by their scales; cross_cut(values, masks=None): what
    crosses a cut, copied to the current device; join(y_preds): the outputs'
    rows joined;
  last_stage: None, or fn(m, weights, state, inputs, persistent) -> (run,
    per_pass): the last stage's forward on micro-batch m and every pass's
    backward at once, `last_stage_at_once`'s (one traced function:
    engine/traced_tower.py).

The last stage's backward starts from its own loss, not from gradients another
stage sends, so where it need not wait for the batch's counts its forward and
backward are one call (`last_stage_at_once`), made at its forward's place in the
schedule: under either schedule the last stage then holds one micro-batch's
activations, only during that call, and with recompute it is not rerun.
"""

import collections
import contextlib

import tensorflow as tf

from towers import gradients
from towers.model_parallel import schedule

TowerOutput = collections.namedtuple(
    "TowerOutput", ["grads", "loss", "state", "y_pred", "terms", "term_grads"])
TowerOutput.__doc__ = """What one tower computed, on that tower.

grads: per trainable variable, d(share * loss_scale)/d(weight), None where unused.
loss: float32 scalar, `share`: the shard's share of the batch's loss (unscaled):
    each term's sum over the batch's denominator, times its loss weight, plus
    the regularisation's share (forward.regularization_share: a mean term times rows
    / the batch's rows, a sum term whole). Summed over the towers,
    the grads are the batch's mean gradient and the losses its loss.
state: per non-trainable variable, its new value, None where unchanged.
y_pred: (outputs, masks) for the shard's rows, as forward.forward returns them.
terms: per loss term of the objective, its losses.Term over the shard's rows.
term_grads: [] where the counted terms are in grads and loss; else, per term
    whose denominator is counted, in term order, the gradients of weight * its
    sum * loss_scale, which denominators.fold scales by the batch's count and
    adds to grads (and the term to loss).
"""

Plan = collections.namedtuple("Plan", ["schedule", "count_first", "recompute"])
Plan.__doc__ = """How a tower's flight runs, the same for every tower of a step.

schedule: one of schedule.SCHEDULES.
count_first: whether the batch's counts may come before the backwards (they
  cannot inside one XLA computation, which holds one tower only).
recompute: whether each stage's forward is rerun in its backward, keeping only
  its inputs (TowerTrainer's recompute="stages").
"""


class Flight:
    """One tower's step: `start()` runs the schedule up to where the batch's counts are
    needed, `terms` are then known, `finish(scales)` runs the rest.

    Backwards come in passes where counted terms are differentiated on their own:
    pass 0 starts from the shares of the loss whose denominator is known (and the
    regularisation), pass 1 + c from the c-th counted term, each with its own
    gradients, and its own gradients of a stage's outputs sent back to the stage
    before. Otherwise (no counted term, or counts known before the backwards)
    there is one pass.
    """

    def __init__(self, stages, work, weights, state, devices, plan):
        """stages: the tower's model as a stages.Stages (one stage: the whole model).
        work: what its stages compute (the module's docstring), with the tower's
          micro-batches.
        weights, state: model.trainable_variables / non_trainable_variables values in
          model order, each already on its stage's device of `devices`.
        devices: the tower's device per stage. plan: a Plan."""
        self.stages, self.work, self.devices = stages, work, devices
        num_micro = work.micro_batches
        self.weights = [stages.select(weights, k) for k in range(stages.num_stages)]
        self.state = [stages.select(state, k, trainable=False) for k in range(stages.num_stages)]
        self.changed = [[None] * len(s) for s in self.state]
        self.actions = schedule.build_order(
            schedule.make(plan.schedule, stages.num_stages, num_micro))
        first_backward = next(i for i, a in enumerate(self.actions)
                              if a.kind == schedule.BACKWARD)
        # The counts can come first where no forward follows a backward.
        self.count_first = plan.count_first and all(
            a.kind == schedule.BACKWARD for a in self.actions[first_backward:])
        self.done = first_backward if self.count_first else len(self.actions)
        self.scales = None  # per counted term, 1 / its count (count_first), from finish
        self.num_passes = 1  # 1 + the counted terms without count_first, known at the end
        # A persistent tape makes a recurrent layer's gradient slower (a third in a
        # masked LSTM's step): only where a counted term may need a second backward.
        self.persistent = not self.count_first and (
            work.counted is None or bool(work.counted))
        shape = (stages.num_stages, num_micro)
        # Per (stage, micro-batch): the tape, the stage's inputs it watched (None
        # where not differentiable), what it returned and their Keras masks, what
        # its backward starts from ([share] + the counted terms; None: nothing),
        # its share of the batch's loss (unscaled), and the gradients of what it
        # returned (sent back by the next stage); per stage, per pass, the running
        # sum of its micro-batches' weight gradients (_add_gradients).
        self.tapes, self.inputs, self.outputs, self.masks = (_table(shape) for _ in range(4))
        self.targets, self.shares, self.cotangents = (_table(shape) for _ in range(3))
        self.grad_sums = [[] for _ in range(stages.num_stages)]  # per stage, per pass
        self.y_pred, self.micro_terms = [None] * num_micro, [None] * num_micro
        self._terms = None  # their sums over the micro-batches, once every forward ran
        self._previous = [[] for _ in devices]  # per stage: what its last action produced
        self.recompute = plan.recompute
        self.kept = _table(shape)  # with recompute: per (stage, micro-batch) (inputs, state)
        # The last stage's forward and backward at once, where its backward starts from
        # what its own forward gives: not from counted terms scaled by the batch's counts.
        self.at_once = work.last_stage is not None and (
            not self.count_first or work.counted == [])
        self.grads_at_once = [None] * num_micro  # per micro-batch: its per-pass gradients

    def start(self):
        """Runs the schedule up to where the batch's counts are needed (all of it where
        they are not: no counted term, or they come after)."""
        self._run(self.actions[:self.done])
        return self

    @property
    def terms(self):
        """Per loss term, its losses.Term over the shard (the micro-batches' sums); known
        once every forward ran (after `start`)."""
        if self._terms is None:
            self._terms = self.work.total(self.micro_terms)
        return self._terms

    def finish(self, scales, densify=None):
        """Runs the rest of the schedule and returns the tower's TowerOutput.

        scales: per loss term, what the step multiplies its sum by (1 / the
          batch's count for a counted one: denominators.count); used where the
          counts came first.
        densify: None or one bool per trainable variable: turn that variable's
          tf.IndexedSlices gradient into a dense Tensor here, before the gather.
        """
        if self.count_first:
            self.scales = [scales[i] for i in self.work.counted]
        self._run(self.actions[self.done:])
        per_stage = []
        for k, device in enumerate(self.devices):
            with tf.device(device):
                per_stage.append(self._stage_gradients(k))
        # per pass; a variable several stages read: their sum, where it lives
        grads = [self.stages.merge(per_pass, devices=self.devices)
                 for per_pass in zip(*per_stage)]
        if densify is not None:
            grads = [[gradients.to_dense(g) if dense else g
                      for g, dense in zip(per_pass, densify)] for per_pass in grads]
        with tf.device(self.devices[-1]):
            loss, y_pred = self._loss_and_outputs()
        return TowerOutput(grads[0], loss, self.stages.merge(self.changed, trainable=False),
                           y_pred, self.terms, grads[1:])

    def _run(self, actions):
        for kind, k, m in actions:
            name = "forward" if kind == schedule.FORWARD else "backward"
            with tf.device(self.devices[k]), tf.name_scope(f"stage_{k}_{name}_{m}"), \
                    tf.control_dependencies(self._previous[k]):
                self._previous[k] = (self._forward(k, m) if kind == schedule.FORWARD
                                     else self._backward(k, m))

    def _forward(self, k, m):
        """Stage k's forward on micro-batch m (step 3), recorded for its backward; with
        recompute, not recorded: its inputs and the state it read are kept instead."""
        last = k == self.stages.num_stages - 1
        inputs = self.work.inputs(m) if k == 0 else self.work.cross_cut(  # to this device
            self.outputs[k - 1][m], self.masks[k - 1][m])
        if last and self.at_once:
            run, self.grads_at_once[m] = self.work.last_stage(
                m, self.weights[k], self.state[k], inputs, self.persistent)
            run = run._replace(watched=watched_inputs(k, inputs))
        else:
            if self.recompute:
                self.kept[k][m] = (inputs, list(self.state[k]))
            run = self._record(k, m, inputs, self.state[k], taped=not self.recompute)
        if last:
            self.y_pred[m], self.micro_terms[m] = run.outputs, run.terms
            self.num_passes = 1 if self.count_first else len(run.targets)
        else:
            self.masks[k][m] = run.masks
        self.tapes[k][m], self.inputs[k][m], self.targets[k][m] = run.tape, run.watched, run.targets
        self.outputs[k][m], self.shares[k][m] = run.outputs, run.share
        for i, new in enumerate(run.new_state):
            if new is not None:
                self.state[k][i] = self.changed[k][i] = new
        # What the stage's next action waits for: the last stage's loss, not its outputs,
        # which nothing may need joined (logits kept in parts into the loss: vocab_loss).
        return (([] if last else tf.nest.flatten(run.outputs))
                + [t for t in run.targets if t is not None])

    def _record(self, k, m, inputs, state, taped):
        """Stage k's forward on micro-batch m from `inputs` and `state`, under a tape
        where `taped`: `record`'s _Run, its outputs flat and their masks apart before
        the last stage."""
        tape = tf.GradientTape(persistent=self.persistent) if taped else None
        run = record(self.work, k, m, self.weights[k], state, inputs, tape, self.persistent)
        if k < self.stages.num_stages - 1:
            run = run._replace(outputs=tf.nest.flatten(run.outputs[0]), masks=run.outputs[1])
        return run

    def _rerun(self, k, m):
        """Stage k's forward on micro-batch m again, recorded, on the inputs and state its
        first run read (the same dropout masks), its state updates dropped (the first
        run's count). It reads copies of its inputs made after the cotangents its
        backward starts from arrived (on the last stage, after the stage's previous
        action, as every action: _run): a forward of its own, which Grappler cannot
        merge with the first run, so its activations live only during this backward."""
        inputs, state = self.kept[k][m]
        self.kept[k][m] = None
        arrived = [] if k == self.stages.num_stages - 1 else [
            c for per_pass in self.cotangents[k][m] for c in per_pass if c is not None]
        with tf.control_dependencies(arrived):
            flat = tf.nest.flatten(inputs)
            inputs = tf.nest.pack_sequence_as(inputs, self.work.cross_cut(flat))
        run = self._record(k, m, inputs, state, taped=True)
        self.tapes[k][m], self.inputs[k][m], self.targets[k][m] = run.tape, run.watched, run.targets
        if k < self.stages.num_stages - 1:
            self.outputs[k][m] = run.outputs  # what the next stage's cotangents apply to

    def _backward(self, k, m):
        """Stage k's backward on micro-batch m (step 4), pass by pass: weight and input
        gradients."""
        at_once = self.grads_at_once[m] if k == self.stages.num_stages - 1 else None
        if self.recompute and at_once is None:
            self._rerun(k, m)
        watched = self.inputs[k][m]
        sources = self.weights[k] + [t for t in watched if t is not None]
        sent, added = [], []  # sent: input gradients, for the stage before
        if k > 0:
            self.cotangents[k - 1][m] = []
        for p in range(self.num_passes):
            grads = at_once[p] if at_once is not None else self._gradients(k, m, p, sources)
            added += self._add_gradients(k, p, grads[:len(self.weights[k])])
            if k > 0:
                input_grads = iter(grads[len(self.weights[k]):])
                cotangents = [None if t is None else _dense_or_none(next(input_grads))
                              for t in watched]
                self.cotangents[k - 1][m].append(cotangents)
                sent += [c for c in cotangents if c is not None]
        self.tapes[k][m] = None  # the activations of (k, m) may now be freed
        return added + sent

    def _gradients(self, k, m, backward_pass, sources):
        """The gradients of `sources` (stage k's weights, then its watched inputs) in
        pass `backward_pass` of (k, m)'s backward, from its tape: from its own targets
        (_starts) and the cotangents the next stage sent back."""
        targets, output_gradients = self._starts(k, m, backward_pass)
        if k < self.stages.num_stages - 1:
            for output, cotangent in zip(self.outputs[k][m],
                                         self.cotangents[k][m][backward_pass]):
                if cotangent is not None:
                    targets.append(output)
                    output_gradients.append(tf.identity(cotangent))  # to this device
        if not targets:
            return [None] * len(sources)
        return self.tapes[k][m].gradient(targets, sources, output_gradients=output_gradients)

    def _starts(self, k, m, backward_pass):
        """(targets, their output gradients) pass `backward_pass`'s backward at (k, m) starts
        from, before what the next stage sends back: its share of the loss, or one
        counted term; with the counts first, every one, each counted term weighed by
        its scale."""
        own = self.targets[k][m]
        if self.scales is not None:
            given = [(t, 1.0 if i == 0 else self.scales[i - 1]) for i, t in enumerate(own)]
        else:
            given = [(own[backward_pass], 1.0)] if backward_pass < len(own) else []
        given = [(t, s) for t, s in given if t is not None]
        return [t for t, _ in given], [tf.ones_like(t) if isinstance(s, float)
                                       else tf.cast(s, t.dtype) * tf.ones_like(t)
                                       for t, s in given]

    def _add_gradients(self, k, backward_pass, grads):
        """Adds one micro-batch's weight gradients of `backward_pass` into stage k's running
        sums, so that one sum is held per stage and pass, not every micro-batch's gradients
        until the last backward (M x the stage's weights). Returns the sums' dense
        parts, what the stage's next action waits for."""
        sums = self.grad_sums[k]
        if backward_pass == len(sums):
            sums.append(grads)
        else:
            sums[backward_pass] = [gradients.add(pair) for pair in zip(sums[backward_pass], grads)]
        return [gradients.dense_part(g) for g in sums[backward_pass] if g is not None]

    def _stage_gradients(self, k):
        """Stage k's gradients per pass: its micro-batches' sums."""
        return self.grad_sums[k]

    def _loss_and_outputs(self):
        """The shard's share of the batch's loss (every stage's, every micro-batch's; with
        the counts first, the counted terms too), and its outputs."""
        shares = [share for stage_shares in self.shares for share in stage_shares
                  if share is not None]
        if self.scales is not None:
            shares += self.work.counted_losses(self.scales, self.terms)
        loss = (tf.constant(0.0) if not shares else shares[0] if len(shares) == 1
                else tf.add_n([tf.identity(share) for share in shares]))  # here, on the last stage
        return loss, self.work.join(self.y_pred)


def record(work, k, m, weights, state, inputs, tape, several_backwards):
    """Stage k's forward on micro-batch m from `weights`, `state` and `inputs`, under
    `tape` (None: not recorded), and its targets: a _Run (outputs (y_pred, masks) as
    work.forward's, masks None). `work` as the module's docstring's; several_backwards:
    whether the tape may be differentiated more than once."""
    watched = watched_inputs(k, inputs)
    with tape or contextlib.nullcontext():
        if tape is not None:
            tape.watch(weights + [t for t in watched if t is not None])
        outputs, new_state, regularization = work.forward(
            k, m, weights, state, inputs, several_backwards=several_backwards)
        share, terms, targets = work.targets(k, m, outputs, regularization)
    return _Run(tape, watched, outputs, None, new_state, share, terms, targets)


def last_stage_at_once(work, k, weights, state, inputs, persistent):
    """The last stage k's forward on the micro-batch of `work` (its one), and its
    backward of every pass, each from one of its targets (Flight's passes: the share,
    then each counted term, as `_starts` gives them where the counts do not come
    first): (its _Run with no tape nor watched inputs, per pass the gradients of the
    weights and then of the watched inputs, None where unconnected). Traced as one
    function (engine/traced_tower.py), so that each tower and micro-batch makes one
    call, whose loss and backward are traced and optimised once."""
    tape = tf.GradientTape(persistent=persistent)
    run = record(work, k, 0, weights, state, inputs, tape, persistent)
    sources = weights + [t for t in run.watched if t is not None]
    per_pass = [[None] * len(sources) if target is None else tape.gradient(target, sources)
                for target in run.targets]
    return run._replace(tape=None, watched=None), per_pass


def watched_inputs(k, inputs):
    """Stage k's inputs its backward gives gradients of (for the stage before): the
    floating ones, None for the others; none on the first stage."""
    return [] if k == 0 else [t if t.dtype.is_floating else None for t in inputs]


_Run = collections.namedtuple(
    "_Run", ["tape", "watched", "outputs", "masks", "new_state", "share", "terms", "targets"])
_Run.__doc__ = """One run of a stage's forward on a micro-batch (Flight._record)."""


def _dense_or_none(grad):
    return None if grad is None else tf.convert_to_tensor(grad)


def _table(shape):
    rows, columns = shape
    return [[None] * columns for _ in range(rows)]
