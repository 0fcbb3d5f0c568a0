"""GPipe as a functional scan over ticks, per device, inside ``fpar.shard``.

Legend: ``p`` stages (the pipe axis), ``m`` microbatches, ``v`` model chunks per stage;
``x_M...`` are the microbatches (dim 0 of size m), ``h_...`` one microbatch's activation.

Each tick every stage applies its layers to the activation it holds, then ``ppermute`` hands
the result to the next stage (the JAX shard_map notebook's ``spmd_pipeline``; praxis'
``LayerwiseShardablePipelined``).  Microbatch ``j`` is on stage ``s`` at tick ``j + s``
(and, with ``v`` chunks, on chunk ``c`` at tick ``c m + j + s``: the circular, "looped"
schedule), so ``v m + p - 1`` ticks run everything.  Differentiating the scan gives GPipe:
every forward, then every backward in reverse, with ``ppermute``'s transpose carrying the
cotangents back a stage per tick.

Bubble ticks: a stage with nothing to do still computes (SPMD), on zeros.  Three masks keep
that work out of the result and its gradient even when the stage function is not finite at
zero (e.g. it normalises its input): the input is zeroed, the output is zeroed, and the
stage parameters pass through ``_GradMask``, an identity whose backward keeps the gradient
only on valid ticks (praxis' ``where(valid, w, stop_gradient(w))``, without copying ``w``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .._collectives import axis_index, axis_size, ppermute, psum
from .._registry import bound_once
from .._tree import tree_leaves, tree_map

__all__ = ["gpipe_scan"]

Tensor = torch.Tensor


def gpipe_scan(stage_fn: Callable, stage_params: Any, xs: Tensor, *, axis: str = "pipe") -> Tensor:
    """Run microbatches through a pipeline of stages; call inside ``fpar.shard``.

    ``stage_params`` is this device's block of parameters stacked on a leading dim over the
    pipe axis (in-spec ``P(axis, ...)``): ``v`` chunks per device, chunk ``c`` of device ``s``
    being layer-chunk ``c * p + s`` of the model (Megatron's interleaved layout; see
    ``stage_major``).  ``stage_fn(chunk_params, h)`` applies one chunk and must keep the
    activation's shape.  Differentiating the sharded function that calls this gives GPipe
    (with ``v > 1``: the looped breadth-first schedule).

    Args:
      stage_fn: ``(chunk_params, h) -> h``, per device (it may use collectives over other axes,
        e.g. tensor parallelism).
      stage_params: pytree of this device's blocks, each with leading dim ``v``.
      xs: the microbatches, ``(m, ...)``, the same on every stage (replicated over ``axis``).
      axis: the pipe mesh axis.

    Returns:
      ``(m, ...)``: the last stage's outputs, replicated over ``axis`` (a ``psum`` of the last
      stage's masked outputs, whose transpose sends the cotangent to that stage only).

    Raises:
      ValueError: leaves of ``stage_params`` with different leading dims, or ``v > 1`` with
        fewer microbatches than stages (a microbatch would return to stage 0 before the
        previous chunk is done with it).

    Example:
      >>> def loss(w, xs):                          # inside fpar.shard over ("pipe",)
      ...     ys = fpar.pipeline.gpipe_scan(lambda w, h: torch.tanh(h @ w), w, xs)
      ...     return (ys ** 2).mean()
      >>> fpar.shard(loss, mesh, (P("pipe"), P()), P())(w_LDD, x_MBD)
    """
    p = axis_size(axis)
    v = _num_chunks(stage_params)
    m = int(xs.shape[0])
    if v > 1 and m < p:
        raise ValueError(
            f"fpar.pipeline.gpipe_scan: {m} microbatches with v={v} chunks per stage on {p} stages; "
            f"the looped schedule needs m >= p, since microbatch j re-enters stage 0 m ticks after "
            f"it left and must have passed all p stages by then. Use at least {p} microbatches."
        )
    stage = axis_index(axis)
    perm = [(i, i + 1) for i in range(p - 1)] + ([(p - 1, 0)] if v > 1 else [])
    zero = torch.zeros_like(xs[0])
    state, outs, circ = zero, [zero] * m, [zero] * m
    for t in range(v * m + p - 1):
        k = t - stage  # how far along this stage is: microbatch k % m of chunk k // m
        valid = (k >= 0) & (k < v * m)
        h = torch.where(stage == 0, _injected(t, m, v, xs, circ, zero), state)
        h = torch.where(valid, h, zero)
        params = _chunk(stage_params, k.div(m, rounding_mode="floor").clamp(0, v - 1), v)
        params = tree_map(lambda w, keep=valid: _GradMask.apply(w, keep), params)
        y = torch.where(valid, stage_fn(params, h), zero)
        slot = _last_stage_slot(t, p, m, v)
        if slot is not None and slot[1] == v - 1:
            outs[slot[0]] = torch.where(stage == p - 1, y, zero)
        state = ppermute(y, axis, perm) if p > 1 else y
        if slot is not None and slot[1] < v - 1:
            circ[slot[0]] = state  # on stage 0: the last stage's output, for its next chunk
    return psum(torch.stack(outs), axis)


def _num_chunks(stage_params: Any) -> int:
    sizes = {int(w.shape[0]) for w in tree_leaves(stage_params) if isinstance(w, Tensor) and w.dim() > 0}
    if len(sizes) != 1:
        raise ValueError(
            f"fpar.pipeline.gpipe_scan: every leaf of stage_params must have the same leading "
            f"(stacked) dim, the number of chunks on this device; got leading dims {sorted(sizes)}. "
            f"Stack the stages' parameters on dim 0 and give them the in-spec P(axis, ...)."
        )
    return sizes.pop()


def _injected(t: int, m: int, v: int, xs: Tensor, circ: list, zero: Tensor) -> Tensor:
    """What stage 0 starts at tick ``t``: a fresh microbatch, one back from the last stage, or zeros."""
    if t >= v * m:
        return zero
    j, c = t % m, t // m
    return xs[j] if c == 0 else circ[j]


def _last_stage_slot(t: int, p: int, m: int, v: int) -> tuple[int, int] | None:
    """(microbatch, chunk) the last stage computes at tick ``t``, or None in its bubble."""
    k = t - (p - 1)
    if not 0 <= k < v * m:
        return None
    return k % m, k // m


def _chunk(stage_params: Any, c: Tensor, v: int) -> Any:
    if v == 1:
        return tree_map(lambda w: w[0], stage_params)
    index = c.reshape(1)
    return tree_map(lambda w: torch.index_select(w, 0, index).squeeze(0), stage_params)


@bound_once
class _GradMask(torch.autograd.Function):
    """Identity on ``w``; the backward keeps the gradient only where ``keep`` (no copy of ``w``)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(w: Tensor, keep: Tensor) -> Tensor:
        return w.view_as(w)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[1])

    @staticmethod
    def backward(ctx, g: Tensor):
        (keep,) = ctx.saved_tensors
        return torch.where(keep, g, torch.zeros((), dtype=g.dtype, device=g.device)), None
