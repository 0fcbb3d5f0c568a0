"""Activation checkpointing (rematerialisation) that composes with ``torch.func`` and ``fpar.shard``.

``remat(f)`` computes ``f`` without keeping its intermediate activations: only its inputs are
saved, and the backward runs ``f`` again (under ``torch.func.vjp``) to get them.  Memory for
activations inside ``f`` becomes the size of its inputs; the price is one more forward of ``f``.

Why not ``torch.utils.checkpoint``: it works by ``saved_tensors_hooks``, which
``torch.func.grad``/``vjp`` refuse ("don't yet support saved tensor hooks"), and its recompute
would run the per-device code after ``fpar.shard`` has returned, outside the mesh.

How it works.  ``_Remat`` is an ``autograd.Function`` with its own ``vmap`` rule, the same pattern
as fpar's collectives: each vmap level (a mesh axis of ``fpar.shard`` or a user's ``vmap``) is
peeled, its batch dim moved to the front and recorded; below the last one the function runs on
plain tensors by *re-creating* the peeled levels with ``torch.func.vmap`` and rebinding the
running shard's frame to them, so collectives inside ``f`` work in the forward and in the
recompute (even after ``fpar.shard`` returned, as for a gradient taken outside it).  The mesh
token and axis indices travel as extra inputs so they are re-batched like everything else.  A
gradient transform *inside* the sharded function stops the peeling (its forward runs with the
mesh levels still live), and ``f`` simply runs there.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary

from .._compile import TRACED
from .._errors import remat_reads_message
from .._recompute import modes
from .._registry import TRANSPARENT
from .._torch_api import is_batchedtensor, maybe_current_level, maybe_get_level
from .._tree import tree_flatten, tree_unflatten
from ._internal import ShardMode, current_frame, enter_frame, internal, shard_mode_active

__all__ = ["remat", "save_alternate_dots", "save_dots"]

Tensor = torch.Tensor

_COMPILED = (
    "fpar.optim.remat({name}) inside a sharded call that torch.compile traces whole: not supported "
    "(its recompute re-creates the mesh's vmap levels, which Dynamo cannot trace). Drop remat from "
    "the compiled step, or drop fullgraph=True to run the sharded call eagerly (remat included)."
)


# torch's vmap errors for a value read (data-dependent control flow, .item(), .tolist())
_VMAP_READS = ("data-dependent control flow", "calling .item()", "calling .tolist()")

RECOMPUTING = [0]  # > 0 while a backward recomputes a remat body's forward (fpar.plan reads it)


def remat(f: Callable, policy: Callable[[str, int], bool] | None = None) -> Callable:
    """Return ``f`` with activation checkpointing: save only its inputs, recompute in backward.

    Works in plain PyTorch, under ``torch.func.grad``/``vjp``/``vmap``, inside ``fpar.shard``
    (collectives included, on both backends) and for gradients taken outside the sharded
    function.  ``f`` must be a deterministic function of its tensor arguments (non-tensor
    arguments are passed through as constants) returning a pytree of tensors; its forward runs
    twice when differentiated.

    ``policy`` (selective recomputation, as ``jax.checkpoint``'s ``policy=``): called as
    ``policy(op, i)`` for each op the forward runs (``op`` its name, ``"aten.mm"``; ``i`` how many
    ops of that name ran before it in this call); where it returns True the op's output is kept
    and the recompute uses it instead of running the op again.  ``save_dots`` keeps every matmul's
    and attention kernel's output; ``save_alternate_dots`` keeps attention's and every other
    matmul's (torchtitan's "op" selective checkpointing).  None (the default) keeps nothing.  The
    recompute must run the same ops as the forward; if it does not, the backward raises.

    Example:
      >>> block = fpar.optim.remat(lambda p, x: torch.relu(x @ p["w1"]) @ p["w2"])
      >>> h = block(params, x)   # backward recomputes x @ w1 and the relu instead of storing them
      >>> block = fpar.optim.remat(layer, policy=fpar.optim.save_dots)   # recomputes the relu only
    """
    if policy is not None and not callable(policy):
        raise TypeError(
            f"fpar.optim.remat: policy must be a function (op name, index) -> bool, such as "
            f"fpar.optim.save_dots, or None; got {type(policy).__name__}."
        )
    return _remat(f, policy, discard=False)


def skip_outputs(f: Callable, policy: Callable[[str, int], bool]) -> Callable:
    """``remat(f)`` whose backward neither keeps nor recomputes the outputs of the ops ``policy`` names.

    For ops whose values the backward never reads: outputs of ``f`` that nothing in ``f``
    consumes, made by ops whose gradients need only their inputs (a matmul).  The forward keeps
    only ``f``'s inputs and the recompute gives those ops uninitialised outputs of the same
    layout, so ``f``'s backward runs everything else again and no named op: Megatron-SP's
    column-parallel entry (``fpar.ops.sp_gather_matmul``: the all-gather runs again, the
    matmul does not).  Internal: reading such an output in ``f`` would be silently wrong.
    """
    return _remat(f, policy, discard=True)


def _remat(f: Callable, policy: Callable[[str, int], bool] | None, *, discard: bool) -> Callable:
    @functools.wraps(f)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if TRACED[0] and torch.compiler.is_compiling():
            raise NotImplementedError(_COMPILED.format(name=getattr(f, "__name__", "f")))
        leaves, treedef = tree_flatten((args, kwargs))
        slots = [i for i, v in enumerate(leaves) if isinstance(v, Tensor)]
        frame = current_frame()
        extra = [] if frame is None else [frame.token, *frame.index.values()]
        call = _Call(
            f,
            treedef,
            leaves,
            slots,
            frame,
            tuple(frame.index) if frame else (),
            policy=policy,
            discard=discard,
        )
        tracker = getattr(frame, "tracker", None)
        if getattr(frame, "calls", None) is not None:  # a real mesh: where the body's collectives start
            call.first_coll = frame.calls[0]
        if getattr(frame, "asked", None) is not None:  # and its varying-axes queries
            call.first_query = frame.asked[0]
        if tracker is not None:  # a real mesh's traced call: its body types the outputs
            call.in_types = [tracker.info(leaves[i]) for i in slots]
        outs = _Remat.apply(call, *(leaves[i] for i in slots), *extra)
        if tracker is not None and "out_types" in call.shared:
            for o, (v, d) in zip(outs, call.shared["out_types"]):
                tracker._mark(o, v, d)
        return tree_unflatten(call.out_treedef, list(outs))

    return wrapped


# The function call, re-creatable under the vmap levels it was peeled from ---------------------


@dataclasses.dataclass
class _Level:
    """One peeled vmap level: its mesh axis (None for a user vmap) and which values it batches."""

    axis: str | None
    in_batched: tuple[bool, ...]
    randomness: str
    out_batched: tuple[bool, ...] = ()


class _Opaque:
    """An output not batched at a re-created level, carried out of it untouched (as in shard)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: Tensor):
        self.tensor = tensor


