"""A stacked parameter's layers, each layer's gradient added into the step's sum as its backward ends.

A stage function over stacked layers (``w[layers, ...]``, as ``fpar.plan.model_step`` and
``fpar.hf.pipeline_stages`` cut them) takes its layers with ``w.unbind(0)``.  Autograd's
backward of ``unbind`` waits for every layer's gradient and then stacks them, and the step's
sum takes the stack: at the end of a microbatch's backward a stage held each layer's gradient,
their stacked copy and the sum, where one sum is needed (4 bytes a parameter each in float32:
what `docs/performance.md`'s pipeline table had over the formula on every ZeRO stage).

On a real mesh a stage function's replicated parameter reaches it as an output of its gradient
bucket: ``_Defer``'s when the call's data-parallel sums are deferred (``fpar.defer_reduction()``:
every microbatch but a chunk's last of a step, every one under ``fpar.optim.zero_pipeline``),
the bucket's hooked view when the call all-reduces them (a chunk's last microbatch).  While the
stage runs a forward with gradients, ``unbind(0)``, ``t[i]`` or ``t.select(0, i)`` of such a
parameter ``t`` returns the same rows, but each row's gradient goes into ``t``'s slot of the
bucket's buffer (the deferred sum, or the buffer the all-reduce sends) as soon as its layer's
backward has made it, and is then freed; ``t``'s own cotangent is then what reached it
otherwise (nothing, usually), or, for the all-reducing call, the slot itself.  A row's node gets
``AccumulateGrad``'s sequence number, as the bucket's launch hook does (``_dist/buckets.py``):
autograd runs the ready node numbered highest first, and a row's node, made at the ``unbind``
before any layer ran, would otherwise wait for the end of the chunk's backward and every
layer's gradient with it.

The sums are the same, element for element, as adding the stacked gradient (rows no gradient
reached are zero, as ``unbind``'s backward makes them).  Anything else takes its rows as before:
the in-process mesh (``vmap``), a compiled region, a forward without gradients (recomputation's
first pass), a stage function outside ``fpar.shard``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from .._compile import untraced
from .._dist.buckets import _ASAP  # AccumulateGrad's sequence number, as the buckets' launch hooks

__all__ = ["ROWS", "Rows", "Unstack", "rows_at"]

Tensor = torch.Tensor
_UNBIND = {Tensor.unbind, torch.unbind}
ROWS = _UNBIND | {Tensor.__getitem__, Tensor.select}  # the calls ``Unstack.rows_of`` may take


class Unstack:
    """One forward's rows of a real mesh's stacked parameters (see the module's note)."""

    def __init__(self, target_of: Callable[[Tensor], _Target | None] | None = None) -> None:
        self.gates: dict[int, tuple[Tensor, Tensor, _Target]] = {}  # id(t) -> (t, its gate, its target)
        # where a tensor's rows go (``None``: it keeps its rows); default a gradient bucket's slot
        self.target_of = target_of or _target

    def rows_of(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Rows of a deferred parameter ``t`` (``t.unbind(0)``, ``t[r]``, ``t.select(0, r)``), or ``None``.

        Each row's gradient goes into ``t``'s slot of its gradient bucket; ``None`` for any other
        call, or a ``t`` that is not a bucket's output.
        """
        taken = rows_at(func, args, kwargs)
        if taken is None:
            return None
        t, at = taken
        got = self.gates.get(id(t))
        if got is None:
            target = self.target_of(t)
            if target is None:
                return None
            got = self.gates[id(t)] = (t, _Gate.apply(t, target), target)
        _, gate, target = got
        if isinstance(at, range):
            return tuple(self._row(gate, r, target) for r in at)
        return self._row(gate, at, target)

    def _row(self, gate: Tensor, r: int, target: _Target) -> Tensor:
        row = _Row.apply(gate, r, target)
        row.grad_fn._set_sequence_nr(_ASAP)  # run as soon as the row's gradient is complete
        return row


def rows_at(func: Any, args: tuple, kwargs: dict) -> tuple[Tensor, range | int] | None:
    """``(t, rows)`` for a row call of a tensor ``t`` that takes gradients here; ``None`` otherwise.

    ``rows`` is a ``range`` for ``t.unbind(0)``, ``r >= 0`` for ``t[r]`` or ``t.select(0, r)``.
    """
    if not args or not isinstance(args[0], Tensor) or args[0].dim() == 0:
        return None
    t, n = args[0], args[0].shape[0]
    if func in _UNBIND:
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        if len(args) > 2 or set(kwargs) - {"dim"} or not isinstance(dim, int) or dim % t.dim():
            return None
        at: Any = range(n)
    elif func is Tensor.__getitem__ and len(args) == 2 and not kwargs:
        at = args[1]
    elif func is Tensor.select and len(args) == 3 and not kwargs and isinstance(args[1], int):
        at = args[2] if args[1] % t.dim() == 0 else None
    else:
        return None
    if not isinstance(at, range) and not (type(at) is int and -n <= at < n):
        return None  # a slice, a tensor index, out of range (torch's own error): as before
    if not (t.requires_grad and torch.is_grad_enabled()):
        return None
    return t, at if isinstance(at, range) else at % n


class Rows(TorchFunctionMode):
    """While a forward runs: ``Unstack.rows_of`` for the row calls it makes (``ROWS``)."""

    def __init__(self, unstack: Unstack | None = None) -> None:
        super().__init__()
        self.unstack = unstack or Unstack()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in ROWS:
            got = self.unstack.rows_of(func, args, kwargs)
            if got is not None:
                return got
        return func(*args, **kwargs)


def _target(t: Tensor) -> _Target | None:
    """Where ``t``'s cotangent goes, if ``t`` is itself a real mesh's gradient bucket's output."""
    from .._defer import Deferred

    bucket = getattr(t, "_fpar_bucket", None)
    if bucket is not None:  # the all-reducing call's hooked view (``_dist/buckets._hooked``)
        state, i = bucket
        return _Reducing(state, i) if tuple(state.layout.shapes[i]) == tuple(t.shape) else None
    fn = t.grad_fn
    held = getattr(fn, "held", None)
    if not isinstance(held, Deferred) or type(fn).__name__ != "_DeferBackward":
        return None
    i = t.output_nr
    metas = fn.metas  # type: ignore[union-attr]
    if not 0 <= i < len(metas) or tuple(metas[i][0]) != tuple(t.shape):
        return None
    return _Deferred(held, fn.index, i, metas)  # type: ignore[union-attr]


class _Target:
    """Where a gated tensor's rows go: its slot of a bucket's buffer, written row by row.

    A row's first write into a slot that holds no sum yet copies (the buffer is uninitialised
    there); rows no gradient reached are then zero.
    """

    def __init__(self) -> None:
        self.done: set[int] = set()  # rows written into a slot that held no sum

    def add(self, r: int, g: Tensor) -> None:
        with torch._C._DisableFuncTorch():
            slot, summed = self._slot()
            if summed or r in self.done:
                slot[r].add_(g)
            else:
                slot[r].copy_(g)
                self.done.add(r)

    def close(self, rest: Tensor | None) -> Tensor | None:
        """Every row is in (the gate's backward); the gated tensor's cotangent is returned."""
        with torch._C._DisableFuncTorch():
            slot, summed = self._slot()
            if not summed:
                for r in range(slot.shape[0]):
                    if r not in self.done:
                        slot[r].zero_()
        return self._closed(slot, rest)

    def _slot(self) -> tuple[Tensor, bool]:
        raise NotImplementedError

    def _closed(self, slot: Tensor, rest: Tensor | None) -> Tensor | None:
        raise NotImplementedError


class _Deferred(_Target):
    """Slot ``i`` of bucket ``b`` of a deferred sum (``_defer.Deferred``)."""

    def __init__(self, held: Any, b: int, i: int, metas: list) -> None:
        super().__init__()
        self.held, self.b, self.i, self.metas = held, b, i, metas

    def _slot(self) -> tuple[Tensor, bool]:
        return self.held.row_slot(self.b, self.i, self.metas)

    def _closed(self, slot: Tensor, rest: Tensor | None) -> Tensor | None:
        self.held.mark_summed(self.b, self.i)
        return rest  # what reached the tensor other than through its rows: ``Deferred.add`` adds it


class _Reducing(_Target):
    """Slot ``i`` of an all-reducing call's bucket (``_dist/buckets._State``)."""

    def __init__(self, state: Any, i: int) -> None:
        super().__init__()
        self.state, self.i = state, i

    def _slot(self) -> tuple[Tensor, bool]:
        return self.state.row_slot(self.i)

    def _closed(self, slot: Tensor, rest: Tensor | None) -> Tensor:
        if rest is not None:
            with torch._C._DisableFuncTorch():
                slot.add_(rest)
        self.state.written(self.i)
        return slot  # the cotangent: the bucket's ``arrive`` takes it in place


@untraced
class _Gate(torch.autograd.Function):
    """``t`` itself; its backward runs after every row's, ends the rows and passes on the rest."""

    @staticmethod
    def forward(ctx: Any, t: Tensor, target: Any) -> Tensor:
        ctx.target = target
        ctx.set_materialize_grads(False)
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, g: Tensor | None) -> tuple[Tensor | None, None]:
        return ctx.target.close(g), None


@untraced
class _Row(torch.autograd.Function):
    """Row ``r`` of the gated tensor; its backward adds the row's gradient into the bucket."""

    @staticmethod
    def forward(ctx: Any, gate: Tensor, r: int, target: Any) -> Tensor:
        ctx.r, ctx.target = r, target
        ctx.set_materialize_grads(False)
        return gate.select(0, r)

    @staticmethod
    def backward(ctx: Any, g: Tensor | None) -> tuple[None, None, None]:
        if g is not None:
            ctx.target.add(ctx.r, g)
        return None, None, None
