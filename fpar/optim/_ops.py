"""Elementwise maths on lists of tensors: ``torch._foreach_*`` where it applies, else per leaf.

The foreach kernels process a whole list per launch (much faster for many small leaves) but
have no ``vmap`` batching rule, so inside ``fpar.shard`` (and under any ``torch.func``
transform, or with autograd) every function here falls back to ordinary per-tensor ops with
the same arithmetic.  Scalars ``s`` may be Python numbers or 0-d tensors.

**Donation.**  Inside ``with donation():`` (``fpar.optim.zero_update(..., donate=True)`` on a
real mesh) the tensors given to a transformation's ``update`` (updates, state, params) belong
to it: a function called with ``inplace=True`` writes its result into its first list and
returns that list (the same kernels as the functional form, so the same values, without a
second copy of the state).  On tensors that are not plain (vmap'd in-process, or needing
autograd) ``inplace`` is ignored and the result is new, so donation is a permission, never a
requirement.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from ._internal import is_plain

__all__ = [
    "add",
    "addcmul",
    "adam_direction",
    "donating",
    "donation",
    "lerp",
    "mul",
    "sum_squares",
    "where",
    "writable",
]

Tensor = torch.Tensor
_LOCAL = threading.local()


@contextlib.contextmanager
def donation(on: bool = True) -> Iterator[None]:
    """Let (``on``) or forbid the transformations' updates run in place on their inputs (this thread)."""
    before = getattr(_LOCAL, "on", False)
    _LOCAL.on = on
    try:
        yield
    finally:
        _LOCAL.on = before


def donating() -> bool:
    """Whether the running ``update`` may overwrite the tensors it was given (see ``donation``)."""
    return getattr(_LOCAL, "on", False)


def writable(xs: list[Tensor]) -> bool:
    """Whether an ``update`` may write into ``xs`` now: donated, and each a dense buffer of its own.

    Autograd may hand out one gradient tensor for two parameters, or a stride-0 expansion; a
    write into those would change another leaf too, so such lists are never written in place.
    """
    if not donating() or torch.compiler.is_compiling():
        # Compiled: a traced tensor has no address to compare (Dynamo cannot trace data_ptr
        # arithmetic); the update runs out of place, the same values, and the compiled graph
        # reuses its own buffers.
        return False
    spans = []
    for x in xs:
        if not isinstance(x, Tensor) or not x.is_contiguous():
            return False
        # meta tensors (fpar.plan's) have no addresses: their storage and offset stand in for one
        where, start = (x.untyped_storage()._cdata, x.storage_offset()) if x.is_meta else (0, x.data_ptr())
        start *= x.element_size() if x.is_meta else 1
        spans.append((where, start, start + x.numel() * x.element_size()))
    spans.sort()
    return all(a[0] != b[0] or a[2] <= b[1] for a, b in zip(spans, spans[1:]))


def _scalar(s, like: Tensor):
    return s.to(like.dtype) if isinstance(s, Tensor) else s


def mul(xs: list[Tensor], s, *, inplace: bool = False) -> list[Tensor]:
    """``x * s`` for each x (into ``xs`` with ``inplace``)."""
    if xs and is_plain(xs) and (not isinstance(s, Tensor) or is_plain([s])):
        if inplace:
            torch._foreach_mul_(xs, s)
            return xs
        return list(torch._foreach_mul(xs, s))
    return [x * _scalar(s, x) for x in xs]


def add(xs: list[Tensor], ys: list[Tensor], alpha: float = 1.0, *, inplace: bool = False) -> list[Tensor]:
    """``x + alpha * y`` for each pair (into ``xs`` with ``inplace``)."""
    if xs and is_plain(xs + ys):
        if inplace:
            torch._foreach_add_(xs, ys, alpha=alpha)
            return xs
        return list(torch._foreach_add(xs, ys, alpha=alpha))
    return [x + alpha * y if alpha != 1.0 else x + y for x, y in zip(xs, ys)]


def lerp(xs: list[Tensor], ys: list[Tensor], w: float, *, inplace: bool = False) -> list[Tensor]:
    """``x + w (y - x)`` for each pair (``torch.lerp``, as torch.optim uses; into ``xs`` with ``inplace``)."""
    if xs and is_plain(xs + ys):
        if inplace:
            torch._foreach_lerp_(xs, ys, w)
            return xs
        return list(torch._foreach_lerp(xs, ys, w))
    return [torch.lerp(x, y, w) for x, y in zip(xs, ys)]


def addcmul(
    xs: list[Tensor], ys: list[Tensor], zs: list[Tensor], value: float, *, inplace: bool = False
) -> list[Tensor]:
    """``x * 1 + value * y * z`` for each triple (into ``xs`` with ``inplace``)."""
    if xs and is_plain(xs + ys + zs):
        if inplace:
            torch._foreach_addcmul_(xs, ys, zs, value=value)
            return xs
        return list(torch._foreach_addcmul(xs, ys, zs, value=value))
    return [torch.addcmul(x, y, z, value=value) for x, y, z in zip(xs, ys, zs)]


def adam_direction(
    mu: list[Tensor],
    nu: list[Tensor],
    bc1: Tensor,
    bc2: Tensor,
    eps: float,
    *,
    into: list[Tensor] | None = None,
) -> list[Tensor]:
    """``(mu / bc1) / (sqrt(nu) / sqrt(bc2) + eps)``: Adam's bias-corrected step direction.

    ``into``: write the result into these (donated) buffers, leaf by leaf, instead of two new
    temporaries the size of the state (the same kernels, so the same values).
    """
    if mu and is_plain(mu + nu):
        if into is not None and is_plain(into):
            root_bc2 = torch.sqrt(bc2)
            for m, v, d in zip(mu, nu, into):
                torch.sqrt(v, out=d)
                d.div_(root_bc2)
                d.add_(eps)
                torch.div(m, d, out=d)
                d.div_(bc1)
            return into
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