@dataclasses.dataclass
class _Call:
    f: Callable
    treedef: Any
    leaves: list
    slots: list[int]
    frame: Any
    axes: tuple[str, ...]
    levels: tuple[_Level, ...] = ()  # outermost first
    in_types: list | None = None  # a real mesh's traced call: the tracker's types of the inputs
    first_coll: int | None = None  # a real mesh: the call's count of collectives before the body
    first_query: int | None = None  # a real mesh: the call's count of varying-axes queries before the body
    shared: dict = dataclasses.field(default_factory=dict)  # the output treedef, set by run
    policy: Callable[[str, int], bool] | None = None  # which ops' outputs the forward keeps
    discard: bool = False  # ``skip_outputs``: the policy's ops are neither kept nor recomputed

    @property
    def out_treedef(self):
        return self.shared["out_treedef"]

    def with_level(self, level: _Level) -> _Call:
        return dataclasses.replace(self, levels=(level, *self.levels))

    def run(self, tensors: list[Tensor]) -> tuple[Tensor, ...]:
        """``f`` on ``tensors`` (physical, one leading dim per peeled level that batches them)."""
        rebind = self.frame is not None and any(lv.axis is not None for lv in self.levels)
        fn = self._innermost(rebind)
        for i in reversed(range(len(self.levels))):
            fn = self._level(fn, self.levels[i])
        if self.frame is not None and getattr(self.frame, "direct", None) is not None:
            # A real mesh (no vmap levels): rebind the shard call's frame, so the recomputation
            # in the backward, after the call returned, reaches its collectives.  In a traced
            # call its tracker types the body's ops, so that the outputs vary over the axes the
            # data flow gives them (the in-process mesh's rule), not over every axis.
            frame, tracker = self.frame, self.frame.tracker
            # After the call returned (the recompute in the backward) count its collectives from
            # the body's first, so that each gets the gradient sum the plan put at its output; a
            # plan whose sums sit at their uses types the recompute with a new tracker.
            retracker = None
            if tracker is None and self.in_types is not None and frame.retrace is not None:
                tracker = retracker = frame.retrace()
            typed = tracker is not None and self.in_types is not None and not self.levels
            at, held, query_at = frame.recompute_at, frame.retracker, frame.query_at
            frame.recompute_at = None if self.first_coll is None else [self.first_coll]
            frame.query_at = None if self.first_query is None else [self.first_query]
            frame.retracker = retracker
            try:
                with (
                    enter_frame(frame),
                    tracker.body(tensors, self.in_types, _name(self.f))
                    if typed
                    else contextlib.nullcontext(),
                ):
                    outs = tuple(_unwrap(fn(*tensors)))
                    if typed:
                        self.shared["out_types"] = [tracker.info(o) for o in outs]
                    return outs
            finally:
                frame.recompute_at, frame.retracker, frame.query_at = at, held, query_at
        if not rebind:
            # A user's grad transform inside the sharded function stopped the peeling: the mesh
            # levels are live.  The recompute in backward runs inside torch.autograd.grad, with
            # fpar's mode popped, so restore it: its implicit pvary must be the same as in the
            # forward.
            live = self.frame is not None and self.frame.token is not None and not shard_mode_active()
            with ShardMode(self.frame) if live else contextlib.nullcontext():
                return tuple(_unwrap(fn(*tensors)))
        with enter_frame(self.frame):
            try:
                return tuple(_unwrap(fn(*tensors)))
            except RuntimeError as e:
                # vmap (the in-process mesh's devices) has no per-device value to read: fpar's message,
                # the same as the real mesh's
                read = next((w for w in _VMAP_READS if w in str(e)), None)
                if read is None or self.frame is None or self.frame.token is None:
                    raise
                raise ValueError(remat_reads_message(_name(self.f), read)) from e

    def _innermost(self, rebind: bool) -> Callable:
        n = len(self.slots)

        def run(*flat):
            if rebind:
                self.frame.token = flat[n]
                self.frame.index = dict(zip(self.axes, flat[n + 1 :]))
            leaves = list(self.leaves)
            for i, t in zip(self.slots, flat[:n]):
                leaves[i] = t
            args, kwargs = tree_unflatten(self.treedef, leaves)
            out_leaves, out_treedef = tree_flatten(self.f(*args, **kwargs))
            for v in out_leaves:
                if not isinstance(v, Tensor):
                    raise TypeError(
                        f"fpar.optim.remat({_name(self.f)}): the function returned a "
                        f"{type(v).__name__}; it must return a pytree of tensors."
                    )
            self.shared["out_treedef"] = out_treedef
            return tuple(out_leaves)

        return run

    def _level(self, inner: Callable, level: _Level) -> Callable:
        frame = self.frame

        def body(*flat):
            if level.axis is not None:
                frame.levels[maybe_current_level()] = level.axis
            outs = _unwrap(inner(*flat))
            cur = maybe_current_level()
            level.out_batched = tuple(is_batchedtensor(o) and maybe_get_level(o) == cur for o in outs)
            return (
                tuple(o for o, b in zip(outs, level.out_batched) if b),
                tuple(_Opaque(o) for o, b in zip(outs, level.out_batched) if not b),
            )

        in_dims = tuple(0 if b else None for b in level.in_batched)
        mapped = torch.func.vmap(body, in_dims=in_dims, out_dims=(0, None), randomness=level.randomness)

        def run(*flat):
            batched, opaque = mapped(*flat)
            batched, opaque = iter(batched), iter(opaque)
            return [next(batched) if b else next(opaque) for b in level.out_batched]

        return run


