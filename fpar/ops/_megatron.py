"""Megatron 1D tensor parallelism as per-device functions (Shoeybi et al. 2019, arXiv:1909.08053).

Every function here runs *inside* ``fpar.shard``: it takes this device's blocks and names the
tensor-parallel mesh axis with ``axis=``.  Parameters are plain tensors (``w_in_out`` layout, the
layer computes ``x @ w``); ``fpar.ops.mlp_specs`` and friends give the ``fpar.P`` of each one.

Megatron's two conjugate operators are where the communication is:

* ``f`` (entering a column-parallel layer) is the identity forward and an all-reduce backward.
  In fpar it needs no code: the input is *replicated* over the axis and the weight *varies*, so
  fpar inserts JAX's implicit ``pvary`` where they meet, whose transpose is exactly that
  all-reduce of the input gradient (``comm_stats`` shows it as a backward ``psum``).
* ``g`` (leaving a row-parallel layer) is ``fpar.psum`` forward; its transpose is the identity.

So a transformer layer (attention + MLP) does 2 all-reduces of ``b*s*h`` forward and 2 backward.

Shape suffixes (torchtitan style); inside ``fpar.shard`` they name the per-device block:
    B  batch                         T  sequence (query positions)   S  key positions
    D  model dim (replicated)        F  MLP hidden, F/n per device   H  heads, H/n per device
    K  head dim                      E  H*K of this device's heads (D/n)
    V  vocabulary, V/n per device    n  size of the tensor-parallel axis
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .._collectives import axis_index, pmax, psum
from . import _check as check
from ._dropout import check_dropout, site_dropout

__all__ = [
    "attention",
    "column_linear",
    "mlp",
    "row_linear",
    "vocab_cross_entropy",
    "vocab_embedding",
]

Tensor = torch.Tensor


# Linear layers ----------------------------------------------------------------------------------


def column_linear(x: Tensor, w: Tensor, b: Tensor | None = None, *, axis) -> Tensor:
    """Apply a column-parallel linear layer: ``x[..., D] replicated -> y[..., F/n] varying over axis``.

    ``w`` is split by columns (``P(None, axis)``), so each device computes its slice of the output
    features with no communication.  Megatron's ``f`` operator (identity forward, all-reduce of
    the input gradient backward) is *not* written here: ``x`` is replicated over ``axis`` and ``w``
    varies, so fpar inserts an implicit ``pvary`` where they meet, and its transpose is that
    all-reduce.  A hand-written ``f`` (a custom backward that all-reduces the gradient, as in
    Megatron's ``copy_to_tensor_model_parallel_region``) would sum it a second time.

    Args:
      x: input ``[..., D]``, replicated over ``axis``.
      w: this device's column block ``[D, F/n]`` of the global ``[D, F]`` weight.
      b: optional bias block ``[F/n]`` (spec ``P(axis)``).
      axis: the tensor-parallel mesh axis (or tuple of axes).

    Returns:
      ``x @ w + b``, ``[..., F/n]``, varying over ``axis``.

    Raises:
      TypeError: a non-tensor or non-float argument.
      ValueError: mismatched shapes.
    """
    check.axis_size("column_linear", axis)
    check_linear("column_linear", x, w, b, "P(None, axis)", "P(axis)")
    y = x @ w
    return y if b is None else y + b


def row_linear(x: Tensor, w: Tensor, b: Tensor | None = None, *, axis) -> Tensor:
    """Apply a row-parallel linear layer: ``x[..., F/n] varying -> y[..., D] replicated over axis``.

    ``w`` is split by rows (``P(axis, None)``) to match an input split along its features (the
    output of ``column_linear``); each device's product is a partial sum, completed by one
    ``fpar.psum`` (Megatron's ``g``).  The bias is replicated and added once, after the psum.

    Args:
      x: input block ``[..., F/n]``, varying over ``axis``.
      w: this device's row block ``[F/n, D]`` of the global ``[F, D]`` weight.
      b: optional bias ``[D]``, replicated (spec ``P()``).
      axis: the tensor-parallel mesh axis.

    Returns:
      ``psum(x @ w) + b``, ``[..., D]``, replicated over ``axis``.
    """
    check.axis_size("row_linear", axis)
    check_linear("row_linear", x, w, b, "P(axis, None)", "P()")
    y = psum(x @ w, axis)
    return y if b is None else y + b


def mlp(params: dict, x: Tensor, *, axis) -> Tensor:
    """Apply the Megatron MLP ``gelu(x @ w_in + b_in) @ w_out + b_out``: replicated -> replicated.

    ``column_linear -> gelu -> row_linear``: GeLU is applied to each device's own slice of the
    hidden features, so the layer does one all-reduce forward and one backward.

    Args:
      params: ``{"w_in": [D, F/n], "w_out": [F/n, D]}`` and optionally ``"b_in": [F/n]``,
        ``"b_out": [D]``; specs from ``fpar.ops.mlp_specs(axis)``.
      x: input ``[..., D]``, replicated over ``axis``.
      axis: the tensor-parallel mesh axis.

    Returns:
      ``[..., D]``, replicated over ``axis``.
    """
    check.params("mlp", params, ("w_in", "w_out"), ("b_in", "b_out"), "mlp")
    h = F.gelu(column_linear(x, params["w_in"], params.get("b_in"), axis=axis))
    return row_linear(h, params["w_out"], params.get("b_out"), axis=axis)


# Attention -------------------------------------------------------------------------------------


def attention(
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
    """Apply head-parallel multi-head self-attention: ``x[B, T, D] replicated -> [B, T, D] replicated``.

    The fused ``q, k, v`` projection is column-split by heads (each device holds ``n_heads/n``
    whole heads, so attention itself is local) and the output projection is row-split: one
    all-reduce forward, one backward.

    Args:
      params: ``{"w_qkv": [D, 3, E], "w_o": [E, D]}`` and optionally ``"b_qkv": [3, E]``,
        ``"b_o": [D]``, where ``E = D/n`` are this device's heads' columns; specs from
        ``fpar.ops.attention_specs(axis)``.  Head ``h`` owns columns ``[h*K, (h+1)*K)``.
      x: input ``[B, T, D]``, replicated over ``axis``.
      axis: the tensor-parallel mesh axis.
      n_heads: the total number of heads; must be divisible by the size of ``axis``.
      causal: mask attention to later positions.
      dropout: drop probability of the attention probabilities (``fpar.ops.dropout``: the mask
        is the block of one global ``[B, n_heads, T, T]`` mask, the same at every layout).
      key: the ``fpar.random`` key, needed when ``dropout > 0``.
      batch_axes: the mesh axes the batch dim is split over (``None``: those ``x`` varies over).

    Returns:
      ``[B, T, D]``, replicated over ``axis``.
    """
    check_dropout("attention", dropout, key)
    o_BTE = heads_attention(
        params,
        x,
        axis=axis,
        n_heads=n_heads,
        causal=causal,
        api="attention",
        dropout=dropout,
        key=key,
        batch_axes=batch_axes,
    )
    return row_linear(o_BTE, params["w_o"], params.get("b_o"), axis=axis)


def heads_attention(
    params: dict,
    x_BTD: Tensor,
    *,
    axis,
    n_heads: int,
    causal: bool,
    api: str,
    dropout: float = 0.0,
    key=None,
    batch_axes=None,
    project=None,
) -> Tensor:
    """The column-parallel part of ``attention``: this device's heads' outputs ``[B, T, E]``.

    ``project(x, w)``: the q, k, v projection's product (Megatron-SP's ``sp_gather_matmul``: ``x``
    is then a sequence block); by default ``x @ w``.
    """
    h_local, k = check_attention(api, params, x_BTD, axis=axis, n_heads=n_heads)
    w_qkv, b_qkv = params["w_qkv"], params.get("b_qkv")
    b_flat = None if b_qkv is None else b_qkv.reshape(-1)
    w_flat = w_qkv.reshape(w_qkv.shape[0], -1)
    if project is None:
        qkv = column_linear(x_BTD, w_flat, b_flat, axis=axis)  # B,T,3E
    else:
        qkv = project(x_BTD, w_flat)
        qkv = qkv if b_flat is None else qkv + b_flat
    q_BTHK, k_BTHK, v_BTHK = qkv.unflatten(-1, (3, h_local, k)).unbind(2)

    def drop(p_BHTS: Tensor) -> Tensor:
        return site_dropout(key, p_BHTS, dropout, axis=axis, split_dim=1, batch_axes=batch_axes)

    return attend(q_BTHK, k_BTHK, v_BTHK, causal=causal, drop=drop if dropout else None).flatten(2)


def check_attention(api: str, params: dict, x_BTD: Tensor, *, axis, n_heads: int) -> tuple[int, int]:
    """Validate head-parallel attention's arguments; return (heads per device, head dim)."""
    n = check.axis_size(api, axis)
    check.params(api, params, ("w_qkv", "w_o"), ("b_qkv", "b_o"), "attention")
    check.floating(api, "x", check.tensor(api, "x", x_BTD, ndim=3))
    h_local, k = attention_heads(api, x_BTD.shape[-1], n_heads, n)
    want = (x_BTD.shape[-1], 3, h_local * k)
    if tuple(params["w_qkv"].shape) != want:
        raise ValueError(
            f"fpar.ops.{api}: the w_qkv block has shape {tuple(params['w_qkv'].shape)}, expected {want} "
            f"(D, 3, n_heads/n * head_dim with n_heads={n_heads}, n={n}); give the global "
            f"[D, 3, D] weight the spec P(None, None, axis) (fpar.ops.attention_specs(axis))."
        )
    return h_local, k


def attention_heads(api: str, d_model: int, n_heads: int, n: int) -> tuple[int, int]:
    """Return (heads per device, head dim), checking that the heads split evenly."""
    if isinstance(n_heads, bool) or not isinstance(n_heads, int) or n_heads < 1:
        raise TypeError(f"fpar.ops.{api}: n_heads must be a positive int, got {n_heads!r}.")
    check.divisible(api, "the model dim D", d_model, n_heads, f"Choose n_heads dividing D={d_model}.")
    if n_heads % n:
        raise ValueError(
            f"fpar.ops.{api}: n_heads={n_heads} is not divisible by the axis size {n}: each device "
            f"must hold whole heads. Use a tensor axis whose size divides {n_heads}, or change n_heads."
        )
    return n_heads // n, d_model // n_heads


def attend(q_BTHK: Tensor, k_BSHK: Tensor, v_BSHK: Tensor, *, causal: bool, drop=None) -> Tensor:
    """Scaled dot-product attention over local heads: ``softmax(q k^T / sqrt(K)) v``, ``[B, T, H, K]``.

    ``drop``, if given, is applied to the probabilities ``[B, H, T, S]`` (attention dropout).
    """
    q_BHTK, k_BHSK, v_BHSK = (t.transpose(1, 2) for t in (q_BTHK, k_BSHK, v_BSHK))
    s_BHTS = (q_BHTK * q_BHTK.shape[-1] ** -0.5) @ k_BHSK.transpose(-1, -2)
    if causal:
        t, s = s_BHTS.shape[-2:]
        future_TS = torch.ones(t, s, dtype=torch.bool, device=s_BHTS.device).triu(1)
        s_BHTS = s_BHTS.masked_fill(future_TS, -math.inf)
    p_BHTS = torch.softmax(s_BHTS, dim=-1)
    if drop is not None:
        p_BHTS = drop(p_BHTS)
    return (p_BHTS @ v_BHSK).transpose(1, 2)


# Vocabulary-parallel embedding and cross-entropy -------------------------------------------------


def vocab_embedding(ids: Tensor, w: Tensor, *, axis) -> Tensor:
    """Look up token embeddings in a vocab-split table: ``ids[...] replicated -> x[..., D] replicated``.

    Device ``r`` holds rows ``[r*V/n, (r+1)*V/n)`` of the table (spec ``P(axis, None)``).  Ids it
    does not own are looked up as row 0 and zeroed; one ``fpar.psum`` then assembles every
    token's row (Megatron ``VocabParallelEmbedding``).  The backward needs no communication.

    Args:
      ids: integer token ids ``[...]`` in ``[0, V)``, replicated over ``axis``.
      w: this device's block ``[V/n, D]`` of the ``[V, D]`` table.
      axis: the tensor-parallel mesh axis.

    Returns:
      ``[..., D]``, replicated over ``axis``.
    """
    check.axis_size("vocab_embedding", axis)
    return psum(embedding_partial("vocab_embedding", ids, w, axis), axis)


def embedding_partial(api: str, ids: Tensor, w_VD: Tensor, axis) -> Tensor:
    """This device's share of the embedding: its rows, zeros for ids it does not own."""
    check.integer(api, "ids", ids)
    check.floating(api, "w", check.tensor(api, "w", w_VD, ndim=2))
    local, outside = _local_ids(ids, w_VD.shape[0], axis)
    x = F.embedding(local, w_VD)
    return x.masked_fill(outside.unsqueeze(-1), 0.0)


def vocab_cross_entropy(logits_local: Tensor, targets: Tensor, *, axis) -> Tensor:
    """Per-token cross-entropy of vocab-split logits: ``logits[..., V/n] varying -> loss[...] replicated``.

    The logits are never gathered.  Three all-reduces of one number per token (Megatron
    ``_VocabParallelCrossEntropy``): ``pmax`` of the local max (for stability), ``psum`` of the
    target's logit (only its owner contributes), ``psum`` of the local sums of ``exp``; then
    ``loss = log(sum_exp) - target_logit``.  The gradient is plain autodiff of this formula
    through the collectives: psum transposes to the identity, and the max is a constant (the
    loss does not depend on it), so the backward is local, ``softmax - onehot``.  fp16/bf16
    logits are upcast to float32 (as Megatron does); the loss has the logits' dtype.

    Args:
      logits_local: this device's vocab slice ``[..., V/n]`` (e.g. from ``column_linear``).
      targets: integer targets ``[...]`` in ``[0, V)``, replicated over ``axis``.
      axis: the tensor-parallel mesh axis.

    Returns:
      The loss of each token ``[...]``, replicated over ``axis``.
    """
    api = "vocab_cross_entropy"
    check.axis_size(api, axis)
    check.floating(api, "logits_local", check.tensor(api, "logits_local", logits_local, min_ndim=1))
    check.integer(api, "targets", targets)
    if tuple(targets.shape) != tuple(logits_local.shape[:-1]):
        raise ValueError(
            f"fpar.ops.{api}: targets has shape {tuple(targets.shape)}, expected the logits' leading "
            f"dims {tuple(logits_local.shape[:-1])} (logits_local is {tuple(logits_local.shape)})."
        )
    dtype = logits_local.dtype
    if dtype in (torch.float16, torch.bfloat16):  # fpar's rule: accumulate in float32
        logits_local = logits_local.float()
    # 1. The max over the whole vocabulary; detached: the loss does not depend on it.
    max_ = pmax(logits_local.detach().amax(-1), axis)
    shifted = logits_local - max_.unsqueeze(-1)
    # 2. The target's logit: found on one device, zero on the others.
    local, outside = _local_ids(targets, logits_local.shape[-1], axis)
    picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
    target_logit = psum(picked, axis)
    # 3. The softmax denominator.
    sum_exp = psum(shifted.exp().sum(-1), axis)
    return (sum_exp.log() - target_logit).to(dtype)


def _local_ids(ids: Tensor, v_local: int, axis) -> tuple[Tensor, Tensor]:
    """Ids relative to this device's vocab slice (0 where not owned) and the not-owned mask."""
    local = ids - axis_index(axis) * v_local
    outside = (local < 0) | (local >= v_local)
    return local.masked_fill(outside, 0), outside


# Error checking ---------------------------------------------------------------------------------


def check_linear(api: str, x, w, b, w_spec: str, b_spec: str) -> None:
    check.floating(api, "x", check.tensor(api, "x", x, min_ndim=1))
    check.floating(api, "w", check.tensor(api, "w", w, ndim=2))
    check.same(
        api,
        f"x's last dim must equal w's first dim: x is {tuple(x.shape)}, the w block is {tuple(w.shape)}",
        x.shape[-1],
        w.shape[0],
        f"Give the [in, out] weight the spec {w_spec} (weights are laid out w_in_out: y = x @ w).",
    )
    if b is not None:
        check.tensor(api, "b", b, ndim=1)
        check.same(
            api,
            f"the bias block has {b.shape[0]} entries but the w block has {w.shape[1]} columns",
            b.shape[0],
            w.shape[1],
            f"Give the bias the spec {b_spec}.",
        )
