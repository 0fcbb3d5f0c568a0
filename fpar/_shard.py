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

from ._collectives import frames
from ._compile import TOO_OLD, WHOLE_STEP, graph_break, opaque, signature_key, untraced
from ._errors import SpecError
from ._local.shard import LocalCall
from ._mesh import Mesh
from ._spec import PartitionSpec, check_spec
from ._tree import broadcast_prefix, describe, keystr, tree_flatten_with_path, tree_map

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
            raise ValueError(
                f"fpar.shard({fname}): bucket_mb must be a positive number of megabytes, got {bucket_mb!r}."
            )
        real = DistShard(f, fname, mesh, in_specs, out_specs, bool(check_rep), _prefix, float(bucket_mb))

    kw_real: dict = {}  # real mesh, keyword calls: (number of args, keyword specs) -> its DistShard

    def real_call(args: tuple, kwargs: dict, *, make: bool):
        """The real-mesh DistShard of a call and its positional arguments (keywords as one more).

        With ``make=False`` the DistShard is None for a keyword signature never called eagerly.
        """
        if not kwargs:
            return real, args
        g, specs = _with_kwargs(f, fname, in_specs, args, kwargs)
        args = (*args, kwargs)
        key = (len(args), repr(specs[-1]))
        if make and key not in kw_real:
            kw_real[key] = DistShard(
                g, fname, mesh, specs, out_specs, bool(check_rep), _prefix, float(bucket_mb)
            )
        return kw_real.get(key), args

    local_plans: dict = {}  # in-process: signature_key -> the LocalPlan its eager call checked

    def local_call(args: tuple, kwargs: dict) -> tuple:
        """In-process: the positional function, its in_specs and arguments (keywords as one more)."""
        if not kwargs:
            return f, in_specs, args
        g, specs = _with_kwargs(f, fname, in_specs, args, kwargs)
        return g, specs, (*args, kwargs)

    @functools.wraps(f)
    def sharded(*args: Any, **kwargs: Any) -> Any:
        if real is not None and frames() and frames()[-1].token is not None:
            raise NotImplementedError(
                f"fpar.shard({fname}) was called inside another fpar.shard "
                f"({frames()[-1].fname}); nested shard is not supported. Call the inner per-device "
                f"function directly: it already runs per device."
            )
        if real is not None:
            dist_shard, args = real_call(args, kwargs, make=True)
            return dist_shard(args)
        g, specs, call_args = local_call(args, kwargs)
        call = LocalCall(g, fname, mesh, specs, out_specs, bool(check_rep), _prefix)
        out = call.run(call_args)
        local_plans[signature_key(call_args)] = call.plan  # checked: a compiled step may trace it
        return out

    eager_call = opaque(sharded)  # under torch.compile: an eager graph break (see _compile.py)
    too_old = graph_break(sharded, TOO_OLD.format(fname=fname))

    def entry(trace: Callable) -> Callable:
        """The sharded function: eager outside ``torch.compile``; under it ``trace(args, kwargs)``."""

        @functools.wraps(f)
        def sharded_entry(*args: Any, **kwargs: Any) -> Any:
            # Dynamo inlines this: a call whose signature an eager call planned (real mesh) or
            # checked (in-process) is traced whole; otherwise a graph break that runs it eagerly
            if not torch.compiler.is_compiling():
                return eager_call(*args, **kwargs)
            if not WHOLE_STEP:
                return too_old(*args, **kwargs)
            return trace(args, kwargs)

        def compiled_entry(*args: Any, **kwargs: Any) -> Any:
            return sharded_entry(*args, **kwargs)

        # ``torch.compile(fpar.shard(f, ...))`` compiles what ``innermost_fn`` finds here: a frame
        # of its own that calls the entry, so the call is traced whole as from a step.  The entry's
        # own frame is never compiled: called eagerly under a torch.func transform inside a
        # compiled region, Dynamo would try, fail (pytorch#128711) and mark its code skipped for
        # good, so that no later compile could start at it.
        sharded_entry._torchdynamo_orig_callable = compiled_entry
        sharded_entry._torchdynamo_wrapper_id = id(sharded_entry)
        return untraced(sharded_entry)

    if real is None:
        from ._local.compiled import UNCHECKED
        from ._local.compiled import compiled_call as compiled_local

        unchecked = graph_break(sharded, UNCHECKED.format(fname=fname))

        def trace_local(args: tuple, kwargs: dict) -> Any:  # ``_local/compiled.py``
            g, _, call_args = local_call(args, kwargs)
            plan = local_plans.get(signature_key(call_args))
            if plan is None:  # the eager call checks it; Dynamo recompiles at the next call
                return unchecked(*args, **kwargs)
            return compiled_local(g, fname, mesh, plan, call_args)

        return entry(trace_local)
    from ._dist.compiled import EXACT_COUNTS, NOT_FAST, UNPLANNED, compiled_call

    unplanned = graph_break(sharded, UNPLANNED.format(fname=fname))
    not_fast = graph_break(sharded, NOT_FAST.format(fname=fname))
    exact_counts = graph_break(sharded, EXACT_COUNTS.format(fname=fname))

    def trace_real(args: tuple, kwargs: dict) -> Any:  # ``_dist/compiled.py``
        shard_, call_args = real_call(args, kwargs, make=False)
        plan = None if shard_ is None else shard_.compiled_plans.get(signature_key(call_args))
        if plan is None or not plan.fast:  # unplanned: the eager call plans it, and Dynamo
            # recompiles at the next call (its guards on compiled_plans)
            return (unplanned if plan is None else not_fast)(*args, **kwargs)
        if any(kind == "all_to_all_v" for kind, _, _ in plan.coll):  # counts as data: no static graph
            return exact_counts(*args, **kwargs)
        return compiled_call(shard_, plan, call_args)

    return entry(trace_real)


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