def _unwrap(outs) -> list[Tensor]:
    return [o.tensor if isinstance(o, _Opaque) else o for o in outs]


def _name(f) -> str:
    return getattr(f, "__name__", None) or type(f).__name__


def transparent(cls: type) -> type:
    """Register a Function whose outputs the real mesh's tracker types from its body's ops."""
    TRANSPARENT.add(cls)
    return cls


# The autograd.Function -----------------------------------------------------------------------


@transparent
@internal
class _Remat(torch.autograd.Function):
    generate_vmap_rule = False

    @staticmethod
    def forward(call: _Call, *tensors: Tensor):
        keep = _Keep(call.policy, call.discard) if call.policy is not None else contextlib.nullcontext()
        with torch.no_grad(), keep:  # nothing in here is differentiated: backward recomputes
            outs = call.run([t.detach() for t in tensors])
        if call.policy is not None:
            call.shared["kept"] = keep.finish(outs)
        return outs

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.call = inputs[0]
        ctx.save_for_backward(*inputs[1:])  # the inputs only: that is the point

    @staticmethod
    def backward(ctx, *cts):
        call: _Call = ctx.call
        tensors = list(ctx.saved_tensors)
        n = len(call.slots)  # the rest are the mesh token and indices
        # Differentiate only what needs a gradient: the recompute's backward is real work (and,
        # for a replicated input meeting varying values, a real all-reduce on a real mesh).
        diff = [i for i in range(n) if ctx.needs_input_grad[1 + i]]

        floating: list[bool] = []  # which outputs are differentiated (an integer output is not)

        def again(*primals):
            full = list(tensors)
            for i, t in zip(diff, primals):
                full[i] = t
            outs = call.run(full)
            floating[:] = [o.is_floating_point() or o.is_complex() for o in outs]
            return tuple(o for o, f in zip(outs, floating) if f)

        kept = call.shared.pop("kept", None)  # the policy's outputs, used once and freed
        reuse = _Reuse(call.policy, kept, _name(call.f)) if kept is not None else contextlib.nullcontext()
        # A plain backward (no functorch transform around it, no create_graph: grad mode is off in
        # a Function's backward unless the outer backward records a higher derivative) recomputes
        # by plain autograd.  Otherwise functorch's vjp, which differentiates through the saved
        # inputs themselves (a recompute on detached copies would cut a second derivative's path).
        plain = maybe_current_level() is None and not torch.is_grad_enabled()
        RECOMPUTING[0] += 1  # fpar.plan counts the recomputed forward's ops apart
        try:
            with torch.enable_grad(), reuse:
                if plain:
                    primals = [tensors[i].detach().requires_grad_() for i in diff]
                    outs = again(*primals)
                else:
                    outs, vjp_fn = torch.func.vjp(again, *(tensors[i] for i in diff))
        finally:
            RECOMPUTING[0] -= 1
        if kept is not None:
            reuse.done()
        cts = tuple(c for c, f in zip(cts, floating) if f)
        if plain:
            grads = _grad(outs, primals, cts)
        else:
            cts = tuple(torch.zeros_like(o) if c is None else c for o, c in zip(outs, cts))
            grads = vjp_fn(cts)
        result: list = [None] * len(tensors)
        for i, g in zip(diff, grads):
            result[i] = g
        return (None, *result)

    @staticmethod
    def vmap(info, in_dims, call: _Call, *tensors: Tensor):
        level = (maybe_current_level() or 0) + 1  # the level this rule peels
        frame = call.frame
        axis = frame.levels.get(level) if frame is not None else None
        dims = in_dims[1:]
        moved = [t if d is None else t.movedim(d, 0) for t, d in zip(tensors, dims)]
        rec = _Level(axis, tuple(d is not None for d in dims), info.randomness)
        outs = _Remat.apply(call.with_level(rec), *moved)
        return outs, tuple(0 if b else None for b in rec.out_batched)


