"""Where the CPU of a data-parallel step through ``fpar.shard`` goes, phase by phase (issue 52, item 1).

The step is ``data_parallel.py``'s (MLP, MSE ``pmean`` over "data", 2 gloo processes, 1 thread each),
by ``torch.func.grad`` and by ``.backward()``.  Each phase below is a function of fpar or torch;
each is wrapped to add up the main thread's CPU time (``time.thread_time_ns``: no waits) spent
inside it, nested calls counted by depth (``autograd.grad#2`` is the one inside the lowered
call's backward).  A wrapper costs ~1-3 us a call, so the phases read a little high; the total
without wrappers is printed first, from the same processes.

    fpar call (outer)        fpar.shard's call as torch.func.grad calls it (key, lowering check)
    lowering_level           whether the call may run on plain autograd inside (lowered.py)
    Lowered.forward          the call as one op of the transform: unwrap, the call, wrap
    _run                     a planned call: frame, hooks, f, the first message, outputs
    reduce_inputs            the gradient buckets' hooked views of the replicated inputs
    f's ops                  the per-device loss's own torch ops (the MLP and MSE, no fpar)
    Lowered.backward         the lowered call's backward: plain autograd over the call's graph
    arrive / waited          bucket hooks: a cotangent into the bucket (the last launches the
                             all-reduce, here riding in the call's first message) / its wait
    verdict                  reading the first message's check (inside waited)
    functorch                torch.func.grad's own wrapping of the arguments and results

Run:
    python bench/call_phases.py                   # the tiny step (D=64 H=256 B=16): a call's fixed cost
    python bench/call_phases.py --dim 512 --hidden 2048 --batch 128

Timings are printed, never asserted; a shared machine moves them by 20 % and more between runs.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

try:
    import fpar
except ImportError:  # run from a checkout without installing: use the repo's fpar/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import fpar
import data_parallel as dp
from _common import backward_step

from fpar import P

PHASES = (
    ("fpar.shard call", "fpar call (outer)"),
    ("lowering_level", "lowering_level"),
    ("Lowered.forward", "Lowered.forward"),
    ("_run", "_run"),
    ("reduce_inputs", "reduce_inputs"),
    ("f's ops", "f's ops"),
    ("autograd.grad#1", "autograd.grad (functorch's)"),
    ("Lowered.backward", "Lowered.backward"),
    ("autograd.grad#2", "autograd.grad (inside it)"),
    ("backward()", ".backward()"),
    ("arrive", "arrive (4 hooks)"),
    ("waited", "waited"),
    ("verdict", "verdict"),
    ("functorch", "functorch wrap/unwrap"),
)


def _instrument(acc: collections.Counter) -> None:
    """Wrap each phase's function to add its CPU time to ``acc`` (by nesting depth where it nests)."""
    import torch._functorch.eager_transforms as et

    from fpar._dist import agreement, buckets, lowered, pending
    from fpar._dist import shard as dshard

    depth: collections.Counter = collections.Counter()

    def wrap(owner, name: str, label: str, *, nested: bool = False, also=()) -> None:
        f = getattr(owner, name)

        def timed(*args, **kwargs):
            depth[label] += 1
            key = f"{label}#{depth[label]}" if nested else label
            t = time.thread_time_ns()
            try:
                return f(*args, **kwargs)
            finally:
                if depth[label] == 1 or nested:
                    acc[key] += time.thread_time_ns() - t
                depth[label] -= 1

        setattr(owner, name, timed)
        for other in also:  # modules that imported the name themselves
            setattr(other, name, timed)

    wrap(dshard.DistShard, "__call__", "fpar.shard call")
    wrap(lowered, "lowering_level", "lowering_level", also=(dshard,))
    wrap(lowered._Lowered, "forward", "Lowered.forward")
    wrap(lowered._Lowered, "backward", "Lowered.backward")
    wrap(dshard.DistShard, "_run", "_run")
    wrap(buckets, "reduce_inputs", "reduce_inputs", also=(dshard,))
    wrap(dp, "plain_loss", "f's ops")
    wrap(torch.autograd, "grad", "autograd.grad", nested=True)
    wrap(pending.Pending, "backward", "backward()")
    wrap(buckets._State, "arrive", "arrive")
    wrap(buckets._State, "waited", "waited")
    wrap(agreement._First, "verdict", "verdict")
    for name in ("_create_differentiable", "_undo_create_differentiable", "_wrap_all_tensors"):
        wrap(et, name, "functorch")


def worker(cfg: dict) -> dict:
    torch.set_num_threads(1)
    mesh, params, x, y = dp.setup(cfg)
    sharded = fpar.shard(dp.loss_local, mesh, (P(), P("data"), P("data")), P())
    grad_fn = torch.func.grad(sharded)
    plist = [params[k] for k in dp.KEYS]

    def grad_step():
        g = grad_fn(params, x, y)
        torch._foreach_add_(plist, [g[k] for k in dp.KEYS], alpha=-dp.LR)

    steps = {
        "torch.func.grad": grad_step,
        ".backward()": backward_step(sharded, params, dp.KEYS, x, y, lr=dp.LR),
    }
    n = cfg["repeats"]

    def cpu_per_step(step) -> float:
        dist.barrier()
        t = time.thread_time_ns()
        for _ in range(n):
            step()
        return (time.thread_time_ns() - t) / n / 1e3

    out: dict = {}
    for name, step in steps.items():
        for _ in range(cfg["warmup"]):
            step()
        out[name] = {"total": statistics.median(cpu_per_step(step) for _ in range(3))}
    acc: collections.Counter = collections.Counter()
    _instrument(acc)
    for name, step in steps.items():
        for _ in range(cfg["warmup"]):
            step()
        acc.clear()
        out[name]["instrumented"] = cpu_per_step(step)
        out[name].update({k: v / n / 1e3 for k, v in acc.items()})
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--timeout", type=float, default=600.0)
    args = ap.parse_args(argv)
    cfg = dict(vars(args), threads=1)
    res = fpar.launch(worker, dp.NPROCS, cfg, timeout=args.timeout)
    print(
        f"CPU of a step on the main thread, us (ranks 0 / 1), MLP B={args.batch} D={args.dim} "
        f"H={args.hidden}, {dp.NPROCS} gloo processes x 1 thread, {args.repeats} steps, torch {torch.__version__}"
    )
    for form in res[0]:
        r0, r1 = res[0][form], res[1][form]
        print(
            f"\n{form}: {r0['total']:7.0f} / {r1['total']:7.0f} without wrappers, "
            f"{r0['instrumented']:.0f} / {r1['instrumented']:.0f} with them"
        )
        for key, label in PHASES:
            if key in r0:
                print(f"  {label:30s} {r0[key]:7.1f} / {r1.get(key, float('nan')):7.1f}")


if __name__ == "__main__":
    main()
