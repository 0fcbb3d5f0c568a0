"""A top-k mixture-of-experts layer with expert parallelism over ``all_to_all``.

``moe`` is the top-k MoE MLP of Switch / GShard / Mixtral (Fedus et al. 2021, arXiv:2101.03961;
Lepikhin et al. 2020, arXiv:2006.16668), dropless by default: no token is ever dropped, however
skewed the routing.  Unsharded it computes, for tokens ``x[T, D]``::

    probs  = softmax(x @ router)                       # [T, E]
    w, idx = topk(probs, top_k)                        # ties as torch.topk
    w      = w / w.sum(-1, keepdim=True)
    y[t]   = sum_j w[t, j] * gelu(x[t] @ w_in[idx[t, j]]) @ w_out[idx[t, j]]     # exact erf gelu
    aux    = E * sum_e f_e * P_e                       # Switch load-balancing loss

with ``f_e`` the fraction of the ``T * top_k`` (token, choice) pairs routed to expert ``e`` (no
gradient) and ``P_e`` the mean router probability of ``e``, both over *all* tokens.

**Capacity** (``capacity_factor=cf``): expert ``e`` serves the first ``C = ceil(cf * T * top_k /
E)`` pairs routed to it in *global* token order (``T`` all tokens over ``token_axes``; GShard's
first-come rule); a later pair's term is dropped from ``y[t]`` (zero expert output, the residual
carries the token, its weight not renormalised).  Each device learns the pairs routed to each
expert by the devices before it with one all_gather of ``E`` counts, so the kept set, and the
result, are the unsharded layer's on every layout.  ``return_stats=True`` also returns the
routed pairs per expert and the pairs dropped (global, replicated): load balance for logging.

**Exact shapes where shapes may depend on data.**  Unsharded (outside ``vmap``) and on a real
mesh the per-device function runs on plain tensors, so the kept pairs are sorted by expert
(stable: token order within an expert) and each expert computes exactly its rows: one
``torch._grouped_mm`` per weight where the build has it and the operands fit (fp32/bf16/fp16,
rows of a multiple of 16 bytes; measured faster than per-expert matmuls on this CPU build, fwd+bwd
30 vs 41 ms at 2048 rows D=256 H=512 E=8), else one matmul per expert segment (a loop over
experts, never over tokens).  One host read of the counts per layer (``.tolist()``) sizes them.

**Expert parallelism on a real mesh: exact counts** (``axis="expert"``; tokens split over the
axis, experts too, ``E / n`` per device, ``w_in``/``w_out`` split on dim 0, the router
replicated).  Megatron-Core / torchtitan / MegaBlocks style:

1. the kept pairs sorted by global expert, so by destination device, then local expert;
2. one small ``all_to_all`` of the per-expert counts ``[n, E/n]`` (int64): each device learns
   how many rows of each of its experts every source sends;
3. an ``all_to_all`` of exactly those rows with those split sizes (``all_to_all_v`` of
   ``fpar/_dist/exchange.py``; the sizes are data, not part of the plan's signature, so ranks
   whose routing differs, as they always do, agree), regrouped source-major -> expert-major,
   the grouped FFN on exactly the rows received, the inverse regrouping, and the same exchange
   back with the split sizes swapped.  The backward is the transpose: the two exchanges again,
   splits reversed.

Per-device bytes (``fpar.comm_stats()``, the bytes that actually leave the process), ``s`` the
element size, ``out`` the rows this device sends to other devices' experts and ``in`` the rows
it receives from other devices::

    forward   (out + in) D s              dispatch + combine
              + (n - 1)/n * E * 8         the counts
    backward  (out + in) D s              the two transposes

Under balanced routing ``out = in = (n-1)/n * T_local * top_k``: ``(n-1)/n * T_local * top_k *
D * s`` per exchange, four exchanges per step.  Under a skewed router the bytes are the rows
routed, and the memory the routed rows (every token on one expert at T = 8192 runs dropless).

**The in-process mesh: static slots.**  There every per-device function runs under
``torch.func.vmap``, which forbids data-dependent shapes, so each (source -> destination) slot is
padded to its static worst case: a token picks ``top_k`` distinct experts, at most ``min(E/n,
top_k)`` of them on one device, so a slot holds ``C = T_local * min(E/n, top_k)`` rows, sent with
two ``all_to_all`` of the payload plus one of the slots' local expert ids.  The compute does not
pay for the padding: the received slots are sorted by expert with the empty ones last, outside
every group, and ``_DevicesFFN``'s vmap rule folds the devices of a mesh level into the rows and
the groups of one pair of grouped matmuls, which compute only the valid rows (without
``torch._grouped_mm``, or in float64, tiles of one expert each, every expert's group padded to a
tile multiple, one batched matmul: at most ``1.5 R`` rows; megablocks' block-sparse layout, Gale
et al. 2022, arXiv:2211.15841).  The static slots' bytes, as the in-process mesh counts them::

    2 * (n - 1) * C * D * s        the dispatch and the combine  (n * C * D elements each)
    + (n - 1) * C * 8              the local expert id of every slot (int64)

and ``2 (n-1) C D s`` again backward: ``n`` times the balanced exact count when ``E/n >= top_k``.
(A ``vmap`` inside a real-mesh call, jacrev or per-example gradients, also takes the static slots.)

Composition: ``token_axes`` names every mesh axis the tokens are split over (default ``axis``),
so the aux loss is the global one, e.g. tokens over ``("data", "expert")`` with experts over
``"expert"``; ``tensor_axis`` splits every expert's hidden dim ``H`` (expert-TP: ``w_in``
column-split, ``w_out`` row-split, one psum of ``[T_local, D]`` over it).

Shape suffixes, per device inside ``fpar.shard``: ``T`` tokens, ``D`` model dim, ``E`` experts
(``E/n`` local), ``H`` expert hidden dim (``H/t`` under expert-TP), ``K`` = top_k.
"""

