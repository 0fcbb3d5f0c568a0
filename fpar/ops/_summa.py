"""Colossal-AI 2D (SUMMA / Optimus) and 2.5D (Tesseract) tensor-parallel layers.

Per-device functions, to be called inside ``fpar.shard``; the 3D layers are in ``_summa_3d.py``.
Each layer's global function is exactly the unsharded one (``x @ w + b``, LayerNorm, an MLP) on
the global tensors laid out by the specs from :func:`specs_2d` / :func:`specs_2p5d`.

Papers: Xu et al., *An Efficient 2D Method for Training Super-Large Deep Learning Models*
(arXiv 2104.05343, "Optimus"); Wang et al., *Tesseract: Parallelize the Tensor Parallelism
Efficiently* (arXiv 2105.14500, 2.5D).  Reference code: ``colossalai/legacy/nn/layer/
parallel_{2d,2p5d}``.

Grid names.  Device ``(i, j)`` sits at index ``i`` of ``row_axis`` and ``j`` of ``col_axis``.
"Row ``i``" (the paper's row group) is the devices that share ``i``: a collective over it names
``col_axis``.  "Column ``j``" is the devices that share ``j``: a collective over it names
``row_axis``.  2.5D adds ``dep_axis`` (index ``k``): ``d`` independent ``q x q`` layers.

Shape suffixes (torchtitan style; inside a sharded function, per-device blocks)::

    B  batch (dim 0; any dims between it and the last are carried along, e.g. a sequence)
    D  input features of a linear layer (the hidden size for LayerNorm)
    F  output features
    pr, pc, d  sizes of row_axis, col_axis, dep_axis (the paper's grid is square: pr = pc = q)

    x_BD  [B/pr, D/pc] 2D, [B/(d pr), D/pc] 2.5D       w_DF  [D/pr, F/pc]       b_F  [F/(pr pc)]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from .._collectives import all_gather, axis_size, psum, pvary
from .._spec import P
from ..random import fold_in
from ._dropout import check_dropout
from ._dropout import dropout as _dropout

__all__ = [
    "TensorParallelSpecs",
    "layer_norm_2d",
    "layer_norm_2p5d",
    "linear_2d",
    "linear_2p5d",
    "mlp_2d",
    "mlp_2p5d",
    "specs_2d",
    "specs_2p5d",
    "summa_matmul",
]

Tensor = torch.Tensor
AxisName = str | tuple[str, ...]


# Specs --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TensorParallelSpecs:
    """The ``fpar.P`` of every tensor a tensor-parallel layer takes or returns.

    Attributes:
      x: the input activation ``[B, ..., D]``.
      w: a linear weight ``[D, F]`` (``x @ w``).
      b: a linear bias ``[F]``.
      y: the output activation ``[B, ..., F]`` of a linear layer.
      layer_norm: the parameters ``{"w": [D], "b": [D]}`` of the mode's LayerNorm applied to ``x``.
      mlp: the parameters ``{"w_in": [D, H], "b_in": [H], "w_out": [H, D], "b_out": [D]}`` of the
        mode's MLP (biases only with ``bias=True``); the MLP's output has spec ``x``.

    The parameter dicts have the keys and global shapes of ``fpar.ops.init_mlp`` /
    ``init_layer_norm``, so ``fpar.init(fpar.ops.init_mlp(D), mesh, specs.mlp)`` initialises them.
    """

    x: P
    w: P
    b: P
    y: P
    layer_norm: Mapping[str, P]
    mlp: Mapping[str, P]


def specs_2d(
    row_axis: AxisName = "tensor_row", col_axis: AxisName = "tensor_col", *, ndim: int = 2, bias: bool = True
) -> TensorParallelSpecs:
    """Return the specs of the 2D (SUMMA) layers on a ``row_axis x col_axis`` grid.

    Layout (Optimus; Colossal-AI's ``Linear2D``): the activation's batch is split over the grid
    rows and its features over the columns; a weight ``[D, F]`` is split the same way (block
    ``A_ij``); a bias ``[F]`` is split ``q^2`` ways, column-major (``F`` block ``j`` holds
    sub-block ``i`` on device ``(i, j)``), so that one all_gather over a column gives block ``j``.

    Args:
      row_axis: the mesh axis (or tuple of axes) indexing grid rows.
      col_axis: the mesh axis (or tuple of axes) indexing grid columns.
      ndim: the rank of the activations (2 for ``[B, D]``, 3 for ``[B, S, D]``, ...).
      bias: whether ``mlp`` lists the biases.

    Returns:
      ``x = y = P(row, ..., col)``, ``w = P(row, col)``, ``b = P((col, row))``; LayerNorm and
      MLP parameters likewise (vectors as ``b``, matrices as ``w``).

    Example:
      >>> s = fpar.ops.specs_2d("tensor_row", "tensor_col")
      >>> f = fpar.shard(partial(fpar.ops.linear_2d, row_axis="tensor_row", col_axis="tensor_col"),
      ...                mesh, (s.x, s.w, s.b), s.y)      # f(x, w, b) == x @ w + b
    """
    _check_axes("specs_2d", row_axis=row_axis, col_axis=col_axis)
    return _grid_specs("specs_2d", _flat(row_axis), row_axis, col_axis, ndim, bias)


def specs_2p5d(
    dep_axis: AxisName = "tensor_dep",
    row_axis: AxisName = "tensor_row",
    col_axis: AxisName = "tensor_col",
    *,
    ndim: int = 2,
    bias: bool = True,
) -> TensorParallelSpecs:
    """Return the specs of the 2.5D (Tesseract) layers on a ``dep x row x col`` grid.

    Tesseract (and Colossal-AI's 2.5D docs): the batch is split into ``d * q`` row blocks,
    depth-major (block ``k q + i`` on layer ``k``, grid row ``i``); weights, biases and LayerNorm parameters are the 2D ones,
    replicated over ``dep_axis`` (their gradients are summed over it by fpar).

    Args:
      dep_axis: the mesh axis (or tuple) indexing the depth layers.
      row_axis: the mesh axis (or tuple) indexing grid rows.
      col_axis: the mesh axis (or tuple) indexing grid columns.
      ndim: the rank of the activations.
      bias: whether ``mlp`` lists the biases.

    Returns:
      ``x = y = P((dep, row), ..., col)``; the parameters as in :func:`specs_2d`.
    """
    _check_axes("specs_2p5d", dep_axis=dep_axis, row_axis=row_axis, col_axis=col_axis)
    return _grid_specs("specs_2p5d", _flat(dep_axis) + _flat(row_axis), row_axis, col_axis, ndim, bias)


def _grid_specs(
    api: str, batch: tuple[str, ...], row_axis, col_axis, ndim: int, bias: bool
) -> TensorParallelSpecs:
    check_ndim(api, ndim)
    act = P(_entry(batch), *([None] * (ndim - 2)), _entry(_flat(col_axis)))
    w = P(_entry(_flat(row_axis)), _entry(_flat(col_axis)))
    b = P(_entry(_flat(col_axis) + _flat(row_axis)))
    mlp = {"w_in": w, "w_out": w, **({"b_in": b, "b_out": b} if bias else {})}
    return TensorParallelSpecs(x=act, w=w, b=b, y=act, layer_norm={"w": b, "b": b}, mlp=mlp)


def check_ndim(api: str, ndim: Any) -> None:
    """Activations are at least ``[B, D]``."""
    if isinstance(ndim, bool) or not isinstance(ndim, int) or ndim < 2:
        raise ValueError(f"fpar.ops.{api}: ndim must be an int >= 2 (batch ... features), got {ndim!r}.")


def _flat(axis: AxisName) -> tuple[str, ...]:
    return (axis,) if isinstance(axis, str) else tuple(axis)


def _entry(axes: tuple[str, ...]) -> AxisName:
    return axes[0] if len(axes) == 1 else axes


# 2D layers ----------------------------------------------------------------------------------


def summa_matmul(x: Tensor, w: Tensor, *, row_axis: AxisName, col_axis: AxisName) -> Tensor:
    """Multiply 2D-sharded blocks with SUMMA: ``x_BD @ w_DF -> y_BF``, all split (row, col).

    Optimus' forward runs ``q`` steps; at step ``t`` device ``(i, j)`` receives ``X_it``
    (broadcast along row ``i``) and ``A_tj`` (broadcast along column ``j``) and accumulates
    ``Y_ij += X_it A_tj``.  Over the ``q`` steps each device receives every block of its row and
    column: the broadcasts carry exactly the bytes of one all_gather of ``X`` over the row and
    one of ``A`` over the column, which is what this function issues.  The alternatives
    considered: all_gather-then-index per step moves ``q`` times more; a psum of a masked
    block per step moves ``2(q-1)/q`` of a block each step (over ``q`` steps, twice the
    all_gather) and its transpose adds an all-reduce per step; a Cannon ring (ppermute) moves the all_gather's bytes plus the initial skew
    (``(q-1)/q`` of a block) in ``q`` latency rounds, and under autodiff keeps every received
    block anyway.

    Backward (autodiff through the two all_gathers; the transposes are psum_scatters) is
    exact: ``dX`` is reduce-scattered along the row and ``dA`` along the column -- the paper's
    ``Matmul_ABT_2D`` / ``Matmul_ATB_2D`` reductions.  The paper also *re-broadcasts* ``A`` and
    ``X`` in the backward (it keeps only the ``1/q^2`` blocks); autodiff keeps the gathered
    operands from the forward instead.  Per device, for one forward + backward::

        this function:  2 (q-1) (|X| + |A|) / q^2   (all_gather + psum_scatter, each operand)
        the paper:      3 (q-1) (|X| + |A|) / q^2   (Colossal-AI table: 6(q-1)/q, see below)

    i.e. 2/3 of the paper's traffic, at the price of holding ``x`` gathered over the row
    (``[B/q, D]``) and ``w`` over the column (``[D, F/q]``) between forward and backward
    (activation memory ``1/q`` rather than ``1/q^2``).  The Colossal-AI docs state 2D and 2.5D
    bandwidth in units of ``S/q`` (``|X| = |A| = S``): ``3 (q-1) 2S / q^2 = (6(q-1)/q) S/q``.

    Any ``pr x pc`` grid works (SUMMA does not need a square one): ``x_BD`` is
    ``[B/pr, D/pc]``, ``w_DF`` is ``[D/pr, F/pc]``, the result ``[B/pr, F/pc]``.

    Args:
      x: this device's block ``X_ij`` of ``x [B, ..., D]`` (spec ``specs_2d(...).x``).
      w: this device's block ``A_ij`` of ``w [D, F]`` (spec ``specs_2d(...).w``).
      row_axis: the mesh axis (or tuple) indexing grid rows.
      col_axis: the mesh axis (or tuple) indexing grid columns.

    Returns:
      The block ``Y_ij`` of ``y = x @ w`` (spec ``specs_2d(...).y``).

    Raises:
      TypeError: ``x``/``w`` not tensors, axes not names.
      ValueError: block shapes that do not come from ``x [B, ..., D]``, ``w [D, F]`` split by
        ``specs_2d``.
      fpar.UnboundAxisError: called outside ``fpar.shard`` or with an axis the mesh lacks.
    """
    api = "summa_matmul"
    _check_axes(api, row_axis=row_axis, col_axis=col_axis)
    _check_linear_2d(api, x, w, None, row_axis, col_axis)
    x_BD = all_gather(x, col_axis, axis=-1, tiled=True)  # [B/pr, D]: all of row i
    w_DF = all_gather(w, row_axis, axis=0, tiled=True)  # [D, F/pc]: all of column j
    return x_BD @ w_DF


def linear_2d(
    x: Tensor, w: Tensor, b: Tensor | None = None, *, row_axis: AxisName, col_axis: AxisName
) -> Tensor:
    """Apply a 2D-parallel linear layer: ``x_BD @ w_DF + b_F -> y_BF``, all 2D-sharded.

    The matmul is :func:`summa_matmul`.  The bias block ``[F/q^2]`` is all_gathered over the
    column (``row_axis``) to ``[F/q]`` (Colossal-AI's ``add_bias_2d``); its gradient comes back
    by the transpose psum_scatter, which also sums the batch rows of the column.  Traffic per
    device, forward + backward: ``2 (q-1) (|X| + |A| + |b|) / q^2``.

    Args:
      x: block of ``x [B, ..., D]``, spec ``specs_2d(row_axis, col_axis, ndim=x.ndim).x``.
      w: block of ``w [D, F]``, spec ``.w``.
      b: block of ``b [F]``, spec ``.b``; or None.
      row_axis: the mesh axis (or tuple) indexing grid rows.
      col_axis: the mesh axis (or tuple) indexing grid columns.

    Returns:
      The block of ``y = x @ w + b``, spec ``.y``.

    Raises:
      TypeError, ValueError, fpar.UnboundAxisError: as :func:`summa_matmul`, and for a bias
        block that is not ``[F/(pr pc)]``.
    """
    api = "linear_2d"
    _check_axes(api, row_axis=row_axis, col_axis=col_axis)
    _check_linear_2d(api, x, w, b, row_axis, col_axis)
    y_BF = summa_matmul(x, w, row_axis=row_axis, col_axis=col_axis)
    if b is None:
        return y_BF
    return y_BF + all_gather(b, row_axis, axis=0, tiled=True)  # [F/pc]: bias of column j


def layer_norm_2d(
    params: Mapping[str, Tensor], x: Tensor, *, row_axis: AxisName, col_axis: AxisName, eps: float = 1e-5
) -> Tensor:
    """Apply LayerNorm over the features of a 2D-sharded activation: ``x_BD -> y_BD``.

    The features are split over the row group (``col_axis``), so the mean and the variance are
    psums of local partial sums over it (Colossal-AI's ``LayerNorm2D``; two passes, mean first,
    for accuracy).  ``w`` and ``b`` are ``[D/q^2]`` blocks all_gathered over the column, like a
    linear bias.  The global function is ``F.layer_norm(x, (D,), w, b, eps)``.

    Args:
      params: blocks of ``{"w": [D], "b": [D]}``, specs ``specs_2d(...).layer_norm``.
      x: block of ``x [B, ..., D]``, spec ``specs_2d(...).x``.
      row_axis: the mesh axis (or tuple) indexing grid rows.
      col_axis: the mesh axis (or tuple) indexing grid columns.
      eps: added to the variance.

    Returns:
      The block of the normalised activation, spec ``.x``.
    """
    api = "layer_norm_2d"
    _check_axes(api, row_axis=row_axis, col_axis=col_axis)
    check_params(api, params, ("w", "b"), ())
    _check_tensor(api, "x", x, min_dim=1)
    pr = axis_size(row_axis)
    for name in ("w", "b"):
        _check_param_block(api, f"params[{name!r}]", params[name], x.shape[-1], pr, "x's last dim", row_axis)
    d_total = x.shape[-1] * axis_size(col_axis)
    mean_B1 = psum(x.sum(-1, keepdim=True), col_axis) / d_total
    xc_BD = x - mean_B1
    var_B1 = psum((xc_BD * xc_BD).sum(-1, keepdim=True), col_axis) / d_total
    w_D, b_D = (all_gather(params[k], row_axis, axis=0, tiled=True) for k in ("w", "b"))
    return xc_BD * torch.rsqrt(var_B1 + eps) * w_D + b_D


def mlp_2d(
    params: Mapping[str, Tensor],
    x: Tensor,
    *,
    row_axis: AxisName,
    col_axis: AxisName,
    activation: Callable[[Tensor], Tensor] = F.gelu,
    dropout: float = 0.0,
    key: Tensor | None = None,
) -> Tensor:
    """Apply a 2D-parallel MLP: ``x_BD -> act(x @ w_in + b_in) @ w_out + b_out -> y_BD``.

    Both linears are :func:`linear_2d`; the hidden activation stays 2D-sharded, so the
    nonlinearity is local.  Traffic: that of the two linears.

    Args:
      params: blocks of ``{"w_in": [D, H], "w_out": [H, D]}`` and optionally ``"b_in": [H]``,
        ``"b_out": [D]``; specs ``specs_2d(...).mlp``.
      x: block of ``x [B, ..., D]``, spec ``specs_2d(...).x``.
      row_axis: the mesh axis (or tuple) indexing grid rows.
      col_axis: the mesh axis (or tuple) indexing grid columns.
      activation: the elementwise nonlinearity.
      dropout: drop probability on the hidden activation and on the output (as Colossal-AI's
        ViT MLP), masks from ``fpar.ops.dropout`` on the activations' global layout (the same at
        every layout); ``0.0`` (default) changes nothing.
      key: the ``fpar.random`` key (hidden: ``fold_in(key, 0)``, output: ``fold_in(key, 1)``),
        needed when ``dropout > 0``.

    Returns:
      The block of the MLP's output, spec ``.x``.
    """
    check_params("mlp_2d", params, ("w_in", "w_out"), ("b_in", "b_out"))
    check_dropout("mlp_2d", dropout, key)
    axes = {"row_axis": row_axis, "col_axis": col_axis}
    h_BH = activation(linear_2d(x, params["w_in"], params.get("b_in"), **axes))
    if not dropout:
        return linear_2d(h_BH, params["w_out"], params.get("b_out"), **axes)
    spec = specs_2d(row_axis, col_axis, ndim=x.dim()).x
    h_BH = _dropout(fold_in(key, 0), h_BH, dropout, spec=spec)
    return _dropout(
        fold_in(key, 1), linear_2d(h_BH, params["w_out"], params.get("b_out"), **axes), dropout, spec=spec
    )


# 2.5D layers --------------------------------------------------------------------------------


def linear_2p5d(
    x: Tensor,
    w: Tensor,
    b: Tensor | None = None,
    *,
    dep_axis: AxisName,
    row_axis: AxisName,
    col_axis: AxisName,
) -> Tensor:
    """Apply a 2.5D-parallel linear layer: ``x_BD @ w_DF + b_F -> y_BF`` on a ``d x q x q`` grid.

    Tesseract: each depth layer runs :func:`linear_2d` on its ``1/d`` of the batch; ``w`` and
    ``b`` are the 2D blocks, replicated over ``dep_axis``.  They are marked varying over depth
    (``fpar.pvary``) *before* the all_gathers, so their gradient is all-reduced over depth on
    the ``1/q^2`` block (the paper's depth gradient sum), not on the gathered ``1/q`` one.

    Traffic per device, forward + backward, ``X`` the whole activation, ``A`` the weight::

        2 (q-1) (|X| / (d q^2) + |A| / q^2)    (SUMMA; the paper's 3 (q-1)(...), see
                                                summa_matmul: 3(q-1)(d+1)/(dq) in S/q units)
        + 2 (d-1)/d |A| / q^2                  (depth all-reduce of dA; not in the paper's table)

    Args:
      x: block of ``x [B, ..., D]``, spec ``specs_2p5d(dep_axis, row_axis, col_axis).x``.
      w: block of ``w [D, F]``, spec ``.w``.
      b: block of ``b [F]``, spec ``.b``; or None.
      dep_axis: the mesh axis (or tuple) indexing depth layers.
      row_axis: the mesh axis (or tuple) indexing grid rows.
      col_axis: the mesh axis (or tuple) indexing grid columns.

    Returns:
      The block of ``y = x @ w + b``, spec ``.y``.
    """
    api = "linear_2p5d"
    _check_axes(api, dep_axis=dep_axis, row_axis=row_axis, col_axis=col_axis)
    _check_linear_2d(api, x, w, b, row_axis, col_axis)
    w, b = _vary_over_depth(w, b, dep_axis=dep_axis)
    return linear_2d(x, w, b, row_axis=row_axis, col_axis=col_axis)


def layer_norm_2p5d(
    params: Mapping[str, Tensor],
    x: Tensor,
    *,
    dep_axis: AxisName,
    row_axis: AxisName,
    col_axis: AxisName,
    eps: float = 1e-5,
) -> Tensor:
    """Apply LayerNorm to a 2.5D-sharded activation: :func:`layer_norm_2d` in each depth layer.

    Args:
      params: blocks of ``{"w": [D], "b": [D]}``, specs ``specs_2p5d(...).layer_norm``
        (replicated over depth; their gradient is all-reduced over it).
      x: block of ``x [B, ..., D]``, spec ``specs_2p5d(...).x``.
      dep_axis: the mesh axis (or tuple) indexing depth layers.
      row_axis: the mesh axis (or tuple) indexing grid rows.
      col_axis: the mesh axis (or tuple) indexing grid columns.
      eps: added to the variance.

    Returns:
      The block of the normalised activation, spec ``.x``.
    """
    api = "layer_norm_2p5d"
    _check_axes(api, dep_axis=dep_axis, row_axis=row_axis, col_axis=col_axis)
    check_params(api, params, ("w", "b"), ())
    w, b = _vary_over_depth(params["w"], params["b"], dep_axis=dep_axis)
    return layer_norm_2d({"w": w, "b": b}, x, row_axis=row_axis, col_axis=col_axis, eps=eps)


def mlp_2p5d(
    params: Mapping[str, Tensor],
    x: Tensor,
    *,
    dep_axis: AxisName,
    row_axis: AxisName,
    col_axis: AxisName,
    activation: Callable[[Tensor], Tensor] = F.gelu,
    dropout: float = 0.0,
    key: Tensor | None = None,
) -> Tensor:
    """Apply a 2.5D-parallel MLP: ``x_BD -> act(x @ w_in + b_in) @ w_out + b_out -> y_BD``.

    Args:
      params: blocks of ``{"w_in", "w_out"}`` and optionally ``{"b_in", "b_out"}``, specs
        ``specs_2p5d(...).mlp``.
      x: block of ``x [B, ..., D]``, spec ``specs_2p5d(...).x``.
      dep_axis: the mesh axis (or tuple) indexing depth layers.
      row_axis: the mesh axis (or tuple) indexing grid rows.
      col_axis: the mesh axis (or tuple) indexing grid columns.
      activation: the elementwise nonlinearity.
      dropout: drop probability on the hidden activation and on the output (as Colossal-AI's
        ViT MLP), masks from ``fpar.ops.dropout`` on the activations' global layout (the same at
        every layout); ``0.0`` (default) changes nothing.
      key: the ``fpar.random`` key (hidden: ``fold_in(key, 0)``, output: ``fold_in(key, 1)``),
        needed when ``dropout > 0``.

    Returns:
      The block of the MLP's output, spec ``.x``.
    """
    check_params("mlp_2p5d", params, ("w_in", "w_out"), ("b_in", "b_out"))
    check_dropout("mlp_2p5d", dropout, key)
    axes = {"dep_axis": dep_axis, "row_axis": row_axis, "col_axis": col_axis}
    h_BH = activation(linear_2p5d(x, params["w_in"], params.get("b_in"), **axes))
    if not dropout:
        return linear_2p5d(h_BH, params["w_out"], params.get("b_out"), **axes)
    spec = specs_2p5d(dep_axis, row_axis, col_axis, ndim=x.dim()).x
    h_BH = _dropout(fold_in(key, 0), h_BH, dropout, spec=spec)
    return _dropout(
        fold_in(key, 1), linear_2p5d(h_BH, params["w_out"], params.get("b_out"), **axes), dropout, spec=spec
    )


def _vary_over_depth(*params: Tensor | None, dep_axis: AxisName) -> tuple[Tensor | None, ...]:
    return tuple(None if p is None else pvary(p, dep_axis) for p in params)


# Error checking and messages ---------------------------------------------------------------


def _check_axes(api: str, **axes: Any) -> None:
    """Each axis argument is a name or a tuple of names; no mesh axis is used twice."""
    seen: dict[str, str] = {}
    for arg, axis in axes.items():
        names = _flat(axis) if isinstance(axis, (str, tuple)) else None
        if not names or not all(isinstance(a, str) for a in names):
            raise TypeError(
                f"fpar.ops.{api}: {arg} must be a mesh axis name or a tuple of names, got {axis!r}."
            )
        for a in names:
            if a in seen:
                raise ValueError(
                    f"fpar.ops.{api}: mesh axis {a!r} is given as both {seen[a]} and {arg}; each "
                    f"role needs its own mesh axis."
                )
            seen[a] = arg


def _check_tensor(api: str, name: str, t: Any, *, min_dim: int) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"fpar.ops.{api}: {name} must be a tensor, got {type(t).__name__}.")
    if t.dim() < min_dim:
        raise ValueError(
            f"fpar.ops.{api}: {name} must have at least {min_dim} dims, got shape {tuple(t.shape)}."
        )


def _check_linear_2d(api: str, x: Any, w: Any, b: Any, row_axis: AxisName, col_axis: AxisName) -> None:
    """``x_BD`` and ``w_DF`` are blocks of a global ``[B, D] @ [D, F]`` split by ``specs_2d``."""
    _check_tensor(api, "x", x, min_dim=2)
    _check_tensor(api, "w", w, min_dim=2)
    if w.dim() != 2:
        raise ValueError(f"fpar.ops.{api}: w must be a matrix [D, F] (x @ w), got shape {tuple(w.shape)}.")
    pr, pc = axis_size(row_axis), axis_size(col_axis)
    if x.shape[-1] * pc != w.shape[0] * pr:
        raise ValueError(
            f"fpar.ops.{api}: x's block {tuple(x.shape)} and w's block {tuple(w.shape)} are not blocks "
            f"of a global x [B, ..., D] @ w [D, F]: with {col_axis!r} of size {pc} and {row_axis!r} of "
            f"size {pr}, D = {x.shape[-1]}*{pc} from x but {w.shape[0]}*{pr} from w.  Split x by "
            f"P(row, ..., col) and w by P(row, col): the .x and .w specs of "
            f"fpar.ops.specs_2d({row_axis!r}, {col_axis!r}) (or specs_2p5d)."
        )
    if b is not None:
        _check_param_block(api, "b", b, w.shape[1], pr, "w's last dim", row_axis)


def _check_param_block(api: str, name: str, p: Any, full: int, n: int, of: str, row_axis: AxisName) -> None:
    """A bias-like block all_gathered over ``row_axis`` must come out ``[full]``."""
    _check_tensor(api, name, p, min_dim=1)
    if p.dim() != 1 or p.shape[0] * n != full:
        raise ValueError(
            f"fpar.ops.{api}: {name}'s block has shape {tuple(p.shape)}, but all_gathered over "
            f"{row_axis!r} (size {n}) it must match {of} ({full}): split a [F] vector by "
            f"P((col, row)), the .b / .norm spec of fpar.ops.specs_2d / specs_2p5d."
        )


def check_params(api: str, params: Any, required: tuple[str, ...], optional: tuple[str, ...]) -> None:
    """A parameter dict with the required keys, maybe the optional ones, and nothing else."""
    if not isinstance(params, Mapping):
        raise TypeError(
            f"fpar.ops.{api}: params must be a dict of tensors with keys {list(required + optional)}, "
            f"got {type(params).__name__}."
        )
    missing = [k for k in required if k not in params]
    unknown = [k for k in params if k not in required + optional]
    if missing or unknown:
        raise ValueError(
            f"fpar.ops.{api}: params has keys {sorted(params)}; expected {list(required)}"
            f"{f' and optionally {list(optional)}' if optional else ''}"
            f"{f' (missing {missing})' if missing else ''}{f' (unknown {unknown})' if unknown else ''}."
        )
