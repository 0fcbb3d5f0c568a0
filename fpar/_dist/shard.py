"""``fpar.shard`` on a real mesh: a plan per signature, then the function on plain local tensors.

On a real mesh every process holds its own blocks, so nothing needs batching: the per-device
function runs on the plain local tensors, and a collective is a process-group call
(``exchange.py``'s ``_Exchange``).  What needs care is the gradient of *replicated* values.

**The plan.**  The first call per signature (the function, its specs and ``check_rep``, every
argument's shape, dtype and ``requires_grad``) runs *traced*: a ``TorchFunctionMode`` tracks
which mesh axes every value varies over (inputs by their specs, axis indices, collectives by
their kind) and, JAX-style, inserts a pvary (identity forward, all-reduce of the cotangent
backward) on every replicated float operand at each such meeting.  That call's values and
gradients are right by construction.  It also records, for every *source* of a replicated
value (an input replicated over ``a``; the output of a psum/pmean/pmax/pmin/
all_gather_invariant over ``a``) and axis, whether the values derived from it by replicated
computation are used through a pvary, used replicated into an output, or both.  By linearity
(the derivation is the same on every device of ``a``, so a sum over ``a`` commutes with its
transpose), when every use goes through a pvary, summing the cotangent once at the source is
the same as summing it at every use.  So later calls run **fast**: no interception at all,
each such source wrapped once in an identity whose backward all-reduces over its axes (the
data-parallel gradient all-reduce, bucketed like DDP, see ``buckets.py``), and no
size-1 anything.  Under ``fpar.defer_reduction()`` those input-source sums are kept locally
and reduced by the next call outside the context (``buckets.py``, ``fpar/_defer.py``); sums at
collective outputs reduce at once.  A fast plan's first (traced) call does its input-source sums
as a steady call would (``traced_sums.py``), so a step adds its microbatches' gradients in
one order whichever of its calls traced (a resumed run is bitwise the uninterrupted one).  A signature for which some source is used
both ways, a replicated tensor of unknown origin (a closure-captured parameter) meets a varying
value, or the function differentiates inside itself (an inner ``torch.func.grad``) keeps running
traced.

The plan assumes the data flow (which values meet which, which collectives run in which order)
depends on shapes, not on values; a changed sequence of collectives in a fast call raises.

Two rooms beside this one: ``tracker.py`` (the traced call: varying axes, implicit pvaries, which
cotangents are summed) and ``agreement.py`` (the per-call signature check).
"""

from __future__ import annotations

import contextlib
import ctypes
from typing import Any

import torch
import torch.distributed as dist
from torch._C._functorch import maybe_current_level

from .._collectives import Frame, frames
from .._compile import eager, signature_key
from .._errors import ReplicationError, check_in_leaf, check_out_leaf, replication_message
from .._spec import check_spec
from .._tree import keystr, tree_flatten, tree_flatten_with_path, tree_unflatten
from .agree import digest
from .agreement import _Agreement
from .buckets import reduce_inputs
from .compiled import groups_of
from .exchange import _Exchange, _TakeFirst, summed
from .groups import _device, on_paper, simulated
from .lowered import Foreign, lowered, lowering_level
from .traced_sums import traced_sums
from .tracker import _Tracker

__all__ = ["DistShard"]

Tensor = torch.Tensor


