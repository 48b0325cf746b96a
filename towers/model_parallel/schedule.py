"""Pipeline schedules: in which order each stage runs its micro-batches' forwards and backwards.

A schedule is one list of Actions per stage, read like a timetable:

    gpipe, 2 stages, 3 micro-batches      1f1b, 2 stages, 3 micro-batches
    stage 0: F0 F1 F2 B0 B1 B2            stage 0: F0 F1 B0 F2 B1 B2
    stage 1: F0 F1 F2 B0 B1 B2            stage 1: F0 B0 F1 B1 F2 B2

`build_order` interleaves the stages' lists into one order in which every
action comes after the actions whose results it reads, which is the order
the tower step builds its graph in; each stage's own order is kept with
control dependencies, and the dataflow runs different stages at once.
"""

import collections

FORWARD, BACKWARD = "F", "B"
SCHEDULES = ("gpipe", "1f1b")

Action = collections.namedtuple("Action", ["kind", "stage", "micro_batch"])
Action.__doc__ = "One stage's forward (kind F) or backward (kind B) of one micro-batch."


def gpipe(num_stages, micro_batches):
    """GPipe: each stage runs every micro-batch's forward, then every backward.

    Simple, and the most activation memory: all M micro-batches' activations
    are alive on every stage before the first backward.
    """
    return [[Action(FORWARD, k, m) for m in range(micro_batches)]
            + [Action(BACKWARD, k, m) for m in range(micro_batches)]
            for k in range(num_stages)]


def one_f_one_b(num_stages, micro_batches):
    """1F1B (PipeDream-flush): warm up, then alternate one forward and one backward.

    Stage k first runs K - 1 - k forwards (enough to fill the stages after
    it), then one forward and one backward in turn, then the remaining
    backwards. At most K - k micro-batches' activations are alive on stage k,
    whatever M is; the idle time (bubble) is the same as GPipe's.
    """
    orders = []
    for k in range(num_stages):
        warm_up = min(num_stages - 1 - k, micro_batches)
        order = [Action(FORWARD, k, m) for m in range(warm_up)]
        for m in range(micro_batches - warm_up):
            order += [Action(FORWARD, k, warm_up + m), Action(BACKWARD, k, m)]
        order += [Action(BACKWARD, k, m) for m in range(micro_batches - warm_up, micro_batches)]
        orders.append(order)
    return orders


def make(name, num_stages, micro_batches):
    """The schedule called `name` (one of SCHEDULES): one list of Actions per stage."""
    if name not in SCHEDULES:
        raise ValueError(f"pipeline_schedule must be one of {SCHEDULES}, got {name!r}.")
    return (gpipe if name == "gpipe" else one_f_one_b)(num_stages, micro_batches)


def timetable(per_stage):
    """Clock ticks of an ideal run where every action takes one tick.

    At each tick every stage runs its next action if what it reads is done
    (forward m of stage k reads forward m of stage k - 1; backward m reads
    forward m of its own stage and backward m of stage k + 1). Returns a list
    of ticks, each a list of the actions run in it; the idle share of the
    stages is GPipe's bubble, (K - 1) / (M + K - 1) of the step.

    Raises:
      ValueError: the orders cannot all finish (a schedule that deadlocks).
    """
    num_stages = len(per_stage)
    done, ticks, position = set(), [], [0] * num_stages
    while any(p < len(order) for p, order in zip(position, per_stage)):
        ready = [order[p] for p, order in zip(position, per_stage)
                 if p < len(order) and _inputs_done(order[p], done, num_stages)]
        if not ready:
            raise ValueError(f"the pipeline schedule deadlocks after {len(ticks)} ticks.")
        for action in ready:
            position[action.stage] += 1
        done.update(ready)
        ticks.append(ready)
    return ticks


def build_order(per_stage):
    """Every action once, each after the actions whose results it reads."""
    return [action for tick in timetable(per_stage) for action in tick]


def _inputs_done(action, done, num_stages):
    kind, k, m = action
    if kind == FORWARD:
        return k == 0 or Action(FORWARD, k - 1, m) in done
    return Action(FORWARD, k, m) in done and (
        k == num_stages - 1 or Action(BACKWARD, k + 1, m) in done)
