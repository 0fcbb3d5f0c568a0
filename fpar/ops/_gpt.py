"""A GPT (pre-LayerNorm transformer) from the parallel layers, with its parameter specs and initialisers.

The model is GPT-2's (Radford et al. 2019): token + learned position embeddings, ``n_layers``
blocks ``x + attn(ln1(x))``, ``x + mlp(ln2(x))``, a final LayerNorm and a vocabulary head tied to
the embedding (or untied).  Under Megatron 1D every weight matrix is split over the tensor axis
and activations are replicated; with ``sequence_parallel=True`` (Megatron-SP) activations between
the parallel regions are split along the sequence.  The embedding, head and loss are
vocab-parallel, so the ``[B, T, V]`` logits never exist on one device.

Per-device traffic of one forward + backward (``S`` = bytes of ``[B, T, D]``, ``n`` = axis size,
an all-reduce moving ``2 (n-1)/n`` of its size): 1D does ``2 L + 1`` all-reduces of ``S`` forward
(2 per block, 1 for the embedding) plus 3 of ``[B, T]`` (the loss), and ``2 L + 1`` of ``S``
backward (2 per block, 1 into the head's input); SP replaces each all-reduce by an all-gather and
a reduce-scatter of the same total.

``*_specs`` return the ``fpar.P`` of every parameter (same tree as the parameters) and
``init_*`` return trees of ``fpar.normal``/``fpar.zeros`` for ``fpar.init``, whose values do not
depend on the layout: ``fpar.init(init_gpt(...), mesh, gpt_specs(L, axis), seed=0)``.

Shape suffixes (torchtitan style); inside ``fpar.shard`` they name the per-device block:
    B  batch     T  sequence (T/n per device under SP)   D  model dim   V  vocabulary (V/n)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .._collectives import axis_index
from .._global import normal, ones, zeros
from .._spec import P
from ..random import fold_in
from . import _check as check
from ._dropout import check_dropout, site_dropout
from ._megatron import attention, column_linear, mlp, vocab_cross_entropy, vocab_embedding
from ._moe import check_moe_args, init_moe, moe_specs
from ._moe import moe as _moe_layer  # moe_block's keyword ``moe`` shadows the function
from ._sequence import sp_attention, sp_column_linear, sp_mlp, sp_vocab_embedding

__all__ = [
    "attention_specs",
    "gpt",
    "gpt_block",
    "gpt_block_specs",
    "gpt_loss",
    "gpt_specs",
    "init_attention",
    "init_gpt",
    "init_gpt_block",
    "init_layer_norm",
    "init_mlp",
    "layer_norm",
    "layer_norm_specs",
    "mlp_specs",
    "moe_block",
    "sp_gpt_block",
]

Tensor = torch.Tensor
LN_EPS = 1e-5


# Layers ---------------------------------------------------------------------------------------------


def layer_norm(params: dict, x: Tensor) -> Tensor:
    """LayerNorm over the last dim with ``params = {"w": [D], "b": [D]}`` (replicated), eps 1e-5."""
    check.params("layer_norm", params, ("w", "b"), (), "layer_norm")
    return F.layer_norm(x, x.shape[-1:], params["w"], params["b"], eps=LN_EPS)


def gpt_block(
    params: dict,
    x: Tensor,
    *,
    axis,
    n_heads: int,
    sequence_parallel: bool = False,
    dropout: float = 0.0,
    key: Tensor | None = None,
    batch_axes=None,
) -> Tensor:
    """Apply one pre-LayerNorm transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``.

    ``x[B, T, D] replicated -> [B, T, D] replicated`` (Megatron 1D: 2 all-reduces forward, 2
    backward), or with ``sequence_parallel=True`` ``x[B, T/n, D] -> [B, T/n, D]`` split over
    ``axis`` along the sequence (LayerNorms and residuals on shards; 2 all-gathers and 2
    reduce-scatters each way).  Attention is causal.

    Args:
      params: ``{"ln1", "attn", "ln2", "mlp"}`` (see ``fpar.ops.gpt_block_specs``).
      x: the residual stream.
      axis: the tensor-parallel mesh axis.
      n_heads: total heads, divisible by the size of ``axis``.
      sequence_parallel: use the Megatron-SP layers.
      dropout: GPT-2's dropout probability, applied to the attention probabilities and to the
        attention and MLP outputs before each residual add (``fpar.ops.dropout``: the masks do
        not depend on the layout).  ``0.0`` (default) leaves the block deterministic.
      key: the ``fpar.random`` key of this block and step (its three sites use ``fold_in(key,
        0 / 1 / 2)``); needed when ``dropout > 0``.
      batch_axes: the mesh axes the batch dim is split over (``None``: those ``x`` varies over,
        other than ``axis``, in mesh order).
    """
    check.params("gpt_block", params, ("ln1", "attn", "ln2", "mlp"), (), "gpt_block", leaves=False)
    check_dropout("gpt_block", dropout, key)
    attn_fn, mlp_fn = (sp_attention, sp_mlp) if sequence_parallel else (attention, mlp)
    if not dropout:
        x = x + attn_fn(params["attn"], layer_norm(params["ln1"], x), axis=axis, n_heads=n_heads, causal=True)
        return x + mlp_fn(params["mlp"], layer_norm(params["ln2"], x), axis=axis)
    k_attn, k_res1, k_res2 = (fold_in(key, i) for i in range(3))
    seq = 1 if sequence_parallel else None
    drop = dict(axis=axis, split_dim=seq, batch_axes=batch_axes)
    a = attn_fn(
        params["attn"],
        layer_norm(params["ln1"], x),
        axis=axis,
        n_heads=n_heads,
        causal=True,
        dropout=dropout,
        key=k_attn,
        batch_axes=batch_axes,
    )
    x = x + site_dropout(k_res1, a, dropout, **drop)
    return x + site_dropout(
        k_res2, mlp_fn(params["mlp"], layer_norm(params["ln2"], x), axis=axis), dropout, **drop
    )


def sp_gpt_block(
    params: dict,
    x: Tensor,
    *,
    axis,
    n_heads: int,
    dropout: float = 0.0,
    key: Tensor | None = None,
    batch_axes=None,
) -> Tensor:
    """``gpt_block(..., sequence_parallel=True)``: ``x[B, T/n, D] -> [B, T/n, D]``, split along the sequence."""
    return gpt_block(
        params,
        x,
        axis=axis,
        n_heads=n_heads,
        sequence_parallel=True,
        dropout=dropout,
        key=key,
        batch_axes=batch_axes,
    )


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
      dropout: as for ``fpar.ops.gpt_block`` (attention probabilities and the two residual
        branches; the router and the experts see no dropout).
      key: as for ``fpar.ops.gpt_block``.
      batch_axes: as for ``fpar.ops.gpt_block``.

    Returns:
      ``(x, aux_loss)``.
    """
    check.params("moe_block", params, ("ln1", "attn", "ln2", "moe"), (), "gpt", leaves=False)
    check_dropout("moe_block", dropout, key)
    if not dropout:
        x = x + attention(
            params["attn"], layer_norm(params["ln1"], x), axis=axis, n_heads=n_heads, causal=True
        )
        y, aux = _moe_layer(params["moe"], layer_norm(params["ln2"], x), tensor_axis=axis, **moe)
        return x + y, aux
    k_attn, k_res1, k_res2 = (fold_in(key, i) for i in range(3))
    a = attention(
        params["attn"],
        layer_norm(params["ln1"], x),
        axis=axis,
        n_heads=n_heads,
        causal=True,
        dropout=dropout,
        key=k_attn,
        batch_axes=batch_axes,
    )
    x = x + site_dropout(k_res1, a, dropout, axis=axis, batch_axes=batch_axes)
    y, aux = _moe_layer(params["moe"], layer_norm(params["ln2"], x), tensor_axis=axis, **moe)
    return x + site_dropout(k_res2, y, dropout, axis=axis, batch_axes=batch_axes), aux


