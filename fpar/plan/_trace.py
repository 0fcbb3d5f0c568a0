"""An estimate's recorded ops and messages as plain data, to time again without simulating.

The time model (``fpar.plan._cost``) costs what a simulation recorded: every op's FLOPs, bytes,
dtype and GEMM shape, every message's kind, axes, bytes and group.  ``dump`` keeps those (and
what the estimate reports besides time: peak memory, traffic) as JSON-ready data; ``load``
rebuilds an ``Estimate`` from them that ``retime`` costs on any datasheet hardware in seconds.
``bench/plan.py published`` stores the published runs' traces beside their predictions, and
``tests/plan/test_plan_scale.py`` times them again with the current time model: the table in
docs/plan.md cannot drift from the code that predicts it.

Events repeat (layers, microbatches): each distinct op or message is stored once (``kinds``),
each pipeline action once (``marks``), and a class's events as index pairs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ._estimate import DeviceClass, Estimate, retime
from ._hardware import Hardware
from ._record import Comm, Op

__all__ = ["dump", "load"]

_DTYPES = {str(d): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


def dump(est: Estimate) -> dict:
    """``est``'s recorded events, memory and traffic as JSON-ready data (not its hardware)."""
    kinds: dict = {}
    marks: dict = {None: 0}
    classes = []
    for c in est.devices:
        if c._events is None:
            raise ValueError("fpar.plan: this estimate kept no events (a search's worker drops them).")
        events, groups = c._events
        pairs = []
        for e in events:
            key = _kind(e)
            k = kinds.setdefault(key, len(kinds))
            m = marks.setdefault(_mark(e.mark), len(marks))
            pairs += [k, m]
        classes.append(
            {
                "coords": c.coords,
                "count": c.count,
                "peak_bytes": c.peak_bytes,
                "breakdown": c.breakdown,
                "comm": c.comm,
                "unknown_ops": c.unknown_ops,
                "state_bytes": c.state_bytes,
                "saved_activations": c.saved_activations,
                "groups": [[list(axes), list(members)] for axes, members in groups.items()],
                "events": pairs,
            }
        )
    return {
        "mesh": {"shape": list(est.mesh.shape.values()), "names": list(est.mesh.shape)},
        "kinds": [
            [list(x) if isinstance(x, tuple) else x for x in k] for k in sorted(kinds, key=kinds.__getitem__)
        ],
        "marks": sorted(marks, key=marks.__getitem__),
        "classes": classes,
    }


def load(data: dict, hardware: Hardware, schedule: Any = None) -> Estimate:
    """The ``Estimate`` ``data`` (from ``dump``) describes, timed on ``hardware``.

    ``schedule``: the pipeline schedule the step ran (``fpar.plan.pipeline_schedule(layout)``).
    """
    from ._paper import abstract_mesh

    mesh = abstract_mesh(tuple(data["mesh"]["shape"]), tuple(data["mesh"]["names"]))
    actions = {}
    if schedule is not None:
        actions = {(a.tick, a.stage, a.kind, a.microbatch, a.chunk): a for a in schedule.actions}
    marks = [None if m is None else actions[tuple(m)] for m in data["marks"]]
    kinds = [_event(k) for k in data["kinds"]]
    classes = []
    for c in data["classes"]:
        pairs = c["events"]
        events = []
        for i in range(0, len(pairs), 2):
            kind, mark = kinds[pairs[i]], marks[pairs[i + 1]]
            events.append(kind(mark))
        groups = {tuple(axes): tuple(members) for axes, members in c["groups"]}
        classes.append(
            DeviceClass(
                coords=c["coords"],
                count=c["count"],
                peak_bytes=c["peak_bytes"],
                breakdown=c["breakdown"],
                comm=c["comm"],
                flops=0.0,
                unknown_ops=c["unknown_ops"],
                state_bytes=c["state_bytes"],
                saved_activations=c["saved_activations"],
                _events=(events, groups),
            )
        )
    axis = "pipeline" if schedule is not None else None
    shell = Estimate(mesh, hardware, classes, 0, {}, 0.0, {}, 0.0, [])
    shell._schedules = ([(schedule, axis)] if schedule is not None else [], axis)
    return retime(shell, hardware)


def _kind(e: Op | Comm) -> tuple:
    if isinstance(e, Op):
        dims = tuple(e.dims) if e.dims else None
        return ("op", e.name, e.flops, e.nbytes, str(e.dtype), e.phase, e.recompute, dims)
    return ("comm", e.kind, tuple(e.axes), e.nbytes, e.n, e.overlap, e.phase)


def _mark(a: Any) -> tuple | None:
    return None if a is None else (a.tick, a.stage, a.kind, a.microbatch, a.chunk)


def _event(k: list) -> Callable[[Any], Op | Comm]:
    if k[0] == "op":
        _, name, flops, nbytes, dtype, phase, recompute, dims = k
        dt, dims = _DTYPES[dtype], tuple(dims) if dims else None
        return lambda mark: Op(name, flops, nbytes, dt, phase, mark, None, mark, recompute, dims)
    _, kind, axes, nbytes, n, overlap, phase = k
    axes = tuple(axes)
    return lambda mark: Comm(kind, axes, nbytes, n, overlap, phase, mark, mark)