class _Plan:
    """What the traced first call learned about one signature."""

    __slots__ = (
        "digest",
        "sig",
        "fast",
        "at_use",
        "in_reduce",
        "in_order",
        "coll",
        "out_broken",
        "out_specs",
        "out_treedef",
        "varying",
        "flats",
        "layouts",
        "heads",
        "lone",
        "read_inside",
        "groups",
    )

    def __init__(self, digest: int):
        self.digest = digest
        self.sig: list = []  # (argument, spec, shape, dtype, requires_grad) per tensor argument
        self.fast = False
        # (source, axis) pairs whose cotangent sums sit at their uses (tracker.finish); every other
        # source's sum is at the source, as in a fast plan, even in a signature that stays traced
        self.at_use: frozenset = frozenset()
        self.in_reduce: dict[int, tuple[str, ...]] = {}  # tensor slot -> axes to all-reduce
        self.in_order: list[int] = []  # those slots, latest first use first (gradient-ready order)
        self.coll: list[tuple[str, tuple, tuple[str, ...]]] = []  # (kind, axes, axes to all-reduce)
        self.out_broken: list[tuple[str, ...]] = []
        self.out_specs: list = []
        self.out_treedef = None
        self.flats: dict[Any, Tensor] = {}  # gradient buckets' flat buffers, reused across calls
        self.layouts: dict = {}  # gradient buckets' layouts (buckets._Layout), by the sources' flows
        self.heads: dict[tuple, Tensor] = {}  # first-message headers, by their values
        self.lone = False  # another collective came before bucket 0 could ride: send at once
        # the traced call read the carried sum inside the function (a tensor-parallel activation,
        # not a loss it returns): planned calls wait for it there and go on with a plain tensor
        # (nothing to gain from a Pending, and Dynamo traces none: a compiled f goes on compiled)
        self.read_inside = False
        self.varying: list = []  # (shape, dtype, axes) of each value queried for the axes it varies over, in order
        self.groups = None  # compiled.groups_of: the process groups a compiled call uses


