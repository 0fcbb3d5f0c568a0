"""A real-mesh call under ``torch.func.grad``, differentiated by plain autograd inside the call.

``torch.func.grad`` differentiates with ``create_graph=True`` (pytorch#134612): every op of the
function is recorded at the transform's level, and the backward keeps what every op saved until
it ends, since a higher derivative might follow.  On a model of many layers that doubles the
peak (HF GPT-2 under tensor parallelism: 2.06x DTensor's, against 1.03x by ``.backward()``; 1.00x
lowered), and each op pays functorch's wrapping.  When no higher derivative can follow, none of it is needed:
the call's function runs on the plain tensors under plain autograd, as a ``.backward()`` step,
and the transform sees one op, whose backward runs that graph (freeing as it goes).

When (``lowering_level``): the only active transform is ``torch.func.grad``/``grad_and_value``
(one ``Grad`` level, entered by ``grad_and_value_impl``: not ``vjp``, whose ``vjp_fn`` may be
called again or under ``vmap``), some argument is wrapped at that level, and no outer autograd
records the differentiated values (their plain tensors do not require grad, or grad mode was off
outside).  Otherwise the call runs at the transform's level as before.  Values and gradients are
the same ops either way, from a signature's first call on.

Below the transform, a wrapped tensor the function did not get as an argument (one it captured)
would be a constant: its gradient silently lost.  The lowered signature's first call runs traced
(its own plan, ``DistShard.below``), and the tracker notes an op that meets one; after the whole
forward the processes agree whether any did (``shard._anywhere``: they may run different ops, a
pipeline stage's), and if so every one raises ``Foreign`` and runs the call again at the
transform's level, as every later call of that signature (``DistShard.unlowered``).  A function whose captured tensors are constants in that first call
and differentiated later is not seen: what is differentiated must be an argument.
The Function is torch's single-level one (what functorch generates for every custom Function
under a transform, less its per-call class and tree work: ~0.4 ms a call).
"""

from __future__ import annotations

import inspect
import sys
from types import FrameType
from typing import Any

import torch
from torch._C._functorch import (
    TransformType,
    _unwrap_for_grad,
    _wrap_for_grad,
    get_interpreter_stack,
    is_gradtrackingtensor,
    maybe_get_level,
    pop_dynamic_layer_stack,
    push_dynamic_layer_stack,
)
from torch._functorch.eager_transforms import grad_and_value_impl
from torch._functorch.utils import enable_single_level_autograd_function
from torch.autograd.function import _SingleLevelFunction

from .._compile import untraced
from .._tree import tree_flatten, tree_unflatten

__all__ = ["Foreign", "in_lowered_backward", "lowered", "lowering_level"]

Tensor = torch.Tensor

_GRAD_CODE = inspect.unwrap(grad_and_value_impl).__code__  # (torch wraps it in a generic decorator)


class Foreign(Exception):  # noqa: N818  (a signal, not an error a user sees)
    """A lowered call's traced run met a tensor of the transform's level it did not get as an argument.

    Below the transform such a tensor is a constant (its gradient lost), so the call runs again at
    the transform's level, as it would without lowering (``DistShard.unlowered``).  Raised by
    every process together, once the forward is done and they agreed (``shard._anywhere``).
    """


def lowering_level(leaves: list) -> int | None:
    """The grad level to lower a call with these argument leaves at, or None (run it as it is)."""
    stack = get_interpreter_stack()
    if stack is None or len(stack) != 1 or stack[0].key() != TransformType.Grad:
        return None
    level = stack[0].level()
    wrapped = [x for x in leaves if isinstance(x, Tensor) and is_gradtrackingtensor(x)]
    if not wrapped or any(maybe_get_level(x) != level for x in wrapped):
        return None
    if torch._C._functorch.CGradInterpreterPtr(stack[0]).prevGradMode() and any(
        _unwrap_for_grad(x, level).requires_grad for x in wrapped
    ):
        return None  # the transform's results are differentiable outside it (nn.Parameters)
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:  # entered by torch.func.grad, not vjp
        if frame.f_code is _GRAD_CODE:
            return level
        frame = frame.f_back
    return None


