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
once.  On a real mesh stage 3 with ``regather`` follows FSDP2's schedule throughout: the forward's
all-gathers run one ahead, and each gradient is reduce-scattered asynchronously as soon as
autograd has it complete, overlapping the rest of the backward (``_zero_comm.gathered_grad``).
Without ``regather`` the gathered parameters are kept: 2 (N-1)/N Psi.  ``donate=True``
(``zero_step`` / ``zero_update``) updates the stored parameters and optimizer state in place on a
real mesh, as ``torch.optim`` does, instead of holding the old and the new state at once.

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
reduce-scatters each microbatch's gradient and accumulates only its chunk (the unreduced
gradient of one microbatch exists transiently: one bucket the size of the model).  Under
``mixed_precision``, DDP and stage 3 communicate in the compute dtype (the cast comes before the
pvary / all-gather), stages 1 and 2 reduce-scatter fp32 gradients.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch

import fpar
from fpar import P

from .. import _defer
from .._buffers import pooled
from .._torch_api import is_functorch_wrapped_tensor
from .._tree import broadcast_prefix, keystr, tree_flatten, tree_flatten_with_path, tree_map, tree_unflatten
from . import _ops as ops
from ._base import GradientTransformation, apply_updates
from ._internal import block_shape
from ._precision import MixedPrecision, cast_floating
from ._remat import remat
from ._zero_comm import Regather, gathered_grad, regather_supported, scattered_grad

__all__ = [
    "ZeroLayout",
    "accumulate",
    "bytes_per_device",
    "zero_grads",
    "zero_init",
    "zero_layout",
    "zero_params",
    "zero_step",
    "zero_update",
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

    mesh: fpar.Mesh
    stage: int
    data_axis: str
    treedef: Any
    leaves: tuple[_Leaf, ...]

    @property
    def n(self) -> int:
        """The size of the data axis."""
        return self.mesh.shape[self.data_axis]

    @property
    def param_specs(self) -> Any:
        """Specs of the parameters as the stage stores them (stage 3: chunks)."""
        return self._tree([self._stored(lf) for lf in self.leaves])

    @property
    def grad_specs(self) -> Any:
        """Specs of the gradients a stage holds: stage 0 like the params, 1 one copy per data rank, 2/3 chunks."""
        if self.stage == 0:
            return self._tree([lf.spec for lf in self.leaves])
        if self.stage == 1:
            return self._tree([P(self.data_axis, *lf.spec) for lf in self.leaves])
        return self._tree([self._chunk_spec(lf) for lf in self.leaves])

    @property
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
    params: Any, mesh: fpar.Mesh, param_specs: Any = _REPLICATED, *, stage: int, data_axis: str = "data"
):
    """Plan how ZeRO ``stage`` (0 = plain data parallel, DDP) stores ``params`` on ``mesh``.

    Args:
      params: the parameter tree (global tensors in-process; this process's blocks on a real mesh).
      mesh: the mesh; it must have ``data_axis``.
      param_specs: a pytree prefix of ``params`` of ``fpar.P``: how each parameter is split over
        the *other* axes (tensor parallelism); the data axis is ZeRO's.
      stage: 0, 1, 2 or 3.
      data_axis: the mesh axis the batch is split over.

    Returns:
      A ``ZeroLayout``.

    Raises:
      ValueError: bad stage, no such data axis, or a parameter spec already naming the data axis.
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
    return ZeroLayout(mesh, stage, data_axis, treedef, tuple(out))


# Per-device pieces (run inside fpar.shard) ----------------------------------------------------


def _padded(x: Tensor, lf: _Leaf, n: int) -> Tensor:
    flat = x.reshape(-1)
    pad = n * lf.chunk - lf.numel
    return torch.cat([flat, flat.new_zeros(pad)]) if pad else flat


def _own_chunk(x: Tensor, lf: _Leaf, layout: ZeroLayout) -> Tensor:
    """This device's chunk of a block replicated over the data axis (a slice: no communication)."""
    i = fpar.axis_index(layout.data_axis).reshape(1)
    return _padded(x, lf, layout.n).reshape(layout.n, lf.chunk).index_select(0, i).squeeze(0)


