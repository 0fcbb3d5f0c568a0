"""1D tensor-parallel MLP training step: fpar.ops (Megatron layout) against DTensor, side by side.

Both sides train the same MLP ``gelu(x W_in + b_in) W_out + b_out`` (float32, MSE loss, SGD) on
the same batch, tensor-parallel over 2 gloo processes (``W_in`` split by columns, ``W_out`` by
rows: one all-reduce forward, one backward):

* **fpar**: ``mesh = fpar.make_mesh((2,), ("tensor",))``; ``fpar.ops.mlp`` (``column_linear``
  -> GeLU -> ``row_linear``, whose ``psum`` is Megatron's ``g``; the input gradient's all-reduce,
  Megatron's ``f``, is the transpose of fpar's implicit ``pvary``) inside
  ``torch.func.grad(fpar.shard(loss, mesh, (fpar.ops.mlp_specs("tensor"), P(), P()), P()))``;
  parameters are this process's blocks (``fpar.device_put``); update ``torch._foreach_add_``.
* **DTensor**: ``nn.Sequential(Linear(D, H), GELU(), Linear(H, D))`` parallelized with
  ``parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})``,
  ``loss.backward()``, ``torch.optim.SGD(foreach=True)``.

The same weights on both sides (``W_in = Linear.weight.T``).  Checked once: the gradients of
every parameter agree (fpar's gathered with ``fpar.gather``, DTensor's with ``full_tensor``).
The 2 processes start once (``fpar.launch``), 1 thread each; steps are warmed up, then timed
interleaved (order alternating), each after a ``dist.barrier()``.  Medians from rank 0, ratio
fpar/DTensor (target <= 1.0).  ``--profile`` prints both sides' ``torch.profiler`` op tables.

Run:
    python bench/tp_dtensor.py                       # 30 repeats, B=64 (tokens) D=512 H=2048
    python bench/tp_dtensor.py --batch 256 --profile

Shape suffixes: B tokens (replicated on both processes), D model width, H hidden width.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

try:
    import fpar
except ImportError:  # run from a checkout without installing: use the repo's fpar/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import fpar
from _common import Record, add_json_arg, backward_step, interleaved, profile_table

from fpar import P

NPROCS = 2
LR = 0.01


def loss_local(params, x_BD, y_BD):
    """Per-device loss: the Megatron MLP (replicated in, replicated out), MSE."""
    return F.mse_loss(fpar.ops.mlp(params, x_BD, axis="tensor"), y_BD)


def worker(cfg: dict) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.set_num_threads(cfg["threads"])
    B, D, H = cfg["batch"], cfg["dim"], cfg["hidden"]
    world = dist.get_world_size()
    mesh = fpar.make_mesh((world,), ("tensor",))
    gen = torch.Generator().manual_seed(0)
    full = {
        "w_in": torch.randn(D, H, generator=gen) * D**-0.5,
        "b_in": torch.randn(H, generator=gen) * 0.1,
        "w_out": torch.randn(H, D, generator=gen) * H**-0.5,
        "b_out": torch.randn(D, generator=gen) * 0.1,
    }
    x_BD, y_BD = torch.randn(B, D, generator=gen), torch.randn(B, D, generator=gen)
    specs = fpar.ops.mlp_specs("tensor")
    keys = list(full)

    # (a) fpar
    params = fpar.device_put(full, mesh, specs)
    grad_fn = torch.func.grad(fpar.shard(loss_local, mesh, (specs, P(), P()), P()))
    plist = [params[k] for k in keys]

    def fpar_step():
        g = grad_fn(params, x_BD, y_BD)
        torch._foreach_add_(plist, [g[k] for k in keys], alpha=-LR)

    # (a') fpar, PyTorch style: leaf parameters, .backward(), update from .grad
    f_bw = fpar.shard(loss_local, mesh, (specs, P(), P()), P())
    fpar_bw_step = backward_step(f_bw, params, keys, x_BD, y_BD, lr=LR)

    # (b) DTensor
    dmesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tensor",))
    model = nn.Sequential(nn.Linear(D, H), nn.GELU(), nn.Linear(H, D))
    with torch.no_grad():
        model[0].weight.copy_(full["w_in"].T)
        model[0].bias.copy_(full["b_in"])
        model[2].weight.copy_(full["w_out"].T)
        model[2].bias.copy_(full["b_out"])
    model = parallelize_module(model, dmesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = torch.optim.SGD(model.parameters(), lr=LR, foreach=True)

    def dtensor_step():
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(x_BD), y_BD).backward()
        opt.step()

    # The gradients agree, once, from the same parameters.
    g = fpar.gather(grad_fn(params, x_BD, y_BD), mesh, specs)
    opt.zero_grad(set_to_none=True)
    F.mse_loss(model(x_BD), y_BD).backward()
    theirs = {
        "w_in": model[0].weight.grad.full_tensor().T,
        "b_in": model[0].bias.grad.full_tensor(),
        "w_out": model[2].weight.grad.full_tensor().T,
        "b_out": model[2].bias.grad.full_tensor(),
    }
    worst = 0.0
    for k in keys:
        rel = ((g[k] - theirs[k]).norm() / theirs[k].norm()).item()
        worst = max(worst, rel)
        if rel > 1e-5:
            raise AssertionError(
                f"the gradient of {k} differs, fpar vs DTensor: relative norm diff {rel:.3e}"
            )
    opt.zero_grad(set_to_none=True)

    for _ in range(cfg["warmup"]):
        fpar_step()
        fpar_bw_step()
        dtensor_step()
    profiles = {}
    if cfg["profile"]:
        profiles = {
            "fpar": profile_table(fpar_step),
            "fpar .backward()": profile_table(fpar_bw_step),
            "dtensor": profile_table(dtensor_step),
        }
    fpar.reset_comm_stats()
    fpar_step()
    stats = fpar.comm_stats().get("tensor", {})

    times = interleaved({"fpar": fpar_step, "fpar_bw": fpar_bw_step, "dtensor": dtensor_step}, cfg["repeats"])
    return {
        "times": times,
        "worst_rel": worst,
        "stats": stats,
        "profiles": profiles,
        "threads": torch.get_num_threads(),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30, help="timed steps of each (median)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps of each first")
    parser.add_argument("--hidden", type=int, default=2048, help="H, the hidden width")
    parser.add_argument("--dim", type=int, default=512, help="D, the model width")
    parser.add_argument("--batch", type=int, default=64, help="B, tokens (replicated)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--profile", action="store_true", help="print torch.profiler tables of both")
    parser.add_argument("--timeout", type=float, default=600.0, help="process-group timeout (s)")
    add_json_arg(parser)
    args = parser.parse_args(argv)
    cfg = {k: getattr(args, k) for k in ("repeats", "warmup", "hidden", "dim", "batch", "threads", "profile")}
    record = Record("tp_dtensor", cfg, argv)
    res = fpar.launch(worker, NPROCS, cfg, timeout=args.timeout)
    r0 = res[0]
    for name, table in r0["profiles"].items():
        print(f"== rank 0 profile, {name}, 3 steps ==\n{table}")
    print(
        f"from the same parameters, the gradients agree: max |fpar - DTensor| / |grad| = "
        f"{max(r['worst_rel'] for r in res):.2e} (over params and ranks)"
    )
    med = {k: statistics.median(v) * 1e3 for k, v in r0["times"].items()}
    lo = {k: min(v) * 1e3 for k, v in r0["times"].items()}
    med1 = {k: statistics.median(v) * 1e3 for k, v in res[1]["times"].items()}
    ratio = med["fpar"] / med["dtensor"]
    desc = f"1D TP MLP train step B={args.batch} D={args.dim} H={args.hidden} fp32"
    print(
        f"{desc}, {NPROCS} gloo processes x {r0['threads']} thread(s), torch {torch.__version__}, {args.repeats} repeats"
    )
    for k in ("fpar", "fpar_bw", "dtensor"):
        print(f"  {k:7s}  median {med[k]:8.2f} ms   min {lo[k]:8.2f}   (rank 1 median {med1[k]:.2f})")
    print(
        f"  ratio fpar/DTensor: {ratio:.2f}x (medians; target <= 1.0), {lo['fpar'] / lo['dtensor']:.2f}x (minima)"
    )
    print(
        f"  ratio fpar .backward()/DTensor: {med['fpar_bw'] / med['dtensor']:.2f}x (medians), "
        f"{lo['fpar_bw'] / lo['dtensor']:.2f}x (minima)"
    )
    print(
        "  fpar bytes per device per step (comm_stats on 'tensor'): "
        + ", ".join(f"{k} {v['bytes']:,} in {v['calls']}" for k, v in r0["stats"].items())
    )
    print()
    print("| benchmark | config | fpar func.grad / .backward() (ms) | DTensor (ms) | ratio | threads |")
    print("|---|---|---|---|---|---|")
    print(
        f"| tp_dtensor | {desc}, {NPROCS} gloo procs, Colwise+Rowwise | {med['fpar']:.1f} / {med['fpar_bw']:.1f} | "
        f"{med['dtensor']:.1f} | {ratio:.2f}x / {med['fpar_bw'] / med['dtensor']:.2f}x | {NPROCS}x{r0['threads']} |"
    )
    print(f"<!-- {platform.processor() or platform.machine()}, torch {torch.__version__} -->")

    t = r0["times"]
    record.compare(
        "step",
        f"{desc} (`fpar.ops.mlp`), {NPROCS} gloo processes x {r0['threads']} thread: fpar `torch.func.grad` / "
        "`.backward()` vs DTensor `parallelize_module` Colwise + Rowwise",
        [
            ("fpar torch.func.grad", t["fpar"], "DTensor", t["dtensor"]),
            ("fpar .backward()", t["fpar_bw"], "DTensor", t["dtensor"]),
        ],
    )
    record.data["extra"] = {"comm_stats": r0["stats"], "max_rel_grad_diff": max(r["worst_rel"] for r in res)}
    record.write(args.json)


if __name__ == "__main__":
    main()
