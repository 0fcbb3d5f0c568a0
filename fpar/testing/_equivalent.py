"""``assert_equivalent``: a sharded function computes its unsharded reference, values and gradients.

How a failure is located.  The sharded function is run once more with ``check_rep=False`` and
every output given one extra leading dim split over the mesh axes its out_spec leaves out, so the
result holds *every device's copy* of every block.  Each device's block is then compared with the
same block of the reference output, and only the devices whose block differs are named.  A broken
replication promise (e.g. a missing ``psum`` under ``out_specs=P()``) therefore shows up as copies
that differ from the reference on some devices: an error about the value, not a
``ReplicationError``.  Gradients are blocks of the inputs, located by the in_specs.

On a real mesh (``mesh.backend == "dist"``) every process passes the same global inputs; they are
placed with ``fpar.device_put`` and the outputs and gradients brought back with ``fpar.gather``,
so every process checks the same global values.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import torch

from .._errors import ReplicationError
from .._global import device_put, gather
from .._mesh import Mesh
from .._shard import shard
from .._spec import PartitionSpec
from .._tree import broadcast_prefix, keystr, tree_flatten_with_path, tree_unflatten

__all__ = ["assert_equivalent", "default_tolerance"]

Tensor = torch.Tensor

_TOLERANCES = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2e-2, 1e-2),
    torch.float16: (2e-3, 1e-3),
    torch.complex128: (1e-7, 1e-7),
    torch.complex64: (1e-5, 1e-5),
}
_MAX_NAMED = 8  # differing blocks listed by coordinate before "and N more"


def default_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """``(rtol, atol)`` used by :func:`assert_equivalent` for ``dtype`` when none is given.

    float64 1e-7/1e-7, float32 1e-5/1e-5, bfloat16 2e-2/1e-2, float16 2e-3/1e-3; integer and
    bool values must be equal.  An element passes when ``|got - want| <= atol + rtol * |want|``.
    """
    return _TOLERANCES.get(dtype, (0.0, 0.0))


def assert_equivalent(
    reference: Callable,
    fn: Callable,
    mesh: Mesh,
    in_specs: Any,
    out_specs: Any,
    *args: Any,
    grad: bool = True,
    rtol: float | None = None,
    atol: float | None = None,
    seed: int = 0,
) -> None:
    """Assert ``fpar.shard(fn, mesh, in_specs, out_specs)(*args) == reference(*args)``, and the gradients.

    ``reference`` is the plain (unsharded) function of the global tensors; ``fn`` the per-device
    function.  Outputs must have the same pytree structure, shapes and dtypes, and values within
    the tolerance.  With ``grad=True`` the vector-Jacobian products for one seeded random
    cotangent (``seed``) must also agree, with respect to every floating-point tensor argument
    that has a spec.

    Args:
      reference: the unsharded function, ``reference(*args)``.
      fn: the per-device function given to ``fpar.shard``.
      mesh: an in-process or real mesh.  On a real mesh call this on every process with the same
        global ``args``: the kit places them (``fpar.device_put``) and gathers the results.
      in_specs: as for ``fpar.shard`` (``None`` passes an argument through untouched).
      out_specs: as for ``fpar.shard``.
      *args: global arguments.
      grad: also compare gradients.
      rtol: relative tolerance; default by dtype (:func:`default_tolerance`).
      atol: absolute tolerance; default by dtype.
      seed: seed of the random cotangent.

    Raises:
      AssertionError: naming value or gradient, the leaf's pytree path, the max absolute and
        relative error, and the mesh coordinates (``tensor=1``) of only the blocks that differ.
        A broken replication promise is reported the same way, about the value.

    Example:
      >>> def row_parallel(x, w):                 # x: P(None, "tensor"), w: P("tensor", None)
      ...     return fpar.psum(x @ w, "tensor")
      >>> fpar.testing.assert_equivalent(
      ...     torch.matmul, row_parallel, mesh, (P(None, "tensor"), P("tensor")), P(), x, w)
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"fpar.testing.assert_equivalent: mesh must be a fpar.Mesh, got {mesh!r}.")
    name = getattr(fn, "__name__", None) or type(fn).__name__
    tol = (rtol, atol)
    arg_paths, arg_leaves, arg_def = tree_flatten_with_path(args)
    arg_specs = _prefix(in_specs, args, "in_specs", "the arguments")

    # The reference, and where to put the output blocks.
    want = reference(*args)
    out_paths, want_leaves, out_def = tree_flatten_with_path(want)
    out_leaf_specs = _prefix(out_specs, want, "out_specs", "the reference's outputs")

    # Every device's copy of every output block.
    got_leaves = _every_copy(
        fn, name, mesh, in_specs, arg_specs, arg_leaves, arg_def, out_def, out_leaf_specs
    )
    for path, g, w, spec in zip(out_paths, got_leaves, want_leaves, out_leaf_specs):
        where = f"out{keystr(path)}"
        if spec is None:
            if not _same_static(g, w):
                raise AssertionError(f"value {where} of {name}: got {g!r}, the reference gives {w!r}.")
            continue
        _compare_copies("value", name, where, g, w, spec, mesh, tol)

    if not grad:
        with torch.no_grad():  # fpar.shard's own checks (the replication promise) still apply
            _sharded(fn, name, mesh, in_specs, out_specs)(*_place(mesh, arg_leaves, arg_specs, arg_def))
        return
    _compare_grads(
        reference, fn, name, mesh, in_specs, out_specs, arg_paths, arg_leaves, arg_specs, arg_def, seed, tol
    )


