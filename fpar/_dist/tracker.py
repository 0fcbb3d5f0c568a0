"""The traced call of a real-mesh ``fpar.shard``: varying axes, implicit pvaries, the plan's bookkeeping.

**Which cotangents are summed.**  A value replicated over axis ``a`` (the same on every device
of ``a``) has, in the global function, one copy per device wherever it meets a value varying
over ``a`` (JAX's implicit ``pvary``), enters a collective over ``a``, or leaves through an
output whose spec names ``a``.  The transpose of each such copy sums the cotangent over ``a``.
Cotangent that flows through replicated computation only (a weight used after a psum over
'tensor', in Megatron TP) is *not* summed.
"""

from __future__ import annotations

import contextlib
import os
import sys
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch._C._functorch import is_functorch_wrapped_tensor, maybe_current_level
from torch._functorch.autograd_function import custom_function_call
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from .. import _stats as stats
from .._errors import remat_reads_message
from .._registry import NOT_OPS, TRANSPARENT, bound_once
from .._spec import PartitionSpec
from .._tree import tree_flatten, tree_unflatten
from ..random._guard import RANDOM_OPS, check_random_op
from .agreement import _Agreement
from .exchange import _Exchange

__all__ = ["_Planned", "_Tracker"]

Tensor = torch.Tensor
_REDUCING = {"psum", "pmean", "pmax", "pmin", "all_gather_invariant"}


# Reads that steer Python control flow: refused inside a remat body (``_errors.remat_reads_message``)
_CONTROL_READS = {
    Tensor.item,
    Tensor.tolist,
    Tensor.numpy,
    Tensor.__bool__,
    Tensor.__float__,
    Tensor.__int__,
    Tensor.__index__,
}
# What reads a tensor's value without returning a tensor (as the ops that make a ``Pending`` wait)
_VALUE_READS = _CONTROL_READS | {Tensor.__format__, Tensor.__repr__, Tensor.__array__, Tensor.data_ptr}
_SHAPE_LIKE = {torch.ones_like, torch.zeros_like, torch.empty_like}


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_FPAR_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _by_user() -> bool:
    """Whether the op being intercepted was called by the user's code, not by fpar's own.

    (fpar reads values of its own: a key's words in ``fpar.random``, a split's sizes in
    ``fpar.ops.moe``.)  The first frame outside torch and the modes' handlers decides.
    """
    frame = sys._getframe(2)
    while frame is not None and (
        frame.f_code.co_filename.startswith(_TORCH_DIR) or frame.f_code.co_name == "__torch_function__"
    ):  # torch's dispatch, and other modes handing the op on (fpar's ShardMode)
        frame = frame.f_back
    return frame is None or not frame.f_code.co_filename.startswith(_FPAR_DIR)


def _reads_value(func, result: Any) -> bool:
    """Whether an op that took a tensor read its value (not only its shape, dtype or device)."""
    if func in _VALUE_READS:
        return True
    if func in _SHAPE_LIKE:
        return False
    return any(isinstance(t, Tensor) for t in (result if isinstance(result, (tuple, list)) else (result,)))


_CAPTURED = ("captured",)  # the source of a differentiated tensor of unknown origin (``_Tracker._typed``)


def _at_use(plan, summed: tuple[str, ...], deps: frozenset) -> tuple[str, ...]:
    """The axes a pvaried use sums its cotangent over: those its sources' sums sit at uses for.

    (An axis over which the use has no source sums at the use, as it always did.)
    """
    if plan.fast:
        return ()
    return tuple(
        a
        for a in summed
        if not any(d[1] == a for d in deps) or any(d in plan.at_use for d in deps if d[1] == a)
    )


def _joined(mixed: set, met: list) -> set:
    """The (source, axis) pairs summed at their uses: the mixed ones, and any a use sums with one.

    A use sums its cotangent once for all its sources over an axis, so they are all at the use or
    all at their sources (union-find over the uses' pairs).
    """
    if not mixed:
        return set()
    parent: dict = {}

    def root(x):
        while parent.get(x, x) != x:
            parent[x] = parent.get(parent[x], parent[x])
            x = parent[x]
        return x

    for found in met:
        r = root(found[0])
        for d in found[1:]:
            q = root(d)
            if q != r:
                parent[q] = r
    bad = {root(p) for p in mixed}
    return {p for p in set(mixed).union(*met) if root(p) in bad}


