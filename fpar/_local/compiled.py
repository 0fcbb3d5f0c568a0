"""An in-process sharded call traced by ``torch.compile``: the whole step in one graph.

Eagerly, the in-process mesh runs the per-device function under one ``torch.func.vmap`` level
per mesh axis, with collectives and folded matmuls as ``autograd.Function`` objects whose custom
``vmap`` rules Dynamo cannot trace, inside a ``TorchFunctionMode`` (``mode.py``).  Under Dynamo,
a call whose signature an eager call has already checked runs a lean form of the same program
that Dynamo and AOTAutograd trace:

* the same split of the inputs into per-axis dims (``LocalBackend.split``, views) and the same
  nest of ``torch.func.vmap`` levels, outermost = first mesh axis; every output leaves every
  level with a dim (``out_dims=0``), and one copy is kept along the axes its spec does not name;
* each collective is the custom op ``fpar::local_collective`` whose ``register_vmap`` rule peels
  the levels exactly as the eager ``_Collective`` does, then runs the same exchange on the
  stacked blocks (``exchange.py``): plain differentiable ops, so the backward AOTAutograd derives
  is the exact gradient of the global function, as it is eagerly;
* which mesh axes a value varies over (dropout's batch axes), which eagerly is vmap's batching
  of it, is the eager call's answer to the same query (``LocalPlan.varying``, in query order);
* no ``TorchFunctionMode``: what it does eagerly is counting traffic, checks the eager call has
  already made for this signature (replication, random ops, writes to inputs), inner-transform
  pvaries (refused under compile anyway), and folding matmuls, which Inductor does itself.

The eager call is needed because the static replication check (``check_rep``) reads vmap's
batching of each output, which Dynamo cannot trace; it is a property of the signature and the
code, so it is made once per signature, as on a real mesh.  ``fpar.comm_stats()`` does not count
compiled calls.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch._C._functorch import maybe_current_level

from .._collectives import Frame, frames
from .._compile import TRACED, answered_in_order
from .._tree import tree_flatten, tree_unflatten
from .collective import VARYING, Op
from .exchange import LocalBackend, make_exchange, vmap_dims

__all__ = ["LocalPlan", "UNCHECKED", "compiled_call"]

Tensor = torch.Tensor


@dataclasses.dataclass(frozen=True)
class LocalPlan:
    """What the eager call of one signature established: each leaf's spec, in and out."""

    in_specs: tuple  # per argument leaf: its PartitionSpec, or None (passed through)
    out_specs: tuple  # per output leaf: its PartitionSpec, or None (not a tensor)
    # (shape, dtype, the mesh axes it varies over) of each value the per-device function queried,
    # in order (``collective.varying_of``: dropout's batch axes, ...)
    varying: tuple = ()


# The collective as a custom op whose vmap rule Dynamo and AOTAutograd run -----------------------

# The op's arguments say everything the rule needs (no registry: Dynamo would defer a registry's
# writes past the fake run that needs them): the kind, axes and flattened params of the
# collective, the mesh (axis names and sizes: vmap level i + 1 is axis i; axes as indices), and the eager rule's
# progress so far (axes made explicit, batch dims mapped over).


def _flat_params(kind: str, params: tuple) -> list[int]:
    if kind == "ppermute":
        return [int(v) for pair in params[0] for v in pair]
    return [int(v) for v in params]


def _params(kind: str, flat: list[int]) -> tuple:
    if kind == "ppermute":
        return (tuple((flat[i], flat[i + 1]) for i in range(0, len(flat), 2)),)
    if kind in ("all_gather", "all_gather_invariant", "psum_scatter"):
        return (flat[0], bool(flat[1]))
    if kind == "all_to_all":
        return (flat[0], flat[1], bool(flat[2]))
    return ()


class _Shape:
    """What ``make_exchange`` reads of a mesh."""

    def __init__(self, names: tuple, sizes: tuple):
        self.shape = dict(zip(names, sizes))


_EXCHANGES: dict[tuple, Any] = {}
_SEP = "\x1f"  # joins the mesh's axis names into one string argument (the op takes no list of str)


@torch.library.custom_op("fpar::local_collective", mutates_args=())
def _collective_op(
    x: Tensor,
    token: Tensor,
    kind: str,
    axes: list[int],
    params: list[int],
    mesh_axes: str,
    mesh_sizes: list[int],
    explicit: list[int],
    nbatch: int,
) -> Tensor:
    """Only ever reached through its vmap rule: outside the mesh's levels it has no meaning."""
    raise RuntimeError("fpar: an in-process collective ran outside fpar.shard's vmap levels.")


@_collective_op.register_fake
def _(x, token, kind, axes, params, mesh_axes, mesh_sizes, explicit, nbatch):
    raise RuntimeError("fpar: an in-process collective ran outside fpar.shard's vmap levels.")


