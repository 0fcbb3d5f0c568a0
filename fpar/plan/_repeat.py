"""A pipeline's microbatches on paper: simulate a few, repeat the steady one's ops and messages.

Every microbatch of a pipelined step runs the same program on the same shapes, so simulating
all of them costs time (an estimate's Python runs once per op) and tells nothing new.  A stage
simulates microbatches ``0 .. K`` and the last one (whose backward reduces the data-parallel
gradients); ``K`` is the fewest that still pass through every state the full schedule's peak can
be at on that stage (which action runs, which chunks' gradient sums exist, how many microbatches
of each chunk are in flight: what the memory depends on), plus one steady microbatch.  The events of that steady microbatch (its ops, its tensor-parallel collectives,
its sends and receives) then stand for every microbatch not simulated: copied into the event
list with the schedule's actions of that microbatch, and added to ``fpar.comm_stats``' counts.
So the cost of an estimate no longer grows with the microbatch count, the traffic stays exact
and the peak is the full schedule's (``tests/plan/test_plan_api.py`` checks both against a
simulation of every microbatch).
"""

from __future__ import annotations

import dataclasses

__all__ = ["ENABLED", "expand", "kept_microbatches"]

ENABLED = [True]  # tests switch it off to simulate every microbatch


def _states(order: list, keep, split: bool) -> set:
    """What the memory at each action of a stage's order depends on, for the kept microbatches.

    Each action's kind and chunk, the chunks whose backward has begun (their gradient sums
    exist from then on), and how many microbatches of each chunk hold activations (from F to
    their last backward).  Every microbatch runs the same program, so two moments with the same
    state hold the same bytes.
    """
    chunks = sorted({a.chunk for a in order})
    alive = dict.fromkeys(chunks, 0)
    begun: set = set()
    out = set()
    for a in order:
        if a.microbatch not in keep:
            continue
        if a.kind == "F":
            alive[a.chunk] += 1
        else:
            begun.add(a.chunk)
        out.add((a.kind, a.chunk, frozenset(begun), tuple(alive[c] for c in chunks)))
        if a.kind in ("BW", "W") or (a.kind == "B" and not split):
            alive[a.chunk] -= 1
    return out


def _highest(states: set) -> set:
    """The states no other state of the same action, chunk and begun chunks holds more than.

    Whatever each chunk's activations weigh, the peak is at one of these.
    """
    groups: dict = {}
    for st in states:
        groups.setdefault(st[:3], []).append(st[3])
    out = set()
    for head, counts in groups.items():
        for c in counts:
            if not any(d != c and all(x >= y for x, y in zip(d, c)) for d in counts):
                out.add((*head, c))
    return out


def kept_microbatches(schedule, stage: int) -> frozenset | None:
    """The microbatches stage ``stage`` simulates, or None for all of them (too few to save any).

    The fewest first ``k`` (and the last, whose backward reduces the data-parallel gradients)
    that pass through every state the whole schedule peaks at (``_highest``): with several
    chunks a stage (interleaved 1F1B) the count in flight is not enough, as a chunk holding the
    embedding weighs more than one of layers; plus one steady microbatch to repeat.
    """
    m = schedule.m
    if not ENABLED[0] or m <= 3:
        return None
    order = schedule.compute_order(stage)
    split = any(a.kind == "W" for a in order)
    full = _highest(_states(order, range(m), split))
    for k in range(1, m):
        keep = frozenset(range(k)) | {m - 1}
        if full <= _states(order, keep, split):
            break
    keep = frozenset(range(k + 1)) | {m - 1}  # and one steady microbatch (k) to repeat
    return None if len(keep) >= m else keep


def expand(events: list, schedule, stage: int, keep: frozenset) -> list:
    """``events`` with the steady microbatch's copied for every microbatch not simulated.

    Returns the copies' messages (``Comm`` events), for ``fpar.comm_stats``' counts.
    """
    rep = max(j for j in keep if j != schedule.m - 1)
    actions = {(a.stage, a.kind, a.microbatch, a.chunk): a for a in schedule.actions}

    def moved(a, j):
        return None if a is None else actions[(a.stage, a.kind, j, a.chunk)]

    theirs = [i for i, e in enumerate(events) if e.origin is not None and e.origin.microbatch == rep]
    if not theirs:
        return []
    copies = []
    for j in range(schedule.m):
        if j in keep:
            continue
        for i in theirs:
            e = events[i]
            copies.append(dataclasses.replace(e, origin=moved(e.origin, j), mark=moved(e.mark, j)))
    at = theirs[-1] + 1  # right after the steady microbatch's own (before the last one's reductions)
    events[at:at] = copies
    return [e for e in copies if not hasattr(e, "flops")]