def _diff(t: Tensor) -> bool:
    """Whether a cotangent can flow to ``t`` (float or complex dtype)."""
    return t.is_floating_point() or t.is_complex()


@bound_once
class _Planned(torch.autograd.Function):
    """Identity forward; backward sums the cotangent over the axes ``resolve()`` names then.

    The traced call's pvaries: by the time its backward runs the plan is decided, so the sums
    happen where a fast call would do them (once at each source) or, for a signature that stays
    traced, at every use.  A recomputation in the backward (``fpar.optim.remat``) then sees the
    same sums as the forward it replaces.
    """

    @staticmethod
    def forward(x, resolve, mg):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.resolve, ctx.mg = inputs

    @staticmethod
    def backward(ctx, ct):
        how = ctx.resolve()
        if callable(how):  # an input's sum deferred under fpar.defer_reduction() (traced_sums.py)
            return how(ct), None, None
        return (_Exchange.apply(ct, "psum", (), 0, how, ctx.mg) if how else ct), None, None

    @staticmethod
    def jvp(ctx, x_t, *_):
        return x_t

    @staticmethod
    def vmap(info, in_dims, x, resolve, mg):
        return _Planned.apply(x, resolve, mg), in_dims[0]


class _Tracker(TorchFunctionMode):
    """Varying-axes tracking, per-use implicit pvary, and the plan's bookkeeping (first call)."""

    def __init__(self, owner, plan):  # a shard.DistShard, its shard._Plan
        super().__init__()
        self.owner, self.plan, self.mg = owner, plan, owner.mg
        self.axes = owner.axes
        # Axes of more than one device: a sum over an axis of size 1 is the identity, so such an
        # axis never makes a value a gradient source (it is still typed, for the replication check)
        self.summed = frozenset(a for a in self.axes if owner.mesh.shape[a] > 1)
        # id -> (a weak reference to the tensor, its varying axes, its sources): weak, so that typing a
        # value keeps no intermediate alive past its last use (a traced call holds what an untraced one does)
        self.infos: dict[int, tuple[weakref.ref, frozenset, frozenset]] = {}
        self.pvaried: dict = {}
        self.pvary_use: set = set()
        self.first_use: list = []  # sources in the order of their first pvaried use
        self.met: list = []  # per pvaried use and axis: the (source, axis) pairs it sums together
        self.plain_use: set = set()
        self.unknown = False  # a tracked replicated tensor of unknown origin met a varying value
        # Whether a cotangent can reach the call's inputs or collectives: under a torch.func
        # transform, or a typed value that autograd tracks.  If none can (an optimizer update:
        # nothing requires grad), the sums' places do not matter and the call is planned fast.
        self.differentiable = maybe_current_level() is not None
        self.inner = False  # the function differentiates inside itself
        self.base = maybe_current_level()
        self.coll: list = []
        self.carried: Tensor | None = None  # the sum the call's first message carried, until an op reads it
        self.late: dict = {}  # input slot -> its cotangent's deferral (set after the forward: traced_sums)
        self.wrapped: set = set()  # input slots a later traced call sums as a fast one (reduce_inputs)
        self.remat: str | None = None  # the name of the remat function whose body is being typed
        # The grad mode the function asked for (``torch.no_grad`` and its kin go through this mode):
        # autograd off while it is on means a custom ``torch.autograd.Function``'s forward
        self.grad_wanted = torch.is_grad_enabled()
        # a lowered call (lowered.py): below torch.func.grad's level, a wrapped tensor is one the
        # function did not get as an argument (its gradient would be lost), an op under a
        # transform one of the function's own
        self.below = owner.below
        self.foreign = False  # ... and one was met: the call runs again unlowered (shard._anywhere)

    def check_below(self, leaves: Any) -> None:
        """In a lowered call, note what lowering cannot keep right (the call then runs unlowered)."""
        if not self.foreign and (
            maybe_current_level() is not None
            or any(isinstance(t, Tensor) and is_functorch_wrapped_tensor(t) for t in leaves)
        ):
            self.foreign = True

    # bookkeeping

    def info(self, t: Tensor) -> tuple[frozenset, frozenset]:
        e = self.infos.get(id(t))
        if e is not None and e[0]() is t:  # not an id reused by a newer tensor
            return e[1], e[2]
        return frozenset(), frozenset()

    def _typed(self, t: Tensor) -> tuple[frozenset, frozenset]:
        """``info(t)``; a differentiated tensor the function did not get (captured) has a source of its own.

        Replicated over every axis, it may meet an input's values before a pvary (``w + c``): the
        sum at ``w``'s source would not reach its cotangent, so its use makes the plan sum at uses.
        """
        v, d = self.info(t)
        if not v and not d and self.summed and _diff(t) and stats._tracked(t):
            d = frozenset((_CAPTURED, a) for a in self.summed)
        return v, d

    def _mark(self, result: Any, varying: frozenset, deps: frozenset) -> None:
        if not varying and not deps:
            return
        for t in tree_flatten(result)[0] if not isinstance(result, Tensor) else [result]:
            if isinstance(t, Tensor):
                self.infos[id(t)] = (weakref.ref(t), varying, deps)
                if t.requires_grad:
                    self.differentiable = True

    def enter(self, i: int, leaf: Tensor, spec: PartitionSpec) -> Tensor:
        """Register input ``i``; a replicated float one gets its source-level sum (planned)."""
        named = frozenset(spec.axes())
        rep = [a for a in self.axes if a not in named and a in self.summed]
        deps = frozenset((("in", i), a) for a in rep) if _diff(leaf) else frozenset()
        if deps:
            plan = self.plan
            leaf = _Planned.apply(
                leaf,
                lambda: () if i in self.wrapped else (self.late.get(i) or plan.in_reduce.get(i, ())),
                self.mg,
            )
        self._mark(leaf, named, deps)
        return leaf

    def _use(self, t: Tensor, deps: frozenset, axes: tuple[str, ...]) -> None:
        """``t`` (replicated over ``axes``) is pvaried over them: record its sources' uses."""
        for a in (a for a in axes if a in self.summed):
            # Sorted: ``deps`` is a set, whose order follows string hashing, which differs between
            # processes; ``first_use`` orders the gradient buckets, which every rank must lay out
            # the same way (an all-reduce of differently ordered buffers sums unrelated gradients).
            found = sorted(d for d in deps if d[1] == a)
            if len(found) > 1:
                self.met.append(found)
            if (_CAPTURED, a) in found:
                self.unknown = True
            for d in found:
                if d not in self.pvary_use:
                    self.pvary_use.add(d)
                    self.first_use.append(d[0])
            if not found and stats._tracked(t):
                self.unknown = True

    def _pvary(self, t: Tensor, axes: tuple[str, ...], deps: frozenset) -> Tensor:
        key = (id(t), axes)
        if key in self.pvaried and self.pvaried[key][0] is t:
            return self.pvaried[key][1]
        plan = self.plan
        summed = tuple(a for a in axes if a in self.summed)
        out = _Planned.apply(t, lambda: _at_use(plan, summed, deps), self.mg)
        self.pvaried[key] = (t, out)
        return out

    @contextlib.contextmanager
    def body(
        self, tensors: list[Tensor], types: list[tuple[frozenset, frozenset]], name: str
    ) -> Iterator[None]:
        """Type a body this mode does not intercept, op by op (``fpar.optim.remat``'s forward).

        Its outputs then vary over the axes its data flow gives them (a psum inside returns a
        replicated value), exactly as the in-process mesh's vmap levels say, not over the union
        of its operands.  Under a torch.func transform the body runs below the call's functorch
        level, inside this mode's handler for the Function (where torch pops the mode): push the
        mode again, mark the body's inputs with the types of the values they were unwrapped
        from, and take the body's level as the call's own (it is no user transform).
        """
        base, self.base = self.base, maybe_current_level()
        remat, self.remat = self.remat, name
        for t, (v, d) in zip(tensors, types):
            self._mark(t, v, d)
        on = any(m is self for m in _get_current_function_mode_stack())
        try:
            with contextlib.nullcontext() if on else self:
                yield
        finally:
            self.base, self.remat = base, remat

    # torch ops

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.below:
            self.check_below(tree_flatten((args, kwargs))[0])
        if func in RANDOM_OPS:
            check_random_op(func, args, kwargs, self.owner.fname)  # layout-dependent draws: use fpar.random
        if self.remat is not None and func in _CONTROL_READS and _by_user():
            # the in-process mesh (vmap) cannot read a value here: refuse it alike
            raise ValueError(remat_reads_message(self.remat, f"Tensor.{func.__name__}"))
        if func is torch._C._set_grad_enabled:
            self.grad_wanted = bool(args[0])
        if func in NOT_OPS:
            self.inner = True
            return func(*args, **kwargs)
        if func is custom_function_call and args and args[0] in TRANSPARENT:
            return func(*args, **kwargs)  # its body types its outputs (``typing_body``)
        if self.base != maybe_current_level():
            self.inner = True  # an op under the user's own transform inside the function
        if getattr(func, "__name__", "").startswith("_foreach_"):
            return self._foreach(func, args, kwargs)
        leaves, treedef = tree_flatten((args, kwargs))
        idx = [i for i, t in enumerate(leaves) if isinstance(t, Tensor)]
        if not idx:
            return func(*args, **kwargs)
        reads = self.carried is not None and any(leaves[i] is self.carried for i in idx)
        met, union, deps = self._meet([leaves[i] for i in idx], func)
        if any(t is not leaves[i] for i, t in zip(idx, met)):
            for i, t in zip(idx, met):
                leaves[i] = t
            args, kwargs = tree_unflatten(treedef, leaves)
        result = func(*args, **kwargs)
        self._mark(result, union, deps)
        if reads and _reads_value(func, result):
            self.plan.read_inside, self.carried = True, None
        return result

    def _meet(self, ts: list, func: Any = None) -> tuple[list, frozenset, frozenset]:
        """Tensors ``ts`` meet in one op: pvary each over the axes others vary over and it does not.

        Returns the operands to use, the result's varying axes and its sources.
        """
        infos = [self._typed(t) for t in ts]
        union = frozenset().union(*(v for v, _ in infos))
        deps: set = set()
        out = list(ts)
        for i, (t, (v, d)) in enumerate(zip(ts, infos)):
            missing = union - v
            if missing and _diff(t):
                axes = tuple(a for a in self.axes if a in missing)
                self._refuse_inside_function(func, d, axes)
                self._use(t, d, axes)
                out[i] = self._pvary(t, axes, d)
            deps.update(x for x in d if x[1] not in missing)
        return out, union, frozenset(deps)

    def _refuse_inside_function(self, func: Any, deps: frozenset, axes: tuple[str, ...]) -> None:
        """Refuse an implicit pvary whose sum autograd would never run.

        Inside a custom ``torch.autograd.Function``'s forward (autograd off, though the function
        asked for it; not a remat body, which fpar types itself) nothing is recorded: the
        Function's own backward returns the replicated operand's cotangent unsummed, where the
        in-process mesh (vmap) sums it.  Only a value with a gradient source over ``axes`` needs it.
        """
        if self.remat is not None or torch.is_grad_enabled() or not self.grad_wanted:
            return
        if torch.is_inference_mode_enabled() or not any(a in axes and a in self.summed for _, a in deps):
            return
        op = getattr(func, "__name__", repr(func))
        raise ValueError(
            f"fpar.shard({self.owner.fname}): inside a custom torch.autograd.Function's forward, "
            f"{op} combines a value replicated over {axes} whose gradient is summed over them with one "
            f"varying over {axes}. Autograd records nothing inside that forward, so on a real mesh "
            f"the Function's backward would return the replicated value's gradient without its sum "
            f"over {axes} (the in-process mesh sums it). Make the value vary before the Function: "
            f"pass fpar.pvary(value, {axes!r}) to it, or combine the two in an op of their own "
            f"before the call."
        )

    def _foreach(self, func, args: tuple, kwargs: dict) -> Any:
        """A ``torch._foreach_*`` op: element ``j`` of its result meets only element ``j`` of each list.

        (Typing the whole list by the union of every element's axes would make a replicated
        parameter's update vary over the axes another parameter is split over.)  A tensor
        operand shared by every element (a 0-d coefficient) that must be pvaried differently
        for different elements splits the op into one call per element.
        """
        lists = [k for k, a in enumerate(args) if isinstance(a, (list, tuple))]
        if not lists:
            return func(*args, **kwargs)
        elements: list[list] = []  # per element j: the op's args with each list replaced by its j-th entry
        types: list[tuple] = []  # per element: its result's (varying axes, sources)
        for j in range(len(args[lists[0]])):
            mine = [a[j] if k in lists else a for k, a in enumerate(args)]
            at = [k for k, a in enumerate(mine) if isinstance(a, Tensor)]
            met, union, deps = self._meet([mine[k] for k in at], func)
            for k, t in zip(at, met):
                mine[k] = t
            elements.append(mine)
            types.append((union, deps))
        shared = [k for k, a in enumerate(args) if k not in lists and isinstance(a, Tensor)]
        if all(e[k] is args[k] for e in elements for k in shared):  # one call, as the user wrote it
            result = func(
                *[[e[k] for e in elements] if k in lists else a for k, a in enumerate(args)], **kwargs
            )
        else:
            outs = [func(*[[a] if k in lists else a for k, a in enumerate(e)], **kwargs) for e in elements]
            result = None if outs and outs[0] is None else [r[0] for r in outs]
        if result is None:  # in place: the first list holds the results (and the views pvaried into it)
            targets = [(args[lists[0]][j], e[lists[0]]) for j, e in enumerate(elements)]
        else:
            targets = [(t,) for t in result]
        for ts, (union, deps) in zip(targets, types):
            for t in ts:
                self._mark(t, union, deps)
        return result

    # collectives and outputs

    def collective(self, k: int, kind: str, axes: tuple, params: tuple, x: Tensor) -> Tensor:
        with torch._C.DisableTorchFunction():
            v, d = self.info(x)
            inv = tuple(a for a in axes if a not in v)
            if inv and _diff(x):
                self._use(x, d, inv)
                x = self._pvary(x, inv, d)
            # pvary: identity; the sum over the axes it adds is the implicit pvary above.
            y = x.view_as(x) if kind == "pvary" else _Exchange.apply(x, kind, params, 0, axes, self.mg)
        if kind in _REDUCING:
            varying = v - frozenset(axes)
        else:
            varying = v | frozenset(axes)
        deps = {e for e in d if e[1] not in axes}
        if kind in _REDUCING and _diff(y):
            deps.update((("coll", k), a) for a in axes if a in self.summed)
            plan = self.plan
            with torch._C.DisableTorchFunction():
                y = _Planned.apply(y, lambda: plan.coll[k][2], self.mg)
        self.coll.append((kind, axes))
        self._mark(y, varying, frozenset(deps))
        if params and isinstance(params[0], _Agreement):
            self.carried = y  # read by an op of the function, or only returned (plan.read_inside)
        return y

    def output(self, t: Tensor, named: tuple[str, ...]) -> Tensor:
        v, d = self.info(t)
        rep_named = tuple(a for a in named if a not in v)
        for a in self.axes:
            if a not in named and a not in v and a in self.summed:
                self.plain_use.update(e for e in d if e[1] == a)
        if rep_named and _diff(t):
            with torch._C.DisableTorchFunction():
                self._use(t, d, rep_named)
                t = self._pvary(t, rep_named, d)
        return t

    def finish(self) -> None:
        """Decide the plan: fast unless a source is used both ways or of unknown origin.

        A source used both ways over an axis (a replicated value read through a pvary and also
        returned replicated: the residual stream of a tensor-parallel stage without sequence
        parallelism) has its sums at its uses, and so has every source a use sums together with
        it; every other source keeps its sum at the source (a parameter's data-parallel sum:
        bucketed, and deferred over microbatches), though the signature stays traced.
        """
        plan = self.plan
        pairs = self.pvary_use if self.differentiable else set()
        mixed = pairs & self.plain_use
        if self.unknown or self.inner:
            at_use = set(pairs)
        else:
            at_use = _joined(mixed, self.met)
        plan.fast = not (at_use or self.unknown or self.inner)
        plan.at_use = frozenset(at_use)
        reduce: dict = {}
        for src, a in pairs:
            if (src, a) not in at_use:
                reduce.setdefault(src, []).append(a)
        order = {a: i for i, a in enumerate(self.axes)}
        axes_of = {s: tuple(sorted(v, key=order.get)) for s, v in reduce.items()}
        plan.in_reduce = {s[1]: ax for s, ax in axes_of.items() if s[0] == "in"}
        seen = dict.fromkeys(
            s[1] for s in reversed(self.first_use) if s[0] == "in" and s[1] in plan.in_reduce
        )
        self.met.clear()
        plan.in_order = list(seen)
        plan.coll = [(kind, axes, axes_of.get(("coll", k), ())) for k, (kind, axes) in enumerate(self.coll)]
        self.infos.clear()
        self.pvaried.clear()