def _grad(outs: tuple, primals: list[Tensor], cts: tuple) -> tuple:
    """The recompute's vector-Jacobian product by plain autograd (``None`` where a gradient is zero).

    ``torch.func.vjp`` records the backward for a higher derivative whether or not one follows
    (pytorch#134612), and runs every op and Function of the recompute through functorch's
    wrappers: 12 % of a remat pipeline's simulated step in ``fpar.plan``.
    """
    pairs = [(o, c) for o, c in zip(outs, cts) if c is not None and o.requires_grad]
    if not pairs or not primals:
        return (None,) * len(primals)
    return torch.autograd.grad([o for o, _ in pairs], primals, [c for _, c in pairs], allow_unused=True)


# Selective recomputation: the forward keeps the outputs a policy names, the recompute reuses them

_DOTS = frozenset({"aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm"})
_ATTENTION = frozenset(
    {
        "aten._scaled_dot_product_flash_attention",
        "aten._scaled_dot_product_efficient_attention",
        "aten._scaled_dot_product_cudnn_attention",
        "aten._scaled_dot_product_flash_attention_for_cpu",
    }
)


def save_dots(op: str, index: int) -> bool:
    """A ``remat`` policy: keep every matmul's and attention kernel's output (JAX's ``dots_saveable``)."""
    return op in _DOTS or op in _ATTENTION


