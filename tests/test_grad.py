"""Gradients through fpar.shard equal those of the global function (reference or closed form).

Everything is float64. torch.func.grad / vjp / jvp and .backward() are all exercised.
"""

from __future__ import annotations

import pytest
import torch
from harness import (
    assert_tree_close,
    both,
    case_specs,
    collective_cases,
    fpar_fn,
    mesh_of,
    rand,
    scalar_loss,
    weighted_sum,
)

import fpar
from fpar import P

X2Y3 = {"x": 2, "y": 3}


# ----------------------------------------------------------------------------------------------
# Every collective's transpose: grad of <out, r> against the reference


@pytest.mark.parametrize(("axes", "ax", "prog", "block", "varies"), collective_cases())
def test_collective_grad_matches_reference(axes, ax, prog, block, varies):
    shape, in_spec, out_spec = case_specs(axes, ax, block, varies)
    x = rand(*shape, seed=3)
    f, r = both(prog, axes, in_spec, out_spec)
    gf = torch.func.grad(scalar_loss(f))(x)
    gr = torch.func.grad(scalar_loss(r))(x)
    assert_tree_close(gf, gr, what="grad")


@pytest.mark.parametrize(("axes", "ax", "prog", "block", "varies"), collective_cases()[::7])
def test_collective_grad_with_replicated_input(axes, ax, prog, block, varies):
    """Input replicated over every axis (P()): each device's cotangent must be summed into it."""
    shape, _, out_spec = case_specs(axes, ax, block, varies)
    x = rand(*block, seed=4)
    f, r = both(lambda c, a: prog(c, a * (c.axis_index(tuple(axes)) + 1)), axes, P(), out_spec)
    gf = torch.func.grad(scalar_loss(f))(x)
    gr = torch.func.grad(scalar_loss(r))(x)
    assert_tree_close(gf, gr, what="grad")


@pytest.mark.parametrize(("axes", "ax", "prog", "block", "varies"), collective_cases()[1::5])
def test_collective_vjp_and_backward(axes, ax, prog, block, varies):
    shape, in_spec, out_spec = case_specs(axes, ax, block, varies)
    x = rand(*shape, seed=5)
    f, r = both(prog, axes, in_spec, out_spec)
    out_f, vjp_f = torch.func.vjp(f, x)
    out_r, vjp_r = torch.func.vjp(r, x)
    assert_tree_close(out_f, out_r)
    ct = rand(*out_r.shape, seed=6) if out_r.is_floating_point() else None
    assert_tree_close(vjp_f(ct), vjp_r(ct), what="vjp")

    xf = x.clone().requires_grad_()
    xr = x.clone().requires_grad_()
    weighted_sum(f(xf)).backward()
    weighted_sum(r(xr)).backward()
    assert_tree_close(xf.grad, xr.grad, what=".backward()")


@pytest.mark.parametrize(("axes", "ax", "prog", "block", "varies"), collective_cases()[2::6])
def test_collective_jvp(axes, ax, prog, block, varies):
    shape, in_spec, out_spec = case_specs(axes, ax, block, varies)
    x, t = rand(*shape, seed=7), rand(*shape, seed=8)
    f, r = both(prog, axes, in_spec, out_spec)
    assert_tree_close(torch.func.jvp(f, (x,), (t,)), torch.func.jvp(r, (x,), (t,)), what="jvp")


# ----------------------------------------------------------------------------------------------
# Replicated inputs: the data-parallel gradient all-reduce


def _mse(w, b, x, y):
    return ((torch.tanh(x @ w + b) - y) ** 2).mean()


