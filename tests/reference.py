"""An independent reference for ``fpar.shard``: a plain per-device loop over mesh coordinates.

This file does not import fpar. It mirrors JAX's ``shmap_reference`` (``tests/shard_map_test.py``):

* A mesh is an ordered ``{axis_name: size}`` dict. Devices are the coordinates
  ``itertools.product(*(range(s) for s in sizes))``, in mesh order.
* Specs are any iterable of entries (``fpar.P`` or :class:`Spec` here): ``None``, an axis name, or a
  tuple of names (major-to-minor in the written order). Missing trailing entries mean ``None``;
  mesh axes a spec does not mention are replicated (inputs) or "take coordinate 0" (outputs).
* A per-device program is written against a tiny collectives API, ``prog(c, *blocks)``, where ``c``
  offers ``psum, pmean, pmax, pmin, all_gather, psum_scatter, ppermute, all_to_all, axis_index,
  axis_size`` with fpar's signatures. Under fpar, ``c`` forwards to ``fpar.*`` (see ``harness.py``);
  here ``c`` is a :class:`_RefCollectives` bound to one device.

How the lockstep run works (chosen because it is obviously correct, not because it is fast): the
program is SPMD, so every device calls the same sequence of collectives. The reference runs every
device's program from the start, in passes. In pass ``k`` each device runs until its ``k``-th
collective, which records its input and stops the run (an exception). With all ``k``-th inputs in
hand the ``k``-th results are computed for every device by explicit loops over coordinates
(``_COLLECTIVES`` below) and stored; the next pass replays collectives ``0..k`` from the store. A
pass in which no device stops is the final one, and its per-device outputs are assembled.

Everything is ordinary torch (slicing with ``narrow``, ``cat``/``stack``/``sum``/``amax``), so the
reference global function is differentiable by ``torch.func.grad``/``vjp``/``jvp`` and
``.backward()``; ``amax``/``amin`` split the gradient evenly among ties, which is the contract for
``pmax``/``pmin``. The graph is redundant (each pass recomputes the prefix) but its value and
derivatives are those of the global function.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch

__all__ = ["Spec", "shard_reference", "spec_entries", "entry_names", "block_shape"]

_TREE = {"none_is_leaf": True, "namespace": ""}


class Spec(tuple):
    """A stand-in PartitionSpec for using this reference without fpar (a tuple of entries)."""

    def __new__(cls, *entries):
        return super().__new__(cls, entries)

    def __repr__(self):
        return "Spec" + super().__repr__()


def _is_spec_leaf(s: Any) -> bool:
    # fpar.P may or may not subclass tuple; recognise it by its module so this file never imports fpar.
    return s is None or isinstance(s, Spec) or type(s).__module__.split(".")[0] == "fpar"


# ----------------------------------------------------------------------------------------------
# Specs and blocks


def entry_names(entry: Any) -> tuple[str, ...]:
    """Return the mesh axis names of one spec entry, major-to-minor."""
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)


def spec_entries(spec: Any, rank: int) -> list[tuple[str, ...]]:
    """Return ``rank`` tuples of axis names, one per tensor dim (missing trailing entries: none)."""
    entries = [entry_names(e) for e in tuple(spec)]
    if len(entries) > rank:
        raise ValueError(f"reference: spec {spec!r} longer than rank {rank}")
    return entries + [()] * (rank - len(entries))


def _combined(coord: dict[str, int], mesh: dict[str, int], names: Sequence[str]) -> int:
    """Combined index over ``names``: major-to-minor in the order written."""
    idx = 0
    for n in names:
        idx = idx * mesh[n] + coord[n]
    return idx


def _nblocks(mesh: dict[str, int], names: Sequence[str]) -> int:
    return math.prod(mesh[n] for n in names)


def block_shape(shape: Sequence[int], spec: Any, mesh: dict[str, int]) -> tuple[int, ...]:
    """The per-device block shape of a global ``shape`` under ``spec``."""
    ents = spec_entries(spec, len(shape))
    out = []
    for d, names in enumerate(ents):
        n = _nblocks(mesh, names)
        if shape[d] % n:
            raise ValueError(f"reference: dim {d} of size {shape[d]} not divisible by {n}")
        out.append(shape[d] // n)
    return tuple(out)


def _slice_block(x: torch.Tensor, spec: Any, mesh: dict[str, int], coord: dict[str, int]) -> torch.Tensor:
    bshape = block_shape(x.shape, spec, mesh)
    for d, names in enumerate(spec_entries(spec, x.dim())):
        if names:
            start = _combined(coord, mesh, names) * bshape[d]
            x = x.narrow(d, start, bshape[d])
    return x


def _assemble(
    blocks: dict[tuple, torch.Tensor], spec: Any, mesh: dict[str, int], coords, check_rep: bool, where: str
):
    """Build one global output from per-device blocks (pure: nested ``cat``, no in-place writes)."""
    first = blocks[coords[0]]
    rank = first.dim()
    ents = spec_entries(spec, rank)
    mentioned = {n for names in ents for n in names}
    unmentioned = [a for a in mesh if a not in mentioned]
    grid: dict[tuple[int, ...], torch.Tensor] = {}
    for key in coords:
        coord = dict(zip(mesh, key))
        bidx = tuple(_combined(coord, mesh, names) for names in ents)
        if all(coord[a] == 0 for a in unmentioned):
            grid[bidx] = blocks[key]
        elif check_rep:
            # The test program promised replication; make sure the reference agrees.
            ref = blocks[tuple(0 if a in unmentioned else coord[a] for a in mesh)]
            if not torch.allclose(blocks[key].detach(), ref.detach(), rtol=1e-9, atol=1e-9, equal_nan=True):
                raise AssertionError(f"reference: {where} is not replicated over {unmentioned} at {coord}")
    counts = [_nblocks(mesh, names) for names in ents]

    def build(prefix: tuple[int, ...]) -> torch.Tensor:
        d = len(prefix)
        if d == rank:
            return grid[prefix]
        return torch.cat([build(prefix + (i,)) for i in range(counts[d])], dim=d)

    return build(())


# ----------------------------------------------------------------------------------------------
# Collectives by explicit loops over coordinates. Each takes {coord_key: leaf} for all devices and
# returns {coord_key: result}.


class _Groups:
    """Group structure of a (combined) axis: member ``k`` of the group containing a device."""

    def __init__(self, mesh: dict[str, int], axis_name: Any):
        self.mesh = mesh
        self.names = entry_names(axis_name)
        for n in self.names:
            if n not in mesh:
                raise NameError(f"reference: unknown axis {n!r}")
        self.size = _nblocks(mesh, self.names)

    def index(self, key: tuple) -> int:
        return _combined(dict(zip(self.mesh, key)), self.mesh, self.names)

    def member(self, key: tuple, k: int) -> tuple:
        coord = dict(zip(self.mesh, key))
        for n in reversed(self.names):
            coord[n] = k % self.mesh[n]
            k //= self.mesh[n]
        return tuple(coord[a] for a in self.mesh)

    def gather(self, vals: dict, key: tuple) -> list:
        return [vals[self.member(key, k)] for k in range(self.size)]


_LOW = (torch.float16, torch.bfloat16)


def _accumulator(x: torch.Tensor) -> torch.dtype:
    """The dtype a sum over devices is carried in (fpar's documented rule): float32 for fp16/bf16,
    int32 for bool (psum of bools counts them, as in JAX), the input dtype otherwise."""
    if x.dtype in _LOW:
        return torch.float32
    if x.dtype == torch.bool:
        return torch.int32
    return x.dtype


def _total(g: _Groups, vals, key) -> torch.Tensor:
    """The sum over the group, in the accumulator dtype, added one device at a time."""
    xs = g.gather(vals, key)
    total = xs[0].to(_accumulator(xs[0]))
    for x in xs[1:]:
        total = total + x.to(total.dtype)
    return total


def _psum(g: _Groups, vals, key):
    x = vals[key]
    total = _total(g, vals, key)
    return total.to(x.dtype) if x.dtype in _LOW else total


def _pmean(g, vals, key):
    x = vals[key]
    if x.dtype in _LOW:  # each block divided in float32 first, summed, rounded once: no overflow
        return _total(g, {k: v.to(torch.float32) / g.size for k, v in vals.items()}, key).to(x.dtype)
    return _total(g, vals, key) / g.size


def _pmax(g, vals, key):
    return torch.stack(g.gather(vals, key)).amax(0)


def _pmin(g, vals, key):
    return torch.stack(g.gather(vals, key)).amin(0)


def _all_gather(g, vals, key, *, axis=0, tiled=False):
    xs = g.gather(vals, key)
    return torch.cat(xs, dim=axis) if tiled else torch.stack(xs, dim=axis)


def _psum_scatter(g, vals, key, *, scatter_dimension=0, tiled=False):
    total = _psum(g, vals, key)
    idx = g.index(key)
    if tiled:
        chunk = total.shape[scatter_dimension] // g.size
        return total.narrow(scatter_dimension, idx * chunk, chunk)
    assert total.shape[scatter_dimension] == g.size
    return total.select(scatter_dimension, idx)


def _ppermute(g, vals, key, *, perm):
    idx = g.index(key)
    srcs = [s for s, d in perm if d == idx]
    assert len(srcs) <= 1
    if not srcs:
        return torch.zeros_like(vals[key])
    return vals[g.member(key, srcs[0])]


def _all_to_all(g, vals, key, *, split_axis, concat_axis, tiled=False):
    idx = g.index(key)
    received = []
    for x in g.gather(vals, key):  # ordered by source k
        if tiled:
            chunk = x.shape[split_axis] // g.size
            received.append(x.narrow(split_axis, idx * chunk, chunk))
        else:
            assert x.shape[split_axis] == g.size
            received.append(x.select(split_axis, idx))
    return torch.cat(received, dim=concat_axis) if tiled else torch.stack(received, dim=concat_axis)


_COLLECTIVES: dict[str, Callable] = {
    "psum": _psum,
    "pmean": _pmean,
    "pmax": _pmax,
    "pmin": _pmin,
    "all_gather": _all_gather,
    "psum_scatter": _psum_scatter,
    "ppermute": _ppermute,
    "all_to_all": _all_to_all,
}


# ----------------------------------------------------------------------------------------------
# The lockstep runner


class _Stop(Exception):
    """Raised by a device's program at the first collective whose result is not known yet."""


class _Run:
    def __init__(self, mesh: dict[str, int]):
        self.mesh = mesh
        self.results: list[tuple[str, dict]] = []  # k-th collective: (kind, {coord_key: result tree})
        self.pending: dict[tuple, tuple] = {}


class _RefCollectives:
    """The ``c`` a per-device program sees under the reference: bound to one device."""

    def __init__(self, run: _Run, key: tuple):
        self._run = run
        self._key = key
        self._coord = dict(zip(run.mesh, key))
        self._k = 0

    # -- local (no communication)
    def axis_index(self, axis_name):
        g = _Groups(self._run.mesh, axis_name)
        return torch.tensor(g.index(self._key), dtype=torch.int64)

    def axis_size(self, axis_name) -> int:
        return _Groups(self._run.mesh, axis_name).size

    # -- communicating
    def _collective(self, kind: str, x, axis_name, **kw):
        k = self._k
        self._k += 1
        if k < len(self._run.results):
            done_kind, per_device = self._run.results[k]
            if done_kind != kind:
                raise AssertionError(f"reference: program is not SPMD ({kind} vs {done_kind})")
            return per_device[self._key]
        self._run.pending[self._key] = (kind, x, axis_name, kw)
        raise _Stop

    def _reduce(self, kind, x, axis_name):
        if isinstance(x, (int, float)) and not isinstance(x, bool):
            # Python numbers: every device holds the same constant.
            n = self.axis_size(axis_name)
            return {"psum": x * n, "pmean": x, "pmax": x, "pmin": x}[kind]
        return self._collective(kind, x, axis_name)

    def psum(self, x, axis_name):
        return self._reduce("psum", x, axis_name)

    def pmean(self, x, axis_name):
        return self._reduce("pmean", x, axis_name)

    def pmax(self, x, axis_name):
        return self._reduce("pmax", x, axis_name)

    def pmin(self, x, axis_name):
        return self._reduce("pmin", x, axis_name)

    def all_gather(self, x, axis_name, *, axis=0, tiled=False):
        return self._collective("all_gather", x, axis_name, axis=axis, tiled=tiled)

    def psum_scatter(self, x, axis_name, *, scatter_dimension=0, tiled=False):
        return self._collective(
            "psum_scatter", x, axis_name, scatter_dimension=scatter_dimension, tiled=tiled
        )

    def ppermute(self, x, axis_name, perm):
        return self._collective("ppermute", x, axis_name, perm=[tuple(p) for p in perm])

    def all_to_all(self, x, axis_name, split_axis, concat_axis, *, tiled=False):
        return self._collective(
            "all_to_all", x, axis_name, split_axis=split_axis, concat_axis=concat_axis, tiled=tiled
        )


def _resolve(run: _Run, keys: list[tuple]) -> None:
    """Compute the pending collective for every device and append it to ``run.results``."""
    kinds = {run.pending[k][0] for k in keys}
    axes = {repr(run.pending[k][2]) for k in keys}
    if len(run.pending) != len(keys) or len(kinds) != 1 or len(axes) != 1:
        raise AssertionError("reference: devices disagree on the next collective")
    kind, _, axis_name, kw = run.pending[keys[0]]
    g = _Groups(run.mesh, axis_name)
    trees = {k: run.pending[k][1] for k in keys}
    leaves0, treedef = optree.tree_flatten(trees[keys[0]], **_TREE)
    flat = {k: optree.tree_flatten(trees[k], **_TREE)[0] for k in keys}
    fn = _COLLECTIVES[kind]
    out = {}
    for key in keys:
        res = []
        for i in range(len(leaves0)):
            vals = {k: flat[k][i] for k in keys}
            res.append(fn(g, vals, key, **kw))
        out[key] = optree.tree_unflatten(treedef, res)
    run.results.append((kind, out))
    run.pending = {}


def _broadcast_specs(specs: Any, tree: Any, what: str) -> tuple[list, Any]:
    leaves, treedef = optree.tree_flatten(tree, **_TREE)
    try:
        per_leaf = optree.broadcast_prefix(specs, tree, is_leaf=_is_spec_leaf, **_TREE)
    except ValueError as e:
        raise ValueError(f"reference: {what} is not a prefix: {e}") from None
    return leaves, per_leaf, treedef


def shard_reference(
    prog: Callable[..., Any],
    mesh: dict[str, int],
    in_specs: Any,
    out_specs: Any,
    *,
    check_rep: bool = True,
) -> Callable[..., Any]:
    """Return the global function that ``fpar.shard`` must compute for ``prog(c, *blocks)``.

    Args:
      prog: per-device program taking the collectives object ``c`` first, then the local blocks.
      mesh: ordered ``{axis_name: size}``.
      in_specs, out_specs: pytree prefixes of the args / outputs with spec leaves (``None`` leaf in
        ``in_specs``: the argument is passed through untouched).
      check_rep: if true, outputs left unmentioned along an axis must really be equal along it
        (an AssertionError here means the *test program* is wrong); the coordinate-0 copy is used
        either way.
    """
    mesh = dict(mesh)
    keys = list(itertools.product(*(range(s) for s in mesh.values())))

    def global_fn(*args):
        leaves, leaf_specs, treedef = _broadcast_specs(in_specs, tuple(args), "in_specs")
        local_args = {}
        for key in keys:
            coord = dict(zip(mesh, key))
            local = [
                leaf if spec is None else _slice_block(leaf, spec, mesh, coord)
                for leaf, spec in zip(leaves, leaf_specs)
            ]
            local_args[key] = optree.tree_unflatten(treedef, local)

        run = _Run(mesh)
        while True:
            outs = {}
            for key in keys:
                try:
                    outs[key] = prog(_RefCollectives(run, key), *local_args[key])
                except _Stop:
                    pass
            if not run.pending:
                if len(outs) != len(keys):
                    raise AssertionError("reference: some devices stopped, others finished")
                break
            if outs:
                raise AssertionError("reference: some devices finished while others wait on a collective")
            _resolve(run, keys)

        out_leaves0, out_treedef = optree.tree_flatten(outs[keys[0]], **_TREE)
        per_device = {k: optree.tree_flatten(outs[k], **_TREE)[0] for k in keys}
        out_leaf_specs = optree.broadcast_prefix(out_specs, outs[keys[0]], is_leaf=_is_spec_leaf, **_TREE)
        paths = optree.tree_paths(outs[keys[0]], **_TREE)
        result = []
        for i, spec in enumerate(out_leaf_specs):
            blocks = {k: per_device[k][i] for k in keys}
            result.append(_assemble(blocks, spec, mesh, keys, check_rep, f"out{list(paths[i])}"))
        return optree.tree_unflatten(out_treedef, result)

    return global_fn
