"""Collectives over named mesh axes.

Inside a function run by ``fpar.shard``, each collective names one mesh axis or a tuple of
axes (one combined axis, indexed major-to-minor in the order written, for every collective
including ``ppermute``).  Semantics, shapes and errors follow ``jax.lax``.

How it works.  ``fpar.shard`` runs the per-device function under one ``torch.func.vmap`` level per
mesh axis, so a value is batched at an axis's level exactly when it varies over that axis (JAX's
"varying manual axes", tracked by vmap for free).  A collective is an ``autograd.Function`` whose
``vmap`` rule, level by level, turns the levels of the axes it names into explicit leading dims
and then performs the exchange on the stacked blocks (``_local/exchange.py`` in-process).  Its
``backward``/``jvp`` (used only when the user differentiates *inside* the sharded function) are
the transposes of DESIGN §3: psum <-> broadcast, all_gather <-> psum_scatter, ppermute(perm) <->
ppermute(inverse), all_to_all(s, c) <-> all_to_all(c, s).
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._C._functorch import (
    _unwrap_for_grad,
    get_unwrapped,
    is_batchedtensor,
    maybe_current_level,
    maybe_get_level,
)

from . import _stats as stats
from ._compile import opaque, untraced
from ._errors import UnboundAxisError
from ._registry import internal
from ._tree import tree_map

__all__ = [
    "all_gather",
    "all_gather_invariant",
    "all_to_all",
    "axis_index",
    "axis_size",
    "pmax",
    "pmean",
    "pmin",
    "ppermute",
    "psum",
    "psum_scatter",
    "pvary",
]

Tensor = torch.Tensor
AxisName = str | tuple[str, ...]


# The axis environment ------------------------------------------------------------------------


@dataclasses.dataclass
class Frame:
    """What a running ``fpar.shard`` call binds: its mesh and how each axis is represented."""

    mesh: Any
    fname: str
    exchange: Callable[[Op, Tensor], Tensor]  # performs an op on explicit-axis dims
    pvaried: dict = dataclasses.field(default_factory=dict)  # (id, axes) -> (tensor, its pvary)
    backend: str = "local"  # "local" (in-process) or "dist" (one process per device)
    levels: dict[int, str] = dataclasses.field(default_factory=dict)  # vmap level -> axis
    token: Tensor | None = None  # batched at every mesh level: makes vmap call our rules
    index: dict[str, Tensor] = dataclasses.field(default_factory=dict)  # coordinate per axis
    direct: Callable | None = None  # real mesh: (kind, axes, params, local block) -> exchanged block
    inputs: dict[int, str] = dataclasses.field(default_factory=dict)  # in-process: storage -> "args[0]"
    varying: Callable | None = None  # real mesh: tensor -> the mesh axes it varies over (frozenset)

    def release(self) -> None:
        """Drop the call's tensors once it returns (the frame may outlive it in a reference cycle)."""
        self.pvaried.clear()
        self.index = {}
        self.inputs = {}
        self.token = None


_ENV = threading.local()


def frames() -> list[Frame]:
    """The stack of active ``fpar.shard`` frames in this thread."""
    if not hasattr(_ENV, "stack"):
        _ENV.stack = []
    return _ENV.stack


def _bound(api: str, axis_name: AxisName) -> tuple[Frame, tuple[str, ...]]:
    """Return the active frame and ``axis_name`` as a tuple, or raise a clear error."""
    axes = _as_axes(api, axis_name)
    stack = frames()
    if not stack or stack[-1].token is None:
        raise UnboundAxisError(
            f"fpar.{api} over {axis_name!r} was called outside fpar.shard: collectives name mesh "
            f"axes, which exist only inside a function run by fpar.shard(f, mesh, in_specs, "
            f"out_specs)."
        )
    frame = stack[-1]
    for a in axes:
        if a not in frame.mesh.shape:
            raise UnboundAxisError(
                f"fpar.{api} in fpar.shard({frame.fname}): {a!r} is not an axis of the mesh "
                f"(mesh axes: {frame.mesh.axis_names})."
            )
    return frame, axes