def _reduce_scatter(g: Tensor, lf: _Leaf, layout: ZeroLayout) -> Tensor:
    """Sum per-device gradients over the data axis, keeping this device's chunk: (N-1)/N of the block."""
    return fpar.psum_scatter(_padded(g, lf, layout.n), layout.data_axis, tiled=True)


def _gather(chunk: Tensor, lf: _Leaf, layout: ZeroLayout, *, invariant: bool) -> Tensor:
    """The whole block from every device's chunk: (N-1)/N of the block per device."""
    gather = fpar.all_gather_invariant if invariant else fpar.all_gather
    return gather(chunk, layout.data_axis, tiled=True)[: lf.numel].reshape(lf.block)


BUCKET_BYTES = 25 * 2**20  # DDP's default bucket cap


def _buckets(xs: list[Tensor], layout: ZeroLayout, cap: int) -> list[list[int]]:
    """Leaf indices grouped into buckets, one collective each (in leaf order).

    A bucket holds leaves of one dtype split over the same non-data axes (so the concatenation
    varies over the same axes as each leaf), up to ``cap`` bytes of this device's values; a
    leaf larger than ``cap`` is a bucket of its own.
    """
    buckets: list[list[int]] = []
    open_: dict[tuple, tuple[list[int], int]] = {}
    for i, (x, lf) in enumerate(zip(xs, layout.leaves)):
        key = (x.dtype, lf.split)
        size = layout.n * lf.chunk * x.element_size()
        group, used = open_.get(key, (None, 0))
        if group is None or used + size > cap:
            group, used = [], 0
            buckets.append(group)
        group.append(i)
        open_[key] = (group, used + size)
    return buckets


def _reduce_scatter_all(grads: list[Tensor], layout: ZeroLayout, cap: int) -> list[Tensor]:
    """``_reduce_scatter`` of every leaf, one ``psum_scatter`` per bucket (the same sums)."""
    n, leaves = layout.n, layout.leaves
    out: list[Tensor] = [None] * len(grads)  # type: ignore[list-item]
    for group in _buckets(grads, layout, cap):
        if len(group) == 1:
            out[group[0]] = _reduce_scatter(grads[group[0]], leaves[group[0]], layout)
            continue
        # Device k's chunk of every leaf, side by side: row k of an (N, sum of chunks) matrix.
        rows = [_padded(grads[i], leaves[i], n).reshape(n, leaves[i].chunk) for i in group]
        mine = fpar.psum_scatter(torch.cat(rows, dim=1).reshape(-1), layout.data_axis, tiled=True)
        for i, piece in zip(group, mine.split([leaves[i].chunk for i in group])):
            out[i] = piece
    return out


def _gather_all(chunks: list[Tensor], layout: ZeroLayout, cap: int) -> list[Tensor]:
    """``_gather(..., invariant=True)`` of every leaf, one ``all_gather_invariant`` per bucket."""
    n, leaves = layout.n, layout.leaves
    out: list[Tensor] = [None] * len(chunks)  # type: ignore[list-item]
    for group in _buckets(chunks, layout, cap):
        if len(group) == 1:
            out[group[0]] = _gather(chunks[group[0]], leaves[group[0]], layout, invariant=True)
            continue
        sizes = [leaves[i].chunk for i in group]
        full = fpar.all_gather_invariant(torch.cat([chunks[i] for i in group]), layout.data_axis, tiled=True)
        for i, block in zip(group, full.reshape(n, sum(sizes)).split(sizes, dim=1)):
            lf = leaves[i]
            out[i] = block.reshape(-1)[: lf.numel].reshape(lf.block)
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
        return params, fpar.shard(optimizer.init, layout.mesh, (pspecs,), sspecs)(params)

    def init(params):
        chunks = _map(_own_chunk, params, layout)
        return chunks, optimizer.init(chunks)

    chunks, state = fpar.shard(init, layout.mesh, (pspecs,), (layout.chunk_specs, sspecs))(params)
    return (chunks if layout.stage == 3 else params), state


