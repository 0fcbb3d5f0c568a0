"""A compiled training step through ``fpar.shard`` against the same step in eager mode.

Both sides train the same 2-layer MLP (``gelu(x @ w1 + b1) @ w2 + b2``, float32, MSE loss, the
batch split over "data", the parameters replicated) with ``torch.optim.SGD(momentum=0.9)``:

* **eager**: ``loss = fpar.shard(per_device_loss, mesh, specs, P())``; a step is
  ``opt.zero_grad(); loss(...).backward(); opt.step()``;
* **compiled**: the supported compiled form (README, "torch.compile"):
  ``fpar.shard(torch.compile(per_device_loss), ...)`` (the per-device code compiled, split at
  the ``pmean``), inside a ``torch.compile``\\ d step that also compiles the optimizer update
  (the sharded call is a graph break that runs fpar's machinery eagerly); inductor backend.

Two meshes, each timed in one run:

* **real mesh**: 2 gloo processes on this machine (``fpar.launch``), 1 thread each, each holding
  B/2 rows; each timed step starts after a ``dist.barrier()``; rank 0's medians;
* **in-process mesh**: ``data=2`` in this process.

Besides those two forms, **whole step**: ``torch.compile(step, fullgraph=True)`` of the loss, its
backward and ``fpar.optim``'s SGD in one graph (after one eager step that checks the sharded
call's signature), on both meshes; on the real mesh also torch's own DDP, eager and compiled.
And the **README's tour step** on its in-process ``data=2 x tensor=4`` mesh (w1 64x256, x 32x64:
a step that is all per-call cost): eager vs compiled whole.

Checked first: from the same parameters, 3 compiled steps give the same parameters as 3 eager
steps (float32 tolerance), on every rank.  Then both sides are warmed up (compilation included)
and timed interleaved (the order alternates every repeat); medians and the ratio compiled/eager
are printed, never asserted.  ``--profile`` prints the top ops of one step of each side
(rank 0 / in-process) from ``torch.profiler``.

Run:
    python bench/compile.py                      # D=512 H=2048 B=128 (64/process), 30 repeats
    python bench/compile.py --tiny --repeats 100 # D=64 H=256 B=16: fixed cost per call

Shape suffixes: B batch (global), D model dim, H hidden.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch._inductor.config
import torch.distributed as dist
import torch.nn.functional as F

try:
    import fpar
except ImportError:  # run from a checkout without installing: use the repo's fpar/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import fpar
from _common import Record, add_json_arg

from fpar import P

SPECS = (P(), P(), P(), P(), P("data"), P("data"))
PLAIN_INDUCTOR = [False]
LR = 0.01


def per_device_loss(w1_HD, b1_H, w2_DH, b2_D, x_BD, y_BD):
    """The MLP on this device's rows; MSE averaged over "data" (its gradient needs the all-reduce)."""
    h_BH = F.gelu(F.linear(x_BD, w1_HD, b1_H))
    return fpar.pmean(F.mse_loss(F.linear(h_BH, w2_DH, b2_D), y_BD), "data")


def unsharded_loss(w1_HD, b1_H, w2_DH, b2_D, x_BD, y_BD):
    """The same loss in plain torch on the global batch (the ceiling of what compile can gain)."""
    return F.mse_loss(F.linear(F.gelu(F.linear(x_BD, w1_HD, b1_H)), w2_DH, b2_D), y_BD)


