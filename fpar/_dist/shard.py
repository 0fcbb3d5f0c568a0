"""``fpar.shard`` on a real mesh: a plan per signature, then the function on plain local tensors.

On a real mesh every process holds its own blocks, so nothing needs batching: the per-device
function runs on the plain local tensors, and a collective is a process-group call
(``exchange.py``'s ``_Exchange``).  What needs care is the gradient of *replicated* values.

**Which cotangents are summed.**  A value replicated over axis ``a`` (the same on every device
of ``a``) has, in the global function, one copy per device wherever it meets a value varying
over ``a`` (JAX's implicit ``pvary``), enters a collective over ``a``, or leaves through an
output whose spec names ``a``.  The transpose of each such copy sums the cotangent over ``a``.
Cotangent that flows through replicated computation only (a weight used after a psum over
'tensor', in Megatron TP) is *not* summed.

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
collective outputs and traced calls reduce at once.  A signature for which some source is used
both ways, a replicated tensor of unknown origin (a closure-captured parameter) meets a varying
value, or the function differentiates inside itself (an inner ``torch.func.grad``) keeps running
traced.

**Agreement.**  Every rank must call with the same signature (shapes, dtypes, specs).  No
message is sent just to check it: every rank's first message of a call is the same SUM
all-reduce over the mesh's own ranks (``_Agreement``), of the mesh's current *wire* (a dtype and
a length every rank holds alike, sized by earlier verdicts: ``_Wire``), carrying the signature's
56-bit hash in a form whose sums show whether all ranks agree, and, when they fit, the block of
the call's first collective if it is a float psum/pmean over every mesh axis (a data-parallel
loss) and the call's first gradient bucket (``buckets.py``): such a call's first message waits
for that bucket's launch in the backward, so a small data-parallel step makes one round trip.
Otherwise it goes alone just before the first collective or before returning.  On a planned
call a carried block's message is sent without waiting: the result is a ``Pending`` tensor,
whose sum and check are read at its first use or before the next collective fpar issues
(``pending.py``), so a data-parallel step synchronises once, at its gradients.  Because every
rank's first message has the same form, a rank whose cache hits pairs with one that misses and
ranks that disagree never meet in different collectives.  On mismatch every rank gathers the
signatures and raises naming the argument, ranks and what differs; a rank whose function raises
before its first collective sends its part flagged, and the others raise naming it.  The plan
itself holds no state a rank could disagree on; the wire's size changes only in a verdict, from
the sums every rank reads.

The plan assumes the data flow (which values meet which, which collectives run in which order)
depends on shapes, not on values; a changed sequence of collectives in a fast call raises.
"""

from __future__ import annotations

import collections
import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch._C._functorch import maybe_current_level
from torch.overrides import TorchFunctionMode

from .. import _defer
from .. import _stats as stats
from .._buffers import block, kept_or_new
from .._collectives import Frame, frames
from .._compile import eager, untraced
from .._errors import ReplicationError
from .._registry import bound_once
from .._spec import PartitionSpec, check_spec
from .._tree import keystr, tree_flatten, tree_flatten_with_path, tree_unflatten
from ..random._guard import RANDOM_OPS, check_random_op
from . import pending
from .agree import _CHUNKS, agreed, digest, failed_bit, failed_error, hash_values
from .buckets import reduce_inputs
from .exchange import _Exchange, _TakeFirst, summed
from .groups import _device
from .pending import Pending, defer

__all__ = ["DistShard"]

Tensor = torch.Tensor
_REDUCING = {"psum", "pmean", "pmax", "pmin", "all_gather_invariant"}
_NOT_OPS = {
    torch.autograd.grad,
    torch.autograd.backward,
    torch.Tensor.backward,
    torch.Tensor.register_hook,
    torch.Tensor.requires_grad_,
}


# What reads a tensor's value without returning a tensor (as the ops that make a ``Pending`` wait)
_VALUE_READS = {
    Tensor.item, Tensor.tolist, Tensor.numpy, Tensor.__bool__, Tensor.__float__, Tensor.__int__,
    Tensor.__index__, Tensor.__format__, Tensor.__repr__, Tensor.__array__, Tensor.data_ptr,
}
_SHAPE_LIKE = {torch.ones_like, torch.zeros_like, torch.empty_like}


def _reads_value(func, result: Any) -> bool:
    """Whether an op that took a tensor read its value (not only its shape, dtype or device)."""
    if func in _VALUE_READS:
        return True
    if func in _SHAPE_LIKE:
        return False
    return any(isinstance(t, Tensor) for t in (result if isinstance(result, (tuple, list)) else (result,)))


def _diff(t: Tensor) -> bool:
    """Whether a cotangent can flow to ``t`` (float or complex dtype)."""
    return t.is_floating_point() or t.is_complex()