def zero_params(params: Any, layout: ZeroLayout) -> Any:
    """The parameters as ``zero_layout`` was given them (stage 3 gathers its chunks; else identity)."""
    if layout.stage != 3:
        return params
    pspecs = layout._tree([lf.spec for lf in layout.leaves])
    gather = fpar.shard(
        lambda chunks: _map(lambda c, lf, lo: _gather(c, lf, lo, invariant=True), chunks, layout),
        layout.mesh,
        (layout.chunk_specs,),
        pspecs,
    )
    return gather(params)


def bytes_per_device(tree: Any, mesh: fpar.Mesh, specs: Any = _REPLICATED) -> int:
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


# Gradients -------------------------------------------------------------------------------------


def zero_grads(
    loss_fn: Callable,
    layout: ZeroLayout,
    *,
    batch_specs: Any = None,
    n_micro: int = 1,
    compute_dtype: torch.dtype | None = None,
    regather: bool = True,
    bucket_bytes: int = BUCKET_BYTES,
) -> Callable:
    """Build ``grads(params, batch, loss_scale=None) -> (grads, loss)`` for ``layout``'s stage.

    ``loss_fn(params, batch)`` is per-device code (it runs inside ``fpar.shard``; it may use
    collectives over the non-data axes) returning this device's mean loss over its part of the
    batch; the global loss is the mean over data ranks (and microbatches).  The gradients come
    laid out by ``layout.grad_specs``: stage 0 the global gradient (all-reduced), stage 1 each
    data rank's own gradient (unreduced), stages 2 and 3 each rank's chunk of the reduced one.

    Args:
      loss_fn: ``(params, batch) -> scalar`` per device.
      layout: from ``zero_layout``.
      batch_specs: a pytree prefix of the batch of ``fpar.P`` (default ``P(data_axis)``).
      n_micro: split each device's batch into this many microbatches along the dim split over
        the data axis and average their gradients (``accumulate``).
      compute_dtype: run ``loss_fn`` in this dtype (floating params and batch leaves are cast).
      regather: stage 3 only: keep no gathered parameter from the forward to the backward
        (FSDP2's ``reshard_after_forward``): every parameter view autograd saves is replaced by
        a token and all-gathered again when the backward needs it, the next one prefetched
        asynchronously on a real mesh (``fpar.optim._zero_comm``).  The forward runs once;
        traffic per step is 2 (N-1)/N Psi + (N-1)/N x (bytes of the saved parameters), at most
        3 (N-1)/N Psi.  This differentiates with ``torch.autograd`` (saved-tensor hooks); called
        under a ``torch.func`` transform it falls back to ``remat`` of the gathered forward
        (the forward recomputed in the backward, 3 (N-1)/N Psi).  ``False`` keeps the gathered
        parameters: 2 (N-1)/N Psi, Psi more memory.
      bucket_bytes: stage 2: reduce-scatter the gradients in buckets of up to this many bytes
        per device (leaves of one dtype and layout, in order), one collective per bucket.  On a
        real mesh (not under a ``torch.func`` transform) each bucket's reduce-scatter starts,
        asynchronously, as soon as autograd has its gradients, overlapping the rest of the
        backward (``fpar.optim._zero_comm.scattered_grad``).
    """
    mesh, data, n = layout.mesh, layout.data_axis, layout.n
    batch_specs = P(data) if batch_specs is None else batch_specs
    pspecs = layout._tree([lf.spec for lf in layout.leaves])
    tracking: dict[str, Regather | None] = {"regather": None}  # the running stage-3 forward's
    gathered_outside = False  # stage 3 on a real mesh: FSDP's schedule (``gathered_grad``)
    scatter_early = False  # stage 2 on a real mesh: buckets reduce-scattered in the backward

    def local_loss(params, batch):
        if compute_dtype is not None:
            params, batch = cast_floating(params, compute_dtype), cast_floating(batch, compute_dtype)
        loss = loss_fn(params, batch)
        return loss.float() if loss.dtype in (torch.float16, torch.bfloat16) else loss

    if layout.stage == 0:

        def per_device(params, batch, scale):
            loss = fpar.pmean(local_loss(params, batch), data)
            return loss * scale, loss.detach()

        sharded = fpar.shard(per_device, mesh, (pspecs, batch_specs, P()), (P(), P()))
        objective = sharded
        wrt = lambda params: params  # noqa: E731
    else:
        if layout.stage == 3:

            def gathered_loss(chunks, batch):
                if compute_dtype is not None:  # gather (and reduce-scatter) in the compute dtype
                    chunks = cast_floating(chunks, compute_dtype)
                params = _map(lambda c, lf, lo: _gather(c, lf, lo, invariant=False), chunks, layout)
                if tracking["regather"] is not None:
                    for c, full in zip(tree_flatten(chunks)[0], tree_flatten(params)[0]):
                        tracking["regather"].track(c, full)
                return local_loss(params, batch)

            body = gathered_loss
            in_p = layout.chunk_specs
        else:

            def body(stacked, batch):
                return local_loss(tree_map(lambda t: t.squeeze(0), stacked), batch)

            in_p = layout._tree([P(data, *lf.spec) for lf in layout.leaves])

        def objective_of(body, in_p=in_p):
            def per_device(params, batch, scale):
                loss = body(params, batch)
                return (loss * scale).reshape(1), fpar.pmean(loss.detach(), data)

            sharded = fpar.shard(per_device, mesh, (in_p, batch_specs, P()), (P(data), P()))

            def objective(params, batch, scale):
                scaled, loss = sharded(params, batch, scale)
                return scaled.sum() / n, loss  # the mean over data ranks (a rank's own term on a real mesh)

            return objective

        objective = objective_of(body)
        if layout.stage == 3 and regather:
            hooked = objective
            objective = objective_of(remat(body))  # under torch.func, which refuses saved-tensor hooks
            if mesh.backend == "dist" and all(lf.block for lf in layout.leaves):
                # Gathered outside (``gathered_grad``): each rank's gathered block enters as its
                # own copy, varying over the data axis (its gradient is reduce-scattered there).
                hooked = objective_of(local_loss, layout._tree([_own_copy_spec(lf, data) for lf in layout.leaves]))
                gathered_outside = True

        if layout.stage == 2 and mesh.backend == "dist" and all(lf.block for lf in layout.leaves):
            # Each rank's parameters as its own copy, differentiated by torch.autograd so every
            # bucket is reduce-scattered as soon as its gradients exist (``scattered_grad``).
            hooked = objective_of(local_loss, layout._tree([_own_copy_spec(lf, data) for lf in layout.leaves]))
            scatter_early = True

        wrt = (lambda params: params) if layout.stage == 3 else (lambda params: _per_rank(params, layout))
    grad = torch.func.grad(objective, has_aux=True)
    reduce = _reducer(layout, bucket_bytes) if layout.stage == 2 else None

    def one(params, batch, scale):
        if layout.stage == 3 and regather and regather_supported():
            if gathered_outside:
                return gathered_grad(hooked, layout, params, batch, scale, compute_dtype)
            return _regathered_grad(hooked, tracking, layout, params, batch, scale)
        if scatter_early and regather_supported():
            leaves = tree_flatten(params)[0]
            groups = _buckets(leaves, layout, bucket_bytes)
            return scattered_grad(hooked, layout, params, batch, scale, groups)
        g, loss = grad(wrt(params), batch, scale)
        return (reduce(g) if reduce is not None else g), loss

    acc = accumulate(one, n_micro, mesh, batch_specs)

    def grads(params, batch, loss_scale=None):
        if loss_scale is None:
            leaves = tree_flatten(params)[0]
            scale = torch.ones((), dtype=torch.float32, device=leaves[0].device if leaves else None)
        else:
            scale = loss_scale
        return acc(params, batch, scale)

    return grads