def _side(loss, params, x_BD, y_BD, compile_step):
    """A training step of ``loss`` with its own copy of the parameters and optimizer.

    ``compile_step``: False (eager), True (``torch.compile(step)``: the sharded call a graph
    break unless the mesh is real), or ``"whole"``: ``torch.compile(step, fullgraph=True)``, the
    loss, its backward (every gradient all-reduce) and SGD in one graph, after one eager step
    that plans the sharded call (a real mesh only).
    """
    ps = [p.detach().clone().requires_grad_() for p in params]
    opt = torch.optim.SGD(ps, lr=LR, momentum=0.9, foreach=True)

    def step():
        opt.zero_grad(set_to_none=True)
        out = loss(*ps, x_BD, y_BD)
        out.backward()
        opt.step()
        return out

    if compile_step == "whole":  # torch.optim's step is always a graph break: fpar.optim's SGD
        sgd = fpar.optim.sgd(LR, momentum=0.9)
        state = [sgd.init(ps)]

        def body():
            out = loss(*ps, x_BD, y_BD)
            out.backward()
            updates, state[0] = sgd.update([p.grad for p in ps], state[0], ps)
            with torch.no_grad():
                for p, u in zip(ps, updates):
                    p.add_(u)
                    p.grad = None
            return out.detach()

        whole = torch.compile(body, fullgraph=True)
        calls = [0]

        def planned_then_whole():
            calls[0] += 1
            if calls[0] == 1:
                return body()
            # loss.backward() in the graph; Inductor's all-reduce bucketing and compute/comm
            # reordering (compile-time settings: they apply when the first compiled call compiles)
            comm = (
                {}
                if PLAIN_INDUCTOR[0]
                else dict(bucket_all_reduces_fx="all", reorder_for_compute_comm_overlap=True)
            )
            with torch._dynamo.config.patch(trace_autograd_ops=True), torch._inductor.config.patch(**comm):
                return _timed_first(whole, calls[0] == 2)

        return planned_then_whole, ps
    return (torch.compile(step) if compile_step else step), ps


COMPILE_SECONDS: list = []  # the first compiled call of each whole-step side: compile + one step


def _timed_first(whole, first: bool):
    if not first:
        return whole()
    t0 = time.perf_counter()
    out = whole()
    COMPILE_SECONDS.append(time.perf_counter() - t0)
    return out


def _ddp_side(params, x_BD, y_BD, compiled: bool):
    """The same MLP as an ``nn.Module`` in ``DistributedDataParallel`` (compiled: torch's own
    compiled DDP, ``torch.compile(ddp_model)``, its graph split at the buckets), same SGD."""
    D, H = params[0].shape[1], params[0].shape[0]
    model = torch.nn.Sequential(torch.nn.Linear(D, H), torch.nn.GELU(), torch.nn.Linear(H, D))
    with torch.no_grad():
        for p, q in zip(model.parameters(), params):
            p.copy_(q)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    run_model = torch.compile(ddp) if compiled else ddp
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, foreach=True)

    def step():
        opt.zero_grad(set_to_none=True)
        out = F.mse_loss(run_model(x_BD), y_BD)
        out.backward()
        opt.step()
        return out

    return step, list(model.parameters())


def _check(sides: dict, steps: int = 3) -> float:
    """Run every side ``steps`` times from the same parameters; the largest relative difference."""
    for _ in range(steps):
        for step, _ in sides.values():
            step()
    first = next(iter(sides.values()))[1]
    worst = 0.0
    for name, (_, ps) in sides.items():
        for a, b in zip(first, ps):
            a, b = a.detach(), b.detach()
            rel = float((a - b).norm() / a.norm())
            worst = max(worst, rel)
            if not torch.allclose(a, b, rtol=1e-3, atol=1e-5):  # float32, inductor reorders sums
                raise AssertionError(
                    f"{name}: parameters differ from eager after {steps} steps: rel {rel:.2e}"
                )
    return worst


def _time(sides: dict, repeats: int, warmup: int, barrier) -> dict:
    names = list(sides)
    for _ in range(warmup):
        for n in names:
            sides[n]()
    times: dict = {n: [] for n in names}
    for r in range(repeats):
        for n in names if r % 2 == 0 else reversed(names):
            barrier()
            t0 = time.perf_counter()
            sides[n]()
            times[n].append(time.perf_counter() - t0)
    return times


