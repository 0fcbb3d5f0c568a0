"""Pipeline step: fpar's schedules against torch.distributed.pipelining's, side by side.

Both sides train the same model, cut into ``p`` stages (one gloo process each, 2 by default on
a 2-core machine), with the same microbatching:

* the model: ``p * layers`` residual MLP blocks ``h + Linear(H, D)(relu(Linear(D, H)(h)))``,
  float32, MSE loss on the last stage; stage ``s`` holds blocks ``s * layers ..``;
* **fpar**: ``fpar.pipeline.pipeline(stage, schedule, mesh, loss=mse)`` on the real mesh
  ``("pipe",)`` for 1F1B, GPipe, interleaved 1F1B (v=2), ZB-V, DualPipeV and ZB-H1; the stage
  function is ``torch.func.functional_call`` of the same ``nn.Module`` with this rank's
  parameters (stacked with a leading chunk dim of v); with two chunks per rank each chunk has
  half the blocks, placed by virtual stage (interleaved, or the V of ZB-V/DualPipeV);
* **torch**: ``PipelineStage(module, virtual stage, p v)`` per chunk with ``Schedule1F1B`` /
  ``ScheduleGPipe`` / ``ScheduleInterleaved1F1B`` / ``ScheduleZBVZeroBubble`` /
  ``ScheduleDualPipeV`` (``loss_fn=mse``, ``scale_grads=True``: both compute the gradient of
  the mean over microbatches), ``zero_grad(set_to_none=True)`` before each step; ZB-H1 (torch
  has none) is compared with fpar's 1F1B.

Checked once, before timing: one step of each gives the same loss and gradients.  Then every
variant is timed interleaved (order rotating every repeat), each step between two barriers so
it spans the slowest stage; medians from rank 0.  Peak memory per stage: the most bytes of
tensors saved for backward alive at once during a step (``saved_tensors_hooks``, counted
per storage, the same instrument on both sides; it does not see the ``(x, dy)`` pairs fpar's
split schedules hold from B to W outside autograd), and the process's peak RSS.  fpar's executor
also reports its peak stash (microbatches) and the seconds each stage computed, from which the
measured bubble (1 - compute / step time) is printed next to the tick grid's.
Timings are printed, never asserted.

Run:
    python bench/pipeline.py                           # p=2, m=8, B=256, D=512, H=2048, 2 blocks/stage
    python bench/pipeline.py --stages 4 --microbatches 8 --repeats 10
    python bench/pipeline.py --schedules "1F1B,ZB-H1"  # a subset
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
from _common import Record, add_json_arg

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


def chunk_modules(rank: int, cfg, v: int, layout: str) -> list[nn.Module]:
    """This rank's ``v`` model chunks (``layers / v`` blocks each), seeded by virtual stage."""
    if v == 1:
        return [stage_module(rank, cfg)]
    p = cfg.stages
    out = []
    for c in range(v):
        k = rank if (layout == "v" and c == 0) else (2 * p - 1 - rank if layout == "v" else c * p + rank)
        torch.manual_seed(2000 + k)
        out.append(nn.Sequential(*[Block(cfg.dim, cfg.hidden) for _ in range(cfg.layers // v)]))
    return out


# name: (fpar schedule builder, chunks per rank, layout, torch.distributed.pipelining class or None)
PAIRS = {
    "1F1B": (lambda p, m: pp.one_f_one_b(p, m), 1, "interleaved", "Schedule1F1B"),
    "GPipe": (lambda p, m: pp.gpipe(p, m), 1, "interleaved", "ScheduleGPipe"),
    "interleaved 1F1B": (
        lambda p, m: pp.interleaved_1f1b(p, m, 2),
        2,
        "interleaved",
        "ScheduleInterleaved1F1B",
    ),
    "ZB-V": (lambda p, m: pp.zb_v(p, m), 2, "v", "ScheduleZBVZeroBubble"),
    "DualPipeV": (lambda p, m: pp.dualpipe_v(p, m), 2, "v", "ScheduleDualPipeV"),
    "ZB-H1": (lambda p, m: pp.zb_h1(p, m), 1, "interleaved", None),
}


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
    from torch.distributed import pipelining

    torch.set_num_threads(cfg.threads)
    rank, p, m = dist.get_rank(), dist.get_world_size(), cfg.microbatches
    mesh = fpar.make_mesh((p,), ("pipe",))
    gen = torch.Generator().manual_seed(0)
    x_BD = torch.randn(cfg.batch, cfg.dim, generator=gen)
    y_BD = torch.randn(cfg.batch, cfg.dim, generator=gen)
    xs, ys = x_BD.reshape(m, -1, cfg.dim), y_BD.reshape(m, -1, cfg.dim)
    names = [n for n in PAIRS if n in cfg.schedules]
    mods, params, fpar_steps, torch_scheds, ends = {}, {}, {}, {}, {}
    for name in names:
        build, v, layout, torch_cls = PAIRS[name]
        mods[name] = chunk_modules(rank, cfg, v, layout)
        template = chunk_modules(rank, cfg, v, layout)[0]

        def stage_fn(w, h_BD, template=template):
            return torch.func.functional_call(template, w, (h_BD,))

        named = [dict(mod.named_parameters()) for mod in mods[name]]
        params[name] = {"stages": {k: torch.stack([n[k].detach() for n in named]) for k in named[0]}}
        sch = build(p, m)
        fpar_steps[name] = pp.pipeline(stage_fn, sch, mesh, loss=lambda w, h, t: mse(h, t))
        firsts = {pp_virtual(rank, c, p, v, layout) for c in range(v)}
        ends[name] = (0 in firsts, p * v - 1 in firsts)
        if torch_cls is not None:
            stages = [
                pipelining.PipelineStage(mod, pp_virtual(rank, c, p, v, layout), p * v, torch.device("cpu"))
                for c, mod in enumerate(mods[name])
            ]
            cls = getattr(pipelining, torch_cls)
            torch_scheds[name] = cls(stages[0] if v == 1 else stages, m, loss_fn=mse)

    def run_fpar(name):
        return fpar_steps[name](params[name], xs, ys)

    def run_torch(name):
        for mod in mods[name]:
            mod.zero_grad(set_to_none=True)
        losses: list = []
        first, last = ends[name]
        args = (x_BD,) if first else ()
        kwargs = {"target": y_BD, "losses": losses} if last else {}
        torch_scheds[name].step(*args, **kwargs)
        return losses

    # Same work: compare loss and gradients once.
    check = {}
    for name in torch_scheds:
        res = run_fpar(name)
        losses = run_torch(name)
        diff = max(
            (res.grads["stages"][k][c] - prm.grad).abs().max().item()
            for c, mod in enumerate(mods[name])
            for k, prm in mod.named_parameters()
        )
        loss_diff = abs(float(res.loss) - float(torch.stack(losses).detach().mean())) if losses else 0.0
        check[name] = (diff, loss_diff)

    variants = [("fpar", n) for n in names] + [("torch", n) for n in torch_scheds]
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
                stats.setdefault(name, []).append(out.stats)
    memory = {}
    for side, name in variants:
        held = [t for mod in mods[name] for t in mod.parameters()] + list(params[name]["stages"].values())
        counter = SavedBytes(held)
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda h: h.t):
            run[side](name)
        memory[(side, name)] = counter.peak
    return {
        "rank": rank,
        "times": {k: statistics.median(v) for k, v in times.items()},
        "min": {k: min(v) for k, v in times.items()},
        "memory": memory,
        "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "stats": {n: _median_stats(ss) for n, ss in stats.items()},
        "check": check,
    }


def pp_virtual(rank: int, c: int, p: int, v: int, layout: str) -> int:
    """The virtual stage of this rank's chunk ``c`` (what torch calls the stage index)."""
    from fpar.pipeline._schedule import virtual

    return virtual(rank, c, p, v, layout)


def _median_stats(ss: list):
    """The run with the median wall time (its per-stage compute seconds go with it)."""
    return sorted(ss, key=lambda st: st.wall_s)[len(ss) // 2]


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
    ap.add_argument("--schedules", default=",".join(PAIRS), help="comma-separated, from: " + ", ".join(PAIRS))
    add_json_arg(ap)
    cfg = ap.parse_args()
    cfg.schedules = [n.strip() for n in cfg.schedules.split(",")]
    record = Record("pipeline", {k: v for k, v in vars(cfg).items() if k != "json"})
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
    for name in r0["check"]:
        f, t = r0["times"][("fpar", name)] * 1e3, r0["times"][("torch", name)] * 1e3
        fmin, tmin = r0["min"][("fpar", name)], r0["min"][("torch", name)]
        print(
            f"| {name} (torch `{PAIRS[name][3]}`) | {f:.1f} | {t:.1f} | {f / t:.2f}x | {fmin / tmin:.2f}x |"
        )
    if ("fpar", "ZB-H1") in r0["times"] and ("fpar", "1F1B") in r0["times"]:
        zb, ofob = r0["times"][("fpar", "ZB-H1")] * 1e3, r0["times"][("fpar", "1F1B")] * 1e3
        zmin, omin = r0["min"][("fpar", "ZB-H1")], r0["min"][("fpar", "1F1B")]
        print(
            f"| ZB-H1 (fpar) vs fpar 1F1B | {zb:.1f} | {ofob:.1f} (fpar 1F1B) | {zb / ofob:.2f}x | {zmin / omin:.2f}x |"
        )
    print()
    print("peak activation bytes saved for backward per stage (MiB), fpar vs torch; fpar's peak stash:")
    for name in r0["stats"]:
        row = []
        for r in results:
            fm = r["memory"][("fpar", name)] / 2**20
            tm = f"{r['memory'][('torch', name)] / 2**20:.1f}" if ("torch", name) in r["memory"] else "-"
            row.append(f"stage {r['rank']}: {fm:.1f} vs {tm}")
        split = " (excludes (x, dy) held from B to W)" if name in ("ZB-H1", "ZB-V", "DualPipeV") else ""
        print(f"  {name}: " + "; ".join(row) + f"; stash {r0['stats'][name].peak_stash}{split}")
    print("  peak RSS per process (MiB, all variants): " + ", ".join(f"{r['rss_mb']:.0f}" for r in results))
    print()
    print("fpar measured bubble (1 - stage compute / step wall time, median run); on the tick grid:")
    for name, st in r0["stats"].items():
        busy = [1 - c / st.wall_s for c in st.compute_s]
        print(f"  {name}: per stage {', '.join(f'{b:.3f}' for b in busy)}; ticks {st.bubble_fraction:.3f}")

    step = (
        f"{p} stages, m={m}, B={cfg.batch} D={cfg.dim} H={cfg.hidden}, {cfg.layers} residual MLP blocks a stage, "
        f"{p} gloo processes x {cfg.threads} thread"
    )
    T, M = r0["times"], r0["min"]
    vs_torch = [n for n in r0["check"] if ("torch", n) in T]
    if vs_torch:
        record.compare(
            "schedules",
            f"{step}: "
            + " / ".join(vs_torch)
            + " vs `torch.distributed.pipelining`'s schedule of the same name",
            [
                (
                    f"fpar {n}",
                    (T[("fpar", n)], M[("fpar", n)]),
                    f"torch {n}",
                    (T[("torch", n)], M[("torch", n)]),
                )
                for n in vs_torch
            ],
        )
    if ("fpar", "ZB-H1") in T and ("fpar", "1F1B") in T:
        record.compare(
            "zb_h1",
            f"{step}: fpar's ZB-H1 vs fpar's 1F1B",
            [
                (
                    "fpar ZB-H1",
                    (T[("fpar", "ZB-H1")], M[("fpar", "ZB-H1")]),
                    "fpar 1F1B",
                    (T[("fpar", "1F1B")], M[("fpar", "1F1B")]),
                ),
            ],
        )
    record.data["extra"] = {
        "saved_activation_mib": {
            f"{side} {name} stage {r['rank']}": b / 2**20
            for r in results
            for (side, name), b in r["memory"].items()
        },
        "peak_rss_mib": [r["rss_mb"] for r in results],
        "bubble": {name: st.bubble_fraction for name, st in r0["stats"].items()},
        "check": {name: list(v) for name, v in r0["check"].items()},
    }
    record.write(cfg.json)


if __name__ == "__main__":
    main()
