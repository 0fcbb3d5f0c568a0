"""ZeRO-2 and ZeRO-3 inside a pipeline: each stage's gradients reduce-scattered over the data axis.

``fpar.pipeline.pipeline`` sums every data-parallel gradient once per step (an all-reduce per
bucket of the microbatches' sum).  ``zero_pipeline(step, layout)`` runs the same step with those
sums left undone and reduce-scatters each stage's gradients over the data axis instead, so each
device ends the step with its chunk of the summed gradient (``layout.grad_specs``), as
``zero_update`` takes it: half the all-reduce's bytes, and no whole reduced gradient held.

* Stage 2 (and so ZeRO-1 in a pipeline, whose optimizer state is stage 2's: the gradient is
  reduced once per step either way) keeps whole parameters; ``zero_update`` all-gathers them
  after the update.
* Stage 3 keeps only chunks between steps (FSDP's sharded parameters) and gathers each stage's
  parameters once at the start of the step, holding them for its microbatches (torchtitan's
  choice for FSDP x pipeline, ``reshard_after_forward=False``: one all-gather a step, not one a
  microbatch); they are dropped before the reduce-scatter.  The embedding and the head are
  gathered only by the stage that reads them (``_zero_reshard.stage_gather``).

The embedding and the head (``first`` and ``last``, replicated over the pipe axis, used by one
stage) are reduce-scattered on every stage (zeros where a stage does not use them) and summed
over the pipe axis as chunks: ``1/N`` of what sending the owner's whole gradient would cost.

**When the gradients are reduced** (``reduce_once``).  By default a stage's microbatches'
gradients are summed unreduced (in float32 under ``compute_dtype``) and reduce-scattered once, at
the step's end: torchtitan's FSDP x pipeline (``set_requires_gradient_sync(False)`` but for the
last microbatch), one message a bucket a step, and the stage's whole gradient held until then (4
bytes a parameter of the stage in float32).  ``reduce_once=False`` sums each chunk's gradient onto
the data ranks whose chunks hold it as soon as that chunk's backward of a microbatch ends, and
accumulates it there as chunks (FSDP2's default, and Llama 3's "shards ... gradients"): a
stage holds one chunk's gradient while it is reduced, not the stage's, for ``m`` times the
messages.  A chunk's gradient is a row of each stacked leaf, whose range crosses one or more data
ranks' chunks of the leaf: each piece goes to its owner by ``torch.distributed.reduce`` (the bytes
of a reduce-scatter of the row), in flight while the forwards that follow compute, waited for
before the next backward starts.

In-process (no messages) the step's summed gradients are cut into each device's chunk.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, cast

import torch

from .. import _stats
from .._collectives import pmax, psum
from .._defer import deferred_zeros, is_deferred_zero
from .._mesh import Mesh
from .._shard import shard
from .._spec import P
from .._sums import widened
from .._tree import tree_flatten
from ..pipeline._stage import StepResult, last_stage
from ._zero import (
    BUCKET_BYTES,
    ZeroLayout,
    _Leaf,
    _map,
    _own_chunk,
    _padded,
    _reduce_scatter_all,
    _Releaser,
    zero_params,
)
from ._zero_fsdp import _resize
from ._zero_reshard import Reshard, stage_gather
from ._zero_rows import reduce_onto_owners

__all__ = ["zero_pipeline"]

Tensor = torch.Tensor
_API = "fpar.optim.zero_pipeline"


def zero_pipeline(
    step: Callable,
    layout: ZeroLayout,
    *,
    compute_dtype: torch.dtype | None = None,
    bucket_bytes: int = BUCKET_BYTES,
    reduce_once: bool = True,
    reshard_after_forward: bool = False,
) -> Callable:
    """A pipelined step whose parameters and gradients are laid out by ZeRO stage 2 or 3.

    Args:
      step: from ``fpar.pipeline.pipeline`` on ``layout``'s mesh (its stage functions
        ``fpar.shard``s over the axes other than the pipe axis, the data axis among them).
      layout: ``zero_layout(params, mesh, specs, stage=2 or 3)`` of the pipeline's parameters
        (``{"stages", "first", "last"}``).
      compute_dtype: stage 3: gather the parameters in this dtype (``torch.bfloat16``: half the
        all-gather's bytes and half the gathered stage's memory), as FSDP2's
        ``MixedPrecisionPolicy(param_dtype=...)``; their gradients are still summed over the
        microbatches and reduce-scattered in the parameters' own dtype (float32), and the stage
        functions see the low-precision parameters (a ``w.to(compute_dtype)`` in them is free).
        As FSDP2, a parameter used twice in one microbatch has its two gradients added in
        ``compute_dtype``.  In-process (no messages) the parameters are gathered as they are.
      bucket_bytes: reduce-scatter the gradients in buckets of up to this many bytes a device.
      reduce_once: sum the microbatches' gradients unreduced and reduce-scatter them once a step
        (True, torchtitan's choice in a pipeline), or reduce each chunk's gradient as each of its
        microbatches' backward ends and accumulate chunks (False: the stage's gradient is never
        held whole, for ``m`` times the messages; see the module docstring).  The same sums
        either way; the additions are ordered otherwise (float rounding may differ).
      reshard_after_forward: stage 3: gather each model chunk's parameters for its own forward
        and backward and free them after (True; FSDP2's name, torchtitan's other choice), or
        gather the stage once a step and hold it (False, the default): a stage then holds the
        running chunk and the next one's prefetch, not all ``v``, for two gathers a chunk and
        microbatch (``fpar/optim/_zero_reshard.py``).  The same values either way.

    Returns:
      ``run(params, xs, targets=None, *, key=None) -> StepResult``: ``params`` as ``zero_init``
      returns them (stage 3: chunks), ``.grads`` each device's chunk of the gradient
      (``layout.grad_specs``), equal to the chunks of ``step``'s; loss and stats as ``step``'s.

    Raises:
      TypeError: ``step`` is not a ``fpar.pipeline.pipeline`` step.
      ValueError: a stage other than 2 or 3, another mesh, the data axis is the pipe axis, or a
        layout with ``units``.
      TypeError: ``reduce_once`` or ``reshard_after_forward`` not a bool.
      ValueError: ``reshard_after_forward=True`` at stage 2 (its parameters are whole).

    Example:
      >>> layout = fo.zero_layout(params, mesh, specs, stage=3)
      >>> params, state = fo.zero_init(opt, params, layout)
      >>> run = fo.zero_pipeline(fpar.pipeline.pipeline(stage, schedule, mesh, loss=loss), layout)
      >>> res = run(params, xs, ys)
      >>> params, state = fo.zero_update(opt, layout)(res.grads, state, params)
    """
    unreduced = getattr(step, "_unreduced", None)
    if unreduced is None:
        raise TypeError(f"{_API}: step must come from fpar.pipeline.pipeline, got {type(step).__name__}.")
    if not isinstance(layout, ZeroLayout):
        raise TypeError(f"{_API}: layout must come from fpar.optim.zero_layout, got {type(layout).__name__}.")
    if layout.stage not in (2, 3):
        raise ValueError(
            f"{_API}: layout has stage {layout.stage}; a pipeline takes ZeRO stage 2 or 3 here (for "
            f"ZeRO-1 use stage 2: inside a pipeline the gradient is reduced once a step either way, "
            f"so the two hold the same state; for stage 0 call the pipeline's step itself)."
        )
    if layout.units is not None:
        raise ValueError(
            f"{_API}: layout has units; inside a pipeline ZeRO-3 gathers each stage's parameters "
            f"once a step and holds them for its microbatches, so there is no unit to gather. "
            f"Build the layout without units."
        )
    mesh, data, axis = layout.mesh, layout.data_axis, step._axis  # type: ignore[attr-defined]
    if mesh is not step._mesh:  # type: ignore[attr-defined]
        raise ValueError(f"{_API}: layout is on another mesh than the pipeline; build both on one mesh.")
    if data == axis:
        raise ValueError(
            f"{_API}: the data axis {data!r} is the pipeline's axis; ZeRO shards over the data axis."
        )
    if compute_dtype is not None and not (
        isinstance(compute_dtype, torch.dtype) and compute_dtype.is_floating_point
    ):
        raise TypeError(
            f"{_API}: compute_dtype must be a floating torch.dtype or None, got {compute_dtype!r}."
        )
    if not isinstance(reduce_once, bool):
        raise TypeError(f"{_API}: reduce_once must be True or False, got {reduce_once!r}.")
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(
            f"{_API}: reshard_after_forward must be True or False, got {reshard_after_forward!r}."
        )
    if reshard_after_forward and layout.stage != 3:
        raise ValueError(
            f"{_API}: reshard_after_forward=True is for ZeRO-3; stage {layout.stage} keeps whole "
            f"parameters, so there is nothing to gather or free. Use stage=3, or leave it False."
        )
    pspecs = layout._tree([lf.spec for lf in layout.leaves])
    chunked = shard(lambda g: _map(_own_chunk, g, layout), mesh, (pspecs,), layout.grad_specs)
    low = compute_dtype if layout.stage == 3 and mesh.backend == "dist" else None
    agree = _Agree(layout)
    combines: dict[tuple, Callable] = {}
    groups = layout._tree(list(range(len(layout.leaves))))  # each group's leaves' layout indices
    leaf_of = {g: tree_flatten(groups[g])[0] for g in groups}
    gather = (
        stage_gather(layout, leaf_of["stages"], low, rows=reshard_after_forward)
        if layout.stage == 3 and mesh.backend == "dist"
        else None
    )

    def run(params: Any, xs: Tensor, targets: Any = None, *, key: Tensor | None = None) -> Any:
        _check_params(params, layout)
        rows = None  # reshard_after_forward: each chunk gathered for its own actions
        if gather is not None:
            if reshard_after_forward:
                rows = Reshard(layout, params, leaf_of["stages"], low)
            whole = gather(params, _used(step, layout, leaf_of))
        else:
            whole = zero_params(params, layout)
        if mesh.backend != "dist":  # in-process: the summed gradients, cut into chunks
            res = step(whole, xs, targets, key=key)
            del whole
            return res._replace(grads=chunked(res.grads))
        wide = None if low is None else _master_dtype(params)
        each = None if reduce_once else _RowSums(layout, leaf_of)
        # ZeRO-3: the stage gathered for the step is freed once its last action ends (its
        # tensors stay valid objects: the sums are found and described by them), not held
        # through the stacking and reduce-scatter of its sums
        done = (
            None
            if layout.stage != 3 or rows is not None
            else functools.partial(_free_gathered, whole, params)
        )
        got = unreduced(whole, xs, targets, key, data, wide, each, rows, done)
        del rows, done
        # each leaf's sums are in its gathered dtype, or ``wide`` where that is wider
        sums = [_sum_dtype(t, wide) for t in tree_flatten(whole)[0]]
        del whole  # stage 3: the gathered stage goes before the reduce-scatter
        local, reduced, axes = (tree_flatten(t)[0] for t in (got.local, got.reduced, got.axes))
        like = tree_flatten(params)[0]
        masters = tuple(p.dtype for p in like)
        shared = [_pipe_replicated(lf, axis, mesh) for lf in layout.leaves]
        if each is not None:  # what was left unreduced (nothing, when every sum came by a backward)
            each.whole([(i, g, ax) for i, (g, ax) in enumerate(zip(local, axes)) if g is not None])
            axes = [each.axes.get(i, ax) for i, ax in enumerate(axes)]
            local = [None] * len(local)
        over = agree(axes)  # every rank's sharded call must take the same specs
        extra = tuple(
            tuple(a for a in ov if a != data) + ((axis,) if sh else ()) for ov, sh in zip(over, shared)
        )
        del axes
        rank = mesh._dist.coords[data]
        owns = [
            _own_slice(r, lf, layout, rank, p.device, dt, sh)
            for r, lf, p, dt, sh in zip(reduced, layout.leaves, like, sums, shared)
        ]
        del reduced
        if each is not None:  # the chunks each rank summed: over their other axes, plus the rest
            ins = [each.chunk(i, dt, p.device, sh) for i, (dt, p, sh) in enumerate(zip(sums, like, shared))]
            del each
            sig = ("rows", extra, masters)
            if sig not in combines:
                combines[sig] = _finish_rows(layout, extra, shared, masters, axis)
            return StepResult(got.loss, combines[sig](layout._tree(ins), layout._tree(owns)), got.stats)
        # A leaf this stage never read (the embedding or the head on another stage) got no
        # gradient on any rank of the stage: a zero of no bytes, whose reduce-scatter over the
        # stage's data group every rank of it skips (``_combine``: a sharded call of its own for
        # each such set, the same signature on every rank)
        skip = tuple(g is None for g in local)
        ins = [
            (deferred_zeros(torch.Size(lf.block), dt, p.device) if g is None else g).unsqueeze(0)
            for g, lf, p, dt in zip(local, layout.leaves, like, sums)
        ]
        del local
        combine = combines.get((extra, masters, skip))
        if combine is None:
            combine = combines[(extra, masters, skip)] = _combine(
                layout, extra, shared, masters, axis, bucket_bytes, skip
            )
        grads = combine(layout._tree(ins), layout._tree(owns))
        return StepResult(got.loss, grads, got.stats)

    return run


def _combine(
    layout: ZeroLayout, extra: tuple, shared: list, masters: tuple, axis: str, cap: int, skip: tuple
) -> Callable:
    """The sharded function: reduce-scatter each local gradient, sum the rest, add the chunks already summed.

    ``skip``: per leaf, whether no rank of this pipeline stage read it (its local gradient a zero
    of no bytes): its chunk is a zero, with no reduce-scatter over the stage's data group.
    """
    data = layout.data_axis
    local_specs = layout._tree([P((data, *ex), *lf.spec) for ex, lf in zip(extra, layout.leaves)])
    own_specs = _own_specs(layout, shared, axis)

    def per_device(local: Any, own: Any) -> Any:
        grads = [g.squeeze(0) for g in tree_flatten(local)[0]]
        owns = [o.squeeze(0) if sh else o for o, sh in zip(tree_flatten(own)[0], shared)]
        over = [tuple(a for a in ex if a != axis) for ex in extra]
        # each stacked sum is freed once its bucket is reduce-scattered (the step's own buffers:
        # ``_SumRows``'s, or a stack): the chunks grow as the whole sums go, not beside them.  (Over
        # one data rank a chunk may be its sum itself.)
        done = _Releaser(grads, ()) if layout.n > 1 else None
        chunks = _reduce_scatter_all(grads, layout, cap, done=done, extra=over, skip=list(skip))
        del grads
        out = []
        for c, o, sh, dt in zip(chunks, owns, shared, masters):
            if not is_deferred_zero(o):  # a part summed already (else: a zero of no bytes)
                c = c.add_(o)  # in place: the reduce-scatter's own output
            c = psum(c, axis) if sh else c
            out.append(c.to(dt))  # the parameters' dtype, as zero_update takes it
        return layout._tree(out)

    return shard(per_device, layout.mesh, (local_specs, own_specs), layout.grad_specs)


def _finish_rows(layout: ZeroLayout, extra: tuple, shared: list, masters: tuple, axis: str) -> Callable:
    """``reduce_once=False``'s end: each data-summed chunk summed over its other axes, plus the rest."""
    own_specs = _own_specs(layout, shared, axis)

    def per_device(acc: Any, own: Any) -> Any:
        out = []
        for a, o, sh, ex, dt in zip(tree_flatten(acc)[0], tree_flatten(own)[0], shared, extra, masters):
            a, o = (a.squeeze(0), o.squeeze(0)) if sh else (a, o)
            over = tuple(x for x in ex if x != axis)
            a = psum(a, over) if over else a
            if not is_deferred_zero(o):  # a part summed already
                a = a.add_(o)
            a = psum(a, axis) if sh else a
            out.append(a.to(dt))
        return layout._tree(out)

    return shard(per_device, layout.mesh, (own_specs, own_specs), layout.grad_specs)


