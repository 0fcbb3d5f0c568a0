"""The in-process mesh's collectives: an ``autograd.Function`` whose ``vmap`` rule does the exchange.

``fpar.shard`` in-process runs the per-device function under one ``torch.func.vmap`` level per
mesh axis, so a value is batched at an axis's level exactly when it varies over that axis (JAX's
"varying manual axes", tracked by vmap for free).  A collective is ``_Collective``, whose ``vmap``
rule, level by level, turns the levels of the axes it names into explicit leading dims and then
performs the exchange on the stacked blocks (``exchange.py``).  Its ``backward``/``jvp`` (used
only when the user differentiates *inside* the sharded function) are the transposes of DESIGN
§3: psum <-> broadcast, all_gather <-> psum_scatter, all_gather_invariant -> this device's block,
ppermute(perm) <-> ppermute(inverse), all_to_all(s, c) <-> all_to_all(c, s).

Here too: ``collective``, what ``Frame.collective`` runs in-process (the public functions in
``_collectives.py`` dispatch to it), ``batched_levels`` (the mesh axes a value varies over), and
the implicit pvary of replicated operands (counted, or explicit under a user's transform).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch._C._functorch import (
    _unwrap_for_grad,
    get_unwrapped,
    is_batchedtensor,
    maybe_current_level,
    maybe_get_level,
)

from .. import _stats as stats
from .._collectives import Frame, axis_index, frames
from .._registry import internal

__all__ = ["Op", "batched_levels", "collective", "implicit_pvary"]

Tensor = torch.Tensor


# The collective as an autograd.Function with a vmap rule -------------------------------------


@dataclasses.dataclass(frozen=True)
class Op:
    """One collective: its kind and parameters, and where its axes' dims are so far.

    ``explicit`` lists the axes whose vmap levels the rule has already turned into leading
    dims (in dim order); ``nbatch`` counts the batch dims that follow them (levels the
    collective maps over).  Parameters (``axis``, ``perm``, ...) refer to logical dims.
    """

    kind: str
    axes: tuple[str, ...]
    params: tuple = ()
    explicit: tuple[str, ...] = ()
    nbatch: int = 0
    replicated: tuple[str, ...] = ()  # explicit axes the input was replicated over (implicit pvary)


VARYING = {"all_gather", "psum_scatter", "ppermute", "all_to_all", "pvary"}


@internal
class _Collective(torch.autograd.Function):
    generate_vmap_rule = False

    @staticmethod
    def forward(x: Tensor, token: Tensor, op: Op) -> Tensor:
        # Reached only at a grad/jvp level *inside* the sharded function; the mesh levels are
        # below it, so dispatch again: the vmap rules below do the exchange.
        return _Collective.apply(x, token, op)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, token, op = inputs
        ctx.op = op
        ctx.token = token
        if op.kind in ("pmax", "pmin"):
            ctx.save_for_backward(x, output)
            ctx.save_for_forward(x, output)

    @staticmethod
    def backward(ctx, ct: Tensor):
        saved = ctx.saved_tensors if ctx.op.kind in ("pmax", "pmin") else ()
        return _transpose(ctx.op, ctx.token, ct, *saved), None, None

    @staticmethod
    def jvp(ctx, x_t: Tensor, token_t, op_t):
        op = ctx.op
        if op.kind in ("pmax", "pmin"):
            x, y = ctx.saved_tensors
            return _extreme_share(op, ctx.token, x, y, x_t, transpose=False)
        return _Collective.apply(x_t, ctx.token, op)  # every other collective is linear

    @staticmethod
    def vmap(info, in_dims, x: Tensor, token: Tensor, op: Op):
        frame = frames()[-1]
        level = (maybe_current_level() or 0) + 1  # the level this rule peels
        axis = frame.levels.get(level)  # None: a user's own vmap level
        xd = in_dims[0]
        varying = op.kind in VARYING
        if axis is not None and axis in op.axes:
            # Invariant input: JAX's implicit pvary, i.e. the same block on every device.
            x = x.movedim(xd, 0) if xd is not None else x.expand(info.batch_size, *x.shape)
            op = dataclasses.replace(
                op, explicit=(axis, *op.explicit), replicated=op.replicated + ((axis,) if xd is None else ())
            )
            out_dim = 0 if varying else None
        elif xd is None:  # not batched here: the collective does not touch this level
            out_dim = None
        else:
            k = len(op.explicit)
            x = x.movedim(xd, k)
            op = dataclasses.replace(op, nbatch=op.nbatch + 1)
            out_dim = k if varying else 0
        if _last_level(frame, level, op):
            return frame.exchange(op, x), out_dim
        return _Collective.apply(x, token, op), out_dim


def _last_level(frame: Frame, level: int, op: Op) -> bool:
    """Whether the exchange runs now, on dims made explicit so far.

    Once every axis of the collective is explicit, plain tensor ops on the other levels'
    BatchedTensors do the rest.
    """
    return len(op.explicit) == len(op.axes)


def _transpose(op: Op, token: Tensor, ct: Tensor, *saved: Tensor) -> Tensor:
    kind, p = op.kind, op.params
    if kind == "psum":
        return ct  # psum transposes to pvary: the replicated cotangent, on every device
    if kind == "pvary":
        return _Collective.apply(ct, token, dataclasses.replace(op, kind="psum"))
    if kind == "pmean":
        return ct / _size(op)
    if kind in ("pmax", "pmin"):
        x, y = saved
        return _extreme_share(op, token, x, y, ct, transpose=True)
    if kind == "all_gather_invariant":
        axis, tiled = p
        return _own_block(op, ct, axis, tiled)  # JAX: a dynamic_slice at axis_index, no communication
    if kind == "all_gather":
        axis, tiled = p
        return _Collective.apply(
            ct, token, dataclasses.replace(op, kind="psum_scatter", params=(axis, tiled))
        )
    if kind == "psum_scatter":
        dim, tiled = p
        return _Collective.apply(ct, token, dataclasses.replace(op, kind="all_gather", params=(dim, tiled)))
    if kind == "ppermute":
        inverse = tuple((dst, src) for src, dst in p[0])
        return _Collective.apply(ct, token, dataclasses.replace(op, params=(inverse,)))
    if kind == "all_to_all":
        split, concat, tiled = p
        return _Collective.apply(ct, token, dataclasses.replace(op, params=(concat, split, tiled)))
    raise AssertionError(kind)  # unreachable: every kind is listed above


def _own_block(op: Op, ct: Tensor, axis: int, tiled: bool) -> Tensor:
    """This device's block of a replicated ``ct`` gathered along ``axis`` (no communication)."""
    n = _size(op)
    index = axis_index(op.axes)
    blocks = ct.unflatten(axis, (n, ct.shape[axis] // n)) if tiled else ct
    return blocks.index_select(axis, index.reshape(1)).squeeze(axis)


def _extreme_share(op: Op, token: Tensor, x: Tensor, y: Tensor, t: Tensor, *, transpose: bool) -> Tensor:
    """Derivative of pmax/pmin: the devices holding the extreme share it evenly."""
    mask = (x == y).to(t.dtype)
    count = _Collective.apply(mask, token, dataclasses.replace(op, kind="psum"))
    if transpose:
        return t * mask / count
    return _Collective.apply(t * mask, token, dataclasses.replace(op, kind="psum")) / count


def _size(op: Op) -> int:
    shape = frames()[-1].mesh.shape
    return math.prod([shape[a] for a in op.axes])


# Dispatch from the public API ----------------------------------------------------------------


def collective(frame: Frame, kind: str, axes: tuple[str, ...], params: tuple, x: Tensor) -> Tensor:
    """One collective on this frame's value ``x`` (``Frame.collective`` in-process), counted.

    ``pvary`` counts its transpose's sum; every other kind counts itself, its transpose, and the
    gradient sum of an input replicated over some of its axes (``_count_implicit_pvary``).
    """
    n = frame.mesh.axis_size(axes)
    if kind == "pvary":
        stats.count_transpose(x, "pvary", axes, n)
        return _Collective.apply(x, frame.token, Op("pvary", axes))
    pairs = len(params[0]) if kind == "ppermute" else None
    _count_implicit_pvary(frame, x, axes)
    out = _Collective.apply(x, frame.token, Op(kind, axes, params))
    stats.record(kind, axes, n, x, pairs)
    stats.count_transpose(out, kind, axes, n, pairs)
    return out


# Which mesh axes a value varies over, and the implicit pvary ---------------------------------


def batched_levels(t: Tensor, ours: dict[int, str]) -> set[int]:
    """The mesh levels (keys of ``ours``) at which ``t`` is batched, i.e. the axes it varies over."""
    out: set[int] = set()
    if not ours:  # a mesh with no axes: nothing varies
        return out
    lowest = min(ours)
    while True:
        level = maybe_get_level(t)
        if level < lowest:  # -1 for a plain tensor; below: an outer transform's wrapper
            return out
        if is_batchedtensor(t):
            if level in ours:
                out.add(level)
            t = get_unwrapped(t)
        else:  # a user's grad transform inside the sharded function
            t = _unwrap_for_grad(t, level)


def varying_of(frame: Frame, t: Tensor) -> frozenset[str]:
    """The mesh axes ``t`` varies over in an in-process call: the mesh levels it is batched at.

    For a query of the per-device function (dropout's batch axes, ``clip_by_global_norm``'s
    groups).  An eager call records each answer, in order, in ``frame.queried``: a compiled call
    of the same signature, which cannot read vmap's batching, answers its queries from that record
    (``compiled.py``): the per-device function runs the same code on the same shapes, so it asks
    the same questions in the same order, as it runs the same collectives.
    """
    axes = frozenset(frame.levels[lv] for lv in batched_levels(t, frame.levels))
    if frame.queried is not None:
        frame.queried.append((tuple(t.shape), t.dtype, axes))
    return axes


def _count_implicit_pvary(frame: Frame, leaf: Tensor, axes: tuple[str, ...]) -> None:
    """Count the gradient all-reduce of a collective's input replicated over some of its axes.

    (The real mesh sums that input's cotangent over those axes; in-process vmap's broadcast
    does it, so only the traffic is counted, as for every implicit pvary.)
    """
    if not frame.levels or not (leaf.is_floating_point() or leaf.is_complex()):
        return
    varying = {frame.levels[lv] for lv in batched_levels(leaf, frame.levels)}
    inv = tuple(a for a in axes if a not in varying)
    if inv:
        stats.count_transpose(leaf, "pvary", inv, frame.mesh.axis_size(inv))


def implicit_pvary(frame: Frame, t: Tensor, axes: tuple[str, ...]) -> Tensor:
    """The pvary of a replicated ``t`` that an op is about to combine with varying values.

    ``t`` stays unbatched (the op's result varies anyway, and an unbatched operand keeps
    matmuls folded).  Its transpose is a psum over ``axes``, at every level:

    * the gradient of the sharded function (the physical level): vmap's own broadcast sums
      the cotangent over the axis, so only the traffic is counted (the real mesh does not run
      this engine: see ``_dist/shard.py``);
    * a gradient taken inside the sharded function (a user's grad transform above the mesh
      levels): an explicit pvary whose transpose psums, exactly as JAX's.  (This is
      what makes inner gradients of tensor-parallel models right; its visible side is JAX's
      jax-ml/jax#36886: the inner gradient w.r.t. a replicated parameter is the psum.)

    A tensor used several times (the same tensor object) is pvaried once: its uses share one
    node, so its cotangents are summed locally first and all-reduced once, as DDP does.
    """
    key = (id(t), axes)
    if key in frame.pvaried and frame.pvaried[key][0] is t:
        return frame.pvaried[key][1]
    stats.count_transpose(t, "pvary", axes, frame.mesh.axis_size(axes))
    if (maybe_current_level() or 0) > max(frame.levels):
        # A user's transform inside the sharded function: pvary explicitly (JAX's inserted
        # pvary), so its transpose at that level is a psum.  Rare enough that the batched
        # operand's cost does not matter.
        out = _Collective.apply(t, frame.token, Op("pvary", axes))
    else:
        out = t
    frame.pvaried[key] = (t, out)  # keeps t alive, so its id is not reused within the call
    return out
