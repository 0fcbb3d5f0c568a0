"""Data-parallel training steps, from DDP to ZeRO-3, written with fpar collectives.

Legend: ``N`` = size of the data axis; ``Psi`` = bytes of one device's parameter blocks; a
*chunk* is one device's 1/N of a parameter block, flattened and zero-padded:
``c = ceil(m / N)`` elements for a block of ``m`` elements.  A chunk leaf's global value is 1-D,
``P((*split, data))`` (the axes the parameter is split over, then the data axis), of length
``prod(split sizes) * N * c``.

| stage | params held | grads held | optimizer state | collectives per step (bytes per device) |
|---|---|---|---|---|
| 0 (DDP) | Psi | Psi | K Psi | all-reduce of grads (psum in the backward): 2 (N-1)/N Psi |
| 1 | Psi | Psi (per-device, reduced once per step) | K Psi / N | reduce-scatter + all-gather: 2 (N-1)/N Psi |
| 2 | Psi | Psi / N (reduced per microbatch) | K Psi / N | the same, reduce-scatter per microbatch |
| 3 | Psi / N | Psi / N | K Psi / N | all-gather fwd + (regather) all-gather bwd of the saved params + reduce-scatter: <= 3 (N-1)/N Psi |

(ZeRO, Rajbhandari et al. 2019, arXiv:1910.02054, and ``shared/reference`` §4.)  Stage 3's
``regather`` (the default) is FSDP2's ``reshard_after_forward``: no gathered parameter is kept
from the forward to the backward; the backward all-gathers again only the parameters autograd
saved (``Psi_saved <= Psi``: a bias, or a weight whose input needs no gradient, is not saved),
prefetching the next one asynchronously on a real mesh (``_zero_comm``), so the forward runs
once.  On a real mesh stage 3 with ``regather`` follows FSDP2's schedule throughout: the forward
gathers each parameter at its first use, one ahead, and frees it after its last (so it holds a
parameter or two, not the model), and each gradient is reduce-scattered asynchronously as soon
as autograd has it complete, overlapping the rest of the backward (``_zero_fsdp.gathered_grad``).
Without ``regather`` the gathered parameters are kept: 2 (N-1)/N Psi.  ``donate=True``
(``zero_step`` / ``zero_update``) updates the stored parameters and optimizer state in place on a
real mesh, as ``torch.optim`` does, instead of holding the old and the new state at once (stages
1 and 2 gather the new parameters into the old ones' buffers, a bucket at a time).

Gradients are always those of the *global* loss (the mean over data ranks of the per-device
losses, and over microbatches): every step differentiates a sharded function from the outside
(``torch.func.grad`` of ``fpar.shard(...)``), so collectives over other axes (tensor
parallelism inside ``loss_fn``) get their exact transposes.  For stages 1 and 2 the
parameters enter that function as one copy per data rank (``P(data, ...)``: a stride-0 view
in-process, no copy), the functional form of JAX's ``pcast(params, to='varying')`` over the data
axis, so the gradient arrives per device, unreduced, and the step reduce-scatters it itself.
(Not ``torch.func.grad`` *inside* the sharded function: there fpar transposes every implicit
pvary locally, which drops the tensor-axis sums of a model with more than one Megatron block.)

"Grads held" is the buffer a stage keeps between backward and update (across microbatches):
stage 1 accumulates full per-device gradients and reduce-scatters once per step; stage 2
reduce-scatters each microbatch's gradient and accumulates only its chunk (on a real mesh a
bucket at a time, as its gradients are made).  Stages 2 and 3 with ``reduce_once`` hold a whole
unreduced gradient across the microbatches instead and reduce-scatter it once (``_zero_micro``).  Under
``mixed_precision``, DDP and stage 3 communicate in the compute dtype (the cast comes before the
pvary / all-gather), stages 1 and 2 reduce-scatter fp32 gradients.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import torch

from .._collectives import all_gather, all_gather_invariant, axis_index, frames, psum, psum_scatter
from .._mesh import Mesh
from .._shard import shard
from .._spec import P
from .._tree import broadcast_prefix, keystr, tree_flatten, tree_flatten_with_path, tree_unflatten
from ._base import GradientTransformation
from ._internal import block_shape
from ._zero_comm import _storage_key
from ._zero_fsdp import _resize

__all__ = [
    "ZeroLayout",
    "bytes_per_device",
    "zero_init",
    "zero_layout",
    "zero_params",
]

Tensor = torch.Tensor
_TAG = 1_000_003  # fake leaf sizes for telling which optimizer-state leaf mirrors which parameter
_REPLICATED = P()


# The layout ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Leaf:
    spec: P  # the parameter's spec
    block: tuple[int, ...]  # one device's block of the parameter
    split: tuple[str, ...]  # the mesh axes the parameter is split over
    numel: int  # elements of the block
    chunk: int  # elements of one device's chunk: ceil(numel / N)


@dataclasses.dataclass(frozen=True)
class ZeroLayout:
    """How a ZeRO stage stores parameters, gradients and optimizer state on a mesh (static data).

    Build it with ``zero_layout``.  Its spec trees are what ``fpar.device_put``, ``fpar.gather``,
    checkpoints and ``bytes_per_device`` need.
    """

    mesh: Mesh
    stage: int
    data_axis: str
    treedef: Any
    leaves: tuple[_Leaf, ...]
    units: tuple[int, ...] | None = None  # stage 3: each leaf's unit (``zero_layout``'s ``units``)

    @property
    def n(self) -> int:
        """The size of the data axis."""
        return self.mesh.shape[self.data_axis]

    @functools.cached_property  # cached: a compiled step reads it (Dynamo cannot unflatten a stored treedef)
    def param_specs(self) -> Any:
        """Specs of the parameters as the stage stores them (stage 3: chunks)."""
        return self._tree([self._stored(lf) for lf in self.leaves])

    @functools.cached_property  # cached: a compiled step reads it (Dynamo cannot unflatten a stored treedef)
    def grad_specs(self) -> Any:
        """Specs of the gradients a stage holds: stage 0 like the params, 1 one copy per data rank, 2/3 chunks."""
        if self.stage == 0:
            return self._tree([lf.spec for lf in self.leaves])
        if self.stage == 1:
            return self._tree([P(self.data_axis, *lf.spec) for lf in self.leaves])
        return self._tree([self._chunk_spec(lf) for lf in self.leaves])

    @functools.cached_property  # cached: a compiled step reads it (Dynamo cannot unflatten a stored treedef)
    def chunk_specs(self) -> Any:
        """Specs of chunk trees (per-device 1/N of each parameter block, flattened and padded)."""
        return self._tree([self._chunk_spec(lf) for lf in self.leaves])

    def state_specs(self, optimizer: GradientTransformation) -> Any:
        """Specs of ``optimizer``'s state, laid out like the parameters it mirrors.

        A state leaf that mirrors a parameter is laid out like it (as chunks for stages 1-3); the
        rest (counts, the loss scale) are replicated.  Found by running ``optimizer.init`` on meta tensors of distinct sizes.
        """
        fake = self._tree([torch.empty((_TAG + i,), device="meta") for i in range(len(self.leaves))])
        leaves, treedef = tree_flatten(optimizer.init(fake))
        specs = []
        for x in leaves:
            i = x.shape[0] - _TAG if isinstance(x, Tensor) and x.dim() == 1 else -1
            if 0 <= i < len(self.leaves):
                lf = self.leaves[i]
                specs.append(lf.spec if self.stage == 0 else self._chunk_spec(lf))
            else:
                specs.append(None if x is None else P())
        return tree_unflatten(treedef, specs)

    def _tree(self, leaves: list) -> Any:
        return tree_unflatten(self.treedef, leaves)

    def _stored(self, lf: _Leaf) -> P:
        return self._chunk_spec(lf) if self.stage == 3 else lf.spec

    def _chunk_spec(self, lf: _Leaf) -> P:
        return P((*lf.split, self.data_axis))


def zero_layout(
    params: Any,
    mesh: Mesh,
    param_specs: Any = _REPLICATED,
    *,
    stage: int,
    data_axis: str = "data",
    units: Any = None,
):
    """Plan how ZeRO ``stage`` (0 = plain data parallel, DDP) stores ``params`` on ``mesh``.

    Args:
      params: the parameter tree (global tensors in-process; this process's blocks on a real mesh).
      mesh: the mesh; it must have ``data_axis``.
      param_specs: a pytree prefix of ``params`` of ``fpar.P``: how each parameter is split over
        the *other* axes (tensor parallelism); the data axis is ZeRO's.
      stage: 0, 1, 2 or 3.
      data_axis: the mesh axis the batch is split over.
      units: stage 3: which parameters a real mesh gathers together (FSDP2's ``fully_shard`` of a
        module).  A pytree prefix of ``params`` of unit labels (``str`` or ``int``; every leaf
        under a label is in that unit; ``None``: each leaf under it a unit of its own), e.g.
        ``{"layers": [0, 1, 2], "head": "head"}``.  A unit's parameters are all gathered at the
        first read of any of them (started together, one unit ahead) and freed together after
        the last read of all of them; the backward re-gathers a unit's saved parameters together,
        the next unit prefetched.  Default: a leaf a unit (a stacked leaf taken by its rows: a row
        a unit; with units, row ``r`` of the stacked leaves of one unit is one unit).

    Returns:
      A ``ZeroLayout``.

    Raises:
      ValueError: bad stage, no such data axis, a parameter spec already naming the data axis, or
        ``units`` that are not a prefix of ``params``, hold a label other than ``str``/``int``/
        ``None``, or are given below stage 3.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"fpar.optim.zero_layout: stage must be 0, 1, 2 or 3, got {stage!r}.")
    if data_axis not in mesh.shape:
        raise ValueError(
            f"fpar.optim.zero_layout: data_axis {data_axis!r} is not an axis of the mesh "
            f"(mesh axes: {mesh.axis_names})."
        )
    leaves, treedef = tree_flatten(params)
    specs = broadcast_prefix(param_specs, params, is_leaf=lambda s: s is None or isinstance(s, P))
    n = mesh.shape[data_axis]
    out = []
    for i, (x, spec) in enumerate(zip(leaves, specs)):
        spec = spec if spec is not None else P()
        if data_axis in spec.axes():
            raise ValueError(
                f"fpar.optim.zero_layout: param_specs leaf {i} is {spec}, which splits a parameter over "
                f"the data axis {data_axis!r}; ZeRO shards over that axis itself. Give the layout "
                f"over the other axes only."
            )
        block = tuple(x.shape) if mesh.backend == "dist" else block_shape(spec, tuple(x.shape), mesh.shape)
        m = math.prod(block)
        out.append(_Leaf(spec, block, tuple(spec.axes()), m, -(-m // n)))
    return ZeroLayout(mesh, stage, data_axis, treedef, tuple(out), _units(units, params, stage))


def _units(units: Any, params: Any, stage: int) -> tuple[int, ...] | None:
    """Each leaf's unit number (labels numbered in leaf order; ``None``: a unit of its own)."""
    if units is None:
        return None
    if stage != 3:
        raise ValueError(
            f"fpar.optim.zero_layout: units group the parameters ZeRO-3 gathers together; stage "
            f"{stage} keeps whole parameters and gathers none. Drop units, or use stage=3."
        )
    label = lambda u: u is None or isinstance(u, (str, int)) and not isinstance(u, bool)  # noqa: E731
    try:
        labels = broadcast_prefix(units, params, is_leaf=label)
    except ValueError as e:
        raise ValueError(
            f"fpar.optim.zero_layout: units must be a pytree prefix of params (a label per subtree): {e}"
        ) from None
    paths = tree_flatten_with_path(params)[0]
    numbers: dict = {}
    out = []
    for path, u in zip(paths, labels):
        if not label(u):
            raise ValueError(
                f"fpar.optim.zero_layout: the unit of params{keystr(path)} is {u!r} ({type(u).__name__}); "
                f"a unit label is a str or an int (None: a unit of its own)."
            )
        out.append(numbers.setdefault(u, len(numbers)) if u is not None else -1)
    fresh = iter(range(len(numbers), len(numbers) + len(out)))
    return tuple(next(fresh) if k < 0 else k for k in out)


# Per-device pieces (run inside fpar.shard) ----------------------------------------------------


def _padded(x: Tensor, lf: _Leaf, n: int) -> Tensor:
    flat = x.reshape(-1)
    pad = n * lf.chunk - lf.numel
    return torch.cat([flat, flat.new_zeros(pad)]) if pad else flat


def _own_chunk(x: Tensor, lf: _Leaf, layout: ZeroLayout) -> Tensor:
    """This device's chunk of a block replicated over the data axis (a slice: no communication)."""
    i = axis_index(layout.data_axis).reshape(1)
    return _padded(x, lf, layout.n).reshape(layout.n, lf.chunk).index_select(0, i).squeeze(0)


def _own_chunk_view(x: Tensor, lf: _Leaf, layout: ZeroLayout) -> Tensor | None:
    """On a real mesh, this device's chunk as a view of ``x`` (an update of it writes ``x``), or ``None``.

    ``None`` in-process, for a padded chunk (its tail is not in ``x``) or a non-contiguous ``x``.
    """
    frame = frames()[-1] if frames() else None
    if frame is None or frame.coords is None or lf.numel != layout.n * lf.chunk or not x.is_contiguous():
        return None
    r = frame.coords[layout.data_axis]
    return x.view(-1)[r * lf.chunk : (r + 1) * lf.chunk]


def _reduce_scatter(g: Tensor, lf: _Leaf, layout: ZeroLayout) -> Tensor:
    """Sum per-device gradients over the data axis, keeping this device's chunk: (N-1)/N of the block."""
    return psum_scatter(_padded(g, lf, layout.n), layout.data_axis, tiled=True)


def _gather(chunk: Tensor, lf: _Leaf, layout: ZeroLayout, *, invariant: bool) -> Tensor:
    """The whole block from every device's chunk: (N-1)/N of the block per device."""
    gather = all_gather_invariant if invariant else all_gather
    return gather(chunk, layout.data_axis, tiled=True)[: lf.numel].reshape(lf.block)


BUCKET_BYTES = 25 * 2**20  # DDP's default bucket cap


def _buckets(
    xs: list[Tensor], layout: ZeroLayout, cap: int, extra: list | None = None, skip: list | None = None
) -> list[list[int]]:
    """Leaf indices grouped into buckets, one collective each (in leaf order).

    A bucket holds leaves of one dtype split over the same non-data axes (so the concatenation
    varies over the same axes as each leaf), and summed over the same ``extra`` axes after, up
    to ``cap`` bytes of this device's values; a leaf larger than ``cap`` is a bucket of its own.
    Leaves whose ``skip`` is true are in none.
    """
    buckets: list[list[int]] = []
    open_: dict[tuple, tuple[list[int], int]] = {}
    for i, (x, lf) in enumerate(zip(xs, layout.leaves)):
        if skip is not None and skip[i]:
            continue
        key = (x.dtype, lf.split, extra[i] if extra else ())
        size = layout.n * lf.chunk * x.element_size()
        group, used = open_.get(key, (None, 0))
        if group is None or used + size > cap:
            group, used = [], 0
            buckets.append(group)
        group.append(i)
        open_[key] = (group, used + size)
    return buckets


def _reduce_scatter_all(
    grads: list[Tensor],
    layout: ZeroLayout,
    cap: int,
    done: Callable[[list[int]], None] | None = None,
    extra: list | None = None,
    skip: list | None = None,
) -> list[Tensor]:
    """``_reduce_scatter`` of every leaf, one ``psum_scatter`` per bucket (the same sums).

    ``done(group)`` is told each bucket's leaf indices once its collective has returned (the
    whole gradients of those leaves are no longer needed: ``_Releaser``).  ``extra``: per leaf,
    mesh axes its chunk is then summed over too (a gradient replicated over the tensor axis,
    each device's own part: ``zero_pipeline``), one ``psum`` per bucket.  ``skip``: per leaf,
    whether every rank of its groups knows its sum is zero (a leaf no rank of a pipeline stage
    read): its chunk is a zero, sent nowhere.
    """
    n, leaves = layout.n, layout.leaves
    out: list[Tensor] = [None] * len(grads)  # type: ignore[list-item]
    for i, g in enumerate(grads):
        if skip is not None and skip[i]:
            out[i] = torch.zeros(leaves[i].chunk, dtype=g.dtype, device=g.device)
    for group in _buckets(grads, layout, cap, extra, skip):
        over = extra[group[0]] if extra else ()
        if len(group) == 1:
            mine = _reduce_scatter(grads[group[0]], leaves[group[0]], layout)
            out[group[0]] = psum(mine, over) if over else mine
        else:
            # Device k's chunk of every leaf, side by side: row k of an (N, sum of chunks) matrix.
            rows = [_padded(grads[i], leaves[i], n).reshape(n, leaves[i].chunk) for i in group]
            mine = psum_scatter(torch.cat(rows, dim=1).reshape(-1), layout.data_axis, tiled=True)
            del rows
            if over:
                mine = psum(mine, over)
            for i, piece in zip(group, mine.split([leaves[i].chunk for i in group])):
                out[i] = piece
        if done is not None:
            done(group)
    return out


class _Releaser:
    """Frees donated whole gradients as their buckets are reduce-scattered (stage 1's update).

    A step that donates its gradients would otherwise hold every whole gradient until the update
    returns, beside the reduced chunks, the state and the gathered parameters: 4 bytes a
    parameter over the paper's ``8 + 8/N``.  A gradient's storage is freed (resized to 0 bytes,
    as FSDP2 frees a gathered parameter) after the last bucket that reads it, and only where it
    is the gradient's alone: not shared with a parameter or the optimizer state (``keep``), and
    exactly the gradient's own bytes (not a view into a larger buffer someone keeps).
    """

    def __init__(self, grads: list[Tensor], keep: Any):
        kept = {_storage_key(t) for t in tree_flatten(keep)[0] if isinstance(t, Tensor)}
        self.grads = grads
        self.keys = [_storage_key(g) for g in grads]
        self.left: dict = {}
        for key in self.keys:
            self.left[key] = self.left.get(key, 0) + 1
        for key in kept:
            self.left.pop(key, None)

    def __call__(self, group: list[int]) -> None:
        for i in group:
            key, g = self.keys[i], self.grads[i]
            if key is None or key not in self.left:
                continue
            self.left[key] -= 1
            owned = g.is_contiguous() and g.untyped_storage().nbytes() == g.numel() * g.element_size()
            if self.left[key] == 0 and owned and g.untyped_storage().nbytes():
                _resize(g, 0)


def _gather_all(
    chunks: list[Tensor], layout: ZeroLayout, cap: int, into: list[Tensor] | None = None
) -> list[Tensor]:
    """``_gather(..., invariant=True)`` of every leaf, one ``all_gather_invariant`` per bucket.

    ``into``: donated blocks (the old parameters) to write the gathered ones into, bucket by
    bucket, and return; then a step holds one bucket's gathered values at a time (or one leaf
    larger than a bucket), not a second copy of every parameter.
    """
    n, leaves = layout.n, layout.leaves
    out: list[Tensor] = [None] * len(chunks)  # type: ignore[list-item]

    def put(i: int, block: Tensor) -> None:
        out[i] = block if into is None else into[i].copy_(block)

    def put_rows(i: int, rows: Tensor) -> None:
        """Leaf ``i`` from its ``(N, chunk)`` columns of a gathered bucket (copied once if into)."""
        lf = leaves[i]
        if into is not None and lf.numel == n * lf.chunk:  # no padding: straight into the old buffer
            out[i] = into[i]
            into[i].view(n, lf.chunk).copy_(rows)
        else:
            put(i, rows.reshape(-1)[: lf.numel].reshape(lf.block))

    for group in _buckets(chunks, layout, cap):
        if len(group) == 1:
            put(group[0], _gather(chunks[group[0]], leaves[group[0]], layout, invariant=True))
            continue
        sizes = [leaves[i].chunk for i in group]
        full = all_gather_invariant(torch.cat([chunks[i] for i in group]), layout.data_axis, tiled=True)
        for i, rows in zip(group, full.reshape(n, sum(sizes)).split(sizes, dim=1)):
            put_rows(i, rows)
        del full, rows  # the bucket's gathered values go before the next bucket's come
    return out


def _map(fn: Callable, tree: Any, layout: ZeroLayout) -> Any:
    leaves, treedef = tree_flatten(tree)
    return tree_unflatten(treedef, [fn(x, lf, layout) for x, lf in zip(leaves, layout.leaves)])


# Initialisation and conversion ----------------------------------------------------------------


def zero_init(optimizer: GradientTransformation, params: Any, layout: ZeroLayout) -> tuple[Any, Any]:
    """Return ``(params as the stage stores them, the optimizer state, sharded)``.

    Stages 1-3 build the state on each device's chunks only (``K Psi / N`` bytes); stage 3 also
    keeps only the chunks of the parameters.  Both are laid out by ``layout.param_specs`` and
    ``layout.state_specs(optimizer)``.
    """
    pspecs = layout._tree([lf.spec for lf in layout.leaves])
    sspecs = layout.state_specs(optimizer)
    if layout.stage == 0:
        return params, shard(optimizer.init, layout.mesh, (pspecs,), sspecs)(params)

    def init(params):
        chunks = _map(_own_chunk, params, layout)
        return chunks, optimizer.init(chunks)

    chunks, state = shard(init, layout.mesh, (pspecs,), (layout.chunk_specs, sspecs))(params)
    return (chunks if layout.stage == 3 else params), state


def zero_params(params: Any, layout: ZeroLayout) -> Any:
    """The parameters as ``zero_layout`` was given them (stage 3 gathers its chunks; else identity)."""
    if layout.stage != 3:
        return params
    pspecs = layout._tree([lf.spec for lf in layout.leaves])
    gather = shard(
        lambda chunks: _map(lambda c, lf, lo: _gather(c, lf, lo, invariant=True), chunks, layout),
        layout.mesh,
        (layout.chunk_specs,),
        pspecs,
    )
    return gather(params)


def bytes_per_device(tree: Any, mesh: Mesh, specs: Any = _REPLICATED) -> int:
    """Bytes one device holds of ``tree``, laid out by ``specs`` (measured from the blocks).

    In-process the tree holds global tensors and a device's block is its spec's share of each;
    on a real mesh the tree holds this process's blocks and their sizes are counted as they are.
    """
    leaves = tree_flatten(tree)[0]
    if mesh.backend == "dist":
        return sum(x.numel() * x.element_size() for x in leaves if isinstance(x, Tensor))
    leaf_specs = broadcast_prefix(specs, tree, is_leaf=lambda s: s is None or isinstance(s, P))
    total = 0
    for x, s in zip(leaves, leaf_specs):
        if isinstance(x, Tensor):
            total += math.prod(block_shape(s or P(), tuple(x.shape), mesh.shape)) * x.element_size()
    return total
