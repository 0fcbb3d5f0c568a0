"""ZeRO-2 and 3 on a real mesh: each bucket reduce-scattered, each stacked layer reduced, as its gradient is made.

``scattered_grad`` runs stage 2's backward with a hook on every parameter: a bucket of them is
reduce-scattered (asynchronously) as soon as its last gradient is accumulated.

A model over stacked layers (``w[layers, ...]``, as ``fpar.plan.model_step`` builds one below
ZeRO-3) takes its layers with ``w.unbind(0)`` (or ``w[i]``, ``w.select(0, i)``).  Autograd's
backward of ``unbind`` waits for every layer's gradient and stacks them, so ``scattered_grad``
could reduce-scatter the leaf only at the end of the backward, and held its whole gradient (4
bytes a parameter in float32, where ZeRO-2 holds ``4 / N``): a stacked leaf is most of a model,
one "bucket" the size of the model.

Here each layer's gradient is reduced as soon as its layer's backward has made it, and freed.
The stage-2 layout keeps a leaf as one flat range split into ``N`` equal chunks (data rank ``k``
holds chunk ``k``), so a layer's range lies in one chunk or crosses into the next: each piece is
summed onto the rank that holds it (``torch.distributed.reduce``), which adds it into its chunk
of the leaf's gradient.  The bytes a rank sends are a reduce-scatter's, ``(N - 1) / N`` of the
leaf's (counted as the one reduce-scatter of the leaf the in-process mesh makes), in one message
per layer and chunk crossed.  The sums are the same, element for element, as reducing the
stacked gradient: each element is one rank's sum of every rank's value, as there.

The rows come from ``fpar.pipeline._unstack``'s gate: a leaf used otherwise as well (not only
through its rows) has that gradient reduced row by row too, once every row is in.

Stage 3 (``RowGather``, for ``_zero_fsdp.gathered_grad``): the stacked leaf is not gathered at
all; each row is gathered on its own, at its first read, by a broadcast from each rank whose
chunk holds a piece of it, and its gradient is reduced onto those ranks in the same way.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from .. import _stats
from .._compile import untraced
from .._dist.buckets import _ASAP
from .._sums import widened
from .._tree import tree_flatten, tree_unflatten
from ..pipeline._unstack import ROWS, Rows, Unstack, _Target, rows_at

__all__ = ["RowGather", "RowScatter", "gather_from_owners", "reduce_onto_owners", "scattered_grad"]

Tensor = torch.Tensor
_IN_FLIGHT = 2  # row reductions in flight at once (their pieces freed as they end)


@dataclasses.dataclass
class _InFlight:
    """An asynchronous reduce-scatter into ``out`` of the gradient ``g``.

    ``dtype``: the gradient's own dtype, where ``g`` went widened (an fp16/bf16 gradient summed in
    float32, fpar's rule): the sum is rounded to it once, when waited for.
    """

    work: Any
    out: Tensor
    g: Tensor | None
    dtype: torch.dtype | None = None

    def wait(self) -> Tensor:
        self.work.wait()
        self.g = None
        return self.out if self.dtype is None else self.out.to(self.dtype)


def reduce_onto_owners(
    flat: Tensor, start: int, chunk: int, members: list[int], group: Any, me: int
) -> list[tuple[Any, Tensor, int | None]]:
    """Sum elements ``[start, start + flat.numel())`` of a leaf's flat gradient onto the ranks holding them.

    Data rank ``k`` (global rank ``members[k]``) holds the leaf's elements ``[k chunk, (k + 1)
    chunk)``; the range is cut where it crosses from one chunk into the next and each piece,
    a view of ``flat``, is summed onto its owner by an asynchronous ``torch.distributed.reduce``
    (which writes the sum into the owner's piece).  Returns per piece ``(work, piece, offset in
    this rank's chunk)``, the offset ``None`` where another rank owns it.
    """
    out = []
    width = flat.numel()
    for k in range(start // chunk, (start + width - 1) // chunk + 1):
        a, b = max(start, k * chunk), min(start + width, (k + 1) * chunk)
        piece = flat[a - start : b - start]
        work = dist.reduce(piece, dst=members[k], group=group, async_op=True)
        out.append((work, piece, a - k * chunk if k == me else None))
    return out


def gather_from_owners(
    out: Tensor, start: int, mine: Tensor, chunk: int, members: list[int], group: Any, me: int
) -> list[Any]:
    """Fill ``out`` with elements ``[start, start + out.numel())`` of a leaf held as chunks (``reduce_onto_owners``'s inverse).

    Data rank ``k`` (global rank ``members[k]``) holds the leaf's elements ``[k chunk, (k + 1)
    chunk)``; ``mine`` is this rank's chunk.  Each piece of the range is broadcast by its owner
    (which first copies it from ``mine``, cast to ``out``'s dtype) into every rank's view of
    ``out``, asynchronously: a rank receives the range's bytes, as from an all-gather of it.
    Returns the broadcasts' works.  ``out``'s version counter is kept (a parameter buffer
    gathered again, not a value autograd must see changed).
    """
    works = []
    width = out.numel()
    for k in range(start // chunk, (start + width - 1) // chunk + 1):
        a, b = max(start, k * chunk), min(start + width, (k + 1) * chunk)
        piece = out[a - start : b - start]
        if k == me:
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
                piece.copy_(mine[a - k * chunk : b - k * chunk])
        works.append(dist.broadcast(piece, src=members[k], group=group, async_op=True))
    return works


class RowScatter(Rows):
    """While ``scattered_grad``'s forward runs: the rows of its stacked leaves, reduced row by row.

    Args:
      leaves: the forward's parameter leaves (its inputs that autograd accumulates into).
      chunks: each leaf's chunk size (elements a data rank holds of it).
      groups, axis: the mesh's groups and the data axis.
      on_rows: called with a leaf's index when its rows are first taken (its bucket goes on without it).
      on_closed: called with a leaf's index when every row of it is in (its bucket's traffic counts).
    """

    def __init__(
        self, leaves: list[Tensor], chunks: list[int], groups: Any, axis: str, on_rows: Any, on_closed: Any
    ):
        super().__init__(Unstack(self._target))
        self.index = {id(t): i for i, t in enumerate(leaves)}
        self.leaves, self.chunks, self.on_rows, self.on_closed = leaves, chunks, on_rows, on_closed
        self.group, self.members = groups.group((axis,)), groups.members((axis,))
        self.n = len(self.members)
        self.me = self.members.index(dist.get_rank())
        self.reached: set[int] = set()  # the leaves whose rows were taken
        self.outs: dict[int, Tensor] = {}  # leaf -> this rank's chunk of its summed gradient
        # (work, piece, where it adds: (leaf, offset, the gradient's dtype) on the piece's owner)
        self.pending: list[tuple[Any, Tensor, tuple[int, int, torch.dtype] | None]] = []

    def _target(self, t: Tensor) -> _Target | None:
        i = self.index.get(id(t))
        if i is None or self.leaves[i] is not t or t.dim() < 2 or t.shape[0] < 2:
            return None
        self.on_rows(i)
        self.reached.add(i)
        return _Scattered(self, i)

    def reduce_row(self, i: int, r: int, g: Tensor) -> None:
        """Sum row ``r`` of leaf ``i``'s gradient ``g`` onto the ranks whose chunks hold it."""
        flat = g.detach().reshape(-1)
        # the reduce writes the sum into it on its owner; fp16/bf16 summed in float32 (fpar's rule,
        # ``fpar.low_precision_sums``), rounded once when it is in
        flat = flat.float() if widened(flat.dtype) else flat.clone()
        if i not in self.outs:
            # made at the leaf's first row, on every rank: where it waited for the rank's own first
            # piece, the ranks owning the rows reduced first held it through more of the backward
            # than the others (and fpar.plan, which plans one data rank for all, planned the others)
            self.outs[i] = flat.new_zeros(self.chunks[i], dtype=g.dtype)
        pieces = reduce_onto_owners(flat, r * flat.numel(), self.chunks[i], self.members, self.group, self.me)
        for work, piece, at in pieces:
            self.pending.append((work, piece, None if at is None else (i, at, g.dtype)))
        while len(self.pending) > _IN_FLIGHT:
            self._finish(self.pending.pop(0))

    def add_whole(self, i: int, g: Tensor | None) -> None:
        """A gradient of all of leaf ``i`` (what reached it other than through its rows), row by row."""
        if g is not None:
            with torch._C._DisableFuncTorch():
                for r in range(g.shape[0]):
                    self.reduce_row(i, r, g[r])

    def _finish(self, item: tuple[Any, Tensor, tuple[int, int, torch.dtype] | None]) -> None:
        work, piece, where = item
        work.wait()
        if where is not None:
            i, at, dtype = where
            piece = piece.to(dtype)  # a widened sum rounded once to the gradient's dtype
            self.outs[i][at : at + piece.numel()].add_(piece)

    def wait(self) -> None:
        """End every row reduction still in flight."""
        while self.pending:
            self._finish(self.pending.pop(0))

    def release(self) -> dict[int, Tensor]:
        """The gradient chunks, handed over.

        This object is in reference cycles (its ``Unstack`` calls back into it; each gate's node
        holds its target, which holds it) that would keep them, and through the leaves' hooks the
        step's buckets, alive until Python's next full collection.
        """
        outs, self.outs = self.outs, {}
        self.unstack.gates.clear()
        self.unstack.target_of = lambda t: None
        self.leaves, self.index = [], {}  # their hooks hold the step's buckets
        return outs


class RowGather(RowScatter):
    """While stage 3's forward runs (``gathered_grad``): a stacked leaf's rows, each gathered on its own.

    ``t.unbind(0)``, ``t[r]`` or ``t.select(0, r)`` of a stacked gathered leaf ``t`` (its storage
    holds no bytes) returns, for row ``r``, a tensor on a buffer of the row's own (``row(i, r)``,
    also of 0 bytes) that ``_Lazy`` gathers at its first read and frees after its last, and the
    backward's ``Regather`` gathers again where autograd saved it: FSDP2's units, a layer's slice
    of each leaf, where the leaf was gathered whole before.  A row is gathered by a
    ``torch.distributed.broadcast`` from each rank whose chunk holds a piece of it (one, or two
    where it crosses into the next chunk), and its gradient is reduced onto those ranks as soon
    as the row's backward has made it (``RowScatter.reduce_row``).  The same values, the same
    sums: each element of the gradient is one rank's sum of every rank's value.

    Args:
      leaves, chunks, groups, axis: as ``RowScatter``'s.
      flat: this rank's chunk of each leaf, flat, in the dtype the rows are gathered in.
      row: ``(i, r) -> the buffer of row r of leaf i`` (made once, then the same each forward).
      on_rows: called with a leaf's index when its rows are first taken in this forward.
    """

    def __init__(
        self,
        leaves: list[Tensor],
        chunks: list[int],
        flat: list[Tensor],
        groups: Any,
        axis: str,
        row: Any,
        on_rows: Any,
    ):
        super().__init__(leaves, chunks, groups, axis, on_rows, None)
        self.flat, self.row, self.groups, self.axis = flat, row, groups, axis
        self.rows: dict[tuple[int, int], Tensor] = {}  # the rows handed out in this forward
        self.counted: set[int] = set()  # leaves whose gradient's reduce-scatter is counted
        self.hold: Any = None  # a ``_zero_micro.Held``: rows' gradients summed there, not reduced

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        taken = rows_at(func, args, kwargs) if func in ROWS else None
        if taken is not None:
            t, at = taken
            i = self.index.get(id(t))
            if i is not None and self.leaves[i] is t and t.dim() >= 2 and t.shape[0] >= 2:
                # What follows reads no buffer: the modes below (``_Lazy``) must not see it
                with torch._C.DisableTorchFunction():
                    if i not in self.reached:
                        self.reached.add(i)
                        self.on_rows(i)
                    return tuple(self._row(i, r) for r in at) if isinstance(at, range) else self._row(i, at)
        return func(*args, **kwargs)

    def _row(self, i: int, r: int) -> Tensor:
        got = self.rows.get((i, r))
        if got is None:
            got = self.rows[(i, r)] = _GatheredRow.apply(self.leaves[i], (self, i, r))
            got.grad_fn._set_sequence_nr(_ASAP)  # run as soon as the row's gradient is complete
        return got

    def gather_row(self, i: int, r: int, out: Tensor | None = None) -> _Broadcasts:
        """Start gathering row ``r`` of leaf ``i`` into ``out`` (flat; a new buffer if ``None``)."""
        chunk = self.flat[i]
        width = self.row(i, r).numel()
        if out is None:
            out = chunk.new_empty(width)
        self.groups.group((self.axis,))  # as every collective fpar issues: held messages go first
        works = gather_from_owners(out, r * width, chunk, self.chunks[i], self.members, self.group, self.me)
        return _Broadcasts(works, out)

    def reduce_row(self, i: int, r: int, g: Tensor) -> None:
        if self.hold is not None:
            self.hold.add_row(i, r, g)
            return
        if i not in self.counted:  # the leaf's one reduce-scatter, as the in-process mesh counts it
            self.counted.add(i)
            _stats.record_numel(
                "psum_scatter", (self.axis,), self.n, self.n * self.chunks[i], g.dtype, overlap=True
            )
        super().reduce_row(i, r, g)

    def release(self) -> dict[int, Tensor]:
        self.rows.clear()
        return super().release()


class _Broadcasts:
    """A row's gather in flight: its pieces' broadcasts (``_Pending``'s interface)."""

    def __init__(self, works: list[Any], out: Tensor) -> None:
        self.works, self.out = works, out

    def wait(self) -> Tensor:
        for work in self.works:
            work.wait()
        return self.out


@untraced
class _GatheredRow(torch.autograd.Function):
    """Row ``r`` of stacked leaf ``i``: its own buffer; its backward reduces the row's gradient."""

    @staticmethod
    def forward(ctx: Any, t: Tensor, where: tuple[RowGather, int, int]) -> Tensor:
        ctx.where = where
        ctx.set_materialize_grads(False)
        owner, i, r = where
        return owner.row(i, r).detach()  # not a read of the buffer (torch functions are off here)

    @staticmethod
    def backward(ctx: Any, g: Tensor | None) -> tuple[None, None]:
        if g is not None:
            owner, i, r = ctx.where
            with torch._C._DisableFuncTorch():
                owner.reduce_row(i, r, g)
        return None, None


class _Scattered(_Target):
    """A stacked leaf's rows, each reduced onto its chunks' ranks as its gradient arrives."""

    def __init__(self, owner: RowScatter, i: int) -> None:
        super().__init__()
        self.owner, self.i = owner, i

    def add(self, r: int, g: Tensor) -> None:
        with torch._C._DisableFuncTorch():
            self.owner.reduce_row(self.i, r, g)

    def close(self, rest: Tensor | None) -> Tensor | None:
        """Every row is in: the gradient that reached the leaf otherwise goes on to the leaf."""
        self.owner.on_closed(self.i)
        return rest  # ``scattered_grad``'s hook on the leaf reduces it row by row (``add_whole``)


def scattered_grad(
    objective: Any,
    layout: Any,
    params: Any,
    batch: Any,
    scale: Tensor,
    buckets: list[list[int]],
    into: list[Tensor] | None = None,
) -> tuple[Any, Tensor]:
    """Stage 2's gradient on a real mesh: each bucket reduce-scattered as soon as it is complete.

    Args:
      objective: ``(params, batch, scale) -> (scaled loss, loss)``, a sharded function taking
        each rank's parameter blocks as its own copies (in_specs varying over the data axis).
      layout: the stage-2 ``ZeroLayout``.
      params: this process's (replicated) parameter blocks.
      batch: the batch, as ``objective`` takes it.
      scale: the loss scale (0-d).
      buckets: leaf indices per bucket (``_zero._buckets``): one reduce-scatter each, the
        leaves' padded gradients side by side per rank, as ``_zero._reduce_scatter_all``.
      into: this process's summed chunks of the microbatches before: each bucket's reduced
        chunks are added into them as its reduce-scatter ends, and the sums are returned
        (``_zero_micro.summed_sharded``).

    Returns:
      ``(grads, loss)``: this process's chunk of each reduced gradient, and the loss.
    """
    import torch.distributed as dist

    from .._dist.exchange import _in_group_order, _ordered, reduce_scatter_single

    axis, n = layout.data_axis, layout.n
    groups = layout.mesh._dist
    group, members = groups.group((axis,)), groups.members((axis,))
    direct = _ordered(members, group) and dist.get_backend(group) != "gloo"
    leaves, treedef = tree_flatten(params)
    chunks = [lf.chunk for lf in layout.leaves]
    bucket_of = {i: k for k, group_ in enumerate(buckets) for i in group_}
    missing = [len(b) for b in buckets]
    got: dict[int, Tensor | None] = {}
    done: dict[int, Any] = {}  # bucket -> its reduced chunks (an _InFlight until waited on)
    inflight: list[int] = []

    def finish(k: int) -> None:
        out = done[k].wait()
        if into is not None:  # added into the sums now, the bucket's chunks freed
            for i, piece in zip(scattered[k], out.split([chunks[i] for i in scattered[k]])):
                into[i].add_(piece)
        done[k] = out if into is None else None

    def launch(k: int) -> None:
        rows = []
        for i in scattered[k]:
            g = got.pop(i, None)
            g = torch.zeros_like(leaves[i]) if g is None else g
            flat = g.reshape(-1)
            pad = n * chunks[i] - flat.numel()
            rows.append((torch.cat([flat, flat.new_zeros(pad)]) if pad else flat).reshape(n, chunks[i]))
        full = (torch.cat(rows, dim=1) if len(rows) > 1 else rows[0].contiguous()).reshape(-1)
        for j in inflight:  # one in flight: the previous bucket's buffer is freed
            finish(j)
        inflight.clear()
        low = full.dtype if widened(full.dtype) else None  # fp16/bf16: summed in float32, rounded once
        full = full.float() if low is not None else full
        out = full.new_empty(full.numel() // n)
        groups.group((axis,))  # as every collective fpar issues: held messages go first (pending.py)
        if direct:
            work = reduce_scatter_single(out, full, group=group, async_op=True)
        else:
            work = dist.reduce_scatter(
                out, _in_group_order(list(full.chunk(n)), members, group), group=group, async_op=True
            )
        done[k] = _InFlight(work, out, full, low)
        inflight.append(k)

    # Traffic is counted a bucket at a time, once its every leaf is in (those reduced by rows too).
    uncounted = [len(b) for b in buckets]

    def count(k: int, leaves_in: int = 1) -> None:
        uncounted[k] -= leaves_in
        if uncounted[k] == 0:
            whole = n * sum(chunks[i] for i in buckets[k])
            _stats.record_numel("psum_scatter", (axis,), n, whole, leaves[buckets[k][0]].dtype, overlap=True)

    def accumulated(i: int, leaf: Tensor) -> None:
        if i in rows.reached:  # its rows went on their own; this is what reached it otherwise
            rows.add_whole(i, leaf.grad)
            leaf.grad = None
            return
        got[i], leaf.grad = leaf.grad, None
        k = bucket_of[i]
        missing[k] -= 1
        if missing[k] == 0:
            launch(k)
        count(k)

    inputs = []
    for i, x in enumerate(leaves):
        leaf = x.detach().requires_grad_(True)
        leaf.register_post_accumulate_grad_hook(lambda a, i=i: accumulated(i, a))
        inputs.append(leaf)
    scattered = [list(b) for b in buckets]  # each bucket's leaves reduce-scattered whole

    def by_rows(i: int) -> None:  # a stacked leaf's rows are reduced one by one (``_zero_rows``)
        k = bucket_of[i]
        scattered[k].remove(i)
        missing[k] -= 1

    rows = RowScatter(inputs, chunks, groups, axis, by_rows, lambda i: count(bucket_of[i]))
    try:
        with torch.enable_grad(), rows:
            scaled, loss = objective(tree_unflatten(treedef, inputs), batch, scale)
        torch.autograd.backward(scaled, inputs=inputs)
        for k, left in enumerate(missing):
            if left:  # some gradient never came (an unused parameter): zeros, as autograd's
                missing[k] = 0
                launch(k)
        for k, left in enumerate(uncounted):
            if left:
                count(k, left)
    finally:
        for j in inflight:
            finish(j)
        inflight.clear()
        rows.wait()
        outs = rows.release()
    if into is not None:
        for i in rows.reached:
            if i in outs:
                into[i].add_(outs[i])
        return tree_unflatten(treedef, into), loss.detach()
    grads: list[Tensor] = [None] * len(leaves)  # type: ignore[list-item]
    for k, group_ in enumerate(scattered):
        if group_:
            for i, piece in zip(group_, done[k].split([chunks[i] for i in group_])):
                grads[i] = piece
    for i in rows.reached:  # a leaf no row of which reached this rank's chunk: zeros, as autograd's
        grads[i] = outs[i] if i in outs else leaves[i].new_zeros(chunks[i])
    return tree_unflatten(treedef, grads), loss.detach()