@pytest.mark.parametrize(
    "axes",
    [{"data": 4}, {"data": 2, "other": 2}, {"other": 3, "data": 2}],
    ids=["data4", "data2-other2", "other3-data2"],
)
def test_data_parallel_grad(axes):
    def prog(c, params, x, y):
        return c.pmean(_mse(params["w"], params["b"], x, y), "data")

    params = {"w": rand(3, 2, seed=1), "b": rand(2, seed=2)}
    x, y = rand(8, 3, seed=3), rand(8, 2, seed=4)
    # 'other' (if any) is not mentioned anywhere: everything is replicated over it
    f = fpar_fn(prog, axes, (P(), P("data"), P("data")), P())
    unsharded = lambda p, x, y: _mse(p["w"], p["b"], x, y)  # noqa: E731
    torch.testing.assert_close(f(params, x, y), unsharded(params, x, y))
    g = torch.func.grad(f)(params, x, y)
    assert_tree_close(g, torch.func.grad(unsharded)(params, x, y), what="grad")
    gx = torch.func.grad(f, argnums=(1, 2))(params, x, y)
    assert_tree_close(gx, torch.func.grad(unsharded, argnums=(1, 2))(params, x, y), what="grad x,y")


def test_data_parallel_backward():
    axes = {"data": 4}
    w = rand(3, 2, seed=1).requires_grad_()
    b = rand(2, seed=2).requires_grad_()
    x, y = rand(8, 3, seed=3), rand(8, 2, seed=4)
    f = fpar.shard(
        lambda p, x, y: fpar.pmean(_mse(p[0], p[1], x, y), "data"),
        mesh_of(axes),
        ((P(), P()), P("data"), P("data")),
        P(),
    )
    f((w, b), x, y).backward()
    w2, b2 = w.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    _mse(w2, b2, x, y).backward()
    torch.testing.assert_close(w.grad, w2.grad)
    torch.testing.assert_close(b.grad, b2.grad)


def test_per_device_outputs_summed_outside():
    """out_specs P('b'): d/dw sum_devices (w * x_local).sum() = sum(x) (JAX case G02)."""
    axes = {"b": 4}
    w, x = rand(3, seed=1), rand(8, 3, seed=2)
    f = fpar.shard(lambda w, x: (w * x).sum()[None], mesh_of(axes), (P(), P("b")), P("b"))
    g = torch.func.grad(lambda w: f(w, x).sum())(w)
    torch.testing.assert_close(g, x.sum(0))


@pytest.mark.parametrize(("axes", "ax", "n"), [({"i": 4}, "i", 4), (X2Y3, "y", 3)], ids=["i4", "x2y3"])
def test_replicated_output_gradient_is_not_multiplied(axes, ax, n):
    """The cursed identity: shard(lambda x: x, P(), P()) has gradient 1, not mesh.size."""
    x = rand(5)
    f = fpar.shard(lambda a: a, mesh_of(axes), P(), P())
    g = torch.func.grad(lambda a: (f(a) * torch.arange(5.0, dtype=a.dtype)).sum())(x)
    torch.testing.assert_close(g, torch.arange(5.0, dtype=torch.float64))
    # psum of a replicated value is n * x; its gradient is n, not n * mesh.size
    f2 = fpar.shard(lambda a: fpar.psum(a, ax), mesh_of(axes), P(), P())
    g2 = torch.func.grad(lambda a: f2(a).sum())(x)
    torch.testing.assert_close(g2, torch.full((5,), float(n), dtype=torch.float64))


# ----------------------------------------------------------------------------------------------
# Closed-over tensors


def test_closed_over_grad_via_func_grad():
    x = rand(6, 4, seed=1)

    def make(c_fn):
        def outer(w):
            def prog(c, a):
                return c.psum(torch.sin(a @ w), ("y", "x"))

            return weighted_sum(c_fn(prog)(x))

        return outer

    w = rand(4, 2, seed=2)
    gf = torch.func.grad(make(lambda prog: fpar_fn(prog, X2Y3, P(("x", "y")), P())))(w)
    gr = torch.func.grad(make(lambda prog: both(prog, X2Y3, P(("x", "y")), P())[1]))(w)
    assert_tree_close(gf, gr, what="grad")
    # closed form: sum over all rows
    g_closed = torch.func.grad(lambda w: weighted_sum(torch.sin(x @ w).sum(0)))(w)
    torch.testing.assert_close(gf, g_closed)


