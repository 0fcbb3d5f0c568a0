"""ZeRO-3 AdamW training step: fpar on a real 2-process mesh against FSDP2 ``fully_shard``.

Both sides train the same model, ``L`` residual MLP layers ``h = h + W2 relu(W1 h + b1) + b2``
(``nn.Linear`` layout, float32, MSE loss), on the same global batch split over 2 gloo processes:

* **fpar**: ``fpar.optim.zero_layout(params, mesh, stage=3)``, ``zero_init`` and
  ``zero_step(loss, fpar.optim.adamw(...), layout)`` with the default ``regather=True`` (the
  gathered parameters are not kept from the forward to the backward: the backward re-gathers
  the ones autograd saved, prefetching the next), or ``--no-regather`` (kept: more memory,
  less traffic); and ``donate=True`` (``--no-donate``: off): the step updates the parameter
  chunks and AdamW state in place, as ``torch.optim`` does.  Each process holds 1/2 of every
  parameter, its gradient and AdamW state.
* **FSDP2**: the same ``nn.Module``, ``fully_shard`` on every layer and on the root (its
  default ``reshard_after_forward=True``: parameters re-gathered in the backward, with
  prefetch), ``loss.backward()``, ``torch.optim.AdamW(foreach=True)``.

The processes are started once (``fpar.launch``), 1 thread each.  Both sides are warmed up,
then timed interleaved (the order alternates every repeat), each timed step a full step
(forward, backward, gathers, reduce-scatters, update) after a ``dist.barrier()``.  Medians from
rank 0, ratio fpar/FSDP2 (target <= 1.0).

Checked once, before timing: from the same parameters, one step of each gives the same updated
parameters.

Peak memory per process: torch's CPU allocator accounting as the profiler records it
(``torch.profiler.profile(profile_memory=True)``: every allocation and free of a CPU tensor,
with its time) over one step: peak = bytes held at the start of the step (the stored parameter
shards and optimizer state, counted from the tensors each side keeps) + the highest running
sum of allocations minus frees during the step (see ``peak_bytes``).  (tracemalloc does not see torch's
allocator; ``ru_maxrss`` is one number per process for both sides.)  Ratio fpar/FSDP2 (target
<= 1.1).

Run:
    python bench/zero.py                              # 20 repeats, 3 layers, D=512 H=2048 B=128
    python bench/zero.py --repeats 30 --no-regather
    python bench/zero.py --profile                    # both sides' torch.profiler op tables
    python bench/zero.py --micro 4                    # 4 microbatches a step, each reduce-scattered
    python bench/zero.py --micro 4 --reduce-once      # ... summed unreduced, reduce-scattered once
    python bench/zero.py --units                      # fpar gathers a layer's 4 parameters together

Microbatches (``--micro M``): fpar's ``zero_step(..., n_micro=M)`` against FSDP2's loop of M
``loss.backward()`` calls on the same rows (each rank's rows cut in M consecutive pieces, the loss
divided by M).  ``--reduce-once``: fpar's ``reduce_once=True`` against FSDP2's
``set_requires_gradient_sync(False)`` on every microbatch but the last (both hold a whole
unreduced gradient through the step and reduce-scatter it once).

Shape suffixes: B global batch (B/2 per process), D model width, H hidden width, L layers.
"""

from __future__ import annotations

import argparse
import gc
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
from _common import Record, add_json_arg, interleaved, profile_table

import fpar.optim as fo
from fpar import P

NPROCS = 2
LR, WD = 1e-3, 0.01


