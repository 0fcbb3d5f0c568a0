"""Module-level workers for fpar.launch (picklable): the expert-parallel MoE on a real mesh and in-process."""

from __future__ import annotations

import torch

import fpar
import fpar.ops as ops
from fpar import P

T, D, H, E, TOP_K = 12, 4, 6, 4, 2


def inputs():
    """Global float64 parameters and tokens with a skewed router, the same in every process."""
    gen = torch.Generator().manual_seed(3)
    params = {
        "router": torch.randn(D, E, generator=gen, dtype=torch.float64) * 2.0,
        "w_in": torch.randn(E, D, H, generator=gen, dtype=torch.float64),
        "w_out": torch.randn(E, H, D, generator=gen, dtype=torch.float64),
    }
    params["router"][:, 0] += 1.5  # expert 0 (on device 0) takes most tokens
    x = torch.randn(T, D, generator=gen, dtype=torch.float64)
    ct = torch.randn(T, D, generator=gen, dtype=torch.float64)
    return params, x, ct


def program(mesh):
    """Return (y, aux, grads of <y, ct> + aux, traffic) of the layer over axis "expert" of ``mesh``."""
    params, x, ct = inputs()
    specs = ops.moe_specs("expert")
    layer = fpar.shard(
        lambda p, x: ops.moe(p, x, top_k=TOP_K, axis="expert"), mesh, (specs, P("expert")), (P("expert"), P())
    )
    p_local = fpar.device_put(params, mesh, specs)
    x_local, ct_local = fpar.device_put((x, ct), mesh, P("expert"))
    fpar.reset_comm_stats()
    (y, aux), vjp = torch.func.vjp(layer, p_local, x_local)
    grads = vjp((ct_local, torch.ones_like(aux)))
    stats = fpar.comm_stats()
    out_grads = (fpar.gather(grads[0], mesh, specs), fpar.gather(grads[1], mesh, P("expert")))
    return fpar.gather(y, mesh, P("expert")), aux, out_grads, stats


def worker():
    """Run ``program`` on the real mesh of all launched processes."""
    return program(fpar.make_mesh((-1,), ("expert",)))
