"""Communication accounting: bytes each collective moves, per device, per mesh axis.

Counts are what one device sends under the standard ring algorithms, computed from the
per-device block size ``S`` (bytes) and the (combined) axis size ``n``:

| collective | bytes sent per device |
|---|---|
| psum / pmean / pmax / pmin (all-reduce) | 2 (n-1)/n S |
| all_gather | (n-1) S  (= (n-1)/n of the gathered result) |
| psum_scatter (reduce-scatter) | (n-1)/n S |
| all_to_all | (n-1)/n S |
| ppermute | S x (pairs / n), the average over the devices of the axis |

Both backends count at the same place (the collective's API on the logical block, and an
identity whose backward records the transpose), so the in-process mesh reports exactly what
the real mesh would send.  Backward traffic is recorded under the transpose's kind: the
gradient all-reduce of a replicated parameter (JAX's implicit pvary) appears as ``psum``.
"""

from __future__ import annotations

import threading
from collections import defaultdict

import torch

from ._registry import internal

__all__ = ["comm_stats", "record", "reset_comm_stats"]

_LOCK = threading.Lock()
_STATS: dict[str, dict[str, dict[str, int]]] = defaultdict(
    lambda: defaultdict(lambda: {"calls": 0, "bytes": 0})
)

TRANSPOSE = {
    "psum": None,  # pvary: no communication
    "pmean": None,
    "pmax": None,
    "pmin": None,
    "all_gather": "psum_scatter",
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
    if kind == "all_gather":
        return (n - 1) * block_bytes
    if kind in ("psum_scatter", "all_to_all"):
        return (n - 1) * block_bytes // n
    if kind == "ppermute":
        return block_bytes * (pairs if pairs is not None else n) // n
    raise ValueError(kind)


def record(kind: str, axes: tuple[str, ...], n: int, block: torch.Tensor, pairs: int | None = None) -> None:
    """Count one call of ``kind`` on a per-device block ``block``."""
    _add(kind, axes, bytes_sent(kind, n, block.numel() * block.element_size(), pairs))


def _add(kind: str, axes: tuple[str, ...], nbytes: int) -> None:
    with _LOCK:
        entry = _STATS[",".join(axes)][kind]
        entry["calls"] += 1
        entry["bytes"] += nbytes


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


@internal
class CountTranspose(torch.autograd.Function):
    """Identity whose backward records the traffic of the transpose of ``kind``.

    ``block_bytes`` is the per-device size, taken where the caller sees the logical block;
    the backward may run on physical (stacked) tensors, so it does not measure ``ct``.
    """

    generate_vmap_rule = False

    @staticmethod
    def forward(x, kind, axes, n, pairs, block_bytes):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.args = inputs[1:]

    @staticmethod
    def backward(ctx, ct):
        kind, axes, n, pairs, block_bytes = ctx.args
        _add(TRANSPOSE[kind], axes, bytes_sent(TRANSPOSE[kind], n, block_bytes, pairs))
        return ct, None, None, None, None, None

    @staticmethod
    def jvp(ctx, x_t, *_):
        return x_t

    @staticmethod
    def vmap(info, in_dims, x, *args):
        return CountTranspose.apply(x, *args), in_dims[0]


def count_transpose(x: torch.Tensor, kind: str, axes: tuple[str, ...], n: int, pairs: int | None = None):
    """``x``, recording the transpose's traffic when a gradient flows back through it."""
    if TRANSPOSE[kind] is None or not x.is_floating_point():
        return x
    return CountTranspose.apply(x, kind, axes, n, pairs, x.numel() * x.element_size())
