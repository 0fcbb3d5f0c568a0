"""A decoder layer's pointwise pieces keeping for the backward only what fused kernels keep.

Written as plain torch, RMSNorm keeps its float32 input and float32 normalized value beside the
16-bit result the next matmul keeps (three copies of the hidden state where one is needed), and
SwiGLU keeps ``silu(gate)`` beside ``gate`` and ``up``.  Fused kernels (Apex's and Transformer
Engine's RMSNorm, Megatron-LM's ``bias_swiglu``) keep their inputs and recompute the rest in the
backward.  These autograd Functions do the same with torch ops, so they run on every
device, under ``torch.func`` transforms and on both meshes: ``rms_norm`` keeps ``x`` and one
float32 number a row, ``swiglu`` keeps ``gate`` and ``up``.  Values are those of the plain
forms bit for bit; ``swiglu``'s gradients too (its backward runs the plain backward's ops), and
``rms_norm``'s up to rounding (its backward is written out: the plain backward's op order is
autograd's).  With them (and grouped-query flash attention) ``fpar.plan.model_step``'s Llama 3
405B layer keeps 31.8 bytes per ``s b h / t`` at tensor=8 with sequence parallelism, Megatron-LM's
31.75; 52.1 before (docs/performance.md).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["rms_norm", "swiglu"]

Tensor = torch.Tensor


def rms_norm(
    x: Tensor, weight: Tensor | None = None, eps: float = 1e-6, *, compute_dtype: torch.dtype | None = None
) -> Tensor:
    """RMSNorm over the last dim, computed in float32 (float64 for float64 ``x``): ``(x / rms(x)).to(x.dtype) * weight``.

    The Llama family's norm (Hugging Face's ``LlamaRMSNorm`` and its copies): the mean of squares
    and the scaling in float32, the result cast back to ``x``'s dtype before the weight (cast to
    that dtype too) scales it.  The backward keeps ``x``, ``weight`` and the float32 reciprocal
    RMS of each row — not the float32 copies plain torch keeps — and recomputes the normalized
    value from them.

    Args:
      x: ``[..., D]``, any floating dtype.
      weight: ``[D]`` or ``None`` (no scale).
      eps: added to the mean of squares.
      compute_dtype: the dtype of the mean of squares and the scaling; ``None``: float32, or
        float64 for float64 ``x``.  Hugging Face's norms compute in float32 whatever ``x`` is.

    Returns:
      ``[..., D]`` in ``x``'s dtype.
    """
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise TypeError(
            f"fpar.ops.rms_norm: x must be a floating tensor, got {getattr(x, 'dtype', type(x))}."
        )
    if weight is not None and (weight.dim() != 1 or weight.shape[0] != x.shape[-1]):
        raise ValueError(
            f"fpar.ops.rms_norm: weight must be [{x.shape[-1]}] (x's last dim), got {list(weight.shape)}."
        )
    if compute_dtype is not None and not compute_dtype.is_floating_point:
        raise TypeError(f"fpar.ops.rms_norm: compute_dtype must be a floating dtype, got {compute_dtype}.")
    dt = compute_dtype or torch.promote_types(x.dtype, torch.float32)
    if weight is None:
        return _RmsNorm.apply(x, float(eps), dt)[0]
    # The weight meets x in an op of its own first (the cast the forward makes anyway): on a real
    # mesh a replicated weight scaling a varying x is pvaried there, where autograd records it.  A
    # custom Function's apply is not an op the real mesh's tracker sees, and inside its forward
    # autograd is off: where a sharded call stays traced (a pipeline stage's), the sum over the
    # axes x varies over would be lost (per-head q/k norms under tensor parallelism).
    return _ScaledRmsNorm.apply(x, weight.type_as(x), float(eps), dt)[0]


def _wide(x: Tensor, dt: torch.dtype) -> Tensor:
    return x.to(dt)


def _rstd(x32: Tensor, eps: float) -> Tensor:
    return torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


def _normalize_backward(g32: Tensor, x32: Tensor, r: Tensor) -> Tensor:
    """d/dx of ``x * r(x)`` with ``r = (mean(x^2) + eps)^-1/2``, given the cotangent ``g32``."""
    return r * g32 - (r.pow(3) / x32.shape[-1]) * x32 * (g32 * x32).sum(-1, keepdim=True)


class _RmsNorm(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, eps: float, dt: torch.dtype) -> tuple[Tensor, Tensor]:
        x32 = _wide(x, dt)
        r = _rstd(x32, eps)
        return (x32 * r).to(x.dtype), r

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.save_for_backward(inputs[0], output[1])
        ctx.mark_non_differentiable(output[1])
        ctx.dt = inputs[2]

    @staticmethod
    def backward(ctx: Any, g: Tensor, _: Any) -> tuple[Tensor, None, None]:
        x, r = ctx.saved_tensors
        return _normalize_backward(_wide(g, ctx.dt), _wide(x, ctx.dt), r).to(x.dtype), None, None


class _ScaledRmsNorm(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, weight: Tensor, eps: float, dt: torch.dtype) -> tuple[Tensor, Tensor]:
        x32 = _wide(x, dt)
        r = _rstd(x32, eps)
        return (x32 * r).to(x.dtype) * weight.to(x.dtype), r

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        x, weight, _, ctx.dt = inputs
        ctx.save_for_backward(x, weight, output[1])
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx: Any, g: Tensor, _: Any) -> tuple[Tensor | None, Tensor | None, None, None]:
        x, weight, r = ctx.saved_tensors
        x32 = _wide(x, ctx.dt)
        gx = gw = None
        if ctx.needs_input_grad[0]:
            gx = _normalize_backward(_wide(g * weight.to(g.dtype), ctx.dt), x32, r).to(x.dtype)
        if ctx.needs_input_grad[1]:
            n = (x32 * r).to(x.dtype)
            gw = (g * n).reshape(-1, n.shape[-1]).sum(0).to(weight.dtype)
        return gx, gw, None, None


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) * up``, keeping ``gate`` and ``up`` for the backward (not ``silu(gate)`` too).

    The gated MLP's middle (Llama, Mistral, Qwen...); ``silu(gate)`` is recomputed in the
    backward, whose ops are plain torch's: values and gradients equal ``F.silu(gate) * up``'s bit
    for bit.
    """
    if gate.shape != up.shape:
        raise ValueError(f"fpar.ops.swiglu: gate {list(gate.shape)} and up {list(up.shape)} differ in shape.")
    return _SwiGLU.apply(gate, up)


class _SwiGLU(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(gate: Tensor, up: Tensor) -> Tensor:
        return F.silu(gate) * up

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, Tensor | None]:
        gate, up = ctx.saved_tensors
        g_gate = torch.ops.aten.silu_backward(g * up, gate) if ctx.needs_input_grad[0] else None
        g_up = g * F.silu(gate) if ctx.needs_input_grad[1] else None
        return g_gate, g_up
