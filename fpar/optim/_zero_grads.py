"""ZeRO's gradients: each device's chunk of the reduced gradient, as its stage computes it.

The stages, their traffic and memory are described in ``_zero.py``; the real mesh's
stage-3 schedule in ``_zero_fsdp.py``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from .._collectives import pmean
from .._compile import WHOLE_STEP, signature_key
from .._shard import shard
from .._spec import P
from .._torch_api import maybe_current_level
from .._tree import tree_flatten, tree_map, tree_unflatten
from ._accumulate import _microbatch, accumulate
from ._precision import cast_floating
from ._remat import remat
from ._zero import BUCKET_BYTES, ZeroLayout, _buckets, _gather, _Leaf, _map, _reduce_scatter_all, _Releaser
from ._zero_comm import Regather, regather_supported
from ._zero_fsdp import Uses, gathered_grad
from ._zero_micro import reduced_once, summed_sharded, tap_shapes, taps
from ._zero_rows import scattered_grad

__all__ = ["zero_grads"]

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
    reduce_once: bool = False,
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
        backward (``fpar.optim._zero_rows.scattered_grad``).
      reduce_once: stages 2 and 3 with ``n_micro > 1``: sum each data rank's unreduced gradient
        over the step's microbatches and reduce-scatter the sum once, at the end (FSDP2's
        ``set_requires_gradient_sync(False)`` on all but the last microbatch): ``n_micro - 1``
        fewer reduce-scatters a step, one whole gradient more held through it, in the
        parameters' dtype (``fpar.optim._zero_micro``).  ``False`` (FSDP2's default): each
        microbatch's gradient is reduce-scattered and its chunk summed.  Stages 0 and 1 reduce
        once a step already: refused there.
    """
    mesh, data, n = layout.mesh, layout.data_axis, layout.n
    if reduce_once and layout.stage < 2:
        raise ValueError(
            f"fpar.optim.zero_grads: reduce_once=True is for ZeRO stages 2 and 3 (it trades their "
            f"per-microbatch reduce-scatter for a whole held gradient); stage {layout.stage} already "
            f"reduces once a step (stage 0 all-reduces the microbatches' sum, stage 1 reduce-scatters "
            f"it in the update). Drop reduce_once."
        )
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
            loss = pmean(local_loss(params, batch), data)
            return loss * scale, loss.detach()

        sharded = shard(per_device, mesh, (pspecs, batch_specs, P()), (P(), P()))
        objective = traced = sharded
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
                return (loss * scale).reshape(1), pmean(loss.detach(), data)

            sharded = shard(per_device, mesh, (in_p, batch_specs, P()), (P(data), P()))

            def objective(params, batch, scale):
                scaled, loss = sharded(params, batch, scale)
                return scaled.sum() / n, loss  # the mean over data ranks (a rank's own term on a real mesh)

            return objective

        objective = objective_of(body)
        traced = objective  # under torch.compile: gathered in the forward, no hooks (see ``one``)
        if layout.stage == 3 and regather:
            hooked = objective
            objective = objective_of(remat(body))  # under torch.func, which refuses saved-tensor hooks
            if mesh.backend == "dist" and all(lf.block for lf in layout.leaves):
                # Gathered outside (``gathered_grad``): each rank's gathered block enters as its
                # own copy, varying over the data axis (its gradient is reduce-scattered there).
                hooked = objective_of(
                    local_loss, layout._tree([_own_copy_spec(lf, data) for lf in layout.leaves])
                )
                gathered_outside = True

        if layout.stage == 2 and mesh.backend == "dist" and all(lf.block for lf in layout.leaves):
            # Each rank's parameters as its own copy, differentiated by torch.autograd so every
            # bucket is reduce-scattered as soon as its gradients exist (``scattered_grad``).
            hooked = objective_of(
                local_loss, layout._tree([_own_copy_spec(lf, data) for lf in layout.leaves])
            )
            scatter_early = True

        wrt = (lambda params: params) if layout.stage == 3 else (lambda params: _per_rank(params, layout))
    grad = torch.func.grad(objective, has_aux=True)
    reduce = _reducer(layout, bucket_bytes) if layout.stage == 2 else None

    forwards: dict = {}  # real-mesh stage 3: signature -> what its last forward did with each parameter
    planned: set = set()  # real mesh: signatures whose first eager step ran (so planned) ``traced``
    planning: set = set()  # ... and those this step is planning: every microbatch of a step takes
    # one form, or the last microbatch would not claim the gradients the others deferred

    def one(params, batch, scale):
        if torch.compiler.is_compiling() and WHOLE_STEP:  # the whole step in one graph: torch.autograd
            if mesh.backend == "dist" and signature_key((params, batch, scale)) not in planned:
                raise RuntimeError(_UNPLANNED)
            g, loss = _autograd_grad(traced, wrt(params), batch, scale)
            return (reduce(g) if reduce is not None else g), loss
        if mesh.backend == "dist" and maybe_current_level() is None and _compiling_next():
            key = signature_key((params, batch, scale))
            if key not in planned:  # the first step of a signature: as a compiled step runs it, so
                planning.add(key)  # that a compiled step finds its sharded calls planned
                g, loss = _autograd_grad(traced, wrt(params), batch, scale)
                return (reduce(g) if reduce is not None else g), loss
        if layout.stage == 3 and regather and regather_supported():
            if gathered_outside:
                uses = forwards.setdefault(signature_key((params, batch, scale)), Uses())
                return gathered_grad(hooked, layout, params, batch, scale, compute_dtype, uses)
            return _regathered_grad(hooked, tracking, layout, params, batch, scale)
        if scatter_early and regather_supported():
            leaves = tree_flatten(params)[0]
            groups = _buckets(leaves, layout, bucket_bytes)
            return scattered_grad(hooked, layout, params, batch, scale, groups)
        if maybe_current_level() is None:
            # No transform around the step: torch.autograd.  torch.func.grad records the backward
            # itself (create_graph, for a higher derivative nobody takes here) and so keeps what
            # each op of the backward saves until the whole backward ends (pytorch#134612): every
            # recomputed layer's activations under remat, each layer's activation gradients.
            g, loss = _autograd_grad(objective, wrt(params), batch, scale)
        else:
            g, loss = grad(wrt(params), batch, scale)
        return (reduce(g) if reduce is not None else g), loss

    acc = accumulate(one, n_micro, mesh, batch_specs)
    if reduce_once and n_micro > 1:
        tap_specs = layout._tree([P(data, *lf.spec) for lf in layout.leaves])
        shapes = tap_shapes(layout)

        def tapped_loss(chunks_taps, batch):
            chunks, tap = chunks_taps
            if compute_dtype is not None:
                chunks = cast_floating(chunks, compute_dtype)
            fulls = _map(lambda c, lf, lo: _gather(c, lf, lo, invariant=False), chunks, layout)
            # the rank's gradient of each gathered parameter arrives at its tap, unreduced
            params = tree_map(lambda f, t: f.detach() + t.squeeze(0), fulls, tap)
            if tracking["regather"] is not None:
                for c, full in zip(tree_flatten(chunks)[0], tree_flatten(params)[0]):
                    tracking["regather"].track(c, full)
            return local_loss(params, batch)

        tapped = objective_of(tapped_loss, (layout.chunk_specs, tap_specs))

        def held_one(params, batch, scale, held):
            # under torch.compile, and the eager step that plans for it, as ``one``: torch.autograd
            # in the graph, stage 3's gathered parameters kept (``regather`` is an eager schedule)
            compiled = torch.compiler.is_compiling() and WHOLE_STEP
            if compiled and mesh.backend == "dist" and signature_key((params, batch, scale)) not in planned:
                raise RuntimeError(_UNPLANNED)
            if (
                not compiled
                and mesh.backend == "dist"
                and maybe_current_level() is None
                and _compiling_next()
            ):
                key = signature_key((params, batch, scale))
                if key not in planned:
                    planning.add(key)
                    compiled = True
            if layout.stage == 3 and gathered_outside and regather_supported() and not compiled:
                uses = forwards.setdefault(signature_key((params, batch, scale)), Uses())
                return gathered_grad(hooked, layout, params, batch, scale, compute_dtype, uses, hold=held)[1]
            if layout.stage == 2:
                g, loss = (
                    _autograd_grad(objective, wrt(params), batch, scale)
                    if maybe_current_level() is None
                    else grad(wrt(params), batch, scale)
                )
            else:
                leaves, params_def = tree_flatten(params)
                dtypes = [compute_dtype or t.dtype for t in leaves]
                tap = tree_unflatten(params_def, taps(shapes, dtypes, leaves[0].device if leaves else None))
                g, loss = _tapped_grad(
                    tapped, tracking, layout, params, tap, batch, scale, regather and not compiled
                )
            for i, t in enumerate(tree_flatten(g)[0]):
                held.add(i, t)
            return loss

        acc = reduced_once(
            held_one, _reducer(layout, bucket_bytes, release=True), layout, n_micro, batch_specs
        )

    sharded_loop: Callable | None = None  # real-mesh stage 3 in microbatches: each chunk summed in place
    if (layout.stage == 3 and gathered_outside or scatter_early) and n_micro > 1 and not reduce_once:

        def sharded_one(params, batch, scale, into):
            if scatter_early:
                groups = _buckets(tree_flatten(params)[0], layout, bucket_bytes)
                return scattered_grad(hooked, layout, params, batch, scale, groups, into=into)
            uses = forwards.setdefault(signature_key((params, batch, scale)), Uses())
            return gathered_grad(hooked, layout, params, batch, scale, compute_dtype, uses, into=into)

        sharded_loop = summed_sharded(sharded_one, n_micro, layout, batch_specs)

    def eager_schedule(params, batch, scale):
        """Whether this step runs the real mesh's eager schedule (not a compiled step's form)."""
        if not regather_supported() or torch.compiler.is_compiling():
            return False
        first = _microbatch(batch, 0, n_micro, mesh, batch_specs)
        return not (_compiling_next() and signature_key((params, first, scale)) not in planned)

    def grads(params, batch, loss_scale=None):
        if loss_scale is None:
            leaves = tree_flatten(params)[0]
            scale = torch.ones((), dtype=torch.float32, device=leaves[0].device if leaves else None)
        else:
            scale = loss_scale
        planning.clear()
        if sharded_loop is not None and eager_schedule(params, batch, scale):
            return sharded_loop(params, batch, scale)
        out = acc(params, batch, scale)
        planned.update(planning)
        return out

    return grads


