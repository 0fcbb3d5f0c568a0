"""The real-mesh side of test_tensor_parallel: GPT-2 on 2 gloo processes (module-level: spawned)."""

from __future__ import annotations

import torch
import tp_models

import fpar


def worker():
    """Loss, gradients (gathered to global tensors) and forward traffic on a 2-process tensor axis."""
    torch.set_num_threads(1)
    mesh = fpar.make_mesh((2,), ("tensor",))
    return run(mesh), whole_params_error(mesh)


def whole_params_error(mesh: fpar.Mesh) -> str:
    """The error for the global tensors passed without ``device_put``: a Linear stack, where a whole
    column-parallel weight would run (and the row-parallel sum double the output) if unchecked."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    apply_fn, params, specs = fpar.ops.tensor_parallel(model, mesh, plan={"0": "colwise", "2": "rowwise"})
    f = fpar.shard(apply_fn, mesh, (specs, fpar.P()), fpar.P())
    try:
        f(params, torch.ones(3, 4))
    except ValueError as e:
        return str(e)
    return "no error"


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
