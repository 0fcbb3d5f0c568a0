"""Pipeline step: fpar's 1F1B and GPipe against torch.distributed.pipelining's, side by side.

Both sides train the same model, cut into ``p`` stages (one gloo process each, 2 by default on
a 2-core machine), with the same microbatching:

* the model: ``p * layers`` residual MLP blocks ``h + Linear(H, D)(relu(Linear(D, H)(h)))``,
  float32, MSE loss on the last stage; stage ``s`` holds blocks ``s * layers ..``;
* **fpar**: ``fpar.pipeline.pipeline(stage, one_f_one_b(p, m) | gpipe(p, m), mesh, loss=mse)``
  on the real mesh ``("pipe",)``; the stage function is ``torch.func.functional_call`` of the
  same ``nn.Module`` with this rank's parameters (stacked with a leading chunk dim of 1);
* **torch**: ``PipelineStage(module, rank, p)`` with ``Schedule1F1B`` / ``ScheduleGPipe``
  (``loss_fn=mse``, ``scale_grads=True``: both compute the gradient of the mean over
  microbatches), ``module.zero_grad(set_to_none=True)`` before each step.

Checked once, before timing: one step of each gives the same loss and gradients.  Then every
variant is timed interleaved (order rotating every repeat), each step between two barriers so
it spans the slowest stage; medians from rank 0.  Peak memory per stage: the most bytes of
tensors saved for backward alive at once during a step (``saved_tensors_hooks``, counted
per storage, the same instrument on both sides), and the process's peak RSS.  fpar's executor
also reports its peak stash (microbatches) and the seconds each stage computed, from which the
measured bubble (1 - compute / step time) is printed next to the formula (p - 1)/(m + p - 1).
Timings are printed, never asserted.

Run:
    python bench/pipeline.py                           # p=2, m=8, B=256, D=512, H=2048, 2 blocks/stage
    python bench/pipeline.py --stages 4 --microbatches 8 --repeats 10
"""

from __future__ import annotations

import argparse
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

try:
    import fpar
except ImportError:  # run from a checkout without installing: use the repo's fpar/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import fpar
import fpar.pipeline as pp


class Block(nn.Module):
    """A residual MLP block: h + W2 relu(W1 h)."""

    def __init__(self, d: int, h: int):
        super().__init__()
        self.up, self.down = nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, h_BD):
        return h_BD + self.down(torch.relu(self.up(h_BD)))


def stage_module(rank: int, cfg) -> nn.Module:
    torch.manual_seed(1000 + rank)
    return nn.Sequential(*[Block(cfg.dim, cfg.hidden) for _ in range(cfg.layers)])


def mse(out_BD, t_BD):
    return ((out_BD - t_BD) ** 2).mean()


class SavedBytes:
    """Live bytes of activations autograd saves for backward (per storage), and their peak.

    Parameters (whose storages are given) are left out: they are alive anyway, and the point is
    what a schedule stashes.
    """

    def __init__(self, params):
        self.skip = {t.untyped_storage().data_ptr() for t in params}
        self.live: dict[int, list] = {}  # storage ptr -> [bytes, refcount]
        self.now = self.peak = 0

    def pack(self, t):
        key = t.untyped_storage().data_ptr()
        if key in self.skip:
            return _Held(t, None, None)
        entry = self.live.setdefault(key, [t.untyped_storage().nbytes(), 0])
        if entry[1] == 0:
            self.now += entry[0]
            self.peak = max(self.peak, self.now)
        entry[1] += 1
        return _Held(t, key, self)

    def release(self, key):
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.live[key]


class _Held:
    __slots__ = ("t", "key", "owner")

    def __init__(self, t, key, owner):
        self.t, self.key, self.owner = t, key, owner

    def __del__(self):
        if self.owner is not None:
            self.owner.release(self.key)


