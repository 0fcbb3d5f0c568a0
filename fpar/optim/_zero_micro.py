"""ZeRO-2 and ZeRO-3 over microbatches: each one's gradient reduced and summed, or summed and reduced once.

**Sharded (the default, FSDP2's).**  Stages 2 and 3 reduce-scatter each microbatch's gradient as
soon as it exists and sum the chunks: ``Psi / N`` of gradients held, one reduce-scatter a
microbatch.  On a real mesh stage 3 runs its microbatches here (``summed_sharded``): each
reduced chunk is added, as its reduce-scatter ends, into the sum of the microbatches before
(``gathered_grad``'s ``into``), as FSDP2 adds into a parameter's sharded ``.grad``; the step holds
that sum, one gradient being reduced, and the parameters in use, never a second sum.

**Once (``reduce_once=True``).**  Each data rank's own gradient is kept unreduced, summed over the
step's microbatches in the parameters' dtype, and reduce-scattered once at the end of the step
(FSDP2's ``set_requires_gradient_sync(False)`` on every microbatch but the last):
``n_micro - 1`` fewer reduce-scatters, one whole gradient more held through the step (4 bytes a
parameter with float32 parameters), freed bucket by bucket as the final reduce-scatter goes
(``_zero._Releaser``).  Stage 3 still gathers each parameter for each microbatch's forward and
frees it after (the gathered parameters are what FSDP's units bound; the gradient is this
option's price) (``reduced_once``).

How each mesh makes a rank's unreduced gradient (``zero_grads`` picks):

* a real mesh, stage 3 with ``regather``: ``_zero_fsdp.gathered_grad`` with ``hold``: each
  parameter's gradient, as autograd completes it, is added into the step's sum (a stacked leaf's
  row by row) instead of being reduce-scattered;
* stage 2 anywhere: the parameters enter the loss as one copy per data rank already
  (``P(data, ...)``); their gradient is the unreduced one;
* stage 3 otherwise (in-process, under a ``torch.func`` transform, ``regather=False``): each
  gathered parameter enters the loss as ``gathered.detach() + tap``, ``tap`` a zero per data rank
  (``P(data, ...)``, a stride-0 view: no memory); the gradient of ``tap`` is the rank's gradient of
  the gathered parameter, and nothing flows back through the all-gather.  In-process the backward's
  re-gathers are counted as the real mesh makes them (``_zero_comm.Regather``).

The same values as reducing every microbatch, up to the order of the sums: each microbatch's
gradient is added into the sum before the sum over ranks, not after.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch

from .._defer import defer_reduction
from .._tree import tree_flatten, tree_unflatten
from ._accumulate import _microbatch
from ._zero import ZeroLayout

__all__ = ["Held", "reduced_once", "summed_sharded", "tap_shapes", "taps"]

Tensor = torch.Tensor


class Held:
    """One step's unreduced gradients, each leaf's summed over microbatches (``P(data, ...)`` form).

    ``dtypes``: each leaf's sum's dtype (the stored parameters'): a 16-bit gradient of a
    ``mixed_precision`` loss is summed in float32, rounded never (the update takes float32).
    """

    def __init__(self, layout: ZeroLayout, dtypes: list[torch.dtype], device: torch.device | None):
        self.layout, self.dtypes, self.device = layout, dtypes, device
        self.sums: list[Tensor | None] = [None] * len(layout.leaves)

    def add(self, i: int, g: Tensor) -> None:
        """Add leaf ``i``'s gradient: a rank's block (real mesh) or its ``P(data, ...)`` stack."""
        # autograd's own result, not a view: summed into in place (else copied once)
        owned = (
            not torch.compiler.is_compiling()
            and g.dtype == self.dtypes[i]
            and g.is_contiguous()
            and g._base is None
        )
        if g.dim() == len(self.layout.leaves[i].block) and self.layout.mesh.backend == "dist":
            g = g.unsqueeze(0)
        s = self.sums[i]
        if s is None:
            self.sums[i] = (
                g if owned else g.to(self.dtypes[i], memory_format=torch.contiguous_format, copy=True)
            )
        else:
            s.add_(g)

    def add_row(self, i: int, r: int, g: Tensor) -> None:
        """Add row ``r`` of stacked leaf ``i``'s gradient (a real mesh's ``RowGather``)."""
        s = self.sums[i]
        if s is None:
            block = self.layout.leaves[i].block
            s = self.sums[i] = torch.zeros((1, *block), dtype=self.dtypes[i], device=g.device)
        s[0, r].add_(g)

    def take(self) -> list[Tensor]:
        """The sums in ``P(data, *spec)`` form (zeros where no gradient came), handed over."""
        out = []
        for i, s in enumerate(self.sums):
            if s is None:  # no gradient reached it (a real mesh's unused parameter): zeros
                s = torch.zeros((1, *self.layout.leaves[i].block), dtype=self.dtypes[i], device=self.device)
            out.append(s)
        self.sums = [None] * len(self.sums)
        return out


def tap_shapes(layout: ZeroLayout) -> list[tuple[int, ...]]:
    """Each parameter's ``P(data, *spec)`` shape (a rank's block on a real mesh), found once.

    Outside the step: a compiled step reads no mesh sizes (Dynamo breaks on their mapping).
    """
    mesh = layout.mesh
    if mesh.backend == "dist":
        return [(1, *lf.block) for lf in layout.leaves]
    out = []
    for lf in layout.leaves:
        entries = list(lf.spec.normalized()) + [()] * (len(lf.block) - len(lf.spec.normalized()))
        out.append(
            (layout.n, *(b * math.prod([mesh.shape[a] for a in e]) for b, e in zip(lf.block, entries)))
        )
    return out


def taps(
    shapes: list[tuple[int, ...]], dtypes: list[torch.dtype], device: torch.device | None
) -> list[Tensor]:
    """A zero per data rank and parameter (``P(data, *spec)``), stride 0, each a leaf of autograd."""
    out = []
    for shape, dtype in zip(shapes, dtypes):
        zero = torch.zeros((), dtype=dtype, device=device)
        out.append(zero.expand(shape).detach().requires_grad_(True))
    return out


def reduced_once(
    one: Callable[[Any, Any, Tensor, Held], Tensor],
    reduce: Callable[[Any], Any],
    layout: ZeroLayout,
    n_micro: int,
    batch_specs: Any,
) -> Callable:
    """``grads(params, batch, scale) -> (grads, loss)``: the microbatches summed, then one ``reduce``.

    ``one(params, microbatch, scale, held)`` adds a microbatch's unreduced gradients into ``held``
    and returns its loss; ``reduce`` takes the ``P(data, *spec)`` sums to the stage's chunks.
    """

    def grads(params: Any, batch: Any, scale: Tensor) -> tuple[Any, Tensor]:
        leaves, params_def = tree_flatten(params)  # the layout's structure (not its stored treedef:
        dtypes = [t.dtype for t in leaves]  # Dynamo cannot unflatten that one)
        held = Held(layout, dtypes, leaves[0].device if leaves else None)
        losses = []
        for i in range(n_micro):
            losses.append(one(params, _microbatch(batch, i, n_micro, layout.mesh, batch_specs), scale, held))
        sums = held.take()
        del held
        for s in sums:  # the mean, in place (the sums are this step's own): no second copy
            s.div_(n_micro)
        reduced, treedef = tree_flatten(reduce(tree_unflatten(params_def, sums)))
        del sums
        loss = losses[0]
        for other in losses[1:]:
            loss = loss + other
        return tree_unflatten(treedef, [g.to(d) for g, d in zip(reduced, dtypes)]), loss / n_micro

    return grads


def summed_sharded(
    one: Callable[[Any, Any, Tensor, list[Tensor] | None], tuple[Any, Tensor]],
    n_micro: int,
    layout: ZeroLayout,
    batch_specs: Any,
) -> Callable:
    """``grads(params, batch, scale) -> (grads, loss)``: each microbatch's chunks summed in place.

    ``one(params, microbatch, scale, into)`` returns the microbatch's reduced chunks, added into
    ``into`` (the sum so far, this process's chunks in the parameters' dtype) when it is given,
    as each one's reduce-scatter ends; the first microbatch's chunks (its own new tensors)
    become the sum.
    """

    def grads(params: Any, batch: Any, scale: Tensor) -> tuple[Any, Tensor]:
        total: list[Tensor] | None = None
        losses = []
        treedef = None
        # As ``fpar.optim.accumulate``: sums over other axes (a tensor axis) deferred to the last
        # microbatch, where they can be (stage 3's gathered leaves are new each microbatch: its
        # backward suspends the deferral itself)
        scope = defer_reduction()
        scope._expanded_zeros = True
        scope._checks_itself = True
        try:
            for i in range(n_micro):
                mb = _microbatch(batch, i, n_micro, layout.mesh, batch_specs)
                with scope if i < n_micro - 1 else contextlib.nullcontext():
                    g, loss = one(params, mb, scale, total)
                total, treedef = tree_flatten(g)
                losses.append(loss)
        except BaseException:
            scope._discard()  # this step failed: its deferred sums belong to no step
            raise
        scope._check_reduced("fpar.optim.zero_grads")
        assert total is not None and treedef is not None
        for t in total:  # the mean, in place: the sum is this step's own
            t.div_(n_micro)
        loss = losses[0]
        for other in losses[1:]:
            loss = loss + other
        return tree_unflatten(treedef, total), loss / n_micro

    return grads
