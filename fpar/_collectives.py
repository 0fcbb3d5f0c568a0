"""Collectives over named mesh axes.

Inside a function run by ``fpar.shard``, each collective names one mesh axis or a tuple of
axes (one combined axis, indexed major-to-minor in the order written, for every collective
including ``ppermute``).  Semantics, shapes and errors follow ``jax.lax``.

This module is the API, the same for both meshes: the public functions check their arguments
(errors as ``jax.lax``'s), find the running ``fpar.shard`` call's ``Frame`` (its mesh and axes),
and hand each tensor to the frame's backend, ``Frame.collective``: in-process
``_local/collective.py`` (an ``autograd.Function`` whose vmap rule exchanges every device's
block at once), on a real mesh ``_dist/shard.py`` (a process-group call on the local block).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ._compile import opaque, untraced
from ._errors import UnboundAxisError
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
    exchange: Callable[[Any, Tensor], Tensor] | None  # in-process: performs an Op on explicit-axis dims
    pvaried: dict = dataclasses.field(default_factory=dict)  # (id, axes) -> (tensor, its pvary)
    backend: str = "local"  # "local" (in-process) or "dist" (one process per device)
    levels: dict[int, str] = dataclasses.field(default_factory=dict)  # vmap level -> axis
    token: Tensor | None = None  # batched at every mesh level: makes vmap call our rules
    index: dict[str, Tensor] = dataclasses.field(default_factory=dict)  # coordinate per axis
    coords: dict[str, int] | None = None  # real mesh: this rank's coordinate per axis, as ints
    # The backend's collective: (kind, axes, params, this device's value) -> result; every public
    # collective goes through it (in-process: _local/collective.py's ``collective``).
    collective: Callable[[str, tuple, tuple, Tensor], Tensor] | None = None
    direct: Callable | None = None  # real mesh only (and marks one): its collective, all_to_all_v too
    inputs: dict[int, str] = dataclasses.field(default_factory=dict)  # in-process: storage -> "args[0]"
    varying: Callable | None = None  # real mesh: tensor -> the mesh axes it varies over (frozenset)
    # in-process, an eager call: (shape, dtype, mesh axes) of each value queried for the axes it
    # varies over, in order; a compiled call of the signature answers its queries from them
    queried: list | None = None
    # real mesh, a traced call only: its ``_Tracker``, which types what a body it does not
    # intercept computes (``fpar.optim.remat``'s forward, run below the call's functorch level)
    tracker: Any = None
    # real mesh: the call's collective counter ``[k]``, and while ``fpar.optim.remat`` recomputes
    # its body in the backward, the counter of the recomputed collectives (from the body's first)
    calls: list | None = None
    recompute_at: list | None = None
    # real mesh: a new tracker for a recompute of a plan whose sums sit at uses (None: a fast
    # plan's sums need no typing), and the one typing the recompute running now
    retrace: Callable | None = None
    retracker: Any = None
    # real mesh: the call's count of varying-axes queries ``[k]`` (answered in order from the plan's
    # record), and while remat recomputes its body, the count from the body's first query
    asked: list | None = None
    query_at: list | None = None

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


# API ----------------------------------------------------------------------------------------


@opaque  # never traced by Dynamo: see _compile.py
def _apply(api: str, x: Any, axis_name: AxisName, kind: str, params: tuple = (), *, check=None, number=None):
    frame, axes = _bound(api, axis_name)
    n = frame.mesh.axis_size(axes)

    def one(leaf):
        if isinstance(leaf, Tensor):
            leaf_params = check(leaf, n) if check is not None else params
            return frame.collective(kind, axes, leaf_params, leaf)  # counted by the backend
        if number is not None and isinstance(leaf, (int, float, bool)):
            return number(leaf, n)
        raise TypeError(
            f"fpar.{api} in fpar.shard({frame.fname}): got a {type(leaf).__name__}, not a tensor; "
            f"collectives take pytrees of tensors."
        )

    return one(x) if isinstance(x, Tensor) else tree_map(one, x)


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
    return tree_map(lambda t: frame.collective("pvary", axes, (), t), x)


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