class DistShard:
    """The real-mesh side of one ``fpar.shard(f, mesh, in_specs, out_specs)``: its plan cache."""

    def __init__(self, f, fname: str, mesh, in_specs, out_specs, check_rep: bool, prefix, bucket_mb: float):
        self.f, self.fname, self.mesh = f, fname, mesh
        self.bucket_mb = bucket_mb
        self.in_specs, self.out_specs, self.check_rep = in_specs, out_specs, check_rep
        self._prefix = prefix  # _shard._prefix: spec tree broadcast with the user-facing errors
        self.axes = mesh.axis_names
        self.wire_key = frozenset(self.axes)  # its first messages' wire (MeshGroups.wires)
        self.mg = mesh._dist
        self.plans: dict[Any, _Plan] = {}
        self.compiled_plans: dict[tuple, _Plan] = {}  # compiled.signature_key -> plan (eager calls')
        self.spec_cache: dict[Any, list] = {}
        self.static_text = repr((in_specs, out_specs, check_rep))
        self.index = None
        # torch.func.grad lowered to plain autograd inside the call (lowered.py): the signatures
        # that may not be, and whether a lowered call is running (its plans are kept apart, each
        # traced once with the check that it captures no differentiated tensor)
        self.unlowered: set = set()
        self.below = False

    # -- a call ----------------------------------------------------------------------------

    def __call__(self, args: tuple) -> Any:
        # No torch.compile check here: the sharded function that calls this is
        # torch.compiler.disable'd (fpar/_compile.py), so Dynamo never traces a real-mesh call.
        if self.mesh.abstract and not simulated():  # set-up code on a mesh on paper: device 0
            with on_paper(self.mesh):
                return self(args)
        leaves, treedef = tree_flatten(args)
        specs = self.spec_cache.get(treedef)
        if specs is None:
            specs = self._prefix(self.fname, "in_specs", self.in_specs, args, "the arguments")
            self.spec_cache[treedef] = specs
        key = [treedef, self.below]
        wrapped = False
        for leaf, spec in zip(leaves, specs):
            if spec is None:
                key.append(("static", _static_key(leaf)))
            elif isinstance(leaf, Tensor):
                w = _wrapped(leaf)
                wrapped = wrapped or w
                key.append((leaf.shape, leaf.dtype, leaf.requires_grad, w))
            else:
                key.append(("bad", type(leaf)))
        key = tuple(key)
        if wrapped and key not in self.unlowered:
            level = lowering_level(leaves)
            if level is not None:
                self.below = True
                try:
                    return lowered(self, leaves, treedef, level)
                except Foreign:  # f captures a differentiated tensor: run it at the transform's level
                    self.unlowered.add(key)
                finally:
                    self.below = False
        plan = self.plans.get(key)
        if plan is None:
            return self._first(args, leaves, treedef, specs, key)
        return self._run(plan, leaves, treedef, specs, traced=not plan.fast)

    def _first(self, args, leaves, treedef, specs, key) -> Any:
        PLANNED[0] += 1
        paths, _, _ = tree_flatten_with_path(args)
        sig = []
        for path, leaf, spec in zip(paths, leaves, specs):
            where = f"fpar.shard({self.fname}): args{keystr(path)}"
            if spec is None:
                continue
            check_in_leaf(where, leaf, spec)
            check_spec(spec, tuple(leaf.shape), self.mesh.shape, where=where, blocks=True)
            # requires_grad: which inputs get gradients sets the gradient buckets' layout
            sig.append(
                (f"args{keystr(path)}", str(spec), tuple(leaf.shape), str(leaf.dtype), leaf.requires_grad)
            )
        text = repr((self.fname, self.static_text, self.bucket_mb, sig))  # bucket_mb: the buckets' sizes
        plan = _Plan(digest(text))
        plan.sig = sig
        out = self._run(plan, leaves, treedef, specs, traced=True, first=True)
        self.plans[key] = plan
        if (
            not self.below
            and maybe_current_level() is None
            and not any(isinstance(x, Tensor) and _wrapped(x) for x in leaves)
        ):
            if plan.fast:
                plan.groups = groups_of(plan, self.mg)
            self.compiled_plans[signature_key(args)] = plan  # for torch.compile (compiled.py)
        return out

    def _run(self, plan: _Plan, leaves, treedef, specs, *, traced: bool, first: bool = False):
        mg = self.mg
        agree = _Agreement(self, plan, lazy=not traced)
        tracker = _Tracker(self, plan) if traced else None
        frame = Frame(mesh=self.mesh, fname=self.fname, exchange=None, backend="dist")
        frame.token = _TOKEN
        frame.index = self._index(leaves)
        frame.coords = mg.coords
        if tracker is not None:
            for a, t in frame.index.items():
                tracker._mark(t, frozenset((a,)), frozenset())
        calls = [0]
        done = [False]  # after the call: collectives come from a recomputation in the backward

        def direct(kind: str, axes: tuple, params: tuple, x: Tensor) -> Tensor:
            if done[0]:
                return self._recompute(plan, frame, kind, axes, params, x)
            k = calls[0]
            calls[0] += 1
            if tracker is not None:
                if tracker.below:
                    tracker.check_below((x,))
                if kind != "pvary":
                    params = agree.carry(kind, axes, x, params)
                return tracker.collective(k, kind, axes, params, x)
            if k >= len(plan.coll) or plan.coll[k][:2] != (kind, axes):
                raise RuntimeError(
                    f"fpar.shard({self.fname}): collective #{k} is {kind} over {axes}, but the first "
                    f"call with these shapes ran "
                    + (f"{plan.coll[k][0]} over {plan.coll[k][1]}" if k < len(plan.coll) else "fewer")
                    + ". The real mesh plans a call once per signature; a function whose sequence of "
                    "collectives depends on values, not shapes, is not supported."
                )
            if kind == "pvary":
                y = x.view_as(x)
            else:
                y = summed(x, kind, agree.carry(kind, axes, x, params), axes, mg)
            reduce = plan.coll[k][2]
            if reduce:
                y = _grad_sum(y, reduce, mg)
            return y

        frame.collective = frame.direct = direct
        frame.tracker, frame.calls = tracker, calls
        frame.retrace = lambda: None if plan.fast else _Tracker(self, plan)
        frame.asked = [0]
        frame.varying = lambda x: self._varying(plan, frame, tracker, done[0], first, x)
        local = list(leaves)
        wrapped: dict = {}
        if plan.in_reduce and not first:
            # a fast call, or one of a signature that stays traced (some sums at their uses): the
            # sums at its input sources bucketed, and deferred over microbatches
            sources = [(i, leaves[i], plan.in_reduce[i]) for i in plan.in_order]
            wrapped, grads = reduce_inputs(
                sources,
                mg,
                self.bucket_mb,
                owner=(self, plan),
                fname=self.fname,
                kept=plan.flats,
                layouts=plan.layouts,
                rider=None if plan.lone or tracker is not None else agree,
            )
            if tracker is None:
                agree.grads = grads
            for i, x in wrapped.items():
                local[i] = x
        if tracker is not None:
            tracker.wrapped = set(wrapped)
            for i, (leaf, spec) in enumerate(zip(local, specs)):
                if spec is not None and isinstance(leaf, Tensor):
                    local[i] = tracker.enter(i, leaf, spec)
        frames().append(frame)
        ok = False
        try:
            if tracker is not None:
                with tracker, eager():  # a compiled f runs eagerly here: every op is intercepted
                    out = self.f(*tree_unflatten(treedef, local))
                    outs = self._outputs(plan, tracker, out, first)
            else:
                drawn = _generator_states()
                # Under a torch.func transform entered from eager code, torch does not compile
                # a frame (pytorch#128711) and would mark f's code skipped for every later
                # compile in this process (its .backward() calls too): run it eagerly there.
                with eager() if maybe_current_level() is not None else contextlib.nullcontext():
                    out = self.f(*tree_unflatten(treedef, local))
                if _generator_states() != drawn:
                    raise RuntimeError(_drew_message(self.fname))
                outs, treedef_out = tree_flatten(out)
                if treedef_out != plan.out_treedef:
                    raise RuntimeError(
                        f"fpar.shard({self.fname}): the output structure changed between calls with "
                        f"the same argument shapes ({plan.out_treedef} then {treedef_out})."
                    )
            ok = True
        finally:
            frames().pop()
            done[0] = True
            frame.tracker = None
            if not ok:
                agree.settle()  # the function raised: tell the other ranks, keep its error
        agree.finish()
        if tracker is not None and tracker.below and _anywhere(tracker.foreign, mg, self.axes):
            raise Foreign  # every rank, after the whole forward: run the call again unlowered
        if tracker is not None:
            tracker.finish()
            if first and plan.in_reduce:
                # inside fpar.defer_reduction(), the input-source sums go where a steady call's
                # would: the same deferred buffers, added in the same order
                tracker.late = traced_sums(
                    [(i, leaves[i], plan.in_reduce[i]) for i in plan.in_order],
                    mg,
                    self.bucket_mb,
                    owner=(self, plan),
                    fname=self.fname,
                    kept=plan.flats,
                    layouts=plan.layouts,
                )
        result = []
        for t, spec, broken in zip(outs, plan.out_specs, plan.out_broken):
            if spec is not None and broken:
                t = _TakeFirst.apply(t, broken, mg)
            result.append(t)
        return tree_unflatten(plan.out_treedef, result)

    def _recompute(self, plan: _Plan, frame, kind: str, axes: tuple, params: tuple, x: Tensor) -> Tensor:
        """A collective of the function run again in the backward (``fpar.optim.remat``).

        A fast plan places every sum once: at its inputs, which the recomputed region does not
        touch, or at a collective's output, which the region's collective ``k`` applies again
        (``frame.recompute_at`` counts from the region's first).  A plan whose sums sit at their
        uses runs the region under a new tracker (``frame.retracker``, set by remat), which
        inserts them again.
        """
        at = frame.recompute_at
        if frame.retracker is not None and at is not None:
            # a plan whose sums sit at their uses: the region runs typed again, each collective
            # (and the implicit pvaries between them) as in the traced call
            k = at[0]
            at[0] += 1
            return frame.retracker.collective(k, kind, axes, params, x)
        if not plan.fast or (at is None and any(r for _, _, r in plan.coll)):
            raise NotImplementedError(
                f"fpar.shard({self.fname}) on a real mesh: a recomputation in the backward "
                f"(fpar.optim.remat) of a function whose replicated values need gradient sums "
                f"inside the recomputed region is not supported yet; move the remat boundary so "
                f"replicated parameters enter it as inputs of the sharded function."
            )
        y = x.view_as(x) if kind == "pvary" else _Exchange.apply(x, kind, params, 0, axes, self.mg)
        if at is None:
            return y
        k = at[0]
        at[0] += 1
        if k >= len(plan.coll) or plan.coll[k][:2] != (kind, axes):
            raise RuntimeError(
                f"fpar.shard({self.fname}): the recomputation in the backward (fpar.optim.remat) ran "
                f"{kind} over {axes} as collective #{k}, but the forward ran "
                + (f"{plan.coll[k][0]} over {plan.coll[k][1]}" if k < len(plan.coll) else "fewer")
                + ": a remat function must run the same collectives every time (no value-dependent branches)."
            )
        reduce = plan.coll[k][2]
        return _grad_sum(y, reduce, self.mg) if reduce else y

    def _varying(self, plan: _Plan, frame, tracker, done: bool, first: bool, x: Tensor) -> frozenset:
        """The mesh axes ``x`` varies over (``Frame.varying``; e.g. dropout's batch axes).

        A traced call answers from its tracker, and the signature's first records each answer in
        query order (with the queried value's shape and dtype); a fast call answers its ``k``-th
        query from the record's ``k``-th, and a recomputation in the backward
        (``fpar.optim.remat``) counts from its body's first query.  The data flow depends on shapes
        only, so the answers are exact, however many values of one shape vary differently.  A
        recomputation of a plan kept traced is typed by a fresh tracker (``frame.retracker``).
        """
        if not isinstance(x, Tensor):
            raise TypeError(f"fpar.shard({self.fname}): expected a tensor, got {type(x).__name__}.")
        key = (tuple(x.shape), x.dtype)
        if done and frame.retracker is not None:
            return frozenset(frame.retracker.info(x)[0])
        counter = frame.query_at if done else frame.asked
        k = -1 if counter is None else counter[0]
        if counter is not None:
            counter[0] += 1
        if tracker is not None and not done:
            v = frozenset(tracker.info(x)[0])
            if first:
                plan.varying.append((*key, v))
            return v
        if 0 <= k < len(plan.varying) and plan.varying[k][:2] == key:
            return plan.varying[k][2]
        raise RuntimeError(
            f"fpar.shard({self.fname}) on a real mesh: query #{k} for the mesh axes a value varies over "
            f"(e.g. by dropout) is of a value of shape {key[0]} and dtype {key[1]}, but the first call "
            f"with these argument shapes asked "
            + (
                f"of shape {plan.varying[k][0]} and dtype {plan.varying[k][1]}"
                if 0 <= k < len(plan.varying)
                else "fewer"
            )
            + ". The real mesh plans a call once per signature; a function whose data flow depends on "
            "values, not shapes, is not supported (or pass the layout explicitly: fpar.ops.dropout's "
            "spec=, the layers' batch_axes=)."
        )

    def _outputs(self, plan: _Plan, tracker: _Tracker, out: Any, first: bool) -> list:
        """Check the outputs against out_specs (first call) and pvary replicated named ones."""
        paths, leaves, treedef = tree_flatten_with_path(out)
        if first:
            plan.out_treedef = treedef
            plan.out_specs = self._prefix(self.fname, "out_specs", self.out_specs, out, "the outputs")
        outs = []
        for path, leaf, spec in zip(paths, leaves, plan.out_specs):
            where = f"fpar.shard({self.fname}): out{keystr(path)}"
            if check_out_leaf(where, leaf, spec):
                outs.append(leaf)
                if first:
                    plan.out_broken.append(())
                continue
            if first:
                check_spec(spec, tuple(leaf.shape), self.mesh.shape, where=where, blocks=True)
            varying, _ = tracker.info(leaf)
            named = set(spec.axes())
            broken = tuple(a for a in self.axes if a not in named and a in varying)
            if broken and self.check_rep:
                raise ReplicationError(replication_message(where, spec, list(broken)))
            if first:
                plan.out_broken.append(broken)
            outs.append(tracker.output(leaf, tuple(a for a in self.axes if a in named)))
        return outs

    def _index(self, leaves) -> dict[str, Tensor]:
        """This rank's coordinate per axis, as 0-d int64 tensors on the arguments' device."""
        device = next((x.device for x in leaves if isinstance(x, Tensor)), None)
        if device is not None and device.type == "meta":  # fpar.plan: the coordinate is known, keep its value
            device = torch.device("cpu")
        if self.index is None or (device is not None and self.index[0] != device):
            dev = device if device is not None else _device([])
            self.index = (
                dev,
                {a: torch.full((), self.mg.coords[a], dtype=torch.int64, device=dev) for a in self.axes},
            )
        return self.index[1]


