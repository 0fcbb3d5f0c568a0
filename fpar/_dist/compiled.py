"""A real-mesh sharded call traced by ``torch.compile``: the whole step in one graph.

Under ``torch.compile`` (Dynamo tracing), a call of ``fpar.shard`` on a real mesh does not break
the graph: it runs its signature's *fast plan* (``shard.py``) as code Dynamo can trace.  The
plan was made by an eager call with the same signature (the traced call, which knows where the
replicated values meet varying ones); here nothing is intercepted:

* each source the plan sums is wrapped in :class:`_Traced` ``"pvary"`` (identity forward,
  all-reduce of the cotangent backward) instead of a gradient bucket, so the compiler sees every
  gradient all-reduce and may bucket and overlap them itself (Inductor's passes);
* every collective is :class:`_Traced`, an ``autograd.Function`` on
  ``torch.distributed._functional_collectives``, whose backward is JAX's transpose
  (``exchange._Exchange``'s rules), itself a :class:`_Traced`: Dynamo and AOTAutograd put the
  ``_c10d_functional`` ops of the forward *and* the backward into the graphs.

The per-call signature check (``agreement.py``) becomes Dynamo's guards: one check when the
eager call planned the signature, none per compiled call.  What cannot be traced is refused
with an error that says what to do: a signature with no fast plan (never called eagerly, or one
that stays traced), a ``torch.func`` transform around the step (Dynamo can drop a custom
Function's backward there, pytorch#193279), ``check_rep=False`` outputs that leave an axis
varying, ``fpar.ops.moe``'s exact-count exchange.  ``fpar.comm_stats()`` does not count compiled
calls (their messages are issued by the compiled graph, not by fpar's Python).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc

from .._collectives import Frame, frames
from .._compile import TRACED, answered_in_order
from .._registry import internal
from .._sums import widened
from .._tree import tree_flatten, tree_unflatten
from .groups import MeshGroups

__all__ = ["EXACT_COUNTS", "NOT_FAST", "UNPLANNED", "compiled_call", "groups_of"]

Tensor = torch.Tensor

_REDUCE = {"psum": "sum", "pmean": "sum", "pmax": "max", "pmin": "min"}
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def compiled_call(shard, plan, args: tuple) -> Any:
    """``shard(args)`` (a ``DistShard``) as code ``torch.compile`` traces into one graph.

    It runs the fast ``plan`` an eager call with the same signature made.
    """
    fname = shard.fname
    if torch._C._functorch.maybe_current_level() is not None:  # under Dynamo: an error in a transform
        raise RuntimeError(_FUNC_TRANSFORM.format(fname=fname))
    if any(plan.out_broken):
        raise NotImplementedError(
            f"fpar.shard({fname}) under torch.compile: an output left varying over an axis its "
            f"out_spec does not name (check_rep=False) is not supported in a compiled step; give "
            f"the output a spec that names the axis, or run the call eagerly."
        )
    coords, mg = shard.mg.coords, plan.groups
    leaves, treedef = tree_flatten(args)
    local = list(leaves)
    for i in plan.in_order:
        local[i] = _Traced.apply(leaves[i], "pvary", (), plan.in_reduce[i], mg)
    frame = Frame(mesh=shard.mesh, fname=fname, exchange=None, backend="dist")
    frame.token = _TOKEN
    frame.index = {a: torch.tensor(coords[a], dtype=torch.int64) for a in shard.axes}
    count = [0]

    def direct(kind: str, axes: tuple, params: tuple, x: Tensor) -> Tensor:
        k = count[0]
        count[0] += 1
        if k >= len(plan.coll) or plan.coll[k][0] != kind or plan.coll[k][1] != axes:
            raise RuntimeError(
                f"fpar.shard({fname}) under torch.compile: collective #{k} is {kind} over {axes}, "
                f"but the eager call with these shapes ran a different sequence of collectives. "
                f"A function whose collectives depend on values, not shapes, cannot be planned."
            )
        if kind == "all_to_all_v":  # _shard.py's trace_real runs such a call eagerly first
            raise NotImplementedError(EXACT_COUNTS.format(fname=fname))
        y = x.view_as(x) if kind == "pvary" else _Traced.apply(x, kind, params, axes, mg)
        reduce = plan.coll[k][2]
        if reduce:
            y = _Traced.apply(y, "pvary", (), reduce, mg)
        return y

    frame.collective = frame.direct = direct
    frame.varying = answered_in_order(plan.varying, fname)
    stack = frames()
    stack.append(frame)
    TRACED[0] += 1
    try:
        out = shard.f(*tree_unflatten(treedef, local))
    finally:
        TRACED[0] -= 1
        stack.pop()
    if count[0] != len(plan.coll):
        raise RuntimeError(
            f"fpar.shard({fname}) under torch.compile: {count[0]} collectives ran, the eager call "
            f"with these shapes ran {len(plan.coll)}."
        )
    return out


_TOKEN = torch.zeros(())

UNPLANNED = (
    "fpar.shard({fname}) under torch.compile: no eager call with these argument shapes yet. On a "
    "real mesh fpar plans each signature (shapes, dtypes, requires_grad) on its first call, which "
    "runs eagerly and checks the signature across ranks; a compiled step then traces that plan into "
    "its graph. Run the step once without torch.compile (e.g. the first step), then call the "
    "compiled one; without fullgraph=True the first compiled call runs the sharded call eagerly."
)

EXACT_COUNTS = (
    "fpar.shard({fname}) under torch.compile: fpar.ops.moe's expert-parallel exchange on a real mesh "
    "sends exactly the rows routed to each device, whose counts are data (read on the host every "
    "step), so the call cannot be traced into one graph. Run the step eagerly, or drop "
    "fullgraph=True: the call then runs eagerly at a graph break (MoE with axis=None, every expert "
    "on every device, compiles whole)."
)

NOT_FAST = (
    "fpar.shard({fname}) under torch.compile: this signature cannot be traced into one graph: its "
    "calls stay traced (a replicated value of unknown origin, e.g. a tensor the function captures "
    "instead of taking it as an argument, meets a varying one; or a source used both through a "
    "pvary and replicated into an output; or the function differentiates inside itself). Pass "
    "every parameter as an argument with its spec, or drop fullgraph=True to run the call eagerly."
)

_FUNC_TRANSFORM = (
    "fpar.shard({fname}) under torch.compile inside a torch.func transform (grad, vjp, vmap, ...): "
    "torch 2.13 cannot compile this form correctly (under torch.compile(torch.func.grad(f)) Dynamo "
    "can drop a custom autograd.Function's backward and return a local gradient, pytorch#193279). "
    "Compile a step that calls the sharded loss, then loss.backward() or torch.autograd.grad "
    "(with torch._dynamo.config.trace_autograd_ops = True for .backward() inside the compiled "
    "function), or run torch.func.grad without torch.compile."
)


def groups_of(plan, mg: MeshGroups) -> _Groups:
    """Every process group ``plan`` communicates over, forward and backward, with its rank maps.

    Computed eagerly, when the plan is made: a traced call only reads them, since Dynamo allows no
    mutation of outside state inside an ``autograd.Function``.
    """
    out = {}
    for axes in {*plan.in_reduce.values(), *(c[1] for c in plan.coll), *(c[2] for c in plan.coll if c[2])}:
        if axes:
            group = mg.group(axes)
            out[axes] = (group, tuple(dist.get_group_rank(group, r) for r in mg.members(axes)), mg.me(axes))
    return _Groups(out)


def _to_group_order(blocks: list, order: tuple) -> list:
    out = [None] * len(blocks)
    for m, g in enumerate(order):
        out[g] = blocks[m]
    return out


def _run(kind: str, params: tuple, x: Tensor, axes: tuple, mg: _Groups) -> Tensor:
    """One collective on the local block, as ``_c10d_functional`` ops (``exchange._run``'s semantics)."""
    group, order, _ = mg.groups[axes]
    n = len(order)
    if kind in ("psum", "pmean", "psum_scatter") and widened(x.dtype):
        wide = x.to(torch.float32)  # summed in float32, rounded once (exchange._widened)
        if kind == "pmean":
            wide, kind = wide / n, "psum"
        return _run(kind, params, wide, axes, mg).to(x.dtype)
    if kind in ("psum", "pmean", "psum_scatter") and x.dtype == torch.bool:
        return _run(kind, params, x.to(torch.int64 if kind == "pmean" else torch.int32), axes, mg)
    if kind == "pmean" and x.dtype in _LOW_PRECISION:  # native: each block divided first (exchange._run)
        return fc.all_reduce((x / n).contiguous(), "sum", group)
    if kind in _REDUCE:
        y = fc.all_reduce(x.contiguous(), _REDUCE[kind], group)
        return y / n if kind == "pmean" else y
    if kind in ("all_gather", "all_gather_invariant"):
        axis, tiled = params
        g = fc.all_gather_tensor(x.contiguous(), 0, group)  # group-rank order, stacked on dim 0
        blocks = list(g.chunk(n, 0))
        blocks = [blocks[order[m]] for m in range(n)]
        return torch.cat(blocks, axis) if tiled else torch.stack(blocks, axis)
    if kind == "psum_scatter":
        dim, tiled = params
        chunks = _to_group_order(list(x.chunk(n, dim)), order)
        y = fc.reduce_scatter_tensor(torch.cat([c.contiguous() for c in chunks], 0), "sum", 0, group)
        return y if tiled else y.squeeze(dim)
    if kind == "all_to_all":
        split, concat, tiled = params
        t = x.movedim(split, 0)
        chunks = list(t.unflatten(0, (n, t.shape[0] // n)).unbind(0))  # chunk j goes to member j
        send = torch.stack(_to_group_order(chunks, order)).contiguous()
        recv = fc.all_to_all_single(send, None, None, group)
        got = torch.stack([recv[order[m]] for m in range(n)])  # (n_src, c, *rest)
        got = got.movedim(1, 1 + split)
        if not tiled:
            got = got.squeeze(1 + split)
        got = got.movedim(0, concat)
        return got.flatten(concat, concat + 1) if tiled else got
    if kind == "ppermute":
        return _ppermute(x, params[0], mg, axes, group, order)
    raise AssertionError(kind)


def _ppermute(x: Tensor, perm, mg: _Groups, axes: tuple, group, order: tuple) -> Tensor:
    """A permutation as one ``all_to_all_single`` with uneven splits (funcol has no send/recv)."""
    me = mg.groups[axes][2]
    n = len(order)
    send_to = [d for s, d in perm if s == me]
    recv_from = [s for s, d in perm if d == me]
    numel = x.numel()
    sizes_in = [0] * n
    sizes_out = [0] * n
    if send_to:
        sizes_in[order[send_to[0]]] = numel
    if recv_from:
        sizes_out[order[recv_from[0]]] = numel
    flat = x.contiguous().reshape(-1)
    got = fc.all_to_all_single(flat, sizes_out, sizes_in, group)
    if not recv_from:
        return torch.zeros_like(x)
    return got.reshape(x.shape)


class _Groups:
    """What a traced collective needs of the mesh: ``groups[axes] = (group, order, me)``."""

    __slots__ = ("groups",)

    def __init__(self, groups: dict):
        self.groups = groups


@internal
class _Traced(torch.autograd.Function):
    """A collective on local blocks that Dynamo traces; its backward is JAX's transpose."""

    @staticmethod
    def forward(x: Tensor, kind: str, params: tuple, axes: tuple, mg: _Groups) -> Tensor:
        if kind == "pvary":
            return x.view_as(x)
        return _run(kind, params, x, axes, mg)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, ctx.kind, ctx.params, ctx.axes, ctx.mg = inputs
        if ctx.kind in ("pmax", "pmin"):
            ctx.save_for_backward(x, output)

    @staticmethod
    def backward(ctx, ct: Tensor):
        kind, p, axes, mg = ctx.kind, ctx.params, ctx.axes, ctx.mg
        n = len(mg.groups[axes][1])
        if kind == "psum":  # the cotangent of a replicated value: psum transposes to pvary
            g = ct
        elif kind == "pmean":
            g = ct / n
        elif kind in ("pmax", "pmin"):
            x, y = ctx.saved_tensors
            mask = (x == y).to(ct.dtype)
            g = ct * mask / _Traced.apply(mask, "psum", (), axes, mg)
        elif kind == "pvary":
            g = _Traced.apply(ct, "psum", (), axes, mg)
        elif kind == "all_gather":
            g = _Traced.apply(ct, "psum_scatter", p, axes, mg)
        elif kind == "all_gather_invariant":
            me = mg.groups[axes][2]
            g = ct.chunk(n, p[0])[me] if p[1] else ct.select(p[0], me)
        elif kind == "psum_scatter":
            g = _Traced.apply(ct, "all_gather", p, axes, mg)
        elif kind == "ppermute":
            g = _Traced.apply(ct, kind, (tuple((d, s) for s, d in p[0]),), axes, mg)
        else:  # all_to_all
            split, concat, tiled = p
            g = _Traced.apply(ct, kind, (concat, split, tiled), axes, mg)
        return g, None, None, None, None