from __future__ import annotations

import itertools
import math
import warnings

import torch
import torch.nn.functional as F
from torch._C import _functorch
from torch._subclasses.fake_tensor import is_fake

import fpar
from fpar import P
from fpar._collectives import frames

from . import _check as check

__all__ = ["init_moe", "moe", "moe_block", "moe_specs"]

Tensor = torch.Tensor

# Tiles per expert that the rows would fill if spread evenly: tile rows b = ceil(R / (2 E)).
_TILES_PER_EXPERT = 2


def moe(
    params: dict,
    x: Tensor,
    *,
    top_k: int = 2,
    axis=None,
    token_axes=None,
    tensor_axis=None,
    capacity_factor: float | None = None,
    return_stats: bool = False,
):
    """Apply a top-k mixture-of-experts MLP; return ``(y, aux_loss)`` (``+ (stats,)``).

    Args:
      params: ``{"router": [D, E], "w_in": [E, D, H], "w_out": [E, H, D]}`` (global shapes; inside
        ``fpar.shard`` the blocks of ``fpar.ops.moe_specs(axis, tensor_axis=...)``).
      x: tokens ``[T, D]`` (leading dims are flattened into tokens and restored in ``y``); with
        ``axis`` this device's block of the tokens.
      top_k: experts per token, ``1 <= top_k <= E``.
      axis: the expert-parallel mesh axis (or tuple of axes): experts and tokens are split over
        it and pairs travel by ``all_to_all``.  ``None``: every expert is local.
      token_axes: every mesh axis the tokens are split over, for the global aux loss (default:
        ``axis``, or none).  Tokens over ``("data", "expert")`` need ``token_axes=("data",
        "expert")``.  Naming an axis the tokens are *not* split over counts them twice.
      tensor_axis: expert tensor parallelism: ``w_in`` split on ``H`` (dim 2), ``w_out`` on ``H``
        (dim 1) over this axis, ``x`` and the router replicated over it; one psum of ``y``.
      capacity_factor: ``None`` (default): dropless.  A float ``> 0``: each expert takes at most
        ``C = ceil(capacity_factor * T * top_k / E)`` (token, choice) pairs, ``T`` the *global*
        tokens (over ``token_axes``), first come first served in global token order (GShard's
        rule; a token's choices go to distinct experts, so token order decides).  A dropped pair
        contributes zero expert output (the residual carries the token); its router weight is
        not renormalised.  The result does not depend on the layout.
      return_stats: also return ``stats = {"counts": int64 [E], "dropped": int64 0-d}``: the
        (token, choice) pairs routed to each expert and the pairs dropped by the capacity, over
        every token of ``token_axes`` (replicated, for logging; costs one all_gather of ``E``
        ints over ``token_axes``, which ``capacity_factor`` needs anyway).

    Returns:
      ``y`` shaped like ``x`` (split like it) and ``aux_loss``, a 0-d tensor replicated over
      ``token_axes`` (and ``tensor_axis``); with ``return_stats``, ``stats`` as a third element.

    Raises:
      TypeError / ValueError: naming the argument, before any communication, for a bad
        ``top_k`` (``top_k > E`` included), experts not divisible over ``axis``, a capacity
        factor that is not a positive finite number, or router / expert / token shapes that
        disagree.  (Tokens not divisible over the axis are rejected by ``fpar.shard`` itself.)

    Example:
      >>> mesh = fpar.make_mesh((4,), ("expert",))
      >>> f = fpar.shard(lambda p, x: fpar.ops.moe(p, x, axis="expert"), mesh,
      ...                (fpar.ops.moe_specs("expert"), P("expert")), (P("expert"), P()))
      >>> y, aux = f(params, x)
    """
    check.floating("moe", "x", check.tensor("moe", "x", x, min_ndim=2))
    n, token_axes = check_moe_args(
        "moe", params, x.shape[-1], top_k, axis, token_axes, tensor_axis, capacity_factor
    )
    if not isinstance(return_stats, bool):
        raise TypeError(f"fpar.ops.moe: return_stats must be a bool, got {return_stats!r}.")
    router, w_in, w_out = params["router"], params["w_in"], params["w_out"]
    d, e = router.shape
    shape = x.shape
    x_TD = x.reshape(-1, d)
    t = x_TD.shape[0]
    probs_TE = torch.softmax(x_TD @ router, dim=-1)
    w_TK, idx_TK = probs_TE.topk(top_k, dim=-1)
    w_TK = w_TK / w_TK.sum(-1, keepdim=True)
    aux = _aux_loss(probs_TE, idx_TK, token_axes)
    keep_TK, stats = None, None
    if capacity_factor is not None or return_stats:
        keep_TK, stats = _capacity(idx_TK, e, capacity_factor, token_axes)
    if axis is None:
        if _dynamic_shapes_ok(x_TD):
            y_TKD = _local_exact(x_TD, idx_TK, keep_TK, w_in, w_out)
        else:  # under vmap (the in-process mesh): fixed shapes
            pairs = torch.arange(t * top_k, device=x.device) // top_k
            keep = None if keep_TK is None else keep_TK.reshape(-1)
            y_TKD = _grouped_ffn(x_TD, pairs, idx_TK.reshape(-1), keep, w_in, w_out).view(t, top_k, d)
    else:
        frame = _real_frame()
        if frame is not None and _dynamic_shapes_ok(x_TD):
            y_TKD = _expert_parallel_exact(x_TD, idx_TK, keep_TK, w_in, w_out, axis, n, frame)
        else:
            y_TKD = _expert_parallel(x_TD, idx_TK, keep_TK, w_in, w_out, axis, n)
    y_TD = (w_TK.unsqueeze(-1) * y_TKD).sum(1)
    if tensor_axis is not None:
        y_TD = fpar.psum(y_TD, tensor_axis)
    if return_stats:
        return y_TD.reshape(shape), aux, stats
    return y_TD.reshape(shape), aux


