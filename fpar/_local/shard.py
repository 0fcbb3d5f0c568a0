"""``fpar.shard`` in-process: split the inputs, run one vmap level per mesh axis, assemble the outputs.

The in-process twin of ``_dist/shard.py``: ``_shard.py`` checks the specs and builds the sharded
function, then runs each call here (``LocalCall``) or on a real mesh (``DistShard``).  Why one
vmap level per mesh axis: see ``_shard.py``'s docstring and docs/design/in-process-mesh.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch._C._functorch import maybe_current_level

from .. import _stats as stats
from .._collectives import Frame, frames
from .._compile import eager
from .._errors import ReplicationError, check_in_leaf, check_out_leaf, replication_message
from .._spec import check_spec
from .._tree import keystr, tree_flatten_with_path, tree_unflatten
from .collective import batched_levels, collective
from .compiled import LocalPlan
from .exchange import LocalBackend, vmap_dims
from .mode import storage_of

__all__ = ["LocalCall"]

Tensor = torch.Tensor


class LocalCall:
    """One call of a sharded function: split the inputs, run the nest, assemble the outputs."""

    def __init__(self, f, fname, mesh, in_specs, out_specs, check_rep, prefix):
        self.f, self.fname, self.mesh = f, fname, mesh
        self._prefix = prefix  # _shard._prefix: spec tree broadcast with the user-facing errors
        self.in_specs, self.out_specs, self.check_rep = in_specs, out_specs, check_rep
        self.axes = mesh.axis_names

    def run(self, args: tuple) -> Any:
        if frames() and frames()[-1].token is not None:
            raise NotImplementedError(
                f"fpar.shard({self.fname}) was called inside another fpar.shard "
                f"({frames()[-1].fname}); nested shard is not supported. Call the inner per-device "
                f"function directly: it already runs per device."
            )
        backend = LocalBackend(self.mesh)  # a real mesh runs _dist/shard.py instead
        paths, leaves, self.treedef = tree_flatten_with_path(args)
        specs = self._prefix(self.fname, "in_specs", self.in_specs, args, "the arguments")
        self.static = {}
        self.inputs = {}  # in-process: the caller's storages, which in-place ops must not touch
        views, labels, checked = [], [], []
        for i, (path, leaf, spec) in enumerate(zip(paths, leaves, specs)):
            where = f"fpar.shard({self.fname}): args{keystr(path)}"
            if spec is None:
                self.static[i] = leaf
                continue
            check_in_leaf(where, leaf, spec)
            backend.check_input(spec, leaf, where)
            view, label = backend.split(leaf, spec)
            views.append(view)
            labels.append(label)
            checked.append((where, spec, leaf))
            if backend.name == "local" and storage_of(leaf):
                self.inputs.setdefault(storage_of(leaf), f"args{keystr(path)}")
        self.tensor_slots = [i for i in range(len(leaves)) if i not in self.static]
        self.leaf_specs = tuple(None if i in self.static else s for i, s in enumerate(specs))
        backend.before(self, checked)  # a real mesh agrees on shapes here, before any exchange
        return self._run(backend, views, labels)

    def _run(self, backend, views: list[Tensor], labels: list[list]) -> Any:
        from .mode import ShardMode

        device = views[0].device if views else None
        token, index = backend.token_and_index(device)
        level_dims = vmap_dims(self.axes, labels)
        frame = Frame(
            mesh=self.mesh,
            fname=self.fname,
            exchange=backend.exchange,
            backend=backend.name,
            inputs=self.inputs,
            queried=[],
        )
        frame.collective = functools.partial(collective, frame)
        fn = self._innermost(frame, len(views))
        for i in reversed(range(len(self.axes))):
            fn = self._level(fn, frame, i, level_dims[i])
        frames().append(frame)
        try:
            with ShardMode(frame), eager():
                outs = fn(*views, token, *index)
        except RuntimeError as e:
            if "randomness" in str(e):
                raise RuntimeError(
                    f"fpar.shard({self.fname}): a random op ran inside the sharded function; its "
                    f"draws would depend on the mesh layout. Use fpar.random with an explicit key "
                    f"(fpar.random.uniform / normal / bernoulli(key, ..., spec=...), "
                    f"fpar.ops.dropout(key, x, rate, spec=...)), or draw the tensor outside and "
                    f"pass it in with a spec."
                ) from e
            raise
        finally:
            frames().pop()
            frame.release()
        if self.axes:
            outs = _merge(outs, [self.axes[0] in p for p in self.present])
        # checked: compilable, with the answers of its varying-axes queries
        self.plan = LocalPlan(self.leaf_specs, tuple(self.out_leaf_specs), tuple(frame.queried))
        return self._assemble(backend, outs)

    def _innermost(self, frame: Frame, nviews: int) -> Callable:
        def run(*flat):
            frame.token = flat[nviews]
            frame.index = dict(zip(self.axes, flat[nviews + 1 :]))
            leaves = [None] * (len(self.static) + nviews)
            for i, v in self.static.items():
                leaves[i] = v
            for i, v in zip(self.tensor_slots, flat[:nviews]):
                leaves[i] = v
            out = self.f(*tree_unflatten(self.treedef, leaves))
            return self._outputs(frame, out)

        return run

    def _level(self, inner: Callable, frame: Frame, i: int, in_dims: tuple) -> Callable:
        axis = self.axes[i]

        def level(*flat):
            frame.levels[maybe_current_level()] = axis
            outs = inner(*flat)
            if i < len(self.axes) - 1:  # the level inside split its outputs: interleave them back
                inner_axis = self.axes[i + 1]
                outs = _merge(outs, [inner_axis in p for p in self.present])
            keep = [axis in self.present[j] for j in range(len(outs))]
            return (
                tuple(o for o, k in zip(outs, keep) if k),
                tuple(_Opaque(o) for o, k in zip(outs, keep) if not k),
            )

        return torch.func.vmap(level, in_dims=in_dims, out_dims=(0, None))

    # -- outputs ----------------------------------------------------------------------------

    def _outputs(self, frame: Frame, out: Any) -> list[Tensor]:
        """Check the per-device outputs; record which axes each will have a dim for."""
        paths, leaves, self.out_treedef = tree_flatten_with_path(out)
        specs = self._prefix(self.fname, "out_specs", self.out_specs, out, "the outputs")
        self.out_static, self.out_slots, self.out_specs_flat, self.present = {}, [], [], []
        self.replicated_named = []
        self.out_leaf_specs = []  # for the plan of a compiled call (compiled.LocalPlan)
        tensors = []
        for j, (path, leaf, spec) in enumerate(zip(paths, leaves, specs)):
            where = f"fpar.shard({self.fname}): out{keystr(path)}"
            if check_out_leaf(where, leaf, spec):
                self.out_static[j] = leaf
                self.out_leaf_specs.append(None)
                continue
            self.out_leaf_specs.append(spec)
            check_spec(spec, tuple(leaf.shape), self.mesh.shape, where=where, blocks=True)
            varying = batched_levels(leaf, frame.levels)
            named = set(spec.axes())
            broken = [a for a in self.axes if a not in named and _level_of(frame, a) in varying]
            if broken and self.check_rep:
                raise ReplicationError(replication_message(where, spec, broken))
            self.present.append([a for a in self.axes if a in named or a in broken])
            rep = tuple(a for a in self.axes if a in named and _level_of(frame, a) not in varying)
            if rep and (leaf.is_floating_point() or leaf.is_complex()):
                # one copy per device along rep: the transpose sums (counted, as on a real mesh)
                stats.count_transpose(leaf, "pvary", rep, self.mesh.axis_size(rep))
            self.replicated_named.append(rep)
            self.out_slots.append(j)
            self.out_specs_flat.append(spec)
            tensors.append(leaf)
        return tensors

    def _assemble(self, backend, outs: list[Tensor]) -> Any:
        leaves = [None] * (len(self.out_static) + len(outs))
        for j, v in self.out_static.items():
            leaves[j] = v
        for slot, t, spec, present, rep in zip(
            self.out_slots, outs, self.out_specs_flat, self.present, self.replicated_named
        ):
            leaves[slot] = backend.output(t, spec, present, rep)
        return tree_unflatten(self.out_treedef, leaves)


def _level_of(frame: Frame, axis: str) -> int:
    return next(lvl for lvl, a in frame.levels.items() if a == axis)


def _merge(parts: tuple[tuple, tuple], keep: list[bool]) -> list:
    """Undo a level's split of its outputs into (has a dim for the axis, replicated over it)."""
    batched, replicated = iter(parts[0]), iter(parts[1])
    return [next(batched) if k else next(replicated).tensor for k in keep]


class _Opaque:
    """Carries an output that is replicated over a level's axis out of that level untouched.

    vmap's ``out_dims=None`` rejects any BatchedTensor, even one batched only at an outer level
    (varying over an outer axis, replicated over this one).  Such a tensor is valid outside this
    level, so it leaves as an opaque leaf instead of being expanded and sliced again.
    """

    __slots__ = ("tensor",)

    def __init__(self, tensor: Tensor):
        self.tensor = tensor


# Error checking and messages ---------------------------------------------------------------
