"""Collective values under fpar.shard against the reference, plus JAX-verified literal examples."""

from __future__ import annotations

import pytest
import torch
from harness import (
    arange,
    assert_tree_close,
    both,
    case_specs,
    collective_cases,
    fpar_fn,
    mesh_of,
    rand,
    ref_fn,
)

import fpar
from fpar import P

# ----------------------------------------------------------------------------------------------
# Every collective alone, on single axes and on tuple axes in both orders, against the reference.


@pytest.mark.parametrize(("axes", "ax", "prog", "block", "varies"), collective_cases())
def test_collective_matches_reference(axes, ax, prog, block, varies):
    shape, in_spec, out_spec = case_specs(axes, ax, block, varies)
    x = rand(*shape, seed=len(shape) + shape[0])
    f, r = both(prog, axes, in_spec, out_spec)
    assert_tree_close(f(x), r(x))


# ----------------------------------------------------------------------------------------------
# Literal examples verified on JAX (mesh (2,2) ('x','y'), data laid out P(('x','y')) = [0,1,2,3]).

XY = {"x": 2, "y": 2}
QUAD = P(("x", "y"))


def _run(prog, in_specs, out_specs, *args, axes=XY, check_rep=True):
    return fpar_fn(prog, axes, in_specs, out_specs, check_rep=check_rep)(*args)


@pytest.mark.parametrize("ax", [("x", "y"), ("y", "x")], ids=["xy", "yx"])
def test_literal_psum_order_irrelevant(ax):
    out = _run(lambda c, v: c.psum(v, ax), QUAD, P(), torch.arange(4.0))
    assert out.tolist() == [6.0]


@pytest.mark.parametrize(
    ("ax", "expected"), [(("y", "x"), [0, 2, 1, 3]), (("x", "y"), [0, 1, 2, 3])], ids=["yx", "xy"]
)
def test_literal_all_gather_tiled(ax, expected):
    out = _run(lambda c, v: c.all_gather(v, ax, tiled=True), QUAD, QUAD, torch.arange(4.0))
    # every device holds the whole gathered vector; out_spec QUAD concatenates the 4 copies
    assert out.reshape(4, 4).tolist() == [[float(e) for e in expected]] * 4


@pytest.mark.parametrize(
    ("ax", "expected"),
    [(("y", "x"), [0, 2, 1, 3]), (("x", "y"), [0, 1, 2, 3]), ("y", [0, 1, 0, 1])],
    ids=["yx", "xy", "y"],
)
def test_literal_axis_index(ax, expected):
    out = _run(lambda c: c.axis_index(ax)[None], (), QUAD)
    assert out.tolist() == expected
    assert out.dtype == torch.int64


@pytest.mark.parametrize(
    ("ax", "expected"), [(("y", "x"), [0, 8, 4, 12]), (("x", "y"), [0, 4, 8, 12])], ids=["yx", "xy"]
)
def test_literal_psum_scatter_tiled(ax, expected):
    out = _run(lambda c, v: c.psum_scatter(v, ax, tiled=True), P(), QUAD, torch.arange(4.0))
    assert out.tolist() == [float(e) for e in expected]


SHIFT1 = [(i, (i + 1) % 4) for i in range(4)]


@pytest.mark.parametrize(
    ("ax", "expected"),
    [
        # Written order ('y','x'): combined index k = 2*y + x; device k receives from k-1.
        # Devices in P(('x','y')) layout have k = [0, 2, 1, 3] and hold v = [0, 1, 2, 3]; the value at
        # k-1 is [3, 2, 0, 1]. (Mesh order would give [3, 0, 1, 2], which is what a ppermute that
        # sorts its replica groups computes; fpar's contract is the written order.)
        (("y", "x"), [3, 2, 0, 1]),
        (("x", "y"), [3, 0, 1, 2]),
    ],
    ids=["yx", "xy"],
)
def test_literal_ppermute_written_order(ax, expected):
    out = _run(lambda c, v: c.ppermute(v, ax, SHIFT1), QUAD, QUAD, torch.arange(4.0))
    assert out.tolist() == [float(e) for e in expected]


@pytest.mark.parametrize("ax", [("y", "x"), ("x", "y"), ("y",), "x"], ids=["yx", "xy", "(y)", "x"])
@pytest.mark.parametrize("shift", [1, 3], ids=["shift1", "shift3"])
def test_ppermute_consistent_with_axis_index_and_all_gather(ax, shift):
    """ppermute's combined index is the one axis_index and all_gather use (self-consistency)."""

    def prog(c, v):
        n = c.axis_size(ax)
        moved = c.ppermute(v, ax, [(i, (i + shift) % n) for i in range(n)])
        gathered = c.all_gather(v, ax)  # (n, 1), ordered by combined index
        src = (c.axis_index(ax) - shift) % n
        expected = (gathered * (torch.arange(n)[:, None] == src)).sum(0)
        return moved - expected

    out = _run(prog, QUAD, QUAD, rand(4))
    assert torch.equal(out, torch.zeros(4, dtype=torch.float64))


def test_literal_check_rep_false_returns_coordinate_zero():
    out = _run(lambda c, v: v, P("i"), P(), torch.arange(6), axes={"i": 2}, check_rep=False)
    assert out.tolist() == [0, 1, 2]


