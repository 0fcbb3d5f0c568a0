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
parameter is in flight; with ``zero_layout``'s ``units``, one unit: gathering a parameter starts
its unit's other saved parameters too, in the order they were tracked (the same on every rank).

In-process, all devices live in one process and the gathered value is a view of the stacked
chunks, so the token keeps it (nothing to free) and the re-gather is counted, not performed:
``fpar.comm_stats`` reports the same traffic on both meshes.

Saved-tensor hooks are refused by ``torch.func`` transforms ("don't yet support saved tensor
hooks"), so this path differentiates with ``torch.autograd.grad``; under an outer
``torch.func`` transform (or inside a ``torch.func`` transform in the loss) ``zero_grads``
falls back to ``remat``.

The real mesh's whole stage-3 schedule (``gathered_grad``) is in ``_zero_fsdp``.

This module talks to ``torch.distributed`` directly for the asynchronous collectives (no
exchange of ``fpar._dist`` is asynchronous): the process group and member order come from the
mesh's groups, as in ``fpar._dist``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
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
    """The identity of ``t``'s storage, or ``None``.

    Not its data pointer: meta storages, and storages resized to 0 bytes while a parameter is
    not gathered, all have data pointer 0.
    """
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # no plain storage (a subclass, sparse, ...)
        return None


@dataclasses.dataclass(eq=False)
class _Param:
    """One gathered parameter of this forward: where it lives and how to gather it again."""

    chunk: Tensor  # this device's chunk (physical, flattened; in-process: every device's)
    nbytes: int  # one device's chunk's bytes (what comm_stats counts; no meta tensor: fpar.plan
    # runs on meta tensors and would count it as memory)
    left: int = 0  # its saved views the backward has not unpacked yet
    storage: Tensor | None = None  # re-gathered, while ``left`` views still need it
    live: bool = False  # in-process: counted as re-gathered, while ``left`` views still need it
    gather: Callable[[], Any] | None = None  # a stacked leaf's row: how to gather it (``RowGather``)
    leaf: int | None = None  # ... and its leaf (counted once a backward, as the whole leaf)
    alive: Tensor | None = None  # in-process: the tracked tensor (its storage's identity not reused)
    unit: Any = None  # its unit (``zero_layout``'s ``units``): gathered with the unit's others
    seq: int = 0  # the order it was tracked in (a unit's gathers start in this order on every rank)


@dataclasses.dataclass(eq=False)
class _Saved:
    """What autograd keeps instead of a view of a gathered parameter."""

    param: _Param
    index: int  # position among this forward's saved parameter views
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    kept: Tensor | None  # in-process: the tensor itself
    unpacked: bool = False


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
        self._inflight: dict[int, _Pending] = {}  # id of a _Param -> its prefetched gather
        self._todo: set[_Param] = set()  # saved parameters the backward has not gathered yet
        self._counted: set[int] = set()  # stacked leaves whose rows' re-gathers are counted

    def track(self, chunk: Tensor, full: Tensor, *, flat: bool = False, unit: Any = None) -> None:
        """Remember that ``full`` (inside shard) was all-gathered from ``chunk`` over the axis.

        ``flat``: ``full`` is known to view a flat gathered buffer (its storage may hold 0 bytes now).
        ``unit``: the parameter's unit: the backward gathers the unit's saved parameters together.
        """
        c, f = _physical(chunk).detach().reshape(-1), _physical(full)
        key = _storage_key(f)
        if key is None:
            return
        whole = flat or f.untyped_storage().nbytes() == self.n * c.numel() * c.element_size()
        if self.groups is not None and not whole:
            return  # not the flat gathered buffer a re-gather rebuilds: autograd keeps it
        self._params[key] = _Param(
            c,
            chunk.numel() * chunk.element_size(),
            alive=f if self.groups is None else None,
            unit=unit,
            seq=len(self._params),
        )

    def track_row(
        self, row: Tensor, leaf: int, nbytes: int, gather: Callable[[], Any], unit: Any = None
    ) -> None:
        """Remember that ``row`` (its own buffer) is a row of stacked leaf ``leaf`` (``RowGather``).

        ``nbytes``: the leaf's chunk's bytes; ``gather()`` starts gathering the row into a new buffer.
        """
        self._params[_storage_key(row)] = _Param(  # type: ignore[index]
            row, nbytes, gather=gather, leaf=leaf, unit=unit, seq=len(self._params)
        )

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
        param.left += 1
        if param.left == 1:
            self._todo.add(param)
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
        param = x.param
        param.left -= 1
        x.unpacked = True
        if self.groups is None:
            if not param.live:  # the same count as a real mesh's (below)
                _stats.record_bytes("all_gather", (self.axis,), self.n, param.nbytes, overlap=True)
            param.live = param.left > 0
            return x.kept
        storage = param.storage
        if storage is None:
            self._todo.discard(param)
            # Counted as the all-gather it is (the forward's own gather is counted by
            # fpar.all_gather): (N-1) x one device's chunk; a stacked leaf's rows once, as the leaf.
            if param.leaf not in self._counted:
                _stats.record_bytes("all_gather", (self.axis,), self.n, param.nbytes, overlap=True)
            if param.leaf is not None:
                self._counted.add(param.leaf)
            pending = self._inflight.pop(id(param), None)
            if pending is None:  # not prefetched: its unit's others start with it
                pending = self._start(param)
                self._start_unit(param)
            storage = pending.wait()
        # One re-gather a parameter a backward: it stays gathered until its last saved view is
        # unpacked.  A parameter saved by several nodes (a stacked leaf, each layer saving its
        # slice, as remat saves its inputs) would otherwise be gathered whole once a node.
        param.storage = storage if param.left > 0 else None
        self._prefetch(x.index)
        return storage.as_strided(x.size, x.stride, x.offset)

    def _prefetch(self, index: int) -> None:
        """Start gathering the next parameter the backward will need, unless one is in flight.

        That is the parameter of the nearest view saved before ``index`` (the backward unpacks
        them in about reverse order) that is neither unpacked nor gathered already.
        """
        if self._inflight or not self._todo:
            return
        for j in range(index - 1, -1, -1):
            saved = self._saved[j]
            if not saved.unpacked and saved.param in self._todo:
                self._todo.discard(saved.param)
                self._inflight[id(saved.param)] = self._start(saved.param)
                self._start_unit(saved.param)
                return

    def _start_unit(self, param: _Param) -> None:
        """Start gathering the saved parameters of ``param``'s unit the backward has not gathered yet."""
        if param.unit is None:
            return
        others = sorted((q for q in self._todo if q.unit == param.unit), key=lambda q: q.seq)
        for q in others:  # in tracking order: every rank issues the same gathers in the same order
            self._todo.discard(q)
            self._inflight[id(q)] = self._start(q)

    def _start(self, param: _Param) -> Any:
        return param.gather() if param.gather is not None else _Pending.start(param, self.groups, self.axis)

    def close(self) -> None:
        """Wait for a prefetch the backward did not use (e.g. a gradient not asked for)."""
        for pending in self._inflight.values():
            pending.wait()
        self._inflight.clear()
        for saved in self._saved:  # views the backward never unpacked (a gradient not asked for)
            saved.param.storage = None


class _Pending:
    """An asynchronous all-gather of one parameter's chunks into a buffer shaped like its storage."""

    def __init__(self, work, bufs: list[Tensor] | None, out: Tensor):
        self.work, self.bufs, self.out = work, bufs, out

    @classmethod
    def start(cls, param: _Param, groups: Any, axis: str, out: Tensor | None = None) -> _Pending:
        """Start gathering ``param``'s chunks into ``out`` (a new flat buffer if ``None``)."""
        return cls.gather(param.chunk, groups, axis, out)

    @classmethod
    def gather(cls, chunk: Tensor, groups: Any, axis: str, out: Tensor | None = None) -> _Pending:
        """Start gathering every data rank's ``chunk`` (flat) into ``out``, in mesh order (a new buffer if ``None``)."""
        import torch.distributed as dist

        from .._dist.exchange import all_gather_single

        group, members = groups.group((axis,)), groups.members((axis,))
        n = len(members)
        ordered = [dist.get_group_rank(group, r) for r in members] == list(range(n))
        if out is None:
            out = torch.empty(n * chunk.numel(), dtype=chunk.dtype, device=chunk.device)
        if ordered:
            work = all_gather_single(out, chunk, group=group, async_op=True)
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
