"""One low-precision copy of a stage's weights per step, shared by every microbatch in flight.

A stage function that keeps float32 master weights casts them to its compute dtype
(``w.to(torch.bfloat16)``, as ``fpar.plan.model_step`` does), and autograd saves the cast for the
matmul's backward: a stage with ``k`` microbatches in flight would hold ``k`` copies of its
weights (Llama 3's interleaved schedule keeps up to 143 chunk-microbatches on stage 0).  While a
stage runs a forward with gradients, ``Tensor.to(dtype)`` (or ``.bfloat16()``, ``.half()``) of
one of the chunk's parameter leaves, or of a view of one, returns the step's one cast of those
elements: made at the first microbatch's use, shared by every later one, and dropped as the
chunk's last backward starts (its graph's saved views then free it as that backward goes).  Only
for a chunk the schedule keeps two or more microbatches of in flight: with one, a shared cast
would live through each backward where a microbatch's own is freed layer by layer; and not
under recomputation, whose forward runs without gradients and saves no cast.  Parameters do not
change during a step, so the values are the same as a cast per microbatch, and the shared cast's
backward is the cast's own (the gradient converted to the parameter's dtype, then accumulated
there): values and gradients are bit for bit those of a copy per microbatch.  ``torch.autocast``
keeps a cache of weight casts within one forward; this one lasts the step.

Not shared: casts inside a ``torch.func`` transform (the in-process mesh's ``vmap``) or a compiled
region, where the tensors are not the leaves' own; they are made per use as before.
"""

from __future__ import annotations

from typing import Any

import torch

from .._compile import untraced

__all__ = ["Casts"]

Tensor = torch.Tensor
_SHORTHANDS = {Tensor.bfloat16: torch.bfloat16, Tensor.half: torch.float16}


class Casts:
    """The casts of one chunk's parameter leaves made during a step (see the module's note).

    Args:
      leaves: the chunk's parameter leaves (floating-point ones are shared).
    """

    def __init__(self, leaves: list) -> None:
        self.storages = {_storage(t) for t in leaves if isinstance(t, Tensor) and t.is_floating_point()}
        self.storages.discard(None)
        self.made: dict[tuple, Tensor] = {}

    def __call__(self, func: Any, args: tuple, kwargs: dict) -> Tensor | None:
        """The shared cast for a ``Tensor.to``-style call on a leaf's elements, or ``None`` (not one)."""
        dtype = _target(func, args, kwargs)
        if dtype is None:
            return None
        t = args[0]
        if not (t.is_floating_point() and dtype.is_floating_point and dtype != t.dtype):
            return None
        storage = _storage(t)
        if storage not in self.storages:
            return None
        if not (t.requires_grad and torch.is_grad_enabled()):
            return None  # nothing saves it (recomputation's forward runs without grad): not shared
        key = (storage, t.storage_offset(), tuple(t.shape), t.stride(), dtype)
        cast = self.made.get(key)
        if cast is None:
            with torch.no_grad():
                cast = self.made[key] = t.to(dtype)
        return _Shared.apply(t, cast)

    def clear(self) -> None:
        self.made.clear()


def _target(func: Any, args: tuple, kwargs: dict) -> torch.dtype | None:
    """The dtype of ``t.to(dtype)``, ``t.to(dtype=dtype)``, ``t.bfloat16()``, ``t.half()``; else ``None``."""
    if not args or not isinstance(args[0], Tensor):
        return None
    if func in _SHORTHANDS and len(args) == 1 and not kwargs:
        return _SHORTHANDS[func]
    if func is not Tensor.to:
        return None
    if len(args) == 2 and isinstance(args[1], torch.dtype) and not kwargs:
        return args[1]
    if len(args) == 1 and set(kwargs) == {"dtype"} and isinstance(kwargs["dtype"], torch.dtype):
        return kwargs["dtype"]
    return None


def _storage(t: Tensor) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # no plain storage (a subclass, a functorch wrapper)
        return None


@untraced
class _Shared(torch.autograd.Function):
    """``x.to(cast.dtype)`` that returns the shared ``cast`` (a view of it); the backward is the cast's."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, cast: Tensor) -> Tensor:
        ctx.dtype = x.dtype
        return cast.view_as(cast)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        return g.to(ctx.dtype), None