# ----------------------------------------------------------------------------------------------
# Other collective semantics


@pytest.mark.parametrize(
    ("axes", "ax"),
    [({"i": 4}, "i"), ({"x": 2, "y": 3}, ("y", "x")), ({"x": 2, "y": 3}, "y"), ({"x": 2, "y": 3}, ("x",))],
    ids=["i4", "x2y3-(y,x)", "x2y3-y", "x2y3-(x)"],
)
def test_python_numbers(axes, ax):
    n = 1
    for a in (ax,) if isinstance(ax, str) else ax:
        n *= axes[a]

    def prog(c, x):
        return x * c.psum(1, ax) + c.pmean(2.0, ax) + c.pmax(3, ax) * c.pmin(5, ax)

    x = rand(12)
    out = fpar_fn(prog, axes, P(tuple(axes)), P(tuple(axes)))(x)
    torch.testing.assert_close(out, x * n + 2.0 + 15)
    torch.testing.assert_close(out, ref_fn(prog, axes, P(tuple(axes)), P(tuple(axes)))(x))


def test_axis_size_is_python_int_and_axis_index_is_int64_scalar():
    seen = []

    def f(x):
        seen.append((fpar.axis_size("x"), fpar.axis_size(("y", "x")), fpar.axis_size("y")))
        i = fpar.axis_index(("x", "y"))
        seen.append((i.dtype, i.dim()))
        return x

    fpar.shard(f, mesh_of({"x": 2, "y": 3}), P(), P())(torch.zeros(()))
    sizes, (dtype, dim) = seen[0], seen[1]
    assert sizes == (2, 6, 3)
    assert all(type(s) is int for s in sizes)
    assert dtype == torch.int64
    assert dim == 0


def test_psum_of_replicated_input_multiplies_by_size():
    axes = {"x": 2, "y": 3}
    x = rand(5)
    out = fpar_fn(lambda c, x: c.psum(x, ("y", "x")), axes, P(), P())(x)
    torch.testing.assert_close(out, 6 * x)
    out = fpar_fn(lambda c, x: c.psum(x, "y"), axes, P(), P())(x)
    torch.testing.assert_close(out, 3 * x)


def test_pmean_is_psum_over_size():
    axes = {"x": 2, "y": 3}
    x = rand(12, 2)
    prog = lambda c, x: c.pmean(x, "y") - c.psum(x, "y") / 3  # noqa: E731
    out = fpar_fn(prog, axes, P(("x", "y")), P("x"))(x)
    torch.testing.assert_close(out, torch.zeros(4, 2, dtype=torch.float64))


@pytest.mark.parametrize(
    "collective",
    [
        pytest.param(lambda c, t: c.psum(t, "y"), id="psum"),
        pytest.param(lambda c, t: c.pmax(t, ("y", "x")), id="pmax"),
        pytest.param(lambda c, t: c.all_gather(t, "y", tiled=True), id="all_gather"),
        pytest.param(lambda c, t: c.psum_scatter(t, "x", tiled=True), id="psum_scatter"),
        pytest.param(lambda c, t: c.ppermute(t, ("y", "x"), [(0, 5), (5, 1), (1, 0)]), id="ppermute"),
        pytest.param(lambda c, t: c.all_to_all(t, "x", 0, 0, tiled=True), id="all_to_all"),
    ],
)
def test_collectives_on_pytrees(collective):
    axes = {"x": 2, "y": 3}

    def prog(c, tree):
        return collective(c, tree)

    tree = {"a": rand(12, 2, seed=1), "b": (rand(12, seed=2), rand(24, 3, seed=3))}
    spec = P(("x", "y"))
    f, r = both(prog, axes, spec, spec)
    assert_tree_close(f(tree), r(tree))
    # and leaf by leaf equals the collective on each leaf alone
    leafwise = {
        "a": fpar_fn(prog, axes, spec, spec)(tree["a"]),
        "b": tuple(fpar_fn(prog, axes, spec, spec)(t) for t in tree["b"]),
    }
    assert_tree_close(f(tree), leafwise)


def test_collectives_compose_across_axes():
    """psum over one axis, all_gather over another, ppermute over a tuple: a chain."""
    axes = {"x": 2, "y": 3, "z": 1}

    def prog(c, a):
        h = c.psum(a * a, "x")
        h = c.all_gather(h, ("z", "y"), axis=1, tiled=True)
        h = c.ppermute(h, ("y", "x"), [(i, (i + 2) % 6) for i in range(6)])
        return c.pmax(h, "x") + c.axis_index("y")

    x = rand(12, 4)
    f, r = both(prog, axes, P(("y", "x")), P(("z", "y")))  # all_gather left it varying over z
    assert_tree_close(f(x), r(x))


def test_arange_blocks_layout_per_device():
    """Each device sees exactly the block its spec names (tuple entry, unmentioned axis)."""
    axes = {"x": 2, "y": 3}

    def prog(c, a):
        return a[None]

    x = arange(6, 4)
    f, r = both(prog, axes, P(("y", "x")), P(("x", "y")))
    assert_tree_close(f(x), r(x))
    # device (x, y) holds row 2*y + x; the output lays devices out in (x, y) order
    expected = torch.stack([x[2 * yy + xx] for xx in range(2) for yy in range(3)])[:, None, :]
    assert_tree_close(f(x), expected)
