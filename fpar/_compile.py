"""How fpar meets ``torch.compile``: where Dynamo may trace, and where it must not.

fpar's collectives, implicit pvaries and gradient all-reduces are custom ``autograd.Function`` classes
(in-process also with custom ``vmap`` rules), run under a ``TorchFunctionMode``.  Dynamo cannot
trace the in-process machinery at all (functorch levels, custom vmap rules), and where it does
trace a custom Function it can drop its backward: under ``torch.compile(torch.func.grad(f))`` a
Function whose backward all-reduces then returns the *local* gradient, silently (pytorch#193279,
reproduced on torch 2.13 with gloo).  So fpar never lets Dynamo trace its own eager machinery;
what it traces is a separate, lean form of a sharded call whose signature an eager call has
planned or checked (the whole step in one graph: ``_dist/compiled.py`` on a real mesh,
``_local/compiled.py`` in-process, while :data:`TRACED` is set).  Everywhere else:

* a sharded function and every collective are wrapped in ``torch.compiler.disable``: under
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

import contextlib
import functools
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import torch

from ._tree import tree_flatten_with_path

try:  # torch's per-code-object frame strategy (what torch._dynamo.skip_code uses)
    from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy
except ImportError:  # a torch without Dynamo: nothing ever compiles a frame
    set_code_exec_strategy = None

T = TypeVar("T")

__all__ = [
    "BACKWARD_TRACED",
    "REASON",
    "TRACED",
    "eager",
    "graph_break",
    "opaque",
    "refuse_traced_backward",
    "signature_key",
    "untraced",
    "WHOLE_STEP",
    "TOO_OLD",
    "answered_in_order",
]

REASON = (
    "fpar: this call cannot be traced by torch.compile, so fullgraph=True cannot cover it. A "
    "collective in a per-device function compiled on its own (fpar.shard(torch.compile(f), ...)) "
    "breaks f's graph there. Compile the whole step instead, on either mesh: "
    "torch.compile(step, fullgraph=True), step calling the sharded loss, then loss.backward() or "
    "torch.autograd.grad, then the update, after one eager step (torch.func.grad cannot be "
    "compiled: pytorch#193279). Or drop fullgraph=True: the call runs eagerly (see docs/compile.md)."
)


def graph_break(fn: Callable, reason: str = REASON) -> Callable:
    """``fn`` as an eager call Dynamo never traces: a graph break, or under ``fullgraph`` an error.

    The error carries ``reason``.
    ``torch.compiler.disable`` imports Dynamo (about 2 s a process); a program that never compiles
    never imports it.  So the wrapper carries Dynamo's markers (``_torchdynamo_disable``: Dynamo
    never inlines it, and names ``reason`` under ``fullgraph``) and disables Dynamo for what it
    calls only once Dynamo is loaded: before that, nothing can be compiling.
    """
    disabled: list = []

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if "torch._dynamo" not in sys.modules:
            return fn(*args, **kwargs)
        refuse_traced_backward(getattr(fn, "__name__", "f"))
        if not disabled:
            disabled.append(torch.compiler.disable(fn, reason=reason))
        return disabled[0](*args, **kwargs)

    call._torchdynamo_disable = True
    call._torchdynamo_disable_msg = reason
    call._torchdynamo_disable_recursive = True
    return untraced(call)  # its own frame, run at a graph break, is not compiled either


def opaque(fn: Callable) -> Callable:
    """A collective's entry: traced inside a whole-traced sharded call, else a graph break.

    Inside a sharded call Dynamo traces whole (``_dist/compiled.py``, ``_local/compiled.py``,
    while :data:`TRACED` is set) ``fn`` goes into the graph; anywhere else it is a :func:`graph_break`.
    """
    call = graph_break(fn)

    @functools.wraps(fn)
    def entry(*args, **kwargs):
        # Dynamo inlines this (it is not disabled); in eager mode TRACED is 0: one list lookup
        if TRACED[0] and torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        return call(*args, **kwargs)

    return untraced(entry)


BACKWARD_TRACED = (
    "fpar ({name}) runs eagerly at a graph break of a compiled function while "
    "torch._dynamo.config.trace_autograd_ops is True: Dynamo would trace the .backward() of this "
    "eager call's result as a graph input with no history and silently make no gradients, so fpar "
    "refuses. On a real "
    "mesh, run the step once without torch.compile first: the compiled step then traces the "
    "sharded call whole, backward included. Otherwise leave trace_autograd_ops off, so that "
    "loss.backward() runs eagerly (see docs/compile.md)."
)


def refuse_traced_backward(name: str) -> None:
    """Raise :data:`BACKWARD_TRACED` where a compiled frame runs an fpar call eagerly.

    That is, at a graph break while ``torch._dynamo.config.trace_autograd_ops`` is on: Dynamo then traces the ``.backward()`` of that eager call's result as a graph input with no
    history, and the backward silently makes no gradients (torch 2.13, fpar or not: the output
    of any function under ``torch.compiler.disable`` does the same).  A frame Dynamo compiled
    shows up on the stack as a code object in Dynamo's map of transformed code.  Costs one
    config read per eager call when Dynamo is loaded and the flag is off.
    """
    if "torch._dynamo" not in sys.modules or not torch._dynamo.config.trace_autograd_ops:
        return
    from torch._dynamo.utils import orig_code_map

    frame = sys._getframe(1)
    for _ in range(16):
        if frame is None:
            return
        if frame.f_code in orig_code_map:
            raise RuntimeError(BACKWARD_TRACED.format(name=name))
        frame = frame.f_back


def signature_key(args: tuple) -> tuple:
    """The key of a call's signature that Dynamo can compute and hash (no ``PyTreeSpec`` in it).

    The leaves' paths stand for the argument structure; with each tensor's shape, dtype and
    ``requires_grad`` and each other leaf's value (or type) it names one eager plan.
    """
    paths, leaves, _ = tree_flatten_with_path(args)
    sig = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            sig.append((tuple(leaf.shape), leaf.dtype, leaf.requires_grad))
        elif leaf is None or isinstance(leaf, (bool, int, float, str)):
            sig.append((type(leaf), leaf))  # hashable; and torch 2.11's Dynamo cannot trace hash(str)
        else:
            try:
                hash(leaf)
                sig.append((type(leaf), leaf))
            except TypeError:
                sig.append((type(leaf), id(leaf)))
    return tuple(paths), tuple(sig)


# The whole step in one graph needs torch 2.13's Dynamo (checked on 2.13.0 and 2.14.1): 2.11's fails
# to trace it (optree polyfills, Tensor.requires_grad_ in a graph), loudly.  Older torch gets a
# graph break that says so, and its calls run eagerly.
WHOLE_STEP = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)
TOO_OLD = (
    "fpar.shard({fname}) under torch.compile: tracing the whole step into one graph needs torch "
    "2.13 or newer (this is torch " + torch.__version__ + "); here the sharded call runs eagerly, "
    "as a graph break. Upgrade torch, or drop fullgraph=True."
)

# How many sharded calls Dynamo is tracing whole right now (``_dist/compiled.py``,
# ``_local/compiled.py``): in them, fpar's collectives are traced into the graph instead of breaking it.
TRACED = [0]


def eager():
    """A context in which compiled functions run eagerly (fpar intercepts every op there).

    Setting the stance imports Dynamo (~2 s of CPU a process): before it is loaded no function
    has been compiled, so there is nothing to run eagerly.  One compiled inside the region (``f``
    calling ``torch.compile(g)`` on its first call) then runs at the default stance, inside
    fpar's modes; its values and gradients equal the eager ones on both meshes
    (``tests/test_compile.py``), and from the next call on it runs eagerly here.
    """
    if "torch._dynamo" not in sys.modules:
        return contextlib.nullcontext()
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


def answered_in_order(record: Sequence, fname: str) -> Callable[[torch.Tensor], frozenset]:
    """A compiled call's ``Frame.varying``: query ``k`` answered by the eager call's ``k``-th answer.

    ``record``: ``(shape, dtype, mesh axes)`` of each value the eager call with the same argument
    shapes queried for the axes it varies over (dropout's batch axes, clip's groups), in order.
    Neither vmap's batching (in-process) nor the tracker (real mesh) runs under Dynamo.
    """
    asked = [0]

    def varying(x: torch.Tensor) -> frozenset:
        k = asked[0]
        asked[0] += 1
        if k >= len(record) or record[k][:2] != (tuple(x.shape), x.dtype):
            raise RuntimeError(
                f"fpar.shard({fname}) under torch.compile: query #{k} for the mesh axes a value "
                f"varies over (e.g. by dropout) is of a value of shape {tuple(x.shape)} and dtype "
                f"{x.dtype}, but the eager call with these argument shapes asked "
                + (f"of shape {record[k][0]} and dtype {record[k][1]}" if k < len(record) else "fewer")
                + ". A function whose queries depend on values, not shapes, cannot be compiled; "
                "pass the layout explicitly (fpar.ops.dropout's spec=, the layers' batch_axes=)."
            )
        return record[k][2]

    return varying
