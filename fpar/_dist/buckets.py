"""Gradient all-reduces of replicated values on a real mesh, bucketed and overlapped like DDP.

A bucket is a group of tensors replicated over the same axes, with the same dtype, in the
order their gradients are expected (the reverse of their first use), closed once it holds
``bucket_mb`` megabytes (the first one at 1 MB, as DDP).  Each bucket is two identity steps in
the autograd graph, created when the sharded function is entered, in this order::

    x_1..x_k  ->  views with a waiting hook  ->  _Launch  ->  the function's uses

* ``_Launch``'s backward runs as soon as every cotangent of its tensors is final: autograd runs
  the ready node with the highest sequence number first, and ``_Launch`` is given
  ``AccumulateGrad``'s (the largest), so it does not wait behind the rest of the backward.  It
  copies the cotangents into one flat buffer, starts an asynchronous all-reduce of it, and hands
  views of the buffer on.
* The views' hooks wait on the all-reduce; the cotangents they pass on are the summed views.
  Those view nodes keep the sequence numbers of their creation, before any of the function's
  own ops, so autograd runs them only when nothing else is ready: the rest of the backward
  (earlier layers) overlaps the communication, and nothing ever reads an unreduced gradient:
  not ``AccumulateGrad``, not a hook, not ``torch.autograd.grad``'s capture, not an op outside
  the sharded function.  (Hooks, not ``autograd.Function``s, where that is enough: under
  ``torch.func.grad`` each custom Function costs ~0.4 ms of functorch's Python per call.)

When the gradient may itself be differentiated (``create_graph``, nested ``torch.func.grad``,
forward-mode AD), the all-reduce is a differentiable Function (``_AllReduceFlat``: a psum,
whose transpose is pvary), so grad-of-grad stays right; otherwise it runs on the plain values.

**Deferral** (``fpar.defer_reduction``, ``fpar/_defer.py``): a call inside the context builds
the same buckets but one node each, ``_Defer``, whose backward adds the cotangents into the
bucket's flat buffer (no communication) and gives the inputs no gradient.  The next call
outside the context on the same input tensors hands the buffers to its buckets: ``_Launch``
adds its cotangents into the buffer and all-reduces that, the sum of every microbatch's
gradient in one message per bucket.  Its bytes are counted in ``fpar.comm_stats`` where the
all-reduce is issued (one call per bucket).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._C import _functorch

from .. import _defer
from .. import _stats as stats

__all__ = ["reduce_inputs"]

Tensor = torch.Tensor
FIRST_BUCKET_MB = 1.0  # DDP's first bucket (torch.distributed's _DEFAULT_FIRST_BUCKET_BYTES)


class _State:
    """One bucket's pending all-reduce, shared by its two nodes, and its deferred sum if any."""

    __slots__ = ("work", "held", "index", "narrow", "kept")

    def __init__(self, held: _defer.Deferred | None = None, index: int = 0, kept: dict | None = None):
        self.work = None
        self.held, self.index = held, index
        self.narrow = None  # (fp16/bf16 flat buffer, its float32 copy being summed)
        self.kept = kept  # the plan's flat buffers by bucket index, reused across calls

    def wait(self) -> None:
        work, self.work = self.work, None
        if work is not None:
            work.wait()
        if self.narrow is not None:
            flat, wide = self.narrow
            self.narrow = None
            with torch._C._DisableFuncTorch():  # plain buffers, also from a hook under functorch
                flat.copy_(wide)  # rounded once, after the float32 sum

    def waited(self, ct: Tensor) -> None:
        """The tensor hook of ``_waiting``: wait on the all-reduce; the cotangent is its result."""
        self.wait()

    def flat(self, cts: list[Tensor]) -> Tensor:
        """The bucket's cotangents in one flat buffer, plus the deferred microbatches' sum."""
        buf = self.held.take(self.index) if self.held is not None else None
        if buf is None:
            flat = [ct.reshape(-1) for ct in cts]
            if self.kept is None:
                return torch.cat(flat)
            # As DDP's persistent buckets: the last call's buffer, when nothing holds it any more
            # (its gradients were dropped: ``zero_grad``, a new step), so no fresh pages are
            # touched every step.  Exact: a tensor, view, work handle or array over it counts.
            buf = self.kept.get(self.index)
            total = sum(f.numel() for f in flat)
            if buf is None or (buf.numel(), buf.dtype, buf.device) != (total, flat[0].dtype, flat[0].device) or not _unheld(buf):
                buf = self.kept[self.index] = torch.cat(flat)
                return buf
            return torch.cat(flat, out=buf)
        at = 0
        for ct in cts:
            buf[at : at + ct.numel()].view(ct.shape).add_(ct)
            at += ct.numel()
        return buf