def _own_specs(layout: ZeroLayout, shared: list, axis: str) -> Any:
    """Specs of each rank's chunks (one per pipe stage of a leaf replicated over the pipe axis)."""
    return layout._tree(
        [
            P(axis, *layout._chunk_spec(lf)) if sh else layout._chunk_spec(lf)
            for lf, sh in zip(layout.leaves, shared)
        ]
    )


class _RowSums:
    """``reduce_once=False``: each backward's gradients summed onto the data ranks that hold them.

    Called by the pipeline after each backward action with the deferred sums it completed (a
    chunk's row of each stacked leaf; ``first``/``last`` whole).  Each row is cut where the
    data ranks' chunks of its leaf meet, and each piece is summed onto its owner
    (``torch.distributed.reduce``), which adds it into its chunk.  The pieces are in flight while
    the forwards that follow compute, and waited for before the next backward starts: one
    backward's sums are held at a time.
    """

    def __init__(self, layout: ZeroLayout, leaf_of: dict):
        self.layout, self.leaf_of = layout, leaf_of
        self.data = layout.data_axis
        self.groups = cast(Any, layout.mesh._dist)  # a real mesh's (``MeshGroups``)
        self.group, self.members = self.groups.group((self.data,)), self.groups.members((self.data,))
        self.me = self.groups.coords[self.data]
        self.acc: dict[int, Tensor] = {}  # leaf -> this rank's chunk of its data-summed gradient
        self.axes: dict[int, str] = {}  # leaf -> the axes its sums are over (a leaf of ``Unreduced.axes``)
        # the pieces in flight: (work, piece, (leaf, offset, the sum's dtype) if this rank owns it)
        self.pending: list[tuple[Any, Tensor, tuple[int, int, torch.dtype] | None]] = []

    def ready(self) -> None:
        """A backward begins: the last one's reductions end first."""
        self.wait()

    def __call__(self, items: list) -> None:
        """One backward's sums: ``[(group, chunk, leaf, sum, axes)]`` (``each`` of the pipeline)."""
        for g, c, j, value, axes in items:
            i = self.leaf_of[g][j]
            flat = value.reshape(-1)
            self._reduce(i, c * flat.numel() if g == "stages" else 0, flat, " ".join(axes))

    def whole(self, items: list) -> None:
        """Whole leaves' sums (``(leaf, sum, axes)``), each as one row from its start."""
        for i, g, ax in items:
            self._reduce(i, 0, g.reshape(-1), ax)
        self.wait()

    def _reduce(self, i: int, start: int, flat: Tensor, axes: str) -> None:
        if self.layout.n > 1 and self.data not in axes.split():  # (over one rank: no sum to take)
            raise ValueError(
                f"{_API}: the gradient of parameter leaf {i} is not summed over the data axis "
                f"{self.data!r} (its sums are over {axes or 'no axis'}); ZeRO shards gradients over the "
                f"data axis, so its stage functions must use it replicated over that axis."
            )
        self.axes[i] = axes
        dtype = flat.dtype
        # the sum goes into the buffer (the step's own); fp16/bf16 summed in float32 (fpar's rule,
        # ``fpar.low_precision_sums``), rounded once when it is in
        flat = flat.float() if widened(dtype) else flat
        _stats.record_numel(
            "psum_scatter", (self.data,), self.layout.n, flat.numel(), flat.dtype, overlap=True
        )
        self.groups.group((self.data,))  # as every collective fpar issues: held messages go first
        chunk = self.layout.leaves[i].chunk
        if i not in self.acc:  # at the leaf's first sum on every rank, as ``RowScatter``'s
            self.acc[i] = flat.new_zeros(chunk, dtype=dtype)
        for work, piece, at in reduce_onto_owners(flat, start, chunk, self.members, self.group, self.me):
            self.pending.append((work, piece, None if at is None else (i, at, dtype)))

    def wait(self) -> None:
        """End the reductions in flight; add the pieces this rank owns into its chunks."""
        pending, self.pending = self.pending, []
        for work, piece, where in pending:
            work.wait()
            if where is not None:
                i, at, dtype = where
                piece = piece.to(dtype)  # a widened sum rounded once to the gradient's dtype
                self.acc[i][at : at + piece.numel()].add_(piece)

    def chunk(self, i: int, dtype: torch.dtype, device: torch.device, shared: bool) -> Tensor:
        """This rank's chunk of leaf ``i``'s data-summed gradient (zeros where none reached it)."""
        acc = self.acc.pop(i, None)
        if acc is None:
            acc = torch.zeros(self.layout.leaves[i].chunk, dtype=dtype, device=device)
        return acc.unsqueeze(0) if shared else acc