def _regathered_grad(objective, tracking, layout, params, batch, scale):
    """Stage 3's gradient with the backward re-gather of ``_zero_comm`` (``torch.autograd``)."""
    leaves, treedef = tree_flatten(params)
    inputs = [t.detach().requires_grad_(True) for t in leaves]
    rg = Regather(layout.mesh, layout.data_axis)
    tracking["regather"] = rg
    try:
        with torch.enable_grad(), rg.hooks():
            scaled, loss = objective(tree_unflatten(treedef, inputs), batch, scale)
    finally:
        tracking["regather"] = None
    try:
        g = torch.autograd.grad(scaled, inputs, allow_unused=True, materialize_grads=True)
    finally:
        rg.close()
    return tree_unflatten(treedef, list(g)), loss.detach()


def _own_copy_spec(lf: _Leaf, data: str) -> P:
    """The spec of a rank's whole (gathered) block as its own copy: ``lf.spec`` + data on dim 0.

    On a real mesh a spec only says what the local block varies over; naming the data axis
    makes each rank's copy a value of its own, so its gradient comes back unreduced.
    """
    entries = [tuple(e) for e in lf.spec.normalized()]
    entries += [()] * (len(lf.block) - len(entries))
    entries[0] = (*entries[0], data)
    return P(*[e if e else None for e in entries])