def gpt(
    params: dict,
    ids: Tensor,
    *,
    axis,
    n_heads: int,
    sequence_parallel: bool = False,
    dropout: float = 0.0,
    key: Tensor | None = None,
    batch_axes=None,
    moe: dict | None = None,
):
    """Compute a GPT's vocab-split logits: ``ids[B, T] replicated -> logits[B, T, V/n] varying over axis``.

    Vocab-parallel embedding plus learned positions, the blocks, a final LayerNorm and the
    vocab-parallel head (``column_linear`` by ``w_emb^T`` if tied, else by ``w_head``).  Feed
    the result to ``fpar.ops.vocab_cross_entropy`` (or use ``gpt_loss``).

    Args:
      params: see ``fpar.ops.gpt_specs``; ``"w_head"`` present means an untied head.
      ids: integer token ids ``[B, T]``, replicated over ``axis``; ``T <= max_seq_len``.
      axis: the tensor-parallel mesh axis.
      n_heads: total heads, divisible by the size of ``axis``.
      sequence_parallel: Megatron-SP between the parallel regions (``T`` divisible by the size
        of ``axis``); the values are the same.
      dropout: GPT-2's dropout probability (embedding, attention probabilities, residuals);
        ``0.0`` (default) gives the deterministic model.
      key: the ``fpar.random`` key of this step (the embedding uses ``fold_in(key, 0)``, block
        ``i`` ``fold_in(key, i + 1)``); needed when ``dropout > 0``.  Pass it into
        ``fpar.shard`` with in_spec ``P()``.
      batch_axes: the mesh axes the batch dim is split over (``None``: inferred, see
        ``gpt_block``).
      moe: for a MoE GPT (``init_gpt(..., n_experts=E)``), the keyword arguments of
        ``fpar.ops.moe`` (``top_k``, ``axis``, ``token_axes``, ``capacity_factor``); its blocks with a ``"moe"`` MLP
        run ``fpar.ops.moe_block`` (expert-TP over ``axis``), and the result is ``(logits,
        aux_loss)``, ``aux_loss`` the sum over the MoE blocks.

    Returns:
      This device's vocabulary slice of the logits, ``[B, T, V/n]`` (with ``moe``: and the aux loss).
    """
    api = "gpt"
    n = check.axis_size(api, axis)
    check.params(api, params, ("w_emb", "w_pos", "blocks", "ln_f"), ("w_head",), "gpt", leaves=False)
    check.integer(api, "ids", check.tensor(api, "ids", ids, ndim=2))
    check_dropout(api, dropout, key)
    t, w_pos = ids.shape[1], params["w_pos"]
    if t > w_pos.shape[0]:
        raise ValueError(
            f"fpar.ops.{api}: ids has {t} positions but w_pos only {w_pos.shape[0]}; use sequences of "
            f"at most max_seq_len={w_pos.shape[0]} or build the model with a larger max_seq_len."
        )
    _check_moe(api, params, moe, sequence_parallel, axis)
    if sequence_parallel:
        check.divisible(api, "the sequence length", t, n, "Sequence parallelism splits it over the axis.")
        x = sp_vocab_embedding(ids, params["w_emb"], axis=axis)
        # This device's positions; the gradient of the shared table is summed over the axis.
        x = x + w_pos[:t].unflatten(0, (n, t // n))[axis_index(axis)]
    else:
        x = vocab_embedding(ids, params["w_emb"], axis=axis) + w_pos[:t]
    if dropout:
        x = site_dropout(
            fold_in(key, 0),
            x,
            dropout,
            axis=axis,
            split_dim=1 if sequence_parallel else None,
            batch_axes=batch_axes,
        )
    aux = 0.0
    for i, block in enumerate(params["blocks"]):
        extra = dict(dropout=dropout, key=fold_in(key, i + 1), batch_axes=batch_axes) if dropout else {}
        if "moe" in block:
            x, block_aux = moe_block(block, x, axis=axis, n_heads=n_heads, moe=moe, **extra)
            aux = aux + block_aux
            continue
        x = gpt_block(block, x, axis=axis, n_heads=n_heads, sequence_parallel=sequence_parallel, **extra)
    x = layer_norm(params["ln_f"], x)
    w_head = params["w_head"] if "w_head" in params else params["w_emb"].t()
    if sequence_parallel:
        return sp_column_linear(x, w_head, axis=axis)
    logits = column_linear(x, w_head, axis=axis)
    return logits if moe is None else (logits, aux)


def gpt_loss(
    params: dict,
    ids: Tensor,
    targets: Tensor,
    *,
    axis,
    n_heads: int,
    sequence_parallel: bool = False,
    dropout: float = 0.0,
    key: Tensor | None = None,
    batch_axes=None,
    moe: dict | None = None,
):
    """Per-token next-token loss of ``gpt``: ``ids, targets[B, T] replicated -> loss[B, T] replicated``.

    ``vocab_cross_entropy(gpt(params, ids, ...), targets)``; average it yourself (and ``pmean``
    over a data axis).  ``dropout``, ``key``, ``batch_axes``, ``moe``: as for ``gpt``; with ``moe``
    (a MoE GPT) it returns ``(loss, aux_loss)``.
    """
    out = gpt(
        params,
        ids,
        axis=axis,
        n_heads=n_heads,
        sequence_parallel=sequence_parallel,
        dropout=dropout,
        key=key,
        batch_axes=batch_axes,
        moe=moe,
    )
    if moe is None:
        return vocab_cross_entropy(out, targets, axis=axis)
    return vocab_cross_entropy(out[0], targets, axis=axis), out[1]


# Parameter specs --------------------------------------------------------------------------------------


def mlp_specs(axis="tensor", *, bias: bool = True) -> dict:
    """Return the ``fpar.P`` of each ``mlp`` parameter: ``w_in`` by columns, ``w_out`` by rows.

    ``axis=None`` replicates everything.
    """
    specs = {"w_in": P(None, axis), "w_out": P(axis, None)}
    if bias:
        specs.update(b_in=P(axis), b_out=P())
    return _replicated(specs) if axis is None else specs


def attention_specs(axis="tensor", *, bias: bool = True) -> dict:
    """Return the ``fpar.P`` of each ``attention`` parameter: ``w_qkv`` by heads, ``w_o`` by rows.

    ``axis=None`` replicates everything (``ulysses_attention``, ``ring_self_attention``).
    """
    specs = {"w_qkv": P(None, None, axis), "w_o": P(axis, None)}
    if bias:
        specs.update(b_qkv=P(None, axis), b_o=P())
    return _replicated(specs) if axis is None else specs


def layer_norm_specs() -> dict:
    """LayerNorm parameters are replicated."""
    return {"w": P(), "b": P()}


def gpt_block_specs(axis="tensor") -> dict:
    """Return the specs of a ``gpt_block``'s parameters (the same for 1D and sequence parallel)."""
    return {
        "ln1": layer_norm_specs(),
        "attn": attention_specs(axis),
        "ln2": layer_norm_specs(),
        "mlp": mlp_specs(axis),
    }


def gpt_specs(
    n_layers: int, axis="tensor", *, tied: bool = True, moe: bool = False, expert_axis="expert"
) -> dict:
    """Return the specs of ``gpt``'s parameters: the embedding (and head) split over the vocabulary.

    Args:
      n_layers: the number of blocks.
      axis: the tensor-parallel mesh axis.
      tied: the head reuses the embedding; ``False`` adds ``"w_head"`` (``[D, V]`` by columns).
      moe: a MoE GPT (``init_gpt(..., n_experts=E)``): every other block (1, 3, ...) has a
        ``"moe"`` MLP, its experts split over ``expert_axis`` (``None``: replicated) and their
        hidden dim over ``axis``.
      expert_axis: the mesh axis a MoE GPT's experts are split over (``None``: replicated).
    """
    _check_layers("gpt_specs", n_layers)
    specs = {
        "w_emb": P(axis, None),
        "w_pos": P(),
        "blocks": [gpt_block_specs(axis) for _ in range(n_layers)],
        "ln_f": layer_norm_specs(),
    }
    if not tied:
        specs["w_head"] = P(None, axis)
    for i in range(1, n_layers, 2) if moe else ():
        block = specs["blocks"][i]
        del block["mlp"]
        block["moe"] = moe_specs(expert_axis, tensor_axis=axis)
    return specs


# Initialisers -------------------------------------------------------------------------------------------


def init_mlp(
    d_model: int,
    d_hidden: int | None = None,
    *,
    std: float = 0.02,
    out_std: float | None = None,
    bias: bool = True,
    dtype: torch.dtype = torch.float32,
) -> dict:
    """Return ``fpar.init`` leaves for an ``mlp``: normal weights (``out_std`` for ``w_out``), zero biases."""
    d_hidden = 4 * d_model if d_hidden is None else d_hidden
    p = {
        "w_in": normal((d_model, d_hidden), std=std, dtype=dtype),
        "w_out": normal((d_hidden, d_model), std=std if out_std is None else out_std, dtype=dtype),
    }
    if bias:
        p.update(b_in=zeros((d_hidden,), dtype=dtype), b_out=zeros((d_model,), dtype=dtype))
    return p


def init_attention(
    d_model: int,
    *,
    std: float = 0.02,
    out_std: float | None = None,
    bias: bool = True,
    dtype: torch.dtype = torch.float32,
) -> dict:
    """Return ``fpar.init`` leaves for ``attention``: ``w_qkv [D, 3, D]``, ``w_o [D, D]``, zero biases."""
    p = {
        "w_qkv": normal((d_model, 3, d_model), std=std, dtype=dtype),
        "w_o": normal((d_model, d_model), std=std if out_std is None else out_std, dtype=dtype),
    }
    if bias:
        p.update(b_qkv=zeros((3, d_model), dtype=dtype), b_o=zeros((d_model,), dtype=dtype))
    return p


def init_layer_norm(d_model: int, *, dtype: torch.dtype = torch.float32) -> dict:
    """Return ``fpar.init`` leaves for ``layer_norm``: ones and zeros."""
    return {"w": ones((d_model,), dtype=dtype), "b": zeros((d_model,), dtype=dtype)}


def init_gpt_block(
    d_model: int,
    d_hidden: int | None = None,
    *,
    std: float = 0.02,
    out_std: float | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict:
    """Return ``fpar.init`` leaves for a ``gpt_block``."""
    return {
        "ln1": init_layer_norm(d_model, dtype=dtype),
        "attn": init_attention(d_model, std=std, out_std=out_std, dtype=dtype),
        "ln2": init_layer_norm(d_model, dtype=dtype),
        "mlp": init_mlp(d_model, d_hidden, std=std, out_std=out_std, dtype=dtype),
    }


def init_gpt(
    vocab_size: int,
    d_model: int,
    n_layers: int,
    max_seq_len: int,
    *,
    d_hidden: int | None = None,
    tied: bool = True,
    std: float = 0.02,
    dtype: torch.dtype = torch.float32,
    n_experts: int | None = None,
) -> dict:
    """Return ``fpar.init`` leaves for ``gpt`` (GPT-2 init: residual projections get ``std / sqrt(2 L)``).

    ``n_experts``: a MoE GPT, every other block (1, 3, ...) with a ``"moe"`` MLP of that many
    experts of hidden size ``d_hidden`` (see ``gpt_specs(..., moe=True)``).

    Example:
      >>> params = fpar.init(init_gpt(256, 64, 2, 64), mesh, gpt_specs(2, "tensor"), seed=0)
    """
    _check_layers("init_gpt", n_layers)
    out_std = std / math.sqrt(2 * n_layers)
    p = {
        "w_emb": normal((vocab_size, d_model), std=std, dtype=dtype),
        "w_pos": normal((max_seq_len, d_model), std=std, dtype=dtype),
        "blocks": [
            init_gpt_block(d_model, d_hidden, std=std, out_std=out_std, dtype=dtype) for _ in range(n_layers)
        ],
        "ln_f": init_layer_norm(d_model, dtype=dtype),
    }
    if not tied:
        p["w_head"] = normal((d_model, vocab_size), std=std, dtype=dtype)
    for i in range(1, n_layers, 2) if n_experts is not None else ():
        block = p["blocks"][i]
        del block["mlp"]
        hidden = 4 * d_model if d_hidden is None else d_hidden
        block["moe"] = init_moe(d_model, hidden, n_experts, std=std, out_std=out_std, dtype=dtype)
    return p


def _check_moe(api: str, params: dict, moe, sequence_parallel: bool, axis) -> None:
    """A MoE GPT's arguments, every MoE block's included, before the first collective."""
    blocks = params["blocks"]
    has_moe = any("moe" in b for b in blocks)
    if has_moe and moe is None:
        raise ValueError(
            f"fpar.ops.{api}: params have MoE blocks but moe is None; pass moe=dict(top_k=..., "
            f"axis=<expert axis>) (the result is then (logits, aux_loss))."
        )
    if moe is not None and not has_moe:
        raise ValueError(
            f"fpar.ops.{api}: moe={moe!r} but params have no MoE block; build them with "
            f"init_gpt(..., n_experts=E) and gpt_specs(..., moe=True)."
        )
    if moe is not None and sequence_parallel:
        raise ValueError(f"fpar.ops.{api}: moe and sequence_parallel=True do not combine yet; pick one.")
    if moe is None:
        return
    if not isinstance(moe, dict) or set(moe) - {"top_k", "axis", "token_axes", "capacity_factor"}:
        raise TypeError(
            f"fpar.ops.{api}: moe must be a dict with keys among 'top_k', 'axis', 'token_axes', "
            f"'capacity_factor' (the "
            f"keyword arguments of fpar.ops.moe; the tensor axis is the GPT's), got {moe!r}."
        )
    d = params["w_emb"].shape[1]
    for i, block in enumerate(blocks):
        if "moe" in block:
            kw = {"top_k": 2, "axis": None, "token_axes": None, **moe}
            check_moe_args(f"{api} (blocks[{i}])", block["moe"], d, tensor_axis=axis, **kw)


def _replicated(specs: dict) -> dict:
    return {k: P() for k in specs}


def _check_layers(api: str, n_layers) -> None:
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 0:
        raise TypeError(f"fpar.ops.{api}: n_layers must be a non-negative int, got {n_layers!r}.")
