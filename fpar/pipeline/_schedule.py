"""Pipeline schedules as data: actions on a tick grid, and where each model chunk lives.

This module is the data only; everything else is a function over it, importing it (never the
other way): ``_validate`` (checks), ``_timeline`` (measures), ``_draw`` (pictures) and
``_builders`` (``gpipe``, ``one_f_one_b``, ..., ``place``, which validate what they build).

A schedule says, for each of ``p`` pipeline stages (devices) and each *tick*, which action the
stage runs: a compute action on one microbatch of one of its ``v`` model chunks, and the
sends/receives that move activations forward and gradients backward between neighbouring
stages.  Chunk ``c`` on stage ``s`` is *virtual stage* ``c * p + s`` of the model (Megatron's
interleaved layout, arXiv:2104.04473 §2.2): microbatch ``j`` flows through virtual stages
``0 .. p*v - 1`` forward and back again.

Tick semantics (the same for the validator, the timeline and both executors): within a tick a
stage first runs its compute action, then all of that tick's sends and receives happen at once
(one batched exchange on a real mesh, which cannot deadlock).  So a value sent at tick ``t``
can be used from tick ``t + 1`` on, and a ``SEND`` at tick ``t`` must meet its ``RECV`` on the
peer stage at the same tick.

Compute kinds: ``F`` (forward), ``BW`` (the whole backward: input and weight gradients), and,
for zero-bubble schedules (arXiv:2401.10241), ``B`` (input gradient only) and ``W`` (weight
gradient only).  A microbatch's activations are *stashed* on a stage from its ``F`` until its
last backward action (``BW`` or ``W``: the weight gradient needs the stage's inputs too).
"""

from __future__ import annotations

import dataclasses

__all__ = [
    "Action",
    "Schedule",
    "ScheduleError",
]

COMPUTE = ("F", "B", "W", "BW")
COMM = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
KINDS = COMPUTE + COMM


class ScheduleError(ValueError):
    """A pipeline schedule is malformed: the message names the stage, the tick and the action."""


# Data ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, order=True)
class Action:
    """One thing a stage does at one tick.

    Attributes:
      tick: when (see the module docstring for what happens within a tick).
      stage: the pipeline stage (device along the pipe axis) that does it.
      kind: ``F``, ``B``, ``W``, ``BW`` (compute) or ``SEND_F``, ``RECV_F``, ``SEND_B``,
        ``RECV_B`` (communication).
      microbatch: which microbatch.
      chunk: which of the stage's model chunks.  For a send, the chunk that produced the value;
        for a receive, the chunk that will consume it.
    """

    tick: int
    stage: int
    kind: str
    microbatch: int
    chunk: int = 0

    def label(self, v: int = 1) -> str:
        """Short label for charts: ``F3``, or ``F3b`` for chunk 1 when there are several chunks."""
        kind = "B" if self.kind == "BW" else self.kind
        suffix = chr(ord("a") + self.chunk) if v > 1 else ""
        return f"{kind}{self.microbatch}{suffix}"

    def __str__(self) -> str:
        return f"{self.kind}(microbatch={self.microbatch}, chunk={self.chunk})"


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: every stage's actions on a tick grid.

    Build one with a builder (``gpipe``, ``one_f_one_b``, ``interleaved_1f1b``, ``zb_h1``,
    ``zb_v``, ``dualpipe_v``), with ``place`` from per-stage orders of compute actions, or by
    hand from explicit actions; check it with ``validate`` (the executors do so before running)
    and draw it with ``draw``.

    Attributes:
      name: what to call it in charts and messages.
      p: number of pipeline stages.
      m: number of microbatches.
      v: model chunks per stage (virtual stages per device).
      actions: every action, sorted by (tick, stage).
      stash_bound: per stage, the most microbatch-chunks whose activations may be stashed at
        once; ``validate`` enforces it.  ``None``: no bound.
      layout: where the model's chunks live (see ``virtual``): ``"interleaved"`` (Megatron's,
        chunk ``c`` of stage ``s`` is virtual stage ``c p + s``) or ``"v"`` (two chunks per
        stage in a V: stage ``s`` holds virtual stages ``s`` and ``2 p - 1 - s``, so the turn at
        stage ``p - 1`` and the loss on stage 0 need no message).
    """

    name: str
    p: int
    m: int
    v: int
    actions: tuple[Action, ...]
    stash_bound: tuple[int, ...] | None = None
    layout: str = "interleaved"

    def __post_init__(self):
        object.__setattr__(self, "actions", tuple(sorted(self.actions)))

    @property
    def num_ticks(self) -> int:
        """Ticks from the first action to the last (the makespan on the tick grid)."""
        return max((a.tick for a in self.actions), default=-1) + 1

    def stage_actions(self, stage: int) -> list[Action]:
        """The actions of one stage, in tick order."""
        return [a for a in self.actions if a.stage == stage]

    def compute_order(self, stage: int) -> list[Action]:
        """The compute actions of one stage, in tick order."""
        return [a for a in self.actions if a.stage == stage and a.kind in COMPUTE]

    def at(self, stage: int, tick: int) -> list[Action]:
        """The actions of ``stage`` at ``tick`` (compute first, then communication)."""
        return [a for a in self.actions if a.stage == stage and a.tick == tick]

    def by_tick(self) -> list[list[Action]]:
        """``out[t]``: every stage's actions at tick ``t``."""
        out: list[list[Action]] = [[] for _ in range(self.num_ticks)]
        for a in self.actions:
            out[a.tick].append(a)
        return out

    def __str__(self) -> str:
        return f"{self.name}: p={self.p} stages, m={self.m} microbatches, v={self.v}, {self.num_ticks} ticks"