def _as_axes(api: str, axis_name: AxisName) -> tuple[str, ...]:
    axes = (axis_name,) if isinstance(axis_name, str) else axis_name
    if not isinstance(axes, (tuple, list)) or not all(isinstance(a, str) for a in axes):
        raise TypeError(
            f"fpar.{api}: axis_name must be a mesh axis name or a tuple of names, got {axis_name!r}."
        )
    if len(set(axes)) != len(axes):
        raise ValueError(f"fpar.{api}: axis_name {tuple(axes)} names an axis more than once.")
    if not axes:
        raise ValueError(f"fpar.{api}: axis_name is empty; name at least one mesh axis.")
    return tuple(axes)


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
        return _extreme_share(op, token, *saved, ct, transpose=True)
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
    return math.prod(shape[a] for a in op.axes)


# API ----------------------------------------------------------------------------------------


@opaque  # never traced by Dynamo: see _compile.py
def _apply(api: str, x: Any, axis_name: AxisName, kind: str, params: tuple = (), *, check=None, number=None):
    frame, axes = _bound(api, axis_name)
    n = frame.mesh.axis_size(axes)
    pairs = len(params[0]) if kind == "ppermute" else None

    def one(leaf):
        if isinstance(leaf, Tensor):
            leaf_params = check(leaf, n) if check is not None else params
            if frame.direct is not None:  # a real mesh: plain local tensors, no vmap levels
                return frame.direct(kind, axes, leaf_params, leaf)  # counted where it is issued
            _count_implicit_pvary(frame, leaf, axes)
            out = _Collective.apply(leaf, frame.token, Op(kind, axes, leaf_params))
            stats.record(kind, axes, n, leaf, pairs)
            stats.count_transpose(out, kind, axes, n, pairs)
            return out
        if number is not None and isinstance(leaf, (int, float, bool)):
            return number(leaf, n)
        raise TypeError(
            f"fpar.{api} in fpar.shard({frame.fname}): got a {type(leaf).__name__}, not a tensor; "
            f"collectives take pytrees of tensors."
        )

    return one(x) if isinstance(x, Tensor) else tree_map(one, x)


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


@untraced  # a frame Dynamo never compiles: see _compile.py
def psum(x: Any, axis_name: AxisName) -> Any:
    """Sum over mesh axes: ``psum(x varying over axis) -> x replicated over axis``.

    Args:
      x: a pytree of tensors (or Python numbers: ``psum(1, 'i')`` is the size of ``'i'``).
      axis_name: a mesh axis or a tuple of axes.

    Returns:
      The sum over the devices of the axis, the same on each of them.

    Example:
      >>> fpar.psum(partial_BD, "tensor")   # row-parallel linear: sum the partial products
    """
    return _apply("psum", x, axis_name, "psum", number=lambda c, n: c * n)


@untraced  # a frame Dynamo never compiles: see _compile.py
def pmean(x: Any, axis_name: AxisName) -> Any:
    """Mean over mesh axes: ``pmean(x varying over axis) -> x replicated over axis``."""
    return _apply("pmean", x, axis_name, "pmean", number=lambda c, n: c)


@untraced  # a frame Dynamo never compiles: see _compile.py
def pmax(x: Any, axis_name: AxisName) -> Any:
    """Elementwise max over mesh axes: ``pmax(x varying) -> x replicated``.

    Differentiable (unlike JAX's): the gradient goes to the device holding the max, split evenly
    between ties.
    """
    return _apply("pmax", x, axis_name, "pmax", number=lambda c, n: c)


@untraced  # a frame Dynamo never compiles: see _compile.py
def pmin(x: Any, axis_name: AxisName) -> Any:
    """Elementwise min over mesh axes: ``pmin(x varying) -> x replicated``; differentiable like pmax."""
    return _apply("pmin", x, axis_name, "pmin", number=lambda c, n: c)