def save_alternate_dots(op: str, index: int) -> bool:
    """A ``remat`` policy: keep attention's output and every other ``aten.mm``'s, from the first.

    torchtitan's "op" selective activation checkpointing: it saves the outputs of ``mm`` and the
    attention kernels except every second ``mm``, so the recompute runs half the linear layers'
    matmuls and the element-wise ops between them.  ``aten.bmm`` counts the same way (the
    in-process mesh runs a device-batched matmul as one).
    """
    return op in _ATTENTION or (op in ("aten.mm", "aten.bmm") and index % 2 == 0)


def _op_name(func) -> str:
    return str(func._overloadpacket)


# Ops whose backward reads none of their inputs' values (views, casts, copies, splits, joins): a
# kept matmul's output that reaches a sum over the mesh only through these is not needed by the
# recompute once the sum's output is kept (``fpar/_recompute.py``).  Every other op reads it.
_VALUE_FREE = frozenset(
    "aten." + n
    for n in (
        "view _unsafe_view reshape alias detach t transpose permute expand squeeze unsqueeze "
        "select slice split split_with_sizes unbind chunk narrow movedim _to_copy clone "
        "contiguous cat stack"
    ).split()
)
_REDUCTIONS = frozenset({"psum", "pmean", "psum_scatter"})  # linear, and no larger than their input


def _tensors(args, kwargs):
    for a in (*args, *(kwargs or {}).values()):
        if isinstance(a, Tensor):
            yield a
        elif isinstance(a, (tuple, list)):
            yield from (t for t in a if isinstance(t, Tensor))


class _Mode(TorchDispatchMode):
    """A remat mode: registered as the thread's innermost for the backends' collectives."""

    def __init__(self, policy: Callable[[str, int], bool]):
        super().__init__()
        self.policy = policy
        self.seen: collections.Counter = collections.Counter()
        self.inside = 0  # > 0 inside a collective: its own ops are not the body's

    def __enter__(self):
        modes().append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        modes().pop()
        return super().__exit__(*exc)

    def _count(self, name: str) -> int:
        i, self.seen[name] = self.seen[name], self.seen[name] + 1
        return i


