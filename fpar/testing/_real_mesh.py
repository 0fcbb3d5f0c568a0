"""One run on a real mesh against the in-process mesh of the same shape, on every process.

``assert_same_on_real_mesh`` compares the global values a ``run(mesh, ...)`` returns; every rank
raises the same ``RealMeshMismatch``, naming the leaves that differ and what each rank raised.
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable
from typing import Any

import torch

from .._mesh import Mesh
from .._tree import keystr, tree_flatten_with_path

__all__ = ["RealMeshMismatch", "assert_same_on_real_mesh"]

F64 = torch.float64

Tensor = torch.Tensor

_TOLERANCE = {torch.float64: (1e-9, 1e-11), torch.complex128: (1e-9, 1e-11)}
_MAX_LISTED = 12  # differing leaves listed before "and N more"


# Comparing a run on a real mesh with the in-process mesh -----------------------------------------


class RealMeshMismatch(AssertionError):
    """Raised by :func:`assert_same_on_real_mesh` on every rank when the real mesh disagrees.

    ``raised`` says whether the real mesh raised (True) or returned values that differ (False).
    """

    def __init__(self, message: str, *, raised: bool):
        super().__init__(message)
        self.raised = raised


def assert_same_on_real_mesh(
    run: Callable[..., Any],
    mesh: Mesh,
    *args: Any,
    rtol: float | None = None,
    atol: float | None = None,
    **kwargs: Any,
) -> None:
    """Assert that ``run(mesh, *args, **kwargs)`` on a real mesh returns what it returns in-process.

    Point it at your own training loop: ``run(mesh, ...)`` builds the step for ``mesh``, places
    global inputs with ``fpar.device_put``, trains, evaluates, and returns a pytree of *global*
    values brought back with ``fpar.gather`` (both are the identity on the in-process mesh, so
    the same code runs on both).  It is run once on the in-process mesh of ``mesh``'s shape
    (``fpar.make_mesh(shape, names, backend="local")``, the reference: a plain differentiable
    torch program) and once on ``mesh``, then every leaf is compared.  Call it on every process
    of the real mesh, inside a ``fpar.testing.distributed`` body or under ``torchrun``.  The
    ranks agree on the outcome over a gloo group of their own, so every rank raises the same
    error naming what each rank saw; a rank that raised alone is reported by all once the
    others' collectives have finished (or given up after the process group's timeout).

    Args:
      run: ``run(mesh, *args, **kwargs) -> pytree`` of global tensors (and plain Python values).
      mesh: the real mesh (``mesh.backend == "dist"``).
      *args: passed to ``run`` after the mesh, the same on every process.
      rtol: relative tolerance; default 1e-9 for float64 (the meshes only sum in different
        orders), ``fpar.testing.default_tolerance`` for other dtypes.
      atol: absolute tolerance; default 1e-11 for float64, as above for other dtypes.
      **kwargs: passed to ``run``.

    Raises:
      RealMeshMismatch: (an ``AssertionError``) naming the path of every leaf that differs (its
        max absolute and relative error, and the worst element on each mesh), or, when ``run``
        raised on the real mesh, each rank's error and the first traceback.  An error of the
        in-process run is raised as it is (it is not the real mesh's).
      ValueError: ``mesh`` is not a real mesh.

    Example:
      >>> def train(mesh, steps):                  # your training loop, for any mesh
      ...     step = build_step(mesh)
      ...     params = fpar.device_put(init_params(), mesh, SPECS)
      ...     losses = []
      ...     for t in range(steps):
      ...         params, loss = step(params, fpar.device_put(batch(t), mesh, P("data")))
      ...         losses.append(loss)
      ...     return {"losses": losses, "params": fpar.gather(params, mesh, SPECS)}
      >>> @fpar.testing.distributed(4)
      ... def test_my_training_loop():
      ...     mesh = fpar.make_mesh((2, 1, 2), ("pipe", "tensor", "data"))
      ...     fpar.testing.assert_same_on_real_mesh(train, mesh, 3)
    """
    import torch.distributed as dist

    from .._mesh import make_mesh

    name = getattr(run, "__qualname__", None) or type(run).__name__
    if not isinstance(mesh, Mesh) or mesh.backend != "dist":
        raise ValueError(
            f"fpar.testing.assert_same_on_real_mesh({name}): mesh must be a real mesh (fpar.make_mesh "
            f"inside fpar.testing.distributed or under torchrun), got {mesh!r}."
        )
    group = _agreement_group()  # every rank is here: make it before anything can fail
    local = make_mesh(tuple(mesh.shape.values()), tuple(mesh.axis_names), backend="local")
    try:
        want = run(local, *args, **kwargs)
    except Exception as e:
        e._fpar_in_process = True  # the same on every rank, and nothing was sent: raised as it is
        raise
    try:
        got = run(mesh, *args, **kwargs)
        problems = _compare(got, want, rtol, atol)
        outcome: tuple = ("differ", problems) if problems else ("ok",)
    except Exception as e:  # noqa: BLE001 - reported on every rank below
        outcome = ("raised", f"{type(e).__name__}: {e}", traceback.format_exc())
    outcomes: list = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, outcome, group=group)
    if all(o[0] == "ok" for o in outcomes):
        return
    mesh_text = "x".join(f"{a}={s}" for a, s in mesh.shape.items())
    raised = any(o[0] == "raised" for o in outcomes)
    head = f"fpar.testing.assert_same_on_real_mesh({name}) on the real mesh [{mesh_text}]: " + (
        "it raised where the in-process mesh returned" if raised else "values differ from the in-process mesh"
    )
    raise RealMeshMismatch(head + "\n" + _by_rank(outcomes), raised=raised)


_GROUP: dict = {}


def _agreement_group():
    """A gloo group over every rank, for the ranks' verdicts only (fpar's own groups may be stuck)."""
    import torch.distributed as dist

    world = dist.group.WORLD
    if _GROUP.get("world") is not world:
        _GROUP.update(world=world, group=dist.new_group(backend="gloo"))
    return _GROUP["group"]


def _by_rank(outcomes: list) -> str:
    """Each distinct outcome once, with the ranks that had it (tracebacks: the first one only)."""
    seen: dict = {}
    for r, o in enumerate(outcomes):
        key = o[:2] if o[0] == "raised" else (o[0], tuple(o[1]) if len(o) > 1 else ())
        seen.setdefault(key, []).append(r)
    lines, shown_trace = [], False
    for key, ranks in seen.items():
        who = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
        if key[0] == "ok":
            lines.append(f"  {who}: same as in-process")
        elif key[0] == "differ":
            problems = list(key[1])
            more = len(problems) - _MAX_LISTED
            body = "\n".join(f"    {p}" for p in problems[:_MAX_LISTED])
            lines.append(
                f"  {who}: {len(problems)} value(s) differ:\n{body}"
                + (f"\n    ... and {more} more" if more > 0 else "")
            )
        else:
            lines.append(f"  {who} raised {key[1]}")
            if not shown_trace:
                trace = outcomes[ranks[0]][2]
                lines.append(f"  traceback (rank {ranks[0]}):\n    " + trace.strip().replace("\n", "\n    "))
                shown_trace = True
    return "\n".join(lines)


def _tolerance(dtype: torch.dtype, rtol: float | None, atol: float | None) -> tuple[float, float]:
    from ._equivalent import default_tolerance

    r, a = _TOLERANCE.get(dtype) or default_tolerance(dtype)
    return (r if rtol is None else rtol), (a if atol is None else atol)


def _compare(got: Any, want: Any, rtol: float | None, atol: float | None) -> list[str]:
    """Every leaf of ``got`` (real mesh) against ``want`` (in-process): a line per difference."""
    g_paths, g_leaves, g_def = tree_flatten_with_path(got)
    w_paths, w_leaves, w_def = tree_flatten_with_path(want)
    if g_def != w_def:
        return [f"the result's structure differs: real mesh {g_def}, in-process {w_def}"]
    out = []
    for path, g, w in zip(w_paths, g_leaves, w_leaves):
        where = keystr(path) or "the result"
        if not isinstance(w, Tensor):
            if isinstance(g, Tensor) or g != w:
                out.append(f"{where}: real mesh {g!r}, in-process {w!r}")
            continue
        if not isinstance(g, Tensor):
            out.append(f"{where}: real mesh gives a {type(g).__name__}, in-process a tensor")
            continue
        if g.shape != w.shape:
            out.append(
                f"{where}: shape {tuple(g.shape)} on the real mesh, {tuple(w.shape)} in-process (return "
                f"global values: bring blocks back with fpar.gather)"
            )
            continue
        if g.dtype != w.dtype:
            out.append(f"{where}: dtype {g.dtype} on the real mesh, {w.dtype} in-process")
            continue
        g, w = g.detach().cpu(), w.detach().cpu()
        if not (w.is_floating_point() or w.is_complex()):
            if not torch.equal(g, w):
                n = int((g != w).sum())
                out.append(f"{where}: {n} of {w.numel()} elements differ (exact dtype {w.dtype})")
            continue
        r, a = _tolerance(w.dtype, rtol, atol)
        g64 = g.to(torch.complex128 if w.is_complex() else F64)
        w64 = w.to(g64.dtype)
        diff = (g64 - w64).abs()
        nan = g64.isnan() != w64.isnan()
        both_nan = g64.isnan() & w64.isnan()
        bad = ((diff > a + r * w64.abs()) & ~both_nan) | nan
        if not bool(bad.any()):
            continue
        diff = torch.where(both_nan, torch.zeros_like(diff), diff).nan_to_num(nan=math.inf)
        worst = int(diff.flatten().argmax())
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), w.shape)) if w.dim() else ()
        rel = float((diff / w64.abs().clamp_min(1e-300)).max())
        out.append(
            f"{where}: max abs error {float(diff.max()):.3g}, max rel error {rel:.3g} (rtol={r:g}, "
            f"atol={a:g}), {int(bad.sum())} of {w.numel()} elements; worst at {list(idx)}: real mesh "
            f"{g64.flatten()[worst].item():.10g}, in-process {w64.flatten()[worst].item():.10g}"
        )
    return out
