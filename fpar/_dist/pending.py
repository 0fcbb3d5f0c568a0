"""A collective's result that is waited on at its first use: the call's first message, sent async.

A planned call whose first collective is a small sum over every mesh axis (a data-parallel
loss ``pmean``) sends it, with the signature check it carries (``shard._Agreement``), without
waiting, or, when the call's first gradient bucket may ride in the same message, once that
bucket is ready in the backward (``shard._First``; until then it counts as in flight): the
result is a ``Pending`` tensor, as torch's ``AsyncCollectiveTensor``.  (Unless the signature's
traced call saw the function itself read the sum, a tensor-parallel activation: waiting at once
costs nothing more there, and a plain tensor lets a compiled ``f`` go on compiled.)  Its value
is waited on, and the check read, at the first of:

* any operation that reads it (``.item()``, printing, arithmetic, ...): every op but the few
  that need only its shape (``ones_like``, ``zeros_like``, ``empty_like``, which is all
  ``loss.backward()`` and ``torch.func.grad`` ask of it) and ``.detach()``, whose result is
  another ``Pending`` of the same buffer;
* the next collective fpar issues, on any mesh (``MeshGroups.group`` settles first): a rank
  never sends a message whose size depends on its signature before every rank has agreed on it
  (a first message still waiting for its bucket goes then, alone);
* the end of ``fpar.launch``'s function, and interpreter exit.

So a training step costs one synchronisation, at its gradient all-reduce, as DDP's, instead of
one more at the loss; the loss is summed while the backward runs.  A gradient bucket that is
ready while the check is still on its way (another rank is behind) does not wait for it: its
all-reduce is *held* (``hold``) and the backward goes on; held messages are sent, in the order
they were held, right after the verdicts run, at the next settling (the next bucket that finds
the check arrived, the backward's final wait, or any of the points above).  Every rank sends
the same messages in the same order, only some later, and a check that fails drops them all.
Settling runs the check's verdict exactly as a synchronous call does (the same error on every
rank).  The settled tensor's value is then its ``elem``; unsettled entries are kept in issue
order, and settling one settles every earlier one first, so every rank runs the verdicts' own
messages (a mismatch's signature gather) in the same order.
"""

from __future__ import annotations

import atexit
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_map

from .._compile import untraced

Tensor = torch.Tensor

_UNSETTLED: list[tuple[Callable[[], None], Any]] = []  # (verdict, its message's work), oldest first
_HELD: list[Callable[[], None]] = []  # messages sent once the verdicts have run, in order
_settling = [False]
_for_collective = [False]  # the settling in progress comes before another collective


@untraced
def settle(*, collective: bool = False) -> None:
    """Run every pending verdict, oldest first, then send the held messages in order.

    A verdict may raise the agreement's error; it then drops the held messages (they belong to
    the failed call; every rank drops the same ones).  ``collective``: this settling comes
    before another collective (``MeshGroups.group``), not a read of a value.
    """
    if _settling[0]:
        return  # a held message asking for its group: the loop below goes on in order
    _settling[0] = True
    _for_collective[0] = collective
    try:
        with torch._C._DisableFuncTorch():  # plain buffers, also from a hook under functorch
            while _UNSETTLED:
                verdict, _ = _UNSETTLED.pop(0)
                verdict()
            while _HELD:
                _HELD.pop(0)()
    except BaseException:
        _HELD.clear()
        raise
    finally:
        _settling[0] = _for_collective[0] = False


def for_collective() -> bool:
    """Whether the settling in progress comes before another collective."""
    return _for_collective[0]


def defer(verdict: Callable[[], None], work: Any) -> None:
    _UNSETTLED.append((verdict, work))


def in_flight() -> bool:
    """Whether a check is still on its way: settling now would wait for it."""
    return any(not work.is_completed() for _, work in _UNSETTLED)


def hold(send: Callable[[], None]) -> None:
    """Send ``send``'s message at the next settling, after the verdicts and the earlier held ones."""
    _HELD.append(send)


@untraced
def _settle_at_exit() -> None:
    """At exit (``groups.close``): every message sent has arrived, and a failed check is shown.

    With the default group up, the verdicts run as at any settling.  Once the script has
    destroyed it (``destroy_process_group()`` before exit), no verdict can send its own
    messages and no held message can go (every rank drops the same ones); but a message
    already sent is still in flight on a group fpar holds, and is waited for here, never just
    dropped: its gloo worker would otherwise finish it during finalization and, holding the
    last reference to its buffer, abort the process (``groups.close``).
    """
    if not (_UNSETTLED or _HELD):
        return
    if ending_on_error():
        # An uncaught exception is ending this process: its peers may be waiting for it
        # elsewhere and never answer; no verdict runs, nothing held is sent, nothing is waited
        # for (``groups.close`` bounds the teardown of what is still in flight).
        _UNSETTLED.clear()
        _HELD.clear()
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            settle()
        except Exception:  # noqa: BLE001 - no caller is left to raise to: show it
            import sys
            import traceback

            print(
                "fpar: a sharded call's signature check failed after its result was last used:",
                file=sys.stderr,
            )
            traceback.print_exc()
    _HELD.clear()
    while _UNSETTLED:  # the group was destroyed first, or a verdict raised: wait, send nothing
        _, work = _UNSETTLED.pop(0)
        _wait_sent(work)


