"""ZeRO's update and step: the optimizer on each device's chunk, then the parameters as the stage keeps them.

``zero_update`` checks that the gradients it is given are the ones ``zero_grads`` returns for the
layout (the error names the expected shape and points to ``zero_step``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from .._mesh import Mesh
from .._shard import shard
from .._tree import keystr, tree_flatten, tree_flatten_with_path, tree_unflatten
from . import _ops as ops
from ._base import GradientTransformation, apply_updates
from ._internal import is_plain
from ._precision import MixedPrecision
from ._zero import (
    BUCKET_BYTES,
    ZeroLayout,
    _gather_all,
    _Leaf,
    _map,
    _own_chunk,
    _own_chunk_view,
    _reduce_scatter_all,
    _Releaser,
)
from ._zero_grads import zero_grads

__all__ = ["zero_step", "zero_update"]

Tensor = torch.Tensor

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
    ``add_decayed_weights``) then write the new state and parameters into the given tensors and
    return them (stages 1 and 2 all-gather the updated chunks into the old parameters' buffers
    one bucket at a time), so the step holds one copy of the state instead of the old and the
    new together (the same kernels: the same values); stage 1 also frees each donated whole
    gradient's memory as soon as its bucket is reduce-scattered (a gradient sharing its storage
    with a parameter, the state or a larger buffer is left alone).  The caller
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
            whole = [g.squeeze(0) for g in leaves]
            done = _Releaser(whole, (state, params)) if inplace else None  # donated: freed as reduced
            del leaves, grads
            grads = tree_unflatten(treedef, _reduce_scatter_all(whole, layout, bucket_bytes, done))
            del whole, done
        # donated: each device's chunk is a view of its parameter (the update writes it there), and
        # the new parameters are gathered into the old ones' buffers, a bucket at a time
        old, ptree = tree_flatten(params)
        into = old if ops.writable(old) and is_plain(old) else None
        if into is None:
            chunks = _map(_own_chunk, params, layout)  # copies: the old parameters stay whole
        else:
            views = [_own_chunk_view(x, lf, layout) for x, lf in zip(old, layout.leaves)]
            own = [
                _own_chunk(x, lf, layout) if v is None else v for x, lf, v in zip(old, layout.leaves, views)
            ]
            chunks = tree_unflatten(ptree, own)
        updates, state = optimizer.update(grads, state, chunks)
        chunks = apply_updates(chunks, updates)
        leaves, treedef = tree_flatten(chunks)
        return tree_unflatten(treedef, _gather_all(leaves, layout, bucket_bytes, into)), state

    stored = layout.param_specs
    sharded = shard(per_device, mesh, (gspecs, sspecs, stored), (stored, sspecs))

    def update(grads, opt_state, params):
        _check_grads(grads, layout)  # before any communication
        return sharded(grads, opt_state, params)

    return update


# Error checking and messages ------------------------------------------------------------------


def _global_shape(lf: _Leaf, mesh: Mesh) -> tuple[int, ...]:
    """The parameter's global shape from its block and spec (in-process)."""
    entries = tuple(lf.spec) + (None,) * (len(lf.block) - len(tuple(lf.spec)))
    sizes = []
    for b, entry in zip(lf.block, entries):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        sizes.append(b * math.prod([mesh.shape[a] for a in axes]))
    return tuple(sizes)


def _expected_grad_shape(lf: _Leaf, layout: ZeroLayout) -> tuple[int, ...]:
    """The shape ``zero_update`` takes for one gradient leaf (global in-process, a block on a real mesh)."""
    real = layout.mesh.backend == "dist"
    if layout.stage == 0:
        return lf.block if real else _global_shape(lf, layout.mesh)
    if layout.stage == 1:
        return (1, *lf.block) if real else (layout.n, *_global_shape(lf, layout.mesh))
    split = math.prod([layout.mesh.shape[a] for a in lf.split])
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
    reduce_once: bool = False,
) -> Callable:
    """Build a training step ``(params, opt_state, batch) -> (params, opt_state, metrics)``.

    ``zero_grads`` then ``zero_update`` (see both); ``metrics = {"loss": global mean loss}``.
    ``donate=True``: ``params`` and ``opt_state`` are handed over to the step and updated in
    place on a real mesh (see ``zero_update``); use only the trees it returns.
    ``reduce_once=True`` (stages 2 and 3, ``n_micro > 1``): the microbatches' gradients are summed
    unreduced and reduce-scattered once a step (see ``zero_grads``).
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
        reduce_once=reduce_once,
    )
    update_fn = zero_update(optimizer, layout, bucket_bytes=bucket_bytes, donate=donate)

    def step(params, opt_state, batch):
        scale = opt_state.loss_scale if policy is not None and policy.scaled else None
        grads, loss = grads_fn(params, batch, scale)
        params, opt_state = update_fn(grads, opt_state, params)
        return params, opt_state, {"loss": loss}

    return step