def _profile(sides: dict) -> str:
    from torch.profiler import ProfilerActivity, profile

    out = []
    for n, step in sides.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        out.append(f"--- {n}\n" + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    return "\n".join(out)


def _data(cfg: dict):
    B, D, H = cfg["batch"], cfg["dim"], cfg["hidden"]
    g = torch.Generator().manual_seed(0)
    params = [
        torch.randn(H, D, generator=g) * D**-0.5,
        torch.zeros(H),
        torch.randn(D, H, generator=g) * H**-0.5,
        torch.zeros(D),
    ]
    return params, torch.randn(B, D, generator=g), torch.randn(B, D, generator=g)


def run(cfg: dict) -> dict:
    """One mesh: on a launched worker the real mesh (rank's rows), else the in-process mesh."""
    torch.set_num_threads(cfg["threads"])
    PLAIN_INDUCTOR[0] = cfg.get("plain_inductor", False)

    real = dist.is_available() and dist.is_initialized()
    n = dist.get_world_size() if real else 2
    mesh = fpar.make_mesh((n,), ("data",))
    params, x_BD, y_BD = _data(cfg)
    if real:
        x_BD, y_BD = (t.chunk(n)[dist.get_rank()] for t in (x_BD, y_BD))
    eager = fpar.shard(per_device_loss, mesh, SPECS, P())
    compiled = fpar.shard(torch.compile(per_device_loss), mesh, SPECS, P())
    sides = {
        "eager": _side(eager, params, x_BD, y_BD, False),
        "compiled": _side(compiled, params, x_BD, y_BD, True),
        "compiled f only": _side(compiled, params, x_BD, y_BD, False),
    }
    sides["whole step"] = _side(fpar.shard(per_device_loss, mesh, SPECS, P()), params, x_BD, y_BD, "whole")
    if real:  # torch's own DDP, eager and compiled
        sides["DDP"] = _ddp_side(params, x_BD, y_BD, False)
        sides["DDP compiled"] = _ddp_side(params, x_BD, y_BD, True)
    rel = _check(sides)
    compile_s = COMPILE_SECONDS[-1]
    if not real:  # plain torch, no fpar: what inductor gains on this step at all
        plain = {
            "torch eager": _side(unsharded_loss, params, x_BD, y_BD, False),
            "torch compiled": _side(unsharded_loss, params, x_BD, y_BD, True),
        }
        rel = max(rel, _check(plain))
        sides.update(plain)
    sides = {name: step for name, (step, _) in sides.items()}
    barrier = dist.barrier if real else (lambda: None)
    times = _time(sides, cfg["repeats"], cfg["warmup"], barrier)
    result = {
        "rel": rel,
        "ms": {n: statistics.median(v) * 1e3 for n, v in times.items()},
        "min_ms": {n: min(v) * 1e3 for n, v in times.items()},
        "n": cfg["repeats"],
        "compile_s": compile_s,
    }
    if cfg["profile"]:  # every rank steps (the collectives need both); rank 0's table is printed
        result["profile"] = _profile(sides)
    return result


def tour_loss(params, x, y):
    """The README's tour: column- then row-parallel over "tensor", the mean over "data"."""
    h = x @ params["w1"]
    out = fpar.psum(torch.relu(h) @ params["w2"], "tensor")
    return fpar.pmean(((out - y) ** 2).mean(), "data")


def run_tour(cfg: dict) -> dict:
    """The README's tour step in-process (2 x 4 mesh): eager vs ``torch.compile(step, fullgraph=True)``."""
    torch.set_num_threads(cfg["threads"])
    mesh = fpar.make_mesh((2, 4), ("data", "tensor"))
    specs = {"w1": P(None, "tensor"), "w2": P("tensor", None)}
    loss = fpar.shard(tour_loss, mesh, in_specs=(specs, P("data"), P("data")), out_specs=P())
    g = torch.Generator().manual_seed(0)
    params = {
        "w1": torch.randn(64, 256, generator=g) * 64**-0.5,
        "w2": torch.randn(256, 64, generator=g) * 256**-0.5,
    }
    x, y = torch.randn(32, 64, generator=g), torch.randn(32, 64, generator=g)
    sgd = fpar.optim.sgd(LR, momentum=0.9)

    def make(compiled: bool):
        ps = {k: v.clone().requires_grad_() for k, v in params.items()}
        state = [sgd.init(ps)]

        def body():
            out = loss(ps, x, y)
            out.backward()
            updates, state[0] = sgd.update({k: p.grad for k, p in ps.items()}, state[0], ps)
            with torch.no_grad():
                for k, p in ps.items():
                    p.add_(updates[k])
                    p.grad = None
            return out.detach()

        if not compiled:
            return body, list(ps.values())
        whole = torch.compile(body, fullgraph=True)
        calls = [0]

        def first_eager_then_whole():
            calls[0] += 1
            if calls[0] == 1:
                return body()  # checks the sharded call's signature
            with torch._dynamo.config.patch(trace_autograd_ops=True):
                return _timed_first(whole, calls[0] == 2)

        return first_eager_then_whole, list(ps.values())

    sides = {"tour eager": make(False), "tour whole step": make(True)}
    rel = _check(sides)
    times = _time({n: s for n, (s, _) in sides.items()}, cfg["repeats"] * 5, cfg["warmup"] * 2, lambda: None)
    return {
        "compile_s": COMPILE_SECONDS[-1],
        "rel": rel,
        "ms": {n: statistics.median(v) * 1e3 for n, v in times.items()},
        "min_ms": {n: min(v) * 1e3 for n, v in times.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="D=64 H=256 B=16")
    ap.add_argument("--profile", action="store_true", help="print the top ops of one step per side")
    ap.add_argument("--mesh", choices=("both", "real", "local"), default="both")
    ap.add_argument(
        "--plain-inductor",
        action="store_true",
        help="compile the whole step without Inductor's all-reduce bucketing and reordering passes",
    )
    ap.add_argument("--no-tour", action="store_true", help="skip the README tour step's sides")
    ap.add_argument("--batch", type=int, help="global batch (default 128; --tiny 16)")
    ap.add_argument("--dim", type=int, help="model dim (default 512; --tiny 64)")
    ap.add_argument("--hidden", type=int, help="hidden dim (default 2048; --tiny 256)")
    add_json_arg(ap)
    a = ap.parse_args()
    dims = dict(batch=16, dim=64, hidden=256) if a.tiny else dict(batch=128, dim=512, hidden=2048)
    dims.update({k: getattr(a, k) for k in dims if getattr(a, k) is not None})
    cfg = dict(dims, repeats=a.repeats, warmup=a.warmup, profile=a.profile, plain_inductor=a.plain_inductor)
    record = Record("compile", dict(cfg, mesh=a.mesh))
    print(
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at start"
    )
    label = f"MLP train step B={cfg['batch']} D={cfg['dim']} H={cfg['hidden']} fp32, SGD momentum"
    rows = []
    if a.mesh in ("both", "real"):
        res = fpar.launch(run, 2, dict(cfg, threads=1), timeout=600)[0]
        rows.append(("real mesh, 2 gloo procs", "2x1", res))
    tour = None
    if a.mesh in ("both", "local"):
        rows.append(("in-process mesh data=2", "1", run(dict(cfg, threads=1))))
        tour = None if a.no_tour else run_tour(dict(cfg, threads=1))
    print(f"load average {os.getloadavg()[0]:.2f} at end")
    print(
        "| benchmark | config | compiled (ms) | eager (ms) | ratio | max rel. param diff after 3 steps | threads |"
    )
    print("|---|---|---|---|---|---|---|")
    forms = (
        ("whole step", "eager", "the whole step compiled, fullgraph=True, vs the eager step"),
        (
            "whole step",
            "DDP compiled",
            "the whole step compiled vs torch.compile(DDP model) + backward + SGD",
        ),
        ("DDP compiled", "DDP", "torch's own: compiled DDP vs eager DDP"),
        ("compiled", "eager", "compiled step + fpar.shard(torch.compile(f))"),
        ("compiled f only", "eager", "eager step + fpar.shard(torch.compile(f))"),
        ("torch compiled", "torch eager", "plain torch, no fpar: torch.compile(step)"),
    )
    for where, threads, res in rows:
        ms = res["ms"]
        for c, e, what in forms:
            if c in ms and e in ms:
                print(
                    f"| compile | {label}, {where}: {what} | {ms[c]:.2f} | {ms[e]:.2f} | "
                    f"{ms[c] / ms[e]:.2f}x | {res['rel']:.1e} | {threads} |"
                )
    for where, _, res in rows:
        print(f"compile time of the whole step, {where}: {res['compile_s']:.1f} s (its first compiled call)")
    if tour is not None:
        print(f"compile time of the whole tour step: {tour['compile_s']:.1f} s (its first compiled call)")
        ms = tour["ms"]
        print(
            f"| compile | README tour step (in-process 2x4 mesh, w1 64x256, x 32x64, SGD): the whole step "
            f"compiled, fullgraph=True, vs the eager step | {ms['tour whole step']:.3f} | {ms['tour eager']:.3f} | "
            f"{ms['tour whole step'] / ms['tour eager']:.2f}x | {tour['rel']:.1e} | 1 |"
        )
    for where, _, res in rows:
        if "profile" in res:
            print(f"\n=== profile, {where}\n{res['profile']}")

    def side(res, name):  # (median_s, min_s): what the record takes
        return res["ms"][name] / 1e3, res["min_ms"][name] / 1e3

    for where, _, res in rows:
        mesh_id = "real" if where.startswith("real") else "local"
        step = f"{label}, {where}, 1 thread a process"
        record.compare(
            mesh_id,
            f"{step}: compiled step / eager step, each with `fpar.shard(torch.compile(f))`, vs the eager step with `fpar.shard(f)`",
            [
                ("compiled step", side(res, "compiled"), "eager step", side(res, "eager")),
                ("compiled f only", side(res, "compiled f only"), "eager step", side(res, "eager")),
            ],
        )
        whole = "the whole step compiled (`torch.compile(step, fullgraph=True)`: loss, backward, every all-reduce and SGD in one graph)"
        record.compare(
            "whole" if mesh_id == "real" else "local_whole",
            f"{label}, {where}: {whole} vs the eager step",
            [
                ("whole step", side(res, "whole step"), "eager step", side(res, "eager")),
            ],
        )
        if "DDP" in res["ms"]:
            record.compare(
                "whole_ddp",
                f"{label}, {where}: {whole} vs torch's compiled DDP (`torch.compile(ddp_model)`, backward, SGD)",
                [
                    ("whole step", side(res, "whole step"), "DDP compiled", side(res, "DDP compiled")),
                ],
            )
            record.compare(
                "ddp",
                f"{label}, {where}: torch's own compiled DDP vs eager DDP (no fpar)",
                [
                    ("DDP compiled", side(res, "DDP compiled"), "DDP", side(res, "DDP")),
                ],
            )
        if "torch compiled" in res["ms"]:
            record.compare(
                "torch",
                f"{label}: plain torch's own `torch.compile(step)` vs its eager step (no fpar)",
                [
                    ("torch compiled", side(res, "torch compiled"), "torch eager", side(res, "torch eager")),
                ],
            )
        record.data["extra"][f"max_rel_param_diff_{mesh_id}"] = res["rel"]
        record.data["extra"][f"whole_step_compile_s_{mesh_id}"] = res["compile_s"]
    if tour is not None:
        record.compare(
            "tour",
            "README tour step, in-process data=2 x tensor=4 mesh (w1 64x256, x 32x64), fpar.optim SGD: "
            "the whole step compiled (`torch.compile(step, fullgraph=True)`) vs the eager step",
            [
                (
                    "whole step",
                    (tour["ms"]["tour whole step"] / 1e3, tour["min_ms"]["tour whole step"] / 1e3),
                    "eager step",
                    (tour["ms"]["tour eager"] / 1e3, tour["min_ms"]["tour eager"] / 1e3),
                ),
            ],
        )
        record.data["extra"]["max_rel_param_diff_tour"] = tour["rel"]
        record.data["extra"]["whole_step_compile_s_tour"] = tour["compile_s"]
    record.write(a.json)


if __name__ == "__main__":
    main()