@_collective_op.register_vmap
def _(info, in_dims, x, token, kind, axes, params, mesh_axes, mesh_sizes, explicit, nbatch):
    # The eager rule (collective._Collective.vmap), for a custom op, whose rule runs at the level
    # it peels.
    level = maybe_current_level() or 0  # inside a vmap rule there is a level
    axis = level - 1 if 1 <= level <= len(mesh_sizes) else None  # None: a user's vmap level
    xd = in_dims[0]
    if axis is not None and axis in axes:
        x = x.movedim(xd, 0) if xd is not None else x.expand(info.batch_size, *x.shape)
        explicit = [axis, *explicit]
        out_dim = 0 if kind in VARYING else None
    elif xd is None:
        out_dim = None
    else:
        x = x.movedim(xd, len(explicit))
        nbatch += 1
        out_dim = len(explicit) if kind in VARYING else 0
    if len(explicit) < len(axes):
        return _collective_op(x, token, kind, axes, params, mesh_axes, mesh_sizes, explicit, nbatch), out_dim
    names, sizes = tuple(mesh_axes.split(_SEP)), tuple(mesh_sizes)
    if (names, sizes) not in _EXCHANGES:
        _EXCHANGES[names, sizes] = make_exchange(_Shape(names, sizes))
    op = Op(
        kind, tuple(names[a] for a in axes), _params(kind, params), tuple(names[a] for a in explicit), nbatch
    )
    return _EXCHANGES[names, sizes](op, x), out_dim


# The call -----------------------------------------------------------------------------------


UNCHECKED = (
    "fpar.shard({fname}) under torch.compile: no eager call with these argument shapes yet. "
    "In-process, fpar checks each signature (shapes, dtypes, requires_grad) on its first call, "
    "which runs eagerly: the replication check reads vmap's batching, which Dynamo cannot trace. "
    "Run the step once without torch.compile (e.g. the first step), then call the compiled one; "
    "without fullgraph=True the first compiled call runs the sharded call eagerly."
)

_FUNC_TRANSFORM = (
    "fpar.shard({fname}) under torch.compile inside a torch.func transform (grad, vjp, vmap, ...): "
    "not supported in a compiled step. Compile a step that calls the sharded loss, then "
    "loss.backward() or torch.autograd.grad (with torch._dynamo.config.trace_autograd_ops = True "
    "for .backward() inside the compiled function), or run torch.func.grad without torch.compile."
)


def compiled_call(f, fname: str, mesh, plan: LocalPlan, args: tuple) -> Any:
    """``fpar.shard(f, mesh, ...)(*args)`` in-process, as code ``torch.compile`` traces whole."""
    if maybe_current_level() is not None:
        raise RuntimeError(_FUNC_TRANSFORM.format(fname=fname))
    backend = LocalBackend(mesh)
    axes = mesh.axis_names
    leaves, treedef = tree_flatten(args)
    views, labels, slots = [], [], []
    for i, (leaf, spec) in enumerate(zip(leaves, plan.in_specs)):
        if spec is None:
            continue
        view, label = backend.split(leaf, spec)
        views.append(view)
        labels.append(label)
        slots.append(i)
    level_dims = vmap_dims(axes, labels)
    device = views[0].device if views else None
    token, index = backend.token_and_index(device)
    frame = Frame(mesh=mesh, fname=fname, exchange=None, backend="local")
    names = _SEP.join(axes)

    def collective(kind: str, axes_: tuple, params: tuple, x: Tensor) -> Tensor:
        # vmap level i + 1 is mesh axis i: compiled_call refuses outer transforms
        return _collective_op(
            x,
            frame.token,
            kind,
            [axes.index(a) for a in axes_],
            _flat_params(kind, params),
            names,
            list(mesh.axis_sizes),
            [],
            0,
        )

    frame.collective = collective
    frame.varying = answered_in_order(plan.varying, fname)
    nviews = len(views)
    out_tree: list = []

    def innermost(*flat):
        frame.token = flat[nviews]
        frame.index = dict(zip(axes, flat[nviews + 1 :]))
        local = list(leaves)
        for i, v in zip(slots, flat[:nviews]):
            local[i] = v
        out_leaves, out_treedef = tree_flatten(f(*tree_unflatten(treedef, local)))
        out_tree.append((out_leaves, out_treedef))
        return tuple(t for t, spec in zip(out_leaves, plan.out_specs) if spec is not None)

    fn = innermost
    for i in reversed(range(len(axes))):
        fn = torch.func.vmap(fn, in_dims=level_dims[i], out_dims=0)
    stack = frames()
    stack.append(frame)
    TRACED[0] += 1
    try:
        outs = fn(*views, token, *index)
    finally:
        TRACED[0] -= 1
        stack.pop()
    out_leaves, out_treedef = out_tree[-1]
    outs = iter(outs)
    assembled = [
        backend.output(next(outs), spec, list(axes)) if spec is not None else leaf
        for leaf, spec in zip(out_leaves, plan.out_specs)
    ]
    return tree_unflatten(out_treedef, assembled)
