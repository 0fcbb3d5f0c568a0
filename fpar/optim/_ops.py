"""Elementwise maths on lists of tensors: ``torch._foreach_*`` where it applies, else per leaf.

The foreach kernels process a whole list per launch (much faster for many small leaves) but
have no ``vmap`` batching rule, so inside ``fpar.shard`` (and under any ``torch.func``
transform, or with autograd) every function here falls back to ordinary per-tensor ops with
the same arithmetic.  Scalars ``s`` may be Python numbers or 0-d tensors.
"""

from __future__ import annotations

import torch

from ._internal import is_plain

__all__ = ["add", "addcmul", "adam_direction", "lerp", "mul", "sum_squares", "where"]

Tensor = torch.Tensor


def _scalar(s, like: Tensor):
    return s.to(like.dtype) if isinstance(s, Tensor) else s


def mul(xs: list[Tensor], s) -> list[Tensor]:
    """``x * s`` for each x."""
    if xs and is_plain(xs) and (not isinstance(s, Tensor) or is_plain([s])):
        return list(torch._foreach_mul(xs, s))
    return [x * _scalar(s, x) for x in xs]


def add(xs: list[Tensor], ys: list[Tensor], alpha: float = 1.0) -> list[Tensor]:
    """``x + alpha * y`` for each pair."""
    if xs and is_plain(xs + ys):
        return list(torch._foreach_add(xs, ys, alpha=alpha))
    return [x + alpha * y if alpha != 1.0 else x + y for x, y in zip(xs, ys)]


def lerp(xs: list[Tensor], ys: list[Tensor], w: float) -> list[Tensor]:
    """``x + w (y - x)`` for each pair (``torch.lerp``, as torch.optim uses)."""
    if xs and is_plain(xs + ys):
        return list(torch._foreach_lerp(xs, ys, w))
    return [torch.lerp(x, y, w) for x, y in zip(xs, ys)]


def addcmul(xs: list[Tensor], ys: list[Tensor], zs: list[Tensor], value: float) -> list[Tensor]:
    """``x * 1 + value * y * z`` for each triple."""
    if xs and is_plain(xs + ys + zs):
        return list(torch._foreach_addcmul(xs, ys, zs, value=value))
    return [torch.addcmul(x, y, z, value=value) for x, y, z in zip(xs, ys, zs)]


def adam_direction(mu: list[Tensor], nu: list[Tensor], bc1: Tensor, bc2: Tensor, eps: float) -> list[Tensor]:
    """``(mu / bc1) / (sqrt(nu) / sqrt(bc2) + eps)``: Adam's bias-corrected step direction."""
    if mu and is_plain(mu + nu):
        denom = torch._foreach_sqrt(nu)
        torch._foreach_div_(denom, torch.sqrt(bc2))  # a 0-d tensor: no host sync on GPU
        torch._foreach_add_(denom, eps)
        out = torch._foreach_div(mu, denom)
        torch._foreach_div_(out, bc1)
        return list(out)
    return [
        (m / (torch.sqrt(v) / torch.sqrt(bc2).to(v.dtype) + eps)) / bc1.to(m.dtype) for m, v in zip(mu, nu)
    ]


def sum_squares(xs: list[Tensor]) -> list[Tensor]:
    """``sum(x**2)`` of each tensor, as 0-d tensors."""
    if xs and is_plain(xs):
        return [n * n for n in torch._foreach_norm(xs)]
    return [(x * x).sum() for x in xs]


def where(cond: Tensor, xs: list[Tensor], ys: list[Tensor]) -> list[Tensor]:
    """``cond ? x : y`` for each pair (``cond`` a 0-d bool tensor)."""
    return [torch.where(cond, x, y) for x, y in zip(xs, ys)]