class _Plan:
    """What the traced first call learned about one signature."""

    __slots__ = (
        "digest", "sig", "fast", "in_reduce", "in_order", "coll", "out_broken", "out_specs", "out_treedef",
        "varying", "flats", "layouts", "heads", "lone", "read_inside",
    )

    def __init__(self, digest: int):
        self.digest = digest
        self.sig: list = []  # (argument, spec, shape, dtype, requires_grad) per tensor argument
        self.fast = False
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
        self.varying: dict = {}  # (shape, dtype) -> axes a queried value varies over (None: ambiguous)


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
        self.spec_cache: dict[Any, list] = {}
        self.static_text = repr((in_specs, out_specs, check_rep))
        self.index = None

    # -- a call ----------------------------------------------------------------------------

    def __call__(self, args: tuple) -> Any:
        # No torch.compile check here: the sharded function that calls this is
        # torch.compiler.disable'd (fpar/_compile.py), so Dynamo never traces a real-mesh call.
        leaves, treedef = tree_flatten(args)
        specs = self.spec_cache.get(treedef)
        if specs is None:
            specs = self._prefix(self.fname, "in_specs", self.in_specs, args, "the arguments")
            self.spec_cache[treedef] = specs
        key = [treedef]
        for leaf, spec in zip(leaves, specs):
            if spec is None:
                key.append(("static", _static_key(leaf)))
            elif isinstance(leaf, Tensor):
                key.append((leaf.shape, leaf.dtype, leaf.requires_grad, _wrapped(leaf)))
            else:
                key.append(("bad", type(leaf)))
        key = tuple(key)
        plan = self.plans.get(key)
        if plan is None:
            return self._first(args, leaves, treedef, specs, key)
        return self._run(plan, leaves, treedef, specs, traced=not plan.fast)

    def _first(self, args, leaves, treedef, specs, key) -> Any:
        paths, _, _ = tree_flatten_with_path(args)
        sig = []
        for i, (path, leaf, spec) in enumerate(zip(paths, leaves, specs)):
            where = f"fpar.shard({self.fname}): args{keystr(path)}"
            if spec is None:
                continue
            if not isinstance(leaf, Tensor):
                raise TypeError(
                    f"{where} is a {type(leaf).__name__}, not a tensor, but its in_spec is {spec}. "
                    f"Pass a tensor, or give it the in_spec None to pass it through untouched."
                )
            check_spec(spec, tuple(leaf.shape), self.mesh.shape, where=where, blocks=True)
            # requires_grad: which inputs get gradients sets the gradient buckets' layout
            sig.append((f"args{keystr(path)}", str(spec), tuple(leaf.shape), str(leaf.dtype), leaf.requires_grad))
        text = repr((self.fname, self.static_text, self.bucket_mb, sig))  # bucket_mb: the buckets' sizes
        plan = _Plan(digest(text))
        plan.sig = sig
        out = self._run(plan, leaves, treedef, specs, traced=True, first=True)
        self.plans[key] = plan
        return out

    def _run(self, plan: _Plan, leaves, treedef, specs, *, traced: bool, first: bool = False):
        mg = self.mg
        agree = _Agreement(self, plan, lazy=not traced)
        tracker = _Tracker(self, plan) if traced else None
        frame = Frame(mesh=self.mesh, fname=self.fname, exchange=None, backend="dist")
        frame.token = _TOKEN
        frame.index = self._index(leaves)
        if tracker is not None:
            for a, t in frame.index.items():
                tracker._mark(t, frozenset((a,)), frozenset())
        calls = [0]
        done = [False]  # after the call: collectives come from a recomputation in the backward

        def direct(kind: str, axes: tuple, params: tuple, x: Tensor) -> Tensor:
            if done[0]:
                return self._recompute(plan, kind, axes, params, x)
            k = calls[0]
            calls[0] += 1
            if tracker is not None:
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

        frame.direct = direct
        frame.varying = lambda x: self._varying(plan, tracker, done[0], x)
        local = list(leaves)
        if tracker is not None:
            for i, (leaf, spec) in enumerate(zip(leaves, specs)):
                if spec is not None and isinstance(leaf, Tensor):
                    local[i] = tracker.enter(i, leaf, spec)
        elif plan.in_reduce:
            sources = [(i, leaves[i], plan.in_reduce[i]) for i in plan.in_order]
            wrapped, agree.grads = reduce_inputs(
                sources, mg, self.bucket_mb, owner=(self, plan), fname=self.fname, kept=plan.flats, layouts=plan.layouts,
                rider=None if plan.lone else agree,
            )
            for i, x in wrapped.items():
                local[i] = x
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
            if not ok:
                agree.settle()  # the function raised: tell the other ranks, keep its error
        agree.finish()
        if tracker is not None:
            tracker.finish()
        result = []
        for t, spec, broken in zip(outs, plan.out_specs, plan.out_broken):
            if spec is not None and broken:
                t = _TakeFirst.apply(t, broken, mg)
            result.append(t)
        return tree_unflatten(plan.out_treedef, result)

    def _recompute(self, plan: _Plan, kind: str, axes: tuple, params: tuple, x: Tensor) -> Tensor:
        """A collective of the function run again in the backward (``fpar.optim.remat``).

        Right when every sum of the signature sits at its inputs (a fast plan without sums at
        collective outputs): the recomputed region then needs none of its own.
        """
        if not plan.fast or any(r for _, _, r in plan.coll):
            raise NotImplementedError(
                f"fpar.shard({self.fname}) on a real mesh: a recomputation in the backward "
                f"(fpar.optim.remat) of a function whose replicated values need gradient sums "
                f"inside the recomputed region is not supported yet; move the remat boundary so "
                f"replicated parameters enter it as inputs of the sharded function."
            )
        return x.view_as(x) if kind == "pvary" else _Exchange.apply(x, kind, params, 0, axes, self.mg)

    def _varying(self, plan: _Plan, tracker: _Tracker | None, done: bool, x: Tensor) -> frozenset:
        """The mesh axes ``x`` varies over (``Frame.varying``; e.g. dropout's batch axes).

        A traced call answers from its tracker and records the answer per (shape, dtype) of the
        queried value; a fast call, and a recomputation in the backward (``fpar.optim.remat``),
        answer from that record, which is exact because the data flow depends on shapes only.
        Two values of one shape and dtype varying over different axes keep the signature traced.
        """
        if not isinstance(x, Tensor):
            raise TypeError(f"fpar.shard({self.fname}): expected a tensor, got {type(x).__name__}.")
        key = (tuple(x.shape), x.dtype)
        if tracker is not None and not done:
            v = frozenset(tracker.info(x)[0])
            if plan.varying.setdefault(key, v) != v:
                plan.varying[key] = None
            return v
        v = plan.varying.get(key, _UNSEEN)
        if v is None or v is _UNSEEN:
            raise RuntimeError(
                f"fpar.shard({self.fname}) on a real mesh: a value of shape {key[0]} and dtype {key[1]} "
                + (
                    "is queried for the mesh axes it varies over (e.g. by dropout) in a recomputation "
                    "in the backward (fpar.optim.remat), but values of that shape and dtype vary over "
                    "different axes in this function, so the answer is ambiguous; pass the layout "
                    "explicitly (fpar.ops.dropout's spec=, the layers' batch_axes=)."
                    if v is None
                    else "is queried for the mesh axes it varies over (e.g. by dropout), but the first "
                    "call with these shapes queried none such. The real mesh plans a call once per "
                    "signature; a function whose data flow depends on values, not shapes, is not supported."
                )
            )
        return v

    def _outputs(self, plan: _Plan, tracker: _Tracker, out: Any, first: bool) -> list:
        """Check the outputs against out_specs (first call) and pvary replicated named ones."""
        paths, leaves, treedef = tree_flatten_with_path(out)
        if first:
            plan.out_treedef = treedef
            plan.out_specs = self._prefix(self.fname, "out_specs", self.out_specs, out, "the outputs")
        outs = []
        for j, (path, leaf, spec) in enumerate(zip(paths, leaves, plan.out_specs)):
            where = f"fpar.shard({self.fname}): out{keystr(path)}"
            if spec is None:
                if isinstance(leaf, Tensor):
                    raise TypeError(
                        f"{where} is a tensor but its out_spec is None; give it a fpar.P out_spec "
                        f"(None is for non-tensor outputs, which are returned as they are)."
                    )
                outs.append(leaf)
                if first:
                    plan.out_broken.append(())
                continue
            if not isinstance(leaf, Tensor):
                raise TypeError(
                    f"{where} is a {type(leaf).__name__}, not a tensor, but its out_spec is {spec}; "
                    f"return a tensor, or give it the out_spec None."
                )
            if first:
                check_spec(spec, tuple(leaf.shape), self.mesh.shape, where=where, blocks=True)
            varying, _ = tracker.info(leaf)
            named = set(spec.axes())
            broken = tuple(a for a in self.axes if a not in named and a in varying)
            if broken and self.check_rep:
                from .._shard import _replication_message

                raise ReplicationError(_replication_message(where, spec, list(broken)))
            if first:
                plan.out_broken.append(broken)
            outs.append(tracker.output(leaf, tuple(a for a in self.axes if a in named)))
        return outs

    def _index(self, leaves) -> dict[str, Tensor]:
        """This rank's coordinate per axis, as 0-d int64 tensors on the arguments' device."""
        device = next((x.device for x in leaves if isinstance(x, Tensor)), None)
        if self.index is None or (device is not None and self.index[0] != device):
            dev = device if device is not None else _device([])
            self.index = (dev, {a: torch.tensor(self.mg.coords[a], device=dev) for a in self.axes})
        return self.index[1]


