"""Communication accounting: bytes each collective moves, per device, per mesh axis.

Bytes are what one device sends under the standard ring algorithms, computed from the
per-device block size ``S`` (bytes) and the (combined) axis size ``n``:

| collective | bytes sent per device |
|---|---|
| psum / pmean / pmax / pmin (all-reduce) | 2 (n-1)/n S |
| all_gather | (n-1) S  (= (n-1)/n of the gathered result) |
| psum_scatter (reduce-scatter) | (n-1)/n S |
| all_to_all | (n-1)/n S |
| ppermute | S x (pairs / n), the average over the devices of the axis |
| broadcast (a ``check_rep=False`` output, real mesh) | (n-1)/n S (a pipelined chain) |
| send / recv (point-to-point, real mesh) | S sent / S received, by this process |

**Real mesh: counted where issued.**  Every process-group call fpar makes is counted once, when
it is issued, with the buffer it sends: each collective of ``_dist/exchange.py`` (forward, and
the backward's transposes when the backward actually runs them), each bucketed gradient
all-reduce (one ``psum`` call per bucket, with the bucket's bytes, also when it carries the sum
of microbatches deferred by ``fpar.defer_reduction``), and every point-to-point send and receive
(the pipeline executor).  ZeRO-3's backward re-gathers are counted when the backward uses them
(a prefetch it does not use is issued but not counted).  Not counted: the real mesh's per-call
signature check (a 16-byte all-reduce of a hash, fpar's own control traffic, not the program's)
and ``fpar.gather``'s all-gathers (data leaving the mesh, as ``device_put``'s enters it).

**In-process mesh: the same model, no messages.**  All devices live in one process, so nothing
is sent; each collective is counted at its API on the logical block and each transpose (the
gradient all-reduce of a replicated value, JAX's implicit pvary, appears as ``psum``) when the
forward creates it, so the in-process mesh reports the bytes the real mesh sends.  The one
difference is the number of calls of the bucketed gradient all-reduces: one per replicated
tensor in-process, one per bucket on a real mesh (the bytes are the same).
"""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from collections.abc import Iterator

import torch
from torch._C._functorch import get_unwrapped, is_gradtrackingtensor, maybe_get_level

from ._sums import wire_itemsize

__all__ = ["comm_stats", "record", "reset_comm_stats"]

_LOCK = threading.Lock()
_STATS: dict[str, dict[str, dict[str, int]]] = defaultdict(
    lambda: defaultdict(lambda: {"calls": 0, "bytes": 0})
)

TRANSPOSE = {
    "psum": None,  # pvary: no communication
    "pmean": None,
    "pmax": "psum",  # the backward shares the extreme among its holders: a psum of the mask
    "pmin": "psum",
    "all_gather": "psum_scatter",
    "all_gather_invariant": None,  # transpose: keep one's own block
    "psum_scatter": "all_gather",
    "ppermute": "ppermute",
    "all_to_all": "all_to_all",
    "pvary": "psum",
}


def bytes_sent(kind: str, n: int, block_bytes: int, pairs: int | None = None) -> int:
    """Bytes one device sends for ``kind`` over an axis of size ``n`` (see the module table)."""
    if n == 1:
        return 0
    if kind in ("psum", "pmean", "pmax", "pmin"):
        return 2 * (n - 1) * block_bytes // n
    if kind in ("all_gather", "all_gather_invariant"):
        return (n - 1) * block_bytes
    if kind in ("psum_scatter", "all_to_all"):
        return (n - 1) * block_bytes // n
    if kind == "ppermute":
        return block_bytes * (pairs if pairs is not None else n) // n
    if kind == "broadcast":
        return (n - 1) * block_bytes // n
    raise ValueError(kind)


def record(
    kind: str,
    axes: tuple[str, ...],
    n: int,
    block: torch.Tensor,
    pairs: int | None = None,
    *,
    overlap: bool = False,
) -> None:
    """Count one call of ``kind`` on a per-device block ``block``.

    ``overlap``: issued asynchronously, to overlap with compute (gradient buckets, ZeRO's
    prefetches and reduce-scatters); only ``fpar.plan``'s time model reads it.
    """
    record_numel(kind, axes, n, block.numel(), block.dtype, pairs, overlap=overlap)


