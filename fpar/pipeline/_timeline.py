"""Timelines: how a run of a schedule spends its time per stage (grid, simulated, or executed)."""

from __future__ import annotations

import dataclasses

from ._schedule import Action, Schedule, ScheduleError, needs, stash_delta

__all__ = ["Timeline", "replay", "simulate", "timeline"]


@dataclasses.dataclass(frozen=True)
class Timeline:
    """How a run of a schedule spent its time, per stage: computing, idle, stash.

    Produced by ``timeline`` (the tick grid), ``simulate`` (durations per kind) and the
    executors (what they actually ran, with measured seconds).

    Attributes:
      name: the schedule's name.
      makespan: ticks (or time units) from the first action to the end of the last.
      busy: per stage, ticks (or time) spent computing.
      peak_stash: per stage, the most microbatch-chunks stashed at once.
      peak_inbox: per stage, the most received values waiting to be used (executors only).
      compute_s: per stage, measured seconds of compute (executors only).
      wall_s: measured seconds of the whole run (executors only).
    """

    name: str
    makespan: float
    busy: tuple
    peak_stash: tuple
    peak_inbox: tuple = ()
    compute_s: tuple = ()
    wall_s: float | None = None

    @property
    def idle(self) -> tuple:
        """Per stage, ticks (or time) spent waiting: the bubble."""
        return tuple(self.makespan - b for b in self.busy)

    @property
    def bubble_fraction(self) -> float:
        """Idle stage-ticks over all stage-ticks: ``sum(idle) / (p * makespan)``."""
        return sum(self.idle) / (len(self.busy) * self.makespan) if self.makespan else 0.0

    def table(self) -> str:
        """A per-stage text table of busy, idle and peak stash."""
        rows = [f"{self.name}: makespan {self.makespan:g}, bubble {self.bubble_fraction:.4f}"]
        rows.append("stage  busy  idle  peak_stash" + ("  compute_s" if self.compute_s else ""))
        for s, b in enumerate(self.busy):
            extra = f"  {self.compute_s[s]:9.4f}" if self.compute_s else ""
            rows.append(f"{s:5d}  {b:4g}  {self.idle[s]:4g}  {self.peak_stash[s]:10d}{extra}")
        return "\n".join(rows)


def timeline(schedule: Schedule) -> Timeline:
    """The schedule's own tick grid: per stage, compute ticks, idle ticks and peak stash."""
    busy, peak = [], []
    for s in range(schedule.p):
        order = schedule.compute_order(s)
        busy.append(len(order))
        live = top = 0
        for a in order:
            live += stash_delta(a)
            top = max(top, live)
        peak.append(top)
    return Timeline(schedule.name, schedule.num_ticks, tuple(busy), tuple(peak))


def simulate(schedule: Schedule, *, f: float = 1.0, b: float = 1.0, w: float = 1.0) -> Timeline:
    """Replay each stage's order of compute actions with durations, as early as dependencies allow.

    ``F`` takes ``f``, ``B`` takes ``b``, ``W`` takes ``w`` and ``BW`` takes ``b + w``;
    communication is free.  With the default unit durations a split backward costs twice a
    fused one's halves, so ZB-H1's bubble, ``(p - 1)(f + b - w)``, compares with 1F1B's
    ``(p - 1)(f + b + w)`` as in the zero-bubble paper.

    Returns:
      The simulated timeline (``makespan`` and ``busy`` in the durations' unit).
    """
    cost = {"F": f, "B": b, "W": w, "BW": b + w}
    starts = replay(schedule, cost)
    makespan = max((t + cost[a.kind] for a, t in starts.items()), default=0.0)
    busy = tuple(sum(cost[a.kind] for a in schedule.compute_order(s)) for s in range(schedule.p))
    return Timeline(schedule.name, makespan, busy, timeline(schedule).peak_stash)


def replay(schedule: Schedule, cost) -> dict[Action, float]:
    """Start time of each compute action, each stage in its order, as early as its inputs allow.

    ``cost``: seconds per action kind (a dict), or per action (a callable, ``fpar.plan``'s
    durations measured per stage).
    """
    if not callable(cost):
        cost = (lambda table: lambda a: table[a.kind])(cost)
    p, v = schedule.p, schedule.v
    orders = [schedule.compute_order(s) for s in range(p)]
    end: dict[tuple, float] = {}
    starts: dict[Action, float] = {}
    free, pos = [0.0] * p, [0] * p
    left = sum(len(o) for o in orders)
    while left:
        progressed = False
        for s in range(p):
            while pos[s] < len(orders[s]):
                a = orders[s][pos[s]]
                deps = needs(s, a.kind, a.microbatch, a.chunk, p, v, schedule.layout)
                if any(n not in end for n in deps):
                    break
                starts[a] = max([free[s]] + [end[n] for n in deps])
                free[s] = starts[a] + cost(a)
                end[(a.kind, s, a.microbatch, a.chunk)] = free[s]
                if a.kind in ("B", "BW"):
                    end[("grad", s, a.microbatch, a.chunk)] = free[s]
                pos[s] += 1
                left -= 1
                progressed = True
        if not progressed:  # unreachable for a validated schedule
            raise ScheduleError(f"fpar.pipeline.simulate: {schedule.name} cannot finish; validate it first.")
    return starts
