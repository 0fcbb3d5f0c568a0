"""Gradient accumulation (4 microbatches): fpar's deferred reduction against DDP's ``no_sync()``.

Both sides train the same 2-layer MLP as ``bench/data_parallel.py`` (``Linear(D, H) -> ReLU ->
Linear(H, D)``, float32, MSE) on the same global batch split over 2 gloo processes; each
process's rows are cut into ``n_micro = 4`` microbatches and the step averages their gradients:

* **fpar**: ``fpar.optim.accumulate(torch.func.grad_and_value(sharded_loss), 4, mesh,
  batch_specs)``: microbatches 0-2 run under ``fpar.defer_reduction()`` (gradients summed
  locally, no messages), the last all-reduces the sum once per bucket; SGD with
  ``torch._foreach_add_``.
* **fpar .backward()**: the same sharded loss on leaf parameters, PyTorch's way: microbatches 0-2's
  ``loss.backward()`` under one ``fpar.defer_reduction()`` (``.grad`` stays ``None``), the last
  one's outside it (``.grad`` is then the reduced sum), SGD from ``.grad`` (``lr / n_micro``).
* **fpar, reduce every microbatch**: the same loop by hand without deferral (what ``accumulate``
  did before): one all-reduce per bucket per microbatch.
* **DDP**: ``with model.no_sync():`` around the first 3 microbatches' ``backward()``, the last
  outside (DDP's documented accumulation), ``torch.optim.SGD(foreach=True)``.

Checked before timing: one step of each, from the same parameters, gives the same update.
Messages per step: ``fpar.comm_stats()`` (counted where issued) and a counting DDP comm hook.
The 2 processes are started once (``fpar.launch``), 1 thread each; the three steps are timed
interleaved (rotating order), each after a ``dist.barrier()``; medians of rank 0, ratios printed.
Also printed: each side's CPU time per step on the main thread (``time.thread_time``: a step's own
work, without its waits).  Timings are printed, never asserted.

Run:
    python bench/accumulate.py                 # D=512 H=2048, global batch 256 (32 rows per microbatch)
    python bench/accumulate.py --repeats 40
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

try:
    import fpar
except ImportError:  # run from a checkout without installing: use the repo's fpar/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import fpar
from _common import Record, add_json_arg, interleaved

from fpar import P

_HERE = Path(__file__).resolve().parent

_spec = importlib.util.spec_from_file_location("data_parallel", _HERE / "data_parallel.py")
_dp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_dp)
KEYS, LR, counting_hook, loss_local, make_module = (
    _dp.KEYS,
    _dp.LR,
    _dp.counting_hook,
    _dp.loss_local,
    _dp.make_module,
)

NPROCS = 2
N_MICRO = 4


def worker(cfg: dict) -> dict:
    """Runs on each process: check, count messages, time the three steps."""
    torch.set_num_threads(cfg["threads"])
    mesh, params, x_local, y_local = _dp.setup(cfg)
    plist = [params[k] for k in KEYS]
    micro = list(zip(x_local.chunk(N_MICRO), y_local.chunk(N_MICRO)))

    sharded = fpar.shard(loss_local, mesh, (P(), P("data"), P("data")), P())
    grad_and_value = torch.func.grad_and_value(sharded)
    acc = fpar.optim.accumulate(lambda p, b: grad_and_value(p, *b), N_MICRO, mesh, (P("data"), P("data")))

    def fpar_step():
        g, _ = acc(params, (x_local, y_local))
        torch._foreach_add_(plist, [g[k] for k in KEYS], alpha=-LR)

    def fpar_every_step():
        total = None
        for x, y in micro:
            g, _ = grad_and_value(params, x, y)
            total = g if total is None else {k: total[k] + g[k] for k in KEYS}
        torch._foreach_add_(plist, [total[k] for k in KEYS], alpha=-LR / N_MICRO)

    leaves = [params[k].detach().clone().requires_grad_() for k in KEYS]
    lp = dict(zip(KEYS, leaves))

    def fpar_bw_step():
        for p in leaves:
            p.grad = None
        with fpar.defer_reduction():
            for x, y in micro[:-1]:
                sharded(lp, x, y).backward()
        sharded(lp, *micro[-1]).backward()
        with torch.no_grad():
            torch._foreach_add_(leaves, [p.grad for p in leaves], alpha=-LR / N_MICRO)

    model = DDP(make_module(params))
    opt = torch.optim.SGD(model.parameters(), lr=LR, foreach=True)

    def ddp_step():
        opt.zero_grad(set_to_none=True)
        with model.no_sync():
            for x, y in micro[:-1]:
                (F.mse_loss(model(x), y) / N_MICRO).backward()
        x, y = micro[-1]
        (F.mse_loss(model(x), y) / N_MICRO).backward()
        opt.step()

    # The same update from the same parameters (fpar's accumulate vs DDP's no_sync).
    before = [p.clone() for p in plist]
    fpar_step()
    fpar_bw_step()
    ddp_step()
    worst = 0.0
    for k, p0, pf, pb, pd in zip(KEYS, before, plist, leaves, model.parameters()):
        ud = pd.detach() - p0
        for side, u in (("fpar", pf - p0), ("fpar .backward()", pb.detach() - p0)):
            rel = ((u - ud).norm() / ud.norm()).item()
            worst = max(worst, rel)
            if rel > 1e-4:  # float32 sums of 4 microbatches in different orders: ~1e-5 apart
                raise AssertionError(
                    f"the update of {k} differs, {side} vs DDP: relative norm diff {rel:.3e}"
                )

    # Messages per step (warm): fpar counted where issued; DDP by a counting comm hook.
    counts = {}
    for name, step in (("fpar", fpar_step), ("fpar_bw", fpar_bw_step), ("fpar_every", fpar_every_step)):
        step()
        fpar.reset_comm_stats()
        step()
        counts[name] = fpar.comm_stats().get("data", {})
    counter = {"calls": 0, "buffer_bytes": 0}
    counted = DDP(make_module(params))
    counted.register_comm_hook(None, counting_hook(counter))
    for _ in range(2):  # DDP rebuilds its buckets after the first step: count the second
        counter.update(calls=0, buffer_bytes=0)
        with counted.no_sync():
            for x, y in micro[:-1]:
                F.mse_loss(counted(x), y).backward()
        F.mse_loss(counted(micro[-1][0]), micro[-1][1]).backward()
    del counted

    steps = {"fpar": fpar_step, "fpar_bw": fpar_bw_step, "fpar_every": fpar_every_step, "ddp": ddp_step}
    for _ in range(cfg["warmup"]):
        for s in steps.values():
            s()
    cpu: dict = {}
    times = interleaved(steps, cfg["repeats"], cpu)
    return {
        "times": times,
        "cpu": cpu,
        "worst": worst,
        "counts": counts,
        "ddp_count": counter,
        "param_bytes": sum(p.numel() * p.element_size() for p in plist),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument(
        "--batch", type=int, default=256, help="global batch (split over 2, then 4 microbatches)"
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=600.0)
    add_json_arg(parser)
    args = parser.parse_args(argv)
    if args.batch % (NPROCS * N_MICRO):
        parser.error(f"--batch must be divisible by {NPROCS * N_MICRO}")
    cfg = {k: getattr(args, k) for k in ("repeats", "warmup", "hidden", "dim", "batch", "threads")}
    record = Record("accumulate", dict(cfg, n_micro=N_MICRO), argv)
    res = fpar.launch(worker, NPROCS, cfg, timeout=args.timeout)
    r0 = res[0]
    med = {k: statistics.median(v) * 1e3 for k, v in r0["times"].items()}
    lo = {k: min(v) * 1e3 for k, v in r0["times"].items()}
    print(
        f"accumulate step, {N_MICRO} microbatches, MLP B={args.batch} (global) D={args.dim} H={args.hidden} "
        f"float32, {NPROCS} gloo processes x {args.threads} thread(s), {args.repeats} repeats; same update "
        f"as DDP: max rel diff {max(r['worst'] for r in res):.2e}"
    )
    names = {
        "fpar": "fpar accumulate (deferred)",
        "fpar_bw": "fpar .backward() (deferred)",
        "fpar_every": "fpar, reduce every microbatch",
        "ddp": "DDP no_sync",
    }
    for k, label in names.items():
        print(f"  {label:31s} median {med[k]:8.2f} ms   min {lo[k]:8.2f} ms")
    print(
        f"  ratio fpar/DDP: {med['fpar'] / med['ddp']:.2f}x (medians), {lo['fpar'] / lo['ddp']:.2f}x (minima); "
        f"deferred / every microbatch: {med['fpar'] / med['fpar_every']:.2f}x"
    )
    print(
        f"  ratio fpar .backward()/DDP: {med['fpar_bw'] / med['ddp']:.2f}x (medians), "
        f"{lo['fpar_bw'] / lo['ddp']:.2f}x (minima)"
    )
    cpu = {k: statistics.median(v) * 1e3 for k, v in r0["cpu"].items()}
    print(
        f"  CPU time of a step on the main thread (no waits; load moves it less than the wall time), rank 0: "
        f"fpar {cpu['fpar']:.2f} / {cpu['fpar_bw']:.2f} ms (accumulate / .backward()), DDP {cpu['ddp']:.2f}; "
        f"ratios {cpu['fpar'] / cpu['ddp']:.2f}x / {cpu['fpar_bw'] / cpu['ddp']:.2f}x"
    )
    ring = 2 * (NPROCS - 1) / NPROCS
    c, cb, ce, d = r0["counts"]["fpar"], r0["counts"]["fpar_bw"], r0["counts"]["fpar_every"], r0["ddp_count"]
    print(
        f"gradient all-reduces per step (data axis): fpar deferred {c['psum']['calls']} "
        f"({c['psum']['bytes']:,} B), .backward() deferred {cb['psum']['calls']} ({cb['psum']['bytes']:,} B), every microbatch {ce['psum']['calls']} ({ce['psum']['bytes']:,} B), "
        f"DDP {d['calls']} ({int(d['buffer_bytes'] * ring):,} B); formula: one step's parameter bytes x "
        f"2(n-1)/n = {int(r0['param_bytes'] * ring):,} B; loss pmean: {c.get('pmean', {}).get('calls', 0)} per step"
    )
    print()
    print(
        "| benchmark | config | fpar func.grad / .backward() (ms) | DDP no_sync (ms) | ratio | "
        "fpar reducing every microbatch (ms) | all-reduces/step fpar / DDP |"
    )
    print("|---|---|---|---|---|---|---|")
    print(
        f"| accumulate | n_micro=4, B={args.batch} D={args.dim} H={args.hidden} fp32, {NPROCS} gloo procs | "
        f"{med['fpar']:.2f} / {med['fpar_bw']:.2f} | {med['ddp']:.2f} | {med['fpar'] / med['ddp']:.2f}x / "
        f"{med['fpar_bw'] / med['ddp']:.2f}x | {med['fpar_every']:.2f} | {c['psum']['calls']} / {d['calls']} |"
    )

    t = r0["times"]
    step = (
        f"DP SGD step, {N_MICRO} microbatches, MLP B={args.batch} (global) D={args.dim} H={args.hidden} fp32, "
        f"{NPROCS} gloo processes x {args.threads} thread"
    )
    record.compare(
        "step",
        f"{step}: `fpar.optim.accumulate` / `.backward()` under `fpar.defer_reduction()` vs DDP with `no_sync()`",
        [
            ("fpar accumulate", t["fpar"], "DDP no_sync", t["ddp"]),
            ("fpar .backward()", t["fpar_bw"], "DDP no_sync", t["ddp"]),
        ],
    )
    record.compare(
        "every",
        f"{step}: fpar reducing every microbatch vs fpar's deferred sums",
        [
            ("fpar, reduce every microbatch", t["fpar_every"], "fpar accumulate", t["fpar"]),
        ],
    )
    record.data["extra"] = {
        "cpu_ms": cpu,
        "allreduces_per_step": {
            "fpar": c["psum"]["calls"],
            "fpar_bw": cb["psum"]["calls"],
            "fpar_every": ce["psum"]["calls"],
            "ddp": d["calls"],
        },
        "max_rel_update_diff": max(r["worst"] for r in res),
    }
    record.write(args.json)


if __name__ == "__main__":
    main()
