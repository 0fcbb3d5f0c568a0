"""fpar.shard_map: JAX's spelling of fpar.shard (same engine)."""

from __future__ import annotations

import pytest
import torch

import fpar
from fpar import P

MESH = fpar.make_mesh((2, 2), ("data", "tensor"))


def _loss(w, x):
    return fpar.pmean(fpar.psum((x @ w).tanh().sum(), "tensor"), "data")


def test_shard_map_equals_shard_and_the_unsharded_function():
    gen = torch.Generator().manual_seed(0)
    w, x = (
        torch.randn(3, 4, generator=gen, dtype=torch.float64),
        torch.randn(6, 3, generator=gen, dtype=torch.float64),
    )
    specs = (P(None, "tensor"), P("data"))
    mapped = fpar.shard_map(_loss, mesh=MESH, in_specs=specs, out_specs=P())
    plain = fpar.shard(_loss, MESH, specs, P())
    want = (x @ w).tanh().sum() / 2  # pmean over 2 data shards of per-shard sums
    torch.testing.assert_close(mapped(w, x), want)
    torch.testing.assert_close(mapped(w, x), plain(w, x), rtol=0, atol=0)
    torch.testing.assert_close(torch.func.grad(mapped)(w, x), torch.func.grad(plain)(w, x), rtol=0, atol=0)


def test_shard_map_as_a_decorator():
    @fpar.shard_map(mesh=MESH, in_specs=(P(None, "tensor"), P("data")), out_specs=P())
    def loss(w, x):
        return _loss(w, x)

    w, x = torch.ones(3, 4), torch.ones(6, 3)
    torch.testing.assert_close(loss(w, x), torch.tensor(3.0).tanh() * 24 / 2)


def test_check_vma_is_the_replication_check():
    def f(x):
        return x * 2  # varies over 'data'

    with pytest.raises(fpar.ReplicationError, match="varies over mesh axis 'data'"):
        fpar.shard_map(f, mesh=MESH, in_specs=P("data"), out_specs=P())(torch.arange(4.0))
    out = fpar.shard_map(f, mesh=MESH, in_specs=P("data"), out_specs=P(), check_vma=False)(torch.arange(4.0))
    torch.testing.assert_close(out, torch.tensor([0.0, 2.0]))  # the block at coordinate 0


def test_keywords_are_required():
    with pytest.raises(TypeError):
        fpar.shard_map(_loss, MESH, P(), P())  # JAX's signature: mesh and specs are keyword-only
