"""The in-process driver: every stage in this process, a loop over ticks, then over stages."""

from __future__ import annotations

import time
from typing import Any

import torch

from .._tree import tree_flatten, tree_map, tree_unflatten
from ._schedule import COMPUTE, Action, Schedule, next_stage, prev_stage
from ._stage import Fns, Stage, StepResult, last_stage, stack
from ._timeline import Timeline

Tensor = torch.Tensor


class LocalDriver:
    """All stages in this process: a loop over ticks, then over stages; sends fill inboxes."""

    def __init__(self, schedule: Schedule, fns: Fns):
        self.schedule, self.fns = schedule, fns
        self.ticks = schedule.by_tick()

    def run(self, params: dict, xs: Tensor, targets: Any, key: Tensor | None = None) -> StepResult:
        sch = self.schedule
        p, v = sch.p, sch.v
        stacked = params["stages"]
        chunks = [[tree_map(lambda t, r=s * v + c: t[r], stacked) for c in range(v)] for s in range(p)]
        stages = [
            Stage(s, sch, self.fns, chunks[s], params.get("first"), params.get("last"), key) for s in range(p)
        ]
        start = time.perf_counter()
        for actions in self.ticks:
            for a in actions:
                if a.kind in COMPUTE:
                    stages[a.stage].run(a, xs, targets)
            for a in actions:
                if a.kind in ("SEND_F", "SEND_B"):
                    self._deliver(a, stages)
            for st in stages:
                st.note_inbox()
        wall = time.perf_counter() - start
        grads = {"stages": _stack_chunks([st.grads("stages") for st in stages], stacked)}
        if "first" in params:
            grads["first"] = stages[0].grads("first")[0] if params["first"] is not None else None
        if "last" in params:
            grads["last"] = stages[last_stage(sch)].grads("last")[0] if params["last"] is not None else None
        loss = stages[last_stage(sch)].loss_sum / sch.m
        stats = _timeline(sch, stages, wall)
        return StepResult(loss, grads, stats)

    def _deliver(self, a: Action, stages: list) -> None:
        """In-process send and receive: the value moves to the peer stage's inbox."""
        sch = self.schedule
        to = (next_stage if a.kind == "SEND_F" else prev_stage)(a.stage, a.chunk, sch.p, sch.v, sch.layout)
        stages[to[0]].inbox[(a.kind[-1], a.microbatch, to[1])] = stages[a.stage].to_send(a)


def _stack_chunks(per_stage: list[list], like: Any) -> Any:
    """Stack per-(stage, chunk) gradient trees in stage-major order: row s * v + c."""
    flat = [tree_flatten(g)[0] for chunks in per_stage for g in chunks]
    _, td = tree_flatten(like)
    return tree_unflatten(td, [stack(col) for col in zip(*flat)])


def _timeline(sch: Schedule, stages: list, wall: float) -> Timeline:
    return Timeline(
        sch.name,
        sch.num_ticks,
        tuple(st.busy for st in stages),
        tuple(st.peak for st in stages),
        tuple(st.peak_inbox for st in stages),
        tuple(st.seconds for st in stages),
        wall,
    )