# Values -------------------------------------------------------------------------------------


def _every_copy(fn, name, mesh, in_specs, arg_specs, arg_leaves, arg_def, out_def, out_leaf_specs) -> list:
    """Run ``fn`` sharded, returning every device's copy of each tensor output.

    Each tensor output comes back as ``(copies, *global)``: one copy per combination of the mesh
    axes its out_spec leaves out (the block at coordinate 0 is only one of them).
    """
    wide_specs = []
    for spec in out_leaf_specs:
        if spec is None:
            wide_specs.append(None)
            continue
        left_out = tuple(a for a in mesh.axis_names if a not in spec.axes())
        wide_specs.append(PartitionSpec(left_out if left_out else None, *spec))

    def every_copy(*fargs):
        out = fn(*fargs)
        paths, leaves, treedef = tree_flatten_with_path(out)
        if treedef != out_def:
            raise AssertionError(
                f"value of {name}: the sharded function returns a tree of structure {treedef}, "
                f"the reference {out_def}."
            )
        return [
            leaf if spec is None or not isinstance(leaf, Tensor) else leaf.unsqueeze(0)
            for leaf, spec in zip(leaves, out_leaf_specs)
        ]

    every_copy.__name__ = name
    blocks = _place(mesh, arg_leaves, arg_specs, arg_def)
    with torch.no_grad():
        out = shard(every_copy, mesh, in_specs, wide_specs, check_rep=False)(*blocks)
        return _collect(mesh, out, wide_specs)


def _compare_copies(kind, name, where, got, want, spec, mesh, tol) -> None:
    if not isinstance(got, Tensor) or not isinstance(want, Tensor):
        raise AssertionError(
            f"{kind} {where} of {name}: got a {type(got).__name__}, want a {type(want).__name__}."
        )
    _check_meta(kind, name, where, got[0], want)
    entries = _entries(spec, want.dim())
    left_out = [a for a in mesh.axis_names if a not in spec.axes()]
    rtol, atol = _tol(want.dtype, tol)
    bad, worst_abs, worst_rel = [], 0.0, 0.0
    for coord in _coords(mesh):
        copy = got[_combined(coord, mesh, left_out)]
        g, w = _block(copy, entries, coord, mesh), _block(want, entries, coord, mesh)
        ok, abs_err, rel_err = _close(g, w, rtol, atol)
        if not ok:
            bad.append(coord)
            worst_abs, worst_rel = max(worst_abs, abs_err), max(worst_rel, rel_err)
    if not bad:
        return
    message = (
        f"{kind} {where} of {name} differs from the reference: max abs error {worst_abs:.3g}, "
        f"max rel error {worst_rel:.3g} (rtol={rtol:g}, atol={atol:g}), "
        f"{_located(bad, mesh.axis_names, mesh.size, 'device')}."
    )
    if left_out and not _copies_agree(got):
        message += (
            f" Its out_spec {spec} promises the same value on every device along "
            f"{tuple(left_out)}, but the copies differ: a missing psum/pmean over those axes?"
        )
    raise AssertionError(message)


def _copies_agree(got: Tensor) -> bool:
    """Whether every copy of an output (dim 0) is the same."""
    return all(torch.equal(got[k], got[0]) for k in range(1, got.shape[0]))


# Gradients ----------------------------------------------------------------------------------