def check_moe_args(
    api: str, params, d_x: int, top_k, axis, token_axes, tensor_axis, capacity_factor=None
) -> tuple[int, tuple]:
    """Check ``moe``'s arguments (``d_x``: the tokens' width); return the axis size and the token axes.

    Raises before any communication, naming the argument and the fix (``fpar.ops.gpt`` calls it
    for every MoE block before its first block runs).
    """
    check.params(api, params, ("router", "w_in", "w_out"), (), "moe")
    router, w_in, w_out = params["router"], params["w_in"], params["w_out"]
    check.tensor(api, "params['router']", router, ndim=2)
    check.tensor(api, "params['w_in']", w_in, ndim=3)
    check.tensor(api, "params['w_out']", w_out, ndim=3)
    n = 1 if axis is None else check.axis_size(api, axis)
    if tensor_axis is not None:
        check.axis_size(api, tensor_axis)
    d, e = router.shape
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= e:
        raise ValueError(
            f"fpar.ops.{api}: top_k must be an int with 1 <= top_k <= E = {e} experts, got {top_k!r}."
        )
    if capacity_factor is not None and (
        isinstance(capacity_factor, bool)
        or not isinstance(capacity_factor, (int, float))
        or not math.isfinite(capacity_factor)
        or capacity_factor <= 0
    ):
        raise ValueError(
            f"fpar.ops.{api}: capacity_factor must be None (dropless) or a finite number > 0 "
            f"(each expert takes at most ceil(capacity_factor * T * top_k / E) pairs), got "
            f"{capacity_factor!r}."
        )
    if e % n:
        raise ValueError(
            f"fpar.ops.{api}: the router has E = {e} experts, not divisible by the size {n} of axis "
            f"{axis!r}; expert parallelism puts E/n experts on each device. Use a number of experts "
            f"divisible by {n}."
        )
    fix = (
        f"Give w_in and w_out the spec P({axis!r}, ...) on dim 0 (fpar.ops.moe_specs({axis!r})), the "
        f"router [D, E] replicated."
        if axis is not None
        else "With axis=None every device holds all E experts: w_in is [E, D, H], w_out [E, H, D]."
    )
    check.same(api, "x's last dim != router.shape[0]", d_x, d, "x is [T, D] and router [D, E].")
    check.same(
        api,
        f"w_in.shape[0] (experts on this device) != E / n = {e} / {n}",
        w_in.shape[0],
        e // n,
        fix,
    )
    check.same(api, "w_in.shape[1] != D (router.shape[0])", w_in.shape[1], d, "w_in is [E, D, H].")
    check.same(api, "w_out.shape[0] != w_in.shape[0]", w_out.shape[0], w_in.shape[0], "w_out is [E, H, D].")
    h_in, h_out = w_in.shape[2], w_out.shape[1]
    check.same(api, "w_out.shape[1] != w_in.shape[2] (H)", h_out, h_in, "w_out is [E, H, D].")
    check.same(api, "w_out.shape[2] != D (router.shape[0])", w_out.shape[2], d, "w_out is [E, H, D].")
    token_axes = _token_axes(api, axis, token_axes)
    if tensor_axis is not None and set(_axes(tensor_axis)) & set(_axes(axis) + token_axes):
        raise ValueError(
            f"fpar.ops.{api}: tensor_axis={tensor_axis!r} overlaps axis={axis!r} / token_axes="
            f"{token_axes!r}; expert-TP splits each expert's hidden dim over an axis the tokens are "
            f"replicated over."
        )
    return n, token_axes