class _Launch(torch.autograd.Function):
    @staticmethod
    def forward(state, bucket, *xs):
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.state, ctx.bucket = inputs[0], inputs[1]
        ctx.shapes = [(x.shape, x.dtype, x.device) for x in inputs[2:]]

    @staticmethod
    def backward(ctx, *cts):
        cts = [
            ct if ct is not None else torch.zeros(s, dtype=d, device=dev)
            for ct, (s, d, dev) in zip(cts, ctx.shapes)
        ]
        level = _first_order_level(cts)
        if level is None:  # the gradient may itself be differentiated: keep psum's transpose
            return (None, None, *_AllReduceFlat.apply(ctx.state, ctx.bucket, *cts))
        # Nothing can differentiate these cotangents: the all-reduce on their plain values, with
        # no Function around it (under functorch each costs ~0.4 ms of Python per call).
        if level:
            plain = [_functorch._unwrap_for_grad(c, level) for c in cts]
            with torch._C._DisableFuncTorch():
                outs = _start(ctx.state, ctx.bucket, plain)
            return (None, None, *(_functorch._wrap_for_grad(o, level) for o in outs))
        return (None, None, *_start(ctx.state, ctx.bucket, cts))

    @staticmethod
    def jvp(ctx, _s, _b, *ts):
        return tuple(ts)

    @staticmethod
    def vmap(info, in_dims, state, bucket, *xs):
        return _Launch.apply(state, bucket, *xs), tuple(in_dims[2:])


def _first_order_level(cts: list[Tensor]) -> int | None:
    """Where the cotangents live when nothing can differentiate them, else ``None``.

    ``0``: plain autograd without ``create_graph``.  ``L``: the only functorch transform is one
    ``torch.func.grad`` at level ``L``, the cotangents are its wrappers, and what they wrap is
    tracked by nothing (its graph ends when the transform returns).
    """
    if torch.autograd.forward_ad._current_level >= 0:
        return None
    stack = _functorch.get_interpreter_stack()
    if not stack:
        return None if torch.is_grad_enabled() and any(c.requires_grad for c in cts) else 0
    if len(stack) != 1 or stack[0].key() != _functorch.TransformType.Grad:
        return None
    level = stack[0].level()
    for c in cts:
        if _functorch.is_functorch_wrapped_tensor(c):
            if _functorch.maybe_get_level(c) != level:
                return None
            c = _functorch.get_unwrapped(c)
            if _functorch.is_functorch_wrapped_tensor(c):
                return None
        if c.requires_grad:
            return None
    return level


def _start(state: _State, bucket: tuple, cts: list[Tensor]) -> list[Tensor]:
    """Start the all-reduce of a bucket's cotangents; return views of the (pending) flat sum."""
    axes, mg = bucket
    flat = state.flat(cts)
    wire = flat
    if flat.dtype in (torch.float16, torch.bfloat16):
        # fpar's rule for sums over devices (README "Low precision"), as the in-process mesh and
        # every other psum: fp16/bf16 summed in float32 and rounded once.
        wire = flat.float()
        state.narrow = (flat, wire)
    stats.record("psum", axes, mg.mesh.axis_size(axes), wire)  # counted as issued: one per bucket
    state.work = dist.all_reduce(wire, group=mg.group(axes), async_op=True)
    out, at = [], 0
    for ct in cts:
        out.append(flat[at : at + ct.numel()].view(ct.shape))
        at += ct.numel()
    return out


class _AllReduceFlat(torch.autograd.Function):
    """Start the all-reduce of a bucket's cotangents; returns views of the (pending) flat sum.

    A Function of its own so that a transform above (``torch.func.grad``) hands it plain tensors
    and, for a gradient that is itself differentiated, gets its transpose (psum's: pvary).
    """

    @staticmethod
    def forward(state, bucket, *cts):
        return tuple(_start(state, bucket, list(cts)))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.state, ctx.bucket = inputs[0], inputs[1]

    @staticmethod
    def jvp(ctx, _s, _b, *ts):
        """Forward mode over the backward (hessian): the all-reduce is linear, so the tangents are
        all-reduced too (a psum each, not bucketed: a second order is rare)."""
        from .exchange import _Exchange

        axes, mg = ctx.bucket
        return tuple(_Exchange.apply(t, "psum", (), 0, axes, mg) for t in ts)

    @staticmethod
    def vmap(info, in_dims, state, bucket, *cts):
        """Batched cotangents (jacrev, hessian): each one psummed with its batch dim carried along.

        Not bucketed: the psum is an ``_Exchange`` Function, so transforms further out (the
        forward mode of ``hessian``) see its rules; raw process-group calls here would act on
        the primal values only.
        """
        from .exchange import _Exchange

        if state.held is not None:
            raise NotImplementedError(
                "fpar.defer_reduction(): a deferred gradient bucket cannot be reduced under vmap "
                "(jacrev, hessian, per-example gradients); leave the context for such calls."
            )
        axes, mg = bucket
        out = []
        for c, d in zip(cts, in_dims[2:]):
            c = c.movedim(d, 0) if d is not None else c.expand(info.batch_size, *c.shape)
            out.append(_Exchange.apply(c, "psum", (), 1, axes, mg))
        return tuple(out), (0,) * len(out)

    @staticmethod
    def backward(ctx, *gs):
        from .exchange import _Exchange

        # The all-reduce is a psum (local -> replicated); it transposes to pvary: the identity
        # on the replicated cotangent, whose own transpose is the psum again.
        ctx.state.wait()
        axes, mg = ctx.bucket
        return (None, None, *(_Exchange.apply(g, "pvary", (), 0, axes, mg) for g in gs))


