"""Ops timed on this machine: ``hardware="this"``'s measured cost table.

A step's ops are timed here once per signature (the op, its tensors' shapes, strides and dtypes,
its other arguments), on CPU tensors of those layouts: floating tensors hold values in [0.5, 1.5)
(never uninitialised memory, whose denormals would time a slow path, nor negatives, whose square
roots are NaNs that cost ten times as much), integer tensors zeros (valid indices and targets),
booleans ``False``.  The seconds kept are the median of a few calls, less
what the timing loop itself costs per call (a one-element add's time): the kernel's own time.
The step's per-op framework cost (autograd's bookkeeping, Python) is ``Hardware.op_overhead``,
added by the time model to every op.

Ops that cannot be timed here are costed by the roofline, and counted: an op too large for this
machine (``max_bytes`` of inputs and outputs), one whose arguments cannot be keyed or rebuilt, or
one that fails on CPU for these arguments.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from typing import Any

import torch

__all__ = ["OpTimer", "reset", "timer"]

Tensor = torch.Tensor


class OpTimer:
    """Seconds of an op's kernel on this machine, timed once per call signature and kept."""

    def __init__(self, *, max_bytes: int = 1 << 28, repeats: int = 5, budget: float = 0.05):
        self.max_bytes = max_bytes
        self.repeats = repeats
        self.budget = budget  # seconds of timing per signature at most (beyond one call)
        self.table: dict = {}  # signature -> kernel seconds
        self.untimed: Counter = Counter()  # op name -> calls costed by the roofline instead
        self.threads: int | None = None  # threads the ops are timed with (None: this process's)
        self._floor: float | None = None

    def seconds(self, func, args, kwargs, key, nbytes: int) -> float | None:
        """The kernel seconds of ``func(*args, **kwargs)`` (meta tensors) here; None: not timed."""
        if key is None or nbytes > self.max_bytes:
            self.untimed[str(func.overloadpacket)] += 1
            return None
        key = (key, self.threads)  # an op's time depends on the threads it runs with
        got = self.table.get(key)
        if got is None and key not in self.table:
            got = self.table[key] = self._time(func, args, kwargs)
        if got is None:
            self.untimed[str(func.overloadpacket)] += 1
        return got

    def floor(self) -> float:
        """What the timing loop costs per call of an op that does nothing worth timing."""
        if self._floor is None:
            a, b = torch.ones(1), torch.ones(1)
            self._floor = _median_call(torch.ops.aten.add.Tensor, (a, b), {}, 31, 1.0)
        return self._floor

    def _time(self, func, args, kwargs) -> float | None:
        before = torch.get_num_threads()
        try:
            if self.threads is not None:  # as the job's processes will run it
                torch.set_num_threads(self.threads)
            real_args, real_kwargs = _materialize(args), _materialize(kwargs)
            t = _median_call(func, real_args, real_kwargs, self.repeats, self.budget)
        except Exception:  # noqa: BLE001 - an op this CPU cannot run with these arguments
            return None
        finally:
            torch.set_num_threads(before)
        return max(t - self.floor(), 0.0)


_EVICT: list = []


def _evict() -> None:
    """Write over a core's caches (4 MB: its L2 and more), as a step's other ops do between two uses."""
    if not _EVICT:
        _EVICT.append(torch.empty(1 << 20))
    _EVICT[0].fill_(1.0)


_TABLE: list = []


def timer() -> OpTimer:
    """This process's table of ops timed here (kept across estimates: a search repeats the ops)."""
    if not _TABLE:
        _TABLE.append(OpTimer())
    return _TABLE[0]


def reset() -> None:
    """Start a new table (a new measurement of this machine: time its ops afresh)."""
    _TABLE.clear()


def _median_call(func, args, kwargs, repeats: int, budget: float) -> float:
    func(*args, **kwargs)  # warm: allocator, one-time kernel setup
    times = []
    spent = 0.0
    while len(times) < repeats and (spent < budget or len(times) < 1):
        _evict()  # a step's op finds its inputs in the shared cache or memory, not in its own core's
        t = time.perf_counter()
        func(*args, **kwargs)
        dt = time.perf_counter() - t
        times.append(dt)
        spent += dt
    return statistics.median(times)


def _materialize(tree: Any) -> Any:
    """Meta tensors -> CPU tensors of the same layout and plausible values; the rest as is."""
    if isinstance(tree, Tensor):
        return _real(tree) if tree.device.type == "meta" else tree
    if isinstance(tree, (list, tuple)):
        return type(tree)(_materialize(x) for x in tree) if not hasattr(tree, "_fields") else tree
    if isinstance(tree, dict):
        return {k: _materialize(v) for k, v in tree.items()}
    if isinstance(tree, torch.device) and tree.type == "meta":
        return torch.device("cpu")
    return tree


_GEN = torch.Generator().manual_seed(0)


def _real(t: Tensor) -> Tensor:
    extent = t.storage_offset() + 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s > 0)
    if t.numel() == 0:
        extent = t.storage_offset()
    if t.dtype.is_floating_point or t.dtype.is_complex:
        # in [0.5, 1.5): a square root, log or division of optimizer state takes its usual path
        # (a NaN from a negative input costs ~10x on x86); a generator of its own: torch's
        # default one is the user's (and fpar.shard checks it).  Drawn in [0.55, 1.45): a draw
        # just under 1.5 rounds to 1.5 in bfloat16
        base = torch.rand(extent, generator=_GEN).mul_(0.9).add_(0.55).to(t.dtype)
    else:
        base = torch.zeros(extent, dtype=t.dtype)
    out = base.as_strided(t.shape, t.stride(), t.storage_offset())
    return out.requires_grad_(False)