# Virtual stages -----------------------------------------------------------------------------


LAYOUTS = ("interleaved", "v")


def virtual(s: int, c: int, p: int, v: int, layout: str = "interleaved") -> int:
    """The virtual stage (model chunk index) of chunk ``c`` on stage ``s``."""
    if layout == "v":
        return s if c == 0 else 2 * p - 1 - s
    return c * p + s


def locate(k: int, p: int, v: int, layout: str = "interleaved") -> tuple[int, int]:
    """The (stage, chunk) that holds virtual stage ``k``: the inverse of ``virtual``."""
    if layout == "v":
        return (k, 0) if k < p else (2 * p - 1 - k, 1)
    return k % p, k // p


def next_stage(s: int, c: int, p: int, v: int, layout: str = "interleaved") -> tuple[int, int] | None:
    """The (stage, chunk) after chunk ``c`` of stage ``s``, or None after the last virtual stage."""
    k = virtual(s, c, p, v, layout) + 1
    return None if k == p * v else locate(k, p, v, layout)


def prev_stage(s: int, c: int, p: int, v: int, layout: str = "interleaved") -> tuple[int, int] | None:
    """The (stage, chunk) before chunk ``c`` of stage ``s``, or None before the first virtual stage."""
    k = virtual(s, c, p, v, layout) - 1
    return None if k < 0 else locate(k, p, v, layout)


def check_layout(api: str, layout: str, v: int) -> None:
    if layout not in LAYOUTS:
        raise ScheduleError(f"fpar.pipeline.{api}: layout must be one of {LAYOUTS}, got {layout!r}.")
    if layout == "v" and v != 2:
        raise ScheduleError(f"fpar.pipeline.{api}: the 'v' layout has v=2 chunks per stage, got v={v}.")


def check_sizes(api: str, p: int, m: int, v: int) -> None:
    for name, val in (("p", p), ("m", m), ("v", v)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ScheduleError(f"fpar.pipeline.{api}: {name} must be a positive int, got {val!r}.")


def needs(
    s: int, kind: str, j: int, c: int, p: int, v: int, layout: str = "interleaved"
) -> list[tuple[str, int, int, int]]:
    """What a compute action waits for: (kind, stage, microbatch, chunk) of other actions."""
    if kind == "F":
        prev = prev_stage(s, c, p, v, layout)
        return [] if prev is None else [("F", prev[0], j, prev[1])]
    if kind == "W":
        return [("B", s, j, c)]
    need = [("F", s, j, c)]
    nxt = next_stage(s, c, p, v, layout)
    if nxt is not None:
        need.append(("grad", nxt[0], j, nxt[1]))  # its B or BW, whichever it runs
    return need


def stash_delta(a: Action) -> int:
    """+1 when a compute action stashes a microbatch-chunk, -1 when it frees one."""
    if a.kind == "F":
        return 1
    if a.kind in ("BW", "W"):
        return -1
    return 0
