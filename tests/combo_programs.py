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


def defer_unmatched(case):
    """Deferred microbatches, then the step's final call: its gradient, or the error it raised.

    ``matched``: the same tensors and shapes; ``shared``: one sharded function over two parameter
    sets (a stack's layers), each deferred then claimed by its own final call; ``other_tensors``
    (parameters cast inside the loop) and ``shorter`` (a short last microbatch: a new signature,
    traced) leave the deferred sums unreduced.
    """
    mesh = fpar.make_mesh((2,), ("data",))
    loss = _loss(mesh)
    g = torch.Generator().manual_seed(0)
    w = fpar.device_put(torch.randn(4, 4, generator=g, dtype=F64), mesh, P()).requires_grad_()
    v = fpar.device_put(torch.randn(4, 4, generator=g, dtype=F64), mesh, P()).requires_grad_()
    x = fpar.device_put(torch.randn(8, 4, generator=g, dtype=F64), mesh, P("data"))
    loss(w, x).backward()  # the signature's first (planned) call
    loss(w, x).backward()  # a steady one
    w.grad = v.grad = None
    with fpar.defer_reduction():
        loss(w, x).backward()
        if case == "shared":
            loss(v, x * 2).backward()
    if case in ("matched", "shared"):
        last_w, last_x = w, x
    elif case == "other_tensors":
        last_w, last_x = w.detach().clone().requires_grad_(), x  # e.g. parameters cast inside the loop
    else:  # a shorter last microbatch: a new signature, whose first call is traced
        last_w, last_x = w, x[:2]
    try:
        total = loss(last_w, last_x)
        if case == "shared":
            total = total + loss(v, x * 2)  # both layers' final calls, one backward
        total.backward()
    except RuntimeError as e:
        return str(e)
    return [w.grad.clone(), None if v.grad is None else v.grad.clone()]


def defer_cases():
    return [defer_unmatched(c) for c in ("matched", "shared", "other_tensors", "shorter")]


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