@untraced  # a frame Dynamo never compiles: see _compile.py
def all_gather(x: Any, axis_name: AxisName, *, axis: int = 0, tiled: bool = False) -> Any:
    """Gather every device's block: ``all_gather(x: [*s]) -> [*s[:axis], n, *s[axis:]]``.

    With ``tiled=True`` the blocks are concatenated along ``axis`` instead of stacked on a new dim.
    As in JAX the result counts as varying over the axis (it transposes to ``psum_scatter``).

    Args:
      x: a pytree of tensors.
      axis_name: a mesh axis or a tuple of axes (blocks ordered by the combined index).
      axis: where the gathered dim goes.
      tiled: concatenate instead of stack.
    """

    def check(leaf, n):
        rank = leaf.dim() + (0 if tiled else 1)
        return (_dim("all_gather", "axis", axis, rank), bool(tiled))

    return _apply("all_gather", x, axis_name, "all_gather", check=check)


@untraced  # a frame Dynamo never compiles: see _compile.py
def all_gather_invariant(x: Any, axis_name: AxisName, *, axis: int = 0, tiled: bool = False) -> Any:
    """``all_gather`` whose result is typed replicated over the axis (JAX's ``all_gather_invariant``).

    ``all_gather_invariant(x varying) -> gathered x replicated``.  Use it where the gathered
    value must leave ``fpar.shard`` with an out_spec that leaves the axis out, e.g. parameters
    gathered after a ZeRO update.  Its transpose is a local slice (each device keeps its own
    block of the replicated cotangent): no communication in the backward.
    """

    def check(leaf, n):
        rank = leaf.dim() + (0 if tiled else 1)
        return (_dim("all_gather_invariant", "axis", axis, rank), bool(tiled))

    return _apply("all_gather_invariant", x, axis_name, "all_gather_invariant", check=check)


@untraced  # a frame Dynamo never compiles: see _compile.py
def psum_scatter(x: Any, axis_name: AxisName, *, scatter_dimension: int = 0, tiled: bool = False) -> Any:
    """Sum over devices, each keeping one chunk: the transpose of ``all_gather``.

    ``tiled=False`` needs ``x.shape[scatter_dimension] == n`` and removes that dim; ``tiled=True``
    needs it divisible by ``n`` and keeps 1/n of it.
    """

    def check(leaf, n):
        d = _dim("psum_scatter", "scatter_dimension", scatter_dimension, leaf.dim())
        _fits("psum_scatter", "scatter_dimension", d, leaf.shape[d], n, tiled)
        return (d, bool(tiled))

    return _apply("psum_scatter", x, axis_name, "psum_scatter", check=check)


@opaque  # never traced by Dynamo: see _compile.py
def ppermute(x: Any, axis_name: AxisName, perm: Sequence[tuple[int, int]]) -> Any:
    """Send blocks between devices: device ``dst`` gets the block of ``src`` for each ``(src, dst)``.

    Devices that are nobody's destination get zeros.  Indices are positions along the (combined)
    axis; a negative index counts from the end, as in Python.
    """
    frame, axes = _bound("ppermute", axis_name)
    n = frame.mesh.axis_size(axes)
    pairs = _check_perm(perm, n)
    return _apply("ppermute", x, axis_name, "ppermute", (pairs,))


@untraced  # a frame Dynamo never compiles: see _compile.py
def all_to_all(x: Any, axis_name: AxisName, split_axis: int, concat_axis: int, *, tiled: bool = False) -> Any:
    """Split ``split_axis`` into n chunks, send chunk j to device j, join what arrives on ``concat_axis``.

    ``tiled=False`` needs ``x.shape[split_axis] == n``: that dim is removed and the received blocks
    are stacked on a new dim at ``concat_axis``.  ``tiled=True`` needs divisibility and concatenates.
    """

    def check(leaf, n):
        s = _dim("all_to_all", "split_axis", split_axis, leaf.dim())
        c = _dim("all_to_all", "concat_axis", concat_axis, leaf.dim())
        _fits("all_to_all", "split_axis", s, leaf.shape[s], n, tiled)
        return (s, c, bool(tiled))

    return _apply("all_to_all", x, axis_name, "all_to_all", check=check)