def _per_rank(params: Any, layout: ZeroLayout) -> Any:
    """One copy of each parameter per data rank, ``P(data, *spec)``, without copying."""
    if layout.mesh.backend == "dist":
        return tree_map(lambda t: t.unsqueeze(0), params)
    return tree_map(lambda t: t.expand(layout.n, *t.shape), params)


def _reducer(layout: ZeroLayout, bucket_bytes: int) -> Callable:
    in_g = layout._tree([P(layout.data_axis, *lf.spec) for lf in layout.leaves])

    def reduce(stacked):
        leaves, treedef = tree_flatten(stacked)
        return tree_unflatten(treedef, _reduce_scatter_all([g.squeeze(0) for g in leaves], layout, bucket_bytes))

    return fpar.shard(reduce, layout.mesh, (in_g,), layout.chunk_specs)


def accumulate(
    grad_fn: Callable, n_micro: int, mesh: fpar.Mesh, batch_specs: Any, *, key_arg: int | None = None
) -> Callable:
    """Average ``grad_fn``'s gradients over ``n_micro`` microbatches of each device's batch.

    ``grad_fn(params, batch, *rest) -> (grads, aux)``; the result has the same signature.  Each
    batch leaf is cut along the dim its spec splits over the mesh (every device's block into
    ``n_micro`` consecutive pieces, so microbatch ``i`` takes piece ``i`` of every device's block);
    leaves whose specs split no dim go whole to every microbatch.  With a loss that is a mean
    over the batch, this equals one step on the whole batch, holding 1/n_micro of the activations.

    ``key_arg``: the position in ``grad_fn``'s arguments (>= 2, counting ``params`` and ``batch``)
    of a ``fpar.random`` key; microbatch ``i`` then gets ``fpar.random.fold_in(key, i)`` there (also
    when ``n_micro == 1``), so its dropout masks differ from the other microbatches'.

    On a real mesh the data-parallel gradient all-reduces run once per step, not once per
    microbatch: microbatches ``0 .. n_micro - 2`` run under ``fpar.defer_reduction()`` (their
    replicated parameters' gradients are kept locally and come back as zeros) and the last one
    reduces the sum, one all-reduce per bucket; the averaged gradient is the same.  Sums that
    cannot be deferred (see ``fpar.defer_reduction``) run per microbatch as before.
    """
    if key_arg is not None and (isinstance(key_arg, bool) or not isinstance(key_arg, int) or key_arg < 2):
        raise ValueError(
            f"fpar.optim.accumulate: key_arg={key_arg!r} must be the position (>= 2) of the key among "
            f"grad_fn's arguments (params, batch, *rest)."
        )
    if n_micro < 1:
        raise ValueError(f"fpar.optim.accumulate: n_micro must be >= 1, got {n_micro}.")
    if n_micro == 1 and key_arg is None:
        return grad_fn

    def accumulated(params, batch, *rest):
        total_g = None
        auxs = []
        owned: set[int] = set()  # ids of the running sums allocated here (alive in total_g)

        def add(total: Any, g: Any) -> Any:
            """``total + g``, in place into a sum this call allocated (``grad_fn``'s own results
            may be buffers it reuses: never written); deferred zeros are skipped."""
            if not isinstance(g, Tensor):
                return total + g
            if _defer.is_deferred_zero(g):
                return total
            if _defer.is_deferred_zero(total):
                return g
            if id(total) in owned:
                return total.add_(g)
            out = total + g
            owned.add(id(out))
            return out

        def mean(i: int, t: Any) -> Any:
            if not isinstance(t, Tensor):
                return t / n_micro
            if _defer.is_deferred_zero(t):
                return torch.zeros(t.shape, dtype=t.dtype, device=t.device)
            if id(t) in owned:
                return t.div_(n_micro)
            plain = type(t) is Tensor and (t.is_floating_point() or t.is_complex())
            if not plain or t.requires_grad or is_functorch_wrapped_tensor(t):
                return t / n_micro
            # grad_fn's own result (the reduced sum of a real mesh's deferred microbatches):
            # never written, and the mean goes into this wrapper's buffers, not fresh memory
            # (2.7 ms against 0.7 ms for 8 MB of gradients) once the caller dropped them.
            return torch.div(t, n_micro, out=pooled(pools.setdefault(i, []), t))

        scope = fpar.defer_reduction()
        scope._expanded_zeros = True  # deferred gradients come back as expanded zeros: skipped
        try:
            for i in range(n_micro):
                args = _fold_key(rest, key_arg, i)
                mb = _microbatch(batch, i, n_micro, mesh, batch_specs)
                if i < n_micro - 1:
                    with scope:  # reduced with the last microbatch: one all-reduce per bucket per step
                        g, aux = grad_fn(params, mb, *args)
                else:
                    g, aux = grad_fn(params, mb, *args)
                total_g = g if total_g is None else tree_map(add, total_g, g)
                auxs.append(aux)  # summed at the end: a real mesh's loss may still be in flight
        except BaseException:
            scope._discard()  # this step failed: its deferred sums belong to no step
            raise
        scope._check_reduced("fpar.optim.accumulate")
        total_aux = auxs[0]
        for aux in auxs[1:]:
            total_aux = tree_map(torch.add, total_aux, aux)
        leaves, treedef = tree_flatten(total_g)
        means = tree_unflatten(treedef, [mean(i, t) for i, t in enumerate(leaves)])
        return means, tree_map(lambda t: t / n_micro, total_aux)

    pools: dict[int, list] = {}  # leaf position -> the means' buffers (_buffers.pooled)
    return accumulated


