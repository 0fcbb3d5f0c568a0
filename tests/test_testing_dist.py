"""fpar.testing on a real mesh: ``distributed`` runs bodies on gloo processes; ``assert_equivalent``
places global inputs and gathers results there, and locates bugs exactly as in-process."""

from __future__ import annotations

import time

import pytest
import torch

import fpar
from fpar import P
from fpar.testing import assert_equivalent, distributed

pytestmark = pytest.mark.multiprocess


def _rand(*shape, seed=0, dtype=torch.float64):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def row_parallel(x, w):
    return fpar.psum(x @ w, "tensor")


def row_parallel_no_psum(x, w):
    return x @ w


@distributed(2, timeout=120)
def test_kit_on_real_mesh():
    mesh = fpar.make_mesh((2,), ("tensor",))
    assert mesh.backend == "dist"
    x, w = _rand(4, 6, seed=1), _rand(6, 5, seed=2)
    assert_equivalent(torch.matmul, row_parallel, mesh, (P(None, "tensor"), P("tensor")), P(), x, w)
    with pytest.raises(AssertionError) as info:
        assert_equivalent(torch.matmul, row_parallel_no_psum, mesh, (P(None, "tensor"), P("tensor")), P(), x, w)
    msg = str(info.value)
    assert msg.startswith("value out of row_parallel_no_psum differs from the reference")
    assert "in the devices at tensor=0; tensor=1 (2 of 2)" in msg

    def bad_block(x):  # rank 1's block is off
        return torch.where(fpar.axis_index("tensor") == 1, x * 2, x)

    with pytest.raises(AssertionError, match=r"in the devices at tensor=1 \(1 of 2\)"):
        assert_equivalent(lambda x: x, bad_block, mesh, P("tensor"), P("tensor"), x)
    # a pytree with a replicated parameter, a split batch, gradients w.r.t. both
    params = {"w1": _rand(6, 8, seed=3), "w2": _rand(8, 6, seed=4)}

    def mlp(p, x):
        return fpar.psum(torch.tanh(x @ p["w1"]) @ p["w2"], "tensor")

    assert_equivalent(
        lambda p, x: torch.tanh(x @ p["w1"]) @ p["w2"],
        mlp,
        mesh,
        ({"w1": P(None, "tensor"), "w2": P("tensor")}, P()),
        P(),
        params,
        x,
    )


@distributed(2, timeout=60)
def _rank1_raises():
    fpar.make_mesh((2,), ("tensor",))
    if torch.distributed.get_rank() == 1:
        raise ValueError("only rank 1 fails")


@distributed(2, timeout=4)
def _hangs():
    fpar.make_mesh((2,), ("tensor",))
    if torch.distributed.get_rank() == 0:
        time.sleep(600)
    torch.distributed.barrier()


def test_distributed_names_the_failing_rank():
    with pytest.raises(fpar.LaunchError) as info:
        _rank1_raises()
    msg = str(info.value)
    assert msg.startswith("fpar.testing.distributed(_rank1_raises): ")
    assert "rank 1" in msg and "ValueError: only rank 1 fails" in msg


def test_distributed_timeout_stops_a_hang():
    start = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        _hangs()
    assert time.monotonic() - start < 60
    msg = str(info.value)
    assert msg.startswith("fpar.testing.distributed(_hangs): the body did not finish within 4s on 2 processes")
    assert "--- rank 0 ---" in msg and "_hangs" in msg


def test_distributed_rejects_local_functions():
    with pytest.raises(TypeError, match="define it at the top level of a module"):

        @distributed(2)
        def body():
            pass