def loss_local(params, batch):
    """Per-device loss: the residual MLP on this device's rows, MSE (ZeRO averages over data)."""
    x_BD, y_BD = batch
    h = x_BD
    for i in range(len(params) // 4):
        u = torch.relu(F.linear(h, params[f"{i}.w1"], params[f"{i}.b1"]))
        h = h + F.linear(u, params[f"{i}.w2"], params[f"{i}.b2"])
    return F.mse_loss(h, y_BD)


class Block(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.w1, self.w2 = nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x):
        return x + self.w2(torch.relu(self.w1(x)))


def make_params(L: int, D: int, H: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    params = {}
    for i in range(L):
        params[f"{i}.w1"] = torch.randn(H, D, generator=gen) * D**-0.5
        params[f"{i}.b1"] = torch.zeros(H)
        params[f"{i}.w2"] = torch.randn(D, H, generator=gen) * H**-0.5
        params[f"{i}.b2"] = torch.zeros(D)
    return params


def make_module(params, L: int, D: int, H: int) -> nn.Module:
    model = nn.Sequential(*[Block(D, H) for _ in range(L)])
    with torch.no_grad():
        for i, block in enumerate(model):
            block.w1.weight.copy_(params[f"{i}.w1"])
            block.w1.bias.copy_(params[f"{i}.b1"])
            block.w2.weight.copy_(params[f"{i}.w2"])
            block.w2.bias.copy_(params[f"{i}.b2"])
    return model


def held_bytes(*trees) -> int:
    """Bytes of the distinct tensor storages in ``trees`` (DTensors: their local shards)."""
    from torch.distributed.tensor import DTensor

    seen, total = set(), 0
    for tree in trees:
        for t in fpar._tree.tree_flatten(tree)[0]:
            if isinstance(t, DTensor):
                t = t.to_local()
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                if s.data_ptr() not in seen:
                    seen.add(s.data_ptr())
                    total += s.nbytes()
    return total


def peak_bytes(step, held) -> tuple[int, int]:
    """``(bytes held before, peak bytes)`` of the second of two calls of ``step``.

    The profiler's allocation events (``profile_memory=True``: every CPU allocation and free
    with its time) are summed in time order over the second call, starting from ``held()``,
    the bytes of the tensors the side keeps between steps.  Measuring the second call means
    every block freed in it was allocated under the profiler (the profiler does not report
    frees of blocks allocated before it started), so the running sum is exact.
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    box = {}
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
        gc.collect()
        box["held"] = held()
        with record_function("measured step"):
            step()
    allocs, start = allocation_events(prof)
    running = peak = box["held"]
    for t, size in allocs:
        if t >= start:
            running += size
            peak = max(peak, running)
    return box["held"], peak


def allocation_events(prof) -> tuple[list, int]:
    """``(sorted (time ns, bytes) of every CPU allocation (+) and free (-), start of "measured step")``."""
    import torch._C._profiler as C

    allocs, start = [], None

    def walk(node):
        nonlocal start
        if node.name == "measured step":
            start = node.start_time_ns
        if (
            isinstance(node.extra_fields, C._ExtraFields_Allocation)
            and node.extra_fields.device.type == "cpu"
        ):
            allocs.append((node.start_time_ns, node.extra_fields.alloc_size))
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    return sorted(allocs), start


def worker(cfg: dict) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(cfg["threads"])
    B, D, H, L = cfg["batch"], cfg["dim"], cfg["hidden"], cfg["layers"]
    world = dist.get_world_size()
    mesh = fpar.make_mesh((world,), ("data",))
    full = make_params(L, D, H)
    gen = torch.Generator().manual_seed(1)
    x_BD, y_BD = torch.randn(B, D, generator=gen), torch.randn(B, D, generator=gen)
    batch = fpar.device_put((x_BD, y_BD), mesh, P("data"))

    # (a) fpar ZeRO-3
    opt = fo.adamw(LR, weight_decay=WD)
    # --units: a layer's parameters one unit (gathered together, as fully_shard(block) does)
    units = {k: int(k.split(".")[0]) for k in full} if cfg["units"] else None
    layout = fo.zero_layout(full, mesh, P(), stage=3, units=units)
    box = {}
    box["params"], box["state"] = fo.zero_init(opt, full, layout)
    micro, once = cfg["micro"], cfg["reduce_once"]
    zstep = fo.zero_step(
        loss_local,
        opt,
        layout,
        regather=cfg["regather"],
        donate=cfg["donate"],
        n_micro=micro,
        reduce_once=once,
    )

    def fpar_step():
        box["params"], box["state"], _ = zstep(box["params"], box["state"], batch)

    # (b) FSDP2
    dmesh = init_device_mesh("cpu", (world,))
    model = make_module(full, L, D, H)
    for block in model:
        fully_shard(block, mesh=dmesh)
    fully_shard(model, mesh=dmesh)
    topt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, foreach=True)

    def fsdp_step():
        topt.zero_grad(set_to_none=True)
        for i, (x, y) in enumerate(zip(batch[0].chunk(micro), batch[1].chunk(micro))):
            if once:  # the unreduced gradient summed, reduce-scattered with the last microbatch
                model.set_requires_gradient_sync(i == micro - 1)
            (F.mse_loss(model(x), y) / micro).backward()
        topt.step()

    # One step of each from the same parameters: the same update.
    fpar_step()
    fsdp_step()
    mine = fpar.gather(fo.zero_params(box["params"], layout), mesh, P())
    worst = 0.0
    for i, block in enumerate(model):
        for name, p in (
            ("w1", block.w1.weight),
            ("b1", block.w1.bias),
            ("w2", block.w2.weight),
            ("b2", block.w2.bias),
        ):
            key = f"{i}.{name}"
            theirs = p.full_tensor().detach()
            uf, ut = mine[key] - full[key], theirs - full[key]
            rel = ((uf - ut).norm() / ut.norm()).item()
            worst = max(worst, rel)
            if rel > 1e-3:
                raise AssertionError(
                    f"the update of {key} differs, fpar vs FSDP2: relative norm diff {rel:.3e}"
                )

    for _ in range(cfg["warmup"]):
        fpar_step()
        fsdp_step()

    # Peak memory of one step each (after warm-up: optimizer state exists on both sides).
    fpar_held, fpar_peak = peak_bytes(fpar_step, lambda: held_bytes(box["params"], box["state"]))
    fsdp_held, fsdp_peak = peak_bytes(
        fsdp_step, lambda: held_bytes(list(model.parameters()), list(topt.state.values()))
    )

    profiles = {}
    if cfg["profile"]:
        profiles = {"fpar": profile_table(fpar_step), "FSDP2": profile_table(fsdp_step)}
    times = interleaved({"fpar": fpar_step, "fsdp": fsdp_step}, cfg["repeats"])
    fpar.reset_comm_stats()
    fpar_step()
    return {
        "times": times,
        "profiles": profiles,
        "worst_rel": worst,
        "mem": {"fpar": (fpar_held, fpar_peak), "fsdp": (fsdp_held, fsdp_peak)},
        "stats": fpar.comm_stats().get("data", {}),
        "param_bytes": sum(t.numel() * t.element_size() for t in full.values()),
        "threads": torch.get_num_threads(),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20, help="timed steps of each (median)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps of each first")
    parser.add_argument("--layers", type=int, default=3, help="L, residual MLP layers")
    parser.add_argument("--hidden", type=int, default=2048, help="H, the hidden width")
    parser.add_argument("--dim", type=int, default=512, help="D, the model width")
    parser.add_argument("--batch", type=int, default=128, help="B, the global batch (split over 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--no-regather", dest="regather", action="store_false", help="keep gathered params")
    parser.add_argument("--micro", type=int, default=1, help="microbatches a step (zero_step's n_micro)")
    parser.add_argument("--units", action="store_true", help="fpar: a layer's parameters one ZeRO-3 unit")
    parser.add_argument(
        "--reduce-once", action="store_true", help="sum the microbatches unreduced, reduce-scatter once"
    )
    parser.add_argument("--profile", action="store_true", help="print torch.profiler tables of both")
    parser.add_argument(
        "--no-donate", dest="donate", action="store_false", help="functional update (old + new state)"
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="process-group timeout (s)")
    add_json_arg(parser)
    args = parser.parse_args(argv)
    if args.batch % (NPROCS * args.micro):
        parser.error(f"--batch must be divisible by {NPROCS} x --micro")
    keys = (
        "repeats",
        "warmup",
        "layers",
        "hidden",
        "dim",
        "batch",
        "threads",
        "regather",
        "donate",
        "micro",
        "reduce_once",
        "units",
        "profile",
    )
    cfg = {k: getattr(args, k) for k in keys}
    record = Record("zero", cfg, argv)
    res = fpar.launch(worker, NPROCS, cfg, timeout=args.timeout)
    r0 = res[0]
    n = NPROCS
    for name, table in r0["profiles"].items():
        print(f"== rank 0 profile, {name}, 3 steps ==\n{table}")
    print(
        f"starting from the same parameters, one step of each gives the same update: max "
        f"|fpar - FSDP2| / |update| = {max(r['worst_rel'] for r in res):.2e} (over params and ranks)"
    )
    med = {k: statistics.median(v) * 1e3 for k, v in r0["times"].items()}
    lo = {k: min(v) * 1e3 for k, v in r0["times"].items()}
    med1 = {k: statistics.median(v) * 1e3 for k, v in res[1]["times"].items()}
    ratio = med["fpar"] / med["fsdp"]
    desc = (
        f"ZeRO-3 AdamW step, {args.layers} residual MLP layers D={args.dim} H={args.hidden}, "
        f"B={args.batch} (global) fp32, regather={args.regather}, donate={args.donate}"
        + (
            f", {args.micro} microbatches" + (" reduced once" if args.reduce_once else "")
            if args.micro > 1
            else ""
        )
        + (", fpar units: a layer" if args.units else "")
    )
    print(
        f"{desc}, {n} gloo processes x {r0['threads']} thread(s), torch {torch.__version__}, {args.repeats} repeats"
    )
    for k, label in (("fpar", "fpar "), ("fsdp", "FSDP2")):
        print(f"  {label}  median {med[k]:8.2f} ms   min {lo[k]:8.2f}   (rank 1 median {med1[k]:.2f})")
    print(
        f"  ratio fpar/FSDP2: {ratio:.2f}x (medians; target <= 1.0), {lo['fpar'] / lo['fsdp']:.2f}x (minima)"
    )
    mem = {k: max(r["mem"][k][1] for r in res) for k in ("fpar", "fsdp")}
    for k, label in (("fpar", "fpar "), ("fsdp", "FSDP2")):
        held, peak = r0["mem"][k]
        print(
            f"  {label}  peak {peak / 2**20:7.1f} MiB per process (held between steps {held / 2**20:.1f} MiB)"
        )
    mratio = mem["fpar"] / mem["fsdp"]
    print(f"  peak memory ratio fpar/FSDP2: {mratio:.2f}x (max over ranks; target <= 1.1)")
    psi = r0["param_bytes"]
    stats = r0["stats"]
    print(
        "  fpar bytes per device per step (comm_stats): "
        + ", ".join(f"{k} {v['bytes']:,} in {v['calls']}" for k, v in stats.items())
        + f"; (N-1)/N Psi = {psi * (n - 1) // n:,}"
    )
    print()
    print("| benchmark | config | fpar (ms) | FSDP2 (ms) | ratio | peak MiB fpar / FSDP2 (ratio) | threads |")
    print("|---|---|---|---|---|---|---|")
    print(
        f"| zero | {desc}, {n} gloo procs | {med['fpar']:.1f} | {med['fsdp']:.1f} | {ratio:.2f}x "
        f"| {mem['fpar'] / 2**20:.1f} / {mem['fsdp'] / 2**20:.1f} ({mratio:.2f}x) | {n}x{r0['threads']} |"
    )
    print(f"<!-- {platform.processor() or platform.machine()}, torch {torch.__version__} -->")

    step = f"{desc}, {n} gloo processes x {r0['threads']} thread"
    record.compare(
        "step",
        f"{step}: fpar ZeRO-3 vs FSDP2 `fully_shard`",
        [
            ("fpar", r0["times"]["fpar"], "FSDP2", r0["times"]["fsdp"]),
        ],
    )
    record.memory(
        "memory",
        f"{step}: peak memory per process (the larger rank's) vs FSDP2",
        [
            ("fpar", mem["fpar"], "FSDP2", mem["fsdp"]),
        ],
    )
    record.data["extra"] = {
        "comm_stats": stats,
        "param_bytes": psi,
        "max_rel_update_diff": max(r["worst_rel"] for r in res),
    }
    record.write(args.json)


if __name__ == "__main__":
    main()
