"""Colossal-AI 2D / 2.5D / 3D tensor parallelism (fpar/ops/_summa.py, _summa_3d.py).

Every layer is checked against the unsharded function on the global tensors (``x @ w + b``,
``F.layer_norm``, a GeLU MLP) in value and gradient (float64, random cotangent), on the
in-process mesh; block shapes give the per-device parameter memory; ``fpar.comm_stats()`` after one
forward + backward must equal, byte for byte, the traffic formula of each algorithm.
"""

from __future__ import annotations

from fractions import Fraction
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import fpar
from fpar import P
from fpar.ops import (
    layer_norm_2d,
    layer_norm_2p5d,
    layer_norm_3d,
    linear_2d,
    linear_2p5d,
    linear_3d,
    mlp_2d,
    mlp_2p5d,
    mlp_3d,
    specs_2d,
    specs_2p5d,
    specs_3d,
    summa_matmul,
)

F64 = torch.float64
BYTES = 8  # float64
AX2 = {"row_axis": "tensor_row", "col_axis": "tensor_col"}
AX25 = {"dep_axis": "tensor_dep", **AX2}
AX3 = {"input_axis": "tensor_y", "weight_axis": "tensor_x", "output_axis": "tensor_z"}


def mesh2(pr, pc):
    return fpar.make_mesh((pr, pc), ("tensor_row", "tensor_col"))


def mesh25(d, q):
    return fpar.make_mesh((d, q, q), ("tensor_dep", "tensor_row", "tensor_col"))


def mesh3(q):
    return fpar.make_mesh((q, q, q), ("tensor_x", "tensor_y", "tensor_z"))


