"""Sequence parallelism: Megatron-SP, DeepSpeed-Ulysses and ring attention, as per-device functions.

All three keep activations split along the sequence over a mesh axis, ``x[B, T/n, D]`` (spec
``P(None, axis)``), and differ in how attention sees the whole sequence:

* **Megatron sequence parallelism** (Korthikanti et al. 2022, arXiv:2205.05198).  LayerNorm,
  dropout and residuals run on sequence shards; entering a tensor-parallel region the shards are
  all-gathered along the sequence, and leaving it the partial sums are reduce-scattered along the
  sequence instead of all-reduced.  All-reduce = reduce-scatter + all-gather, so the traffic is
  that of Megatron 1D, with ``1/n`` of the activation memory outside the matmuls.  As in
  Megatron-LM, a column-parallel matmul keeps its input's sequence block, not the gathered
  sequence, and its backward gathers the block again (``sp_gather_matmul``): one all-gather more
  per region for the paper's ``34 s b h / t`` bytes a layer.  Replicated
  parameters used on sequence shards (LayerNorm, the row-parallel bias) get their gradients
  all-reduced over the axis, as in Megatron (fpar's implicit pvary does it).
* **Ulysses** (Jacobs et al. 2023, arXiv:2309.14509).  Weights replicated; one all-to-all turns
  ``q, k, v`` from ``[T/n, all heads]`` into ``[T, H/n heads]``, attention is local per head, and
  one all-to-all turns the output back.
* **Ring attention** (Liu, Zaharia, Abbeel 2023, arXiv:2310.01889).  Key/value blocks travel
  around a ring (``fpar.ppermute``) while each device accumulates its queries' attention with an
  online softmax; no device ever holds the whole sequence.

Shape suffixes (torchtitan style); inside ``fpar.shard`` they name the per-device block:
    B  batch              T  this device's sequence block (T/n of the sequence), or all of it
    S  key positions      D  model dim            F  MLP hidden (F/n per device)
    H  heads              K  head dim             E  this device's heads' columns
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .._collectives import all_gather, all_to_all, axis_index, axis_size, ppermute, psum_scatter
from . import _check as check
from ._dropout import batch_axes_of, block_keep, check_dropout, site_dropout
from ._megatron import (
    attend,
    attention_heads,
    check_attention,
    check_linear,
    embedding_partial,
    heads_attention,
)

__all__ = [
    "ring_attention",
    "ring_self_attention",
    "sp_attention",
    "sp_column_linear",
    "sp_gather_matmul",
    "sp_mlp",
    "sp_row_linear",
    "sp_vocab_embedding",
    "ulysses_attention",
]

Tensor = torch.Tensor


# Megatron sequence parallelism ------------------------------------------------------------------


def sp_column_linear(x: Tensor, w: Tensor, b: Tensor | None = None, *, axis, seq_dim: int = 1) -> Tensor:
    """All-gather the sequence, then column-parallel linear: ``x[B, T/n, D] -> y[B, T, F/n]``.

    Megatron-SP's ``g`` (all-gather forward, reduce-scatter backward) followed by
    ``column_linear``.  Both are transposes fpar derives: no hand-written backward.

    Args:
      x: this device's sequence block, split over ``axis`` along ``seq_dim``.
      w: column block ``[D, F/n]`` (spec ``P(None, axis)``).
      b: optional bias block ``[F/n]`` (spec ``P(axis)``).
      axis: the tensor-parallel mesh axis (the sequence is split over the same axis).
      seq_dim: the sequence dim of ``x``.

    Returns:
      ``[..., T, ..., F/n]`` with the whole sequence, varying over ``axis``.
    """
    check.axis_size("sp_column_linear", axis)
    _check_seq("sp_column_linear", x, seq_dim)
    check_linear("sp_column_linear", x, w, b, "P(None, axis)", "P(axis)")  # before any communication
    y = sp_gather_matmul(x, w, axis=axis, seq_dim=seq_dim)
    return y if b is None else y + b


def sp_gather_matmul(x: Tensor, w, *, axis, seq_dim: int = 1):
    """All-gather the sequence and multiply: ``all_gather(x) @ w``, keeping only ``x`` for the backward.

    Megatron-SP's entry into a column-parallel region.  The weights' gradients need the
    whole-sequence input; as in Megatron-LM, the backward all-gathers this device's sequence
    block again instead of the forward keeping the gathered one, so a layer keeps ``1/n`` of
    each such input (Korthikanti et al.'s ``34 s b h / t`` per layer) for one more all-gather per
    region in the backward.  The product's value and gradients are those of the plain
    ``all_gather(x, axis, axis=seq_dim, tiled=True) @ w``.

    Args:
      x: this device's sequence block, split over ``axis`` along ``seq_dim``.
      w: a weight ``[D, F]`` (usually a column block), or a tuple or list of them: one gather
        for all (``q``, ``k`` and ``v``; SwiGLU's two input projections).
      axis: the mesh axis the sequence is split over.
      seq_dim: the sequence dim of ``x``.

    Returns:
      ``[..., T, ..., F]`` (the whole sequence), or a tuple of them for a tuple or list ``w``.

    Under ``torch.compile`` of a whole sharded call (where ``fpar.optim.remat`` cannot run) the
    gathered input is kept, as a plain ``all_gather`` then matmul would.
    """
    ws = tuple(w) if isinstance(w, (tuple, list)) else (w,)
    from ..optim._remat import RECOMPUTING, save_dots, skip_outputs  # fpar.optim imports fpar.ops' users

    # Nothing to keep for a backward: no gradient (an outer remat's forward, evaluation), or an
    # outer remat's recompute (its body must run the ops its forward ran); nor under compile.
    if not torch.is_grad_enabled() or RECOMPUTING[0] or torch.compiler.is_compiling():
        out = _gathered_products(x, *ws, axis=axis, seq_dim=seq_dim)
    else:
        out = skip_outputs(_gathered_products, save_dots)(x, *ws, axis=axis, seq_dim=seq_dim)
    return tuple(out) if isinstance(w, (tuple, list)) else out[0]


def _gathered_products(x: Tensor, *ws: Tensor, axis, seq_dim: int) -> tuple[Tensor, ...]:
    """``all_gather(x) @ w`` for each ``w``.

    Under ``skip_outputs`` the forward keeps ``x`` and the weights, and the backward runs the
    all-gather again, not the matmuls (whose gradients need only their inputs).
    """
    full = all_gather(x, axis, axis=seq_dim, tiled=True)
    return tuple(full @ w for w in ws)


def sp_row_linear(x: Tensor, w: Tensor, b: Tensor | None = None, *, axis, seq_dim: int = 1) -> Tensor:
    """Row-parallel linear, then reduce-scatter along the sequence: ``x[B, T, F/n] -> y[B, T/n, D]``.

    Megatron-SP's ``g-bar`` (reduce-scatter forward, all-gather backward) in place of the
    all-reduce of ``row_linear``.  The replicated bias is added to each sequence shard.

    Args:
      x: input block ``[..., T, ..., F/n]`` with the whole sequence, varying over ``axis``.
      w: row block ``[F/n, D]`` (spec ``P(axis, None)``).
      b: optional bias ``[D]`` (spec ``P()``).
      axis: the tensor-parallel mesh axis.
      seq_dim: the sequence dim of ``x``; its size must be divisible by the axis size.

    Returns:
      This device's sequence block ``[..., T/n, ..., D]``.
    """
    n = check.axis_size("sp_row_linear", axis)
    _check_seq("sp_row_linear", x, seq_dim)
    check.divisible("sp_row_linear", "the sequence length", x.shape[seq_dim], n, "Pad the sequence.")
    check_linear("sp_row_linear", x, w, b, "P(axis, None)", "P()")
    y = psum_scatter(x @ w, axis, scatter_dimension=seq_dim, tiled=True)
    return y if b is None else y + b


def sp_mlp(params: dict, x: Tensor, *, axis) -> Tensor:
    """Apply the Megatron MLP on sequence shards: ``x[B, T/n, D] -> [B, T/n, D]``, both split over axis.

    ``all_gather(seq) -> column_linear -> gelu -> row_linear -> psum_scatter(seq)``; the
    parameters and their specs are those of ``fpar.ops.mlp`` (``mlp_specs(axis)``).

    Args:
      params: as for ``fpar.ops.mlp``.
      x: this device's sequence block ``[B, T/n, D]``.
      axis: the tensor-parallel mesh axis.
    """
    check.params("sp_mlp", params, ("w_in", "w_out"), ("b_in", "b_out"), "mlp")
    h = F.gelu(sp_column_linear(x, params["w_in"], params.get("b_in"), axis=axis))
    return sp_row_linear(h, params["w_out"], params.get("b_out"), axis=axis)


def sp_attention(
    params: dict,
    x: Tensor,
    *,
    axis,
    n_heads: int,
    causal: bool = True,
    dropout: float = 0.0,
    key=None,
    batch_axes=None,
) -> Tensor:
    """Head-parallel self-attention on sequence shards: ``x[B, T/n, D] -> [B, T/n, D]``.

    The sequence is all-gathered entering the column-parallel ``q, k, v`` projection and the
    output projection's partial sums are reduce-scattered back to sequence shards.  Parameters
    and specs are those of ``fpar.ops.attention``.

    Args:
      params: as for ``fpar.ops.attention``.
      x: this device's sequence block ``[B, T/n, D]``.
      axis: the tensor-parallel mesh axis.
      n_heads: total heads, divisible by the size of ``axis``.
      causal: mask attention to later positions (by global position).
      dropout: the attention-probability dropout rate, as for ``fpar.ops.attention``.
      key: the dropout key, as for ``fpar.ops.attention``.
      batch_axes: as for ``fpar.ops.attention``.
    """
    check_attention("sp_attention", params, x, axis=axis, n_heads=n_heads)  # before any communication
    check_dropout("sp_attention", dropout, key)
    o_BTE = heads_attention(
        params,
        x,
        axis=axis,
        n_heads=n_heads,
        causal=causal,
        api="sp_attention",
        dropout=dropout,
        key=key,
        batch_axes=batch_axes,
        project=lambda x, w: sp_gather_matmul(x, w, axis=axis, seq_dim=1),
    )
    return sp_row_linear(o_BTE, params["w_o"], params.get("b_o"), axis=axis)


def sp_vocab_embedding(ids: Tensor, w: Tensor, *, axis, seq_dim: int = 1) -> Tensor:
    """Vocab-parallel embedding, reduce-scattered along the sequence: ``ids[B, T] -> x[B, T/n, D]``.

    As ``fpar.ops.vocab_embedding`` but the partial lookups are summed with ``psum_scatter``
    along the sequence, so each device keeps its own sequence block (Megatron's
    ``reduce_scatter_embeddings``).

    Args:
      ids: integer ids ``[B, T]``, replicated over ``axis``.
      w: this device's block ``[V/n, D]`` (spec ``P(axis, None)``).
      axis: the tensor-parallel mesh axis.
      seq_dim: the sequence dim of ``ids``.
    """
    n = check.axis_size("sp_vocab_embedding", axis)
    _check_seq("sp_vocab_embedding", ids, seq_dim)
    check.divisible("sp_vocab_embedding", "the sequence length", ids.shape[seq_dim], n, "Pad the sequence.")
    x = embedding_partial("sp_vocab_embedding", ids, w, axis)
    return psum_scatter(x, axis, scatter_dimension=seq_dim, tiled=True)


# DeepSpeed-Ulysses ------------------------------------------------------------------------------


def ulysses_attention(
    params: dict,
    x: Tensor,
    *,
    axis,
    n_heads: int,
    causal: bool = True,
    dropout: float = 0.0,
    key: Tensor | None = None,
    batch_axes=None,
) -> Tensor:
    """Self-attention with Ulysses all-to-alls: ``x[B, T/n, D] -> [B, T/n, D]``, split over axis.

    Weights are replicated (``fpar.ops.attention_specs(None)``); their gradients are summed over
    ``axis`` like data-parallel ones.  ``q, k, v [B, T/n, 3, H, K]`` go through one all-to-all to
    ``[B, T, 3, H/n, K]`` (every position, ``H/n`` heads), attention is local, and one all-to-all
    brings ``[B, T, H/n, K]`` back to ``[B, T/n, H, K]``: per device ``4 (n-1)/n`` of this
    device's ``[T/n, D]`` activations each way (forward), constant if ``T`` and ``n`` grow together.

    Args:
      params: ``{"w_qkv": [D, 3, D], "w_o": [D, D]}``, optionally ``"b_qkv": [3, D]``, ``"b_o": [D]``,
        all replicated.
      x: this device's sequence block ``[B, T/n, D]``.
      axis: the sequence-parallel mesh axis.
      n_heads: total heads, divisible by the size of ``axis`` (Ulysses' degree limit).
      causal: mask attention to later positions.
      dropout: drop probability of the attention probabilities.  After the first all-to-all each
        device holds ``n_heads/n`` whole heads over every position, so its mask is the heads
        block of one global ``[B, n_heads, T, T]`` mask: the mask ``fpar.ops.attention`` draws
        with the same key, at every layout.
      key: the ``fpar.random`` key, needed when ``dropout > 0``.
      batch_axes: the mesh axes the batch dim is split over (``None``: those ``x`` varies over,
        other than ``axis``).
    """
    api = "ulysses_attention"
    check_dropout(api, dropout, key)
    n = check.axis_size(api, axis)
    p = _replicated_attention_params(api, params, x)
    _, k = attention_heads(api, x.shape[-1], n_heads, n)  # each device gets n_heads/n whole heads
    qkv_BT3HK = _qkv(p, x).unflatten(-1, (3, n_heads, k))
    # seq -> heads: split the heads dim, concatenate the sequence blocks in device order.
    qkv_BT3HK = all_to_all(qkv_BT3HK, axis, split_axis=3, concat_axis=1, tiled=True)

    def drop(p_BHTS: Tensor) -> Tensor:
        return site_dropout(key, p_BHTS, dropout, axis=axis, split_dim=1, batch_axes=batch_axes)

    o_BTHK = attend(*qkv_BT3HK.unbind(2), causal=causal, drop=drop if dropout else None)
    # heads -> seq: split the sequence, concatenate the heads in device order.
    o_BTHK = all_to_all(o_BTHK, axis, split_axis=1, concat_axis=2, tiled=True)
    return _out_proj(p, o_BTHK.flatten(2))


# Ring attention -----------------------------------------------------------------------------------


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    axis,
    causal: bool = True,
    dropout: float = 0.0,
    key: Tensor | None = None,
    batch_axes=None,
) -> Tensor:
    """Blockwise attention with key/value blocks rotating around a ring: ``q, k, v[B, T/n, H, K] -> [B, T/n, H, K]``.

    Each device keeps its query block and, for ``n`` steps, attends to the key/value block it
    holds, then passes that block to the next device with ``fpar.ppermute`` (after step ``s``
    device ``i`` holds the block of device ``i - s``).  An online softmax (running max ``m`` and
    sum ``l``; earlier partial results rescaled by ``exp(m_old - m_new)``) makes the result
    exact.  With ``causal``, positions are global (``axis_index * T/n + t``).  The gradient is
    autodiff through the ppermutes (their transpose is the reverse rotation); the running max
    is a constant for autodiff, as the result does not depend on it.  Per device the forward
    sends ``n - 1`` key and value blocks, the backward ``n - 1`` of each again.  Masked blocks
    are computed and discarded (no causal load balancing).  fp16/bf16 blocks travel in their
    dtype; the softmax statistics and the output accumulate in float32, rounded once at the end.

    Args:
      q: this device's query block ``[B, T/n, H, K]``.
      k: this device's key block ``[B, T/n, H, K]``.
      v: this device's value block ``[B, T/n, H, K]``.
      axis: the mesh axis the sequence is split over (blocks in axis order).
      causal: mask keys at later global positions.
      dropout: drop probability of the attention probabilities: the mask is one global
        ``[B, H, T, T]`` mask (the one ``fpar.ops.dropout`` draws on the probabilities of the
        unsharded attention with this key); each ring step draws the block of the key block it
        holds, and the dropped probabilities stay in the softmax's denominator.
      key: the ``fpar.random`` key, needed when ``dropout > 0``.
      batch_axes: the mesh axes the batch dim is split over (``None``: those ``q`` varies over,
        other than ``axis``).

    Returns:
      This device's block of the attention output ``[B, T/n, H, K]``.
    """
    api = "ring_attention"
    check_dropout(api, dropout, key)
    n = check.axis_size(api, axis)
    for name, t in (("q", q), ("k", k), ("v", v)):
        check.floating(api, name, check.tensor(api, name, t, ndim=4))
    if not (q.shape == k.shape == v.shape):
        raise ValueError(
            f"fpar.ops.{api}: q, k and v blocks must have the same shape [B, T/n, H, K], got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}."
        )
    t = q.shape[1]
    ring = [(i, (i + 1) % n) for i in range(n)]
    q_BHTK = q.transpose(1, 2) * q.shape[-1] ** -0.5
    k_BHSK, v_BHSK = k.transpose(1, 2), v.transpose(1, 2)
    me = axis_index(axis)
    q_pos_T = me * t + torch.arange(t, device=q.device)
    # fp16/bf16: the softmax statistics and the output accumulate in float32 (fpar's rule);
    # the blocks travel in the input dtype.
    acc = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    m_BHT = torch.full(q_BHTK.shape[:-1], -math.inf, dtype=acc, device=q.device)
    l_BHT = torch.zeros(q_BHTK.shape[:-1], dtype=acc, device=q.device)
    acc_BHTK = torch.zeros(q_BHTK.shape, dtype=acc, device=q.device)
    drop = _ring_dropout(q_BHTK, dropout, key, axis, n, batch_axes) if dropout else None
    for step in range(n):
        s_BHTS = (q_BHTK @ k_BHSK.transpose(-1, -2)).to(acc)
        if causal:
            k_pos_S = ((me - step) % n) * t + torch.arange(t, device=q.device)
            s_BHTS = s_BHTS.masked_fill(q_pos_T.unsqueeze(-1) < k_pos_S, -math.inf)
        # Step 0 is this device's own block, which holds each query's own position: m is finite
        # from then on, so exp(-inf - m) = 0 for masked keys and no NaN appears.
        m_new = torch.maximum(m_BHT, s_BHTS.detach().amax(-1))
        scale_BHT = torch.exp(m_BHT - m_new)
        p_BHTS = torch.exp(s_BHTS - m_new.unsqueeze(-1))
        l_BHT = l_BHT * scale_BHT + p_BHTS.sum(-1)
        if drop is not None:
            p_BHTS = p_BHTS * drop((me - step) % n)
        acc_BHTK = acc_BHTK * scale_BHT.unsqueeze(-1) + p_BHTS @ v_BHSK.to(acc)
        m_BHT = m_new
        if step < n - 1:
            k_BHSK, v_BHSK = ppermute((k_BHSK, v_BHSK), axis, ring)
    return (acc_BHTK / l_BHT.unsqueeze(-1)).transpose(1, 2).to(q.dtype)


def _ring_dropout(q_BHTK: Tensor, rate: float, key: Tensor, axis, n: int, batch_axes):
    """``drop(j)``: the scaled keep-mask of this query block against key block ``j``.

    The blocks of one global ``[B, H, T, T]`` mask: rows ``me*t ..`` (this device's queries),
    columns ``j*t ..``, batch rows by the batch axes' combined index.
    """
    b, h, t, _ = q_BHTK.shape
    batch = batch_axes_of(q_BHTK, axis, batch_axes)
    n_batch = math.prod([axis_size(a) for a in batch])
    b0 = axis_index(batch) * b if batch else 0
    me = axis_index(axis)
    shape, local = [b * n_batch, h, n * t, n * t], [b, h, t, t]
    scale = 1.0 / (1.0 - float(rate))
    dtype = torch.float32 if q_BHTK.dtype in (torch.float16, torch.bfloat16) else q_BHTK.dtype

    def drop(j):
        keep = block_keep(key, rate, shape, [b0, 0, me * t, j * t], local, q_BHTK.device)
        return keep.to(dtype) * scale

    return drop


def ring_self_attention(
    params: dict,
    x: Tensor,
    *,
    axis,
    n_heads: int,
    causal: bool = True,
    dropout: float = 0.0,
    key: Tensor | None = None,
    batch_axes=None,
) -> Tensor:
    """Self-attention over a sequence split along ``axis``, by ``ring_attention``: ``[B, T/n, D] -> [B, T/n, D]``.

    Projections are local with replicated weights (``fpar.ops.attention_specs(None)``; their
    gradients are summed over ``axis``); only keys and values travel.

    Args:
      params: as for ``ulysses_attention``.
      x: this device's sequence block ``[B, T/n, D]``.
      axis: the mesh axis the sequence is split over.
      n_heads: number of heads (any divisor of D; no constraint from the axis size).
      causal: mask attention to later global positions.
      dropout: the attention-probability dropout rate, as for ``ring_attention``.
      key: the dropout key, as for ``ring_attention``.
      batch_axes: as for ``ring_attention``.
    """
    api = "ring_self_attention"
    check_dropout(api, dropout, key)
    check.axis_size(api, axis)
    p = _replicated_attention_params(api, params, x)
    _, k = attention_heads(api, x.shape[-1], n_heads, 1)
    q, k_, v = _qkv(p, x).unflatten(-1, (3, n_heads, k)).unbind(2)
    o = ring_attention(q, k_, v, axis=axis, causal=causal, dropout=dropout, key=key, batch_axes=batch_axes)
    return _out_proj(p, o.flatten(2))


# Helpers and checks -------------------------------------------------------------------------------


def _replicated_attention_params(api: str, params: dict, x: Tensor) -> dict:
    check.params(api, params, ("w_qkv", "w_o"), ("b_qkv", "b_o"), "attention")
    check.floating(api, "x", check.tensor(api, "x", x, ndim=3))
    d = x.shape[-1]
    if tuple(params["w_qkv"].shape) != (d, 3, d) or tuple(params["w_o"].shape) != (d, d):
        raise ValueError(
            f"fpar.ops.{api}: expected the whole w_qkv [{d}, 3, {d}] and w_o [{d}, {d}] on every "
            f"device, got blocks {tuple(params['w_qkv'].shape)} and {tuple(params['w_o'].shape)}; "
            f"sequence-parallel attention replicates its weights: use fpar.ops.attention_specs(None)."
        )
    return params


def _qkv(p: dict, x_BTD: Tensor) -> Tensor:
    d = x_BTD.shape[-1]
    qkv = x_BTD @ p["w_qkv"].reshape(d, 3 * d)
    return qkv if p.get("b_qkv") is None else qkv + p["b_qkv"].reshape(3 * d)


def _out_proj(p: dict, o_BTD: Tensor) -> Tensor:
    y = o_BTD @ p["w_o"]
    return y if p.get("b_o") is None else y + p["b_o"]


def _check_seq(api: str, x, seq_dim: int) -> None:
    check.tensor(api, "x" if api != "sp_vocab_embedding" else "ids", x, min_ndim=1)
    if isinstance(seq_dim, bool) or not isinstance(seq_dim, int) or not -x.dim() <= seq_dim < x.dim():
        raise ValueError(
            f"fpar.ops.{api}: seq_dim={seq_dim!r} is out of range for a value of rank {x.dim()}."
        )