_TOKEN = torch.zeros(())  # any non-None token: marks the frame as a running shard call
_UNSEEN = object()


def _static_key(leaf: Any) -> Any:
    try:
        hash(leaf)
        return (type(leaf), leaf)
    except TypeError:
        return (type(leaf), id(leaf))


def _wrapped(t: Tensor) -> bool:
    """Whether ``t`` is wrapped by a functorch transform (a plan per such case)."""
    return torch._C._functorch.is_functorch_wrapped_tensor(t)


def _generator_states() -> tuple:
    """The state of torch's default generators (CPU, and the current CUDA device's if in use).

    A fast call runs with no interception, so a torch random op that first appears after the
    traced call (a branch on ``model.training``) is caught by comparing these before and after.
    """
    if maybe_current_level() is None:
        cpu = torch.default_generator.get_state().numpy().tobytes()
    else:  # under torch.func.grad/vmap: read the state as a plain tensor
        with torch._C._DisableFuncTorch():
            cpu = torch.default_generator.get_state().numpy().tobytes()
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
        axes = ctx.resolve()
        return (_Exchange.apply(ct, "psum", (), 0, axes, ctx.mg) if axes else ct), None, None

    @staticmethod
    def jvp(ctx, x_t, *_):
        return x_t

    @staticmethod
    def vmap(info, in_dims, x, resolve, mg):
        return _Planned.apply(x, resolve, mg), in_dims[0]


# Agreement ------------------------------------------------------------------------------------


def _may_wait_later() -> bool:
    """Whether a carried sum may be a ``Pending`` value: no transform but ``torch.func.grad``."""
    from torch._C import _functorch

    if torch.autograd.forward_ad._current_level >= 0:
        return False
    stack = _functorch.get_interpreter_stack() or ()
    return all(i.key() == _functorch.TransformType.Grad for i in stack)


