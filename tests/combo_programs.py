"""Programs of features that worked alone but not together on the real mesh (``test_combos_dist.py``).

Module level, so that ``fpar.launch`` can pickle them.
"""

from __future__ import annotations

import torch

import fpar
from fpar import P

F64 = torch.float64


def gather_is_a_copy():
    """``fpar.gather`` of a replicated and of a split block, then the blocks updated in place."""
    mesh = fpar.make_mesh((2,), ("data",))
    g = torch.Generator().manual_seed(0)
    rep, split = torch.randn(3, 2, generator=g, dtype=F64), torch.randn(4, 2, generator=g, dtype=F64)
    want = {"rep": rep.clone(), "split": split.clone()}  # (in-process, device_put returns rep itself)
    blocks = fpar.device_put({"rep": rep, "split": split}, mesh, {"rep": P(), "split": P("data")})
    gathered = fpar.gather(blocks, mesh, {"rep": P(), "split": P("data")})
    shared = {k: gathered[k].data_ptr() == blocks[k].data_ptr() for k in blocks}
    for b in blocks.values():
        b.add_(1.0)  # a donated optimizer step writes into the blocks like this
    return shared, {k: torch.equal(gathered[k], v) for k, v in want.items()}


def _loss(mesh):
    return fpar.shard(
        lambda w, x: fpar.pmean(((x @ w) ** 2).mean(), "data"), mesh, in_specs=(P(), P("data")), out_specs=P()
    )


def compiled_shard():
    """``torch.compile(fpar.shard(f, ...), fullgraph=True)``: planned by an eager call, then compiled."""
    torch._dynamo.reset()
    mesh = fpar.make_mesh((2,), ("data",))
    f = _loss(mesh)
    g = torch.Generator().manual_seed(0)
    w = fpar.device_put(torch.randn(4, 4, generator=g, dtype=F64), mesh, P())
    x = fpar.device_put(torch.randn(8, 4, generator=g, dtype=F64), mesh, P("data"))
    compiled = torch.compile(
        f, fullgraph=True, backend="aot_eager"
    )  # Dynamo and AOTAutograd: what the form is about
    try:  # no eager call with these shapes yet: fpar's own message, not Dynamo's "no compiled frames"
        compiled(w, x)
        unplanned = None
    except Exception as e:  # noqa: BLE001
        unplanned = str(e)
    eager_value = f(w, x)
    wg = w.detach().clone().requires_grad_()
    f(wg, x).backward()
    eager_grad, wg.grad = wg.grad, None
    value = compiled(w, x)
    compiled(wg, x).backward()
    return unplanned, (eager_value, eager_grad), (value, wg.grad)
