"""The randomized real-mesh tier: whole training programs on gloo processes == on the in-process mesh.

A real mesh runs fpar's fast-path machinery (plans per signature, the check carried by the first
message, gradients held in buckets, sums deferred to a step's last microbatch) that the in-process
mesh does not have; what breaks there breaks in *combinations*: pipeline x data x tensor with an
axis of size 1, the optimizer's sharded update after a step, evaluation between steps, the end of
the program.  This module checks such combinations the way a user meets them:

* :class:`TrainingProgram` (``_program.py``) describes one program and its layout (a small frozen dataclass: the
  mesh, the model, how gradients are taken, the optimizer, ...); ``program.run(mesh)`` trains it
  on any mesh and returns every step's loss, gradients, parameters, optimizer state and
  evaluation loss as *global* values.  ``fpar.testing.strategies.training_programs`` draws them.
* :func:`assert_same_on_real_mesh` (``_real_mesh.py``) runs any ``run(mesh, ...)`` (your own training loop) on a real
  mesh and on the in-process mesh of the same shape, on every process, and compares the global
  values it returns; every rank raises the same error, naming the leaves that differ.
* :func:`assert_programs_on_real_mesh` (here) is the parent's side: it runs a list of programs in as few
  process launches as it can (one per device count; a fresh one after a program that raised) and
  reports every failing program with its description and a line that reproduces it.

The in-process mesh is the reference: its gradients are exact by construction (a plain
differentiable torch program).  Every drawn value is float64, so the tolerance is tight
(``rtol=1e-9``, ``atol=1e-11`` by default: the two meshes only sum in different orders).
"""

from __future__ import annotations

import math
import os
import tempfile
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._mesh import Mesh
from ._program import TrainingProgram
from ._real_mesh import RealMeshMismatch, _agreement_group, assert_same_on_real_mesh

__all__ = ["assert_programs_on_real_mesh"]

Tensor = torch.Tensor


# Many programs, few launches ------------------------------------------------------------------------


def run_training_program(mesh: Mesh, program: TrainingProgram) -> dict:
    """``program.run(mesh)``: what each process runs for a program by default."""
    return program.run(mesh)


def _run_programs(
    programs: list, progress: str, rtol: float | None, atol: float | None, run: Callable | None = None
) -> list:
    """On every process: each program on its real mesh and in-process; a status per program run.

    After a program that raised on the real mesh the processes' state (pending sums, plans,
    messages in flight) is not to be trusted, so the rest are left to a fresh launch.  Rank 0
    appends each status to ``progress`` as it goes: the parent reads it if the launch dies.
    """
    import time

    import torch.distributed as dist

    from .._mesh import make_mesh

    rank0 = dist.get_rank() == 0

    def note(line: tuple) -> None:
        if rank0:
            with open(progress, "a") as f:
                f.write(repr(line) + "\n")

    statuses = []
    for i, program in enumerate(programs):
        note(("start", i))
        start = time.monotonic()
        try:
            mesh = make_mesh(program.shape, program.names)
            r, a = (rtol, atol) if rtol is not None or atol is not None else program.tolerance
            assert_same_on_real_mesh(run or run_training_program, mesh, program, rtol=r, atol=a)
            status = ("ok", "", False)
        except RealMeshMismatch as e:
            status = ("failed", str(e), e.raised)
        except Exception as e:  # noqa: BLE001
            # the in-process run raised (the same on every rank, nothing sent), or the ranks
            # could not even agree (a process gone): then the processes are not to be trusted
            where = "the in-process run" if getattr(e, "_fpar_in_process", False) else "the real mesh's check"
            text = f"{where} raised {type(e).__name__}: {e}\n{traceback.format_exc()}"
            status = ("failed", text, not getattr(e, "_fpar_in_process", False))
        status = (*status, time.monotonic() - start)
        statuses.append(status)
        note(("status", status[0], status[1][:20000], *status[2:]))
        if status[2]:
            break
    dist.barrier(group=_agreement_group())  # every rank got here: a crash after it is at exit
    note(("end",))
    return statuses


def _read_progress(path: str) -> tuple[list, int | None, bool]:
    """What a launch that failed left: its statuses, the program it started last, whether it ended."""
    import ast

    statuses, started, ended = [], None, False
    try:
        with open(path) as f:
            lines = [ast.literal_eval(line) for line in f if line.strip()]
    except (OSError, ValueError, SyntaxError):
        lines = []
    for line in lines:
        if line[0] == "start":
            started = line[1]
        elif line[0] == "status":
            statuses.append(line[1:])
        elif line[0] == "end":
            ended = True
    return statuses, started, ended