_TOKEN = torch.zeros(())  # any non-None token: marks the frame as a running shard call
PLANNED = [0]  # signatures planned so far in this process (fpar.plan: was a call a steady one?)


def _anywhere(flag: bool, mg, axes: tuple) -> bool:
    """Whether any process of the mesh saw ``flag`` (a lowered call's first run met a captured tensor).

    Decided together, after the whole forward: ranks may run different ops (a pipeline stage's),
    so one rank stopping early to run the call again would pair its collectives with another
    rank's later ones.  Control traffic, as the signature check: not in ``fpar.comm_stats``.
    On paper every process runs the same ops: its own flag.
    """
    if simulated():
        return flag
    t = torch.tensor([float(flag)], device=_device([]))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=mg.group(axes))
    return bool(t.item())


def _static_key(leaf: Any) -> Any:
    try:
        hash(leaf)
        return (type(leaf), leaf)
    except TypeError:
        return (type(leaf), id(leaf))


def _wrapped(t: Tensor) -> bool:
    """Whether ``t`` is wrapped by a functorch transform (a plan per such case)."""
    return torch._C._functorch.is_functorch_wrapped_tensor(t)


def _bytes(state: torch.Tensor) -> bytes:
    """A generator state's bytes (a contiguous CPU uint8 tensor), without numpy: fpar does not need it."""
    return ctypes.string_at(state.data_ptr(), state.numel())


