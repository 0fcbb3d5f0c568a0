"""What a real-mesh pipeline step hands ``fpar.optim.zero_pipeline``: its gradients with the data-parallel sums not taken.

The step defers every sum over the data axis (``defer_reduction``) and gives the local sums to
``zero_pipeline``, which reduce-scatters them itself: once a step (``Unreduced``), or as each
backward action ends (``_Flush``).  Lower-precision parameters' gradients are summed in a wider dtype (``_widen``).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch

from .._tree import tree_flatten, tree_map, tree_unflatten
from ._stage import Stage, stack
from ._timeline import Timeline

Tensor = torch.Tensor


class Unreduced(NamedTuple):
    """A real-mesh step's gradients with the data-parallel sums not taken (``fpar.optim.zero_pipeline``).

    Each tree has the structure of the step's ``params`` (``stages`` stacked over this rank's
    chunks; ``first`` and ``last`` on every rank, ``None`` leaves where this stage does not use
    them).  A parameter's gradient is the sum over the mesh axes ``axes`` (their names in one
    string, space-separated: a leaf of the tree) of every rank's
    ``local`` (this rank's own sum over its microbatches, not communicated) plus ``reduced``
    (what was summed already: a sum the sharded function could not defer), ``None`` where a
    part is zero.
    """

    loss: Tensor
    local: dict
    reduced: dict
    axes: dict
    stats: Timeline


def _unreduced(st: Stage, params: dict, sums: list, loss: Tensor, stats: Timeline) -> Unreduced:
    """Sort the deferred sums (``defer_reduction._take_local``) and the rest by parameter.

    ``sums`` is emptied.  A stacked parameter's chunks' sums are stacked one leaf at a time,
    each chunk's sum let go as its leaf is stacked: with each sum in a buffer of its own
    (``defer_reduction._own_buffers``) the stage's gradient is held once, plus one leaf.
    """
    local: dict[int, Tensor] = {}
    axes: dict[int, str] = {}
    for base, value, over in sums:
        have = local.get(id(base))
        local[id(base)] = value if have is None else have + value
        axes[id(base)] = " ".join(over)  # a leaf of the tree (a tuple or set would be a node)
    sums.clear()

    def reduced(t: Any) -> Any:
        if not isinstance(t, Tensor):
            return None
        parts = [g for g in (t.grad, st.deferred.get(id(t)), st.wide.get(id(t))) if g is not None]
        return sum(parts[1:], parts[0]) if parts else None

    def parts(leaves: list) -> tuple[list, list, list]:
        return (
            [local.get(id(t)) for t in leaves],
            [reduced(t) for t in leaves],
            [axes.get(id(t)) for t in leaves],
        )

    out: dict[str, dict] = {"local": {}, "reduced": {}, "axes": {}}
    chunks = [leaves for leaves, _ in st.groups["stages"]]
    treedef = tree_flatten(params["stages"])[1]
    cols = list(zip(*chunks))  # per leaf, its tensor in each chunk
    stacked = []
    for col in cols:
        stacked.append(_stack_parts(tuple(local.pop(id(t), None) for t in col)))
    out["local"]["stages"] = tree_unflatten(treedef, stacked)
    out["reduced"]["stages"] = tree_unflatten(
        treedef, [_stack_parts(tuple(map(reduced, col))) for col in cols]
    )
    out["axes"]["stages"] = tree_unflatten(
        treedef, [next((axes[id(t)] for t in col if id(t) in axes), None) for col in cols]
    )
    for g in ("first", "last"):
        if g not in params:
            continue
        leaves, td = st.groups[g][0]
        if td is None:  # this stage does not use them
            empty = tree_map(lambda _: None, params[g])
            for part in out:
                out[part][g] = empty
            continue
        for part, got in zip(("local", "reduced", "axes"), parts(leaves)):
            out[part][g] = tree_unflatten(td, got)
    return Unreduced(loss, out["local"], out["reduced"], out["axes"], stats)


class _Flush:
    """``each`` of a step: after a backward action, the deferred sums it completed, named by group, chunk and leaf."""

    def __init__(self, st: Stage, each: Any):
        self.st, self.each = st, each
        self.where = {
            id(t): (g, c, j)
            for g, chunks in st.groups.items()
            for c, (leaves, _) in enumerate(chunks)
            for j, t in enumerate(leaves)
        }

    def ready(self) -> None:
        self.each.ready()

    def __call__(self) -> None:
        done = self.st.deferral._take_done()
        if done:
            self.each([(*self.where[id(base)], value, axes) for base, value, axes in done])


def _widen(st: Stage, dtype: torch.dtype) -> None:
    """Sum the gradients autograd accumulates into lower-precision leaves in ``dtype`` instead.

    After each accumulation into such a leaf's ``.grad`` (a sum the sharded function could not
    defer), the gradient moves into ``st.wide``, kept in ``dtype``: the microbatches add there.
    """
    for group in st.groups.values():
        for leaves, _ in group:
            for t in leaves:
                if isinstance(t, Tensor) and t.requires_grad and t.dtype.itemsize < dtype.itemsize:
                    t.register_post_accumulate_grad_hook(functools.partial(_move_wide, st.wide, dtype))


def _move_wide(wide: dict, dtype: torch.dtype, t: Tensor) -> None:
    g, t.grad = t.grad, None
    if g is None:
        return
    have = wide.get(id(t))
    wide[id(t)] = g.to(dtype) if have is None else have.add_(g)


def _stack_parts(col: tuple) -> Tensor | None:
    """One leaf's part over this rank's chunks, stacked (zeros for a chunk without it); ``None`` if none has it."""
    if all(g is None for g in col):
        return None
    like = next(g for g in col if g is not None)
    return stack([torch.zeros_like(like) if g is None else g for g in col])
