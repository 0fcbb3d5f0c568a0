"""A signature's first (traced) call under ``fpar.defer_reduction()``: its input sums as a steady call's.

The traced call (``tracker.py``) sums each replicated input's cotangent in the ``_Planned`` node it
entered through.  Inside the context that would reduce the traced microbatch at once while the
steady ones defer; ``traced_sums`` gives those nodes the same deferred buffers instead (and,
outside the context, the check that deferred sums of the same function are claimed).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch._C import _functorch

from .. import _defer
from .buckets import _buckets, _deferral_key, _open
from .exchange import _Exchange
from .groups import MeshGroups

__all__ = ["traced_sums"]

Tensor = torch.Tensor


def traced_sums(
    sources: list[tuple[int, Tensor, tuple[str, ...]]],
    mg: MeshGroups,
    bucket_mb: float,
    *,
    owner: tuple,
    fname: str,
    kept: dict | None = None,
    layouts: dict | None = None,
) -> dict[int, Callable[[Tensor], Tensor | None]]:
    """A traced call's input-source sums inside ``fpar.defer_reduction()``: deferred, as a steady call's.

    (Outside it, with deferred sums of the same sharded function open: summed at once, after
    queueing the check of ``_defer.watch_unclaimed``; a new signature never claims them.)

    A signature's first call runs traced (``tracker.py``): each replicated input's cotangent is
    summed by the ``_Planned`` node it entered through, once the plan is known.  Summed at once
    inside the context, a step whose first microbatch traced would add its gradients in another
    order than the same step of steady calls, which defer every microbatch's and reduce the sum:
    ``(a0+b0)+(a1+b1)`` against ``(a0+a1)+(b0+b1)``, a last-bit difference that made a resumed
    run (whose first step traces) differ from the uninterrupted one.  So a traced call adds into
    the very same deferred buffers, keyed as ``reduce_inputs`` keys them.  Called with the plan's
    sources after the forward, it returns, per input slot, what its ``_Planned`` backward does
    with the cotangent (``{}``: sum at once).  A traced call is never the final call of deferred
    sums: those were deferred by earlier calls of the same plan, so the plan had traced already.
    """
    scope = _defer.current()
    if not torch.is_grad_enabled():
        return {}
    if scope is None:  # a new signature's call cannot claim deferred sums: watch those of its function
        if not _defer._LIVE:
            return {}
        mine = [(slot, x) for slot, x, _ in sources]
        queue = _defer.watch_unclaimed(owner[0], fname, owner[1], mine)
        if queue is None:
            return {}
        return {slot: functools.partial(_watched, queue, axes, mg) for slot, _, axes in sources}
    buckets = _buckets([s for s in sources if s[1].grad_fn is None], bucket_mb, mg, layouts)
    key, bases = _deferral_key(buckets, owner)
    if key is None:
        return {}
    held = _open(scope, fname, key, bases, buckets, kept)
    firsts = [True] * len(buckets)  # a call's first cotangent in a bucket counts as its add

    def deferred(b: int, i: int, metas: list, ct: Tensor) -> Tensor | None:
        held.add_one(b, i, ct, metas, firsts[b])
        firsts[b] = False
        if scope._expanded_zeros and _functorch.get_interpreter_stack():
            return _defer.deferred_zeros(*metas[i])  # as ``_Defer``: accumulate skips it
        return None

    out: dict[int, Callable[[Tensor], Tensor | None]] = {}
    for b, (layout, xs) in enumerate(buckets):
        metas = [(x.shape, x.dtype, x.device) for x in xs]
        out.update((slot, functools.partial(deferred, b, i, metas)) for i, slot in enumerate(layout.slots))
    return out


def _watched(queue: Callable[[], None], axes: tuple[str, ...], mg: MeshGroups, ct: Tensor) -> Tensor:
    """A traced call's input sum, at once, after queueing ``_defer.watch_unclaimed``'s check."""
    queue()
    return _Exchange.apply(ct, "psum", (), 0, axes, mg)
