"""Communication accounting (fpar.comm_stats): what the real mesh would send, per device."""

import pytest
import torch

import fpar
from fpar import P


@pytest.fixture(autouse=True)
def _fresh_stats():
    fpar.reset_comm_stats()
    yield
    fpar.reset_comm_stats()


def _ring_allreduce(n, nbytes):
    return 2 * (n - 1) * nbytes // n


def test_replicated_param_used_twice_is_all_reduced_once():
    # The same weight in two ops: one gradient all-reduce over 'data', as DDP does.
    mesh = fpar.make_mesh((4,), ("data",))
    w, x = torch.randn(8, 8, dtype=torch.float64), torch.randn(16, 8, dtype=torch.float64)

    def loss(w, x):
        return fpar.pmean(((x @ w) @ w).square().mean(), "data")

    sharded = fpar.shard(loss, mesh, (P(), P("data")), P())
    grad = torch.func.grad(sharded)(w, x)
    stats = fpar.comm_stats()["data"]
    assert stats["psum"] == {"calls": 1, "bytes": _ring_allreduce(4, w.numel() * 8)}
    assert stats["pmean"] == {"calls": 1, "bytes": _ring_allreduce(4, 8)}
    torch.testing.assert_close(grad, torch.func.grad(lambda w: ((x @ w) @ w).square().mean())(w))


def test_a_view_used_elsewhere_is_its_own_use():
    # w and w.T are different tensors: each varying use is all-reduced (as in JAX); documented.
    mesh = fpar.make_mesh((2,), ("data",))
    w, x = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)
    f = fpar.shard(lambda w, x: fpar.pmean(((x @ w) @ w.T).sum(), "data"), mesh, (P(), P("data")), P())
    torch.func.grad(f)(w, x)
    assert fpar.comm_stats()["data"]["psum"]["calls"] == 2


def test_invariant_use_is_not_all_reduced():
    # A replicated weight applied to a replicated value needs no gradient sync: computed once.
    mesh = fpar.make_mesh((2,), ("data",))
    g, x = torch.randn(4, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)
    f = fpar.shard(lambda g, x: (fpar.pmean(x.sum(0), "data") * g).sum(), mesh, (P(), P("data")), P())
    grad = torch.func.grad(f)(g, x)
    assert "psum" not in fpar.comm_stats()["data"]
    torch.testing.assert_close(grad, x.sum(0) / 2)  # d/dg of (sum over all rows / 2) . g


def test_no_backward_traffic_without_gradient():
    mesh = fpar.make_mesh((2,), ("data",))
    w, x = torch.randn(4, 4), torch.randn(8, 4)
    fpar.shard(lambda w, x: fpar.pmean((x @ w).sum(), "data"), mesh, (P(), P("data")), P())(w, x)
    assert set(fpar.comm_stats()["data"]) == {"pmean"}


def test_all_gather_transpose_counted_as_psum_scatter():
    mesh = fpar.make_mesh((4,), ("i",))
    x = torch.randn(8, 3, dtype=torch.float64)
    f = fpar.shard(lambda b: fpar.psum(fpar.all_gather(b, "i", tiled=True).sum(), "i"), mesh, P("i"), P())
    torch.func.grad(f)(x)
    block = 2 * 3 * 8  # bytes of one device's (2, 3) float64 block
    stats = fpar.comm_stats()["i"]
    assert stats["all_gather"] == {"calls": 1, "bytes": 3 * block}  # (n-1) x block
    assert stats["psum_scatter"] == {"calls": 1, "bytes": 3 * 4 * block // 4}  # (n-1)/n x gathered


def test_tuple_axes_keyed_in_written_order_and_reset():
    mesh = fpar.make_mesh((2, 2), ("x", "y"))
    fpar.shard(lambda v: fpar.psum(v, ("y", "x")), mesh, P(("x", "y")), P())(torch.ones(4))
    assert fpar.comm_stats() == {"y,x": {"psum": {"calls": 1, "bytes": _ring_allreduce(4, 4)}}}
    fpar.reset_comm_stats()
    assert fpar.comm_stats() == {}


# pvary: replicated -> varying; its transpose sums over the axis ------------------------------------


def test_pvary_makes_a_replicated_value_varying():
    mesh = fpar.make_mesh((2,), ("i",))
    w = torch.arange(3.0)
    with pytest.raises(fpar.ReplicationError, match="varies over mesh axis 'i'"):
        fpar.shard(lambda w: fpar.pvary(w, "i"), mesh, P(), P())(w)
    out = fpar.shard(lambda w: fpar.pvary(w, "i")[None], mesh, P(), P("i"))(w)
    torch.testing.assert_close(out, torch.stack([w, w]))


def test_pvary_transpose_sums_over_the_axis():
    mesh = fpar.make_mesh((4,), ("i",))
    w, x = torch.randn(3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    f = fpar.shard(lambda w, x: (fpar.pvary(w, "i") * x).sum(0, keepdim=True), mesh, (P(), P("i")), P("i"))
    grad = torch.func.grad(lambda w: f(w, x).sum())(w)
    torch.testing.assert_close(grad, x.sum(0))  # the sum of every device's contribution


def test_pvary_before_an_inner_grad_gives_the_per_device_gradient():
    # The JAX recipe (pcast to varying) for jax-ml/jax#36886: mark the parameter varying first.
    mesh = fpar.make_mesh((4,), ("i",))
    w, x = torch.randn(3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)

    def per_device(w, x):
        local = torch.func.grad(lambda w: (w * x).sum())
        return local(fpar.pvary(w, "i"))[None], local(w)

    varying, summed = fpar.shard(per_device, mesh, (P(), P("i")), (P("i"), P()))(w, x)
    torch.testing.assert_close(varying, x)  # device k: its own x_k
    torch.testing.assert_close(summed, x.sum(0))  # without pvary: the psum, as in JAX