_IN_BACKWARD = [0]  # lowered backwards running (a count, not a flag: safe if one ever nests)


def in_lowered_backward() -> bool:
    """Whether a lowered call's backward is running: its gradients go back to ``torch.func.grad``.

    That transform fills a zero for a gradient that is None, as it would below itself; a deferred
    sum's zero is then given as ``fpar.optim.accumulate``'s expanded one (``buckets._Defer``).
    """
    return _IN_BACKWARD[0] > 0


class _Box:
    """What the forward leaves its backward (and the caller): the plain graph's ends."""

    __slots__ = ("grad", "ins", "level", "out_def", "outs")

    def __init__(self, level: int):
        self.level = level
        self.grad = torch.is_grad_enabled()  # (the Function's forward runs with it off)
        self.ins: list[Tensor] | None = None  # the plain leaves that require grad
        self.outs: list | None = None  # the call's output leaves (their plain graph)
        self.out_def: Any = None


@untraced  # its backward is called back during a compiled step's backward
class _Lowered(_SingleLevelFunction):
    """The call as one op at the grad level: forward below it, its backward the plain graph's."""

    @staticmethod
    def forward(box: _Box, call: Any, treedef: Any, leaves: list, slots: list[int], *wrapped: Tensor) -> Any:
        level = box.level
        values = [(_unwrap_for_grad(x, level), x.requires_grad) for x in wrapped]
        saved = pop_dynamic_layer_stack()
        try:
            plain = list(leaves)
            box.ins = []
            for i, (v, rg) in zip(slots, values):
                plain[i] = v.detach().requires_grad_(rg)
                if rg:
                    box.ins.append(plain[i])
            with torch.set_grad_enabled(box.grad):  # the transform's grad mode at the call
                out = call(tree_unflatten(treedef, plain))
            box.outs, box.out_def = tree_flatten(out)
            # a detached alias of each (a Pending loss stays unsettled: pending.py)
            results = [t.detach() for t in box.outs if isinstance(t, Tensor)]
        finally:
            push_dynamic_layer_stack(saved)
        return tuple(_wrap_for_grad(t, level) for t in results)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.box = inputs[0]
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        box = ctx.box
        level = box.level
        tensors = [t for t in box.outs or () if isinstance(t, Tensor)]
        pairs = [
            (t, _unwrap_for_grad(g, level))
            for t, g in zip(tensors, grads)
            if g is not None and t.requires_grad
        ]
        got: list = [None] * len(box.ins or ())
        if pairs and box.ins:
            saved = pop_dynamic_layer_stack()
            _IN_BACKWARD[0] += 1
            try:
                got = list(
                    torch.autograd.grad(
                        [t for t, _ in pairs], box.ins, [g for _, g in pairs], allow_unused=True
                    )
                )
            finally:
                _IN_BACKWARD[0] -= 1
                push_dynamic_layer_stack(saved)
        # the plain graph is spent (a second backward cannot come: lowering_level admits no vjp)
        box.ins = box.outs = None
        it = iter(got)
        result: list = [None] * 5
        for rg in ctx.needs_input_grad[5:]:
            g = next(it) if rg else None
            result.append(None if g is None else _wrap_for_grad(g, level))
        return tuple(result)


# FunctionMeta gives it apply, which mypy does not see
_APPLY: Any = getattr(_Lowered, "apply")  # noqa: B009


def lowered(call: Any, leaves: list, treedef: Any, level: int) -> Any:
    """``call(args)`` (a ``DistShard``'s) on the plain tensors, as one op at grad ``level``.

    ``leaves`` and ``treedef``: ``args`` flattened (the caller has them already).
    """
    slots = [i for i, x in enumerate(leaves) if isinstance(x, Tensor) and is_gradtrackingtensor(x)]
    box = _Box(level)
    with enable_single_level_autograd_function():
        results = iter(_APPLY(box, call, treedef, leaves, slots, *[leaves[i] for i in slots]))
    assert box.outs is not None
    outs = [next(results) if isinstance(t, Tensor) else t for t in box.outs]
    return tree_unflatten(box.out_def, outs)
