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

**The real mesh: FSDP's schedule (``gathered_grad``).**  There the whole stage-3 gradient is
driven from here, so that each parameter is gathered just before its first use and each
gradient is reduce-scattered as soon as it exists.  Every parameter's gathered buffer exists
from the start, with a storage of 0 bytes (FSDP2's ``resize_``); each enters the loss as one
copy per data rank (``P(data, ...)``, as stage 2), a leaf of autograd viewing that buffer.
The forward runs under ``_Lazy``, a ``TorchFunctionMode``: the first op that reads a parameter
(or a view of it) waits for its all-gather, which was started one parameter ahead in the order
the previous forward of the same shapes first used them; once as many ops have read it as
read it in that forward, its storage is freed again.  So the forward holds the parameter in
use and the next one (FSDP2's units, a leaf each), not the whole model.  The first forward of a
signature knows no counts: it frees each parameter after its first read and gathers it again if it
is read again (counted; most parameters are read once), so that a first step fits where the
steady ones do (the first-use order it learns is what later forwards prefetch by).  Autograd saves no gathered
value (the saved-tensor hooks above replace each by a token and the backward re-gathers it).
Autograd accumulates a leaf's gradient as soon as it is complete (``AccumulateGrad`` runs
before any other ready node), and its post-accumulate hook starts an asynchronous
reduce-scatter of it right away, which travels while the rest of the backward computes; the
step waits on them all at the end.  (Through ``fpar.all_gather``'s transpose instead, every
reduce-scatter would wait for the end of the backward: the gather nodes are the oldest in the
graph, and autograd runs ready nodes newest first, so the full-size gradients of every
parameter would pile up.)  The same sums, the same values; ``comm_stats`` counts the same
collectives as the in-process path (every parameter gathered once a forward).

A stacked leaf (``[layers, ...]``, a scanned model's) taken by its rows (``w.unbind(0)``, ``w[r]``)
is gathered a row at a time (``_zero_rows.RowGather``): each row has a buffer of its own that
``_Lazy`` and the backward's re-gather treat as a parameter of its own, and each row's gradient is
reduced as soon as it is made.  So a unit is a layer's slice of each stacked leaf, as FSDP2's is
the layer's module.  ``comm_stats`` counts the leaf, as the in-process mesh does: one all-gather a
forward, one re-gather a backward if any row was saved, one reduce-scatter.  The buffers (the
leaves' and the rows') are made once a signature and hold bytes only while gathered.

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
from torch.overrides import TorchFunctionMode

from .. import _defer, _stats
from .._sums import widened
from .._tree import tree_flatten, tree_unflatten
from ._zero_rows import RowGather, _InFlight

__all__ = ["Regather", "Uses", "gathered_grad", "regather_supported"]

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

    def track(self, chunk: Tensor, full: Tensor, *, flat: bool = False) -> None:
        """Remember that ``full`` (inside shard) was all-gathered from ``chunk`` over the axis.

        ``flat``: ``full`` is known to view a flat gathered buffer (its storage may hold 0 bytes now).
        """
        c, f = _physical(chunk).detach().reshape(-1), _physical(full)
        key = _storage_key(f)
        if key is None:
            return
        whole = flat or f.untyped_storage().nbytes() == self.n * c.numel() * c.element_size()
        if self.groups is not None and not whole:
            return  # not the flat gathered buffer a re-gather rebuilds: autograd keeps it
        self._params[key] = _Param(
            c, chunk.numel() * chunk.element_size(), alive=f if self.groups is None else None
        )

    def track_row(self, row: Tensor, leaf: int, nbytes: int, gather: Callable[[], Any]) -> None:
        """Remember that ``row`` (its own buffer) is a row of stacked leaf ``leaf`` (``RowGather``).

        ``nbytes``: the leaf's chunk's bytes; ``gather()`` starts gathering the row into a new buffer.
        """
        self._params[_storage_key(row)] = _Param(row, nbytes, gather=gather, leaf=leaf)  # type: ignore[index]

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
            storage = (pending or self._start(param)).wait()
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
                return

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
        import torch.distributed as dist

        from .._dist.exchange import all_gather_single

        group, members = groups.group((axis,)), groups.members((axis,))
        chunk = param.chunk
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


def gathered_grad(
    objective,
    layout: Any,
    chunks: Any,
    batch: Any,
    scale: Tensor,
    compute_dtype,
    uses: Uses | None = None,
    hold: Any = None,
) -> tuple[Any, Tensor]:
    """Stage 3's gradient on a real mesh with FSDP's schedule (see the module docstring).

    Args:
      objective: ``(params, batch, scale) -> (scaled loss, loss)``, a sharded function taking
        each rank's whole parameter block as its own copy (in_specs varying over the data axis).
      layout: the stage-3 ``ZeroLayout``.
      chunks: this process's parameter chunks (the stored stage-3 parameters).
      batch: the batch, as ``objective`` takes it.
      scale: the loss scale (0-d).
      compute_dtype: gather and reduce-scatter in this dtype (``None``: the chunks' own).
      uses: what the previous forward of this signature did with each parameter (when it was
        first and last used), updated by this one; ``None``: nothing known, nothing kept.
      hold: a ``_zero_once.Held``: each gradient is added into it, unreduced, instead of being
        reduce-scattered (``reduce_once``); ``grads`` is then ``None``.

    Returns:
      ``(grads, loss)``: this process's chunk of each reduced gradient, and the loss.
    """
    import torch.distributed as dist

    from .._dist.exchange import _in_group_order, _ordered, reduce_scatter_single

    uses = Uses() if uses is None else uses
    axis, n = layout.data_axis, layout.n
    groups = layout.mesh._dist
    group, members = groups.group((axis,)), groups.members((axis,))
    # gloo's reduce_scatter_single copies its whole input first; its list form does not.
    direct = _ordered(members, group) and dist.get_backend(group) != "gloo"
    leaves, treedef = tree_flatten(chunks)
    cast = [c if compute_dtype is None or not c.is_floating_point() else c.to(compute_dtype) for c in leaves]
    flat = [c.detach().reshape(-1) for c in cast]
    params = [_Param(f, f.numel() * f.element_size()) for f in flat]
    rg = Regather(layout.mesh, axis)
    gathered: list[Tensor] = []
    done: dict[int, Any] = {}  # leaf -> its reduced chunk (an _InFlight until waited on)
    inflight: list[int] = []

    def reduce_scatter(i: int, leaf: Tensor) -> None:
        if i in rows.reached:  # its rows went on their own; this is what reached it otherwise
            rows.add_whole(i, leaf.grad)
            leaf.grad = None
            return
        if hold is not None:  # summed unreduced, reduced once a step (``_zero_once``)
            g, leaf.grad = leaf.grad, None
            hold.add(i, g)
            return
        g, leaf.grad = leaf.grad.reshape(-1), None
        pad = n * flat[i].numel() - g.numel()
        g = torch.cat([g, g.new_zeros(pad)]) if pad else g.contiguous()
        for j in inflight:  # at most one in flight (as FSDP2): then its full gradient is freed
            done[j] = done[j].wait()
        inflight.clear()
        # fp16/bf16 summed in float32 and rounded once (fpar's rule; FSDP2's bf16 reduce-scatter
        # under fpar.low_precision_sums("native")), counted as sent
        low = g.dtype if widened(g.dtype) else None
        _stats.record("psum_scatter", (axis,), n, g, overlap=True)
        g = g.float() if low is not None else g
        out = torch.empty(flat[i].shape, dtype=g.dtype, device=g.device)
        groups.group((axis,))  # as every collective fpar issues: held messages go first (pending.py)
        if direct:
            work = reduce_scatter_single(out, g, group=group, async_op=True)
        else:
            parts = _in_group_order(list(g.chunk(n)), members, group)
            work = dist.reduce_scatter(out, parts, group=group, async_op=True)
        done[i] = _InFlight(work, out, g, low)  # g stays alive until the collective is done with it
        inflight.append(i)

    # Every gathered parameter has its buffer and its leaf from the start, but the buffer's
    # storage holds 0 bytes until the forward's first op on it (or on a view of it): ``_Lazy``
    # gathers it then, one ahead, and frees it after its last use (FSDP2's units, a leaf each).
    # The buffers are made once a signature (each then holds bytes only while gathered).
    if not uses.bufs:
        for i, lf in enumerate(layout.leaves):
            full = torch.empty(n * flat[i].numel(), dtype=flat[i].dtype, device=flat[i].device)
            uses.views.append(full[: lf.numel].view(lf.block))
            _resize(full, 0)
            uses.bufs.append(full)
    nleaves = len(layout.leaves)
    bufs = uses.bufs
    for i in range(nleaves):
        # The leaf autograd accumulates into (AccumulateGrad runs as soon as the gradient is
        # complete; a node between it and its uses would run only at the end of the backward).
        leaf = uses.views[i].detach().requires_grad_(True)
        leaf.register_post_accumulate_grad_hook(lambda a, i=i: reduce_scatter(i, a))
        rg.track(flat[i], leaf, flat=True)
        gathered.append(leaf)

    def start(j: int) -> Any:
        # the gather writes the buffer in place: not a change autograd must know of (``_resize``)
        with torch.autograd._unsafe_preserve_version_counter(bufs[j]):
            _resize(bufs[j], bufs[j].numel() * bufs[j].element_size())
            if j >= nleaves:  # a stacked leaf's row (its gather counted as the leaf's, ``taken``)
                return rows.gather_row(*row_of[j], bufs[j].view(-1))
            _stats.record_bytes("all_gather", (axis,), n, params[j].nbytes, overlap=True)
            return _Pending.start(params[j], groups, axis, out=bufs[j])

    # A stacked leaf (``[layers, ...]``) taken by its rows (``unbind``, ``t[r]``): a row at a time
    # (``_zero_rows.RowGather``), each row a buffer of its own, gathered and freed as a leaf is.
    row_of = {j: ir for ir, j in uses.rows.items()}

    def track(j: int) -> None:
        i, r = row_of[j]
        rg.track_row(bufs[j], i, params[i].nbytes, lambda: rows.gather_row(i, r))

    def row(i: int, r: int) -> Tensor:
        j = uses.rows.get((i, r))
        if j is None:  # first taken: its buffer, kept for the next forwards
            b = flat[i].new_empty(layout.leaves[i].block[1:])
            _resize(b, 0)
            bufs.append(b)
            j = uses.rows[(i, r)] = len(bufs) - 1
            row_of[j] = (i, r)
            lazy.add(b)
            track(j)
        return bufs[j]

    def taken(i: int) -> None:  # the leaf's gather, counted once a forward (its rows travel instead)
        if not lazy.taken_by_rows(i):
            _stats.record_bytes("all_gather", (axis,), n, params[i].nbytes, overlap=True)

    rows = RowGather(gathered, [f.numel() for f in flat], flat, groups, axis, row, taken)
    rows.hold = hold
    for j in range(nleaves, len(bufs)):
        track(j)
    lazy = _Lazy(bufs, start, uses, nleaves)
    try:
        # Not deferred under fpar.optim.accumulate's defer_reduction(): the gathered leaves are new
        # tensors every microbatch, so a later microbatch could never claim their sums over the
        # axes they are replicated on (a tensor axis); this gradient is reduce-scattered now anyway.
        with torch.enable_grad(), rg.hooks(), _defer.suspended():
            with lazy, rows:
                scaled, loss = objective(tree_unflatten(treedef, gathered), batch, scale)
            # Free what the forward still holds: autograd keeps the leaves, never their values
            # (every saved view of one is a re-gather token).
            lazy.finish()
        torch.autograd.backward(scaled, inputs=gathered)
    finally:
        lazy.finish(complete=False)  # a forward that raised: its gathers in flight end, no new ones
        rg.close()
        for j in inflight:
            done[j] = done[j].wait()
        inflight.clear()
        rows.wait()
        uses.by_rows = set(rows.reached)
        outs = rows.release()
    if hold is not None:
        return None, loss.detach()
    grads = []
    for i, c in enumerate(leaves):
        got = done.get(i, outs.get(i))
        grads.append(got.to(c.dtype) if got is not None else torch.zeros_like(c))
    return tree_unflatten(treedef, grads), loss.detach()


def _resize(t: Tensor, nbytes: int) -> None:
    """Give ``t``'s storage ``nbytes`` bytes (0: free them; ``t`` and its views stay valid objects).

    An op, so ``fpar.plan``'s recorder sees the bytes come and go (FSDP2's way too).  Not a change
    autograd must know of (its version counter is kept): no saved view of a gathered buffer exists
    (each is a re-gather token), and a view made before (the traced call's identity on an input)
    must stay usable after the buffer was freed and gathered again.
    """
    with torch.autograd._unsafe_preserve_version_counter(t):
        torch.ops.inductor.resize_storage_bytes_(t, nbytes)


@dataclasses.dataclass
class Uses:
    """What one forward of a signature did with each stage-3 parameter (``_Lazy``).

    The order in which they were first used, and how many ops read each (views not counted).
    """

    first: list[int] = dataclasses.field(default_factory=list)
    reads: dict[int, int] = dataclasses.field(default_factory=dict)
    # The gathered buffers, made once (each holds 0 bytes but while gathered): the leaves' flat
    # buffers and their leaves' views, then stacked leaves' rows (``RowGather``) as first taken.
    bufs: list[Tensor] = dataclasses.field(default_factory=list)
    views: list[Tensor] = dataclasses.field(default_factory=list)
    rows: dict[tuple[int, int], int] = dataclasses.field(default_factory=dict)  # (leaf, row) -> buffer
    by_rows: set[int] = dataclasses.field(default_factory=set)  # leaves taken by rows last time


# Reading these reads no parameter's values (no all-gather for them).
_METADATA = frozenset(
    {
        "shape", "dtype", "device", "requires_grad", "ndim", "is_leaf", "grad_fn", "layout",
        "size", "dim", "numel", "nelement", "ndimension", "element_size", "stride",
        "storage_offset", "is_contiguous", "is_floating_point", "is_complex", "get_device",
        "__len__", "requires_grad_", "register_hook", "register_post_accumulate_grad_hook",
        "untyped_storage", "data_ptr", "is_sparse", "is_sparse_csr", "is_cuda", "is_cpu", "is_meta",
        "is_mkldnn", "is_quantized", "is_nested", "is_inference", "is_mps", "is_xpu", "_version",
        "names", "itemsize", "nbytes", "is_conj", "is_neg", "is_signed", "_is_view", "device_type",
    }
)  # fmt: skip


def _metadata(func: Any) -> bool:
    name = getattr(func, "__name__", None)
    if name == "__get__":  # a property: Tensor.shape.__get__ and the like
        name = getattr(getattr(func, "__self__", None), "__name__", None)
    return name in _METADATA


class _Lazy(TorchFunctionMode):
    """Stage 3's forward on a real mesh, a parameter at a time: FSDP2's units, one leaf each.

    Each gathered parameter's buffer starts with a storage of 0 bytes.  The first op that takes
    it, or any view of it (found by its storage), waits for its all-gather (started one ahead,
    in the order the previous forward of this signature first used them, at first in leaf
    order).  Once as many ops have read it as read it in the previous forward (once, in a
    signature's first forward; an op whose outputs are all views of it reads nothing), its
    storage is freed again.  So the forward
    holds the parameter in use and the next one, not the whole model.  A forward that reads a
    parameter more often (its ops depend on values) gathers it again, counted: never a wrong
    value, only more traffic; the next forward learns.  Reading metadata (shape, dtype, ...)
    gathers nothing.  Every parameter is gathered once per forward, used or not, as the
    in-process mesh and ``fpar.plan`` count.
    """

    def __init__(self, fulls: list[Tensor], start: Callable[[int], Any], uses: Uses, leaves: int):
        super().__init__()
        self.fulls, self.start, self.uses, self.leaves = list(fulls), start, uses, leaves
        self.keys = {_storage_key(f): i for i, f in enumerate(fulls)}
        n = len(fulls)
        seen = set(uses.first)
        # Rows (indices from ``leaves`` on) only as the last forward first used them; a leaf taken
        # by its rows last time is not gathered whole ahead of its use.
        skip = seen | uses.by_rows
        self.order = [i for i in uses.first if i < n] + [i for i in range(leaves) if i not in skip]
        self.ready = [False] * n
        self.gathered = [False] * n  # gathered in this forward (a later gather is a re-gather)
        self.pending: dict[int, _Pending] = {}
        self.next = 0  # position in ``order`` of the next parameter to prefetch
        self.first: list[int] = []
        self.reads: dict[int, int] = {}
        self.learning = not uses.first  # no forward of this signature ran yet: one read each assumed
        if n:
            self._prefetch()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        hit = () if _metadata(func) else self._hits((args, kwargs))
        for i in hit:
            self._ready(i)
        out = func(*args, **kwargs)
        if hit:
            made = self._hits(out)
            for i in hit:
                if made == (i,):  # a view of the parameter (or an in-place op on it): no read
                    continue
                self.reads[i] = self.reads.get(i, 0) + 1
                if self.reads[i] == self.uses.reads.get(i, 1 if self.learning else None):
                    self._free(i)
        return out

    def add(self, full: Tensor) -> int:
        """One more buffer (a stacked leaf's row, first taken in this forward); its index."""
        self.keys[_storage_key(full)] = len(self.fulls)
        self.fulls.append(full)
        self.ready.append(False)
        self.gathered.append(False)
        return len(self.fulls) - 1

    def taken_by_rows(self, i: int) -> bool:
        """Leaf ``i`` is taken by its rows: never gathered whole for that; whether it was already."""
        was = self.gathered[i] or i in self.pending
        pending = self.pending.pop(i, None)
        if pending is not None:  # prefetched whole (the first forward knows no better): freed
            self._wait(i, pending)
            self._free(i)
            self._prefetch()
        self.gathered[i] = True
        return was

    def _hits(self, tree: Any) -> tuple[int, ...]:
        found: list[int] = []
        stack = [tree]
        while stack:
            x = stack.pop()
            if isinstance(x, Tensor):
                i = self.keys.get(_storage_key(x))
                if i is not None and i not in found:
                    found.append(i)
            elif isinstance(x, (list, tuple)):
                stack.extend(x)
            elif isinstance(x, dict):
                stack.extend(x.values())
        return tuple(found)

    def _ready(self, i: int) -> None:
        if self.ready[i]:
            return
        pending = self.pending.pop(i, None) or self.start(i)
        self._wait(i, pending)
        if i not in self.first:
            self.first.append(i)
        self._prefetch()

    def _wait(self, i: int, pending: _Pending) -> None:
        # the gather writes the buffer in place: not a change autograd must know of (no saved
        # view of it exists before its first use)
        with torch.autograd._unsafe_preserve_version_counter(self.fulls[i]):
            pending.wait()
        self.ready[i] = self.gathered[i] = True

    def _prefetch(self) -> None:
        """Start the next parameter's all-gather in the expected order, unless one is in flight."""
        if self.pending:
            return
        while self.next < len(self.order):
            j = self.order[self.next]
            self.next += 1
            if not self.gathered[j] and not self.ready[j]:
                self.pending[j] = self.start(j)
                return

    def _free(self, i: int) -> None:
        self.ready[i] = False
        _resize(self.fulls[i], 0)

    def finish(self, *, complete: bool = True) -> None:
        """End the forward: free every parameter, and remember this forward's uses for the next.

        ``complete``: gather the parameters it never used first (each once a forward, as the
        in-process mesh and the planner count); ``False`` after an error: no new gathers.
        """
        if complete:  # every leaf gathered once (rows not taken need no gather)
            self.order[self.next :] = [j for j in self.order[self.next :] if j < self.leaves]
            while self.pending or self.next < len(self.order):
                if not self.pending:
                    self._prefetch()
                for i, pending in list(self.pending.items()):
                    del self.pending[i]
                    self._wait(i, pending)
                    self._prefetch()
        for i, pending in list(self.pending.items()):
            del self.pending[i]
            self._wait(i, pending)
        for i in range(len(self.fulls)):
            if self.ready[i]:
                self._free(i)
        if complete:
            self.uses.first, self.uses.reads = self.first, self.reads
