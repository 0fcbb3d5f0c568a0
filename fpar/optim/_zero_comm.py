"""ZeRO-3's backward re-gather: keep no gathered parameter from the forward to the backward.

FSDP2's pattern, for an arbitrary per-device loss: the forward all-gathers each parameter from
the chunks (``fpar.all_gather``, whose transpose is the gradient's reduce-scatter); whenever
autograd *saves* a tensor that lives in a gathered parameter's storage (a matmul saving its
weight for the input's gradient), a saved-tensor hook stores a small token instead (this
device's chunk, and the view's size, stride and offset); when the backward unpacks the token,
the parameter is all-gathered again and the view rebuilt on it.  So the gathered parameters
are freed when the forward ends, the forward runs once (no recomputation, unlike ``remat``),
and the backward re-gathers exactly the parameters autograd needs: per device
``(N-1)/N x (bytes of the saved parameters)``, at most ``(N-1)/N Psi`` (a bias, or a weight
whose input needs no gradient, is never saved, so never re-gathered).

Prefetch (real mesh): unpacking the token saved ``i``-th in the forward starts the
all-gather of the one saved just before it (the backward visits them in about reverse order)
asynchronously, so it travels while this layer's backward computes; a token whose gather was
prefetched waits on it, one that was not gathers on the spot.  At most one prefetched
parameter is in flight.

In-process, all devices live in one process and the gathered value is a view of the stacked
chunks, so the token keeps it (nothing to free) and the re-gather is counted, not performed:
``fpar.comm_stats`` reports the same traffic on both meshes.

Saved-tensor hooks are refused by ``torch.func`` transforms ("don't yet support saved tensor
hooks"), so this path differentiates with ``torch.autograd.grad``; under an outer
``torch.func`` transform (or inside a ``torch.func`` transform in the loss) ``zero_grads``
falls back to ``remat``.

This module talks to ``torch.distributed`` directly for the asynchronous all-gather (no
exchange of ``fpar._dist`` is asynchronous): the process group and member order come from the
mesh's groups, as in ``fpar._dist``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torch._C._functorch import get_unwrapped, is_batchedtensor, maybe_current_level

from .. import _stats

__all__ = ["Regather", "regather_supported"]

Tensor = torch.Tensor


def regather_supported() -> bool:
    """Whether the hook-based re-gather can run here (not under a ``torch.func`` transform)."""
    return maybe_current_level() is None


def _physical(t: Tensor) -> Tensor:
    """The plain tensor under the mesh's vmap levels (what autograd sees and saves)."""
    while is_batchedtensor(t):
        t = get_unwrapped(t)
    return t


def _storage_key(t: Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # no plain storage (a subclass, sparse, ...)
        return None


@dataclasses.dataclass(eq=False)
class _Param:
    """One gathered parameter of this forward: where it lives and how to gather it again."""

    chunk: Tensor  # this device's chunk (physical, flattened; in-process: every device's)
    block: Tensor  # one device's chunk as a meta tensor (what comm_stats counts)


@dataclasses.dataclass(eq=False)
class _Saved:
    """What autograd keeps instead of a view of a gathered parameter."""

    param: _Param
    index: int  # position among this forward's saved parameter views
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    kept: Tensor | None  # in-process: the tensor itself


class Regather:
    """Drops the gathered parameters autograd saves in one forward, and gathers them in backward.

    Use: ``track(chunk, full)`` for each parameter gathered inside ``fpar.shard``, run the forward
    inside ``with regather.hooks():``, then differentiate with ``torch.autograd``.  One object
    per forward (it remembers that forward's saves).
    """

    def __init__(self, mesh: Any, axis: str):
        self.axis = axis
        self.n = mesh.shape[axis]
        self.groups = mesh._dist if mesh.backend == "dist" else None
        self._params: dict[int, _Param] = {}
        self._saved: list[_Saved] = []
        self._inflight: dict[int, _Pending] = {}  # saved index -> its prefetched gather

    def track(self, chunk: Tensor, full: Tensor) -> None:
        """Remember that ``full`` (inside shard) was all-gathered from ``chunk`` over the axis."""
        c, f = _physical(chunk).detach().reshape(-1), _physical(full)
        key = _storage_key(f)
        if key is None:
            return
        if self.groups is not None and f.untyped_storage().nbytes() != self.n * c.numel() * c.element_size():
            return  # not the flat gathered buffer a re-gather rebuilds: autograd keeps it
        self._params[key] = _Param(c, torch.empty(chunk.shape, dtype=chunk.dtype, device="meta"))

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        """Replace saved views of tracked parameters by tokens while the forward runs."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def _pack(self, t: Tensor) -> Any:
        key = _storage_key(t) if self._params else None
        param = self._params.get(key) if key is not None else None
        if param is None:
            return t
        saved = _Saved(
            param,
            len(self._saved),
            tuple(t.size()),
            tuple(t.stride()),
            t.storage_offset(),
            None if self.groups is not None else t,
        )
        self._saved.append(saved)
        return saved

    def _unpack(self, x: Any) -> Tensor:
        if not isinstance(x, _Saved):
            return x
        # Counted as the all-gather it is on a real mesh (the forward's own gather is counted by
        # fpar.all_gather): (N-1) x one device's chunk.
        _stats.record("all_gather", (self.axis,), self.n, x.param.block)
        if self.groups is None:
            return x.kept
        pending = self._inflight.pop(x.index, None)
        storage = (pending or self._start(x.param)).wait()
        self._prefetch(x.index)
        return storage.as_strided(x.size, x.stride, x.offset)

    def _prefetch(self, index: int) -> None:
        """Start gathering the parameter saved just before ``index``, unless one is in flight."""
        if self._inflight or index == 0:
            return
        self._inflight[index - 1] = self._start(self._saved[index - 1].param)

    def _start(self, param: _Param) -> _Pending:
        return _Pending.start(param, self.groups, self.axis)

    def close(self) -> None:
        """Wait for a prefetch the backward did not use (e.g. a gradient not asked for)."""
        for pending in self._inflight.values():
            pending.wait()
        self._inflight.clear()


class _Pending:
    """An asynchronous all-gather of one parameter's chunks into a buffer shaped like its storage."""

    def __init__(self, work, bufs: list[Tensor] | None, out: Tensor):
        self.work, self.bufs, self.out = work, bufs, out

    @classmethod
    def start(cls, param: _Param, groups: Any, axis: str) -> _Pending:
        import torch.distributed as dist

        group, members = groups.group((axis,)), groups.members((axis,))
        chunk = param.chunk
        n = len(members)
        ordered = [dist.get_group_rank(group, r) for r in members] == list(range(n))
        out = torch.empty(n * chunk.numel(), dtype=chunk.dtype, device=chunk.device)
        if ordered:
            work = dist.all_gather_single(out, chunk, group=group, async_op=True)
            return cls(work, None, out)
        bufs = [torch.empty_like(chunk) for _ in range(n)]
        work = dist.all_gather(bufs, chunk, group=group, async_op=True)
        return cls(work, [bufs[dist.get_group_rank(group, r)] for r in members], out)

    def wait(self) -> Tensor:
        """The gathered storage (the padded flat parameter, as the forward's gather made it)."""
        self.work.wait()
        if self.bufs is not None:
            torch.cat(self.bufs, out=self.out)
        return self.out