def _generator_states() -> tuple:
    """The state of torch's default generators (CPU, and the current CUDA device's if in use).

    A fast call runs with no interception, so a torch random op that first appears after the
    traced call (a branch on ``model.training``) is caught by comparing these before and after.
    """
    # no dispatch mode sees the state tensor (fpar.plan's memory count would take it for a buffer)
    with torch._C._DisableTorchDispatch():
        if maybe_current_level() is None:
            cpu = _bytes(torch.default_generator.get_state())
        else:  # under torch.func.grad/vmap: read the state as a plain tensor
            with torch._C._DisableFuncTorch():
                cpu = _bytes(torch.default_generator.get_state())
    if torch.cuda.is_initialized():
        return cpu, torch.cuda.default_generators[torch.cuda.current_device()].get_offset()
    return (cpu,)


def _drew_message(fname: str) -> str:
    return (
        f"fpar.shard({fname}): a torch random op (torch.rand, torch.randn, torch.nn.functional.dropout, "
        f"...) drew from torch's generator inside the sharded function. torch's random ops draw from "
        f"a per-process generator, so the result would depend on the mesh layout (or repeat on "
        f"every device). Use fpar.random with an explicit key instead (fpar.random.uniform / normal "
        f"/ bernoulli, fpar.ops.dropout(key, x, rate, spec=...); pass the key in with in_spec P()), "
        f"or draw outside fpar.shard and pass the tensor in with a spec."
    )


def _grad_sum(x: Tensor, axes: tuple[str, ...], mg) -> Tensor:
    """Identity forward; all-reduces the cotangent over ``axes`` backward (counted when issued)."""
    return _Exchange.apply(x, "pvary", (), 0, axes, mg)