def test_closed_over_grad_via_backward():
    w = rand(4, 2, seed=2).requires_grad_()
    x = rand(6, 4, seed=1)
    f = fpar.shard(
        lambda a: fpar.pmean((torch.sin(a @ w) ** 2).sum(), "x")[None], mesh_of(X2Y3), P(("x", "y")), P("y")
    )
    f(x).sum().backward()
    w2 = w.detach().clone().requires_grad_()
    # global: sum over y of mean over x of per-device sums = (1/2) * total sum
    (0.5 * (torch.sin(x @ w2) ** 2).sum()).backward()
    torch.testing.assert_close(w.grad, w2.grad)


# ----------------------------------------------------------------------------------------------
# pmax / pmin: gradient to the extreme, ties split evenly


@pytest.mark.parametrize("op", ["pmax", "pmin"])
@pytest.mark.parametrize(
    "values",
    [
        pytest.param([1.0, 3.0, 3.0, 2.0], id="tie-of-two"),
        pytest.param([5.0, 5.0, 5.0, 5.0], id="all-equal"),
        pytest.param([0.5, -1.0, 4.0, 2.0], id="unique"),
        pytest.param([-2.0, 1.0, -2.0, -2.0], id="tie-of-three"),
    ],
)
def test_pmax_pmin_gradient_ties(op, values):
    x = torch.tensor(values, dtype=torch.float64)
    f = fpar.shard(lambda a: getattr(fpar, op)(a, "i"), mesh_of({"i": 4}), P("i"), P())
    extreme = x.max() if op == "pmax" else x.min()
    torch.testing.assert_close(f(x), extreme[None])
    g = torch.func.grad(lambda a: f(a).sum())(x)
    hit = (x == extreme).to(x.dtype)
    torch.testing.assert_close(g, hit / hit.sum())
    r = both(lambda c, a: getattr(c, op)(a, "i"), {"i": 4}, P("i"), P())[1]
    torch.testing.assert_close(g, torch.func.grad(lambda a: r(a).sum())(x))


def test_pmax_elementwise_ties_over_tuple_axis():
    # column 0: a tie between devices 1 and 3; column 1: unique max
    x = torch.tensor(
        [[0.0, 1.0], [7.0, 2.0], [1.0, 9.0], [7.0, 3.0], [2.0, 4.0], [6.0, 0.0]], dtype=torch.float64
    )
    f, r = both(lambda c, a: c.pmax(a, ("y", "x")), X2Y3, P(("x", "y")), P())
    torch.testing.assert_close(f(x), torch.tensor([[7.0, 9.0]], dtype=torch.float64))
    g = torch.func.grad(lambda a: (f(a) * torch.tensor([[1.0, 10.0]], dtype=a.dtype)).sum())(x)
    expected = torch.zeros_like(x)
    expected[1, 0] = expected[3, 0] = 0.5
    expected[2, 1] = 10.0
    torch.testing.assert_close(g, expected)
    assert_tree_close(
        g, torch.func.grad(lambda a: (r(a) * torch.tensor([[1.0, 10.0]], dtype=a.dtype)).sum())(x)
    )


def test_pmax_of_replicated_input_gradient_is_one():
    """Replicated over the axis: every device ties; shares sum back to 1 in the replicated input."""
    x = rand(5)
    f = fpar.shard(lambda a: fpar.pmax(a, ("x", "y")), mesh_of(X2Y3), P(), P())
    g = torch.func.grad(lambda a: f(a).sum())(x)
    torch.testing.assert_close(g, torch.ones(5, dtype=torch.float64))


@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize(("axes", "ax"), [({"i": 2}, "i"), ({"x": 2, "y": 2}, ("x", "y"))])
def test_grad_inside_shard_through_all_gather_invariant(axes, ax, tiled):
    """The transpose of all_gather_invariant is this device's block of the replicated cotangent
    (JAX: a dynamic_slice at axis_index, no communication), differentiated inside the shard."""
    n = 1
    for size in axes.values():
        n *= size
    x = rand(2 * n, 3, seed=5)
    w = rand(*((2 * n, 3) if tiled else (n, 2, 3)), seed=6)

    def loss(g):
        return (torch.sin(g) * w).sum()

    def per_device(a):
        return torch.func.grad(lambda a: loss(fpar.all_gather_invariant(a, ax, tiled=tiled)))(a)

    got = fpar.shard(per_device, mesh_of(axes), (P(ax),), P(ax))(x)
    want = torch.func.grad(lambda x: loss(x if tiled else x.unflatten(0, (n, 2))))(x)
    torch.testing.assert_close(got, want)


