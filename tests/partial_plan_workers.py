"""Jobs for ``test_partial_plans.py``: a tensor-parallel stage without sequence parallelism.

``fpar.launch`` unpickles its function by module name, so the jobs live here at module level.
"""

from __future__ import annotations

import torch

import fpar
from fpar import P

D, H, ROWS, N_MICRO = 8, 16, 8, 2
SPECS = {"g": P(), "w1": P(None, "tensor"), "w2": P("tensor", None)}


def problem() -> tuple[dict, torch.Tensor]:
    """The parameters and the global batch (float64), the same on every rank."""
    gen = torch.Generator().manual_seed(5)
    params = {
        "g": torch.randn(D, dtype=torch.float64, generator=gen),
        "w1": torch.randn(D, H, dtype=torch.float64, generator=gen) / D**0.5,
        "w2": torch.randn(H, D, dtype=torch.float64, generator=gen) / H**0.5,
    }
    return params, torch.randn(ROWS, D, dtype=torch.float64, generator=gen)


def block(p: dict, x: torch.Tensor) -> torch.Tensor:
    """Megatron's MLP block on a residual stream replicated over 'tensor' (no sequence parallelism).

    ``x`` is read through a pvary over 'tensor' (into the column-parallel matmul) and returned
    replicated (the residual): its sums over 'tensor' stay at their uses, and so do those of ``g``,
    which a use sums together with it.  The parameters' sums over 'data' can sit at their sources.
    """
    return x + fpar.psum(torch.tanh((x * p["g"]) @ p["w1"]) @ p["w2"], "tensor")


def reference() -> dict:
    """The gradients of the whole batch's ``sum(block(x) ** 2)``, in one process, no fpar."""
    params, x = problem()
    leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
    y = x + torch.tanh((x * leaves["g"]) @ leaves["w1"]) @ leaves["w2"]
    (y**2).sum().backward()
    return {k: v.grad for k, v in leaves.items()}


def step_job() -> tuple[dict, dict, bool, list]:
    """Two steps of two microbatches, the first under ``fpar.defer_reduction()``, by ``.backward()``.

    Returns the second step's gradients (gathered), its ``comm_stats``, and the plan's ``fast``
    and ``at_use`` (the sums that stay at their uses).
    """
    from fpar._dist.shard import DistShard

    made, init = [], DistShard.__init__

    def record(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    mesh = fpar.make_mesh((2, -1), ("data", "tensor"))
    params, x = problem()
    DistShard.__init__ = record
    try:
        f = fpar.shard(block, mesh, (SPECS, P("data")), P("data"))
    finally:
        DistShard.__init__ = init
    placed = fpar.device_put(params, mesh, SPECS)
    xs = [fpar.device_put(c, mesh, P("data")) for c in x.chunk(N_MICRO)]
    grads, stats = {}, {}
    for _ in range(2):  # the first step plans the signature; the second is steady
        leaves = {k: v.detach().clone().requires_grad_() for k, v in placed.items()}
        fpar.reset_comm_stats()
        with fpar.defer_reduction():
            for xm in xs[:-1]:
                (f(leaves, xm) ** 2).sum().backward()
        (f(leaves, xs[-1]) ** 2).sum().backward()
        stats = fpar.comm_stats()
        grads = {k: fpar.gather(v.grad, mesh, SPECS[k]) for k, v in leaves.items()}
    (plan,) = made[0].plans.values()
    return grads, stats, plan.fast, sorted(str(p) for p in plan.at_use)