def _free_gathered(whole: Any, params: Any) -> None:
    """Free the bytes of a stage gathered for the step (its tensors stay valid objects, of no bytes).

    Not a leaf that is the caller's own tensor (one kept whole, not gathered) or shares its storage.
    """
    theirs = {t.untyped_storage()._cdata for t in tree_flatten(params)[0] if isinstance(t, torch.Tensor)}
    for t in tree_flatten(whole)[0]:
        if not isinstance(t, torch.Tensor):
            continue
        st = t.untyped_storage()
        if st.nbytes() and st._cdata not in theirs:
            _resize(t, 0)


class _Agree:
    """The mesh axes each parameter's gradient is summed over, the same on every rank.

    A rank whose stage does not use a parameter (the embedding on a later stage; a chunk slot
    with no layer) has no sums for it: it takes the axes the others report (its zeros summed
    over them change nothing).  One small ``pmax`` over the whole mesh a step.  Two ranks whose
    sums of one parameter are over different axes would need different sums: an error.
    """

    def __init__(self, layout: ZeroLayout):
        self.layout = layout
        names = tuple(layout.mesh.axis_names)
        self.names = names
        self.pmax = shard(lambda m: pmax(m.squeeze(0), names), layout.mesh, (P(names),), P())

    def __call__(self, axes: list) -> list[tuple[str, ...]]:
        own = [None if ax is None else tuple(a for a in self.names if a in ax.split()) for ax in axes]
        mask = torch.tensor([[a in (ax or ()) for a in self.names] for ax in own], dtype=torch.int32)
        union = self.pmax(mask.reshape(1, *mask.shape))
        out = [tuple(a for a, on in zip(self.names, row) if on) for row in union.tolist()]
        for i, (mine, agreed) in enumerate(zip(own, out)):
            if mine is not None and mine != agreed:
                raise ValueError(
                    f"{_API}: the gradient of parameter leaf {i} is summed over the mesh axes {mine} on "
                    f"this rank and over {agreed} on another: its pipeline stages' functions use it "
                    f"differently (replicated over an axis on one, varying on another), and one "
                    f"reduce-scatter cannot sum both."
                )
        return out


