"""Gradient all-reduces of replicated values on a real mesh, bucketed and overlapped like DDP.

A bucket is a group of tensors replicated over the same axes, with the same dtype, in the
order their gradients are expected (the reverse of their first use), closed once it holds
``bucket_mb`` megabytes (the first one at 1 MB, as DDP).  Each bucket is two identity nodes in the autograd graph, created when
the sharded function is entered, in this order::

    x_1..x_k  ->  _Wait  ->  _Launch  ->  the function's uses

* ``_Launch``'s backward runs as soon as every cotangent of its tensors is final (autograd calls
  a node once all of its outputs' gradients are summed).  It copies them into one flat buffer,
  starts an asynchronous all-reduce of it, and hands views of the buffer on to ``_Wait``,
  which is its only consumer.
* ``_Wait``'s backward waits on the all-reduce and passes the (now summed) views on.  The
  autograd engine runs ready nodes latest-created first, and ``_Wait`` was created before any of
  the function's own ops, so it runs only when nothing else is ready: the rest of the backward
  pass (earlier layers) overlaps the communication, and nothing ever reads an unreduced
  gradient: not ``AccumulateGrad``, not a hook, not ``torch.autograd.grad``'s capture, not an
  op outside the sharded function.

The all-reduce is itself a differentiable Function (a psum, whose transpose is pvary), so
grad-of-grad stays right.

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

from .. import _defer
from .. import _stats as stats

__all__ = ["reduce_inputs"]

Tensor = torch.Tensor
FIRST_BUCKET_MB = 1.0  # DDP's first bucket (torch.distributed's _DEFAULT_FIRST_BUCKET_BYTES)


class _State:
    """One bucket's pending all-reduce, shared by its two nodes, and its deferred sum if any."""

    __slots__ = ("work", "held", "index")

    def __init__(self, held: _defer.Deferred | None = None, index: int = 0):
        self.work = None
        self.held, self.index = held, index

    def wait(self) -> None:
        work, self.work = self.work, None
        if work is not None:
            work.wait()

    def flat(self, cts: list[Tensor]) -> Tensor:
        """The bucket's cotangents in one flat buffer, plus the deferred microbatches' sum."""
        buf = self.held.take(self.index) if self.held is not None else None
        if buf is None:
            return torch.cat([ct.reshape(-1) for ct in cts])
        at = 0
        for ct in cts:
            buf[at : at + ct.numel()].view(ct.shape).add_(ct)
            at += ct.numel()
        return buf


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(state, *xs):
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.state = inputs[0]

    @staticmethod
    def backward(ctx, *cts):
        ctx.state.wait()
        return (None, *cts)

    @staticmethod
    def jvp(ctx, _state_t, *ts):
        return tuple(ts)


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
        return (None, None, *_AllReduceFlat.apply(ctx.state, ctx.bucket, *cts))

    @staticmethod
    def jvp(ctx, _s, _b, *ts):
        return tuple(ts)


class _AllReduceFlat(torch.autograd.Function):
    """Start the all-reduce of a bucket's cotangents; returns views of the (pending) flat sum.

    A Function of its own so that a transform above (``torch.func.grad``) hands it plain tensors
    and, for a gradient that is itself differentiated, gets its transpose (psum's: pvary).
    """

    @staticmethod
    def forward(state, bucket, *cts):
        axes, mg = bucket
        flat = state.flat(list(cts))
        stats.record("psum", axes, mg.mesh.axis_size(axes), flat)  # counted as issued: one per bucket
        state.work = dist.all_reduce(flat, group=mg.group(axes), async_op=True)
        out, at = [], 0
        for ct in cts:
            out.append(flat[at : at + ct.numel()].view(ct.shape))
            at += ct.numel()
        return tuple(out)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.state, ctx.bucket = inputs[0], inputs[1]

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
    def jvp(ctx, _h, _i, *ts):
        return tuple(ts)


def reduce_inputs(
    sources: list[tuple[int, Tensor, tuple[str, ...]]], mg, bucket_mb: float, *, owner: tuple, fname: str
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
        state = _State(held, index)
        waited = _Wait.apply(state, *xs)
        launched = _Launch.apply(state, (axes, mg), *waited)
        out.update(zip(slots, launched))
    return out


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


def _tracked(x: Tensor) -> bool:
    return stats._tracked(x) if x.is_floating_point() or x.is_complex() else False
