"""Helpers for the fpar.ops tests: meshes, random parameters, value-and-gradient comparison, traffic formulas."""

from __future__ import annotations

import optree
import torch
from hypothesis import settings

import fpar
from fpar import P

DTYPE = torch.float64
ITEM = 8  # bytes per float64
RTOL, ATOL = 1e-9, 1e-10

# A fraction of the active profile's examples: every example runs a sharded forward + backward.
FEW = settings(max_examples=max(2, settings.default.max_examples // 6))


def mesh(n: int, data: int = 1) -> fpar.Mesh:
    """An in-process mesh ("tensor",) of size n, or ("data", "tensor") when data > 1."""
    if data == 1:
        return fpar.make_mesh((n,), ("tensor",))
    return fpar.make_mesh((data, n), ("data", "tensor"))


def randomize(inits, seed: int = 0, scale: float = 0.5):
    """Global float64 tensors of the shapes of a tree of ``fpar.Init`` (random, LayerNorm weights too)."""
    gen = torch.Generator().manual_seed(seed)
    return optree.tree_map(
        lambda i: torch.randn(i.shape, generator=gen, dtype=DTYPE) * scale,
        inits,
        is_leaf=lambda x: isinstance(x, fpar.Init),
    )


def randn(*shape, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=DTYPE) * scale


def assert_tree_close(got, want, what: str = "value") -> None:
    paths, g_leaves, _ = optree.tree_flatten_with_path(got)
    w_leaves = optree.tree_leaves(want)
    assert len(g_leaves) == len(w_leaves), what
    for path, g, w in zip(paths, g_leaves, w_leaves):
        assert g.shape == w.shape, f"{what} at {path}: shape {tuple(g.shape)} != {tuple(w.shape)}"
        torch.testing.assert_close(g, w, rtol=RTOL, atol=ATOL, msg=lambda m, p=path: f"{what} at {p}: {m}")


def check_values_and_grads(sharded_fn, reference, args, argnums=None) -> None:
    """``fpar.testing.assert_equivalent`` of a :func:`sharded` layer against ``reference``.

    Values, and the gradients of one seeded random cotangent w.r.t. every floating argument with
    a spec (``argnums`` is kept for readability at the call sites: those are the floating ones).
    """
    fpar.testing.assert_equivalent(
        reference,
        sharded_fn.per_device,
        sharded_fn.mesh,
        sharded_fn.in_specs,
        sharded_fn.out_specs,
        *args,
        rtol=RTOL,
        atol=ATOL,
    )


def traffic(fn, args, argnums=None) -> dict:
    """``fpar.comm_stats()`` of one forward (argnums None) or one forward + backward of ``fn(*args).sum()``."""
    fpar.reset_comm_stats()
    if argnums is None:
        fn(*args)
    else:
        torch.func.grad(lambda *a: fn(*a).sum(), argnums=argnums)(*args)
    stats = fpar.comm_stats()
    fpar.reset_comm_stats()
    return stats


def bytes_of(stats: dict, axis: str = "tensor") -> dict:
    """``{collective: bytes}`` on one axis (an empty dict if nothing crossed it)."""
    return {k: v["bytes"] for k, v in stats.get(axis, {}).items() if v["bytes"]}


# Per-device bytes sent under ring algorithms (DESIGN §6), written out here rather than imported.
def all_reduce(n: int, nbytes: int) -> int:
    return 2 * (n - 1) * nbytes // n


def all_gather(n: int, block_bytes: int) -> int:
    return (n - 1) * block_bytes


def reduce_scatter(n: int, nbytes: int) -> int:
    return (n - 1) * nbytes // n


def all_to_all(n: int, nbytes: int) -> int:
    return (n - 1) * nbytes // n


class Sharded:
    """``fpar.shard`` of a per-device layer, keeping what ``fpar.testing.assert_equivalent`` needs."""

    def __init__(self, per_device, mesh_, in_specs, out_specs):
        self.per_device, self.mesh, self.in_specs, self.out_specs = per_device, mesh_, in_specs, out_specs
        self._fn = fpar.shard(per_device, mesh_, in_specs=in_specs, out_specs=out_specs)

    def __call__(self, *args):
        return self._fn(*args)


def sharded(layer, mesh_, in_specs, out_specs, **kw) -> Sharded:
    """``fpar.shard`` of ``layer`` with ``axis="tensor"`` (the ops tests' mesh axis)."""

    def per_device(*args):
        return layer(*args, axis="tensor", **kw)

    per_device.__name__ = layer.__name__
    return Sharded(per_device, mesh_, in_specs, out_specs)


def block_shapes(tree, specs, mesh_: fpar.Mesh) -> dict:
    """The per-device block shape of every leaf, seen from inside ``fpar.shard``."""
    seen = {}

    def probe(t):
        paths, leaves, _ = optree.tree_flatten_with_path(t)
        seen.update({p: tuple(leaf.shape) for p, leaf in zip(paths, leaves)})
        return torch.zeros(())

    fpar.shard(probe, mesh_, in_specs=(specs,), out_specs=P(), check_rep=False)(tree)
    return seen