_moe_layer = moe  # moe_block's keyword ``moe`` shadows the function


def _axes(axis) -> tuple:
    return () if axis is None else (axis,) if isinstance(axis, str) else tuple(axis)


def _token_axes(api: str, axis, token_axes) -> tuple:
    if token_axes is None:
        return _axes(axis)
    names = _axes(token_axes)
    if not all(isinstance(a, str) for a in names):
        raise TypeError(
            f"fpar.ops.{api}: token_axes must be a mesh axis name or a tuple of names, got {token_axes!r}."
        )
    for a in names:
        check.axis_size(api, a)
    missing = [a for a in _axes(axis) if a not in names]
    if missing:
        raise ValueError(
            f"fpar.ops.{api}: token_axes={token_axes!r} leaves out {missing}, but expert parallelism "
            f"splits the tokens over axis={axis!r}; list every axis the tokens are split over, e.g. "
            f"token_axes={tuple(names) + tuple(missing)!r}."
        )
    return names


def _aux_loss(probs_TE: Tensor, idx_TK: Tensor, token_axes: tuple) -> Tensor:
    """Switch's ``E * sum_e f_e P_e`` over the tokens of every device along ``token_axes``."""
    t, e = probs_TE.shape
    k = idx_TK.shape[1]
    counts_E = F.one_hot(idx_TK, e).sum((0, 1)).to(probs_TE.dtype)
    sums_2E = torch.stack([probs_TE.sum(0), counts_E.detach()])
    total = t
    if token_axes:
        sums_2E = fpar.psum(sums_2E, token_axes)  # one all-reduce of 2E numbers
        total = t * fpar.axis_size(token_axes)
    p_E = sums_2E[0] / total
    f_E = sums_2E[1].detach() / (total * k)
    return e * (f_E * p_E).sum()


def _capacity(idx_TK: Tensor, e: int, capacity_factor, token_axes: tuple) -> tuple[Tensor | None, dict]:
    """Which pairs an expert keeps under ``capacity_factor`` (``None``: all), and the layer's stats.

    A pair's place in its expert's queue is the number of pairs routed to that expert by the
    tokens before it in *global* token order: the pairs of the devices before this one along
    ``token_axes`` (one all_gather of the per-expert counts) plus the earlier local ones.  So
    the kept set is the unsharded layer's on every layout.
    """
    t, k = idx_TK.shape
    expert = idx_TK.reshape(-1)
    onehot = F.one_hot(expert, e)  # [T K, E]
    counts_E = onehot.sum(0)
    t_all, prefix_E, total_E = t, None, counts_E
    if token_axes:
        every_NE = fpar.all_gather_invariant(counts_E, token_axes)  # [devices along token_axes, E]
        m = every_NE.shape[0]
        before_N = torch.arange(m, device=expert.device) < fpar.axis_index(token_axes)
        prefix_E = (every_NE * before_N.unsqueeze(1)).sum(0)
        total_E, t_all = every_NE.sum(0), t * m
    keep, dropped = None, total_E.new_zeros(())
    if capacity_factor is not None:
        cap = math.ceil(capacity_factor * t_all * k / e)
        place = ((onehot.cumsum(0) - onehot) * onehot).sum(1)  # earlier local pairs, same expert
        if prefix_E is not None:
            place = place + prefix_E[expert]
        keep = (place < cap).view(t, k)
        dropped = (total_E - cap).clamp(min=0).sum()
    return keep, {"counts": total_E, "dropped": dropped}


