"""How fpar meets ``torch.compile``: where Dynamo may trace, and where it must not.

fpar's collectives, implicit pvaries and gradient all-reduces are custom ``autograd.Function``\\ s
(in-process also with custom ``vmap`` rules), run under a ``TorchFunctionMode``.  Dynamo cannot
trace the in-process machinery at all (functorch levels, custom vmap rules), and where it does
trace a custom Function it can drop its backward: under ``torch.compile(torch.func.grad(f))`` a
Function whose backward all-reduces then returns the *local* gradient, silently (pytorch#193279,
reproduced on torch 2.13 with gloo).  So fpar never lets Dynamo trace its own machinery:

* a sharded function and every collective are ``torch.compiler.disable``\\ d: under
  ``torch.compile`` they are graph breaks that run eagerly, exactly as without compile, with
  their backward intact (``fullgraph=True`` raises Dynamo's error carrying :data:`REASON`);
* per-device code *between* collectives compiles: ``fpar.shard(torch.compile(f), ...)`` on a real
  mesh runs ``f``'s compiled graphs on the plain local tensors of a planned (fast) call, split at
  each collective;
* where fpar intercepts every op (the in-process mesh, and a real-mesh call that plans a
  signature or stays traced), a compiled per-device function runs eagerly
  (:func:`eager`): Dynamo would otherwise try to trace fpar's interception itself;
* what autograd calls back into fpar (a gradient bucket's hooks, a collective's backward, the
  ``Pending`` loss) is :func:`untraced`: inside a compiled step, ``loss.backward()`` is a graph
  break that runs eagerly, but Dynamo still intercepts every Python frame it calls and would
  compile fpar's hooks one by one (recompiling for every tensor slot and shape, then guarding
  on each call), which made a compiled step slower than the eager one.
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

try:  # torch's per-code-object frame strategy (what torch._dynamo.skip_code uses)
    from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy
except ImportError:  # a torch without Dynamo: nothing ever compiles a frame
    set_code_exec_strategy = None

T = TypeVar("T")

__all__ = ["REASON", "eager", "opaque", "untraced"]

REASON = (
    "fpar.shard: a sharded function and fpar's collectives are graph breaks under torch.compile "
    "(they run eagerly, with their custom backward: Dynamo can drop an autograd.Function's backward, "
    "pytorch#193279), so fullgraph=True cannot cover them. Compile the per-device code instead: "
    "fpar.shard(torch.compile(f), ...) (split at each collective), or torch.compile(g, fullgraph=True) "
    "on a part of f without collectives; or drop fullgraph=True (see docs/compile.md)."
)


def opaque(fn: Callable) -> Callable:
    """``fn`` as an eager call Dynamo never traces (a graph break; an error under ``fullgraph``).

    ``torch.compiler.disable`` imports Dynamo (about 2 s a process); a program that never compiles
    never imports it.  So the wrapper carries Dynamo's markers (``_torchdynamo_disable``: Dynamo
    never inlines it, and names :data:`REASON` under ``fullgraph``) and disables Dynamo for what
    it calls only once Dynamo is loaded: before that, nothing can be compiling.
    """
    disabled: list = []

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if "torch._dynamo" not in sys.modules:
            return fn(*args, **kwargs)
        if not disabled:
            disabled.append(torch.compiler.disable(fn, reason=REASON))
        return disabled[0](*args, **kwargs)

    call._torchdynamo_disable = True
    call._torchdynamo_disable_msg = REASON
    call._torchdynamo_disable_recursive = True
    return untraced(call)  # its own frame, run at a graph break, is not compiled either


def eager():
    """A context in which compiled functions run eagerly (fpar intercepts every op there)."""
    return torch.compiler.set_stance("force_eager")


def untraced(obj: T) -> T:
    """``obj``'s frames, and the frames they call, run as they are under ``torch.compile``.

    ``obj`` is a function (with every function and lambda defined in it) or a class (its methods).
    Dynamo never compiles these frames, nor any frame called from them, except a function the
    user compiled explicitly (``torch.compile(f)`` called from them still compiles).  Meant for
    what autograd calls back during a compiled step's ``loss.backward()``: hooks, a Function's
    ``backward``.  Dynamo still inlines ``obj`` where it traces a caller (a graph break inside it
    then falls back to running it).  Costs nothing outside ``torch.compile``: it marks the code
    objects, it does not wrap them.
    """
    if set_code_exec_strategy is not None:
        skip = _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)
        for code in _codes(obj):
            set_code_exec_strategy(code, skip)
    return obj


def _codes(obj) -> Iterator[types.CodeType]:
    if isinstance(obj, type):
        for value in vars(obj).values():
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            if isinstance(value, types.FunctionType):
                yield from _codes(value)
        return
    stack = [obj.__code__]
    while stack:
        code = stack.pop()
        yield code
        stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
