"""Workers for the real-mesh checkpoint test (spawned processes import them by module name).

One launch of 4 gloo processes does everything (spawning is the slow part on 2 cores): load an
in-process checkpoint onto a (data=2, tensor=2) mesh, save it from there, load that onto a (4,)
mesh with other specs, then check failures: a process whose spec is bad, and processes that
disagree, make every process raise and leave the checkpoint intact.
"""

from __future__ import annotations

import collections

import torch

import fpar
from fpar import P

F64 = torch.float64
Moments = collections.namedtuple("Moments", ["mu", "nu"])


def global_tree():
    """The global values every test compares against (deterministic, mixed dtypes and leaves)."""
    g = torch.Generator().manual_seed(0)
    w1 = torch.randn(8, 12, generator=g, dtype=F64)
    w2 = torch.randn(12, 8, generator=g)
    return {
        "params": {"w1": w1, "w2": w2, "b": torch.arange(12)},
        "opt": {
            "moments": Moments(mu={"w1": w1 * 0.5, "w2": w2 * 0.25}, nu=torch.rand(4, 6, generator=g)),
            "count": torch.tensor(7),
        },
        "half": torch.randn(4, 4, generator=g).to(torch.bfloat16),
        "mask": torch.arange(16).reshape(4, 4) % 3 == 0,
        "step": 5,
        "name": "run-1",
        "none": None,
    }


SCALARS = {"step": None, "name": None, "none": None}
SPECS_22 = {  # on a (data=2, tensor=2) mesh
    "params": {"w1": P("data", "tensor"), "w2": P("tensor", None), "b": P("tensor")},
    "opt": {
        "moments": Moments(mu={"w1": P(None, ("tensor", "data")), "w2": P()}, nu=P("data")),
        "count": P(),
    },
    "half": P(None, "data"),
    "mask": P(("data", "tensor")),
    **SCALARS,
}
SPECS_4 = {  # on a (x=4,) mesh
    "params": {"w1": P(None, "x"), "w2": P("x"), "b": P("x")},
    "opt": {"moments": Moments(mu={"w1": P("x"), "w2": P(None, "x")}, nu=P("x")), "count": P()},
    "half": P("x"),
    "mask": P(None, "x"),
    **SCALARS,
}


def tensors_only(tree, specs):
    """The tensor part of a tree and its specs (fpar.gather takes tensors only)."""
    keys = ("params", "opt", "half", "mask")
    return {k: tree[k] for k in keys}, {k: specs[k] for k in keys}


def save_and_reshard(src: str, dst: str):
    """Rank's view of: src (in-process save) -> (2,2) blocks -> save dst -> (4,) blocks; then failures."""
    mesh = fpar.make_mesh((2, 2), ("data", "tensor"))
    blocks = fpar.checkpoint.load(src, mesh, SPECS_22, like=global_tree())  # like=: our Moments class
    written = fpar.checkpoint.save(dst, blocks, mesh, SPECS_22, step=3)
    mesh4 = fpar.make_mesh((4,), ("x",))
    resharded = fpar.checkpoint.load(dst, mesh4, SPECS_4, like=blocks)
    values, specs = tensors_only(resharded, SPECS_4)
    full = fpar.gather(values, mesh4, specs)
    return {
        "rank": torch.distributed.get_rank(),
        "written": written,
        "blocks": blocks,
        "resharded": resharded,
        "full": full,
        "bad_spec": _failure(dst, blocks, mesh, "spec"),
        "disagree": _failure(dst, blocks, mesh, "step"),
    }


def _failure(dst: str, blocks, mesh, kind: str) -> str:
    """Save step 4 where rank 2 has a bad spec, or where the ranks disagree on the step: every rank raises."""
    rank = torch.distributed.get_rank()
    specs, step = SPECS_22, 4
    if kind == "spec" and rank == 2:
        specs = {**SPECS_22, "half": P(None, "nope")}
    if kind == "step" and rank == 1:
        step = 5
    try:
        fpar.checkpoint.save(dst, blocks, mesh, specs, step=step)
    except ValueError as e:  # SpecError and CheckpointError are ValueErrors
        return f"{type(e).__name__}: {e}"
    return "no error"
