"""The zero-bubble split of a backward into B (input gradient) and W (weight gradient).

A forward whose backward the schedule splits runs under ``capture``: every ``F.linear`` and
every ``x @ w`` / ``torch.matmul(x, w)`` whose weight ``w`` is one of the stage's parameter
leaves (or a contiguous reshape of one) runs as ``_Linear``, whose backward computes only the
input gradient and records ``(x, dy)``.  ``B`` is then one ordinary backward of the stage: it
sends the input gradient on, accumulates the cheap gradients (of every parameter used by other
ops), and frees the graph; ``W`` computes the recorded weight gradients as their own matmuls,
``dW = dy^T x`` (or ``x^T dy``) and ``db = sum dy``.  Nothing is recomputed and no part of the
graph is differentiated twice (arXiv:2401.10241 §2: W is the weight-gradient matmuls).

Parameters seen through ``fpar.shard``'s transforms (in-process ``vmap``, or a real mesh's
replication all-reduce) are not captured: their gradients are computed, exactly, in ``B``.  Nor
are the matmuls of a compiled (``torch.compile``) stage function: its graph's backward computes the
weight gradients in ``B`` too (a compiled graph cannot hand single matmuls to ``W``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .._compile import untraced
from ._casts import Casts
from ._unstack import ROWS, Unstack

__all__ = ["Record", "capture", "weight_grads"]

Tensor = torch.Tensor
_LINEAR = {F.linear}
_MATMUL = {torch.matmul, Tensor.matmul, Tensor.__matmul__}
_CASTS = {Tensor.to, Tensor.bfloat16, Tensor.half}


class Record(NamedTuple):
    """One deferred weight gradient: ``kind`` is ``"linear"`` (``y = x w^T + b``) or ``"matmul"`` (``y = x w``)."""

    kind: str
    weight: Tensor  # the parameter leaf
    bias: Tensor | None  # the bias leaf (linear only)
    x: Tensor
    dy: Tensor


class capture(TorchFunctionMode):
    """Run linear layers on ``leaves`` as ``_Linear`` (their weight gradient left to ``weight_grads``).

    Args:
      leaves: the parameter leaves whose weight gradients may be deferred.
      records: where the backward appends one ``Record`` per deferred weight use.
      casts: the chunk's shared low-precision casts of its leaves (``_casts``), or ``None``.
    """

    def __init__(self, leaves: Iterable[Tensor], records: list, casts: Casts | None = None):
        super().__init__()
        self.leaves = {id(t): t for t in leaves}
        self.unstack = Unstack()
        self.records = records
        self.casts = casts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():  # a compiled stage function: its graph's backward does B and W
            return func(*args, **kwargs)
        if func in _LINEAR or func in _MATMUL:
            deferred = self._defer(func, args, kwargs)
            if deferred is not None:
                return deferred
        elif func in _CASTS and self.casts is not None and torch._C._functorch.maybe_current_level() is None:
            shared = self.casts(func, args, kwargs)  # the step's one low-precision copy (``_casts``)
            if shared is not None:
                return shared
        elif func in ROWS and torch._C._functorch.maybe_current_level() is None:
            # a stacked parameter's layers, each one's gradient into its bucket (``_unstack``)
            rows = self.unstack.rows_of(func, args, kwargs)
            if rows is not None:
                return rows
        return func(*args, **kwargs)

    def _defer(self, func, args, kwargs) -> Tensor | None:
        if torch._C._functorch.maybe_current_level() is not None:
            return None  # inside vmap/grad: leave the op to the transform
        if func in _LINEAR:
            x = args[0] if args else kwargs.get("input")
            w = args[1] if len(args) > 1 else kwargs.get("weight")
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            kind = "linear"
        else:
            if len(args) != 2 or kwargs:
                return None
            x, w = args
            b, kind = None, "matmul"
        if not (isinstance(x, Tensor) and isinstance(w, Tensor)) or w.dim() != 2 or x.dim() < 1:
            return None
        lw, lb = self._leaf(w), (self._leaf(b) if isinstance(b, Tensor) else None)
        if lw is None or (b is not None and lb is None):
            return None
        return _Linear.apply(x, w, b, (kind, lw, lb, self.records))

    def _leaf(self, t: Tensor) -> Tensor | None:
        """``t``'s parameter leaf, if ``t`` is one or a contiguous reshape of one.

        A reshape only: the view's autograd node must lead straight to the leaf.  A view made by
        another autograd Function (a real mesh's gradient all-reduce returns its input viewed) has
        a backward of its own, which a deferred weight gradient would skip.
        """
        if id(t) in self.leaves:
            return t
        base = t._base
        if (
            base is not None
            and id(base) in self.leaves
            and t.numel() == base.numel()
            and t.data_ptr() == base.data_ptr()
            and t.is_contiguous()
            and base.is_contiguous()
            and _reshape_of(t, base)
        ):
            return base
        return None


def _reshape_of(t: Tensor, leaf: Tensor) -> bool:
    """Whether ``t``'s autograd node is a view op whose input is ``leaf`` itself."""
    fn = t.grad_fn
    if fn is None or type(fn).__name__ not in _VIEW_NODES or len(fn.next_functions) != 1:
        return False
    return getattr(fn.next_functions[0][0], "variable", None) is leaf


_VIEW_NODES = {"ViewBackward0", "ReshapeAliasBackward0", "UnsafeViewBackward0", "AliasBackward0"}


@untraced
class _Linear(torch.autograd.Function):
    """``F.linear`` or ``x @ w`` whose backward returns only the input gradient and records ``(x, dy)``."""

    @staticmethod
    def forward(ctx, x, w, b, rec):
        kind = rec[0]
        ctx.rec = rec
        ctx.save_for_backward(x, w)
        return F.linear(x, w, b) if kind == "linear" else torch.matmul(x, w)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        kind, lw, lb, records = ctx.rec
        records.append(Record(kind, lw, lb, x.detach(), dy.detach()))
        dx = None
        if ctx.needs_input_grad[0]:
            dx = dy @ w if kind == "linear" else dy @ w.t()
            if x.dim() == 1:
                dx = dx.reshape(x.shape)
        return dx, None, None, None


def weight_grads(
    records: list[Record], into: dict[int, Tensor], slots: dict[int, Tensor] | None = None
) -> None:
    """W: the recorded weight (and bias) gradients, accumulated into ``into[id(leaf)]``.

    The accumulation is fused into the matmul (``addmm_`` into the running sum), so a
    microbatch's weight gradient costs one pass over the weight, not a matmul and an add.
    ``slots``: ``id(leaf) -> `` a contiguous tensor of the leaf's shape and dtype that its first
    gradient is written into (its row of the step's stacked gradient, so that stacking the
    chunks' gradients needs no copy).
    """
    for r in records:
        x2 = r.x.reshape(-1, r.x.shape[-1])
        dy2 = r.dy.reshape(-1, r.dy.shape[-1])
        a, b = (dy2.t(), x2) if r.kind == "linear" else (x2.t(), dy2)
        have = into.get(id(r.weight))
        if have is None and slots and id(r.weight) in slots and slots[id(r.weight)].dtype == a.dtype:
            slot = slots[id(r.weight)]
            torch.mm(a, b, out=slot.view(a.shape[0], b.shape[1]))
            into[id(r.weight)] = slot
        elif have is None or a.dtype != have.dtype:
            _add(into, r.weight, a @ b, slots)
        else:
            have.view(a.shape[0], b.shape[1]).addmm_(a, b)
        if r.bias is not None:
            _add(into, r.bias, dy2.sum(0), slots)
    records.clear()


def _add(into: dict[int, Tensor], leaf: Tensor, g: Tensor, slots: dict[int, Tensor] | None = None) -> None:
    g = g.reshape(leaf.shape)
    have = into.get(id(leaf))
    if have is not None:
        have.add_(g.to(leaf.dtype))
    elif slots and id(leaf) in slots:
        into[id(leaf)] = slots[id(leaf)].copy_(g)
    else:
        into[id(leaf)] = g.to(leaf.dtype).contiguous()
