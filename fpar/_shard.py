"""``fpar.shard``: run a per-device function over a named mesh, like ``jax.shard_map``.

In-process, the per-device function runs under one ``torch.func.vmap`` level per mesh axis
(outermost = first mesh axis).  An input enters each level batched along the axis its spec
splits it over and unbatched (the same block for every device) along the others, so no block is
ever copied: the global tensor is only *viewed* with its split dims separated.  Why per-axis
levels rather than one flat device dim: (1) vmap then tracks which axes every value varies over
(JAX's varying-manual-axes types) for free, which gives the static replication check and JAX's
efficient transposes (an unbatched value is computed once, not once per device); (2) a
replicated operand stays unbatched, so e.g. ``x_BD @ w_DH`` with x split over 'data' and w over
'tensor' is one folded matmul rather than ``mesh.size`` small ones.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch._C._functorch import maybe_current_level

from . import _stats as stats
from ._collectives import Frame, batched_levels, frames
from ._compile import eager, opaque
from ._errors import ReplicationError, SpecError, replication_message
from ._mesh import Mesh
from ._mode import storage_of
from ._spec import PartitionSpec, check_spec
from ._tree import broadcast_prefix, describe, keystr, tree_flatten_with_path, tree_map, tree_unflatten

__all__ = ["shard"]

Tensor = torch.Tensor


# API ----------------------------------------------------------------------------------------


def shard(
    f: Callable, mesh: Mesh, in_specs: Any, out_specs: Any, *, check_rep: bool = True, bucket_mb: float = 25.0
) -> Callable:
    """Map a per-device function over a mesh: global tensors in, global tensors out.

    ``f`` sees each device's block of each argument (per ``in_specs``) and may call fpar's
    collectives over the mesh axes.  Its outputs are reassembled into global tensors per
    ``out_specs``.  Differentiating the result (``torch.func.grad``/``vjp``/``jvp``,
    ``.backward()``) gives exactly the derivative of the global function.

    Args:
      f: the per-device function.  Keyword arguments of the sharded function reach it as
        keyword arguments: tensors in them are replicated (every device sees the whole tensor, as
        if their spec were ``P()``) and other values passed through; pass a tensor positionally
        to give it a spec.
      mesh: the mesh, from ``fpar.make_mesh``.
      in_specs: a pytree prefix of the argument tuple whose leaves are ``fpar.P`` (how to split the
        tensors below it) or ``None`` (pass the argument through untouched, e.g. a Python object).
        Mesh axes a spec does not name mean the input is replicated along them.
      out_specs: a pytree prefix of ``f``'s output, of ``fpar.P``; ``None`` for non-tensor
        outputs.  Mesh axes a spec does not name are a promise that the output is the same on every
        device along them; one copy is returned.
      check_rep: check that promise statically (a value varies over an axis if it depends on an
        input split over it or on a collective that leaves it varying, and stops varying after
        psum/pmean/pmax/pmin over it).  With ``False`` the block at coordinate 0 is returned.
      bucket_mb: real mesh only: the gradient all-reduces of replicated inputs are grouped into
        buckets of at most this many megabytes, each launched asynchronously as soon as its
        gradients exist in the backward pass (as ``DistributedDataParallel``'s ``bucket_cap_mb``).

    Returns:
      The global function.  It raises ``fpar.SpecError``/``TypeError`` for bad specs or arguments,
      and ``fpar.ReplicationError`` for a broken replication promise, before any communication.

    Example:
      >>> mesh = fpar.make_mesh((2, 4), ("data", "tensor"))
      >>> def loss(w, x):                  # w: P(None, 'tensor'), x: P('data')
      ...     return fpar.pmean(fpar.psum((x @ w).sum(), "tensor"), "data")
      >>> fpar.shard(loss, mesh, (P(None, "tensor"), P("data")), P())(w, x)
    """
    fname = getattr(f, "__name__", None) or type(f).__name__
    if not callable(f):
        raise TypeError(f"fpar.shard: f must be callable, got {f!r}.")
    if not isinstance(mesh, Mesh):
        raise TypeError(f"fpar.shard({fname}): mesh must be a fpar.Mesh (from fpar.make_mesh), got {mesh!r}.")
    _check_spec_tree(fname, "in_specs", in_specs, mesh)
    _check_spec_tree(fname, "out_specs", out_specs, mesh)

    real = None
    if mesh.backend == "dist":
        from ._dist.shard import DistShard

        if not isinstance(bucket_mb, (int, float)) or isinstance(bucket_mb, bool) or not bucket_mb > 0:
            raise ValueError(f"fpar.shard({fname}): bucket_mb must be a positive number of megabytes, got {bucket_mb!r}.")
        real = DistShard(f, fname, mesh, in_specs, out_specs, bool(check_rep), _prefix, float(bucket_mb))

    kw_real: dict = {}  # real mesh, keyword calls: (number of args, keyword specs) -> plan

    @functools.wraps(f)
    def sharded(*args: Any, **kwargs: Any) -> Any:
        if real is not None and frames() and frames()[-1].token is not None:
            raise NotImplementedError(
                f"fpar.shard({fname}) was called inside another fpar.shard "
                f"({frames()[-1].fname}); nested shard is not supported. Call the inner per-device "
                f"function directly: it already runs per device."
            )
        if kwargs:
            g, specs = _with_kwargs(f, fname, in_specs, args, kwargs)
            args = (*args, kwargs)
            if real is None:
                return _Call(g, fname, mesh, specs, out_specs, bool(check_rep)).run(args)
            key = (len(args), repr(specs[-1]))
            if key not in kw_real:
                kw_real[key] = DistShard(g, fname, mesh, specs, out_specs, bool(check_rep), _prefix, float(bucket_mb))
            return kw_real[key](args)
        if real is not None:
            return real(args)
        call = _Call(f, fname, mesh, in_specs, out_specs, bool(check_rep))
        return call.run(args)

    return opaque(sharded)  # under torch.compile: an eager graph break (see _compile.py)


def _with_kwargs(f, fname, in_specs, args: tuple, kwargs: dict) -> tuple[Callable, tuple]:
    """A call with keyword arguments as a positional one: every tensor in them is replicated.

    As with a closed-over value in ``jax.shard_map``, each device sees the whole tensor (``P()``),
    the rest is static; split tensors are passed positionally, where ``in_specs`` gives their specs.
    The keyword tree travels as one extra positional argument whose spec is ``P()`` per tensor,
    ``None`` per other value.  Returns the positional function and its ``in_specs``.
    """
    _prefix(fname, "in_specs", in_specs, args, "the positional arguments")  # the usual error first
    arg_specs = tuple([in_specs] * len(args)) if _is_spec(in_specs) else tuple(in_specs)
    kw_specs = tree_map(lambda v: PartitionSpec() if isinstance(v, Tensor) else None, kwargs)

    def with_kwargs(*flat):
        return f(*flat[:-1], **flat[-1])

    with_kwargs.__name__ = fname
    return with_kwargs, (*arg_specs, kw_specs)


# The in-process run ---------------------------------------------------------------------------


class _Call:
    """One call of a sharded function: split the inputs, run the nest, assemble the outputs."""

    def __init__(self, f, fname, mesh, in_specs, out_specs, check_rep):
        self.f, self.fname, self.mesh = f, fname, mesh
        self.in_specs, self.out_specs, self.check_rep = in_specs, out_specs, check_rep
        self.axes = mesh.axis_names

    def run(self, args: tuple) -> Any:
        if frames() and frames()[-1].token is not None:
            raise NotImplementedError(
                f"fpar.shard({self.fname}) was called inside another fpar.shard "
                f"({frames()[-1].fname}); nested shard is not supported. Call the inner per-device "
                f"function directly: it already runs per device."
            )
        backend = _backend(self.mesh)
        paths, leaves, self.treedef = tree_flatten_with_path(args)
        specs = _prefix(self.fname, "in_specs", self.in_specs, args, "the arguments")
        self.static = {}
        self.inputs = {}  # in-process: the caller's storages, which in-place ops must not touch
        views, labels, checked = [], [], []
        for i, (path, leaf, spec) in enumerate(zip(paths, leaves, specs)):
            where = f"fpar.shard({self.fname}): args{keystr(path)}"
            if spec is None:
                self.static[i] = leaf
                continue
            if not isinstance(leaf, Tensor):
                raise TypeError(
                    f"{where} is a {type(leaf).__name__}, not a tensor, but its in_spec is {spec}. "
                    f"Pass a tensor, or give it the in_spec None to pass it through untouched."
                )
            backend.check_input(spec, leaf, where)
            view, label = backend.split(leaf, spec)
            views.append(view)
            labels.append(label)
            checked.append((where, spec, leaf))
            if backend.name == "local" and storage_of(leaf):
                self.inputs.setdefault(storage_of(leaf), f"args{keystr(path)}")
        self.tensor_slots = [i for i in range(len(leaves)) if i not in self.static]
        backend.before(self, checked)  # a real mesh agrees on shapes here, before any exchange
        return self._run(backend, views, labels)

    def _run(self, backend, views: list[Tensor], labels: list[list]) -> Any:
        from ._mode import ShardMode

        device = views[0].device if views else None
        token, index = backend.token_and_index(device)
        level_dims = []
        labels = [list(lab) for lab in labels]
        for i, a in enumerate(self.axes):
            dims = []
            for lab in labels:
                dims.append(lab.index(a) if a in lab else None)
                if a in lab:
                    lab.remove(a)
            level_dims.append((*dims, 0, *[0 if j == i else None for j in range(len(self.axes))]))
        frame = Frame(
            mesh=self.mesh,
            fname=self.fname,
            exchange=backend.exchange,
            backend=backend.name,
            inputs=self.inputs,
        )
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
        specs = _prefix(self.fname, "out_specs", self.out_specs, out, "the outputs")
        self.out_static, self.out_slots, self.out_specs_flat, self.present = {}, [], [], []
        self.replicated_named = []
        tensors = []
        for j, (path, leaf, spec) in enumerate(zip(paths, leaves, specs)):
            where = f"fpar.shard({self.fname}): out{keystr(path)}"
            if spec is None:
                if isinstance(leaf, Tensor):
                    raise TypeError(
                        f"{where} is a tensor but its out_spec is None; give it a fpar.P out_spec "
                        f"(None is for non-tensor outputs, which are returned as they are)."
                    )
                self.out_static[j] = leaf
                continue
            if not isinstance(leaf, Tensor):
                raise TypeError(
                    f"{where} is a {type(leaf).__name__}, not a tensor, but its out_spec is {spec}; "
                    f"return a tensor, or give it the out_spec None."
                )
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


def _backend(mesh: Mesh):
    from ._local import LocalBackend  # a real mesh runs _dist/shard.py instead

    return LocalBackend(mesh)


def _is_spec(s: Any) -> bool:
    return s is None or isinstance(s, PartitionSpec)


def _check_spec_tree(fname: str, name: str, specs: Any, mesh: Mesh) -> None:
    paths, leaves, _ = tree_flatten_with_path(specs)
    for path, s in zip(paths, leaves):
        where = f"fpar.shard({fname}): {name}{keystr(path)}"
        if s is None:
            continue
        if not isinstance(s, PartitionSpec):
            fix = f" Did you mean P({s!r})?" if isinstance(s, str) else ""
            raise TypeError(f"{where} is {s!r}, which must be a fpar.P (PartitionSpec) or None.{fix}")
        check_spec(s, None, mesh.shape, where=where)


def _prefix(fname: str, name: str, specs: Any, tree: Any, what: str) -> list:
    if name == "in_specs" and isinstance(specs, tuple) and len(specs) != len(tree):
        got = ", ".join(describe(a) for a in tree[:8]) + (", ..." if len(tree) > 8 else "")
        raise SpecError(
            f"fpar.shard({fname}): in_specs has {len(specs)} entries, but {fname} was called with "
            f"{len(tree)} positional argument{'' if len(tree) == 1 else 's'} ({got}). Give one spec "
            f"per argument, or a single P for all of them."
        )
    try:
        return broadcast_prefix(specs, tree, is_leaf=_is_spec)
    except ValueError as e:
        raise SpecError(
            f"fpar.shard({fname}): {name} is not a pytree prefix of {what}: {e}. Give {name} the "
            f"structure of {what}, down to where one spec covers a whole subtree; a single P "
            f"applies to everything."
        ) from None