def record_numel(
    kind: str,
    axes: tuple[str, ...],
    n: int,
    numel: int,
    dtype: torch.dtype,
    pairs: int | None = None,
    *,
    overlap: bool = False,
) -> None:
    """``record`` of a block of ``numel`` elements of ``dtype`` that no tensor holds.

    For a message whose block is not a tensor of its own (a whole leaf of which each rank sends
    pieces): a tensor made only to be counted, a meta one too, would be memory to ``fpar.plan``'s
    recorder, alive at once beside the buffer it describes.
    """
    nbytes = numel * wire_itemsize(kind, dtype)  # fp16/bf16 sums: their float32 wire
    _add(kind, axes, bytes_sent(kind, n, nbytes, pairs), overlap=overlap, n=n)


def record_bytes(kind: str, axes: tuple[str, ...], n: int, nbytes: int, *, overlap: bool = False) -> None:
    """Count one call of ``kind`` on a per-device block of ``nbytes`` bytes."""
    _add(kind, axes, bytes_sent(kind, n, nbytes, None), overlap=overlap, n=n)


def record_p2p(axis: str, kind: str, nbytes: int) -> None:
    """Count one point-to-point ``"send"`` or ``"recv"`` of ``nbytes`` along ``axis``."""
    _add(kind, (axis,), nbytes, n=2)


_PAUSED = [0]  # > 0 inside ``uncounted()``


@contextlib.contextmanager
def uncounted() -> Iterator[None]:
    """Count nothing inside (``fpar.gather`` on a real mesh: data leaving the mesh, not the program's)."""
    _PAUSED[0] += 1
    try:
        yield
    finally:
        _PAUSED[0] -= 1


# Called with every counted call: ``(kind, axes, bytes, n, overlap)`` (``fpar.plan`` times them).
LISTENERS: list = []


def _add(
    kind: str, axes: tuple[str, ...], nbytes: int, *, overlap: bool = False, n: int | None = None
) -> None:
    if _PAUSED[0]:
        return
    with _LOCK:
        entry = _STATS[",".join(axes)][kind]
        entry["calls"] += 1
        entry["bytes"] += nbytes
    for listen in LISTENERS:
        listen(kind, tuple(axes), nbytes, n, overlap)


def comm_stats() -> dict[str, dict[str, dict[str, int]]]:
    """Return the bytes sent per device so far: ``{axes: {collective: {"calls", "bytes"}}}``.

    ``axes`` is the axis name, or the names joined by commas for a tuple of axes.  Forward and
    backward traffic both count; reset with ``fpar.reset_comm_stats()``.

    Example:
      >>> fpar.reset_comm_stats(); step(params, batch); fpar.comm_stats()["data"]["psum"]["bytes"]
    """
    with _LOCK:
        return {ax: {k: dict(v) for k, v in kinds.items()} for ax, kinds in _STATS.items()}


def reset_comm_stats() -> None:
    """Forget all counts."""
    with _LOCK:
        _STATS.clear()


def count_transpose(
    x: torch.Tensor, kind: str, axes: tuple[str, ...], n: int, pairs: int | None = None
) -> None:
    """Record the traffic of ``kind``'s transpose if a gradient will flow back through ``x``.

    Counted when the forward runs (a custom Function whose backward counted would cost a
    Python dispatch through every vmap level per call, several ms on small models).  "Will
    flow" means ``x`` is tracked by a grad transform or requires grad.
    """
    if TRANSPOSE[kind] is not None and x.is_floating_point() and _tracked(x):
        nbytes = x.numel() * wire_itemsize(TRANSPOSE[kind], x.dtype)
        _add(TRANSPOSE[kind], axes, bytes_sent(TRANSPOSE[kind], n, nbytes, pairs))


def _tracked(t: torch.Tensor) -> bool:
    while True:
        if is_gradtrackingtensor(t) and t.requires_grad:
            return True
        if maybe_get_level(t) == -1:
            return t.requires_grad
        t = get_unwrapped(t)
