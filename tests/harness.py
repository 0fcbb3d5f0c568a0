"""Glue between test programs, fpar and the reference (``reference.py``).

A test program is ``prog(c, *blocks)``; :data:`FPAR` is the ``c`` that forwards to fpar's public
collectives, so the same program text runs under ``fpar.shard`` and under ``shard_reference``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import optree
import torch
from reference import shard_reference

import fpar

_TREE = {"none_is_leaf": True, "namespace": ""}


class FparCollectives:
    """``c`` for programs run by fpar.shard: each method is the fpar collective of the same name."""

    def psum(self, x, axis_name):
        return fpar.psum(x, axis_name)

    def pmean(self, x, axis_name):
        return fpar.pmean(x, axis_name)

    def pmax(self, x, axis_name):
        return fpar.pmax(x, axis_name)

    def pmin(self, x, axis_name):
        return fpar.pmin(x, axis_name)

    def all_gather(self, x, axis_name, *, axis=0, tiled=False):
        return fpar.all_gather(x, axis_name, axis=axis, tiled=tiled)

    def psum_scatter(self, x, axis_name, *, scatter_dimension=0, tiled=False):
        return fpar.psum_scatter(x, axis_name, scatter_dimension=scatter_dimension, tiled=tiled)

    def ppermute(self, x, axis_name, perm):
        return fpar.ppermute(x, axis_name, perm)

    def all_to_all(self, x, axis_name, split_axis, concat_axis, *, tiled=False):
        return fpar.all_to_all(x, axis_name, split_axis, concat_axis, tiled=tiled)

    def axis_index(self, axis_name):
        return fpar.axis_index(axis_name)

    def axis_size(self, axis_name):
        return fpar.axis_size(axis_name)


FPAR = FparCollectives()


def mesh_of(axes: dict[str, int]) -> fpar.Mesh:
    """An in-process fpar mesh for an ordered ``{name: size}`` dict."""
    return fpar.make_mesh(tuple(axes.values()), tuple(axes.keys()))


def fpar_fn(prog: Callable, axes: dict[str, int], in_specs, out_specs, *, check_rep=True) -> Callable:
    """``fpar.shard`` of ``prog`` with ``c = FPAR``."""

    def per_device(*blocks):
        return prog(FPAR, *blocks)

    per_device.__name__ = getattr(prog, "__name__", "prog")
    return fpar.shard(per_device, mesh_of(axes), in_specs=in_specs, out_specs=out_specs, check_rep=check_rep)


def ref_fn(prog: Callable, axes: dict[str, int], in_specs, out_specs, *, check_rep=True) -> Callable:
    """The reference global function of ``prog``."""
    return shard_reference(prog, axes, in_specs, out_specs, check_rep=check_rep)


def both(prog, axes, in_specs, out_specs, *, check_rep=True) -> tuple[Callable, Callable]:
    return (
        fpar_fn(prog, axes, in_specs, out_specs, check_rep=check_rep),
        ref_fn(prog, axes, in_specs, out_specs, check_rep=check_rep),
    )


def assert_tree_close(actual: Any, expected: Any, *, rtol=None, atol=None, what="value") -> None:
    """Same tree structure, same shapes and dtypes, close values."""
    a_leaves, a_def = optree.tree_flatten(actual, **_TREE)
    e_leaves, e_def = optree.tree_flatten(expected, **_TREE)
    assert a_def == e_def, f"{what}: tree structure {a_def} != {e_def}"
    for i, (a, e) in enumerate(zip(a_leaves, e_leaves)):
        if isinstance(e, torch.Tensor):
            assert isinstance(a, torch.Tensor), f"{what} leaf {i}: {type(a)} is not a tensor"
            assert a.shape == e.shape, f"{what} leaf {i}: shape {tuple(a.shape)} != {tuple(e.shape)}"
            assert a.dtype == e.dtype, f"{what} leaf {i}: dtype {a.dtype} != {e.dtype}"
            torch.testing.assert_close(a, e, rtol=rtol, atol=atol, msg=lambda m, i=i: f"{what} leaf {i}: {m}")
        else:
            assert a == e, f"{what} leaf {i}: {a!r} != {e!r}"


def rand(*shape, seed=0, dtype=torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tuple(shape), generator=g, dtype=dtype)


def arange(*shape, dtype=torch.float64) -> torch.Tensor:
    return torch.arange(math.prod(shape), dtype=dtype).reshape(shape)


def weighted_sum(out: Any, seed: int = 123) -> torch.Tensor:
    """A scalar loss ``sum_i <out_i, r_i>`` with fixed random ``r_i`` (so every output entry matters)."""
    total = 0
    for i, leaf in enumerate(optree.tree_leaves(out, **_TREE)):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            r = rand(*leaf.shape, seed=seed + i, dtype=leaf.dtype)
            total = total + (leaf * r).sum()
    return total


def scalar_loss(fn: Callable, seed: int = 123) -> Callable:
    """``lambda *args: weighted_sum(fn(*args))``."""

    def loss(*args):
        return weighted_sum(fn(*args), seed)

    return loss


def check_against_reference(prog, axes, in_specs, out_specs, args, *, check_rep=True, grad_argnums=None):
    """Assert fpar.shard(prog) == reference(prog) in value and (optionally) gradient."""
    f, r = both(prog, axes, in_specs, out_specs, check_rep=check_rep)
    assert_tree_close(f(*args), r(*args), what="value")
    if grad_argnums is not None:
        gf = torch.func.grad(scalar_loss(f), argnums=grad_argnums)(*args)
        gr = torch.func.grad(scalar_loss(r), argnums=grad_argnums)(*args)
        assert_tree_close(gf, gr, what="grad")


# ----------------------------------------------------------------------------------------------
# A table of single-collective cases shared by the value and gradient tests

MESHES = {
    "i4": {"i": 4},
    "x2y2": {"x": 2, "y": 2},
    "x2y3": {"x": 2, "y": 3},
    "a2b1c2": {"a": 2, "b": 1, "c": 2},
}

AXES = {
    "i4": ["i", ("i",)],
    "x2y2": ["x", "y", ("x", "y"), ("y", "x")],
    "x2y3": ["x", "y", ("x", "y"), ("y", "x")],
    "a2b1c2": ["b", ("c", "a"), ("a", "b", "c"), ("c", "b", "a")],
}


def _axis_id(ax) -> str:
    return ax if isinstance(ax, str) else "(" + ",".join(ax) + ")"


def _names(ax) -> tuple:
    return (ax,) if isinstance(ax, str) else tuple(ax)


def collective_cases():
    """``(id, axes, prog, block_shape, out_varies)`` for each collective variant, mesh and axis_name.

    The input is split over every mesh axis (dim 0, mesh order); ``out_varies`` says whether the
    output still varies over ``ax`` (otherwise the out_spec leaves ``ax`` out, exercising check_rep).
    """
    import random

    cases = []
    for mesh_id, axes in MESHES.items():
        for ax in AXES[mesh_id]:
            n = math.prod(axes[a] for a in _names(ax))
            perm = list(range(n))
            random.Random(n * 7 + len(_names(ax))).shuffle(perm)
            variants = [
                ("psum", lambda c, x, ax=ax: c.psum(x, ax), (2, 3), False),
                ("pmean", lambda c, x, ax=ax: c.pmean(x, ax), (2, 3), False),
                ("pmax", lambda c, x, ax=ax: c.pmax(x, ax), (2, 3), False),
                ("pmin", lambda c, x, ax=ax: c.pmin(x, ax), (2, 3), False),
                ("all_gather-axis0", lambda c, x, ax=ax: c.all_gather(x, ax), (2, 3), True),
                ("all_gather-axis0-tiled", lambda c, x, ax=ax: c.all_gather(x, ax, tiled=True), (2, 3), True),
                (
                    "all_gather-axis1-tiled",
                    lambda c, x, ax=ax: c.all_gather(x, ax, axis=1, tiled=True),
                    (2, 3),
                    True,
                ),
                ("all_gather-axis2", lambda c, x, ax=ax: c.all_gather(x, ax, axis=2), (2, 3), True),
                ("psum_scatter-dim0", lambda c, x, ax=ax: c.psum_scatter(x, ax), (n, 3), True),
                (
                    "psum_scatter-dim1-tiled",
                    lambda c, x, ax=ax: c.psum_scatter(x, ax, scatter_dimension=1, tiled=True),
                    (2, 2 * n),
                    True,
                ),
                (
                    "ppermute-shift1",
                    lambda c, x, ax=ax, n=n: c.ppermute(x, ax, [(i, (i + 1) % n) for i in range(n)]),
                    (2, 3),
                    True,
                ),
                (
                    "ppermute-random",
                    lambda c, x, ax=ax, perm=perm: c.ppermute(x, ax, list(enumerate(perm))),
                    (2, 3),
                    True,
                ),
                (
                    "ppermute-partial",
                    lambda c, x, ax=ax, n=n: c.ppermute(x, ax, [(0, n - 1)]),
                    (2, 3),
                    True,
                ),
                ("all_to_all-s0c1", lambda c, x, ax=ax: c.all_to_all(x, ax, 0, 1), (n, 3), True),
                ("all_to_all-s1c0", lambda c, x, ax=ax: c.all_to_all(x, ax, 1, 0), (2, n), True),
                (
                    "all_to_all-s1c0-tiled",
                    lambda c, x, ax=ax: c.all_to_all(x, ax, 1, 0, tiled=True),
                    (2, 2 * n),
                    True,
                ),
                (
                    "all_to_all-s0c1-tiled",
                    lambda c, x, ax=ax: c.all_to_all(x, ax, 0, 1, tiled=True),
                    (2 * n, 3),
                    True,
                ),
                (
                    "axis_index-mul",
                    lambda c, x, ax=ax: x * (c.axis_index(ax) + 1).to(x.dtype),
                    (2, 3),
                    True,
                ),
            ]
            for name, prog, block, varies in variants:
                prog.__name__ = name.replace("-", "_")
                cases.append(pytest_param(f"{name}-{mesh_id}-{_axis_id(ax)}", axes, ax, prog, block, varies))
    return cases


def pytest_param(id_, axes, ax, prog, block, varies):
    import pytest

    return pytest.param(axes, ax, prog, block, varies, id=id_)


def case_specs(axes: dict[str, int], ax, block: tuple, varies: bool):
    """(global input shape, in_spec, out_spec) for a collective case (see collective_cases)."""
    P = fpar.P
    all_axes = tuple(axes)
    shape = (block[0] * math.prod(axes.values()),) + tuple(block[1:])
    in_spec = P(all_axes)
    kept = all_axes if varies else tuple(a for a in all_axes if a not in _names(ax))
    return shape, in_spec, (P(kept) if kept else P())


def without_gradient_sums(stats: dict) -> dict:
    """``fpar.comm_stats()`` without the kinds the two meshes count differently by design.

    The in-process mesh counts gradient sums of replicated values as JAX issues them (a psum per
    use and axis); a real mesh counts what it issues: one all-reduce per source over all of its
    axes, bucketed, and a broadcast per ``check_rep=False`` output.  Every other collective is
    counted identically, so real-mesh tests compare this and check psums against formulas.
    """
    out = {}
    for ax, kinds in stats.items():
        kept = {k: v for k, v in kinds.items() if k not in ("psum", "broadcast")}
        if kept:
            out[ax] = kept
    return out


def peak_bytes(fn: Callable[[], Any]) -> int:
    """The highest running sum of CPU allocations minus frees while ``fn`` runs (torch.profiler)."""
    import torch._C._profiler as C
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = []

    def walk(node):
        if (
            isinstance(node.extra_fields, C._ExtraFields_Allocation)
            and node.extra_fields.device.type == "cpu"
        ):
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    running = peak = 0
    for _, size in sorted(events):
        running += size
        peak = max(peak, running)
    return peak