@untraced
class _Agreement:
    """The per-call signature check, carried by the call's first message (see the module doc).

    Every rank's first message of a call is the same *wire message*: a SUM all-reduce over the
    mesh's ranks of the *wire* (a dtype and a length, ``MeshGroups.wires``, the same on every
    rank: it changes only in an agreed verdict), the header below, then room.  Two things may
    ride in the room, so that no message is sent just to check the signature:

    * the *block* of the call's first collective, when it is a float psum/pmean over every mesh
      axis (a data-parallel loss; a tensor-parallel activation sum), right after the header;
    * the call's *first gradient bucket* (``buckets._State``), at the end of the wire, when its
      all-reduce is over the same ranks.  A planned call whose bucket 0 fits then does not send
      its first message in the forward at all: the message waits (``_First``) and goes with the
      bucket's all-reduce, so a small data-parallel step makes one round trip, as DDP's.

    Otherwise the header goes alone, just before the first collective (or before returning, for
    a call with none).  Either way the ranks' messages pair up, so a rank whose plan cache hits
    cannot be paired with one that misses.

    Header (exact in float32 for meshes of fewer than ``_F32_RANKS`` ranks): the signature hash
    as ``agree._CHUNKS`` chunks of ``agree._BITS`` bits and their squares (all the same on every rank iff
    ``n * sum(c**2) == sum(c)**2`` per chunk), how many ranks' blocks and buckets ride along,
    how many ranks' functions raised before their first collective (and a bitmask of the
    first ``_MASK_BITS`` group ranks), and the room each rank would want (elements, and whether
    in float32 or float64).  Every rank reads the same sums, so every rank reaches the same
    verdict: go on; raise naming what differs (after gathering the signatures); raise naming
    the ranks that failed; or, where only some ranks' blocks or buckets rode along (a rank read
    its loss before the backward, or traced this signature while another had it planned),
    discard those sums and send them again as usual, in the same place on every rank.  The
    verdict also sizes the wire for the next calls on these axes from the room the ranks want
    (``_Wire``, up to ``_CAP_BYTES``): every rank computes the same size from the same sums.
    """

    def __init__(self, owner: DistShard, plan: _Plan, *, lazy: bool = False):
        self.owner, self.plan = owner, plan
        self.pending = bool(owner.axes) and owner.mesh.size > 1
        self.lazy = lazy  # a planned call: a carried sum may be waited on at its first use
        self.bucket = None  # bucket 0 (buckets._State) when it may ride in the first message
        self.first: _First | None = None  # the first message while it waits for bucket 0
        # what this call's backward sends for its replicated inputs (a planned call's from
        # buckets.reduce_inputs): "reduced" (all-reduces), "deferred" (fpar.defer_reduction:
        # none, sums kept) or "none" (no gradient flows: torch.no_grad(), no input requires
        # grad).  The ranks must agree on it as on the signature, or their next messages would
        # not pair: it salts the hash
        self.grads = "reduced" if torch.is_grad_enabled() else "none"

    def carry(self, kind: str, axes: tuple, x: Tensor, params: tuple) -> tuple:
        """Before a communicating collective: the params to run it with (the check done or carried).

        Returns ``(self,)`` when ``x`` may ride in the first message: ``exchange._run`` then calls
        :meth:`reduce`.  Otherwise the header goes alone first, and ``params`` are returned.
        """
        if not self.pending:
            return params
        if (
            kind in ("psum", "pmean")
            and set(axes) == set(self.owner.axes)
            and x.is_floating_point()
            and x.numel() <= _cap(torch.float32)
        ):
            return (self,)
        self._exchange(None, failed=False)
        return params

    def reduce(self, x: Tensor, kind: str, n: int) -> Tensor | None:
        """The carried psum/pmean of ``x`` (as ``x.dtype``), or ``None``: run the collective as usual.

        On a planned call the message goes without waiting (``pending.py``): the result is a
        ``Pending`` tensor, and the check and the sum are read at its first use or before the
        next collective.  The first call of a signature waits, as under a transform that could
        look inside the value (vmap, forward-mode AD).
        """
        if self.lazy and not self.plan.read_inside and _may_wait_later():
            return self._send_async(x, kind, n)
        y = self._exchange(x, failed=False)
        return None if y is None else (y / n if kind == "pmean" else y)

    def finish(self) -> None:
        """Before returning: the check, if no collective carried it (waiting for bucket 0 if it may)."""
        if not self.pending:
            return
        if self.lazy and self.bucket is not None and _may_wait_later():
            self._send_async(None, "psum", 1)
        else:
            self._exchange(None, failed=False)

    def settle(self) -> None:
        """The function raised: send this rank's part, flagged failed, so no rank waits on it."""
        if self.pending:
            self._exchange(None, failed=True)

    def join(self, bucket) -> bool:
        """Bucket 0's launch: send the waiting first message with it.  Whether the bucket rode."""
        first, self.first = self.first, None
        if first is None or first.work is not None:
            return False  # sent already (read early, or another collective came first)
        return first.send(bucket)

    def _exchange(self, x: Tensor | None, *, failed: bool) -> Tensor | None:
        buf, group, members, layout = self._message(x, failed)
        dist.all_reduce(buf, group=group)
        return self._verdict(buf, x, failed, group, members, layout)

    def _send_async(self, x: Tensor | None, kind: str, n: int) -> Tensor | None:
        """The first message without waiting: now, or, when bucket 0 may ride, at its launch."""
        self.pending = False
        self.owner.mg.group(self.owner.axes)  # settles earlier calls' messages first
        out = None
        if x is not None:
            with torch._C.DisableTorchFunction():
                x = x.detach().clone()
                out = Pending(torch.empty_like(x))
        first = _First(self, x, kind, n, out)
        if self.bucket is not None and self._fits(x, self.bucket):
            self.first = first  # sent by bucket 0's launch, or by the next settling
        else:
            first.send(None)
        defer(first.verdict, first)
        return out

    def wire_for(self, bucket) -> Tensor | None:
        """A buffer for the first message whose tail ``bucket`` may use as its flat buffer.

        When bucket 0 will ride in the waiting first message in the wire's own dtype, its
        cotangents are written straight into the message and summed there: no copy in or out.
        Kept by the plan and reused once nothing holds it (its gradients were dropped).
        """
        first = self.first
        dtype, size = self._wire()
        if first is None or first.work is not None or bucket.layout.dtype != dtype or not self._fits(first.x, bucket):
            return None
        flats = self.plan.flats
        flats["wire"] = kept_or_new(flats.get("wire"), (size,), dtype, bucket.layout.device)
        return flats["wire"]

    def _fits(self, x: Tensor | None, bucket) -> bool:
        """Whether ``bucket`` rides with ``x`` in the wire as it is now."""
        dtype, size = self._wire()
        k = 0 if x is None else x.numel()
        return _HEAD + k + bucket.layout.numel <= size and _rides(bucket.layout.dtype, dtype)

    def _wire(self) -> tuple:
        wire = self.owner.mg.root.wires.get(self.owner.wire_key)
        return _WIRE0 if wire is None else wire.now

    def _message(self, x: Tensor | None, failed: bool, bucket=None, *, settle: bool = True) -> tuple:
        """This rank's first message: the header, ``x``'s block and ``bucket``'s gradients if they ride."""
        self.pending = False
        mg = self.owner.mg
        group = mg.group(self.owner.axes, settle=settle)  # settles earlier calls' messages first
        members = mg.members(self.owner.axes)
        dtype, size = self._wire()
        k = 0 if x is None else x.numel()
        rides = x is not None and _rides(x.dtype, dtype) and _HEAD + k <= size
        m = 0 if bucket is None else bucket.layout.numel
        joins = bucket is not None and _rides(bucket.layout.dtype, dtype) and _HEAD + k + m <= size
        mask = failed_bit(group, mg.rank, _MASK_BITS) if failed else 0.0
        want = self._want(x)
        if self.bucket is not None:  # this call's first message goes now: bucket 0 rides or it does not
            self.bucket.rider = self.bucket = None  # (and no reference cycle keeps its buffer)
        with torch._C.DisableTorchFunction(), torch._C._DisableFuncTorch():  # plain buffers, also in a hook
            dev = x.device if x is not None else _device([])
            head = self._head(dtype, dev, rides, joins, failed, mask, want)
            if joins and bucket.wire is not None and bucket.wire.shape == (size,) and bucket.wire.dtype == dtype:
                buf = bucket.wire  # its tail holds the bucket already
                buf.narrow(0, 0, size - m).zero_()
            else:
                buf = torch.zeros(size, dtype=dtype, device=dev)
            buf.narrow(0, 0, _HEAD).copy_(head)
            if rides:
                buf.narrow(0, _HEAD, k).copy_(x.detach().reshape(-1))
            if joins:
                bucket.pack(buf.narrow(0, size - m, m))
        return buf, group, members, (rides, bucket if joins else None, m)

    def _head(self, dtype, dev, rides: bool, joins: bool, failed: bool, mask: float, want: tuple) -> Tensor:
        """The header's values as a tensor (kept per plan: the same few recur every call)."""
        key = (dtype, dev, rides, joins, failed, mask, self.grads, *want)
        head = self.plan.heads.get(key)
        if head is None:
            h = self.plan.digest ^ _GRAD_SALTS[self.grads]
            values = [*hash_values(h), float(rides), float(joins), float(failed), mask, *want]
            head = self.plan.heads[key] = torch.tensor(values, dtype=dtype, device=dev)
        return head

    def _want(self, x: Tensor | None) -> tuple:
        """The wire this call would fill: (elements, wants float32, wants float64) for the header."""
        parts = [] if x is None else [(x.numel(), x.dtype)]
        b = self.bucket
        if b is not None and _HEAD + sum(k for k, _ in parts) + b.layout.numel <= _cap(b.layout.dtype):
            parts.append((b.layout.numel, b.layout.dtype))
        if not parts:
            return 0.0, 0.0, 0.0  # nothing to carry: no say in the wire's size
        wide = any(d == torch.float64 for _, d in parts)
        return float(_HEAD + sum(k for k, _ in parts)), float(not wide), float(wide)

    def _verdict(self, buf: Tensor, x: Tensor | None, failed: bool, group, members, layout) -> Tensor | None:
        """Read the summed first message: go on (with the carried sums), or raise on every rank."""
        owner = self.owner
        n = len(members)
        rides, bucket, m = layout
        with torch._C.DisableTorchFunction():
            sums = [int(v) for v in buf.narrow(0, 0, _HEAD).tolist()]
        carried, joined, n_failed, mask, want, in32, in64 = sums[2 * _CHUNKS :]
        if n_failed:
            if failed:
                return None  # this rank's own error is on its way
            _defer.drop_all()  # every rank raises: no rank keeps sums of the failed step
            raise failed_error(
                f"fpar.shard({owner.fname})", "this call's first collective", n_failed, n, mask, group, _MASK_BITS
            )
        if not agreed(sums, n):
            _defer.drop_all()
            self._raise(group, members)  # every rank (a failed one too) gathers, then raises
        self._resize(n, want, in32, in64)
        if bucket is not None:  # every rank's bucket rode, or it goes again at its own place
            with torch._C.DisableTorchFunction():
                bucket.rode(buf.narrow(0, buf.numel() - m, m) if joined == n else None)
        if failed or not rides or carried != n:
            return None
        with torch._C.DisableTorchFunction():
            return block(buf, _HEAD, x.shape).to(x.dtype)

    def _resize(self, n: int, want: int, in32: int, in64: int) -> None:
        """Size the wire to the room the ranks want (the same sums, so the same size everywhere)."""
        if in32 == n and n < _F32_RANKS:
            dtype = torch.float32
        elif in64 == n:
            dtype = torch.float64
        elif in32 == in64 == 0:
            dtype = None  # no rank wants room
        else:
            return  # rooms of different dtypes: keep the wire
        wires = self.owner.mg.root.wires
        key = self.owner.wire_key
        wire = wires.get(key) or wires.setdefault(key, _Wire())
        wire.add(dtype, 0 if dtype is None else min(-(-want // n), _cap(dtype)))

    def _raise(self, group, members) -> None:
        owner = self.owner
        sigs: list = [None] * len(members)
        mine = (owner.fname, owner.static_text, self.plan.sig, self.grads, owner.bucket_mb)
        dist.all_gather_object(sigs, mine, group=group)
        by_rank = dict(zip(sorted(members), sigs))  # all_gather_object orders by group rank
        raise ValueError(f"fpar.shard({owner.fname}): " + _differences(by_rank))


class _Wire:
    """The size of every first message over some axes.

    The most room any of the last ``_WINDOW`` calls wanted, in the dtype the latest one that
    wanted room asked for (``_WIRE0`` if none).  A window, not a high-water mark, so that a mesh
    whose calls stop carrying buckets (a pipeline's stage calls, ``_First.verdict``) stops
    padding every call's first message.
    """

    __slots__ = ("recent", "now")

    def __init__(self):
        self.recent: collections.deque = collections.deque(maxlen=_WINDOW)
        self.now = _WIRE0

    def add(self, dtype: torch.dtype | None, size: int) -> None:
        self.recent.append((dtype, size))
        if (dtype, size) == self.now:
            return  # the latest dtype, and the most room it wants: the size stays
        dtype = next((d for d, _ in reversed(self.recent) if d is not None), None)
        if dtype is None:
            self.now = _WIRE0
        else:
            self.now = (dtype, max([_WIRE0[1], *(k for d, k in self.recent if d == dtype)]))


@untraced
class _First:
    """A planned call's first message, sent without waiting; its verdict runs at the next settling.

    ``send`` builds and posts it (with bucket 0 when that rides); until then it counts as in
    flight (``pending.in_flight``), so other buckets are held behind it, and a settling sends
    it alone.
    """

    __slots__ = ("agree", "x", "kind", "n", "out", "work", "buf", "group", "members", "layout")

    def __init__(self, agree: _Agreement, x: Tensor | None, kind: str, n: int, out: Pending | None):
        self.agree, self.x, self.kind, self.n, self.out = agree, x, kind, n, out
        self.work = None

    def send(self, bucket) -> bool:
        """Post the message (``bucket``'s gradients in it if they fit); whether they rode."""
        self.buf, self.group, self.members, self.layout = self.agree._message(
            self.x, False, bucket, settle=False
        )
        with torch._C._DisableFuncTorch():  # from a hook under torch.func.grad: ~3x the cost otherwise
            self.work = dist.all_reduce(self.buf, group=self.group, async_op=True)
        return self.layout[1] is not None

    def is_completed(self) -> bool:
        return self.work is not None and self.work.is_completed()

    def verdict(self) -> None:
        if self.work is None:  # bucket 0 never came: the check goes alone
            self.agree.first = None
            if pending.for_collective():
                # Another collective came between the forward and bucket 0 (a pipeline's next
                # microbatch, a second sharded call): waiting for bucket 0 costs this plan a
                # round trip each call, so its later calls send their first message at once.
                self.agree.plan.lone = True
            self.send(None)
        self.work.wait()
        x = self.x
        y = self.agree._verdict(self.buf, x, False, self.group, self.members, self.layout)
        if x is None:
            return
        with torch._C.DisableTorchFunction():
            if y is None:  # only some ranks' blocks rode along: the sum as usual, in order
                y = x.clone()
                dist.all_reduce(y, group=self.group)
            if self.kind == "pmean":
                torch.div(y, self.n, out=self.out.elem)  # one op, not a division then a copy
            else:
                self.out.elem.copy_(y)


def _rides(dtype: torch.dtype, wire: torch.dtype) -> bool:
    """Whether a float block of ``dtype`` may be summed in a wire of dtype ``wire``.

    fp16/bf16 in float32 or wider, rounded once, as fpar's sums over devices; float64 only in float64.
    """
    return dtype.is_floating_point and (wire == torch.float64 or dtype != torch.float64)


def _cap(dtype: torch.dtype) -> int:
    """The most elements a wire of (blocks of) ``dtype`` grows to."""
    return _CAP_BYTES // (8 if dtype == torch.float64 else 4)


# the hash of a call per what its backward sends (_Agreement.grads): the salts differ in every chunk
_GRAD_SALTS = {"reduced": 0, "deferred": 0x5A5A_A5A5_5A5A_A5, "none": 0x3C3C_C3C3_3C3C_C3}
_HEAD = 2 * _CHUNKS + 7  # chunks, squares, carried, joined, failed count and mask, wanted room
_MASK_BITS = 24  # group ranks below this are named in the failed mask (exact in float32)
_F32_RANKS = 128  # a float32 wire keeps every header sum exact below this many ranks
_WIRE0 = (torch.float64, 64)  # a mesh's first wire: 512 bytes
_WINDOW = 16  # calls a wire's size looks back over
_CAP_BYTES = 2**19  # the wire grows to at most 512 KiB (a first message padded to it costs ~0.2 ms here)


_GRAD_MODES = {
    "reduced": "all-reduced (gradients enabled, outside fpar.defer_reduction())",
    "deferred": "deferred (inside fpar.defer_reduction())",
    "none": "not computed (under torch.no_grad(), or no such input requires grad)",
}


def _differences(by_rank: dict) -> str:
    """Say which argument differs between ranks, and how (shape, dtype, spec)."""
    ranks = sorted(by_rank)
    lines = []
    statics = {r: by_rank[r][1] for r in ranks}
    if len(set(statics.values())) > 1:
        lines.append(
            "in_specs/out_specs/check_rep differ: "
            + "; ".join(f"rank {r}: {statics[r]}" for r in ranks)
        )
    buckets = {r: by_rank[r][4] for r in ranks}
    if len(set(buckets.values())) > 1:  # the gradient buckets, so their all-reduces, would differ
        lines.append("bucket_mb differs: " + ", ".join(f"rank {r}: {buckets[r]:g}" for r in ranks))
    sigs = {r: by_rank[r][2] for r in ranks}
    lengths = {r: len(s) for r, s in sigs.items()}
    if len(set(lengths.values())) > 1:
        lines.append("the number of tensor arguments differs: " + ", ".join(f"rank {r}: {n}" for r, n in lengths.items()))
    else:
        fields = ("spec", "shape", "dtype", "requires_grad")
        for i in range(min(lengths.values())):
            entries = {r: sigs[r][i] for r in ranks if isinstance(sigs[r][i], tuple)}
            if len(entries) < len(ranks):
                continue
            for f, name in enumerate(fields, start=1):
                values = {r: e[f] for r, e in entries.items()}
                if len(set(values.values())) > 1:
                    arg = entries[ranks[0]][0]
                    lines.append(
                        f"{arg} has a different {name} on different ranks ("
                        + ", ".join(f"rank {r}: {v}" for r, v in values.items())
                        + ")"
                    )
    if not lines:
        grads = {r: by_rank[r][3] for r in ranks}
        if len(set(grads.values())) > 1:
            said = []
            for mode, what in _GRAD_MODES.items():
                these = [r for r in ranks if grads[r] == mode]
                if these:
                    said.append(f"{what} on rank{'s' if len(these) > 1 else ''} {', '.join(map(str, these))}")
            return (
                "the ranks differ in what this call's backward does with the replicated inputs' "
                "gradients, so their next messages would not pair up: they are " + "; ".join(said) + ". Every "
                "process must run the same microbatches inside fpar.defer_reduction() (the same number "
                "per step, the last one outside it), with gradients enabled alike."
            )
        lines.append("the ranks called with different signatures")
    return (
        "the ranks passed blocks of different shapes, dtypes or specs; every process must pass its "
        "block of the same global values with the same specs: " + "; ".join(lines) + "."
    )


# The traced run -------------------------------------------------------------------------------


class _Tracker(TorchFunctionMode):
    """Varying-axes tracking, per-use implicit pvary, and the plan's bookkeeping (first call)."""

    def __init__(self, owner: DistShard, plan: _Plan):
        super().__init__()
        self.owner, self.plan, self.mg = owner, plan, owner.mg
        self.axes = owner.axes
        # Axes of more than one device: a sum over an axis of size 1 is the identity, so such an
        # axis never makes a value a gradient source (it is still typed, for the replication check)
        self.summed = frozenset(a for a in self.axes if owner.mesh.shape[a] > 1)
        self.infos: dict[int, tuple[Tensor, frozenset, frozenset]] = {}
        self.pvaried: dict = {}
        self.pvary_use: set = set()
        self.first_use: list = []  # sources in the order of their first pvaried use
        self.plain_use: set = set()
        self.unknown = False  # a tracked replicated tensor of unknown origin met a varying value
        self.inner = False  # the function differentiates inside itself
        self.base = maybe_current_level()
        self.coll: list = []
        self.carried: Tensor | None = None  # the sum the call's first message carried, until an op reads it

    # bookkeeping

    def info(self, t: Tensor) -> tuple[frozenset, frozenset]:
        e = self.infos.get(id(t))
        if e is not None and e[0] is t:
            return e[1], e[2]
        return frozenset(), frozenset()

    def _mark(self, result: Any, varying: frozenset, deps: frozenset) -> None:
        if not varying and not deps:
            return
        for t in tree_flatten(result)[0] if not isinstance(result, Tensor) else [result]:
            if isinstance(t, Tensor):
                self.infos[id(t)] = (t, varying, deps)

    def enter(self, i: int, leaf: Tensor, spec: PartitionSpec) -> Tensor:
        """Register input ``i``; a replicated float one gets its source-level sum (planned)."""
        named = frozenset(spec.axes())
        rep = [a for a in self.axes if a not in named and a in self.summed]
        deps = frozenset((("in", i), a) for a in rep) if _diff(leaf) else frozenset()
        if deps:
            plan = self.plan
            leaf = _Planned.apply(leaf, lambda: plan.in_reduce.get(i, ()) if plan.fast else (), self.mg)
        self._mark(leaf, named, deps)
        return leaf

    def _use(self, t: Tensor, deps: frozenset, axes: tuple[str, ...]) -> None:
        """``t`` (replicated over ``axes``) is pvaried over them: record its sources' uses."""
        for a in (a for a in axes if a in self.summed):
            # Sorted: ``deps`` is a set, whose order follows string hashing, which differs between
            # processes; ``first_use`` orders the gradient buckets, which every rank must lay out
            # the same way (an all-reduce of differently ordered buffers sums unrelated gradients).
            found = sorted(d for d in deps if d[1] == a)
            for d in found:
                if d not in self.pvary_use:
                    self.pvary_use.add(d)
                    self.first_use.append(d[0])
            if not found and stats._tracked(t):
                self.unknown = True

    def _pvary(self, t: Tensor, axes: tuple[str, ...]) -> Tensor:
        key = (id(t), axes)
        if key in self.pvaried and self.pvaried[key][0] is t:
            return self.pvaried[key][1]
        plan = self.plan
        summed = tuple(a for a in axes if a in self.summed)
        out = _Planned.apply(t, lambda: () if plan.fast else summed, self.mg)
        self.pvaried[key] = (t, out)
        return out

    # torch ops

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in RANDOM_OPS:
            check_random_op(func, args, kwargs, self.owner.fname)  # layout-dependent draws: use fpar.random
        if func in _NOT_OPS:
            self.inner = True
            return func(*args, **kwargs)
        if self.base != maybe_current_level():
            self.inner = True  # an op under the user's own transform inside the function
        if getattr(func, "__name__", "").startswith("_foreach_"):
            return self._foreach(func, args, kwargs)
        leaves, treedef = tree_flatten((args, kwargs))
        idx = [i for i, t in enumerate(leaves) if isinstance(t, Tensor)]
        if not idx:
            return func(*args, **kwargs)
        reads = self.carried is not None and any(leaves[i] is self.carried for i in idx)
        met, union, deps = self._meet([leaves[i] for i in idx])
        if any(t is not leaves[i] for i, t in zip(idx, met)):
            for i, t in zip(idx, met):
                leaves[i] = t
            args, kwargs = tree_unflatten(treedef, leaves)
        result = func(*args, **kwargs)
        self._mark(result, union, deps)
        if reads and _reads_value(func, result):
            self.plan.read_inside, self.carried = True, None
        return result

    def _meet(self, ts: list) -> tuple[list, frozenset, frozenset]:
        """Tensors ``ts`` meet in one op: pvary each over the axes others vary over and it does not.

        Returns the operands to use, the result's varying axes and its sources.
        """
        infos = [self.info(t) for t in ts]
        union = frozenset().union(*(v for v, _ in infos))
        deps: set = set()
        out = list(ts)
        for i, (t, (v, d)) in enumerate(zip(ts, infos)):
            missing = union - v
            if missing and _diff(t):
                axes = tuple(a for a in self.axes if a in missing)
                self._use(t, d, axes)
                out[i] = self._pvary(t, axes)
            deps.update(x for x in d if x[1] not in missing)
        return out, union, frozenset(deps)

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
            met, union, deps = self._meet([mine[k] for k in at])
            for k, t in zip(at, met):
                mine[k] = t
            elements.append(mine)
            types.append((union, deps))
        shared = [k for k, a in enumerate(args) if k not in lists and isinstance(a, Tensor)]
        if all(e[k] is args[k] for e in elements for k in shared):  # one call, as the user wrote it
            result = func(*[[e[k] for e in elements] if k in lists else a for k, a in enumerate(args)], **kwargs)
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
                x = self._pvary(x, inv)
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
                y = _Planned.apply(y, lambda: plan.coll[k][2] if plan.fast else (), self.mg)
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
                t = self._pvary(t, rep_named)
        return t

    def finish(self) -> None:
        """Decide the plan: fast unless a source is used both ways or of unknown origin.

        (Or a varying-axes query is ambiguous, see ``DistShard._varying``.)
        """
        plan = self.plan
        mixed = self.pvary_use & self.plain_use
        ambiguous = any(v is None for v in plan.varying.values())
        plan.fast = not (mixed or self.unknown or self.inner or ambiguous)
        reduce: dict = {}
        for src, a in self.pvary_use:
            reduce.setdefault(src, []).append(a)
        order = {a: i for i, a in enumerate(self.axes)}
        axes_of = {s: tuple(sorted(v, key=order.get)) for s, v in reduce.items()}
        plan.in_reduce = {s[1]: ax for s, ax in axes_of.items() if s[0] == "in"}
        seen = dict.fromkeys(s[1] for s in reversed(self.first_use) if s[0] == "in")
        plan.in_order = list(seen)
        plan.coll = [(kind, axes, axes_of.get(("coll", k), ())) for k, (kind, axes) in enumerate(self.coll)]
        self.infos.clear()
        self.pvaried.clear()