def _tapped_grad(objective, tracking, layout, chunks, tap, batch, scale, regather):
    """Stage 3's unreduced gradient (``reduce_once``): the gradient of each parameter's tap.

    With ``regather`` outside a ``torch.func`` transform the backward re-gathers what autograd
    saved, as ``_regathered_grad`` (counted in-process as the real mesh makes them).
    """
    inputs, treedef = tree_flatten(tap)
    if maybe_current_level() is not None:  # under a transform: torch.func, the gathered ones kept
        fn = lambda t: objective((chunks, tree_unflatten(treedef, t)), batch, scale)  # noqa: E731
        return torch.func.grad(fn, has_aux=True)(inputs)
    if not regather:  # (no dict written: a compiled step comes this way)
        with torch.enable_grad():
            scaled, loss = objective((chunks, tap), batch, scale)
        return list(
            torch.autograd.grad(scaled, inputs, allow_unused=True, materialize_grads=True)
        ), loss.detach()
    return _regathered(lambda: objective((chunks, tap), batch, scale), inputs, tracking, layout)


def _regathered_grad(objective, tracking, layout, params, batch, scale):
    """Stage 3's gradient with the backward re-gather of ``_zero_comm`` (``torch.autograd``)."""
    leaves, treedef = tree_flatten(params)
    inputs = [t.detach().requires_grad_(True) for t in leaves]
    run = lambda: objective(tree_unflatten(treedef, inputs), batch, scale)  # noqa: E731
    g, loss = _regathered(run, inputs, tracking, layout)
    return tree_unflatten(treedef, g), loss


