"""Exchanges: the collectives on this process's local blocks, as differentiable Functions.

An exchange is an ``autograd.Function`` around process-group calls; its backward is the
transpose (DESIGN §3), itself an exchange, so grad-of-grad works.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch._C import _functorch

from .. import _recompute
from .. import _stats as stats
from .._compile import untraced
from .._registry import internal
from .._sums import widened
from .groups import SIMULATION, MeshGroups
from .pending import Pending, Stand

Tensor = torch.Tensor

# The one-buffer forms; torch 2.11 has them only under their older names (same arguments).
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)

# On a mesh on paper (fpar.plan) these three only account their buffers (``Simulation.collective``):
# torch.distributed's Python around the fake process group's call was a sixth of an estimate.


def all_gather_single(out: Tensor, x: Tensor, *, group, async_op: bool = False):
    if SIMULATION[0] is not None:
        return SIMULATION[0].collective((out, x), async_op)
    return _all_gather_single(out, x, group=group, async_op=async_op)


def reduce_scatter_single(out: Tensor, x: Tensor, *, group, async_op: bool = False):
    if SIMULATION[0] is not None:
        return SIMULATION[0].collective((out, x), async_op)
    return _reduce_scatter_single(out, x, group=group, async_op=async_op)


def all_reduce(x: Tensor, op=dist.ReduceOp.SUM, *, group, async_op: bool = False):
    if SIMULATION[0] is not None:
        return SIMULATION[0].collective((x,), async_op)
    return dist.all_reduce(x, op=op, group=group, async_op=async_op)


def _in_group_order(blocks: list[Tensor], members: list[int], group) -> list[Tensor]:
    """Reorder per-member blocks into the group's rank order."""
    out: list[Tensor] = [None] * len(blocks)  # type: ignore[list-item]
    for m, r in enumerate(members):
        out[dist.get_group_rank(group, r)] = blocks[m]
    return out


def _ordered(members: list[int], group) -> bool:
    """Whether ``members`` are in the group's rank order (then dim-0 blocks need no reordering)."""
    return all(dist.get_group_rank(group, r) == m for m, r in enumerate(members))


def _from_group_order(blocks: list[Tensor], members: list[int], group) -> list[Tensor]:
    return [blocks[dist.get_group_rank(group, r)] for r in members]


_REDUCE = {
    "psum": dist.ReduceOp.SUM,
    "pmean": dist.ReduceOp.SUM,
    "pmax": dist.ReduceOp.MAX,
    "pmin": dist.ReduceOp.MIN,
}


def _run(
    kind: str,
    params: tuple,
    x: Tensor,
    nb: int,
    axes,
    mg: MeshGroups,
    count_as: str | None = None,
    *,
    spent: bool = False,
) -> Tensor:
    """One collective on this process's local ``x`` (``nb`` batch dims, then the block).

    Counted in ``fpar.comm_stats`` here, where it is issued (forward and backward alike), as
    ``count_as`` if given (a widened ``pmean`` runs as the ``psum`` of its divided blocks).
    ``spent``: ``x`` is a contiguous temporary of the caller's that a sum may write its result
    into (a widened sum's float32 copy), not copied first.
    """
    group, members = mg.group(axes), mg.members(axes)
    n = len(members)
    if kind == "all_to_all_v":  # fpar.ops.moe's exact-count exchange (counted by the rows it sends)
        return _all_to_all_v(x, nb, *params, members, mg.rank, group, axes)
    stats.record(count_as or kind, axes, n, x, len(params[0]) if kind == "ppermute" else None)
    if kind in _REDUCE:
        if params:  # psum/pmean carried by the call's first message (shard.py's _Agreement)
            y = params[0].reduce(x, kind, n)
            if y is not None:
                return y
        if kind == "pmean" and x.dtype in _LOW_PRECISION:  # native: each block divided first
            y = (x.detach() / n).contiguous()  # (as DDP and Megatron-LM): no overflow where the mean fits
            all_reduce(y, group=group)
            return y
        y = x if spent else x.detach().clone(memory_format=torch.contiguous_format)
        all_reduce(y, _REDUCE[kind], group=group)
        return y / n if kind == "pmean" else y
    if kind in ("all_gather", "all_gather_invariant"):
        axis, tiled = params
        if _ordered(members, group):  # one buffer, blocks in mesh order: the members' own
            return _gather_one_buffer(x, nb + axis, tiled, n, group)
        bufs = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(n)]
        dist.all_gather(bufs, x.contiguous(), group=group)
        blocks = _from_group_order(bufs, members, group)
        return torch.cat(blocks, nb + axis) if tiled else torch.stack(blocks, nb + axis)
    if kind == "psum_scatter":
        dim, tiled = params
        if dist.get_backend(group) != "gloo" and _ordered(members, group):
            # One buffer, no per-chunk copies (gloo's reduce_scatter_single copies it all first).
            return _scatter_one_buffer(x, nb + dim, tiled, n, group)
        chunks = [c.contiguous() for c in x.chunk(n, nb + dim)]
        out = torch.empty_like(chunks[0])
        dist.reduce_scatter(out, _in_group_order(chunks, members, group), group=group)
        return out if tiled else out.squeeze(nb + dim)
    if kind == "ppermute":
        return _ppermute(x, params[0], members, mg.rank, group)
    if kind == "all_to_all":
        return _all_to_all(x, nb, *params, members, group)
    raise AssertionError(kind)  # unreachable: pvary never reaches _run


