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

How the routed rows reach their experts and come back (exact counts on plain tensors and
a real mesh, static slots in-process, the grouped matmuls) is in ``_moe_dispatch.py``.

Composition: ``token_axes`` names every mesh axis the tokens are split over (default ``axis``),
so the aux loss is the global one, e.g. tokens over ``("data", "expert")`` with experts over
``"expert"``; ``tensor_axis`` splits every expert's hidden dim ``H`` (expert-TP: ``w_in``
column-split, ``w_out`` row-split, one psum of ``[T_local, D]`` over it).

Shape suffixes, per device inside ``fpar.shard``: ``T`` tokens, ``D`` model dim, ``E`` experts
(``E/n`` local), ``H`` expert hidden dim (``H/t`` under expert-TP), ``K`` = top_k.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .._collectives import all_gather_invariant, axis_index, axis_size, psum
from .._global import normal
from .._spec import P
from . import _check as check
from ._moe_dispatch import (
    _axes,
    _dynamic_shapes_ok,
    _expert_parallel,
    _expert_parallel_exact,
    _grouped_ffn,
    _local_exact,
    _real_frame,
)

__all__ = ["init_moe", "moe", "moe_specs"]

Tensor = torch.Tensor


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
        y_TD = psum(y_TD, tensor_axis)
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
        sums_2E = psum(sums_2E, token_axes)  # one all-reduce of 2E numbers
        total = t * axis_size(token_axes)
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
        every_NE = all_gather_invariant(counts_E, token_axes)  # [devices along token_axes, E]
        m = every_NE.shape[0]
        before_N = torch.arange(m, device=expert.device) < axis_index(token_axes)
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
        "router": normal((d_model, n_experts), std=std, dtype=dtype),
        "w_in": normal((n_experts, d_model, d_hidden), std=std, dtype=dtype),
        "w_out": normal((n_experts, d_hidden, d_model), std=std if out_std is None else out_std, dtype=dtype),
    }