def _regathered(run, inputs, tracking, layout):
    """The forward ``run()`` under a new ``Regather``'s hooks, then its backward by ``torch.autograd``.

    ``run() -> (scaled loss, loss)``; returns ``(gradients w.r.t. inputs, loss)``.
    """
    rg = Regather(layout.mesh, layout.data_axis)
    tracking["regather"] = rg
    try:
        with torch.enable_grad(), rg.hooks():
            scaled, loss = run()
    finally:
        tracking["regather"] = None
    try:
        g = torch.autograd.grad(scaled, inputs, allow_unused=True, materialize_grads=True)
    finally:
        rg.close()
    return list(g), loss.detach()


_UNPLANNED = (
    "fpar.optim.zero_step on a real mesh under torch.compile: no eager step with these shapes ran "
    "with torch._dynamo.config.trace_autograd_ops = True. A compiled ZeRO step runs the gradient "
    "with torch.autograd inside the graph (which needs that flag), and on a real mesh its sharded "
    "calls must be planned by an eager step of the same form: with the flag on, the first eager "
    "step of each shape runs that form. Set the flag before the first step, run one step eagerly, "
    "then the compiled step."
)


def _compiling_next() -> bool:
    """Whether the user has turned on what a compiled ZeRO step needs (Dynamo's trace_autograd_ops).

    Then the first eager call of a signature runs the compiled step's form, which plans its
    sharded calls (it keeps stage 3's gathered parameters for that one step); otherwise every
    eager call runs the eager schedule (overlap, regather).
    """
    dynamo = sys.modules.get("torch._dynamo")
    return dynamo is not None and bool(dynamo.config.trace_autograd_ops)


