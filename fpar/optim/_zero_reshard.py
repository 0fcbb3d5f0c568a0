"""ZeRO-3 inside a pipeline, each model chunk gathered for its own actions (``reshard_after_forward=True``).

By default ``zero_pipeline`` gathers a stage's parameters once a step and holds them for every
microbatch (torchtitan's FSDP x pipeline, ``reshard_after_forward=False``: one all-gather a
step, and the stage's weights whole all step, ``2`` bytes a parameter of the stage in bfloat16).
With ``reshard_after_forward=True`` each model chunk's rows of the stage's stacked parameters
(one layer's, with one layer a chunk) live in buffers of their own, of 0 bytes between uses
(FSDP2's ``resize_``).  Before a forward or backward of a chunk the chunk is gathered (each piece
of a row broadcast by the data rank whose chunk holds it, ``gather_from_owners``); after it, the
chunk is freed unless the stage's next action is the same chunk's; and as an action starts, the
next action's chunk is gathered ahead, in flight while this one computes.  So a stage holds
the running chunk and the next, not all ``v``, for two gathers a chunk and microbatch (FSDP2
does the same: ``reshard_after_forward`` and a prefetch of one unit).

Autograd keeps what a forward saved of a chunk's weights as views of its buffers, whose bytes
come back (the same values) before that chunk's backward.  A weight-gradient action (``W`` of a
zero-bubble schedule) reads no weight and gathers none.  The embedding and the head (``first``
and ``last``) are gathered once a step by the stage that reads them (``stage_gather``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import _stats
from .._tree import tree_flatten, tree_unflatten
from ._zero import ZeroLayout, _gather
from ._zero_comm import _Pending
from ._zero_fsdp import _resize
from ._zero_rows import gather_from_owners

__all__ = ["Reshard", "stage_gather"]

Tensor = torch.Tensor
_NEEDS_WEIGHTS = ("F", "B", "BW")


class Reshard:
    """The pipeline executor's ``gather``: each chunk's rows gathered for its actions, freed after.

    Args:
      layout: the stage-3 ``ZeroLayout`` of ``{"stages", "first", "last"}``.
      params: this rank's parameter chunks (``zero_init``'s), the same tree.
      stages: the indices of ``layout.leaves`` that are ``params["stages"]``'s leaves, in order.
      dtype: the dtype the rows are gathered in (``compute_dtype``, else the chunks' own).
    """

    def __init__(self, layout: ZeroLayout, params: Any, stages: list[int], dtype: Any):
        self.layout, self.stages = layout, stages
        groups: Any = layout.mesh._dist  # a real mesh's ``MeshGroups``
        axis = layout.data_axis
        self.axis, self.group, self.members = axis, groups.group((axis,)), groups.members((axis,))
        self.groups, self.me = groups, groups.coords[axis]
        flat = tree_flatten(params)[0]
        self.mine = [flat[i].reshape(-1) for i in stages]  # this rank's chunk of each stacked leaf
        self.v = layout.leaves[stages[0]].block[0] if stages else 0
        self.rows: list[list[Tensor]] = []  # chunk -> its row buffer of each stacked leaf
        for _ in range(self.v):
            bufs = []
            for i, mine in zip(stages, self.mine):
                lf = layout.leaves[i]
                low = dtype if dtype is not None and mine.is_floating_point() else mine.dtype
                b = torch.empty(lf.block[1:], dtype=low, device=mine.device)
                _resize(b, 0)  # bytes only while gathered
                bufs.append(b)
            self.rows.append(bufs)
        self.order: list = []  # the stage's actions that read weights, as it runs them
        self.at = 0  # the next of ``order`` to run
        self.held: dict[int, list] = {}  # chunk -> its gathers' works (empty once waited): gathered

    def chunks(self, treedef: Any, order: list) -> list[Any]:
        """Each chunk's parameter tree (``params["stages"]``'s structure): its row buffers.

        ``order``: the stage's compute actions as it will run them (``Action``s; those of
        ``_NEEDS_WEIGHTS`` gather their chunk).
        """
        self.order, self.at = [a for a in order if a.kind in _NEEDS_WEIGHTS], 0
        return [tree_unflatten(treedef, bufs) for bufs in self.rows]

    def before(self, a: Any) -> None:
        """Action ``a`` begins: its chunk gathered (waited for); the next action's chunk started."""
        if a.kind not in _NEEDS_WEIGHTS:
            return
        try:  # the next to run, or a later one (``fpar.plan`` skips a planning run's microbatches)
            self.at = self.order.index(a, self.at) + 1
        except ValueError:
            raise RuntimeError(f"fpar.optim.zero_pipeline: action {a} out of the stage's order") from None
        if a.chunk not in self.held:
            self._start(a.chunk)
        for work in self.held[a.chunk]:
            work.wait()
        self.held[a.chunk] = []
        nxt = self._next()
        for c in [c for c in self.held if c not in (a.chunk, nxt)]:
            self._free(c)  # prefetched for an action that did not run
        if nxt is not None and nxt != a.chunk and nxt not in self.held:
            self._start(nxt)  # in flight while ``a`` computes

    def after(self, a: Any) -> None:
        """Action ``a`` ended: its chunk freed, unless the stage's next action is the same chunk's."""
        if a.kind in _NEEDS_WEIGHTS and self._next() != a.chunk:
            self._free(a.chunk)

    def close(self) -> None:
        """The step's end: every chunk freed (a gather still in flight ends first)."""
        for c in list(self.held):
            self._free(c)

    def _next(self) -> int | None:
        return self.order[self.at].chunk if self.at < len(self.order) else None

    def _start(self, c: int) -> None:
        self.groups.group((self.axis,))  # as every collective fpar issues: held messages go first
        works = []
        for i, mine, b in zip(self.stages, self.mine, self.rows[c]):
            lf = self.layout.leaves[i]
            width = b.numel()
            _resize(b, width * b.element_size())
            out = b.view(-1)
            works += gather_from_owners(out, c * width, mine, lf.chunk, self.members, self.group, self.me)
            _stats.record_bytes(
                "all_gather_invariant",
                (self.axis,),
                self.layout.n,
                width * b.element_size() // self.layout.n,
                overlap=True,
            )
        self.held[c] = works

    def _free(self, c: int) -> None:
        for work in self.held.pop(c, []):
            work.wait()
        for b in self.rows[c]:
            _resize(b, 0)


