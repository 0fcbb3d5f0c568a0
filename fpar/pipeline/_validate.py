"""Validating a schedule before it runs: every error names the stage, the tick and the action."""

from __future__ import annotations

from ._schedule import (
    COMM,
    COMPUTE,
    KINDS,
    Action,
    Schedule,
    ScheduleError,
    check_layout,
    check_sizes,
    next_stage,
    prev_stage,
    stash_delta,
)

__all__ = ["validate"]


def validate(schedule: Schedule) -> Schedule:
    """Check that a schedule can run and computes every gradient exactly once.

    Checks: every action is well formed and a stage runs at most one compute action per tick;
    every stage runs, for each microbatch and chunk, one forward and one backward (``BW``, or
    ``B`` then ``W``) in that order; every value a compute action needs was received at an
    earlier tick; every send meets its receive on the peer stage at the same tick and sends a
    value already computed (else a real mesh would deadlock); every received value is used;
    and the stash of every stage stays within ``schedule.stash_bound``.

    Returns:
      The schedule, unchanged.

    Raises:
      ScheduleError: naming the stage, the tick and the action at fault.
    """
    p, m, v = schedule.p, schedule.m, schedule.v
    check_sizes("validate", p, m, v)
    check_layout("validate", schedule.layout, v)
    for a in schedule.actions:
        _check_action(a, p, m, v)
    computed = _check_compute(schedule)
    _check_comm(schedule, computed)
    if schedule.stash_bound is not None:
        _check_stash(schedule)
    return schedule


def _err(a: Action, msg: str) -> ScheduleError:
    return ScheduleError(f"fpar.pipeline.validate: stage {a.stage}, tick {a.tick}, action {a}: {msg}")


def _check_action(a: Action, p: int, m: int, v: int) -> None:
    if a.kind not in KINDS:
        raise _err(a, f"unknown kind {a.kind!r}; kinds are {KINDS}.")
    if not (0 <= a.stage < p and 0 <= a.microbatch < m and 0 <= a.chunk < v and a.tick >= 0):
        raise _err(a, f"out of range for p={p} stages, m={m} microbatches, v={v} chunks (ticks >= 0).")


def _check_compute(schedule: Schedule) -> dict[tuple, Action]:
    """Per-stage compute checks; returns (kind, stage, mb, chunk) -> the action."""
    p, m, v = schedule.p, schedule.m, schedule.v
    computed: dict[tuple, Action] = {}
    busy: dict[tuple, Action] = {}
    for a in schedule.actions:
        if a.kind not in COMPUTE:
            continue
        if (a.stage, a.tick) in busy:
            raise _err(
                a,
                f"stage {a.stage} already runs {busy[(a.stage, a.tick)]} at this tick; one "
                f"compute action per stage per tick.",
            )
        busy[(a.stage, a.tick)] = a
        key = (a.kind, a.stage, a.microbatch, a.chunk)
        if key in computed:
            raise _err(a, f"runs twice (also at tick {computed[key].tick}); each runs exactly once.")
        computed[key] = a
    end = schedule.num_ticks
    for s in range(p):
        for j in range(m):
            for c in range(v):
                _check_unit(computed, s, j, c, end)
    return computed


def _check_unit(computed: dict, s: int, j: int, c: int, end: int) -> None:
    f = computed.get(("F", s, j, c))
    bw, b, w = (computed.get((k, s, j, c)) for k in ("BW", "B", "W"))
    missing = Action(end, s, "F", j, c)
    if f is None:
        raise _err(missing, f"never runs: the schedule ends (tick {end}) without this forward.")
    if bw is not None and (b is not None or w is not None):
        raise _err(bw, "this microbatch also has a split B/W backward; use BW or B and W, not both.")
    if bw is None and (b is None or w is None):
        kind = "BW" if b is None and w is None else ("W" if w is None else "B")
        raise _err(
            Action(end, s, kind, j, c),
            f"never runs: the schedule ends at tick {end} without "
            f"it, so this stage's gradient would miss microbatch {j}.",
        )
    first = bw if bw is not None else b
    if first.tick <= f.tick:
        raise _err(
            first,
            f"runs before (or with) its forward at tick {f.tick}; the backward needs the "
            f"forward's stashed activations.",
        )
    if w is not None and w.tick <= b.tick:
        raise _err(
            w, f"runs before (or with) its B at tick {b.tick}; W needs the output gradient B consumes."
        )