def ending_on_error() -> bool:
    """Whether the interpreter is exiting because of an uncaught exception.

    Python prints the traceback and sets ``sys.last_value`` (3.12: also ``sys.last_exc``) before
    it runs the exit handlers; a script that ends normally, or by ``sys.exit``, leaves it unset.
    An interactive session (the REPL, ``python -i``, IPython or Jupyter) sets it for any error
    shown at its prompt and goes on, so there it says nothing about the exit: not counted.
    """
    import sys

    if hasattr(sys, "ps1") or sys.flags.interactive or "IPython" in sys.modules:
        return False
    return getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None


def _wait_sent(work: Any) -> None:
    """Wait for a deferred message, if it was sent (a ``_First`` keeps its handle as ``work``)."""
    handle = getattr(work, "work", work)
    if handle is None or not hasattr(handle, "wait") or handle.is_completed():
        return
    try:
        handle.wait()
    except Exception:  # noqa: BLE001 - a peer failed: the message will not arrive, and it is over
        pass


atexit.register(_settle_at_exit)  # also run first by groups.close; here for a group fpar never closed

# Ops that read only a tensor's metadata: what ``backward()`` and ``torch.func.grad`` do to a
# scalar loss (the seed cotangent), answered without waiting.
_SHAPE_ONLY = {
    torch.ops.aten.ones_like.default,
    torch.ops.aten.zeros_like.default,
    torch.ops.aten.empty_like.default,
}


def _unwrap(t: Any) -> Any:
    return t.elem if isinstance(t, Pending) else t


@untraced
class Pending(Tensor):
    """A collective's result whose value arrives later; any op that reads it waits for it first."""

    elem: Tensor

    @staticmethod
    def __new__(cls, elem: Tensor):
        r = Tensor._make_wrapper_subclass(
            cls, elem.shape, strides=elem.stride(), dtype=elem.dtype, device=elem.device, requires_grad=False
        )
        r.elem = elem  # written once its verdict has run
        return r

    def __repr__(self, *, tensor_contents=None) -> str:
        settle()
        return repr(self.elem)

    def __reduce_ex__(self, proto):
        settle()
        return self.elem.__reduce_ex__(proto)

    # What reads the data without the dispatcher (and refuses subclasses): the value, waited for.
    def tolist(self):
        settle()
        return self.elem.tolist()

    def numpy(self, *, force: bool = False):
        settle()
        return self.elem.numpy(force=force)

    def __array__(self, dtype=None, copy=None):
        settle()
        return self.elem.__array__(dtype)

    def data_ptr(self) -> int:
        settle()
        return self.elem.data_ptr()

    def __format__(self, spec: str) -> str:  # f"{loss:.4f}": torch formats plain tensors only
        settle()
        return self.elem.__format__(spec)

    def __deepcopy__(self, memo):
        settle()
        if self.grad_fn is not None:  # as torch does for any tensor inside a graph
            raise RuntimeError(
                "Only Tensors created explicitly by the user (graph leaves) support the deepcopy "
                "protocol at the moment; deepcopy loss.detach() instead."
            )
        return self.elem.__deepcopy__(memo)

    def backward(self, gradient=None, retain_graph=None, create_graph=False, inputs=None) -> None:
        """``Tensor.backward``, without waiting: a scalar loss's seed cotangent is made here.

        As torch's, which would make it with ``ones_like(self)``: an op on this subclass, so a
        Python dispatch (~20 us, several times that inside a step) that needs only the shape.
        """
        if gradient is None and self.requires_grad and self.numel() == 1 and self.dtype.is_floating_point:
            gradient = torch.ones(self.shape, dtype=self.dtype, device=self.device)
        torch.autograd.backward(self, gradient, retain_graph, create_graph, inputs=inputs)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default and type(args[0]) is Pending:
            # an alias of the same buffer, still unsettled: ``loss.detach()`` reads nothing (and a
            # lowered call hands the transform its loss this way: lowered.py)
            return Pending(args[0].elem.detach())
        if func not in _SHAPE_ONLY:
            settle()
        if any(isinstance(a, (list, tuple)) for a in args):  # a tensor list (cat, stack, ...)
            args = tree_map(_unwrap, args)
        else:  # the usual case (``ones_like(loss)`` in every backward): no pytree walk
            args = [a.elem if isinstance(a, Pending) else a for a in args]
        if kwargs:  # ``memory_format=`` of the seed's ``ones_like``: no pytree walk either
            if any(isinstance(v, (list, tuple, dict)) for v in kwargs.values()):
                kwargs = tree_map(_unwrap, kwargs)
            else:
                kwargs = {k: v.elem if isinstance(v, Pending) else v for k, v in kwargs.items()}
        return func(*args, **(kwargs or {}))


@untraced
class Stand(Pending):
    """``total - base`` in ``base + stand``, the one op it takes: that add is ``total`` itself.

    How a fast call's carried psum/pmean gets its first-order history under
    ``torch.func.grad`` without a custom Function (``exchange._pending_sum``): the transform
    records the add at its level, and below it the add returns the unsettled ``total``.
    """

    total: Pending

    @staticmethod
    def __new__(cls, total: Pending):
        r = Pending.__new__(cls, total.elem)
        r.total = total
        return r

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.add.Tensor and len(args) == 2 and isinstance(args[1], Stand) and not kwargs:
            return args[1].total
        raise AssertionError(f"fpar internal: a Stand is only ever added to its base, not {func}")