# ----------------------------------------------------------------------------------------------
# Higher order


def test_grad_of_grad_linear_collectives():
    axes = {"x": 2, "y": 2}

    def prog(c, w, a):
        h = c.all_gather(torch.sin(a * w), "y", tiled=True)  # (4, 3) per device
        h = c.ppermute(h, ("y", "x"), [(i, (i + 1) % 4) for i in range(4)])
        h = c.psum_scatter(h**2, "y", tiled=True)
        return c.pmean(h.sum(), ("x", "y"))

    w = rand(3, seed=1)
    x = rand(8, 3, seed=2)
    f, r = both(prog, axes, (P(), P(("x", "y"))), P())

    def gg(fn):
        inner = torch.func.grad(fn, argnums=0)
        return torch.func.grad(lambda w: (inner(w, x) ** 2).sum())(w)

    assert_tree_close(gg(f), gg(r), what="grad of grad")
    hf = torch.func.hessian(lambda w: f(w, x))(w)
    hr = torch.func.hessian(lambda w: r(w, x))(w)
    assert_tree_close(hf, hr, what="hessian")


def test_grad_of_grad_via_autograd():
    w = rand(3, seed=1).requires_grad_()
    x = rand(8, 3, seed=2)
    f = fpar.shard(
        lambda w, a: fpar.psum((torch.sin(a * w) ** 2).sum(), "i"), mesh_of({"i": 4}), (P(), P("i")), P()
    )
    (g,) = torch.autograd.grad(f(w, x), w, create_graph=True)
    (gg,) = torch.autograd.grad(g.sum(), w)
    w2 = w.detach().clone().requires_grad_()
    (g2,) = torch.autograd.grad((torch.sin(x * w2) ** 2).sum(), w2, create_graph=True)
    (gg2,) = torch.autograd.grad(g2.sum(), w2)
    torch.testing.assert_close(g, g2)
    torch.testing.assert_close(gg, gg2)


def test_jvp_of_program_with_replicated_and_split_inputs():
    def prog(c, w, a):
        h = c.all_to_all(torch.tanh(a @ w), "y", 1, 0, tiled=True)
        return c.psum(h, "x"), c.axis_index("y") * h

    w, x = rand(3, 3, seed=1), rand(12, 3, seed=2)
    tw, tx = rand(3, 3, seed=3), rand(12, 3, seed=4)
    f, r = both(prog, X2Y3, (P(), P(("x", "y"))), (P("y"), P(("x", "y"))))
    assert_tree_close(torch.func.jvp(f, (w, x), (tw, tx)), torch.func.jvp(r, (w, x), (tw, tx)), what="jvp")


def test_jvp_matches_unsharded():
    x, t = rand(8, 3, seed=1), rand(8, 3, seed=2)
    f = fpar.shard(lambda a: fpar.psum(torch.sin(a).sum(0), "i"), mesh_of({"i": 4}), P("i"), P())
    out, tangent = torch.func.jvp(f, (x,), (t,))
    out2, tangent2 = torch.func.jvp(lambda a: torch.sin(a).sum(0), (x,), (t,))
    torch.testing.assert_close(out, out2)
    torch.testing.assert_close(tangent, tangent2)


# ----------------------------------------------------------------------------------------------
# Megatron-style MLP (DESIGN.md §1)


def _mlp_loss(params, x, y):
    return ((torch.relu(x @ params["w1"]) @ params["w2"] - y) ** 2).mean()