def _dynamic_shapes_ok(x: Tensor) -> bool:
    """Whether shapes may depend on the routing: no vmap (the in-process mesh, jacrev), no forward
    AD, and real values to read (not the meta / fake tensors of ``fpar.plan``'s paper mesh)."""
    if x.is_meta or is_fake(x):
        return False
    if any(i.key() != _functorch.TransformType.Grad for i in _functorch.get_interpreter_stack() or ()):
        return False
    return torch.autograd.forward_ad._current_level < 0


def _real_frame():
    """The running real-mesh ``fpar.shard`` frame (its ``direct`` issues process-group calls), or None."""
    stack = frames()
    return stack[-1] if stack and stack[-1].direct is not None else None


def _sorted_pairs(idx_TK: Tensor, keep_TK: Tensor | None, e: int) -> tuple[Tensor, Tensor]:
    """The kept pairs sorted by expert (stable: token order within an expert), and counts ``[E]``."""
    expert = idx_TK.reshape(-1)
    if keep_TK is not None:
        expert = torch.where(keep_TK.reshape(-1), expert, e)  # dropped pairs sort last, uncounted
    order = torch.argsort(expert, stable=True)
    return order, torch.bincount(expert, minlength=e + 1)[:e]


def _local_exact(x_TD: Tensor, idx_TK: Tensor, keep_TK: Tensor | None, w_in: Tensor, w_out: Tensor) -> Tensor:
    """Every expert local, exact shapes: rows sorted by expert, one grouped FFN, back in place."""
    t, d = x_TD.shape
    k, e = idx_TK.shape[1], w_in.shape[0]
    order, counts_E = _sorted_pairs(idx_TK, keep_TK, e)
    counts = counts_E.tolist()
    sel = order[: sum(counts)]  # the kept pairs, by expert
    out = _ffn_exact(x_TD.index_select(0, sel // k), counts, w_in, w_out)
    return out.new_zeros(t * k, d).index_copy(0, sel, out).view(t, k, d)


def _expert_parallel_exact(
    x_TD: Tensor, idx_TK: Tensor, keep_TK: Tensor | None, w_in: Tensor, w_out: Tensor, axis, n: int, frame
) -> Tensor:
    """The real mesh's exact-count dispatch: ``[T, K, D]``, each pair's expert output (0 if dropped).

    1. the pairs sorted by global expert (so by destination device, then local expert);
    2. one small all_to_all of the per-expert counts ``[n, E/n]``: each device learns how many
       rows of each of its experts every source sends;
    3. an all_to_all of exactly those rows (split sizes as data), regrouped from source-major
       to expert-major, one grouped FFN on exactly the rows received, the inverse regrouping,
       and the same all_to_all back with the split sizes swapped.
    """
    t, d = x_TD.shape
    k, e_l = idx_TK.shape[1], w_in.shape[0]
    axes = _axes(axis)
    order, counts_E = _sorted_pairs(idx_TK, keep_TK, e_l * n)
    recv_NE = fpar.all_to_all(counts_E.view(n, e_l), axes, 0, 0)  # [source, local expert]
    sent_NE, got_NE = torch.stack([counts_E.view(n, e_l), recv_NE]).tolist()  # one host read
    send = tuple(sum(r) for r in sent_NE)
    recv = tuple(sum(r) for r in got_NE)
    sel = order[: sum(send)]  # the kept pairs, by destination then local expert
    rows = frame.direct("all_to_all_v", axes, (send, recv), x_TD.index_select(0, sel // k))
    per_expert = [sum(got_NE[s][j] for s in range(n)) for j in range(e_l)]
    if n > 1 and e_l > 1:  # source-major -> expert-major
        segs = torch.arange(rows.shape[0], device=rows.device).split([c for r in got_NE for c in r])
        perm = torch.cat([segs[s * e_l + j] for j in range(e_l) for s in range(n)])
        out = _ffn_exact(rows.index_select(0, perm), per_expert, w_in, w_out)
        out = out.new_zeros(out.shape).index_copy(0, perm, out)
    else:
        out = _ffn_exact(rows, per_expert, w_in, w_out)
    back = frame.direct("all_to_all_v", axes, (recv, send), out)
    return back.new_zeros(t * k, d).index_copy(0, sel, back).view(t, k, d)


def _ffn_exact(rows_RD: Tensor, counts: list, w_in: Tensor, w_out: Tensor) -> Tensor:
    """``gelu(rows @ w_in[e]) @ w_out[e]`` for rows sorted by expert, ``counts[e]`` rows each.

    One ``torch._grouped_mm`` per weight where the build has it and the operands fit its
    constraints (fp32/bf16/fp16, rows of a multiple of 16 bytes); otherwise one matmul per
    expert on its segment (a loop over experts, never over tokens).
    """
    if _grouped_mm_fits(rows_RD, w_in, w_out):
        offs = torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32, device=rows_RD.device)
        out = _gmm_ffn(rows_RD, offs, w_in, w_out)
        if out is not None:
            return out
    outs = [
        F.gelu(seg @ wi) @ wo
        for seg, wi, wo in zip(rows_RD.split(counts), w_in.unbind(0), w_out.unbind(0))
    ]
    return torch.cat(outs)


def _grouped_mm_fits(rows: Tensor, w_in: Tensor, w_out: Tensor) -> bool:
    if not _GROUPED_MM or rows.shape[0] == 0 or rows.dtype not in _GROUPED_DTYPES:
        return False
    s = rows.element_size()
    if (w_in.shape[1] * s) % 16 or (w_in.shape[2] * s) % 16:  # its stride rule
        return False
    return all(t.dtype == rows.dtype for t in (w_in, w_out))


def _top_is_vmap() -> bool:
    stack = _functorch.get_interpreter_stack() or ()
    return bool(stack) and stack[-1].key() == _functorch.TransformType.Vmap


def _sorted_ffn(
    rows: Tensor, key: Tensor, groups: int, w_in: Tensor, w_out: Tensor, strict: bool = False
) -> Tensor | None:
    """Row ``r`` through group ``key[r]``'s expert (``w_*[key[r]]``), zero where ``key[r] < 0``.

    Fixed shapes: the rows are sorted by group, invalid ones last (outside every group, so never
    computed), two grouped matmuls, and the inverse permutation.
    """
    last = torch.where(key < 0, groups, key)
    order = torch.argsort(last, stable=True)
    counts = torch.zeros(groups + 1, dtype=torch.long, device=rows.device).scatter_add(
        0, last, torch.ones_like(last)
    )
    offs = counts[:groups].cumsum(0).to(torch.int32)
    out = _gmm_ffn(rows.index_select(0, order), offs, w_in, w_out, strict)
    if out is None:
        return None
    out = out.new_zeros(out.shape).index_copy(0, order, out)  # row r back at r
    return torch.where((key >= 0).unsqueeze(1), out, 0.0)


class _DevicesFFN(torch.autograd.Function):  # not fpar-internal: the mesh's implicit pvary sees its operands
    """``_sorted_ffn`` over the devices of one mesh level at once (the in-process mesh).

    Under ``vmap`` torch has no batching rule for ``torch._grouped_mm`` and would loop over the
    devices, each slice's backward a full-size copy.  This Function's vmap rule sees the level's
    device dim: it folds the devices into the rows and the groups (device ``b``'s expert ``e`` is
    group ``b E + e`` when the weights vary over the level; ``e`` when they are shared), so one
    pair of grouped matmuls does every device's valid rows.  The rule runs plain ops, which
    the outer levels (a grad transform, other mesh axes) see as usual; the Function's own forward
    is never reached (it is applied only when the top transform is a vmap).
    """

    generate_vmap_rule = False

    @staticmethod
    def forward(rows, key, w_in, w_out):
        return _sorted_ffn(rows, key, w_in.shape[0], w_in, w_out)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, ct):
        raise NotImplementedError("fpar.ops.moe: _DevicesFFN is applied under vmap only")

    @staticmethod
    def vmap(info, in_dims, rows, key, w_in, w_out):
        b = info.batch_size
        rd, kd, wid, wod = in_dims

        def batched(t, d):
            return t.movedim(d, 0) if d is not None else t.expand(b, *t.shape)

        rows, key = batched(rows, rd), batched(key, kd)
        if wid is None and wod is None:
            groups, wi, wo = w_in.shape[0], w_in, w_out
            key_flat = key
        else:
            wi, wo = batched(w_in, wid), batched(w_out, wod)
            e = wi.shape[1]
            wi, wo = wi.flatten(0, 1), wo.flatten(0, 1)
            groups = b * e
            dev = torch.arange(b, device=key.device).unsqueeze(1) * e
            key_flat = torch.where(key < 0, key, key + dev)
        out = _sorted_ffn(rows.flatten(0, 1), key_flat.flatten(), groups, wi, wo, strict=True)
        return out.view(rows.shape), 0


def _gmm_ffn(rows: Tensor, offs: Tensor, w_in: Tensor, w_out: Tensor, strict: bool = False) -> Tensor | None:
    """Two ``torch._grouped_mm`` (rows ``offs[e-1]:offs[e]`` use expert ``e``), or None if it refuses.

    Under vmap (the in-process mesh) torch has no batching rule for it and loops over the
    devices (its warning is silenced: a handful of devices, each a grouped matmul).
    """
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*batching rule for aten::_grouped_mm")
            h = F.gelu(torch._grouped_mm(rows, w_in.contiguous(), offs=offs))
            return torch._grouped_mm(h, w_out.contiguous(), offs=offs)
    except RuntimeError:  # an operand it cannot take (alignment, layout): the exact fallback
        if strict:
            raise
        return None


_GROUPED_MM = hasattr(torch, "_grouped_mm")
_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _expert_parallel(
    x_TD: Tensor, idx_TK: Tensor, keep_TK: Tensor | None, w_in: Tensor, w_out: Tensor, axis, n: int
) -> Tensor:
    """Fixed-shape dispatch (vmap, the in-process mesh): each pair to its expert's device and back."""
    t, d = x_TD.shape
    k = idx_TK.shape[1]
    e_local = w_in.shape[0]
    cap = t * min(e_local, k)  # static worst case of one (source -> destination) slot
    expert = idx_TK.reshape(-1)
    dest, local = expert // e_local, expert % e_local
    pos = dest * cap + _rank_in_group(dest, n)  # this pair's row in the [n, cap] send buffer
    if keep_TK is not None:
        pos = torch.where(keep_TK.reshape(-1), pos, n * cap)  # a dropped pair: the dump slot
    device = x_TD.device
    token = torch.arange(t * k, device=device) // k
    slot_token = torch.full((n * cap + 1,), t, dtype=torch.long, device=device).scatter(0, pos, token)
    slot_expert = torch.full((n * cap + 1,), -1, dtype=torch.long, device=device).scatter(0, pos, local)
    slot_token, slot_expert = slot_token[: n * cap], slot_expert[: n * cap]
    x_pad = torch.cat([x_TD, x_TD.new_zeros(1, d)])  # row t: the zeros of an empty slot
    send = x_pad[slot_token].view(n, cap, d)
    recv = fpar.all_to_all(send, axis, 0, 0).reshape(n * cap, d)  # rows from every source device
    recv_expert = fpar.all_to_all(slot_expert.view(n, cap), axis, 0, 0).reshape(n * cap)
    rows = torch.arange(n * cap, device=device)
    out = _grouped_ffn(recv, rows, recv_expert.clamp(min=0), recv_expert >= 0, w_in, w_out)
    back = fpar.all_to_all(out.view(n, cap, d), axis, 0, 0).reshape(n * cap, d)
    if keep_TK is not None:
        back = torch.cat([back, back.new_zeros(1, d)])
    return back[pos].view(t, k, d)


def _rank_in_group(group: Tensor, n: int) -> Tensor:
    """For each row, how many earlier rows share its group (``group`` in ``[0, n)``)."""
    onehot = F.one_hot(group, n)
    return ((onehot.cumsum(0) - onehot) * onehot).sum(1)


def _grouped_ffn(
    x: Tensor, src: Tensor, expert: Tensor, valid: Tensor | None, w_in: Tensor, w_out: Tensor
) -> Tensor:
    """``gelu(x[src[r]] @ w_in[expert[r]]) @ w_out[expert[r]]`` for every row ``r`` (0 where not ``valid``).

    Rows are grouped by expert into tiles of ``b`` rows of one expert (each group padded to a
    multiple of ``b``), then every tile is multiplied by its expert's weights in one batched
    matmul.  All shapes depend only on the number of rows and experts, never on the routing.
    """
    r, e, d = src.shape[0], w_in.shape[0], x.shape[1]
    if _grouped_mm_fits(x, w_in, w_out):
        # Rows sorted by expert (invalid ones last, outside every group): torch._grouped_mm computes
        # only the rows inside the groups, so the cost is the valid rows', not the static bound's.
        key = expert if valid is None else torch.where(valid, expert, -1)
        rows = x.index_select(0, src)
        if _top_is_vmap():  # the mesh's level: one grouped matmul over every device's rows
            out = _DevicesFFN.apply(rows, key, w_in, w_out)
        else:
            out = _sorted_ffn(rows, key, e, w_in, w_out)
        if out is not None:
            return out
    b = max(1, math.ceil(r / (_TILES_PER_EXPERT * e)))
    tiles = math.ceil(r / b) + e
    slots = tiles * b
    onehot = F.one_hot(expert, e)
    if valid is not None:
        onehot = onehot * valid.unsqueeze(1)
    padded = (onehot.sum(0) + b - 1) // b * b
    end = padded.cumsum(0)
    pos = (end - padded)[expert] + ((onehot.cumsum(0) - onehot) * onehot).sum(1)
    if valid is not None:
        pos = torch.where(valid, pos, slots)  # the dump slot
    slot_src = torch.full((slots + 1,), x.shape[0], dtype=torch.long, device=x.device).scatter(0, pos, src)
    x_pad = torch.cat([x, x.new_zeros(1, d)])
    tiles_BD = x_pad[slot_src[:slots]].view(tiles, b, d)
    starts = torch.arange(tiles, device=x.device) * b
    tile_expert = (end.unsqueeze(0) <= starts.unsqueeze(1)).sum(1).clamp(max=e - 1)
    h = F.gelu(tiles_BD @ w_in[tile_expert])
    out = (h @ w_out[tile_expert]).reshape(slots, d)
    return torch.cat([out, out.new_zeros(1, d)])[pos]


def moe_block(
    params: dict,
    x: Tensor,
    *,
    axis,
    n_heads: int,
    moe: dict,
    dropout: float = 0.0,
    key: Tensor | None = None,
    batch_axes=None,
) -> tuple[Tensor, Tensor]:
    """A pre-LayerNorm transformer block with a MoE MLP: ``x + attn(ln1(x))``, then ``x + moe(ln2(x))``.

    Attention is Megatron 1D over ``axis`` (as in ``fpar.ops.gpt_block``); the experts are split
    over ``axis`` too on their hidden dim (expert-TP) and over ``moe["axis"]`` by expert.

    Args:
      params: ``{"ln1", "attn", "ln2", "moe"}`` (see ``fpar.ops.gpt_specs(..., moe=True)``).
      x: the residual stream ``[B, T, D]``, replicated over ``axis``.
      axis: the tensor-parallel mesh axis.
      n_heads: total heads.
      moe: keyword arguments of ``fpar.ops.moe`` (``top_k``, ``axis``, ``token_axes``).
      dropout, key, batch_axes: as for ``fpar.ops.gpt_block`` (attention probabilities and the
        two residual branches; the router and the experts see no dropout).

    Returns:
      ``(x, aux_loss)``.
    """
    from ._dropout import check_dropout, site_dropout
    from ._gpt import layer_norm
    from ._megatron import attention

    check.params("moe_block", params, ("ln1", "attn", "ln2", "moe"), (), "gpt", leaves=False)
    check_dropout("moe_block", dropout, key)
    if not dropout:
        x = x + attention(params["attn"], layer_norm(params["ln1"], x), axis=axis, n_heads=n_heads, causal=True)
        y, aux = _moe_layer(params["moe"], layer_norm(params["ln2"], x), tensor_axis=axis, **moe)
        return x + y, aux
    k_attn, k_res1, k_res2 = (fpar.random.fold_in(key, i) for i in range(3))
    a = attention(
        params["attn"], layer_norm(params["ln1"], x), axis=axis, n_heads=n_heads, causal=True,
        dropout=dropout, key=k_attn, batch_axes=batch_axes,
    )
    x = x + site_dropout(k_res1, a, dropout, axis=axis, batch_axes=batch_axes)
    y, aux = _moe_layer(params["moe"], layer_norm(params["ln2"], x), tensor_axis=axis, **moe)
    return x + site_dropout(k_res2, y, dropout, axis=axis, batch_axes=batch_axes), aux


def moe_specs(axis="expert", *, tensor_axis=None) -> dict:
    """Return the ``fpar.P`` of each ``moe`` parameter: experts split over ``axis`` on dim 0.

    ``tensor_axis`` additionally splits each expert's hidden dim (expert-TP); the router is
    replicated.  ``axis=None`` keeps every expert on every device.
    """
    return {
        "router": P(),
        "w_in": _clean(P(axis, None, tensor_axis)),
        "w_out": _clean(P(axis, tensor_axis, None)),
    }


def _clean(spec: P) -> P:
    parts = tuple(spec)
    while parts and parts[-1] is None:
        parts = parts[:-1]
    return P(*parts)


def init_moe(
    d_model: int,
    d_hidden: int,
    n_experts: int,
    *,
    std: float = 0.02,
    out_std: float | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict:
    """Return ``fpar.init`` leaves for ``moe``: normal router and experts (``out_std`` for ``w_out``)."""
    for name, v in (("d_model", d_model), ("d_hidden", d_hidden), ("n_experts", n_experts)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise TypeError(f"fpar.ops.init_moe: {name} must be a positive int, got {v!r}.")
    return {
        "router": fpar.normal((d_model, n_experts), std=std, dtype=dtype),
        "w_in": fpar.normal((n_experts, d_model, d_hidden), std=std, dtype=dtype),
        "w_out": fpar.normal(
            (n_experts, d_hidden, d_model), std=std if out_std is None else out_std, dtype=dtype
        ),
    }
