"""ZeRO-3 on a real mesh with FSDP's schedule: a parameter gathered at its first use, freed after its last.

On a real mesh the whole stage-3 gradient is driven from here (``gathered_grad``), so that
each parameter is gathered just before its first use and each gradient is reduce-scattered as
soon as it exists.  Every parameter's gathered buffer exists from the start, with a storage of
0 bytes (FSDP2's ``resize_``); each enters the loss as one copy per data rank (``P(data, ...)``,
as stage 2), a leaf of autograd viewing that buffer.  The forward runs under ``_Lazy``, a
``TorchFunctionMode``: the first op that reads a parameter (or a view of it) waits for its
all-gather, which was started one parameter ahead in the order the previous forward of the same
shapes first used them; once as many ops have read it as read it in that forward, its storage
is freed again.  So the forward holds the parameter in use and the next one (FSDP2's units, a
leaf each), not the whole model.  The first forward of a signature knows no counts: it frees
each parameter after its first read and gathers it again if it is read again (counted; most
parameters are read once), so that a first step fits where the steady ones do (the first-use
order it learns is what later forwards prefetch by).  Autograd saves no gathered value
(``_zero_comm.Regather``'s saved-tensor hooks replace each by a token and the backward
re-gathers it).
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

The backward's re-gather (``Regather``) and the asynchronous gather (``_Pending``) are ``_zero_comm``'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from .. import _defer, _stats
from .._compile import graph_break
from .._sums import widened
from .._tree import tree_flatten, tree_unflatten
from ._zero_comm import Regather, _Param, _Pending, _storage_key
from ._zero_rows import RowGather, _InFlight

__all__ = ["Uses", "gathered_grad"]

Tensor = torch.Tensor


def gathered_grad(
    objective: Callable[..., tuple[Tensor, Tensor]],
    layout: Any,
    chunks: Any,
    batch: Any,
    scale: Tensor,
    compute_dtype: torch.dtype | None,
    uses: Uses | None = None,
    hold: Any = None,
    into: list[Tensor] | None = None,
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
      hold: a ``_zero_micro.Held``: each gradient is added into it, unreduced, instead of being
        reduce-scattered (``reduce_once``); ``grads`` is then ``None``.
      into: this process's summed chunks of the microbatches before (the parameters' dtype):
        each reduced chunk is added into its sum as its reduce-scatter ends, and the sums are
        returned (``_zero_micro.summed_sharded``).

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

    def finish(j: int) -> None:
        got = done[j].wait()
        done[j] = into[j].add_(got) if into is not None else got  # the reduced chunk freed at once

    def reduce_scatter(i: int, leaf: Tensor) -> None:
        if i in rows.reached:  # its rows went on their own; this is what reached it otherwise
            rows.add_whole(i, leaf.grad)
            leaf.grad = None
            return
        if hold is not None:  # summed unreduced, reduced once a step (``_zero_micro``)
            g, leaf.grad = leaf.grad, None
            hold.add(i, g)
            return
        assert leaf.grad is not None  # the hook runs once it is accumulated
        g, leaf.grad = leaf.grad.reshape(-1), None
        pad = n * flat[i].numel() - g.numel()
        g = torch.cat([g, g.new_zeros(pad)]) if pad else g.contiguous()
        for j in inflight:  # at most one in flight (as FSDP2): then its full gradient is freed
            finish(j)
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
    units = layout.units
    # A stacked leaf (``[layers, ...]``) taken by its rows (``unbind``, ``t[r]``): a row at a time
    # (``_zero_rows.RowGather``), each row a buffer of its own, gathered and freed as a leaf is.
    row_of = {j: ir for ir, j in uses.rows.items()}

    def unit_of(j: int) -> Any:  # a leaf's unit number; a row's: (its leaf's, the row); None: its own
        if units is None:
            return None
        return units[j] if j < nleaves else (units[row_of[j][0]], row_of[j][1])

    for i in range(nleaves):
        # The leaf autograd accumulates into (AccumulateGrad runs as soon as the gradient is
        # complete; a node between it and its uses would run only at the end of the backward).
        leaf = uses.views[i].detach().requires_grad_(True)
        leaf.register_post_accumulate_grad_hook(lambda a, i=i: reduce_scatter(i, a))
        rg.track(flat[i], leaf, flat=True, unit=unit_of(i))
        gathered.append(leaf)

    def start(j: int) -> Any:
        # the gather writes the buffer in place: not a change autograd must know of (``_resize``)
        with torch.autograd._unsafe_preserve_version_counter(bufs[j]):
            _resize(bufs[j], bufs[j].numel() * bufs[j].element_size())
            if j >= nleaves:  # a stacked leaf's row (its gather counted as the leaf's, ``taken``)
                return rows.gather_row(*row_of[j], bufs[j].view(-1))
            _stats.record_bytes("all_gather", (axis,), n, params[j].nbytes, overlap=True)
            return _Pending.start(params[j], groups, axis, out=bufs[j])

    def track(j: int) -> None:
        i, r = row_of[j]
        rg.track_row(bufs[j], i, params[i].nbytes, lambda: rows.gather_row(i, r), unit=unit_of(j))

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
    lazy = _Lazy(bufs, start, uses, nleaves, unit_of if units is not None else None)
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
            finish(j)
        inflight.clear()
        rows.wait()
        uses.by_rows = set(rows.reached)
        outs = rows.release()
    if hold is not None:
        return None, loss.detach()
    grads = []
    for i, c in enumerate(leaves):
        if into is not None:  # done[i] is into[i] already; a stacked leaf's rows' chunk adds now
            if i not in done and i in outs:
                into[i].add_(outs[i])
            grads.append(into[i])
            continue
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


_COMPILED_REGION = (
    "fpar.optim: a function compiled on its own (torch.compile(layer)) ran inside an eager "
    "ZeRO-3 step on a real mesh. Stage 3 gathers each parameter at its first use, op by op, "
    "which a compiled region cannot do (Inductor would fail to lower the gathers' storage "
    "resizes). Compile the whole step instead (torch.compile(step); docs/layouts/zero.md, "
    "'The whole step in one compiled graph'), or run the layer eagerly, or use stage 2."
)


def _raise_compiled_region() -> None:
    raise RuntimeError(_COMPILED_REGION)


# Runs when the compiled region does: an error there (under fullgraph, Dynamo's, with the same
# words), never traced into the region's graph.  A lazy graph break, not ``torch.compiler.disable``
# at import: that imports Dynamo, ~2 s of every process that imports fpar (``_compile.graph_break``).
_refuse_compiled_region = graph_break(_raise_compiled_region, _COMPILED_REGION)


class _Lazy(TorchFunctionMode):
    """Stage 3's forward on a real mesh, a unit at a time: FSDP2's units, by default one leaf each.

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

    ``unit_of(buffer)`` (``zero_layout``'s ``units``): buffers of one unit are gathered together
    (the first read of any of them waits for all; the prefetch starts a whole unit) and freed
    together, once each has been read as often as in the previous forward.  A stacked leaf taken
    by its rows last time is never gathered whole for its unit (its rows are units of their own
    kind: row ``r`` of the unit's stacked leaves).
    """

    def __init__(
        self,
        fulls: list[Tensor],
        start: Callable[[int], Any],
        uses: Uses,
        leaves: int,
        unit_of: Callable[[int], Any] | None = None,
    ):
        super().__init__()
        self.fulls, self.start, self.uses, self.leaves = list(fulls), start, uses, leaves
        self.unit_of = unit_of
        self.members: dict[Any, list[int]] = {}  # unit -> its buffers (``unit_of`` given)
        for j in range(len(self.fulls)):
            self._join(j)
        self.seen: set[int] = set()  # buffers read in this forward (``first``'s members)
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

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if torch.compiler.is_compiling():  # Dynamo traces this mode: a region compiled on its own
            _refuse_compiled_region()
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
                if self.reads[i] == self._expected(i):
                    self._free_unit(i)
        return out

    def _expected(self, i: int) -> int | None:
        """Reads of buffer ``i`` the previous forward made (one each in a signature's first)."""
        return self.uses.reads.get(i, 1 if self.learning else None)

    def _join(self, j: int) -> None:
        if self.unit_of is not None:
            self.members.setdefault(self.unit_of(j), []).append(j)

    def _unit(self, j: int) -> list[int]:
        """Buffer ``j``'s unit (itself, without units), less stacked leaves taken by rows last time."""
        if self.unit_of is None:
            return [j]
        skip = self.uses.by_rows
        return [m for m in self.members[self.unit_of(j)] if m == j or m not in skip]

    def _free_unit(self, i: int) -> None:
        """Free ``i``'s unit, unless one of its gathered buffers still has reads to come."""
        unit = self._unit(i)
        for m in unit:
            e = self._expected(m)
            if m != i and self.ready[m] and e is not None and self.reads.get(m, 0) < e:
                return
        for m in unit:
            if self.ready[m]:
                self._free(m)

    def add(self, full: Tensor) -> int:
        """One more buffer (a stacked leaf's row, first taken in this forward); its index."""
        self.keys[_storage_key(full)] = len(self.fulls)
        self.fulls.append(full)
        self.ready.append(False)
        self.gathered.append(False)
        self._join(len(self.fulls) - 1)
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
            self._saw(i)
            return
        # the unit's buffers not gathered yet in this forward come with it (one read again after
        # its unit was freed comes alone: a re-gather, counted)
        unit = [m for m in self._unit(i) if m == i or not (self.ready[m] or self.gathered[m])]
        started = [(m, self.pending.pop(m, None) or self.start(m)) for m in unit]
        for m, pending in started:
            self._wait(m, pending)
        self._saw(i)
        self._prefetch()

    def _saw(self, i: int) -> None:
        if i not in self.seen:
            self.seen.add(i)
            self.first.append(i)

    def _wait(self, i: int, pending: _Pending) -> None:
        # the gather writes the buffer in place: not a change autograd must know of (no saved
        # view of it exists before its first use)
        with torch.autograd._unsafe_preserve_version_counter(self.fulls[i]):
            pending.wait()
        self.ready[i] = self.gathered[i] = True

    def _prefetch(self) -> None:
        """Start the next unit's all-gathers in the expected order, unless one is in flight."""
        if self.pending:
            return
        while self.next < len(self.order):
            j = self.order[self.next]
            self.next += 1
            if not self.gathered[j] and not self.ready[j]:
                for m in self._unit(j):
                    if not (self.gathered[m] or self.ready[m] or m in self.pending):
                        self.pending[m] = self.start(m)
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