def _used(step: Any, layout: ZeroLayout, leaf_of: dict) -> list[bool]:
    """Per parameter leaf, whether this rank's pipeline stage reads it (``first`` and ``last``: one stage each).

    The embedding ``first`` is read by the first stage, and by the last too when the loss ties
    one of its weights (``fpar.pipeline.pipeline``'s ``tied``); the head ``last`` by the last
    stage; the stacked stage parameters by every stage.
    """
    pipe = cast(Any, layout.mesh._dist).coords[step._axis]
    last = last_stage(step._schedule)
    used = [True] * len(layout.leaves)
    for i in leaf_of.get("first", ()):
        used[i] = pipe == 0 or (bool(step._ties) and pipe == last)
    for i in leaf_of.get("last", ()):
        used[i] = pipe == last
    return used


def _sum_dtype(t: Any, wide: torch.dtype | None) -> torch.dtype:
    """The dtype a gathered leaf's gradient is summed in: its own, or ``wide`` where that is wider."""
    dtype = t.dtype if isinstance(t, Tensor) else torch.float32
    if wide is not None and dtype.is_floating_point and dtype.itemsize < wide.itemsize:
        return wide
    return dtype


def _master_dtype(params: Any) -> torch.dtype:
    """The dtype the parameters are stored in (their gradients are summed in it)."""
    floating = [t.dtype for t in tree_flatten(params)[0] if isinstance(t, Tensor) and t.is_floating_point()]
    return max(floating, key=lambda d: d.itemsize, default=torch.float32)


def _pipe_replicated(lf: _Leaf, axis: str, mesh: Mesh) -> bool:
    """Whether a parameter is replicated over the pipe axis (``first``/``last``: one stage's gradient)."""
    return mesh.shape.get(axis, 1) > 1 and axis not in lf.split


def _own_slice(
    reduced: Tensor | None,
    lf: _Leaf,
    layout: ZeroLayout,
    rank: int,
    device: torch.device,
    dtype: torch.dtype,
    shared: bool,
) -> Tensor:
    """This device's chunk of a gradient already summed over the data axis (a slice), or zeros."""
    if reduced is None:  # the common case (every sum deferred): a zero that holds no chunk of memory
        out = deferred_zeros(torch.Size([lf.chunk]), dtype, device)
    else:
        out = _padded(reduced, lf, layout.n).reshape(layout.n, lf.chunk)[rank].to(dtype)
    return out.unsqueeze(0) if shared else out


def _check_params(params: Any, layout: ZeroLayout) -> None:
    treedef = tree_flatten(params)[1]
    if treedef != layout.treedef:
        raise ValueError(
            f"{_API}: params do not have the layout's structure ({treedef} against {layout.treedef}); "
            f"pass the parameters zero_init returned for this layout."
        )
