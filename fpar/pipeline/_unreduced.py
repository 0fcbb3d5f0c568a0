"""What a real-mesh pipeline step hands ``fpar.optim.zero_pipeline``: its gradients with the data-parallel sums not taken.

The step defers every sum over the data axis (``defer_reduction``) and gives the local sums to
``zero_pipeline``, which reduce-scatters them itself: once a step (``Unreduced``, a stacked
leaf's chunks summed into the rows of one buffer by ``_SumRows``), or as each backward action
ends (``_Flush``).  Lower-precision parameters' gradients are summed in a wider dtype (``_widen``).
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


def _unreduced(
    st: Stage, params: dict, sums: list, loss: Tensor, stats: Timeline, rows: list | None = None
) -> Unreduced:
    """Sort the deferred sums (``defer_reduction._take_local``) and the rest by parameter.

    ``rows``: per leaf of ``stages``, the stacked buffer (``_SumRows``) its chunks' sums were
    added into, or None: a leaf whose every sum is its row of it is that buffer, not a stack.
    """
    local: dict[int, Tensor] = {}
    axes: dict[int, str] = {}
    for base, value, over in sums:
        have = local.get(id(base))
        local[id(base)] = value if have is None else have + value
        axes[id(base)] = " ".join(over)  # a leaf of the tree (a tuple or set would be a node)

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
    per_chunk = [parts(leaves) for leaves, _ in st.groups["stages"]]
    treedef = tree_flatten(params["stages"])[1]
    for k, part in enumerate(("local", "reduced", "axes")):
        cols = list(zip(*(chunk[k] for chunk in per_chunk)))
        if part == "axes":
            leaves = [next((a for a in col if a is not None), None) for col in cols]
        elif part == "local" and rows is not None:
            leaves = [_stack_parts(col, buf) for col, buf in zip(cols, rows)]
        else:
            leaves = [_stack_parts(col) for col in cols]
        out[part]["stages"] = tree_unflatten(treedef, leaves)
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


def _stack_parts(col: tuple, buf: Tensor | None = None) -> Tensor | None:
    """One leaf's part over this rank's chunks, stacked (zeros for a chunk without it); ``None`` if none has it.

    ``buf``: the leaf's stacked sum (``_SumRows``); when every part there is is its own row of it,
    ``buf`` is the stack (its other rows zeroed), with no copy.
    """
    if all(g is None for g in col):
        return None
    if buf is not None and all(g is None or _is_row(g, buf, c) for c, g in enumerate(col)):
        for c, g in enumerate(col):
            if g is None:
                buf[c].zero_()
        return buf
    like = next(g for g in col if g is not None)
    return stack([torch.zeros_like(like) if g is None else g for g in col])


def _is_row(g: Tensor, buf: Tensor, c: int) -> bool:
    """Whether ``g`` is row ``c`` of ``buf`` (by storage: on the planner's meta device too)."""
    row = buf[c]
    return (
        g.untyped_storage()._cdata == buf.untyped_storage()._cdata
        and g.storage_offset() == row.storage_offset()
        and g.shape == row.shape
        and g.stride() == row.stride()
    )


class _SumRows:
    """``zero_pipeline``'s once-a-step sums (``defer_reduction._row_buffer``): a stacked leaf's chunks into its rows.

    A deferred bucket whose one tensor is chunk ``c``'s row of stacked leaf ``i`` adds its
    microbatches' sums into row ``c`` of one ``[v, ...]`` buffer of ``i`` (made at the leaf's first
    such bucket, in the sums' dtype), so the stage's stacked sum is that buffer: stacking the
    chunks' sums at the step's end held the stage's gradient twice (4 bytes a parameter in float32).
    A row is handed out once a step; a sum of another shape or dtype gets a buffer of its own.
    """

    def __init__(self, st: Stage, stacked: Any):
        self.leaves = tree_flatten(stacked)[0]
        self.bufs: list[Tensor | None] = [None] * len(self.leaves)
        self.at: dict[int, tuple[int, int]] = {}  # id(chunk leaf) -> (stacked leaf, chunk)
        self.given: set[int] = set()
        for c, (chunk, _) in enumerate(st.groups["stages"]):
            for i, leaf in enumerate(chunk):
                if (
                    isinstance(leaf, Tensor)
                    and isinstance(self.leaves[i], Tensor)
                    and leaf.is_floating_point()
                ):
                    self.at[id(leaf)] = (i, c)

    def __call__(self, base: Tensor, numel: int, dtype: torch.dtype) -> Tensor | None:
        where = self.at.get(id(base))
        if where is None or id(base) in self.given:
            return None
        i, c = where
        t = self.leaves[i]
        buf = self.bufs[i]
        if numel != t[0].numel() or (buf is not None and buf.dtype != dtype):
            return None
        if buf is None:
            buf = self.bufs[i] = torch.empty(t.shape, dtype=dtype, device=t.device)
        self.given.add(id(base))
        return buf[c].view(-1)