def _autograd_grad(objective, params, batch, scale):
    """``torch.func.grad(objective, has_aux=True)`` as ``torch.autograd.grad``: what compiles whole.

    Under ``torch.compile`` a sharded call inside a ``torch.func`` transform is refused
    (pytorch#193279); a compiled step traces the sharded objective and its ``torch.autograd``
    backward instead, every collective and its transpose (stage 3's all-gather and the
    reduce-scatter of its gradient) in the graph.  Stage 3 gathers in the forward and keeps the
    gathered parameters for the backward there (``regather`` is an eager schedule).
    """
    leaves, treedef = tree_flatten(params)
    inputs = [t.detach().requires_grad_(True) for t in leaves]
    with torch.enable_grad():
        scaled, loss = objective(tree_unflatten(treedef, inputs), batch, scale)
    g = torch.autograd.grad(scaled, inputs, allow_unused=True, materialize_grads=True)
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


def _reducer(layout: ZeroLayout, bucket_bytes: int, *, release: bool = False) -> Callable:
    """Each rank's ``P(data, *spec)`` gradients reduce-scattered to chunks, a bucket at a time.

    ``release``: the gradients are the caller's to give (``reduce_once``'s sums): on a real mesh
    each one's storage is freed as soon as its bucket is reduced (``_Releaser``), so the step
    never holds the whole sum beside all its chunks.
    """
    in_g = layout._tree([P(layout.data_axis, *lf.spec) for lf in layout.leaves])
    release = release and layout.mesh.backend == "dist"

    def reduce(stacked):
        leaves, treedef = tree_flatten(stacked)
        whole = [g.squeeze(0) for g in leaves]
        # (not in a compiled graph: there the compiler frees what its schedule no longer reads)
        done = _Releaser(whole, ()) if release and not torch.compiler.is_compiling() else None
        del leaves, stacked
        return tree_unflatten(treedef, _reduce_scatter_all(whole, layout, bucket_bytes, done))

    return shard(reduce, layout.mesh, (in_g,), layout.chunk_specs)