class _Defer(torch.autograd.Function):
    """A deferred bucket (``fpar.defer_reduction``): backward adds the cotangents into its buffer."""

    @staticmethod
    def forward(held, index, *xs):
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.held, ctx.index = inputs[0], inputs[1]
        ctx.metas = [(x.shape, x.dtype, x.device) for x in inputs[2:]]

    @staticmethod
    def backward(ctx, *cts):
        ctx.held.add(ctx.index, list(cts), ctx.metas)
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
) -> dict[int, Tensor]:
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

    Returns:
      ``{slot: wrapped tensor}``: the identity on values.
    """
    buckets = _buckets(sources, bucket_mb)
    out: dict[int, Tensor] = {}
    scope = _defer.current()
    held = None
    if scope is not None or _defer._PENDING:
        bases = [(slot, _defer.base_of(x)) for slots, xs, _ in buckets for slot, x in zip(slots, xs)]
        if bases and all(b is not None for _, b in bases):
            key = (*owner, tuple((slot, _defer.identity(b)) for slot, b in bases))
            if scope is not None:
                versions = [(slot, b, b._version) for slot, b in bases]
                held = _defer.open_deferred(scope, fname, key, versions, len(buckets))
                held.calls += 1
                for index, (slots, xs, _) in enumerate(buckets):
                    out.update(zip(slots, _Defer.apply(held, index, *xs)))
                return out
            held = _defer.claim(key)
    for index, (slots, xs, axes) in enumerate(buckets):
        state = _State(held, index, kept)
        waited = [_waiting(x, state) for x in xs]
        launched = _Launch.apply(state, (axes, mg), *waited)
        _run_when_ready(launched[0].grad_fn)
        out.update(zip(slots, launched))
    return out


def _waiting(x: Tensor, state: _State) -> Tensor:
    """``x``'s identity whose backward waits on the bucket's all-reduce.

    A view with a tensor hook rather than an ``autograd.Function``: under ``torch.func.grad``
    every custom Function costs ~0.4 ms of functorch's Python per call, a hook nothing.  The
    view's node is created before the function's own ops, so autograd runs it (and the hook) only
    once nothing else is ready; its input comes from ``_Launch``, so it runs after the launch.
    """
    w = x.view_as(x)
    if w.requires_grad:
        w.register_hook(state.waited)
    return w


def _run_when_ready(node) -> None:
    """Let autograd run ``node`` as soon as its gradients are complete, as it does ``AccumulateGrad``.

    The engine runs the ready node with the highest sequence number first, and numbers nodes in
    creation order.  ``_Launch`` is created before the function's own ops, so with its own number
    it would run only once nothing else is ready: after the whole backward of the function, every
    bucket's all-reduce then started at the end, latest bucket first, each waited on before the
    next began (no overlap at all).  ``AccumulateGrad`` nodes carry the largest number; so does
    ``_Launch`` now.  The waiting views keep their own, so they still run only when nothing else
    is ready.
    """
    if node is not None:
        node._set_sequence_nr(_ASAP)


_ASAP = 2**64 - 1  # AccumulateGrad's sequence number (UINT64_MAX)


def _buckets(sources: list, bucket_mb: float) -> list[tuple[list[int], list[Tensor], tuple]]:
    """Group the sources into buckets: ``(slots, tensors, axes)``, the same for every call of a plan."""
    open_: dict = {}  # (axes, dtype, device) -> [slots, tensors, bytes, axes], not yet full
    buckets: list = []
    for slot, x, axes in sources:
        if not x.requires_grad and not _tracked(x):
            continue  # no gradient will flow: nothing to reduce
        key = (axes, x.dtype, x.device)
        b = open_.get(key)
        if b is None:
            b = open_[key] = [[], [], 0, axes]
            buckets.append(b)
        b[0].append(slot)
        b[1].append(x)
        b[2] += x.numel() * x.element_size()
        # As DDP: a bucket closes once it reaches its cap; the first one is small (1 MB), so the
        # last layer's gradients start their all-reduce while the earlier layers' backward runs.
        cap = (FIRST_BUCKET_MB if len(buckets) == 1 else bucket_mb) * 2**20
        if b[2] >= cap:
            del open_[key]
    return [(slots, xs, axes) for slots, xs, _, axes in buckets]


def _unheld(buf: Tensor) -> bool:
    """Whether nothing but ``buf`` itself refers to its memory (the count includes the storage
    object asked for here)."""
    return torch._C._storage_Use_Count(buf.untyped_storage()._cdata) == 2


def _tracked(x: Tensor) -> bool:
    return stats._tracked(x) if x.is_floating_point() or x.is_complex() else False
