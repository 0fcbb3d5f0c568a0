"""Colossal-AI 3D tensor-parallel layers (a ``q x q x q`` cube).

Per-device functions, to be called inside ``fpar.shard``.  Paper: Bian et al., *Maximizing
Parallelism in Distributed Training for Huge Neural Networks* (arXiv 2105.14450).  Reference
code: ``colossalai/legacy/nn/layer/parallel_3d`` (``Linear3D``, ``_Linear3D``).

Axis roles (Colossal-AI's group names).  Device ``(i, j, l)`` sits at index ``i`` of
``weight_axis``, ``j`` of ``input_axis``, ``l`` of ``output_axis``.  A linear layer

1. all_gathers ``x`` over ``input_axis`` (the input group ``(i, *, l)``),
2. all_gathers ``w`` over ``weight_axis`` (the weight group ``(*, j, l)``),
3. multiplies locally (a partial sum over the ``l``-th slice of the input features),
4. psum_scatters ``y`` over ``output_axis`` (the output group ``(i, j, *)``).

The output's features end up split over ``input_axis`` and its batch over
``(weight_axis, output_axis)``: the next layer swaps ``input_axis`` and ``output_axis``
(:func:`mlp_3d` does).  :func:`specs_3d` gives the matching global layouts.

Shape suffixes (per-device blocks; ``qi, qw, qo`` are the sizes of the three axes, ``q`` each
in the paper)::

    B  batch (dim 0; dims between it and the last are carried along)
    D  input features, F output features
    x_BD  [B/(qw qi), D/qo]     w_DF  [D/(qo qw), F/qi]     b_F  [F/qi]     y_BF  [B/(qw qo), F/qi]
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from .._collectives import all_gather, axis_size, psum, psum_scatter, pvary
from .._spec import P
from ..random import fold_in
from ._dropout import check_dropout
from ._dropout import dropout as _dropout
from ._summa import (
    AxisName,
    TensorParallelSpecs,
    _check_axes,
    _check_tensor,
    _entry,
    _flat,
    check_ndim,
    check_params,
)

__all__ = ["layer_norm_3d", "linear_3d", "mlp_3d", "specs_3d"]

Tensor = torch.Tensor


# Specs --------------------------------------------------------------------------------------


def specs_3d(
    input_axis: AxisName = "tensor_y",
    weight_axis: AxisName = "tensor_x",
    output_axis: AxisName = "tensor_z",
    *,
    ndim: int = 2,
    bias: bool = True,
) -> TensorParallelSpecs:
    """Return the specs of the 3D layers for one assignment of the axis roles.

    ``x [B, ..., D]``: batch split over ``(weight, input)``, features over ``output``.
    ``w [D, F]``: input features over ``(output, weight)``, output features over ``input``:
    ``q^3`` blocks ``[D/q^2, F/q]``.  ``b [F]`` over ``input``, replicated over the other two
    (as Colossal-AI's, whose gradient is all-reduced over the output x weight group).
    ``y [B, ..., F]``: batch over ``(weight, output)``, features over ``input``.
    ``layer_norm``'s ``[D]`` parameters (for ``x``) are split over ``output``.  In ``mlp`` the
    second layer has ``input`` and ``output`` swapped, so the MLP returns ``x``'s layout.

    The defaults are ``fpar.ops.tensor_layout``'s 3D axes in Colossal-AI's roles: device
    ``(i, j, l)`` of ``(tensor_x, tensor_y, tensor_z)`` gathers its input over ``(i, *, l)``,
    its weight over ``(*, j, l)`` and scatters its output over ``(i, j, *)``.

    Args:
      input_axis: the axis ``x`` is all_gathered over.
      weight_axis: the axis ``w`` is all_gathered over.
      output_axis: the axis ``y`` is psum_scattered over.
      ndim: the rank of the activations.
      bias: whether ``mlp`` lists the biases.

    Returns:
      The specs; the global function of :func:`linear_3d` on them is ``x @ w + b``.
    """
    _check_axes("specs_3d", input_axis=input_axis, weight_axis=weight_axis, output_axis=output_axis)
    check_ndim("specs_3d", ndim)
    i, w, o = _flat(input_axis), _flat(weight_axis), _flat(output_axis)
    mid = [None] * (ndim - 2)
    w_in, b_in = P(_entry(o + w), _entry(i)), P(_entry(i))
    w_out, b_out = P(_entry(i + w), _entry(o)), P(_entry(o))  # input and output swapped
    mlp = {"w_in": w_in, "w_out": w_out, **({"b_in": b_in, "b_out": b_out} if bias else {})}
    return TensorParallelSpecs(
        x=P(_entry(w + i), *mid, _entry(o)),
        w=w_in,
        b=b_in,
        y=P(_entry(w + o), *mid, _entry(i)),
        layer_norm={"w": P(_entry(o)), "b": P(_entry(o))},
        mlp=mlp,
    )


# Layers -------------------------------------------------------------------------------------


def linear_3d(
    x: Tensor,
    w: Tensor,
    b: Tensor | None = None,
    *,
    input_axis: AxisName,
    weight_axis: AxisName,
    output_axis: AxisName,
) -> Tensor:
    """Apply a 3D-parallel linear layer: ``x_BD @ w_DF + b_F -> y_BF`` (layouts: :func:`specs_3d`).

    Forward: all_gather ``x`` over ``input_axis`` to ``[B/q, D/q]``, all_gather ``w`` over
    ``weight_axis`` to ``[D/q, F/q]``, multiply, psum_scatter over ``output_axis`` to
    ``[B/q^2, F/q]``.  Backward is autodiff: the transposes are exactly the paper's -- all_gather
    ``dy`` over ``output_axis``, psum_scatter ``dx`` over ``input_axis`` and ``dw`` over
    ``weight_axis``.  The bias is marked varying over ``(weight_axis, output_axis)`` so its
    gradient is one all-reduce over that group (Colossal-AI's).  Traffic per device, forward +
    backward, ``X``, ``W``, ``Y`` the whole input, weight and output::

        2 (q-1) (|X| + |W| + |Y|) / q^3   (= 6(q-1)/q^3 S for |X| = |W| = |Y| = S, the paper's)
        + 2 (q^2-1)/q^2 |b| / q           (bias gradient, with a bias)

    Args:
      x: block of ``x [B, ..., D]``, spec ``specs_3d(input_axis, weight_axis, output_axis).x``.
      w: block of ``w [D, F]``, spec ``.w``.
      b: block of ``b [F]``, spec ``.b``; or None.
      input_axis: the axis ``x`` is gathered over.
      weight_axis: the axis ``w`` is gathered over.
      output_axis: the axis ``y`` is reduce-scattered over.

    Returns:
      The block of ``y = x @ w + b``, spec ``.y``.

    Raises:
      TypeError: ``x``/``w``/``b`` not tensors, axes not names.
      ValueError: blocks that do not come from ``x [B, ..., D]``, ``w [D, F]``, ``b [F]`` split
        by ``specs_3d``.
      fpar.UnboundAxisError: called outside ``fpar.shard`` or with an axis the mesh lacks.
    """
    api = "linear_3d"
    _check_axes(api, input_axis=input_axis, weight_axis=weight_axis, output_axis=output_axis)
    _check_linear_3d(api, x, w, b, input_axis, weight_axis, output_axis)
    x_BD = all_gather(x, input_axis, axis=0, tiled=True)  # [B/qw, D/qo]
    w_DF = all_gather(w, weight_axis, axis=0, tiled=True)  # [D/qo, F/qi]
    y_BF = psum_scatter(x_BD @ w_DF, output_axis, scatter_dimension=0, tiled=True)
    if b is None:
        return y_BF
    return y_BF + pvary(b, _flat(weight_axis) + _flat(output_axis))


def layer_norm_3d(
    params: Mapping[str, Tensor],
    x: Tensor,
    *,
    input_axis: AxisName,
    weight_axis: AxisName,
    output_axis: AxisName,
    eps: float = 1e-5,
) -> Tensor:
    """Apply LayerNorm over the features of a 3D-sharded activation: ``x_BD -> y_BD``.

    ``x``'s features are split over ``output_axis``: the mean and variance are psums over it.
    ``w`` and ``b`` are ``[D/q]`` blocks, replicated over the other two axes (their gradient is
    all-reduced over them).  The global function is ``F.layer_norm(x, (D,), w, b, eps)``.

    Args:
      params: blocks of ``{"w": [D], "b": [D]}``, specs ``specs_3d(...).layer_norm``.
      x: block of ``x [B, ..., D]``, spec ``specs_3d(...).x``.
      input_axis: the next layer's input axis (splits the batch).
      weight_axis: the next layer's weight axis (splits the batch).
      output_axis: the next layer's output axis (splits the features).
      eps: added to the variance.

    Returns:
      The block of the normalised activation, spec ``.x``.
    """
    api = "layer_norm_3d"
    _check_axes(api, input_axis=input_axis, weight_axis=weight_axis, output_axis=output_axis)
    check_params(api, params, ("w", "b"), ())
    _check_tensor(api, "x", x, min_dim=1)
    for name in ("w", "b"):
        p = params[name]
        _check_tensor(api, f"params[{name!r}]", p, min_dim=1)
        if p.dim() != 1 or p.shape[0] != x.shape[-1]:
            raise ValueError(
                f"fpar.ops.{api}: params[{name!r}]'s block has shape {tuple(p.shape)}, but x's block has "
                f"{x.shape[-1]} features: split a [D] vector by P(output_axis), the .layer_norm specs of "
                f"fpar.ops.specs_3d."
            )
    d_total = x.shape[-1] * axis_size(output_axis)
    mean_B1 = psum(x.sum(-1, keepdim=True), output_axis) / d_total
    xc_BD = x - mean_B1
    var_B1 = psum((xc_BD * xc_BD).sum(-1, keepdim=True), output_axis) / d_total
    return xc_BD * torch.rsqrt(var_B1 + eps) * params["w"] + params["b"]


def mlp_3d(
    params: Mapping[str, Tensor],
    x: Tensor,
    *,
    input_axis: AxisName,
    weight_axis: AxisName,
    output_axis: AxisName,
    activation: Callable[[Tensor], Tensor] = F.gelu,
    dropout: float = 0.0,
    key: Tensor | None = None,
) -> Tensor:
    """Apply a 3D-parallel MLP: ``x_BD -> act(x @ w_in + b_in) @ w_out + b_out -> y_BD``.

    The second linear swaps ``input_axis`` and ``output_axis`` (its input is the first one's
    output layout), so the result has ``x``'s layout.

    Args:
      params: blocks of ``{"w_in": [D, H], "w_out": [H, D]}`` and optionally ``"b_in": [H]``,
        ``"b_out": [D]``; specs ``specs_3d(input_axis, weight_axis, output_axis).mlp``.
      x: block of ``x [B, ..., D]``, spec ``specs_3d(...).x``.
      input_axis: the first layer's input axis.
      weight_axis: both layers' weight axis.
      output_axis: the first layer's output axis.
      activation: the elementwise nonlinearity.
      dropout: drop probability on the hidden activation and on the output (as Colossal-AI's
        ViT MLP), masks from ``fpar.ops.dropout`` on the activations' global layout (the same at
        every layout); ``0.0`` (default) changes nothing.
      key: the ``fpar.random`` key (hidden: ``fold_in(key, 0)``, output: ``fold_in(key, 1)``),
        needed when ``dropout > 0``.

    Returns:
      The block of the MLP's output, spec ``.x``.
    """
    check_params("mlp_3d", params, ("w_in", "w_out"), ("b_in", "b_out"))
    check_dropout("mlp_3d", dropout, key)
    first = {"input_axis": input_axis, "weight_axis": weight_axis, "output_axis": output_axis}
    second = {"input_axis": output_axis, "weight_axis": weight_axis, "output_axis": input_axis}
    h_BH = activation(linear_3d(x, params["w_in"], params.get("b_in"), **first))
    if not dropout:
        return linear_3d(h_BH, params["w_out"], params.get("b_out"), **second)
    specs = specs_3d(input_axis, weight_axis, output_axis, ndim=x.dim())
    h_BH = _dropout(fold_in(key, 0), h_BH, dropout, spec=specs.y)
    return _dropout(
        fold_in(key, 1),
        linear_3d(h_BH, params["w_out"], params.get("b_out"), **second),
        dropout,
        spec=specs.x,
    )


# Error checking and messages ---------------------------------------------------------------


def _check_linear_3d(api: str, x: Any, w: Any, b: Any, input_axis, weight_axis, output_axis) -> None:
    _check_tensor(api, "x", x, min_dim=2)
    _check_tensor(api, "w", w, min_dim=2)
    if w.dim() != 2:
        raise ValueError(f"fpar.ops.{api}: w must be a matrix [D, F] (x @ w), got shape {tuple(w.shape)}.")
    qi, qw, qo = (axis_size(a) for a in (input_axis, weight_axis, output_axis))
    names = f"input_axis={input_axis!r}, weight_axis={weight_axis!r}, output_axis={output_axis!r}"
    if x.shape[-1] != w.shape[0] * qw:
        raise ValueError(
            f"fpar.ops.{api}: x's block {tuple(x.shape)} and w's block {tuple(w.shape)} are not blocks of "
            f"a global x [B, ..., D] @ w [D, F]: x's last dim must be {qw} (the size of {weight_axis!r}) "
            f"times w's first.  Split them by the .x and .w specs of fpar.ops.specs_3d({names})."
        )
    if (x.shape[0] * qi) % qo:
        raise ValueError(
            f"fpar.ops.{api}: x's block has batch {x.shape[0]}; gathered over {input_axis!r} ({qi}) it "
            f"must be divisible by the size of {output_axis!r} ({qo}) to be reduce-scattered: the "
            f"global batch must be divisible by every axis size product in specs_3d({names})."
        )
    if b is not None:
        _check_tensor(api, "b", b, min_dim=1)
        if b.dim() != 1 or b.shape[0] != w.shape[1]:
            raise ValueError(
                f"fpar.ops.{api}: b's block has shape {tuple(b.shape)}, but w's block has {w.shape[1]} "
                f"output features: split a [F] bias by P(input_axis), the .b spec of fpar.ops.specs_3d."
            )
