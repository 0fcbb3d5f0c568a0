"""fpar.shard: specs as pytree prefixes, static args, closures, output assembly, check_rep."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
from harness import arange, assert_tree_close, both, mesh_of, rand

import fpar
from fpar import P

X2Y3 = {"x": 2, "y": 3}
X2Y2 = {"x": 2, "y": 2}


# ----------------------------------------------------------------------------------------------
# Input splitting and output assembly


@pytest.mark.parametrize(
    ("in_spec", "out_spec", "shape"),
    [
        pytest.param(P("x"), P("x"), (4, 3), id="x->x"),
        pytest.param(P(None, "y"), P(None, "y"), (2, 6), id="dim1-y"),
        pytest.param(P("x", "y"), P("x", "y"), (4, 6), id="x-y"),
        pytest.param(P("y", "x"), P("y", "x"), (6, 4), id="y-x"),
        pytest.param(P(("x", "y")), P(("x", "y")), (12, 2), id="(x,y)"),
        pytest.param(P(("y", "x")), P(("y", "x")), (12, 2), id="(y,x)"),
        pytest.param(P(("y", "x")), P(("x", "y")), (12, 2), id="(y,x)->(x,y)-block-transpose"),
        pytest.param(P(("x", "y")), P(None, ("y", "x")), (6, 1), id="dim0->dim1"),
        pytest.param(P("x"), P("x", "y"), (4, 3), id="tile-replicated-over-y"),
        pytest.param(P("x"), P(("y", "x")), (4, 3), id="tile-into-tuple-entry"),
        pytest.param(P(), P("y"), (2, 3), id="replicated-tiled-y"),
        pytest.param(P(None, None, "x"), P(None, None, "x"), (1, 2, 4), id="trailing-dim"),
        pytest.param(P(("x",)), P(("x",)), (4,), id="one-name-tuple"),
    ],
)
def test_identity_layouts(in_spec, out_spec, shape):
    x = arange(*shape)
    f, r = both(lambda c, a: a, X2Y3, in_spec, out_spec)
    assert_tree_close(f(x), r(x))


def test_identity_round_trip_is_exact():
    x = rand(12, 6)
    for spec in (P(("y", "x")), P("x", "y"), P(None, ("x", "y")), P(("x", "y"), None)):
        out = fpar.shard(lambda a: a, mesh_of(X2Y3), spec, spec)(x)
        assert torch.equal(out, x), spec


def test_block_shapes_seen_per_device():
    seen = []

    def f(a, b, s):
        seen.append((tuple(a.shape), tuple(b.shape), tuple(s.shape)))
        return a

    x = torch.zeros(12, 6, 5)
    fpar.shard(f, mesh_of(X2Y3), (P(("y", "x")), P(None, "x"), P()), P(("y", "x")))(
        x, torch.zeros(3, 4), torch.zeros(())
    )
    assert seen[0] == ((2, 6, 5), (3, 2), ())


# ----------------------------------------------------------------------------------------------
# Specs are pytree prefixes


def test_dict_params_and_tuple_args():
    def prog(c, params, x):
        h = x @ params["w1"]  # column-parallel over y
        return c.psum(torch.tanh(h) @ params["w2"], "y")

    specs = {"w1": P(None, "y"), "w2": P("y", None)}
    params = {"w1": rand(4, 6, seed=1), "w2": rand(6, 5, seed=2)}
    x = rand(8, 4, seed=3)
    f, r = both(prog, X2Y3, (specs, P("x")), P("x"))
    out = f(params, x)
    assert_tree_close(out, r(params, x))
    torch.testing.assert_close(out, torch.tanh(x @ params["w1"]) @ params["w2"])


def test_single_spec_broadcasts_to_all_args():
    def prog(c, a, b, tree):
        return a + b * tree["k"][0] - tree["k"][1]

    a, b = rand(4, 3, seed=1), rand(4, 3, seed=2)
    tree = {"k": [rand(4, 3, seed=3), rand(4, 3, seed=4)]}
    f, r = both(prog, X2Y3, P("x"), P("x"))
    assert_tree_close(f(a, b, tree), r(a, b, tree))
    assert_tree_close(f(a, b, tree), a + b * tree["k"][0] - tree["k"][1])


def test_spec_prefix_of_subtree():
    """One P for a whole dict argument; per-leaf specs for a list argument."""

    def prog(c, d, lst):
        return {"s": d["u"] * d["v"], "t": lst[0] + c.all_gather(lst[1], "y", tiled=True)}

    d = {"u": rand(4, 6, seed=1), "v": rand(4, 6, seed=2)}
    lst = [rand(6, seed=3), rand(6, seed=4)]
    in_specs = (P("x", "y"), [P(), P("y")])
    out_specs = {"s": P("x", "y"), "t": P("y")}
    f, r = both(prog, X2Y3, in_specs, out_specs)
    assert_tree_close(f(d, lst), r(d, lst))


class Batch(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


def test_namedtuple_args_and_outputs():
    def prog(c, batch):
        return Batch(x=c.pmean(batch.x, "x"), y=batch.y * 2)

    b = Batch(rand(4, 3, seed=1), rand(6, seed=2))
    f, r = both(prog, X2Y3, (Batch(P("x"), P("y")),), Batch(P(), P("y")))
    out = f(b)
    assert isinstance(out, Batch)
    assert_tree_close(out, r(b))


@pytest.mark.parametrize(
    "out_specs",
    [
        pytest.param(P(("y", "x")), id="one-P-for-all"),
        pytest.param((P(("y", "x")), [P(("x", "y")), P(None, ("y", "x"))]), id="per-leaf"),
        pytest.param((P(("y", "x")), P(("x", "y"))), id="prefix-of-list"),
    ],
)
def test_tuple_entry_out_specs_on_pytree_outputs(out_specs):
    def prog(c, a):
        return a, [a * 2, a[:, None] + 1]

    x = arange(12)
    f, r = both(prog, X2Y3, P(("x", "y")), out_specs)
    assert_tree_close(f(x), r(x))


# ----------------------------------------------------------------------------------------------
# Static (None-spec'd) arguments, closures, zero-argument functions


def test_none_spec_passes_objects_through_untouched():
    marker = object()
    seen = []

    def f(x, scale, act, tag):
        seen.append((scale, act, tag))
        return act(x) * scale

    act = torch.tanh
    x = rand(4, 3)
    out = fpar.shard(f, mesh_of(X2Y3), (P("x"), None, None, None), P("x"))(x, 2.5, act, marker)
    torch.testing.assert_close(out, torch.tanh(x) * 2.5)
    assert all(s == 2.5 and a is act and t is marker for s, a, t in seen)


def test_none_spec_for_a_nested_python_structure():
    cfg = {"mode": "sum", "dims": [0, 1]}

    def prog(c, x, cfg):
        assert cfg["mode"] == "sum" and list(cfg["dims"]) == [0, 1]
        return c.psum(x.sum(dim=tuple(cfg["dims"]))[None], "x")

    x = rand(4, 6)
    f, r = both(prog, X2Y3, (P("x", "y"), None), P("y"))
    assert_tree_close(f(x, cfg), r(x, cfg))


def test_closed_over_tensor_is_replicated():
    w = rand(3, 5, seed=7)

    def prog(c, x):
        return c.psum(x @ w, "x")

    x = rand(4, 3)
    f, r = both(prog, X2Y3, P("x"), P())
    assert_tree_close(f(x), r(x))
    torch.testing.assert_close(f(x), (x.reshape(2, 2, 3) @ w).sum(0))


def test_zero_argument_function():
    def prog(c):
        return c.axis_index(("y", "x"))[None] * 10 + c.axis_size("y")

    f, r = both(prog, X2Y3, (), P(("x", "y")))
    out = f()
    assert_tree_close(out, r())
    assert out.tolist() == [10 * (2 * y + x) + 3 for x in range(2) for y in range(3)]


def test_zero_argument_function_replicated_output():
    ones = torch.ones(2, dtype=torch.float64)
    out = fpar.shard(lambda: fpar.psum(ones, ("x", "y")), mesh_of(X2Y3), (), P())()
    assert out.tolist() == [6.0, 6.0]


# ----------------------------------------------------------------------------------------------
# check_rep


def test_check_rep_accepts_reduced_outputs():
    def prog(c, a):
        return c.pmean(a, ("x", "y")), c.pmax(a, ("y", "x")), a.shape[0] * c.psum(1, "y") + torch.zeros(2)

    x = rand(6, 2)
    f, r = both(prog, X2Y3, P(("x", "y")), (P(), P(), P()))
    assert_tree_close(f(x), r(x))


@pytest.mark.parametrize(
    ("in_spec", "out_spec", "shape"),
    [
        pytest.param(P("x"), P(), (4, 3), id="x->()"),
        pytest.param(P(("x", "y")), P("y"), (12,), id="(x,y)->y"),
        pytest.param(P(("y", "x")), P(None, "x"), (12, 2), id="(y,x)->dim1-x"),
        pytest.param(P("y"), P(("x",)), (6,), id="y->(x)"),
    ],
)
def test_check_rep_false_returns_coordinate_zero(in_spec, out_spec, shape):
    x = arange(*shape)
    f, r = both(lambda c, a: a * 3, X2Y3, in_spec, out_spec, check_rep=False)
    assert_tree_close(f(x), r(x))


def test_check_rep_false_coordinate_zero_explicit():
    # mesh (x=2, y=3), x split over (x,y) in blocks of 2: device (0, y) holds rows 2y..2y+1
    x = arange(12)
    out = fpar.shard(lambda a: a, mesh_of(X2Y3), P(("x", "y")), P("y"), check_rep=False)(x)
    assert torch.equal(out, x[:6])
    out = fpar.shard(lambda a: a, mesh_of(X2Y3), P(("y", "x")), P("y"), check_rep=False)(x)
    assert torch.equal(out, torch.cat([x[0:2], x[4:6], x[8:10]]))


def test_check_rep_false_with_axis_index():
    out = fpar.shard(
        lambda: (fpar.axis_index(("x", "y")) + 1)[None], mesh_of(X2Y3), (), P("x"), check_rep=False
    )()
    assert out.tolist() == [1, 4]


def test_outputs_of_mixed_kinds():
    """A replicated output next to split ones, each with its own out_spec."""

    def prog(c, a):
        loss = c.pmean((a * a).sum(), ("x", "y"))
        return {"loss": loss, "grad_like": 2 * a, "gathered": c.all_gather(a, "y", tiled=True)}

    x = rand(12, 2)
    out_specs = {"loss": P(), "grad_like": P(("x", "y")), "gathered": P(("x", "y"))}
    f, r = both(prog, X2Y3, P(("x", "y")), out_specs)
    assert_tree_close(f(x), r(x))
    torch.testing.assert_close(f(x)["loss"], (x * x).sum() / 6)


def test_dtypes_preserved():
    for dtype in (torch.float32, torch.float64, torch.int64, torch.bfloat16):
        x = torch.arange(12).to(dtype)
        out = fpar.shard(lambda a: fpar.psum(a, "y"), mesh_of(X2Y3), P(("x", "y")), P("x"))(x)
        assert out.dtype == dtype
        assert out.tolist() == torch.arange(12).reshape(2, 3, 2).sum(1).reshape(-1).to(dtype).tolist()


def test_global_function_name_in_messages():
    def loss(a):
        return a

    with pytest.raises(fpar.ReplicationError, match=r"fpar\.shard\(loss\)"):
        fpar.shard(loss, mesh_of(X2Y3), P("x"), P())(rand(4))


def test_closed_over_only_output_is_replicated():
    """A value computed only from closed-over tensors and P() inputs passes check_rep with P()."""
    w = rand(3, seed=1)
    out = fpar.shard(lambda b: torch.sin(w) * b, mesh_of(X2Y3), P(), P())(rand(3, seed=2))
    torch.testing.assert_close(out, torch.sin(w) * rand(3, seed=2))


def test_same_sharded_function_on_new_shapes():
    """No stale per-shape state: one sharded function, several global shapes and layouts."""
    f, r = both(lambda c, a: c.psum(a * a, "x"), X2Y3, P(("x", "y")), P("y"))
    for shape in ((6,), (12, 2), (6, 1, 3), (18,)):
        x = rand(*shape, seed=shape[0])
        assert_tree_close(f(x), r(x))


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: rand(4, 6).t(), id="transposed"),
        pytest.param(lambda: rand(1, 4).expand(6, 4), id="expanded-stride-0"),
        pytest.param(lambda: rand(6, 8)[:, ::2], id="strided-slice"),
    ],
)
def test_non_contiguous_inputs(make):
    x = make()
    f, r = both(lambda c, a: c.psum(a, "x") * 2, X2Y3, P(None, "x"), P(None, "y"))
    assert_tree_close(f(x), r(x.contiguous()))


def test_empty_dims():
    x = torch.zeros(0, 4, dtype=torch.float64)
    f, r = both(lambda c, a: c.psum(a, "x"), X2Y3, P("y"), P("y"))
    assert_tree_close(f(x), r(x))


def test_returning_a_closed_over_tensor():
    w = rand(3)
    assert torch.equal(fpar.shard(lambda: w, mesh_of(X2Y3), (), P())(), w)
    assert torch.equal(fpar.shard(lambda: w, mesh_of(X2Y3), (), P("y"))(), w.repeat(3))
