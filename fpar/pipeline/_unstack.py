"""A stacked parameter's layers, each layer's gradient added into the step's sum as its backward ends.

A stage function over stacked layers (``w[layers, ...]``, as ``fpar.plan.model_step`` and
``fpar.hf.pipeline_stages`` cut them) takes its layers with ``w.unbind(0)``.  Autograd's
backward of ``unbind`` waits for every layer's gradient and then stacks them, and the step's
sum takes the stack: at the end of a microbatch's backward a stage held each layer's gradient,
their stacked copy and the sum, where one sum is needed (4 bytes a parameter each in float32:
what `docs/performance.md`'s pipeline table had over the formula on every ZeRO stage).

On a real mesh, a forward whose data-parallel sums are deferred (``fpar.defer_reduction()``:
every microbatch but the last of a step, and every one under ``fpar.optim.zero_pipeline``)
sees each replicated parameter as an output of its bucket's ``_Defer`` node.  While the stage
runs such a forward with gradients, ``unbind(0)`` of one returns the same rows, but a row's
gradient is added into the parameter's slot of the deferred sum (``Deferred.add_row``) as soon
as its layer's backward has made it, and then freed; the parameter's own cotangent is then
what reached it otherwise (nothing, usually).  Autograd runs the ready node made last first,
so a row's node made at the ``unbind``, before any layer ran, would wait for the end of the
backward: each row is handed to its layer through a *tap*, made at the layer's first use of it,
whose backward is ready as that layer's ends and runs before the layers below.

The sums are the same, element for element, as adding the stacked gradient (rows no gradient
reached are zero, as ``unbind``'s backward makes them).  Anything else ``unbind``s as before:
a call that reduces at once (the step's last microbatch of a plain pipeline), the in-process
mesh (``vmap``), a compiled region, a forward without gradients (recomputation's first pass).
"""

from __future__ import annotations

from typing import Any

import torch

from .._compile import untraced

__all__ = ["ROWS", "Unstack"]

Tensor = torch.Tensor
_UNBIND = {Tensor.unbind, torch.unbind}
ROWS = _UNBIND | {Tensor.__getitem__, Tensor.select}  # the calls ``Unstack.rows_of`` may take


class Unstack:
    """One forward's ``unbind(0)``s of deferred stacked parameters (see the module's note)."""

    def __init__(self) -> None:
        self.gates: dict[int, tuple[Tensor, Tensor, _Target]] = {}  # id(t) -> (t, its gate, its sum)
        self.rows: dict[int, tuple[Tensor, _Target, int]] = {}  # id(row) -> (row, its sum, index)
        self.taps: dict[int, Tensor] = {}  # id(row) -> the row as its layer first took it

    def rows_of(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Rows of a deferred parameter ``t`` (``t.unbind(0)``, ``t[r]``, ``t.select(0, r)``), or ``None``.

        Each row's gradient is added into ``t``'s sum; ``None`` for any other call.
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
        got = self.gates.get(id(t))
        if got is None:
            target = _Target.of(t)
            if target is None:
                return None
            got = self.gates[id(t)] = (t, _Gate.apply(t, target), target)
        _, gate, target = got
        if isinstance(at, range):
            return tuple(self._row(gate, r, target) for r in at)
        return self._row(gate, at % n, target)

    def _row(self, gate: Tensor, r: int, target: _Target) -> Tensor:
        row = _Row.apply(gate, r, target)
        self.rows[id(row)] = (row, target, r)
        return row

    def tap(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``args`` and ``kwargs`` with each row replaced by its tap, made at the row's first use."""
        if not self.rows:
            return args, kwargs
        found = False
        for a in (*args, *kwargs.values()):
            if isinstance(a, Tensor):
                found = found or id(a) in self.rows
            elif isinstance(a, (list, tuple)):
                found = found or any(isinstance(x, Tensor) and id(x) in self.rows for x in a)
        if not found:
            return args, kwargs
        return tuple(self._tapped(a) for a in args), {k: self._tapped(a) for k, a in kwargs.items()}

    def _tapped(self, a: Any) -> Any:
        if isinstance(a, (list, tuple)):
            return type(a)(self._tapped(x) for x in a)
        if not isinstance(a, Tensor) or id(a) not in self.rows:
            return a
        got = self.taps.get(id(a))
        if got is None:
            row, target, r = self.rows[id(a)]
            got = self.taps[id(a)] = _Row.apply(row, r, target)
        return got


class _Target:
    """Where a deferred parameter's cotangent goes: slot ``i`` of bucket ``b`` of ``held``."""

    def __init__(self, held: Any, b: int, i: int, metas: list) -> None:
        self.held, self.b, self.i, self.metas = held, b, i, metas

    @classmethod
    def of(cls, t: Tensor) -> _Target | None:
        """``t``'s slot, if ``t`` is itself an output of a deferred bucket (``_dist/buckets._Defer``)."""
        from .._defer import Deferred

        fn = t.grad_fn
        held = getattr(fn, "held", None)
        if not isinstance(held, Deferred) or type(fn).__name__ != "_DeferBackward":
            return None
        i = t.output_nr
        metas = fn.metas  # type: ignore[union-attr]
        if not 0 <= i < len(metas) or tuple(metas[i][0]) != tuple(t.shape):
            return None
        return cls(held, fn.index, i, metas)  # type: ignore[union-attr]

    def add(self, r: int, g: Tensor) -> None:
        self.held.add_row(self.b, self.i, r, g, self.metas)

    def close(self) -> None:
        self.held.close_rows(self.b, self.i, self.metas)


@untraced
class _Gate(torch.autograd.Function):
    """``t`` itself; its backward runs after every row's, ends the rows and passes on the rest."""

    @staticmethod
    def forward(ctx: Any, t: Tensor, target: _Target) -> Tensor:
        ctx.target = target
        ctx.set_materialize_grads(False)
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, g: Tensor | None) -> tuple[Tensor | None, None]:
        ctx.target.close()
        return g, None  # what reached the gated tensor other than through its rows (or None)


@untraced
class _Row(torch.autograd.Function):
    """Row ``r`` of the gated tensor (or a tap of one); its backward adds the gradient into the sum."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, r: int, target: _Target) -> Tensor:
        ctx.r, ctx.target, ctx.whole = r, target, x.dim() == len(target.metas[target.i][0])
        ctx.set_materialize_grads(False)
        return x.select(0, r) if ctx.whole else x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: Tensor | None) -> tuple[None, None, None]:
        if g is not None:
            ctx.target.add(ctx.r, g)
        return None, None, None