def rand(*shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def linear_args(batch, d, f, *, bias, seed=0):
    """Global ``x [*batch, d]``, ``w [d, f]`` and (maybe) ``b [f]``."""
    args = (rand(*batch, d, seed=seed), rand(d, f, seed=seed + 1))
    return args + ((rand(f, seed=seed + 2),) if bias else ())


def reference_linear(x, w, b=None):
    return x @ w if b is None else x @ w + b


def reference_layer_norm(params, x):
    return F.layer_norm(x, x.shape[-1:], params["w"], params["b"], eps=1e-5)


def reference_mlp(params, x):
    h = F.gelu(x @ params["w_in"] + params.get("b_in", 0))
    return h @ params["w_out"] + params.get("b_out", 0)


def assert_same_function(sharded, reference, args):
    """Values and the vjp (w.r.t. every argument, a random cotangent) agree."""
    y, vjp = torch.func.vjp(sharded, *args)
    y_ref, vjp_ref = torch.func.vjp(reference, *args)
    torch.testing.assert_close(y, y_ref)
    ct = rand(*y_ref.shape, seed=99)
    for i, (g, g_ref) in enumerate(zip(vjp(ct), vjp_ref(ct))):
        torch.testing.assert_close(g, g_ref, msg=lambda m, i=i: f"gradient of argument {i}: {m}")


def traffic_of_one_step(sharded, args):
    """``fpar.comm_stats()`` for exactly one forward + backward."""
    y, vjp = torch.func.vjp(sharded, *args)
    fpar.reset_comm_stats()
    torch.func.vjp(sharded, *args)[1](torch.ones_like(y))
    return fpar.comm_stats()


def without_calls(stats):
    return {ax: {k: v["bytes"] for k, v in kinds.items() if v["bytes"]} for ax, kinds in stats.items()}


# Values and gradients: linear layers, property-tested ---------------------------------------

small = st.integers(1, 2)


@settings(max_examples=20)
@given(
    pr=small, pc=small, k=st.tuples(small, small, small), seq=st.sampled_from([(), (2,)]), bias=st.booleans()
)
def test_linear_2d_is_x_at_w_plus_b(pr, pc, k, seq, bias):
    # Any pr x pc grid: x [B, ..., D] by P(row, ..., col), w [D, F] by P(row, col), b [F] by P((col, row)).
    B, D, Fo = pr * k[0], pr * pc * k[1], pr * pc * k[2]
    s = specs_2d(ndim=2 + len(seq))
    args = linear_args((B, *seq), D, Fo, bias=bias)
    layer = fpar.shard(partial(linear_2d, **AX2), mesh2(pr, pc), (s.x, s.w, s.b)[: len(args)], s.y)
    assert_same_function(layer, reference_linear, args)


@settings(max_examples=15)
@given(
    d=small, q=small, k=st.tuples(small, small, small), seq=st.sampled_from([(), (2,)]), bias=st.booleans()
)
def test_linear_2p5d_is_x_at_w_plus_b(d, q, k, seq, bias):
    B, D, Fo = d * q * k[0], q * k[1], q * q * k[2]
    s = specs_2p5d(ndim=2 + len(seq))
    args = linear_args((B, *seq), D, Fo, bias=bias)
    layer = fpar.shard(partial(linear_2p5d, **AX25), mesh25(d, q), (s.x, s.w, s.b)[: len(args)], s.y)
    assert_same_function(layer, reference_linear, args)


@settings(max_examples=15)
@given(q=small, k=st.tuples(small, small, small), seq=st.sampled_from([(), (2,)]), bias=st.booleans())
def test_linear_3d_is_x_at_w_plus_b(q, k, seq, bias):
    B, D, Fo = q * q * k[0], q * q * k[1], q * k[2]
    s = specs_3d(ndim=2 + len(seq))
    args = linear_args((B, *seq), D, Fo, bias=bias)
    layer = fpar.shard(partial(linear_3d, **AX3), mesh3(q), (s.x, s.w, s.b)[: len(args)], s.y)
    assert_same_function(layer, reference_linear, args)


def test_summa_matmul_is_x_at_w():
    s = specs_2d()
    layer = fpar.shard(partial(summa_matmul, **AX2), mesh2(2, 2), (s.x, s.w), s.y)
    assert_same_function(layer, reference_linear, linear_args((4,), 6, 8, bias=False))


def test_3d_axis_roles_can_be_any_permutation():
    roles = {"input_axis": "tensor_z", "weight_axis": "tensor_y", "output_axis": "tensor_x"}
    s = specs_3d(**roles)
    layer = fpar.shard(partial(linear_3d, **roles), mesh3(2), (s.x, s.w, s.b), s.y)
    assert_same_function(layer, reference_linear, linear_args((8,), 4, 6, bias=True))


# LayerNorm and MLP --------------------------------------------------------------------------


def ln_params(d, seed=5):
    return {"w": 1 + 0.1 * rand(d, seed=seed), "b": rand(d, seed=seed + 1)}


def mlp_params(d, h, bias, seed=7):
    p = {"w_in": rand(d, h, seed=seed), "w_out": rand(h, d, seed=seed + 1)}
    return p | ({"b_in": rand(h, seed=seed + 2), "b_out": rand(d, seed=seed + 3)} if bias else {})


MODES = {
    # mode: (mesh, specs, axes, layer_norm, mlp, (B, D, H) multiples that fit the layouts)
    "2d": (lambda: mesh2(2, 2), specs_2d, AX2, layer_norm_2d, mlp_2d, (4, 8, 12)),
    "2.5d": (lambda: mesh25(2, 2), specs_2p5d, AX25, layer_norm_2p5d, mlp_2p5d, (8, 4, 8)),
    "3d": (lambda: mesh3(2), specs_3d, AX3, layer_norm_3d, mlp_3d, (8, 4, 8)),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seq", [(), (3,)], ids=["BD", "BSD"])
def test_layer_norm_is_f_layer_norm(mode, seq):
    mesh, specs, axes, ln, _, (B, D, _) = MODES[mode]
    s = specs(ndim=2 + len(seq))
    layer = fpar.shard(partial(ln, **axes), mesh(), (s.layer_norm, s.x), s.x)
    x = 3 + 2 * rand(B, *seq, D, seed=1)  # an offset and scale for the mean/variance to matter
    assert_same_function(layer, reference_layer_norm, (ln_params(D), x))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_mlp_is_the_unsharded_mlp(mode, bias):
    mesh, specs, axes, _, mlp, (B, D, H) = MODES[mode]
    s = specs(ndim=3, bias=bias)
    layer = fpar.shard(partial(mlp, **axes), mesh(), (s.mlp, s.x), s.x)
    assert_same_function(layer, reference_mlp, (mlp_params(D, H, bias), rand(B, 2, D, seed=3)))


@pytest.mark.parametrize("mode", MODES)
def test_pre_ln_residual_block_trains_like_unsharded(mode):
    # x + mlp(ln(x)): the LayerNorm's output layout is the MLP's input layout in every mode.
    mesh, specs, axes, ln, mlp, (B, D, H) = MODES[mode]
    s = specs()

    def block(p, x):
        return x + mlp(p["mlp"], ln(p["ln"], x, **axes), **axes)

    def reference(p, x):
        return x + reference_mlp(p["mlp"], reference_layer_norm(p["ln"], x))

    params = {"ln": ln_params(D), "mlp": mlp_params(D, H, True)}
    layer = fpar.shard(block, mesh(), ({"ln": s.layer_norm, "mlp": s.mlp}, s.x), s.x)
    assert_same_function(layer, reference, (params, rand(B, D, seed=4)))


# Specs and per-device parameter memory ------------------------------------------------------


def test_specs_are_the_papers_layouts():
    s = specs_2d()
    assert (s.x, s.w, s.b, s.y) == (
        P("tensor_row", "tensor_col"),
        P("tensor_row", "tensor_col"),
        P(("tensor_col", "tensor_row")),
        P("tensor_row", "tensor_col"),
    )
    assert specs_2d(ndim=3).x == P("tensor_row", None, "tensor_col")
    s = specs_2p5d()
    assert (s.x, s.w, s.b) == (
        P(("tensor_dep", "tensor_row"), "tensor_col"),
        P("tensor_row", "tensor_col"),
        P(("tensor_col", "tensor_row")),
    )
    s = specs_3d()  # Colossal-AI: input group (i, *, l), weight group (*, j, l), output group (i, j, *)
    assert (s.x, s.w, s.b, s.y) == (
        P(("tensor_x", "tensor_y"), "tensor_z"),
        P(("tensor_z", "tensor_x"), "tensor_y"),
        P("tensor_y"),
        P(("tensor_x", "tensor_z"), "tensor_y"),
    )
    assert s.mlp["w_out"] == P(("tensor_y", "tensor_x"), "tensor_z")
    assert set(specs_3d(bias=False).mlp) == {"w_in", "w_out"}


@pytest.mark.parametrize(
    "mode, mesh, specs, layer, fraction",
    [
        ("2d", lambda: mesh2(2, 2), specs_2d, partial(linear_2d, **AX2), Fraction(1, 4)),  # 1/q^2
        ("2.5d", lambda: mesh25(2, 2), specs_2p5d, partial(linear_2p5d, **AX25), Fraction(1, 4)),  # 1/q^2
        ("3d", lambda: mesh3(2), specs_3d, partial(linear_3d, **AX3), Fraction(1, 8)),  # 1/q^3
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_weight_block_is_the_papers_fraction(mode, mesh, specs, layer, fraction):
    seen = {}

    def spy(x, w, b):
        seen["w"], seen["b"] = tuple(w.shape), tuple(b.shape)
        return layer(x, w, b)

    s = specs()
    x, w, b = linear_args((8,), 8, 16, bias=True)
    fpar.shard(spy, mesh(), (s.x, s.w, s.b), s.y)(x, w, b)
    assert Fraction(seen["w"][0] * seen["w"][1], w.numel()) == fraction
    # The 2D/2.5D bias is split q^2 ways too; the 3D bias q ways (as Colossal-AI's).
    assert Fraction(seen["b"][0], b.numel()) == (Fraction(1, 2) if mode == "3d" else fraction)


# Traffic: exact bytes per collective per axis for one forward + backward --------------------
#
# DESIGN §6 / the Colossal-AI table give per-device traffic of a linear layer (fwd + bwd) as a
# fraction of the activation / weight size S: 1D 2(P-1)/P, 2D 6(q-1)/q, 2.5D 3(q-1)(d+1)/(dq),
# 3D 6(q-1)/q^3.  Conventions: 1D and 3D are in units of S (3D: 2(q-1)(|X|+|W|+|Y|)/q^3 = 6(q-1)/q^3 S
# for equal sizes, which we match exactly).  2D and 2.5D are in units of S/q: the paper's 2D
# moves 3(q-1)(|X|+|A|)/q^2 per device (2 broadcast phases forward, 2 broadcasts + 2 reduces
# backward) = (6(q-1)/q) S/q.  Ours is autodiff of one all_gather per operand, which keeps the
# gathered operands instead of re-broadcasting them in the backward: 2(q-1)(|X|+|A|)/q^2, i.e.
# 2/3 of the paper's (and for 2.5D, 2/3 of 3(q-1)(d+1)/(dq) S/q plus the depth all-reduce of the
# weight gradient, 2(d-1)/d |A|/q^2, which the table leaves out).


def all_gather_then_scatter(block):
    """all_gather of a per-device block over n devices, and its transpose psum_scatter."""
    return lambda n: {"all_gather": (n - 1) * block, "psum_scatter": (n - 1) * block}


@pytest.mark.parametrize("q", [2, 3])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_2d_traffic(q, bias):
    B, D, Fo = 6 * q, 6 * q, 6 * q  # |X| = |A| = S
    X, A, b = B * D * BYTES, D * Fo * BYTES, Fo * BYTES
    s = specs_2d()
    layer = fpar.shard(partial(linear_2d, **AX2), mesh2(q, q), (s.x, s.w, s.b)[: 2 + bias], s.y)
    stats = traffic_of_one_step(layer, linear_args((B,), D, Fo, bias=bias))
    # Along row i (col axis): x's blocks.  Along column j (row axis): w's blocks and the bias's.
    row_axis_bytes = Fraction(q - 1) * (A + bias * b) / q**2
    col_axis_bytes = Fraction(q - 1) * X / q**2
    assert without_calls(stats) == {
        "tensor_col": {"all_gather": col_axis_bytes, "psum_scatter": col_axis_bytes},
        "tensor_row": {"all_gather": row_axis_bytes, "psum_scatter": row_axis_bytes},
    }
    if not bias:  # 2/3 of the paper's 6(q-1)/q, in its units of S/q
        total = sum(v for kinds in without_calls(stats).values() for v in kinds.values())
        assert total == Fraction(2, 3) * Fraction(6 * (q - 1), q) * Fraction(X, q)


@pytest.mark.parametrize("d", [2, 3])
def test_2p5d_traffic(d):
    q = 2
    B, D, Fo = 12 * d, 12, 12 * d  # |X| = |A| = S
    X, A, b = B * D * BYTES, D * Fo * BYTES, Fo * BYTES
    s = specs_2p5d()
    layer = fpar.shard(partial(linear_2p5d, **AX25), mesh25(d, q), (s.x, s.w, s.b), s.y)
    stats = without_calls(traffic_of_one_step(layer, linear_args((B,), D, Fo, bias=True)))
    row_axis_bytes = Fraction(q - 1) * (A + b) / q**2
    col_axis_bytes = Fraction(q - 1) * X / (d * q**2)
    depth_psum = Fraction(2 * (d - 1), d) * (A + b) / q**2  # weight + bias gradient over depth
    assert stats == {
        "tensor_col": {"all_gather": col_axis_bytes, "psum_scatter": col_axis_bytes},
        "tensor_row": {"all_gather": row_axis_bytes, "psum_scatter": row_axis_bytes},
        "tensor_dep": {"psum": depth_psum},
    }
    # Without the bias: SUMMA's part is 2/3 of the table's 3(q-1)(d+1)/(dq) in units of S/q.
    summa = 2 * (col_axis_bytes + Fraction(q - 1) * A / q**2)
    assert summa == Fraction(2, 3) * Fraction(3 * (q - 1) * (d + 1), d * q) * Fraction(X, q)


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_3d_traffic(bias):
    q = 2
    B, D, Fo = 16, 16, 16  # |X| = |W| = |Y| = S
    X, W, Y, b = B * D * BYTES, D * Fo * BYTES, B * Fo * BYTES, Fo * BYTES
    s = specs_3d()
    layer = fpar.shard(partial(linear_3d, **AX3), mesh3(q), (s.x, s.w, s.b)[: 2 + bias], s.y)
    stats = without_calls(traffic_of_one_step(layer, linear_args((B,), D, Fo, bias=bias)))
    per = {n: Fraction(q - 1) * size / q**3 for n, size in (("x", X), ("w", W), ("y", Y))}
    expected = {
        "tensor_y": {"all_gather": per["x"], "psum_scatter": per["x"]},  # input group
        "tensor_x": {"all_gather": per["w"], "psum_scatter": per["w"]},  # weight group
        "tensor_z": {"psum_scatter": per["y"], "all_gather": per["y"]},  # output group
    }
    if bias:  # [F/q] block, gradient all-reduced over weight x output (q^2 devices)
        expected["tensor_x,tensor_z"] = {"psum": Fraction(2 * (q * q - 1), q * q) * b / q}
    assert stats == expected
    if not bias:  # exactly the paper's 6(q-1)/q^3 of S
        assert sum(sum(k.values()) for k in stats.values()) == Fraction(6 * (q - 1), q**3) * X


# Errors at the boundary ---------------------------------------------------------------------


def run_2d(fn, in_specs, *args, mesh=None):
    return fpar.shard(fn, mesh or mesh2(2, 2), in_specs, P("tensor_row", "tensor_col"))(*args)


def test_error_wrong_weight_spec():
    x, w = linear_args((4,), 4, 4, bias=False)
    with pytest.raises(ValueError, match=r"not blocks of a global x \[B, \.\.\., D\] @ w \[D, F\]"):
        run_2d(partial(linear_2d, **AX2), (specs_2d().x, P(None, "tensor_col")), x, w)


def test_error_wrong_bias_spec():
    x, w, b = linear_args((4,), 4, 8, bias=True)
    with pytest.raises(ValueError, match=r"all_gathered over 'tensor_row'"):
        run_2d(partial(linear_2d, **AX2), (specs_2d().x, specs_2d().w, P("tensor_col")), x, w, b)


def test_error_3d_wrong_layout():
    s = specs_3d()
    x, w = linear_args((8,), 8, 4, bias=False)
    with pytest.raises(ValueError, match=r"not blocks of a global x"):
        fpar.shard(partial(linear_3d, **AX3), mesh3(2), (s.x, P(None, "tensor_y")), s.y)(x, w)


def test_error_same_axis_twice():
    with pytest.raises(ValueError, match="given as both row_axis and col_axis"):
        specs_2d("tensor_row", "tensor_row")
    with pytest.raises(ValueError, match="given as both"):
        specs_3d("a", ("b", "a"), "c")


def test_error_axis_not_a_name():
    with pytest.raises(TypeError, match="must be a mesh axis name or a tuple of names"):
        specs_2p5d(0, "r", "c")


def test_error_not_a_tensor():
    def f(x):
        return linear_2d(x, [[1.0]], **AX2)

    with pytest.raises(TypeError, match="w must be a tensor"):
        run_2d(f, (specs_2d().x,), rand(4, 4, seed=0))


def test_error_outside_shard():
    with pytest.raises(fpar.UnboundAxisError, match="outside fpar.shard"):
        linear_2d(rand(2, 2, seed=0), rand(2, 2, seed=1), **AX2)


def test_error_mlp_params():
    def f(p, x):
        return mlp_2d(p, x, **AX2)

    s = specs_2d()
    with pytest.raises(ValueError, match=r"missing \['w_out'\]"):
        run_2d(f, ({"w_in": s.w}, s.x), {"w_in": rand(4, 4, seed=0)}, rand(4, 4, seed=1))
    with pytest.raises(TypeError, match="params must be a dict"):
        run_2d(partial(f, [1]), (s.x,), rand(4, 4, seed=1))


def test_error_ndim():
    with pytest.raises(ValueError, match="ndim must be an int >= 2"):
        specs_3d(ndim=1)
