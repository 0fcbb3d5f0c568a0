"""Gradient all-reduces of replicated values on a real mesh, bucketed and overlapped like DDP.

A bucket is a group of tensors replicated over the same axes, with the same dtype, in the
order their gradients are expected (the reverse of their first use), closed once it holds
``bucket_mb`` megabytes (the first one at 1 MB, as DDP).  Each tensor enters the function as
two views with hooks on their nodes (``_hooked``), created when the sharded function is entered::

    x  ->  waiting view (hook: wait)  ->  launch view (hook: arrive)  ->  the function's uses

* ``arrive`` runs as soon as the tensor's cotangent is final (the launch view's node carries
  ``AccumulateGrad``'s sequence number, so autograd does not leave it for last).  It copies the
  cotangent into its slot of the bucket's flat buffer and hands the slot on; the bucket's last
  arrival starts an asynchronous all-reduce of the buffer.  The buffer is the plan's, kept
  across calls and reused once nothing holds it (as DDP's buckets).
* ``waited`` runs on the waiting view's node, which keeps the sequence number of its creation,
  before any of the function's own ops: autograd runs it only when nothing else is ready, so
  the rest of the backward (earlier layers) overlaps the communication.  It waits on the
  all-reduce (starting it first if some tensor got no cotangent: its slot is zero); the slots
  handed on are then the sums, and nothing ever read them before: not ``AccumulateGrad``, not
  a hook, not ``torch.autograd.grad``'s capture, not an op outside the sharded function.

**Bucket 0 rides in the call's first message** when its all-reduce is over the same ranks and
it fits the wire (``shard._Agreement``): its launch sends the call's waiting first message with
it, so the signature check costs no round trip of its own; when the wire is in the bucket's
dtype the flat buffer is the message's tail, summed in place.  If some rank's bucket did not
ride (that rank read its loss before the backward), every rank sends it again, at its launch's
place among the held messages (``_again``).

Hooks rather than ``autograd.Function``s: under ``torch.func.grad`` every custom Function costs
~0.4 ms of functorch's Python in the forward and more in the backward.  When a cotangent may
itself be differentiated (``create_graph``, nested ``torch.func`` transforms, jacrev, hessian),
``arrive`` returns its differentiable psum (``_Exchange``, whose transpose is pvary) at once
instead, so higher orders stay right; it is not bucketed.

**Deferral** (``fpar.defer_reduction``, ``fpar/_defer.py``): a call inside the context builds
the same buckets but one node each, ``_Defer``, whose backward adds the cotangents into the
bucket's flat buffer (the plan's kept one, as above: a step touches no fresh pages; no
communication) and gives the inputs no gradient (under
``fpar.optim.accumulate``'s ``torch.func.grad``: a hook per tensor, ``_defer_hooked``, passing on
an expanded shared zero that ``accumulate`` skips).  The next call
outside the context on the same input tensors hands the buffers to its buckets: ``arrive``
adds its cotangents into the buffer and the bucket all-reduces that, the sum of every microbatch's
gradient in one message per bucket.  Its bytes are counted in ``fpar.comm_stats`` where the
all-reduce is issued (one call per bucket).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch._C import _functorch

from .. import _defer
from .. import _stats as stats
from .._buffers import block, contiguous_strides, kept_or_new
from .._compile import untraced
from .._registry import bound_once
from .._sums import widened, wire_itemsize
from . import pending
from .exchange import _Exchange, _first_order_level
from .lowered import in_lowered_backward

__all__ = ["reduce_inputs"]

Tensor = torch.Tensor
FIRST_BUCKET_MB = 1.0  # DDP's first bucket (torch.distributed's _DEFAULT_FIRST_BUCKET_BYTES)
_HELD_BACK = object()  # a bucket's ``work`` while its all-reduce waits in ``pending.hold``
_RIDING = object()  # a bucket's ``work`` while it rides in the call's first message (shard._First)


class _Layout:
    """A bucket's fixed part, the same in every call of a plan: its tensors' places in the flat buffer."""

    __slots__ = (
        "slots",
        "bucket",
        "shapes",
        "strides",
        "offsets",
        "numel",
        "dtype",
        "device",
    )

    def __init__(self, slots: list[int], bucket: tuple, xs: list[Tensor]):
        self.slots = slots  # the sources' slots, in order
        self.bucket = bucket  # (axes, mesh groups)
        self.shapes = [x.shape for x in xs]
        self.strides = [contiguous_strides(x.shape) for x in xs]  # each slot's, in the flat buffer
        self.offsets = []
        at = 0
        for x in xs:
            self.offsets.append(at)
            at += x.numel()
        self.numel, self.dtype, self.device = at, xs[0].dtype, xs[0].device

    @property
    def summed_bytes(self) -> int:
        """What its all-reduce sums (fp16/bf16 in float32, unless native sums): what ``comm_stats`` counts."""
        return self.numel * wire_itemsize("psum", self.dtype)


@untraced
class _State:
    """One bucket in one call: its flat buffer, the cotangents that arrived, the pending all-reduce."""

    __slots__ = (
        "layout",
        "held",
        "index",
        "kept",
        "flat",
        "adding",
        "arrived",
        "work",
        "narrow",
        "rider",
        "wire",
        "in_place",
    )

    def __init__(self, layout: _Layout, held=None, index: int = 0, kept: dict | None = None):
        self.layout = layout  # its fixed part: axes, shapes, offsets, size, dtype
        self.held, self.index, self.kept = held, index, kept
        self.flat = None  # chosen when the first cotangent arrives
        self.adding = False  # the flat buffer holds deferred microbatches' sums: add into it
        self.arrived = [False] * len(self.layout.shapes)
        self.work = None  # None: not launched; _HELD_BACK: held (pending.hold); _RIDING: in the
        # call's first message; False: summed and waited for
        self.narrow = None  # (fp16/bf16 flat buffer, its float32 copy being summed)
        self.rider = None  # the call's shard._Agreement, when this bucket may ride in its first message
        self.wire = None  # that message's buffer, when ``flat`` is its tail (no copy in or out)
        self.in_place: set[int] = set()  # slots whose cotangent was written into them (``written``)

    # -- the launch: a hook on each tensor's launch view, run as soon as its cotangent is final --

    def arrive(self, i: int, ct: Tensor) -> Tensor:
        """Put tensor ``i``'s cotangent in its slot; the last one starts the all-reduce.

        Returns the slot (a view of the flat buffer, whose sum the waiting hooks wait for), or,
        when the cotangent may itself be differentiated (``create_graph``, nested transforms,
        jacrev, hessian), its differentiable psum, at once (a second order is rare).
        """
        if self.arrived[i] or self.work is False:  # a second backward through the same graph
            self._reset()
        level = _first_order_level(ct)
        if level is None:
            self._done(i)
            axes, mg = self.layout.bucket
            return _Exchange.apply(ct, "psum", (), 0, axes, mg)
        if level:
            with torch._C._DisableFuncTorch():  # plain buffers, from a hook under functorch
                slot = self._put(i, _functorch._unwrap_for_grad(ct, level))
            self._done(i)
            return _functorch._wrap_for_grad(slot, level)
        slot = self._put(i, ct)
        self._done(i)
        return slot

    def row_slot(self, i: int) -> tuple[Tensor, bool]:
        """Tensor ``i``'s slot, for a cotangent written into it row by row before it arrives.

        (A stacked parameter's layers, each as its backward ends: ``fpar/pipeline/_unstack.py``.)
        Returns the slot and whether it holds deferred sums already (else the first write of a row
        copies); ``written(i)`` once every row is in, and the slot itself arrives as the cotangent.
        """
        return self._slot(i), self.adding

    def written(self, i: int) -> None:
        """Tensor ``i``'s cotangent is in its slot: ``arrive`` takes it there."""
        self.in_place.add(i)

    def _put(self, i: int, ct: Tensor) -> Tensor:
        slot = self._slot(i)
        if i in self.in_place:  # ``written``: the cotangent is there already ...
            self.in_place.discard(i)
            if ct.data_ptr() != slot.data_ptr() or ct.stride() != slot.stride():
                slot.copy_(ct)  # ... unless autograd added another use's gradient out of place
        elif self.adding:
            slot.add_(ct)
        else:
            slot.copy_(ct)
        return slot

    def _reset(self) -> None:
        if self.work:  # the last round's all-reduce, never waited on (its graph was cut short)
            self.waited(None)
        self.flat, self.adding, self.work = None, False, None
        self.arrived = [False] * len(self.layout.shapes)
        self.in_place = set()

    def _slot(self, i: int) -> Tensor:
        if self.flat is None:
            self.flat = self._buffer()
        layout = self.layout
        return block(self.flat, layout.offsets[i], layout.shapes[i], layout.strides[i])

    def _buffer(self) -> Tensor:
        """The bucket's flat buffer: the deferred microbatches' sum, the plan's kept buffer, or new."""
        dtype, device, total = self.layout.dtype, self.layout.device, self.layout.numel
        buf = self.held.take(self.index) if self.held is not None else None
        if buf is not None:
            self.adding = True
            return buf
        if self.rider is not None:
            self.wire = self.rider.wire_for(self)
            if self.wire is not None:  # the cotangents go straight into the first message
                return self.wire.narrow(0, self.wire.numel() - total, total)
        if self.kept is None:
            return torch.empty(total, dtype=dtype, device=device)
        # As DDP's persistent buckets: the last call's buffer, when nothing holds it any more
        # (its gradients were dropped: ``zero_grad``, a new step), so no fresh pages are touched
        # every step.  Exact: a tensor, view, work handle or array over it counts.
        buf = self.kept[self.index] = kept_or_new(self.kept.get(self.index), (total,), dtype, device)
        return buf

    def _done(self, i: int) -> None:
        self.arrived[i] = True
        if all(self.arrived):
            self.launch()

    def launch(self, *, hold: bool = True) -> None:
        """Start the all-reduce of the flat buffer (once; slots that got no cotangent are zeros).

        While the call's signature check is still on its way (``pending.py``; another rank is
        behind), the all-reduce is held rather than waited for here: the backward goes on, and
        the message goes at the next settling, in order (the backward's final wait at the
        latest).  A wait here would stop this rank's backward for as long as the other is behind.
        """
        if self.work is not None or self.flat is None:
            return  # launched or held already, or every cotangent was summed at once (a second order)
        if self.rider is not None and self.rider.join(self):
            # In the call's first message, with its signature check: one round trip, not two.
            # If some rank's bucket did not ride (it read its loss before the backward), the
            # verdict says so on every rank and ``_again`` sends it here, in launch order.
            self.work = _RIDING
            axes, mg = self.layout.bucket
            stats.record_bytes("psum", axes, len(mg.members(axes)), self.layout.summed_bytes, overlap=True)
            pending.hold(self._again)
            return
        if hold and pending.in_flight():
            self.work = _HELD_BACK
            pending.hold(self._send)
            return
        self._send()

    def _fill(self) -> None:
        for i, got in enumerate(self.arrived):
            if not got and not self.adding:  # no cotangent reached it: its gradient is zero
                self._slot(i).zero_()

    def pack(self, into: Tensor) -> None:
        """Put the bucket in its place in the call's first message (``shard._Agreement``)."""
        with torch._C._DisableFuncTorch():
            self._fill()
            if into.data_ptr() != self.flat.data_ptr():
                into.copy_(self.flat)

    def rode(self, summed: Tensor | None) -> None:
        """The first message's verdict: the bucket's sum, or ``None`` (some rank's did not ride)."""
        if summed is None:
            self.work = _HELD_BACK  # ``_again`` sends it, where it was launched
            return
        if summed.data_ptr() != self.flat.data_ptr():
            with torch._C._DisableFuncTorch():
                self.flat.copy_(summed)  # fp16/bf16: rounded once, after the wider sum
        self.work = False

    def _again(self) -> None:
        if self.work is _HELD_BACK:
            self._send()

    def _send(self) -> None:
        with torch._C._DisableFuncTorch():
            self._fill()
            flat = self.flat
            wire = flat
            if widened(flat.dtype):
                # fpar's rule for sums over devices (README "Low precision"), as the in-process
                # mesh and every other psum: fp16/bf16 summed in float32 and rounded once.
                wire = flat.float()
                self.narrow = (flat, wire)
            axes, mg = self.layout.bucket
            stats.record_bytes(
                "psum", axes, len(mg.members(axes)), self.layout.summed_bytes, overlap=True
            )  # as issued
            self.work = dist.all_reduce(wire, group=mg.group(axes), async_op=True)

    # -- the wait: a hook on each tensor's waiting view, run once nothing else is ready -------

    def waited(self, ct: Tensor) -> None:
        """Wait on the all-reduce (starting it first if some tensor got no cotangent)."""
        if self.work is None:
            if self.flat is None:
                return  # summed at once (a second order): nothing to wait for
            self.launch(hold=False)
        if self.work is _HELD_BACK or self.work is _RIDING:
            pending.settle()  # reads the check, then sends the held all-reduces (this one among them)
            if self.work is _HELD_BACK or self.work is _RIDING:  # dropped: the check failed, and raised
                self.work = None
                return
        work, self.work = self.work, False
        if work:
            work.wait()
        if self.narrow is not None:
            flat, wide = self.narrow
            self.narrow = None
            with torch._C._DisableFuncTorch():
                flat.copy_(wide)  # rounded once, after the float32 sum


@bound_once
class _Defer(torch.autograd.Function):
    """A deferred bucket (``fpar.defer_reduction``): backward adds the cotangents into its buffer."""

    @staticmethod
    def forward(held, index, *xs):
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.held, ctx.index = inputs[0], inputs[1]
        ctx.metas = [(x.shape, x.dtype, x.device) for x in inputs[2:]]
        ctx.set_materialize_grads(False)  # no cotangent: nothing to add (``Deferred._add`` takes None)

    @staticmethod
    def backward(ctx, *cts):
        ctx.held.add(ctx.index, list(cts), ctx.metas)
        if ctx.held.scope._expanded_zeros and (_functorch.get_interpreter_stack() or in_lowered_backward()):
            # functorch would fill zeros for a None gradient; accumulate skips these
            return (None, None, *(_defer.deferred_zeros(*m) for m in ctx.metas))
        return (None, None, *(None for _ in cts))

    @staticmethod
    def vmap(info, in_dims, held, index, *xs):
        raise NotImplementedError(
            "fpar.defer_reduction(): gradients cannot be deferred under vmap (jacrev, hessian, "
            "per-example gradients); leave the context for such calls."
        )

    @staticmethod
    def jvp(ctx, _h, _i, *ts):
        return tuple(ts)


def reduce_inputs(
    sources: list[tuple[int, Tensor, tuple[str, ...]]],
    mg,
    bucket_mb: float,
    *,
    owner: tuple,
    fname: str,
    kept: dict | None = None,
    layouts: dict | None = None,
    rider=None,
) -> tuple[dict[int, Tensor], str]:
    """Wrap replicated inputs so their cotangents are all-reduced over their axes, bucketed.

    Under ``fpar.defer_reduction()`` the cotangents are added into per-bucket buffers instead;
    a call outside it reduces the buffers left by earlier calls of ``owner`` on the same inputs.

    Args:
      sources: ``(slot, tensor, axes)`` in the order their gradients are expected to be ready
        (the reverse of their first use in the forward pass).
      mg: the mesh's process groups.
      bucket_mb: a bucket closes once it holds this many megabytes (the first at 1 MB).
      owner: ``(sharded function, plan)``: with the inputs' identities, what a deferred sum is
        kept under.
      fname: the sharded function's name, for messages.
      kept: where the flat buffers are kept between calls (the plan's), or ``None``.
      layouts: where the buckets' layouts are kept between calls (the plan's), or ``None``.
      rider: the call's ``shard._Agreement``: the first bucket, when its all-reduce is over the
        same ranks as the call's first message, may ride in that message.

    Returns:
      ``({slot: wrapped tensor}, grads)``: the identity on values, and what this call's
      backward sends: ``"reduced"`` (its buckets' all-reduces), ``"deferred"`` (nothing; the
      sums are kept) or ``"none"`` (no gradient flows).  The ranks must agree on it
      (``shard._Agreement.grads``).
    """
    if not torch.is_grad_enabled():
        return {}, "none"  # torch.no_grad(), inference_mode(): no graph, nothing to reduce
    scope = _defer.current()
    if (scope is not None or _defer._PENDING) and any(x.grad_fn is not None for _, x, _ in sources):
        # An input computed in the graph (an activation, a pipeline stage's input) passes its
        # cotangent on within this call's backward, and is a new tensor every microbatch: its
        # sums are never deferred (its own buckets, reduced at once); only leaves (parameters) are.
        leaves = [s for s in sources if s[1].grad_fn is None]
        flowing = [s for s in sources if s[1].grad_fn is not None]
        out, grads = {}, "none"
        if leaves:
            out, grads = reduce_inputs(
                leaves, mg, bucket_mb, owner=owner, fname=fname, kept=kept, layouts=layouts, rider=rider
            )
        sub_kept = None if kept is None else kept.setdefault("flowing", {})
        sub_layouts = None if layouts is None else layouts.setdefault("flowing", {})
        now, reduced = _reduce_now(_buckets(flowing, bucket_mb, mg, sub_layouts), None, sub_kept, None)
        out.update(now)
        return out, grads if grads != "none" else reduced
    buckets = _buckets(sources, bucket_mb, mg, layouts)
    out: dict[int, Tensor] = {}
    held = None
    if scope is not None or _defer._PENDING:
        key, bases = _deferral_key(buckets, owner)
        if key is not None:
            if scope is not None:
                held = _open(scope, fname, key, bases, buckets, kept)
                # accumulate's one torch.func.grad: hooks (plain autograd keeps the Function)
                hooks = scope._expanded_zeros and bool(_functorch.get_interpreter_stack())
                hooks = hooks and not _several_levels(buckets[0][1][0])
                for index, (layout, xs) in enumerate(buckets):
                    deferred = _defer_hooked(held, index, xs) if hooks else _Defer.apply(held, index, *xs)
                    out.update(zip(layout.slots, deferred))
                return out, "deferred"
            held = _defer.claim(key)
    now, grads = _reduce_now(buckets, held, kept, rider)
    out.update(now)
    if scope is None and held is None and _defer._LIVE:
        inputs = [(slot, x) for layout, xs in buckets for slot, x in zip(layout.slots, xs)]
        _watch(now.values(), owner, fname, inputs)
    return out, grads


def _watch(views, owner: tuple, fname: str, inputs: list) -> None:
    """Watch a gradient-taking call outside the context that claimed no deferred sums.

    At the end of its backward, ``owner``'s sums left unclaimed are an error
    (``_defer.watch_unclaimed``; ``inputs``: this call's replicated ``(slot, tensor)``).
    """
    queue = _defer.watch_unclaimed(owner[0], fname, owner[1], inputs)
    view = next((v for v in views if v.requires_grad), None)
    if queue is not None and view is not None:
        view.register_hook(lambda ct: queue())


def _deferral_key(buckets: list, owner: tuple) -> tuple[tuple | None, list]:
    """The key deferred sums over these buckets' tensors are kept under, and the tensors' bases.

    ``(None, [])`` when some tensor cannot be deferred (under more than one transform level).
    """
    bases = [(slot, _defer.base_of(x)) for layout, xs in buckets for slot, x in zip(layout.slots, xs)]
    if not bases or any(b is None for _, b in bases):
        return None, []
    return (*owner, tuple((slot, _defer.identity(b)) for slot, b in bases)), bases


def _open(scope, fname: str, key: tuple, bases: list, buckets: list, kept: dict | None) -> _defer.Deferred:
    """The open deferred sums for ``key``, counting one more deferred call."""
    versions = [(slot, b, b._version) for slot, b in bases]
    buffer = None if kept is None else functools.partial(_kept_view, kept)
    held = _defer.open_deferred(scope, fname, key, versions, len(buckets), buffer)
    held.calls += 1
    if not held.parts:
        for layout, xs in buckets:
            members = [(_defer.base_of(x), at, x.shape) for x, at in zip(xs, layout.offsets)]
            axes = layout.bucket[0]
            held.parts.append((axes if isinstance(axes, tuple) else (axes,), members))
    return held


def _reduce_now(buckets: list, held, kept: dict | None, rider) -> tuple[dict[int, Tensor], str]:
    """Wrap each bucket's tensors so their backward all-reduces the bucket (plus ``held``'s sums)."""
    out: dict[int, Tensor] = {}
    grads = "none"
    for index, (layout, xs) in enumerate(buckets):
        axes, mg = layout.bucket
        if _several_levels(xs[0]):
            # Hooks act at one autograd level; each level's cotangent needs its own sum: a
            # pvary Function per tensor (its backward a psum at every level), not bucketed.
            out.update(
                (slot, _Exchange.apply(x, "pvary", (), 0, axes, mg)) for slot, x in zip(layout.slots, xs)
            )
            grads = "reduced"
            continue
        state = _State(layout, held, index, kept)
        views = [_hooked(x, state, i) for i, x in enumerate(xs)]
        out.update(zip(layout.slots, views))
        hooked = any(v is not x for v, x in zip(views, xs))
        if hooked:
            grads = "reduced"
        if index == 0 and rider is not None and hooked and set(axes) == set(rider.owner.axes):
            state.rider, rider.bucket = rider, state
    return out, grads


@untraced
def _defer_hooked(held, index: int, xs: list[Tensor]) -> list[Tensor]:
    """``_Defer`` as tensor hooks, under ``fpar.optim.accumulate``'s one ``torch.func.grad``.

    Each tensor's view hands its cotangent to the deferred buffer and passes on an expanded
    shared zero (``_defer.deferred_zeros``, which ``accumulate`` skips when it sums microbatches),
    where ``_Defer`` gives no gradient: a hook cannot, but functorch would fill a zero anyway.
    The Function cost ~0.4 ms of functorch's Python per bucket and call.
    """
    metas = [(x.shape, x.dtype, x.device) for x in xs]
    first = [True]  # this call's first cotangent in the bucket counts as the call's add

    def hook(i: int, ct: Tensor) -> Tensor:
        held.add_one(index, i, ct, metas, first[0])
        first[0] = False
        return _functorch._wrap_for_grad(_defer.deferred_zeros(*metas[i]), _functorch.maybe_get_level(ct))

    out = []
    for i, x in enumerate(xs):
        v = x.view_as(x)
        if v.requires_grad:
            v.register_hook(lambda ct, i=i: hook(i, ct))
        out.append(v)
    return out


def _several_levels(x: Tensor) -> bool:
    """Whether ``x`` is differentiated at more than one level.

    Nested ``torch.func`` transforms, ``vmap``, a ``torch.func.grad`` inside plain autograd.
    """
    stack = _functorch.get_interpreter_stack() or ()
    if len(stack) > 1 or any(i.key() != _functorch.TransformType.Grad for i in stack):
        return True
    if stack and _functorch.is_functorch_wrapped_tensor(x):
        inner = _functorch.get_unwrapped(x)
        return inner.requires_grad or _functorch.is_functorch_wrapped_tensor(inner)
    return False


@untraced
def _hooked(x: Tensor, state: _State, i: int) -> Tensor:
    """``x``'s identity, two views deep: its backward launches, then waits on, the bucket's sum.

    Views with hooks on their nodes, not ``autograd.Function``s: under ``torch.func.grad`` every
    custom Function costs ~0.4 ms of functorch's Python in the forward and ~1.5 ms in the
    backward; a hook next to nothing.

    * The outer view's hook (``arrive``) runs as soon as the cotangent of ``x`` in this call is
      final.  Autograd runs the ready node with the highest sequence number first and numbers
      nodes in creation order, so a node created here, before the function's own ops, would run
      only once nothing else is ready: every bucket's all-reduce would start after the whole
      backward (no overlap at all).  It is given ``AccumulateGrad``'s number (the largest)
      instead.  The hook puts the cotangent in the bucket's flat buffer and passes its slot on;
      the bucket's last cotangent starts the all-reduce.
    * The inner view keeps its own number, so its hook (``waited``) runs only once nothing else
      is ready: the rest of the backward (earlier layers) overlaps the communication, and
      nothing reads an unreduced gradient: not ``AccumulateGrad``, not a hook, not
      ``torch.autograd.grad``'s capture, not an op outside the sharded function.
    """
    w = x.view_as(x)
    if not w.requires_grad:
        return x
    # Pre-hooks on the views' nodes (one input each): as tensor hooks, and ~2 us cheaper each.
    w.grad_fn.register_prehook(lambda cts: state.waited(cts[0]))
    v = w.view_as(w)
    node = v.grad_fn
    node.register_prehook(lambda cts: (state.arrive(i, cts[0]),))
    node._set_sequence_nr(_ASAP)
    v._fpar_bucket = (state, i)  # a pipeline stage writes a stacked parameter's rows in place (``_unstack``)
    return v


_ASAP = 2**64 - 1  # AccumulateGrad's sequence number (UINT64_MAX)


def _buckets(
    sources: list, bucket_mb: float, mg, cache: dict | None = None
) -> list[tuple[_Layout, list[Tensor]]]:
    """Group the sources into buckets: ``(layout, tensors)``.

    The same layouts in every call of a plan (kept in ``cache``, by which sources get a gradient
    and their devices).
    """
    flows = tuple((x.requires_grad or _tracked(x), x.device) for _, x, _ in sources)
    layouts = None if cache is None else cache.get(flows)
    if layouts is None:
        open_: dict = {}  # (axes, dtype, device) -> [positions, tensors, bytes, axes], not yet full
        groups: list = []
        for j, ((_, x, axes), (flow, _)) in enumerate(zip(sources, flows)):
            if not flow:
                continue  # no gradient will flow: nothing to reduce
            key = (axes, x.dtype, x.device)
            b = open_.get(key)
            if b is None:
                b = open_[key] = [[], [], 0, axes]
                groups.append(b)
            b[0].append(j)
            b[1].append(x)
            b[2] += x.numel() * x.element_size()
            # As DDP: a bucket closes once it reaches its cap; the first one is small (1 MB), so the
            # last layer's gradients start their all-reduce while the earlier layers' backward runs.
            cap = (FIRST_BUCKET_MB if len(groups) == 1 else bucket_mb) * 2**20
            if b[2] >= cap:
                del open_[key]
        layouts = [(at, _Layout([sources[j][0] for j in at], (axes, mg), xs)) for at, xs, _, axes in groups]
        if cache is not None:
            cache[flows] = layouts
    return [(layout, [sources[j][1] for j in at]) for at, layout in layouts]


def _kept_view(kept: dict, b: int, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Bucket ``b``'s kept flat buffer for deferred sums, as a view of it.

    The view makes the buffer count as held while the sums are open, so ``kept_or_new`` hands it
    to no one else until they (and the gradients the final call makes of them) are dropped.
    """
    buf = kept[b] = kept_or_new(kept.get(b), (numel,), dtype, device)
    return buf.view(numel)


def _tracked(x: Tensor) -> bool:
    return stats._tracked(x) if x.is_floating_point() or x.is_complex() else False