@opaque  # never traced by Dynamo: see _compile.py
def pvary(x: Any, axis_name: AxisName) -> Any:
    """Mark a replicated value as varying over axes: ``pvary(x replicated) -> x varying``.

    The identity on values; its transpose sums the cotangent over the axes (the data-parallel
    gradient all-reduce).  fpar inserts it wherever a replicated tensor meets a varying one,
    as JAX does, so users rarely call it.
    """
    frame, axes = _bound("pvary", axis_name)
    n = frame.mesh.axis_size(axes)

    def one(t: Tensor) -> Tensor:
        if frame.direct is not None:  # a real mesh counts the sum where it issues it
            return frame.direct("pvary", axes, (), t)
        stats.count_transpose(t, "pvary", axes, n)
        return _Collective.apply(t, frame.token, Op("pvary", axes))

    return tree_map(one, x)


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


@opaque  # never traced by Dynamo: see _compile.py
def axis_index(axis_name: AxisName) -> Tensor:
    """This device's index along an axis (int64 scalar; a tuple is one combined axis, major first)."""
    frame, axes = _bound("axis_index", axis_name)
    index = frame.index[axes[0]]
    for a in axes[1:]:
        index = index * frame.mesh.shape[a] + frame.index[a]
    return index


@opaque  # never traced by Dynamo: see _compile.py
def axis_size(axis_name: AxisName) -> int:
    """The size of an axis (the product for a tuple), as a Python int."""
    frame, axes = _bound("axis_size", axis_name)
    return frame.mesh.axis_size(axes)


# Error checking and messages ---------------------------------------------------------------


def _dim(api: str, what: str, d: int, rank: int) -> int:
    if isinstance(d, bool) or not isinstance(d, int):
        raise TypeError(f"fpar.{api}: {what} must be an int, got {d!r}.")
    if not -rank <= d < rank:
        raise ValueError(
            f"fpar.{api}: {what}={d} is out of range for a value of rank {rank - (api == 'all_gather')}."
        )
    return d % rank


def _fits(api: str, what: str, d: int, size: int, n: int, tiled: bool) -> None:
    if tiled and size % n:
        raise ValueError(
            f"fpar.{api}: dim {what}={d} has size {size}, which must be divisible by the axis size "
            f"{n} when tiled=True."
        )
    if not tiled and size != n:
        raise ValueError(
            f"fpar.{api}: dim {what}={d} has size {size}, which must equal the axis size {n} when "
            f"tiled=False (or pass tiled=True to split it into {n} chunks)."
        )


def _check_perm(perm, n: int) -> tuple[tuple[int, int], ...]:
    if not isinstance(perm, (list, tuple)):
        raise TypeError(f"fpar.ppermute: perm must be a list or tuple of (src, dst) pairs, got {perm!r}.")
    pairs = []
    for pair in perm:
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(i, int) for i in pair)):
            raise TypeError(
                f"fpar.ppermute: each entry of perm must be a (src, dst) pair of ints, got {pair!r}."
            )
        for i in pair:
            if not -n <= i < n:
                raise ValueError(
                    f"fpar.ppermute: index {i} in pair {tuple(pair)} is out of range for an axis of size {n}."
                )
        pairs.append((pair[0] % n, pair[1] % n))
    srcs, dsts = [s for s, _ in pairs], [d for _, d in pairs]
    if len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
        raise ValueError(
            f"fpar.ppermute: sources and destinations must be unique, got {tuple(map(tuple, perm))}: "
            f"each device sends at most one block and receives at most one."
        )
    return tuple(pairs)
