"""GPU tier: the same programs on CUDA tensors (in-process) and over NCCL (real mesh).

Skipped without CUDA: the CPU tiers cover the semantics; this tier checks the device paths.
"""

import pytest
import torch

import fpar
from fpar import P

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _megatron_loss(params, x, y):
    h = torch.relu(x @ params["w1"])
    out = fpar.psum(h @ params["w2"], "tensor")
    mask = (fpar.axis_index("data") >= 0).to(out.dtype)  # axis_index on the inputs' device
    return fpar.pmean((((out - y) ** 2) * mask).mean(), "data")


def test_in_process_mesh_on_cuda_equals_cpu():
    torch.manual_seed(0)
    mesh = fpar.make_mesh((2, 2), ("data", "tensor"))
    specs = {"w1": P(None, "tensor"), "w2": P("tensor", None)}
    f = fpar.shard(_megatron_loss, mesh, (specs, P("data"), P("data")), P())
    params = {"w1": torch.randn(8, 16, dtype=torch.float64), "w2": torch.randn(16, 8, dtype=torch.float64)}
    x, y = torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)
    cpu = torch.func.grad_and_value(f)(params, x, y)
    cuda = torch.func.grad_and_value(f)({k: v.cuda() for k, v in params.items()}, x.cuda(), y.cuda())
    torch.testing.assert_close(cuda[1].cpu(), cpu[1])
    for k in params:
        torch.testing.assert_close(cuda[0][k].cpu(), cpu[0][k])


def _nccl_psum():
    torch.cuda.set_device(torch.distributed.get_rank())
    mesh = fpar.make_mesh((2,), ("data",))
    f = fpar.shard(lambda v: fpar.psum(v * v, "data"), mesh, P("data"), P())
    v = fpar.device_put(torch.arange(4.0, device="cuda"), mesh, P("data"))
    return f(v).cpu(), torch.func.grad(lambda b: f(b).sum())(v).cpu()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices for NCCL")
def test_nccl_real_mesh_equals_in_process():
    got = fpar.launch(_nccl_psum, 2, backend="nccl", timeout=120)
    v = torch.arange(4.0)
    want = (v * v).reshape(2, 2).sum(0)
    for value, _ in got:
        torch.testing.assert_close(value, want)
    torch.testing.assert_close(torch.cat([g for _, g in got]), 2 * v)


def _nccl_dp_grads():
    """A data-parallel step on NCCL: fpar.init on the GPU, bucketed async gradient all-reduce."""
    mesh = fpar.make_mesh((2,), ("data",))
    params = fpar.init({"w": fpar.normal((8, 4)), "b": fpar.zeros((4,))}, mesh, P(), seed=0)
    assert all(p.is_cuda for p in params.values()), "fpar.init must allocate on this rank's GPU"
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 8, generator=gen), torch.randn(6, 4, generator=gen)
    xl, yl = fpar.device_put((x.cuda(), y.cuda()), mesh, P("data"))

    def loss(p, x, y):
        return fpar.pmean(((x @ p["w"] + p["b"] - y) ** 2).mean(), "data")

    f = fpar.shard(loss, mesh, (P(), P("data"), P("data")), P(), bucket_mb=1e-5)
    grads = [torch.func.grad(f)(params, xl, yl) for _ in range(3)][-1]  # steady state: the fast path
    return {k: v.cpu() for k, v in params.items()}, {k: v.cpu() for k, v in grads.items()}, x, y


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices for NCCL")
def test_nccl_data_parallel_grads_equal_unsharded():
    got = fpar.launch(_nccl_dp_grads, 2, backend="nccl", timeout=120)
    params, _, x, y = got[0]
    want = torch.func.grad(lambda p: ((x @ p["w"] + p["b"] - y) ** 2).mean())(params)
    for _, grads, _, _ in got:
        for k in want:
            torch.testing.assert_close(grads[k], want[k])