def assert_programs_on_real_mesh(
    programs: Sequence[TrainingProgram],
    *,
    timeout: float = 300.0,
    rtol: float | None = None,
    atol: float | None = None,
    run: Callable[[Mesh, TrainingProgram], Any] | None = None,
    max_launches: int = 4,
) -> dict:
    """Run each program on a real mesh of local gloo processes and in-process; assert they agree.

    Call it in the parent (a pytest test, a script): the programs are grouped by device count
    and every group runs in one launch of ``fpar.testing.distributed`` (processes are slow to
    start).  Inside, every process runs each program through :func:`assert_same_on_real_mesh`.
    A program whose values differ is reported and the launch goes on; after one that raised on
    the real mesh (or killed its processes, or hung) the rest run in a fresh launch.  A crash
    while the processes exit is reported against the launch's last program.

    Args:
      programs: from ``fpar.testing.strategies.training_programs`` or built by hand.
      timeout: seconds one launch may run (every program in it together).
      rtol: as for :func:`assert_same_on_real_mesh`; by default each program's ``tolerance``
        (float64's default, looser for bf16/fp16 compute).
      atol: as ``rtol``.
      run: what each process runs for a program, ``run(mesh, program) -> pytree`` of global
        values (default ``program.run(mesh)``); a module-level function (the processes import
        it by name), e.g. one that also checks your own model on the drawn layout.
      max_launches: launches per device count at most: a bug that makes every program raise
        costs a launch per program, so after this many the programs left are reported as not
        run instead.

    Returns:
      ``{"seconds": [per program], "launches": count}`` (timings, for budgeting a CI tier).

    Raises:
      AssertionError: listing every failing program: its index, its description, the line
        that builds it again (``TrainingProgram(...)``) and what went wrong.

    Example:
      >>> from hypothesis import given, settings, strategies as st
      >>> from fpar.testing import strategies as fst
      >>> @settings(max_examples=2, deadline=None)
      ... @given(st.lists(fst.training_programs(devices=2), min_size=5, max_size=5))
      ... def test_real_mesh(programs):               # 5 programs per launch
      ...     fpar.testing.assert_programs_on_real_mesh(programs)
    """
    from .._dist import LaunchError
    from ._distributed import distributed

    programs = list(programs)
    for i, p in enumerate(programs):
        if not isinstance(p, TrainingProgram):
            raise TypeError(
                f"fpar.testing.assert_programs_on_real_mesh: programs[{i}] is a {type(p).__name__}, "
                f"not a fpar.testing.TrainingProgram."
            )
    if isinstance(max_launches, bool) or not isinstance(max_launches, int) or max_launches < 1:
        raise ValueError(
            f"fpar.testing.assert_programs_on_real_mesh: max_launches must be a positive int, got {max_launches!r}."
        )
    by_devices: dict[int, list[int]] = {}
    for i, p in enumerate(programs):
        by_devices.setdefault(p.devices, []).append(i)
    failures: list[tuple[int, str]] = []
    not_run: list[int] = []
    seconds = [math.nan] * len(programs)
    launches = 0
    for n, todo in by_devices.items():
        for _ in range(max_launches):
            if not todo:
                break
            batch = [programs[i] for i in todo]
            with tempfile.TemporaryDirectory(prefix="fpar-programs-") as tmp:
                progress = os.path.join(tmp, "progress")
                launches += 1
                try:
                    statuses = distributed(n, timeout)(_run_programs)(batch, progress, rtol, atol, run)
                    crash = None
                except (LaunchError, TimeoutError) as e:
                    statuses, started, ended = _read_progress(progress)
                    crash = f"{type(e).__name__}: {e}"
            for j, (state, text, _raised, took) in enumerate(statuses):
                seconds[todo[j]] = took
                if state != "ok":
                    failures.append((todo[j], text))
            done = len(statuses)
            if crash is not None:
                if ended:
                    what, culprit = "the processes failed after the launch's last program, at exit", done - 1
                elif started is None:
                    what, culprit = "the launch failed before its first program started", 0
                else:
                    what, culprit = "the launch failed while this program ran", started
                failures.append((todo[culprit], f"{what}: {crash}"))
                done = max(done, culprit + 1)
            todo = todo[done:]
        not_run += todo
    if failures or not_run:
        failures.sort(key=lambda f: f[0])
        lines = [
            f"{len({i for i, _ in failures})} of {len(programs)} programs differ on a real mesh from the "
            f"in-process mesh ({launches} launches, {sum(s for s in seconds if s == s):.0f}s of programs):"
        ]
        for i, text in failures:
            p = programs[i]
            lines.append(
                f"\n--- program {i}: {p.describe()}\n    reproduce: "
                f"fpar.testing.assert_programs_on_real_mesh([fpar.testing.{p!r}])\n{_indent(text, 4)}"
            )
        if not_run:
            lines.append(
                f"\nnot run (max_launches={max_launches} spent on the failures above): programs "
                + ", ".join(f"{i} ({programs[i].describe()})" for i in sorted(not_run))
            )
        raise AssertionError("\n".join(lines))
    return {"seconds": seconds, "launches": launches}


def _indent(text: str, n: int) -> str:
    pad = " " * n
    return "\n".join(pad + line for line in text.strip().splitlines())