class _Keep(_Mode):
    """The forward: run every op; keep (detached) the outputs the policy names, in order.

    Each kept output is ``(name, index, value)``.  A sum over the mesh whose input is a kept
    output seen only through value-free ops (``psum(x @ w)``) is kept too, and the kept output
    it reduces becomes a layout (``finish``) when nothing else in the body reads it.
    """

    def __init__(self, policy: Callable[[str, int], bool], discard: bool = False):
        super().__init__(policy)
        self.discard = discard
        self.kept: list[tuple[str, int, Any]] = []
        self.derived: WeakTensorKeyDictionary = WeakTensorKeyDictionary()  # tensor -> kept entries
        self.read: set[int] = set()  # kept entries some op or output reads the value of
        self.reduced: dict[int, tuple[frozenset, int]] = {}  # a kept sum -> (its inputs, version)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.inside:
            return out
        name = _op_name(func)
        if not self.discard and self.derived:
            self._trace(name, args, kwargs, out)
        i = self._count(name)
        if self.policy(name, i):
            if not self.discard and isinstance(out, Tensor):
                self.derived[out] = frozenset((len(self.kept),))
            self.kept.append((name, i, _layout_of(out) if self.discard else _detach(out)))
        return out

    def _trace(self, name: str, args, kwargs, out) -> None:
        sources: frozenset = frozenset()
        for t in _tensors(args, kwargs):
            sources |= self.derived.get(t, frozenset())
        if not sources:
            return
        if name not in _VALUE_FREE:
            self.read |= sources
            return
        for o in _tensors((out,) if isinstance(out, Tensor) else out, None):
            self.derived[o] = self.derived.get(o, frozenset()) | sources

    def collective(self, kind: str, x: Tensor, run: Callable[[], Tensor]) -> Tensor:
        self.inside += 1
        try:
            out = run()
        finally:
            self.inside -= 1
        name = "fpar." + kind
        i = self._count(name)
        sources = self.derived.get(x, frozenset()) if not self.discard else frozenset()
        plain = maybe_get_level(x) == -1 and maybe_get_level(out) == -1  # no transform's wrapper
        if sources and kind in _REDUCTIONS and plain:
            self.reduced[len(self.kept)] = (sources, out._version)
            self.kept.append((name, i, out.detach()))
        else:
            self.read |= sources
        return out

    def finish(self, outs) -> list[tuple[str, int, Any]]:
        """The kept outputs for the recompute.

        A sum stays kept in place of the outputs it reduces (which become layouts) where nothing
        else reads them; otherwise its entry is dropped and the recompute runs it again.
        """
        for o in outs:
            self.read |= self.derived.get(o, frozenset())
        sums = {}
        for j, (sources, version) in self.reduced.items():
            if self.kept[j][2]._version != version:  # written in place after the sum: run it again
                self.read |= sources
            else:
                sums[j] = sources
        changed = True
        while changed:  # a sum whose input something else reads runs again, and reads it too
            changed = False
            for j, sources in list(sums.items()):
                if sources & self.read:
                    self.read |= sources
                    del sums[j]
                    changed = True
        unread = set().union(*sums.values()) - self.read if sums else set()
        out = []
        for j, (name, i, v) in enumerate(self.kept):
            if j in self.reduced and j not in sums:
                continue
            out.append((name, i, _layout_of(v) if j in unread else v))
        return out


class _Reuse(_Mode):
    """The recompute: an op the policy names returns the forward's output instead of running."""

    def __init__(self, policy: Callable[[str, int], bool], kept: list, fname: str):
        super().__init__(policy)
        self.kept, self.fname = collections.deque(kept), fname

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.inside:
            return func(*args, **(kwargs or {}))
        name = _op_name(func)
        i = self._count(name)
        if not self.policy(name, i):
            return func(*args, **(kwargs or {}))
        if not self.kept or self.kept[0][0] != name:
            got = self.kept[0][0] if self.kept else "nothing"
            raise RuntimeError(
                f"fpar.optim.remat({self.fname}): the recompute ran {name} (its #{i}) where the "
                f"forward kept {got}: the function ran different ops the second time. A remat'd "
                f"function must be deterministic in the ops it runs."
            )
        kept = self.kept.popleft()[2]
        return _empty_like_layout(kept) if isinstance(kept, _Layout) else kept

    def serves(self, kind: str) -> bool:
        name = "fpar." + kind
        return bool(self.kept) and self.kept[0][:2] == (name, self.seen[name])

    def collective(self, kind: str, x: Tensor, run: Callable[[], Tensor]) -> Tensor:
        serve = self.serves(kind)
        self._count("fpar." + kind)
        if serve:
            return self.kept.popleft()[2]
        self.inside += 1
        try:
            return run()
        finally:
            self.inside -= 1

    def done(self) -> None:
        if self.kept:
            raise RuntimeError(
                f"fpar.optim.remat({self.fname}): the recompute did not run {len(self.kept)} op(s) "
                f"the forward kept (the first: {self.kept[0][0]}): the function ran different ops "
                f"the second time. A remat'd function must be deterministic in the ops it runs."
            )


def _detach(out: Any) -> Any:
    if isinstance(out, Tensor):
        return out.detach()
    if isinstance(out, (tuple, list)):
        return type(out)(_detach(o) for o in out)
    return out


@dataclasses.dataclass(frozen=True)
class _Layout:
    """A discarded output's layout (``skip_outputs``): what the recompute allocates in its place."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


def _layout_of(out: Any) -> Any:
    if isinstance(out, Tensor):
        return _Layout(tuple(out.shape), tuple(out.stride()), out.dtype, out.device)
    raise NotImplementedError(
        f"fpar.optim._remat.skip_outputs: an op with {type(out).__name__} outputs cannot be skipped."
    )


def _empty_like_layout(layout: _Layout) -> Tensor:
    return torch.empty_strided(layout.shape, layout.stride, dtype=layout.dtype, device=layout.device)