def _fold_key(rest: tuple, key_arg: int | None, i: int) -> tuple:
    if key_arg is None:
        return rest
    if key_arg - 2 >= len(rest):
        raise ValueError(f"fpar.optim.accumulate: key_arg={key_arg} but grad_fn got only {len(rest) + 2} arguments.")
    j = key_arg - 2
    return (*rest[:j], fpar.random.fold_in(rest[j], i), *rest[j + 1 :])


def _microbatch(batch: Any, i: int, n_micro: int, mesh: fpar.Mesh, batch_specs: Any) -> Any:
    leaves, treedef = tree_flatten(batch)
    specs = broadcast_prefix(batch_specs, batch, is_leaf=lambda s: s is None or isinstance(s, P))
    out = []
    for x, spec in zip(leaves, specs):
        entries = spec.normalized() if isinstance(spec, P) else ()
        dims = [d for d, e in enumerate(entries) if e]
        if not isinstance(x, Tensor) or not dims:
            out.append(x)
            continue
        d = dims[0]
        parts = 1 if mesh.backend == "dist" else math.prod(mesh.shape[a] for a in entries[d])
        local = x.shape[d] // parts
        if local % n_micro:
            raise ValueError(
                f"fpar.optim.accumulate: a device's batch has {local} rows along dim {d}, which "
                f"n_micro={n_micro} does not divide; use a batch size divisible by "
                f"{n_micro} x the data-parallel size."
            )
        x = x.unflatten(d, (parts, n_micro, local // n_micro)).select(d + 1, i).flatten(d, d + 1)
        out.append(x)
    return tree_unflatten(treedef, out)


# Updates ---------------------------------------------------------------------------------------


def zero_update(
    optimizer: GradientTransformation,
    layout: ZeroLayout,
    *,
    bucket_bytes: int = BUCKET_BYTES,
    donate: bool = False,
) -> Callable:
    """Build ``update(grads, opt_state, params) -> (params, opt_state)`` for ``layout``'s stage.

    Most training loops want ``zero_step`` (``zero_grads`` then this update).  ``grads`` must be
    what ``zero_grads(loss_fn, layout)`` returns, laid out by ``layout.grad_specs``: stage 0 the
    global gradient (shaped like the parameters); stage 1 each data rank's own, unreduced
    gradient, stacked on a leading dim of the data axis's size; stages 2 and 3 each rank's chunk
    of the reduced gradient, flattened.  The gradient of your own sharded loss
    (``torch.func.grad(sharded)(params, ...)``) is the global one, right for stage 0 only; for
    stages 1-3 ``update`` raises a ``ValueError`` saying so, before any communication.

    Stage 0 updates every (replicated) parameter on every device; stage 1 first reduce-scatters
    the per-rank gradients; stages 1 and 2 update this device's chunk of each parameter with
    its chunk of the state and all-gather the new parameters (``all_gather_invariant``: they
    leave replicated); stage 3 updates the chunks and keeps them.  The optimizer runs inside
    ``fpar.shard`` on blocks, so global operations in it (``clip_by_global_norm``, the mixed
    precision overflow check) combine over the devices.  Stage 1's reduce-scatter and the
    all-gathers of stages 1 and 2 go in buckets of up to ``bucket_bytes`` per device (leaves of
    one dtype and layout, in order): one collective per bucket, the same values and bytes.

    ``donate=True`` hands ``grads``, ``opt_state`` and ``params`` over to the update, as JAX's
    ``donate_argnums`` and as ``torch.optim`` steps in place: on a real mesh the built-in
    transformations (``adamw``, ``adam``, ``sgd`` without Nesterov, ``scale*``,
    ``add_decayed_weights``) then write the new state, and for stages 0 and 3 the new
    parameters, into the given tensors and return them, so the step holds one copy of the state
    instead of the old and the new together (the same kernels: the same values).  The caller
    must not use the donated trees afterwards (they hold the new values, or are partly
    overwritten).  In-process the inputs are shared views of global tensors and the update stays
    functional.  With a loss-scaled ``mixed_precision`` the inner optimizer is not donated (an
    overflow keeps its old state).
    """
    mesh = layout.mesh
    sspecs = layout.state_specs(optimizer)
    gspecs = layout.grad_specs
    stage = layout.stage
    inplace = donate and mesh.backend == "dist"

    def per_device(grads, state, params):
        with ops.donation(inplace):
            return update_blocks(grads, state, params)

    def update_blocks(grads, state, params):
        if stage == 0 or stage == 3:
            updates, state = optimizer.update(grads, state, params)
            return apply_updates(params, updates), state
        if stage == 1:
            leaves, treedef = tree_flatten(grads)
            grads = tree_unflatten(treedef, _reduce_scatter_all([g.squeeze(0) for g in leaves], layout, bucket_bytes))
        chunks = _map(_own_chunk, params, layout)
        updates, state = optimizer.update(grads, state, chunks)
        chunks = apply_updates(chunks, updates)
        leaves, treedef = tree_flatten(chunks)
        return tree_unflatten(treedef, _gather_all(leaves, layout, bucket_bytes)), state

    stored = layout.param_specs
    sharded = fpar.shard(per_device, mesh, (gspecs, sspecs, stored), (stored, sspecs))

    def update(grads, opt_state, params):
        _check_grads(grads, layout)  # before any communication
        return sharded(grads, opt_state, params)

    return update


# Error checking and messages ------------------------------------------------------------------


def _global_shape(lf: _Leaf, mesh: fpar.Mesh) -> tuple[int, ...]:
    """The parameter's global shape from its block and spec (in-process)."""
    entries = tuple(lf.spec) + (None,) * (len(lf.block) - len(tuple(lf.spec)))
    sizes = []
    for b, entry in zip(lf.block, entries):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        sizes.append(b * math.prod(mesh.shape[a] for a in axes))
    return tuple(sizes)


def _expected_grad_shape(lf: _Leaf, layout: ZeroLayout) -> tuple[int, ...]:
    """The shape ``zero_update`` takes for one gradient leaf (global in-process, a block on a real mesh)."""
    real = layout.mesh.backend == "dist"
    if layout.stage == 0:
        return lf.block if real else _global_shape(lf, layout.mesh)
    if layout.stage == 1:
        return (1, *lf.block) if real else (layout.n, *_global_shape(lf, layout.mesh))
    split = math.prod(layout.mesh.shape[a] for a in lf.split)
    return (lf.chunk,) if real else (lf.chunk * layout.n * split,)


def _check_grads(grads: Any, layout: ZeroLayout) -> None:
    """Raise if ``grads`` are not laid out as ``layout.grad_specs`` says (a usual mistake: the global gradient)."""
    paths, leaves, _ = tree_flatten_with_path(grads)
    specs = tree_flatten(layout.grad_specs)[0]
    if len(leaves) != len(layout.leaves) or len(specs) != len(leaves):
        return  # fpar.shard names the mismatched trees
    for path, g, lf, spec in zip(map(keystr, paths), leaves, layout.leaves, specs):
        want = _expected_grad_shape(lf, layout)
        if not isinstance(g, Tensor) or tuple(g.shape) == want:
            continue
        param = _global_shape(lf, layout.mesh) if layout.mesh.backend != "dist" else lf.block
        given = " (the parameter's shape: a gradient of the global loss)" if tuple(g.shape) == param else ""
        raise ValueError(
            f"fpar.optim.zero_update (ZeRO stage {layout.stage}): grads{path} has shape {tuple(g.shape)}"
            f"{given}; stage {layout.stage}'s update takes {_GRAD_KIND[min(layout.stage, 2)]}, laid out by "
            f"layout.grad_specs ({spec}): shape {want} here. Gradients from torch.func.grad or .backward() of "
            f"your own sharded loss are already summed over {layout.data_axis!r}, which only stage 0 takes. "
            f"Compute them with fpar.optim.zero_grads(loss_fn, layout), or take the whole step with "
            f"fpar.optim.zero_step:\n"
            f"    step = fpar.optim.zero_step(loss_fn, opt, layout, batch_specs=P({layout.data_axis!r}))"
            f"  # loss_fn(params, batch): per-device loss\n"
            f"    params, opt_state, metrics = step(params, opt_state, batch)"
        )


_GRAD_KIND = {
    0: "the global gradient, laid out like the parameters",
    1: "each data rank's own, unreduced gradient (one copy per data rank, stacked on a leading dim)",
    2: "each data rank's chunk of the reduced gradient (flattened and padded)",
}


def zero_step(
    loss_fn: Callable,
    optimizer: GradientTransformation,
    layout: ZeroLayout,
    *,
    batch_specs: Any = None,
    n_micro: int = 1,
    regather: bool = True,
    bucket_bytes: int = BUCKET_BYTES,
    donate: bool = False,
) -> Callable:
    """Build a training step ``(params, opt_state, batch) -> (params, opt_state, metrics)``.

    ``zero_grads`` then ``zero_update`` (see both); ``metrics = {"loss": global mean loss}``.
    ``donate=True``: ``params`` and ``opt_state`` are handed over to the step and updated in
    place on a real mesh (see ``zero_update``); use only the trees it returns.
    With a ``mixed_precision`` optimizer the loss runs in its compute dtype and is scaled by the
    state's loss scale.

    Example:
      >>> layout = fpar.optim.zero_layout(params, mesh, specs, stage=2)
      >>> opt = fpar.optim.adamw(1e-3)
      >>> params, state = fpar.optim.zero_init(opt, params, layout)
      >>> step = fpar.optim.zero_step(loss_fn, opt, layout, batch_specs=P("data"))
      >>> params, state, metrics = step(params, state, batch)
    """
    policy = optimizer if isinstance(optimizer, MixedPrecision) else None
    grads_fn = zero_grads(
        loss_fn,
        layout,
        batch_specs=batch_specs,
        n_micro=n_micro,
        compute_dtype=policy.compute_dtype if policy is not None else None,
        regather=regather,
        bucket_bytes=bucket_bytes,
    )
    update_fn = zero_update(optimizer, layout, bucket_bytes=bucket_bytes, donate=donate)

    def step(params, opt_state, batch):
        scale = opt_state.loss_scale if policy is not None and policy.scaled else None
        grads, loss = grads_fn(params, batch, scale)
        params, opt_state = update_fn(grads, opt_state, params)
        return params, opt_state, {"loss": loss}

    return step
