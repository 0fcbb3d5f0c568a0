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


def _kit_on_real_mesh():
    """assert_equivalent on a real mesh: passes a right layout, locates wrong ones as in-process."""
    mesh = fpar.make_mesh((2,), ("tensor",))
    assert mesh.backend == "dist"
    x, w = _rand(4, 6, seed=1), _rand(6, 5, seed=2)
    assert_equivalent(torch.matmul, row_parallel, mesh, (P(None, "tensor"), P("tensor")), P(), x, w)
    with pytest.raises(AssertionError) as info:
        assert_equivalent(
            torch.matmul, row_parallel_no_psum, mesh, (P(None, "tensor"), P("tensor")), P(), x, w
        )
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


def _collective_sample():
    """A few programs ``prog(c, x)`` over a 2-device axis: (name, prog, block shape, out varies)."""
    n = 2
    return [
        ("psum", lambda c, x: c.psum(x, "tensor"), (2, 3), False),
        ("pmean", lambda c, x: c.pmean(x, "tensor"), (2, 3), False),
        ("pmax", lambda c, x: c.pmax(x, "tensor"), (2, 3), False),
        ("all_gather", lambda c, x: c.all_gather(x, "tensor", axis=1, tiled=True), (2, 3), True),
        (
            "psum_scatter",
            lambda c, x: c.psum_scatter(x, "tensor", scatter_dimension=1, tiled=True),
            (2, 2 * n),
            True,
        ),
        ("ppermute", lambda c, x: c.ppermute(x, "tensor", [(0, 1), (1, 0)]), (2, 3), True),
        ("all_to_all", lambda c, x: c.all_to_all(x, "tensor", 1, 0, tiled=True), (2, 2 * n), True),
    ]


@distributed(2, timeout=120)
def test_kit_and_reference_sample_on_real_mesh():
    """One launch (processes are slow to start): the kit on a real mesh, then a small sample of the
    in-process property suite on gloo processes: collectives on bfloat16 (and float32, int64)
    against the independent reference; matmul routing under autocast, F.linear by keyword, and a
    keyword argument."""
    import torch.nn.functional as F

    _kit_on_real_mesh()
    from harness import FPAR
    from reference import shard_reference

    mesh = fpar.make_mesh((2,), ("tensor",))
    axes = {"tensor": 2}
    for name, prog, block, varies in _collective_sample():
        for dtype in (
            (torch.bfloat16, torch.float32, torch.int64)
            if name in ("psum", "all_gather")
            else (torch.bfloat16,)
        ):
            x = (_rand(2 * block[0], *block[1:], seed=len(name)) * 4).to(dtype)
            out = P("tensor") if varies else P()

            def per_device(x, prog=prog):
                return prog(FPAR, x)

            per_device.__name__ = f"{name}_{dtype}"
            assert_equivalent(
                shard_reference(prog, axes, P("tensor"), out), per_device, mesh, P("tensor"), out, x
            )

    x, w, b = (
        _rand(4, 6, seed=1, dtype=torch.float32),
        _rand(8, 6, seed=2, dtype=torch.float32),
        _rand(8, seed=3, dtype=torch.float32),
    )

    def linear(x, w, b):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return F.linear(x, weight=w, bias=b)

    # bf16 arithmetic in fp32 tensors: the replicated x's gradient is summed from two bf16 partial
    # products on the real mesh, from one in the reference, so bf16's tolerance applies
    assert_equivalent(
        linear,
        linear,
        mesh,
        (P(), P("tensor"), P("tensor")),
        P(None, "tensor"),
        x,
        w,
        b,
        rtol=2e-2,
        atol=1e-2,
    )

    def scaled(x, *, s):
        return x * s

    got = fpar.shard(scaled, mesh, P("tensor"), P("tensor"))(
        fpar.device_put(x, mesh, P("tensor")), s=torch.tensor(2.0)
    )
    torch.testing.assert_close(fpar.gather(got, mesh, P("tensor")), x * 2)


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
    assert msg.startswith(
        "fpar.testing.distributed(_hangs): the body did not finish within 4s on 2 processes"
    )
    assert "--- rank 0 ---" in msg and "_hangs" in msg


def test_distributed_rejects_local_functions():
    with pytest.raises(TypeError, match="define it at the top level of a module"):

        @distributed(2)
        def body():
            pass
