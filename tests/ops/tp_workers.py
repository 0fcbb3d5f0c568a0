"""The real-mesh side of test_tensor_parallel: GPT-2 on 2 gloo processes (module-level: spawned)."""

from __future__ import annotations

import torch
import tp_models

import fpar


def worker():
    """Loss, gradients (gathered to global tensors) and forward traffic on a 2-process tensor axis."""
    torch.set_num_threads(1)
    mesh = fpar.make_mesh((2,), ("tensor",))
    return run(mesh)


def run(mesh: fpar.Mesh):
    model = tp_models.gpt2()
    apply_fn, params, specs = fpar.ops.tensor_parallel(model, mesh)
    params = fpar.device_put(params, mesh, specs)
    loss = tp_models.sharded_loss(apply_fn, mesh, specs, causal=True)
    ids = tp_models.batch()
    fpar.reset_comm_stats()
    value = loss(params, ids)
    stats = fpar.comm_stats()
    grads = torch.func.grad(loss)(params, ids)
    grads = fpar.gather(grads, mesh, specs)
    return value.detach(), apply_fn.export(grads), stats