def _check_comm(schedule: Schedule, computed: dict) -> None:
    """Sends meet receives at the same tick, carry computed values, and feed every consumer."""
    p, v = schedule.p, schedule.v
    comm = {(a.kind, a.stage, a.microbatch, a.chunk): a for a in schedule.actions if a.kind in COMM}
    counts: dict[tuple, int] = {}
    for a in schedule.actions:
        if a.kind in COMM:
            key = (a.kind, a.stage, a.microbatch, a.chunk)
            counts[key] = counts.get(key, 0) + 1
            if counts[key] > 1:
                raise _err(a, "appears twice; each value is sent and received once.")
    for a in comm.values():
        _check_message(a, comm, computed, p, v, schedule.layout)
    for a in computed.values():
        _check_input(a, comm, p, v, schedule.layout)


def _check_message(a: Action, comm: dict, computed: dict, p: int, v: int, layout: str) -> None:
    s, j, c = a.stage, a.microbatch, a.chunk
    if a.kind in ("SEND_F", "SEND_B"):
        peer = next_stage(s, c, p, v, layout) if a.kind == "SEND_F" else prev_stage(s, c, p, v, layout)
        if peer is None:
            edge = "last" if a.kind == "SEND_F" else "first"
            raise _err(a, f"this is the {edge} virtual stage of the model; there is nobody to send to.")
        producer = [computed.get((k, s, j, c)) for k in (("F",) if a.kind == "SEND_F" else ("B", "BW"))]
        producer = [x for x in producer if x is not None]
        if not producer or producer[0].tick > a.tick:
            what = "F" if a.kind == "SEND_F" else "B/BW"
            raise _err(
                a,
                f"sends a value this stage has not computed yet (its {what} of microbatch {j} "
                f"is not at or before tick {a.tick}).",
            )
        recv_kind = "RECV_F" if a.kind == "SEND_F" else "RECV_B"
        r = comm.get((recv_kind, peer[0], j, peer[1]))
        if r is None or r.tick != a.tick:
            got = "no matching receive" if r is None else f"the receive at tick {r.tick}"
            raise _err(
                a,
                f"stage {peer[0]} has {got}: a real mesh would deadlock here, this stage "
                f"waiting for a {recv_kind}(microbatch={j}, chunk={peer[1]}) on stage {peer[0]} at "
                f"tick {a.tick}.",
            )
    else:
        peer = prev_stage(s, c, p, v, layout) if a.kind == "RECV_F" else next_stage(s, c, p, v, layout)
        send_kind = "SEND_F" if a.kind == "RECV_F" else "SEND_B"
        snd = comm.get((send_kind, peer[0], j, peer[1])) if peer is not None else None
        if snd is None or snd.tick != a.tick:
            who = (
                "nobody (this is the model's first or last virtual stage)"
                if peer is None
                else f"stage {peer[0]}"
            )
            when = "" if snd is None else f" (it sends it at tick {snd.tick})"
            raise _err(
                a,
                f"{who} sends nothing matching at tick {a.tick}{when}: a real mesh would deadlock "
                f"here, this stage waiting forever for a {send_kind} of microbatch {j}.",
            )


def _check_input(a: Action, comm: dict, p: int, v: int, layout: str) -> None:
    s, j, c = a.stage, a.microbatch, a.chunk
    if a.kind == "F" and prev_stage(s, c, p, v, layout) is not None:
        kind, what = "RECV_F", "activation"
    elif a.kind in ("B", "BW") and next_stage(s, c, p, v, layout) is not None:
        kind, what = "RECV_B", "output gradient"
    else:
        return
    r = comm.get((kind, s, j, c))
    if r is None:
        raise _err(
            a,
            f"its input (the {what}) is never received: add {kind}(microbatch={j}, "
            f"chunk={c}) on stage {s} at an earlier tick.",
        )
    if r.tick >= a.tick:
        raise _err(
            a,
            f"its input (the {what}) is only received at tick {r.tick}; a value received at "
            f"tick t can be used from tick t + 1.",
        )


def _check_stash(schedule: Schedule) -> None:
    bound = schedule.stash_bound
    if len(bound) != schedule.p:
        raise ScheduleError(
            f"fpar.pipeline.validate: stash_bound has {len(bound)} entries for {schedule.p} stages."
        )
    for s in range(schedule.p):
        live = 0
        for a in schedule.compute_order(s):
            live += stash_delta(a)
            if live > bound[s]:
                raise _err(
                    a,
                    f"stashes {live} microbatch-chunks, more than the bound {bound[s]} of "
                    f"{schedule.name} on stage {s}; run a backward earlier or raise the bound.",
                )
