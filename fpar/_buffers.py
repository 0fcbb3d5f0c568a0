"""Buffers kept across calls and handed out again once nothing holds them (as DDP's buckets).

A step that writes its gradients into fresh memory touches new pages every time: for the 8 MB
of a D=512 MLP's gradients that costs 1-2 ms on a CPU, as much as the arithmetic.  The buffers
here are kept by their owner (a plan's gradient buckets, a pipeline's stacked gradients,
``fpar.optim.accumulate``'s means) and reused only when the storage count says that nothing
else refers to them any more: the caller dropped the gradients made of them.  A buffer still
held, by a tensor, a view, a work handle or an array over it, is never written again.
"""

from __future__ import annotations

import torch

__all__ = ["block", "contiguous_strides", "kept_or_new", "pooled", "unheld"]

Tensor = torch.Tensor


def unheld(buf: Tensor) -> bool:
    """Whether nothing but ``buf`` itself refers to its memory.

    The storage's use count includes the storage object asked for here, hence 2.
    """
    return torch._C._storage_Use_Count(buf.untyped_storage()._cdata) == 2


def kept_or_new(old: Tensor | None, shape: tuple, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``old`` when it fits and nothing but it holds its memory any more, else a new buffer."""
    if (
        old is not None
        and (tuple(old.shape), old.dtype, old.device) == (tuple(shape), dtype, device)
        and unheld(old)
    ):
        return old
    return torch.empty(shape, dtype=dtype, device=device)


def pooled(pool: list, like: Tensor, size: int = 2) -> Tensor:
    """An uninitialised tensor laid out as ``like``: one of ``pool``'s when nothing holds it.

    ``pool`` keeps up to ``size`` buffers, so a caller that still holds the last result while
    asking for the next (``g = step(g)``) alternates between two instead of touching new memory.
    """
    meta = (like.shape, like.stride(), like.dtype, like.device)
    for kept in pool:
        if (kept.shape, kept.stride(), kept.dtype, kept.device) == meta and unheld(kept):
            return kept.detach()
    buf = torch.empty_like(like)
    if len(pool) < size:
        # Kept as an alias (a tensor of its own on the same storage): the caller's reference to
        # the tensor handed out then counts in the storage's use.  Keeping that very tensor would
        # hide it, and a result still held would be written again.
        pool.append(buf.detach())
    return buf


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (as ``torch.empty(shape).stride()``)."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def block(
    flat: Tensor, offset: int, shape: tuple[int, ...], strides: tuple[int, ...] | None = None
) -> Tensor:
    """``flat[offset : offset + numel].view(shape)`` of a 1-D contiguous ``flat``, as one op.

    A slot of a flat buffer (a gradient bucket's, a message's), taken on every call of a step:
    ``as_strided`` costs ~3 us where the slice (or ``narrow``) and the ``view`` cost ~9.
    ``strides``: ``contiguous_strides(shape)``, when the caller keeps it.
    """
    if strides is None:
        strides = contiguous_strides(shape)
    return flat.as_strided(shape, strides, flat.storage_offset() + offset)
