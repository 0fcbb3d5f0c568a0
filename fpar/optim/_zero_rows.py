"""ZeRO-2 on a real mesh: a stacked parameter's gradient reduced layer by layer as each layer's backward ends.

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
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..pipeline._unstack import Rows, Unstack, _Target

__all__ = ["RowScatter"]

Tensor = torch.Tensor
_IN_FLIGHT = 2  # row reductions in flight at once (their pieces freed as they end)


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
        self.pending: list[tuple[Any, Tensor, tuple[int, int] | None]] = []  # (work, piece, where it adds)

    def _target(self, t: Tensor) -> _Target | None:
        i = self.index.get(id(t))
        if i is None or self.leaves[i] is not t or t.dim() < 2 or t.shape[0] < 2:
            return None
        self.on_rows(i)
        self.reached.add(i)
        return _Scattered(self, i)

    def reduce_row(self, i: int, r: int, g: Tensor) -> None:
        """Sum row ``r`` of leaf ``i``'s gradient ``g`` onto the ranks whose chunks hold it."""
        flat = g.detach().reshape(-1).clone()  # the reduce writes the sum into it on its owner
        width, c = flat.numel(), self.chunks[i]
        start = r * width
        for k in range(start // c, (start + width - 1) // c + 1):
            a, b = max(start, k * c), min(start + width, (k + 1) * c)
            piece = flat[a - start : b - start]
            work = dist.reduce(piece, dst=self.members[k], group=self.group, async_op=True)
            self.pending.append((work, piece, (i, a - k * c) if k == self.me else None))
        while len(self.pending) > _IN_FLIGHT:
            self._finish(self.pending.pop(0))

    def add_whole(self, i: int, g: Tensor | None) -> None:
        """A gradient of all of leaf ``i`` (what reached it other than through its rows), row by row."""
        if g is not None:
            with torch._C._DisableFuncTorch():
                for r in range(g.shape[0]):
                    self.reduce_row(i, r, g[r])

    def _finish(self, item: tuple[Any, Tensor, tuple[int, int] | None]) -> None:
        work, piece, where = item
        work.wait()
        if where is not None:
            i, at = where
            if i not in self.outs:  # made at the first row in: a chunk of every leaf from the forward on
                self.outs[i] = piece.new_zeros(self.chunks[i])
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


class _Scattered(_Target):
    """A stacked leaf's rows, each reduced onto its chunks' ranks as its gradient arrives."""

    def __init__(self, owner: RowScatter, i: int) -> None:
        super().__init__()
        self.owner, self.i = owner, i
        self.reached: set[int] = set()

    def add(self, r: int, g: Tensor) -> None:
        self.reached.add(r)
        with torch._C._DisableFuncTorch():
            self.owner.reduce_row(self.i, r, g)

    def close(self, rest: Tensor | None) -> Tensor | None:
        """Every row is in: the gradient that reached the leaf otherwise goes on to the leaf."""
        self.owner.on_closed(self.i)
        return rest  # ``scattered_grad``'s hook on the leaf reduces it row by row (``add_whole``)