def test_megatron_mlp_value_and_grads():
    mesh = fpar.make_mesh((2, 4), ("data", "tensor"))

    def loss(params, x, y):
        h = x @ params["w1"]
        out = fpar.psum(torch.relu(h) @ params["w2"], "tensor")
        return fpar.pmean(((out - y) ** 2).mean(), "data")

    specs = {"w1": P(None, "tensor"), "w2": P("tensor", None)}
    sharded = fpar.shard(loss, mesh, in_specs=(specs, P("data"), P("data")), out_specs=P())
    params = {"w1": rand(5, 16, seed=1), "w2": rand(16, 3, seed=2)}
    x, y = rand(6, 5, seed=3), rand(6, 3, seed=4)

    torch.testing.assert_close(sharded(params, x, y), _mlp_loss(params, x, y))
    g = torch.func.grad(sharded)(params, x, y)
    assert_tree_close(g, torch.func.grad(_mlp_loss)(params, x, y), what="grad params")
    gxy = torch.func.grad(sharded, argnums=(1, 2))(params, x, y)
    assert_tree_close(gxy, torch.func.grad(_mlp_loss, argnums=(1, 2))(params, x, y), what="grad x,y")

    # .backward() too
    leaf = {k: v.clone().requires_grad_() for k, v in params.items()}
    sharded(leaf, x, y).backward()
    assert_tree_close({k: v.grad for k, v in leaf.items()}, g, what=".backward()")


def test_grad_through_pytree_outputs_and_static_args():
    def prog(c, params, x, mode):
        h = torch.tanh(x @ params["w"]) if mode == "tanh" else x @ params["w"]
        return {
            "loss": c.pmean((h * h).sum(), ("x", "y")),
            "h": c.all_gather(h, "y", axis=1, tiled=True),
            "b": [params["b"] * c.axis_index("x"), c.psum_scatter(params["b"], "y", tiled=True)],
        }

    params = {"w": rand(4, 3, seed=1), "b": rand(6, seed=2)}
    x = rand(12, 4, seed=3)
    in_specs = ({"w": P(None, "y"), "b": P()}, P(("x", "y")), None)
    out_specs = {"loss": P(), "h": P(("x", "y")), "b": [P("x"), P("y")]}
    f, r = both(prog, X2Y3, in_specs, out_specs)
    assert_tree_close(f(params, x, "tanh"), r(params, x, "tanh"))
    gf = torch.func.grad(scalar_loss(f), argnums=(0, 1))(params, x, "tanh")
    gr = torch.func.grad(scalar_loss(r), argnums=(0, 1))(params, x, "tanh")
    assert_tree_close(gf, gr, what="grad")

    leaf = {k: v.clone().requires_grad_() for k, v in params.items()}
    weighted_sum(f(leaf, x, "tanh")).backward()
    assert_tree_close({k: v.grad for k, v in leaf.items()}, gr[0], what=".backward()")


def test_same_tensor_passed_twice_with_different_specs():
    x = rand(6, 6)

    def prog(c, a, b):
        return c.psum(a * b.sum(), ("x", "y"))

    f, r = both(prog, X2Y3, (P(("x", "y")), P(None, "y")), P())
    assert_tree_close(f(x, x), r(x, x))
    gf = torch.func.grad(lambda x: scalar_loss(f)(x, x))(x)
    gr = torch.func.grad(lambda x: scalar_loss(r)(x, x))(x)
    assert_tree_close(gf, gr, what="grad")
    leaf = x.clone().requires_grad_()
    scalar_loss(f)(leaf, leaf).backward()
    assert_tree_close(leaf.grad, gr, what=".backward()")


@pytest.mark.parametrize("out_spec", [P(), P("y")], ids=["P()", "P(y)"])
def test_grad_of_closed_over_tensor_returned_directly(out_spec):
    """w returned as is (P(): one copy; P('y'): 3 tiled copies): gradient counts each copy once."""
    w = rand(3)
    copies = 1 if out_spec == P() else 3

    def outer(w):
        return fpar.shard(lambda: w, mesh_of(X2Y3), (), out_spec)().sum()

    torch.testing.assert_close(
        torch.func.grad(outer)(w), torch.full((3,), float(copies), dtype=torch.float64)
    )