def _gather_one_buffer(x: Tensor, d: int, tiled: bool, n: int, group) -> Tensor:
    """All-gather into one buffer (``[n, *x.shape]``), then lay the blocks along dim ``d``.

    The blocks arrive in the group's rank order, which is the members' order here.  Dim 0 tiled
    is the buffer itself; another dim is one copy, as ``torch.cat``/``torch.stack`` of per-block
    buffers made (the list form also made ``n`` buffers and, on NCCL, copied out of its own
    flat one: ``n`` more kernels).
    """
    x = x.contiguous()
    flat = x.new_empty((n, *x.shape))
    all_gather_single(flat.view(-1), x.view(-1), group=group)
    if not tiled:
        return flat if d == 0 else flat.movedim(0, d).contiguous()
    if d == 0:
        return flat.view(n * x.shape[0], *x.shape[1:])
    return flat.movedim(0, d).reshape(*x.shape[:d], n * x.shape[d], *x.shape[d + 1 :])


def _scatter_one_buffer(x: Tensor, d: int, tiled: bool, n: int, group) -> Tensor:
    """Reduce-scatter dim ``d``'s ``n`` blocks from one buffer: block ``r`` moved to row ``r`` first."""
    blocks = x.unflatten(d, (n, x.shape[d] // n)) if tiled else x.unsqueeze(d + 1)
    rows = blocks.movedim(d, 0).contiguous()  # no copy for dim 0 of a contiguous x
    out = rows.new_empty(rows.shape[1:])
    reduce_scatter_single(out.view(-1), rows.view(-1), group=group)
    return out if tiled else out.squeeze(d)


def _ppermute(x: Tensor, perm, members: list[int], me_rank: int, group) -> Tensor:
    me = members.index(me_rank)
    send_to = [dst for src, dst in perm if src == me]
    recv_from = [src for src, dst in perm if dst == me]
    out = torch.zeros_like(x, memory_format=torch.contiguous_format)
    ops = []
    if send_to and send_to[0] != me:
        ops.append(dist.P2POp(dist.isend, x.contiguous(), members[send_to[0]], group))
    if recv_from and recv_from[0] != me:
        ops.append(dist.P2POp(dist.irecv, out, members[recv_from[0]], group))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    if recv_from and recv_from[0] == me:
        out.copy_(x)
    return out


def _all_to_all(x: Tensor, nb: int, split: int, concat: int, tiled: bool, members, group) -> Tensor:
    n = len(members)
    s = nb + split
    t = x.movedim(s, 0)  # (L_split, *rest)
    chunks = list(t.unflatten(0, (n, t.shape[0] // n)).unbind(0))  # chunk j goes to member j
    send = torch.stack(_in_group_order(chunks, members, group)).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    got = torch.stack(_from_group_order(list(recv.unbind(0)), members, group))  # (n_src, c, *rest)
    got = got.movedim(1, 1 + s)  # each source's chunk back in place: (n_src, *x.shape with c)
    if not tiled:
        got = got.squeeze(1 + s)
    got = got.movedim(0, nb + concat)
    return got.flatten(nb + concat, nb + concat + 1) if tiled else got


def _all_to_all_v(x: Tensor, nb: int, send: tuple, recv: tuple, members, me_rank: int, group, axes) -> Tensor:
    """An all_to_all of dim-0 rows with data-dependent split sizes (``fpar.ops.moe`` on a real mesh).

    ``send[j]`` rows of ``x`` (consecutive, in member order) go to member ``j``; ``recv[j]`` rows
    come from member ``j``, concatenated in member order.  The sizes are data exchanged by the
    caller, not part of the plan's signature.  Its transpose is the same exchange with ``send``
    and ``recv`` swapped.  Counted as an ``all_to_all`` of the bytes that leave this process
    (the rows sent to the other members).
    """
    if nb:
        raise NotImplementedError(
            "fpar: an all_to_all with data-dependent split sizes cannot run under vmap (jacrev, "
            "per-example gradients); fpar.ops.moe uses its static slots there."
        )
    me = members.index(me_rank)
    row = math.prod(x.shape[1:]) * x.element_size()
    stats._add("all_to_all", axes, sum(c for j, c in enumerate(send) if j != me) * row, n=len(members))
    x = x.contiguous()
    if len(members) == 1:
        return x.clone()
    out = x.new_empty((sum(recv), *x.shape[1:]))
    if _ordered(members, group):
        dist.all_to_all_single(out, x, list(recv), list(send), group=group)
        return out
    ranks = [dist.get_group_rank(group, r) for r in members]  # member j is group rank ranks[j]
    by_rank = sorted(range(len(members)), key=ranks.__getitem__)  # members in group rank order
    chunks = x.split(list(send))
    x_g = torch.cat([chunks[j] for j in by_rank])
    out_g = x.new_empty(out.shape)
    dist.all_to_all_single(out_g, x_g, [recv[j] for j in by_rank], [send[j] for j in by_rank], group=group)
    got = dict(zip(by_rank, out_g.split([recv[j] for j in by_rank])))
    return torch.cat([got[j] for j in range(len(members))])


@internal
class _Exchange(torch.autograd.Function):
    """A collective on local blocks; differentiable, with the transposes of DESIGN §3."""

    @staticmethod
    def forward(x: Tensor, kind: str, params: tuple, nb: int, axes: tuple, mg: MeshGroups) -> Tensor:
        if kind == "pvary":
            return x.view_as(x)
        if kind in _SUMS and (widened(x.dtype) or x.dtype == torch.bool):
            return _recompute.collective(kind, x, lambda: _widened(kind, params, x, nb, axes, mg))
        return _recompute.collective(kind, x, lambda: _run(kind, params, x, nb, axes, mg))

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, ctx.kind, ctx.params, ctx.nb, ctx.axes, ctx.mg = inputs
        if ctx.kind in _REDUCE:
            ctx.params = ()  # the signature check a first psum/pmean carried is done
        if ctx.kind in ("pmax", "pmin"):
            ctx.save_for_backward(x, output)
            ctx.save_for_forward(x, output)

    @staticmethod
    def vmap(info, in_dims, x: Tensor, kind: str, params: tuple, nb: int, axes: tuple, mg: MeshGroups):
        """Run the collective under ``vmap`` (jacrev, hessian, per-example gradients).

        The batch is one more leading dim of the block, which every collective carries along
        (``nb`` counts such dims).
        """
        d = in_dims[0]
        if d is None:
            return _Exchange.apply(x, kind, params, nb, axes, mg), None
        return _Exchange.apply(x.movedim(d, 0), kind, params, nb + 1, axes, mg), 0

    @staticmethod
    def jvp(ctx, x_t: Tensor, *_):
        """Forward mode: every collective is linear in its input, except pmax/pmin's choice."""
        if ctx.kind in ("pmax", "pmin"):
            x, y = ctx.saved_tensors
            mask = (x == y).to(x_t.dtype)
            total = _Exchange.apply(x_t * mask, "psum", (), ctx.nb, ctx.axes, ctx.mg)
            return total / _Exchange.apply(mask, "psum", (), ctx.nb, ctx.axes, ctx.mg)
        return _Exchange.apply(x_t, ctx.kind, ctx.params, ctx.nb, ctx.axes, ctx.mg)

    @staticmethod
    def backward(ctx, ct: Tensor):
        kind, p, nb, axes, mg = ctx.kind, ctx.params, ctx.nb, ctx.axes, ctx.mg
        n = len(mg.members(axes))
        if kind == "psum":
            # The replicated cotangent: psum transposes to pvary, whose own transpose (a second
            # derivative) is the psum again.
            g = _pvary(ct, nb, axes, mg)
        elif kind == "pmean":
            g = _pvary(ct, nb, axes, mg) / n
        elif kind in ("pmax", "pmin"):
            x, y = ctx.saved_tensors
            mask = (x == y).to(ct.dtype)
            g = ct * mask / _Exchange.apply(mask, "psum", (), nb, axes, mg)
        elif kind == "pvary":
            g = _Exchange.apply(ct, "psum", (), nb, axes, mg)
        elif kind == "all_gather":
            g = _Exchange.apply(ct, "psum_scatter", p, nb, axes, mg)
        elif kind == "all_gather_invariant":
            g = _own_chunk(ct, nb + p[0], p[1], mg.me(axes), n)
        elif kind == "psum_scatter":
            g = _Exchange.apply(ct, "all_gather", p, nb, axes, mg)
        elif kind == "ppermute":
            g = _Exchange.apply(ct, kind, (tuple((d, s) for s, d in p[0]),), nb, axes, mg)
        elif kind == "all_to_all_v":  # the rows go back: the split sizes swapped
            g = _Exchange.apply(ct, kind, (p[1], p[0]), nb, axes, mg)
        else:  # all_to_all
            split, concat, tiled = p
            g = _Exchange.apply(ct, kind, (concat, split, tiled), nb, axes, mg)
        return g, None, None, None, None, None


def _pvary(ct: Tensor, nb: int, axes: tuple, mg: MeshGroups) -> Tensor:
    """The identity on a cotangent, as a pvary Function only when something can differentiate it.

    The Function exists for its transpose (a psum) in a second derivative.  When no transform or
    autograd level tracks ``ct`` (the usual first-order gradient, also under one
    ``torch.func.grad``), it is ``ct`` itself: under functorch each custom Function costs ~0.4 ms
    of Python per call.
    """
    return _Exchange.apply(ct, "pvary", (), nb, axes, mg) if _tracked(ct) else ct


def _tracked(t: Tensor) -> bool:
    """Whether a computation on ``t`` can be differentiated (by any autograd or functorch level)."""
    stack = _functorch.get_interpreter_stack()
    if stack and any(i.key() != _functorch.TransformType.Grad for i in stack):
        return True  # jvp, vmap, functionalize: keep the Function's rules
    if torch.autograd.forward_ad._current_level >= 0:
        return True  # forward-mode AD is on: tangents may ride on t
    while True:
        if t.requires_grad:
            return True
        if not _functorch.is_functorch_wrapped_tensor(t):
            return False
        t = _functorch.get_unwrapped(t)


def _first_order_level(ct: Tensor) -> int | None:
    """Where ``ct`` lives when nothing can differentiate what is computed from it, else ``None``.

    ``0``: plain autograd without ``create_graph``.  ``L``: the only functorch transform is one
    ``torch.func.grad`` at level ``L``, the cotangent is its wrapper, and what it wraps is
    tracked by nothing (its graph ends when the transform returns).
    """
    if torch.autograd.forward_ad._current_level >= 0:
        return None
    stack = _functorch.get_interpreter_stack()
    if not stack:
        return None if torch.is_grad_enabled() and ct.requires_grad else 0
    if len(stack) != 1 or stack[0].key() != _functorch.TransformType.Grad:
        return None
    level = stack[0].level()
    if not _functorch.is_functorch_wrapped_tensor(ct) or _functorch.maybe_get_level(ct) != level:
        return None
    inner = _functorch.get_unwrapped(ct)
    if _functorch.is_functorch_wrapped_tensor(inner) or inner.requires_grad:
        return None
    return level


def summed(x: Tensor, kind: str, params: tuple, axes: tuple, mg: MeshGroups) -> Tensor:
    """A fast call's psum/pmean.

    As plain autograd ops where nothing but one ``torch.func.grad`` differentiates ``x``;
    otherwise the ``_Exchange`` Function.

    Under ``torch.func.grad`` every custom Function goes through functorch's
    ``custom_function_call`` (~0.4 ms of Python per call, forward and backward).  When ``x`` is
    tracked by that one level only, no second derivative can follow, so the transpose is needed
    to first order only, and that is an ordinary op's: psum's is the identity (pvary) and pmean's
    a division by the device count.  So the result is ``x.clone()`` (``x / n``), whose plain
    value is then overwritten by the all-reduce, out of autograd's sight (nothing saved it).
    The call's first psum/pmean, which carries the signature check (``params``: shard.py's
    ``_Agreement``), may come back unsettled (a ``Pending``): its history is then an add
    (``_pending_sum``).  Under plain autograd the carried one takes the same add (its history
    an add, whose cotangent a hook hands on through a differentiable pvary when the backward
    records a graph, ``create_graph``), or, waited for (a plan that reads it inside the
    function), the clone (division) above with that hook; other sums keep the Function there.
    """
    sums = kind in ("psum", "pmean")
    level = _first_order_level(x) if sums else None
    # Only a psum/pmean's params can be the carried check; other kinds' params are their own
    # (all_to_all's dims), and .reduce on them failed every fast .backward() call.
    plain_autograd = level is None and sums and params and _plain_autograd(x)
    if not (level or plain_autograd) or x.dtype in _LOW_PRECISION or x.dtype == torch.bool or x.is_complex():
        return _Exchange.apply(x, kind, params, 0, axes, mg)
    n = len(mg.members(axes))
    plain_x = _functorch._unwrap_for_grad(x, level) if level else x.detach()
    with torch._C._DisableFuncTorch():
        stats.record(kind, axes, n, plain_x)
        got = params[0].reduce(plain_x, kind, n) if params else None
    if plain_autograd and isinstance(got, Pending):
        return _carried_plain(x, kind, got, n, axes, mg)
    base = x / n if kind == "pmean" else x
    if isinstance(got, Pending):
        return _pending_sum(base, got, level)
    y = base if kind == "pmean" else x.clone()
    if plain_autograd:  # the carried sum, waited for (its plan reads it inside the function)
        _pvary_when_recorded(y, axes, mg)
        plain = y.detach()
    else:
        plain = _functorch._unwrap_for_grad(y, level)
    with torch._C._DisableFuncTorch():
        if got is not None:  # the check's message carried it, and it was waited for
            plain.copy_(got)
        elif kind == "psum":
            all_reduce(plain, group=mg.group(axes))
        else:  # the sum, then one division, as _run does
            total = plain_x.detach().clone(memory_format=torch.contiguous_format)
            all_reduce(total, group=mg.group(axes))
            plain.copy_(total / n)
    return y


def _plain_autograd(x: Tensor) -> bool:
    """Whether only plain autograd differentiates ``x`` (no ``torch.func`` transform, no forward AD)."""
    return (
        x.requires_grad
        and torch.is_grad_enabled()
        and not _functorch.get_interpreter_stack()
        and torch.autograd.forward_ad._current_level < 0
    )


@untraced
def _carried_plain(x: Tensor, kind: str, total: Pending, n: int, axes: tuple, mg: MeshGroups) -> Tensor:
    """The call's first psum/pmean under plain autograd, carried by its first message, no Function.

    ``base + Stand(total)`` as under ``torch.func.grad`` (``_pending_sum``): the add's backward
    hands the cotangent to ``base`` (a view of ``x``, or ``x / n``), the first-order transpose.
    A higher order (``create_graph``) needs pvary's own transpose, a psum of the cotangent's
    cotangent: a hook on ``base`` applies the differentiable pvary when the backward records a
    graph (grad mode is on in a hook exactly then).  ``autograd.Function.apply`` cost ~0.1 ms
    of a tiny data-parallel step.
    """
    base = x / n if kind == "pmean" else x.view_as(x)
    _pvary_when_recorded(base, axes, mg)
    return torch.add(base, Stand(total))


@untraced
def _pvary_when_recorded(t: Tensor, axes: tuple, mg: MeshGroups) -> None:
    """Under ``create_graph``, ``t``'s cotangent goes on through the differentiable pvary.

    So the cotangent's own cotangent is summed: the carried sum's second order.  A pre-hook on ``t``'s node (as a tensor hook, ~2 us cheaper); grad mode is on in a hook
    exactly when the backward records a graph.
    """
    t.grad_fn.register_prehook(
        lambda cts: (_pvary(cts[0], 0, axes, mg),) if torch.is_grad_enabled() else None
    )


def _pending_sum(base: Tensor, total: Pending, level: int) -> Tensor:
    """``total`` (a sum not yet waited for) at ``torch.func.grad``'s level, with ``base``'s history.

    At the level, ``base + stand`` records an add, whose backward hands the cotangent to
    ``base`` (``x``, or ``x / n`` for a pmean): the sum's first-order transpose.  Below it the
    add of a ``Stand`` returns ``total`` itself, so the value is the sum exactly (no rounding of
    ``base + (total - base)``) and is still waited for at its first use.
    """
    return torch.add(base, _functorch._wrap_for_grad(Stand(total), level))


def _own_chunk(ct: Tensor, dim: int, tiled: bool, me: int, n: int) -> Tensor:
    """This rank's block of a replicated cotangent of a gathered value (no communication)."""
    return ct.chunk(n, dim)[me] if tiled else ct.select(dim, me)


@internal
class _TakeFirst(torch.autograd.Function):
    """The block of coordinate 0 along ``axes`` on every process (``check_rep=False`` outputs)."""

    @staticmethod
    def forward(x: Tensor, axes: tuple, mg: MeshGroups) -> Tensor:
        y = x.detach().clone(memory_format=torch.contiguous_format)
        stats.record("broadcast", axes, len(mg.members(axes)), y)
        dist.broadcast(y, mg.members(axes)[0], group=mg.group(axes))
        return y

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.axes, ctx.mg = inputs

    @staticmethod
    def jvp(ctx, x_t: Tensor, *_):
        return _TakeFirst.apply(x_t, ctx.axes, ctx.mg)

    @staticmethod
    def vmap(info, in_dims, x: Tensor, axes: tuple, mg: MeshGroups):
        return _TakeFirst.apply(x, axes, mg), in_dims[0]

    @staticmethod
    def backward(ctx, ct: Tensor):
        # As in-process: only coordinate 0's block is the output, so only it gets a gradient.
        first = ctx.mg.me(ctx.axes) == 0
        return (ct if first else torch.zeros_like(ct)), None, None


_SUMS = ("psum", "pmean", "psum_scatter")
_LOW_PRECISION = (torch.float16, torch.bfloat16)
# A widened sum's float32 copy is made, sent and rounded back this many bytes at a time (at most):
# whole, it is twice the 16-bit buffer's bytes beside it (Llama 3 405B at tensor=8 with sequence
# parallelism: a 0.5 GiB float32 copy of each reduce-scatter's 0.25 GiB input, at a layer's peak).
PIECE_BYTES = 128 * 2**20


def _widened(kind: str, params: tuple, x: Tensor, nb: int, axes, mg: MeshGroups) -> Tensor:
    """Fpar's rule for sums over devices, as in-process (``_local._reduce``, README "Low precision").

    fp16/bf16 blocks are summed in float32 and rounded once to their dtype (unless
    ``fpar.low_precision_sums("native")``: then not widened at all); a mean divides each
    block by the device count first, so it does not overflow where the mean fits.  Bools are
    counted (int32, as JAX's psum of bools; a mean of them is a float).  A block whose float32
    copy exceeds ``PIECE_BYTES`` is summed in pieces along a dim the sum does not scatter (the
    same sums, element by element; a message a piece), each piece's copy freed before the next.
    """
    if x.dtype == torch.bool:
        return _run(kind, params, x.to(torch.int64 if kind == "pmean" else torch.int32), nb, axes, mg)
    scatter = nb + params[0] if kind == "psum_scatter" else None
    cut = _piece_dim(x, scatter) if kind == "psum_scatter" or not params else None
    k = 1 if cut is None else min(x.shape[cut], -(-x.numel() * 4 // PIECE_BYTES))
    if cut is None or k <= 1:  # (a psum carried by the call's first message is never cut: ``_Agreement``)
        return _wide_sum(kind, params, x, nb, axes, mg).to(x.dtype)
    # the piece's dim in the result: one fewer where the scatter dim before it is dropped
    d = cut - 1 if scatter is not None and not params[1] and cut > scatter else cut
    out: Tensor | None = None
    at = 0
    for piece in x.tensor_split(k, cut):
        got = _wide_sum(kind, params, piece, nb, axes, mg)
        if out is None:
            shape = list(got.shape)
            shape[d] = x.shape[cut]
            out = x.new_empty(shape)
        out.narrow(d, at, got.shape[d]).copy_(got)  # rounded once, as ``.to`` rounds
        at += got.shape[d]
        del got
    assert out is not None
    return out


def _piece_dim(x: Tensor, scatter: int | None) -> int | None:
    """The outermost dim of ``x`` of two or more elements that a sum may be cut along (not ``scatter``)."""
    return next((d for d in range(x.dim()) if d != scatter and x.shape[d] > 1), None)


def _wide_sum(kind: str, params: tuple, x: Tensor, nb: int, axes, mg: MeshGroups) -> Tensor:
    """The float32 sum (a mean: of the blocks each divided first) of a 16-bit block, not rounded back."""
    wide = x.to(torch.float32, memory_format=torch.contiguous_format)  # the sum's own buffer
    if kind == "pmean":
        wide.div_(len(mg.members(axes)))
        return _run("psum", params, wide, nb, axes, mg, count_as="pmean", spent=True)
    return _run(kind, params, wide, nb, axes, mg, spent=True)