def _compare_grads(
    reference, fn, name, mesh, in_specs, out_specs, arg_paths, arg_leaves, arg_specs, arg_def, seed, tol
):
    wrt = [
        i
        for i, (leaf, spec) in enumerate(zip(arg_leaves, arg_specs))
        if spec is not None and isinstance(leaf, Tensor) and (leaf.is_floating_point() or leaf.is_complex())
    ]
    if not wrt:
        return

    # The reference: d<reference(args), ct>/d args.
    leaves = list(arg_leaves)
    for i in wrt:
        leaves[i] = arg_leaves[i].detach().requires_grad_()
    want_out = reference(*tree_unflatten(arg_def, leaves))
    cts = _cotangents(want_out, seed)
    want_grads = _vjp(want_out, cts, [leaves[i] for i in wrt])

    # The sharded function, on blocks (a real mesh) or the global tensors (in-process).
    blocks = list(_flat_place(mesh, arg_leaves, arg_specs))
    for i in wrt:
        blocks[i] = blocks[i].detach().requires_grad_()
    got_out = _sharded(fn, name, mesh, in_specs, out_specs)(*tree_unflatten(arg_def, blocks))
    got_out = _gather_like(mesh, got_out, out_specs)
    got_grads = _vjp(got_out, _cotangents(got_out, seed, like=cts), [blocks[i] for i in wrt])
    got_grads = [
        g if mesh.backend != "dist" else gather(g, mesh, arg_specs[i]) for i, g in zip(wrt, got_grads)
    ]
    for i, g, w in zip(wrt, got_grads, want_grads):
        _compare_grad(name, f"args{keystr(arg_paths[i])}", g, w, arg_specs[i], mesh, tol)


def _sharded(fn, name, mesh, in_specs, out_specs):
    """``fpar.shard(fn, ...)`` as the user calls it; a ReplicationError becomes an AssertionError.

    Every device's copy was already compared with the reference, so this error means the copies
    agree but fpar cannot prove it (e.g. an ``all_gather`` returned under ``P()``).
    """
    sharded = shard(fn, mesh, in_specs, out_specs)

    def run(*args):
        try:
            return sharded(*args)
        except ReplicationError as e:
            raise AssertionError(
                f"value of {name}: every device's copy equals the reference, but fpar cannot prove "
                f"the replication its out_specs promise, so fpar.shard raises: {e}"
            ) from None

    return run


def _compare_grad(name, where, got, want, spec, mesh, tol) -> None:
    _check_meta("gradient", name, where, got, want)
    entries = _entries(spec, want.dim())
    named = [a for a in mesh.axis_names if a in spec.axes()]
    rtol, atol = _tol(want.dtype, tol)
    bad, worst_abs, worst_rel = [], 0.0, 0.0
    for coord in _coords(mesh, named):
        ok, abs_err, rel_err = _close(
            _block(got, entries, coord, mesh), _block(want, entries, coord, mesh), rtol, atol
        )
        if not ok:
            bad.append(coord)
            worst_abs, worst_rel = max(worst_abs, abs_err), max(worst_rel, rel_err)
    if not bad:
        return
    blocks = math.prod(mesh.shape[a] for a in named)
    located = (
        _located(bad, named, blocks, "block")
        if named
        else f"in the whole tensor (its in_spec {spec} puts the same copy on every device)"
    )
    raise AssertionError(
        f"gradient w.r.t. {where} of {name} differs from the reference: max abs error "
        f"{worst_abs:.3g}, max rel error {worst_rel:.3g} (rtol={rtol:g}, atol={atol:g}), {located}."
    )


def _cotangents(out, seed: int, like=None) -> list:
    """One seeded random cotangent per floating output leaf (``like``: reuse these, same order)."""
    if like is not None:
        return like
    gen = torch.Generator().manual_seed(seed)
    cts = []
    for leaf in tree_flatten_with_path(out)[1]:
        if isinstance(leaf, Tensor) and (leaf.is_floating_point() or leaf.is_complex()):
            ct = torch.randn(leaf.shape, generator=gen, dtype=torch.float64)
            cts.append(ct.to(dtype=leaf.dtype, device=leaf.device))
        else:
            cts.append(None)
    return cts


def _vjp(out, cts: list, inputs: list) -> list:
    outs = [o for o, c in zip(tree_flatten_with_path(out)[1], cts) if c is not None]
    cts = [c for c in cts if c is not None]
    live = [(o, c) for o, c in zip(outs, cts) if o.requires_grad]
    if not live:
        return [torch.zeros_like(x) for x in inputs]
    grads = torch.autograd.grad([o for o, _ in live], inputs, [c for _, c in live], allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for g, x in zip(grads, inputs)]


# Placing and gathering ----------------------------------------------------------------------


def _flat_place(mesh: Mesh, leaves: list, specs: list) -> list:
    if mesh.backend != "dist":
        return list(leaves)
    return [leaf if spec is None else device_put(leaf, mesh, spec) for leaf, spec in zip(leaves, specs)]


