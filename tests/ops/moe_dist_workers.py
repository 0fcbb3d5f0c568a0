"""Module-level workers for fpar.launch (picklable): the expert-parallel MoE on a real mesh and in-process."""

from __future__ import annotations

import math

import torch

import fpar
import fpar.ops as ops
from fpar import P

T, D, H, E, TOP_K = 12, 4, 6, 4, 2


def inputs(all_to_one: bool = False):
    """Global float64 parameters and tokens with a skewed router, the same in every process.

    ``all_to_one``: every token's first choice is expert 0 and its second expert 1 (both on
    device 0): device 1 receives no rows and sends its every pair away.
    """
    gen = torch.Generator().manual_seed(3)
    params = {
        "router": torch.randn(D, E, generator=gen, dtype=torch.float64) * 2.0,
        "w_in": torch.randn(E, D, H, generator=gen, dtype=torch.float64),
        "w_out": torch.randn(E, H, D, generator=gen, dtype=torch.float64),
    }
    params["router"][:, 0] += 1.5  # expert 0 (on device 0) takes most tokens
    x = torch.randn(T, D, generator=gen, dtype=torch.float64)
    ct = torch.randn(T, D, generator=gen, dtype=torch.float64)
    if all_to_one:
        x = x.abs() + 0.1
        params["router"] = torch.zeros(D, E, dtype=torch.float64)
        params["router"][:, 0], params["router"][:, 1] = 2.0, 1.0
    return params, x, ct


def kept_pairs(params, x, capacity_factor):
    """``(token, expert)`` of every pair an expert serves, by the rule of ``fpar.ops.moe``."""
    idx = torch.softmax(x @ params["router"], -1).topk(TOP_K, -1).indices
    cap = math.inf if capacity_factor is None else math.ceil(capacity_factor * T * TOP_K / E)
    served, kept = [0] * E, []
    for t in range(T):
        for ex in idx[t].tolist():
            if served[ex] < cap:
                served[ex] += 1
                kept.append((t, ex))
    return kept


def exact_bytes(rank: int, n: int, capacity_factor=None, all_to_one=False) -> int:
    """all_to_all bytes rank ``rank`` sends for one forward + backward under exact counts."""
    params, x, _ = inputs(all_to_one)
    t_local, e_local = T // n, E // n
    out = sum(
        1
        for t, ex in kept_pairs(params, x, capacity_factor)
        if t // t_local == rank and ex // e_local != rank
    )
    back = sum(
        1
        for t, ex in kept_pairs(params, x, capacity_factor)
        if t // t_local != rank and ex // e_local == rank
    )
    counts = (n - 1) * E * 8 // n  # the [n, E/n] int64 counts, forward only
    return 2 * (out + back) * D * 8 + counts  # dispatch + combine, forward and transposed


def program(mesh, capacity_factor=None, all_to_one=False):
    """(y, aux, grads of <y, ct> + aux, traffic, second call's values, .backward() grads) over "expert"."""
    params, x, ct = inputs(all_to_one)
    specs = ops.moe_specs("expert")

    def per_device(p, x):
        return ops.moe(p, x, top_k=TOP_K, axis="expert", capacity_factor=capacity_factor)

    layer = fpar.shard(per_device, mesh, (specs, P("expert")), (P("expert"), P()))
    p_local = fpar.device_put(params, mesh, specs)
    x_local, ct_local = fpar.device_put((x, ct), mesh, P("expert"))
    fpar.reset_comm_stats()
    (y, aux), vjp = torch.func.vjp(layer, p_local, x_local)
    grads = vjp((ct_local, torch.ones_like(aux)))
    stats = fpar.comm_stats()
    (y2, aux2), vjp2 = torch.func.vjp(layer, p_local, x_local)  # a planned (fast) call
    grads2 = vjp2((ct_local, torch.ones_like(aux2)))
    leaves = {k: v.detach().clone().requires_grad_() for k, v in p_local.items()}
    for _ in range(2):  # plain autograd, traced then planned on a real mesh
        for v in leaves.values():
            v.grad = None
        y3, aux3 = layer(leaves, x_local)
        ((y3 * ct_local).sum() + aux3).backward()
    grads3 = {k: v.grad for k, v in leaves.items()}

    def out(y, grads):
        return fpar.gather(y, mesh, P("expert")), (
            fpar.gather(grads[0], mesh, specs),
            fpar.gather(grads[1], mesh, P("expert")),
        )

    y, g = out(y, grads)
    y2, g2 = out(y2, grads2)
    return y, aux, g, stats, (y2, aux2, g2), fpar.gather(grads3, mesh, specs)


def worker(capacity_factor=None, all_to_one=False):
    """Run ``program`` on the real mesh of all launched processes."""
    return program(fpar.make_mesh((-1,), ("expert",)), capacity_factor, all_to_one)


def program_data_expert(mesh, capacity_factor=None):
    """(y, aux, stats, grads of <y, ct> + aux) on data x expert, tokens over both, twice (traced, planned)."""
    params, x, ct = inputs()
    specs = ops.moe_specs("expert")
    tokens = P(("data", "expert"))

    def per_device(p, x):
        return ops.moe(
            p,
            x,
            top_k=TOP_K,
            axis="expert",
            token_axes=("data", "expert"),
            capacity_factor=capacity_factor,
            return_stats=True,
        )

    layer = fpar.shard(per_device, mesh, (specs, tokens), (tokens, P(), P()))
    p_local = fpar.device_put(params, mesh, specs)
    x_local, ct_local = fpar.device_put((x, ct), mesh, tokens)
    out = []

    def split(p, x):
        y, aux, stats = layer(p, x)
        return (y, aux), stats

    for _ in range(2):
        (y, aux), vjp, stats = torch.func.vjp(split, p_local, x_local, has_aux=True)
        grads = vjp((ct_local, torch.ones_like(aux)))
        out.append(
            (
                fpar.gather(y, mesh, tokens),
                aux,
                stats,
                (fpar.gather(grads[0], mesh, specs), fpar.gather(grads[1], mesh, tokens)),
            )
        )
    return out


def worker_data_expert(capacity_factor=None):
    return program_data_expert(fpar.make_mesh((2, 2), ("data", "expert")), capacity_factor)