def worker(cfg) -> dict:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.set_num_threads(cfg.threads)
    rank, p, m = dist.get_rank(), dist.get_world_size(), cfg.microbatches
    mesh = fpar.make_mesh((p,), ("pipe",))
    module = stage_module(rank, cfg)
    gen = torch.Generator().manual_seed(0)
    x_BD = torch.randn(cfg.batch, cfg.dim, generator=gen)
    y_BD = torch.randn(cfg.batch, cfg.dim, generator=gen)
    xs, ys = x_BD.reshape(m, -1, cfg.dim), y_BD.reshape(m, -1, cfg.dim)

    template = stage_module(rank, cfg)

    def stage_fn(w, h_BD):
        return torch.func.functional_call(template, w, (h_BD,))

    params = {"stages": {k: v.detach()[None].clone() for k, v in module.named_parameters()}}
    fpar_steps = {
        "1F1B": pp.pipeline(stage_fn, pp.one_f_one_b(p, m), mesh, loss=lambda w, h, t: mse(h, t)),
        "GPipe": pp.pipeline(stage_fn, pp.gpipe(p, m), mesh, loss=lambda w, h, t: mse(h, t)),
        "ZB-H1": pp.pipeline(stage_fn, pp.zb_h1(p, m), mesh, loss=lambda w, h, t: mse(h, t)),
    }
    stage = PipelineStage(module, rank, p, torch.device("cpu"))
    torch_scheds = {
        "1F1B": Schedule1F1B(stage, m, loss_fn=mse),
        "GPipe": ScheduleGPipe(stage, m, loss_fn=mse),
    }

    def run_fpar(name):
        return fpar_steps[name](params, xs, ys)

    def run_torch(name):
        module.zero_grad(set_to_none=True)
        losses = []
        sched = torch_scheds[name]
        if rank == 0:
            sched.step(x_BD)
        elif rank == p - 1:
            sched.step(target=y_BD, losses=losses)
        else:
            sched.step()
        return losses

    # Same work: compare loss and gradients once.
    check = {}
    for name in ("1F1B", "GPipe"):
        res = run_fpar(name)
        losses = run_torch(name)
        diff = max(
            (res.grads["stages"][k][0] - prm.grad).abs().max().item() for k, prm in module.named_parameters()
        )
        loss_diff = abs(float(res.loss) - float(torch.stack(losses).detach().mean())) if losses else 0.0
        check[name] = (diff, loss_diff)

    variants = [("fpar", n) for n in ("1F1B", "GPipe", "ZB-H1")] + [("torch", n) for n in ("1F1B", "GPipe")]
    run = {"fpar": run_fpar, "torch": run_torch}
    for _ in range(cfg.warmup):
        for side, name in variants:
            run[side](name)
    times = {v: [] for v in variants}
    stats = {}
    for r in range(cfg.repeats):
        order = variants[r % len(variants) :] + variants[: r % len(variants)]
        for side, name in order:
            dist.barrier()
            t0 = time.perf_counter()
            out = run[side](name)
            dist.barrier()
            times[(side, name)].append(time.perf_counter() - t0)
            if side == "fpar":
                stats[name] = out.stats
    memory = {}
    for side, name in variants:
        counter = SavedBytes(list(module.parameters()) + list(params["stages"].values()))
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda h: h.t):
            run[side](name)
        memory[(side, name)] = counter.peak
    return {
        "rank": rank,
        "times": {k: statistics.median(v) for k, v in times.items()},
        "min": {k: min(v) for k, v in times.items()},
        "memory": memory,
        "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "stats": stats,
        "check": check,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=2, help="MLP blocks per stage")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    cfg = ap.parse_args()
    p, m = cfg.stages, cfg.microbatches
    print(
        f"fpar {fpar.__version__}, torch {torch.__version__}, {platform.machine()}, "
        f"{p} gloo processes x {cfg.threads} thread(s)"
    )
    print(
        f"model: {p} stages x {cfg.layers} residual MLP blocks D={cfg.dim} H={cfg.hidden}, fp32; "
        f"batch {cfg.batch} in m={m} microbatches of {cfg.batch // m}"
    )
    results = fpar.launch(worker, p, cfg, timeout=600.0)
    r0 = results[0]
    for name, (_, ldiff) in r0["check"].items():
        worst = max(r["check"][name][0] for r in results)
        print(
            f"check {name}: max |grad fpar - grad torch| over stages = {worst:.2e}, |loss diff| = {ldiff:.2e}"
        )
    print()
    print("| schedule | fpar (ms) | torch.distributed.pipelining (ms) | ratio fpar/torch | min-ratio |")
    print("|---|---|---|---|---|")
    for name in ("1F1B", "GPipe"):
        f, t = r0["times"][("fpar", name)] * 1e3, r0["times"][("torch", name)] * 1e3
        fmin, tmin = r0["min"][("fpar", name)], r0["min"][("torch", name)]
        print(f"| {name} | {f:.1f} | {t:.1f} | {f / t:.2f}x | {fmin / tmin:.2f}x |")
    zb, ofob = r0["times"][("fpar", "ZB-H1")] * 1e3, r0["times"][("fpar", "1F1B")] * 1e3
    print(f"| ZB-H1 (fpar only) | {zb:.1f} | - | {zb / ofob:.2f}x of fpar 1F1B | |")
    print()
    print("peak activation bytes saved for backward per stage (MiB), fpar vs torch; fpar's peak stash:")
    for name in ("1F1B", "GPipe", "ZB-H1"):
        row = []
        for r in results:
            fm = r["memory"][("fpar", name)] / 2**20
            tm = f"{r['memory'][('torch', name)] / 2**20:.1f}" if ("torch", name) in r["memory"] else "-"
            row.append(f"stage {r['rank']}: {fm:.1f} vs {tm}")
        print(f"  {name}: " + "; ".join(row) + f"; stash {r0['stats'][name].peak_stash}")
    print("  peak RSS per process (MiB, all variants): " + ", ".join(f"{r['rss_mb']:.0f}" for r in results))
    print()
    print("fpar measured bubble (1 - stage compute / step wall time); on the tick grid; formula:")
    for name, formula in (
        ("1F1B", (p - 1) / (m + p - 1)),
        ("GPipe", (p - 1) / (m + p - 1)),
        ("ZB-H1", (p - 1) / (3 * m + p - 1)),
    ):
        st = r0["stats"][name]
        busy = [1 - c / st.wall_s for c in st.compute_s]
        print(
            f"  {name}: per stage {', '.join(f'{b:.3f}' for b in busy)}; ticks {st.bubble_fraction:.3f}; "
            f"formula {formula:.3f}"
        )


if __name__ == "__main__":
    main()