def _place(mesh, leaves, specs, treedef) -> tuple:
    return tree_unflatten(treedef, _flat_place(mesh, leaves, specs))


def _collect(mesh: Mesh, out: list, specs: list) -> list:
    if mesh.backend != "dist":
        return out
    return [o if s is None else gather(o, mesh, s) for o, s in zip(out, specs)]


def _gather_like(mesh: Mesh, out: Any, out_specs: Any) -> Any:
    if mesh.backend != "dist":
        return out
    paths, leaves, treedef = tree_flatten_with_path(out)
    specs = _prefix(out_specs, out, "out_specs", "the outputs")
    return tree_unflatten(treedef, [v if s is None else gather(v, mesh, s) for v, s in zip(leaves, specs)])


# Blocks, coordinates, closeness -------------------------------------------------------------


def _prefix(specs: Any, tree: Any, name: str, what: str) -> list:
    try:
        return broadcast_prefix(specs, tree, is_leaf=lambda s: s is None or isinstance(s, PartitionSpec))
    except ValueError:
        _, leaves, treedef = tree_flatten_with_path(tree)
        raise AssertionError(
            f"fpar.testing.assert_equivalent: {name} {specs!r} is not a pytree prefix of {what} "
            f"(structure {treedef})."
        ) from None


def _entries(spec: PartitionSpec, rank: int) -> list[tuple[str, ...]]:
    entries = list(spec.normalized())
    return entries + [()] * (rank - len(entries))


def _coords(mesh: Mesh, axes=None) -> list[dict[str, int]]:
    axes = list(mesh.axis_names) if axes is None else list(axes)
    return [dict(zip(axes, c)) for c in itertools.product(*(range(mesh.shape[a]) for a in axes))]


def _combined(coord: dict[str, int], mesh: Mesh, axes) -> int:
    index = 0
    for a in axes:
        index = index * mesh.shape[a] + coord[a]
    return index


def _block(x: Tensor, entries, coord: dict[str, int], mesh: Mesh) -> Tensor:
    for d, entry in enumerate(entries):
        if entry:
            n = math.prod(mesh.shape[a] for a in entry)
            size = x.shape[d] // n
            x = x.narrow(d, _combined(coord, mesh, entry) * size, size)
    return x


def _tol(dtype: torch.dtype, tol) -> tuple[float, float]:
    rtol, atol = default_tolerance(dtype)
    return (rtol if tol[0] is None else tol[0]), (atol if tol[1] is None else tol[1])


def _close(got: Tensor, want: Tensor, rtol: float, atol: float) -> tuple[bool, float, float]:
    if got.numel() == 0:
        return True, 0.0, 0.0
    if not (want.is_floating_point() or want.is_complex()):
        diff = (
            (got.to(torch.int64) - want.to(torch.int64)).abs().double()
            if want.dtype != torch.bool
            else (got != want).double()
        )
        ref = want.to(torch.float64).abs()
    else:
        g, w = got.detach().to(torch.complex128 if want.is_complex() else torch.float64), want.detach()
        w = w.to(g.dtype)
        both_nan = torch.isnan(g) & torch.isnan(w)
        diff = torch.where(both_nan, 0.0, (g - w).abs())
        diff = torch.nan_to_num(diff, nan=math.inf)
        ref = w.abs()
    bad = diff > atol + rtol * ref
    if not bool(bad.any()):
        return True, 0.0, 0.0
    rel = diff / ref
    rel = torch.where(ref == 0, torch.where(diff == 0, 0.0, math.inf), rel)
    return False, float(diff.max()), float(rel.max())


def _check_meta(kind: str, name: str, where: str, got: Tensor, want: Tensor) -> None:
    if tuple(got.shape) != tuple(want.shape):
        raise AssertionError(
            f"{kind} {where} of {name}: shape {tuple(got.shape)}, the reference gives {tuple(want.shape)}."
        )
    if got.dtype != want.dtype:
        raise AssertionError(
            f"{kind} {where} of {name}: dtype {got.dtype}, the reference gives {want.dtype}."
        )


def _located(bad: list[dict], axes, total: int, what: str) -> str:
    def fmt(c):
        return ", ".join(f"{a}={c[a]}" for a in axes)

    shown = "; ".join(fmt(c) for c in bad[:_MAX_NAMED])
    more = f" and {len(bad) - _MAX_NAMED} more" if len(bad) > _MAX_NAMED else ""
    return f"in the {what}s at {shown}{more} ({len(bad)} of {total})"


def _same_static(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an object whose == raises or is ambiguous is not equal
        return a is b