def stage_gather(
    layout: ZeroLayout, stacked: list[int], dtype: Any, *, rows: bool
) -> Callable[[Any, list[bool]], Any]:
    """A pipeline stage's parameters for its step, from its chunks (``zero_pipeline``'s stage 3, on a real mesh).

    ``stacked``: the indices of ``layout.leaves`` that are the stacked stage parameters.  The
    function returned takes the chunks and ``used``: per leaf, whether this rank's stage reads it
    (the embedding ``first`` only on the first stage, the head ``last`` only on the last; every
    stacked leaf).  The stacked leaves are gathered whole (``rows=False``: the stage held for
    the step) or stand as placeholders (``rows=True``: ``Reshard`` gathers each chunk's rows);
    of the rest, a leaf this stage reads is gathered, one it does not stands as a placeholder.
    A placeholder has the leaf's block shape and dtype on one element of memory (an expanded
    scalar): the executor checks and describes the tree by it, and no stage reads it.  (Every
    stage gathering the embedding and the head held both all step: 1 GiB on each stage of Llama
    3 405B's 8,192-GPU layout.)

    Every leaf in ``dtype`` where floating (the chunks' own dtype if ``None``).  One sharded call
    on every rank takes all the chunks (the ranks agree on every leaf's signature before any
    message) and gathers the stacked leaves unless ``rows``; the leaves only some stages read
    are then gathered over the data axis by those stages' ranks alone (a stage's data ranks all
    read the same leaves; ``_zero_comm._Pending.gather``, as ZeRO-3 gathers a parameter).
    """
    from .._shard import shard

    def low(c: Tensor) -> torch.dtype:
        return dtype if dtype is not None and c.is_floating_point() else c.dtype

    spmd = [] if rows else list(stacked)
    agreed = shard(
        lambda chunks: [
            _gather(chunks[i].to(low(chunks[i])), layout.leaves[i], layout, invariant=True) for i in spmd
        ],
        layout.mesh,
        ([layout._chunk_spec(lf) for lf in layout.leaves],),
        [layout.leaves[i].spec for i in spmd],
    )

    def run(params: Any, used: list[bool]) -> Any:
        groups: Any = layout.mesh._dist  # a real mesh's ``MeshGroups`` (fpar.plan: this device's)
        axis = layout.data_axis
        flat, treedef = tree_flatten(params)
        out: list[Any] = [None] * len(flat)
        for i, t in zip(spmd, agreed(flat)):
            out[i] = t
        groups.group((axis,))  # as every collective fpar issues: held messages go first
        pending = []
        for i, c in enumerate(flat):
            if out[i] is not None:
                continue
            lf, dt = layout.leaves[i], low(c)
            if used[i] and i not in stacked:
                pending.append((i, _Pending.gather(c.reshape(-1).to(dt), groups, axis)))
                _stats.record_numel("all_gather_invariant", (axis,), layout.n, lf.chunk, dt)
            else:
                out[i] = torch.zeros((1,) * len(lf.block), dtype=dt, device=c.device).expand(lf.block)
        for i, p in pending:
            lf = layout.leaves[i]
            out[i] = p.wait()[: lf.numel].view(lf.block)
        return tree_unflatten(treedef, out)

    return run
