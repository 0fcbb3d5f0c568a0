"""Argument checks shared by the layers: each raises a message naming the layer, the rule and a fix.

Every layer validates at its boundary, before any collective, so all devices fail the same way.
Shapes seen inside ``fpar.shard`` are per-device blocks; messages say so, because a wrong block
shape almost always means a parameter was given the wrong ``fpar.P``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from .._collectives import axis_size as _axis_size

Tensor = torch.Tensor


def axis_size(api: str, axis) -> int:
    """Return the size of mesh axis ``axis``; raises outside ``fpar.shard`` or for an unknown axis."""
    if not (
        isinstance(axis, str) or (isinstance(axis, tuple) and axis and all(isinstance(a, str) for a in axis))
    ):
        raise TypeError(
            f"fpar.ops.{api}: axis must be a mesh axis name (or a tuple of names), got {axis!r}; "
            f"e.g. {api}(..., axis='tensor')."
        )
    return _axis_size(axis)  # UnboundAxisError outside fpar.shard / for an unknown axis


def tensor(api: str, name: str, x, *, ndim: int | None = None, min_ndim: int | None = None) -> Tensor:
    """Check that ``x`` is a tensor of the given rank."""
    if not isinstance(x, Tensor):
        raise TypeError(f"fpar.ops.{api}: {name} must be a torch.Tensor, got {type(x).__name__}.")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(
            f"fpar.ops.{api}: {name} must have rank {ndim}, got shape {tuple(x.shape)} (rank {x.dim()})."
        )
    if min_ndim is not None and x.dim() < min_ndim:
        raise ValueError(f"fpar.ops.{api}: {name} must have rank >= {min_ndim}, got shape {tuple(x.shape)}.")
    return x


def floating(api: str, name: str, x: Tensor) -> Tensor:
    """Check that ``x`` has a floating dtype."""
    if not x.is_floating_point():
        raise TypeError(f"fpar.ops.{api}: {name} must be a floating-point tensor, got dtype {x.dtype}.")
    return x


def integer(api: str, name: str, x) -> Tensor:
    """Check that ``x`` is an integer tensor (token ids, targets)."""
    tensor(api, name, x)
    if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
        raise TypeError(
            f"fpar.ops.{api}: {name} must be an integer tensor of token ids, got dtype {x.dtype}; "
            f"convert with {name}.long()."
        )
    return x


def same(api: str, what: str, a: int, b: int, hint: str) -> None:
    """Check that two sizes agree; ``hint`` says how to fix it."""
    if a != b:
        raise ValueError(f"fpar.ops.{api}: {what} ({a} != {b}). {hint}")


def params(
    api: str,
    p,
    required: Sequence[str],
    optional: Sequence[str] = (),
    specs_fn: str = "",
    *,
    leaves: bool = True,
) -> None:
    """Check that a parameter dict has the required keys and no unknown ones (and, if ``leaves``, tensors)."""
    if not isinstance(p, Mapping):
        raise TypeError(f"fpar.ops.{api}: params must be a dict of tensors, got {type(p).__name__}.")
    missing = [k for k in required if k not in p]
    unknown = [k for k in p if k not in required and k not in optional]
    if missing or unknown:
        hint = (
            f" Build them with fpar.init(fpar.ops.init_{specs_fn}(...), mesh, fpar.ops.{specs_fn}_specs(axis))."
            if specs_fn
            else ""
        )
        raise ValueError(
            f"fpar.ops.{api}: params has keys {sorted(p)}; expected {list(required)}"
            f"{f' and optionally {list(optional)}' if optional else ''}"
            f"{f' (missing {missing})' if missing else ''}{f' (unknown {unknown})' if unknown else ''}.{hint}"
        )
    for k in p if leaves else ():
        if not isinstance(p[k], Tensor):
            raise TypeError(f"fpar.ops.{api}: params[{k!r}] must be a tensor, got {type(p[k]).__name__}.")


def divisible(api: str, what: str, size: int, n: int, hint: str) -> None:
    """Check that ``size`` is divisible by ``n``."""
    if size % n:
        raise ValueError(f"fpar.ops.{api}: {what} = {size} is not divisible by {n}. {hint}")
