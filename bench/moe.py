"""Expert-parallel MoE layer (``fpar.ops.moe``) against a plain torch MoE, side by side, with bytes moved.

The layer: ``T`` tokens of width ``D``, ``E`` experts of hidden width ``H``, top-``k`` routing,
float32, one forward + backward of ``<y, ct> + aux`` w.r.t. the parameters and the tokens.

* **in-process**: ``fpar.shard(moe, axis="expert")`` on the in-process mesh of ``n`` devices
  (``T`` global tokens) against the same global layer in plain torch (the loop-over-experts MoE
  of HF Mixtral / torchtitan's reference: ``nonzero`` per expert, one matmul per expert,
  ``index_add_`` back), which does the whole mesh's work in one process;
* **gloo**: the same layer on 2 gloo processes (``fpar.launch``, 1 thread each), ``T / 2`` tokens
  per process, against the plain torch MoE of ``T / 2`` tokens and all experts on each process:
  the same per-device tokens, with no exchange; and against ``fpar.ops.moe(axis=None)`` on the
  same tokens (sorted + grouped, every expert local): what the exchange itself costs;
* **fpar, unsharded**: ``fpar.ops.moe`` with ``axis=None`` against the same plain torch MoE.

Both sides are warmed up and timed interleaved (the order alternates every repeat); medians and
ratios are printed, never asserted.  Checked once first: fpar's values and gradients equal the
plain torch MoE's (in-process, and each gloo rank's gathered gradients against the torch MoE on
all ``T`` tokens); the gloo gradients are also compared leaf by leaf with the in-process mesh's.

Bytes per device per layer, fwd + bwd (``fpar.comm_stats()``).  On the real mesh (exact counts,
``fpar/ops/_moe.py``): the rows this rank sends to other ranks' experts (``out``) and the rows
it returns to them (``in``), each crossing twice (forward, and the backward's transpose), plus
the ``[n, E/n]`` int64 counts::

    2 (out + in) D s + (n-1)/n E 8          balanced: 4 (n-1)/n T_local k D s + (n-1)/n E 8

``routed_bytes`` counts ``out`` and ``in`` from the routing each rank sees and is printed beside
the measured figure.  In-process (static slots, ``C = T_local * min(E/n, k)`` rows per source ->
destination slot)::

    forward   2 (n-1) C D s  +  (n-1) C 8         payload dispatch + combine, int64 expert ids
    backward  2 (n-1) C D s                       the two payload transposes
    psum      [2, E] aux sums forward, the replicated router's [D, E] gradient backward:
              2 (n-1)/n * (2 E + D E) s

``--skew`` routes every token to experts 0..k-1 (all on device 0): the worst case for memory
and balance (``--tokens 8192 --skew``: dropless, peak RSS printed per rank).

Run:
    python bench/moe.py                       # T=2048 D=256 H=512 E=8 k=2, n=2, 10 repeats
    python bench/moe.py --experts 16 --top-k 1 --skip-in-process
    python bench/moe.py --tokens 8192 --skew --skip-in-process --repeats 3
"""

from __future__ import annotations

import argparse
import gc
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import optree
import torch
import torch.distributed as dist
import torch.nn.functional as F

try:
    import fpar
except ImportError:  # run from a checkout without installing: use the repo's fpar/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import fpar
from _common import Record, add_json_arg

import fpar.ops as ops
from fpar import P

NPROCS = 2


def torch_moe(params, x_TD, k):
    """A plain torch MoE (Mixtral style): per expert, select its tokens, one matmul each, add back."""
    router, w_in, w_out = params["router"], params["w_in"], params["w_out"]
    e = router.shape[1]
    probs_TE = torch.softmax(x_TD @ router, dim=-1)
    w_TK, idx_TK = probs_TE.topk(k, dim=-1)
    w_TK = w_TK / w_TK.sum(-1, keepdim=True)
    y_TD = torch.zeros_like(x_TD)
    for ex in range(e):
        tok, slot = (idx_TK == ex).nonzero(as_tuple=True)
        h = F.gelu(x_TD[tok] @ w_in[ex]) @ w_out[ex]
        y_TD = y_TD.index_add(0, tok, h * w_TK[tok, slot].unsqueeze(1))
    f_E = torch.bincount(idx_TK.reshape(-1), minlength=e).to(x_TD.dtype) / idx_TK.numel()
    return y_TD, e * (f_E * probs_TE.mean(0)).sum()


def make(cfg, t):
    gen = torch.Generator().manual_seed(0)
    d, h, e = cfg["dim"], cfg["hidden"], cfg["experts"]
    params = {
        "router": torch.randn(d, e, generator=gen),
        "w_in": torch.randn(e, d, h, generator=gen) * d**-0.5,
        "w_out": torch.randn(e, h, d, generator=gen) * h**-0.5,
    }
    x = torch.randn(t, d, generator=gen)
    ct = torch.randn(t, d, generator=gen)
    return params, x, ct


def _obj(fn, p, x, ct):
    y, aux = fn(p, x)
    return (y * ct).sum() + aux


def objective(fn, ct):
    return torch.func.grad(lambda p, x: _obj(fn, p, x, ct), argnums=(0, 1))


def check_same(a, b, what):
    for u, v in zip(optree.tree_leaves(a), optree.tree_leaves(b)):
        torch.testing.assert_close(u, v, rtol=1e-3, atol=1e-4, msg=lambda m: f"{what}: {m}")


def time_pair(steps: dict, repeats: int, warmup: int, sync=None) -> dict:
    names = list(steps)
    for _ in range(warmup):
        for s in steps.values():
            s()
    times = {k: [] for k in names}
    gc.collect()
    gc.disable()
    try:
        for i in range(repeats):
            for name in names if i % 2 == 0 else names[::-1]:
                if sync is not None:
                    sync()
                t0 = time.perf_counter()
                steps[name]()
                times[name].append(time.perf_counter() - t0)
    finally:
        gc.enable()
    return times


def formula(cfg, n, t_local, itemsize=4):
    """The bytes the issue's formulas give per device, fwd + bwd (see the module docstring)."""
    d, e, k = cfg["dim"], cfg["experts"], cfg["top_k"]
    cap = t_local * min(e // n, k)
    static = 4 * (n - 1) * cap * d * itemsize + (n - 1) * cap * 8  # in-process static slots
    counts = (n - 1) * e * 8 // n  # the [n, E/n] int64 counts, forward only
    balanced = 4 * ((n - 1) * t_local * k * d * itemsize // n) + counts  # exact counts, balanced routing
    aux = 2 * (n - 1) * (2 * e + d * e) * itemsize // n  # aux sums forward, router gradient backward
    return {"static": static, "balanced": balanced, "counts": counts, "psum": aux, "cap": cap}


def routed_bytes(params, x_local, cfg, rank, n, itemsize=4):
    """The exact-count bytes one rank sends, fwd + bwd, from the routing it actually sees.

    Rows it sends (pairs of its tokens whose expert lives elsewhere) go out in the forward's
    dispatch and come back as the backward's combine transpose; rows it returns (pairs of the
    other ranks' tokens routed to its experts) leave in the forward's combine and the backward's
    dispatch transpose.  The rows of every rank are gathered so each can count what it returns.
    """
    d, e, k = cfg["dim"], cfg["experts"], cfg["top_k"]
    idx = torch.softmax(x_local @ params["router"], -1).topk(k, -1).indices
    dest = idx // (e // n)
    sent = torch.bincount(dest.reshape(-1), minlength=n)  # rows this rank sends to each rank
    every = [torch.zeros_like(sent) for _ in range(n)]
    dist.all_gather(every, sent)
    out = int(sent.sum() - sent[rank])
    back = sum(int(every[r][rank]) for r in range(n) if r != rank)
    return 2 * (out + back) * d * itemsize + (n - 1) * e * 8 // n


def expert_layer(mesh, k):
    def per_device(p, x):
        return ops.moe(p, x, top_k=k, axis="expert")

    return fpar.shard(per_device, mesh, (ops.moe_specs("expert"), P("expert")), (P("expert"), P()))


def skew_router(params, x):
    """Every token's top choices are experts 0, 1, ... (all on device 0): the worst case."""
    d, e = params["router"].shape
    params = dict(params, router=torch.zeros(d, e))
    params["router"][:, : min(e, 4)] = torch.tensor([4.0, 3.0, 2.0, 1.0][: min(e, 4)])
    return params, x.abs() + 0.1


def worker(cfg: dict) -> dict:
    """On each of the 2 gloo processes: check, count bytes, time fpar EP vs the local torch MoE."""
    torch.set_num_threads(cfg["threads"])
    n, rank = dist.get_world_size(), dist.get_rank()
    mesh = fpar.make_mesh((n,), ("expert",))
    params, x, ct = make(cfg, cfg["tokens"])
    if cfg["skew"]:
        params, x = skew_router(params, x)
    specs = ops.moe_specs("expert")
    p_local = fpar.device_put(params, mesh, specs)
    x_local, ct_local = fpar.device_put((x, ct), mesh, P("expert"))
    ep = objective(expert_layer(mesh, cfg["top_k"]), ct_local)
    base = objective(lambda p, x: torch_moe(p, x, cfg["top_k"]), ct_local)
    want = fpar.gather(ep(p_local, x_local), mesh, (specs, P("expert")))
    # The torch MoE on all T tokens: the EP layer's global gradients (aux is global in both).
    full = objective(lambda p, x: torch_moe(p, x, cfg["top_k"]), ct)(params, x)
    check_same(want, full, f"rank {rank}: EP on gloo vs torch")
    fpar.reset_comm_stats()
    ep(p_local, x_local)
    stats = fpar.comm_stats()
    expected = routed_bytes(params, x_local, cfg, rank, n)
    local = objective(
        lambda p, x: ops.moe(p, x, top_k=cfg["top_k"]), ct_local
    )  # sorted + grouped, no exchange
    times = time_pair(
        {
            "fpar": lambda: ep(p_local, x_local),
            "torch": lambda: base(params, x_local),
            "grouped, no exchange": lambda: local(params, x_local),
        },
        cfg["repeats"],
        cfg["warmup"],
        sync=dist.barrier,
    )
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB (Linux: KiB)
    return {"times": times, "stats": stats, "expected": expected, "peak_mib": peak, "grads": want}


def in_process(args, cfg) -> list:
    t, n, k = args.tokens, args.devices, args.top_k
    params, x, ct = make(cfg, t)
    if args.skew:
        params, x = skew_router(params, x)
    mesh = fpar.make_mesh((n,), ("expert",))
    ep = objective(expert_layer(mesh, k), ct)
    unsharded = objective(lambda p, x: ops.moe(p, x, top_k=k), ct)
    base = objective(lambda p, x: torch_moe(p, x, k), ct)
    want = base(params, x)
    check_same(ep(params, x), want, "in-process EP vs torch")
    check_same(unsharded(params, x), want, "fpar unsharded vs torch")
    print("checked: fpar (EP in-process, unsharded) gives the plain torch MoE's gradients")

    fpar.reset_comm_stats()
    ep(params, x)
    stats = fpar.comm_stats()["expert"]
    form = formula(cfg, n, t // n)
    times = time_pair(
        {
            "fpar EP": lambda: ep(params, x),
            "fpar unsharded": lambda: unsharded(params, x),
            "torch": lambda: base(params, x),
        },
        args.repeats,
        args.warmup,
    )
    med = {kk: statistics.median(v) * 1e3 for kk, v in times.items()}
    print(f"in-process, expert={n}: static slots, C = {form['cap']} rows per (source -> destination) slot")
    for kk in med:
        print(f"  {kk:15s} median {med[kk]:8.1f} ms   min {min(times[kk]) * 1e3:8.1f}")
    print(
        f"  ratio EP / torch {med['fpar EP'] / med['torch']:.2f}x, unsharded / torch "
        f"{med['fpar unsharded'] / med['torch']:.2f}x"
    )
    print(
        f"  bytes/device fwd+bwd: all_to_all {stats['all_to_all']['bytes']:,} B (static-slot formula "
        f"{form['static']:,}), psum {stats['psum']['bytes']:,} B (formula {form['psum']:,})"
    )
    args.in_process_times = times  # for the JSON record (--json)
    return [
        (
            f"in-process expert={n}, T={t}",
            med["fpar EP"],
            med["torch"],
            stats["all_to_all"]["bytes"],
            form["static"],
        ),
        ("unsharded (axis=None), same T", med["fpar unsharded"], med["torch"], None, None),
    ]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048, help="T, global tokens")
    ap.add_argument("--dim", type=int, default=256, help="D")
    ap.add_argument("--hidden", type=int, default=512, help="H, each expert's hidden width")
    ap.add_argument("--experts", type=int, default=8, help="E")
    ap.add_argument("--top-k", type=int, default=2, help="k")
    ap.add_argument("--devices", type=int, default=2, help="n, the in-process expert axis")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (per process under gloo)")
    ap.add_argument("--skew", action="store_true", help="every token to experts 0..k-1 (all on device 0)")
    ap.add_argument("--skip-gloo", action="store_true", help="in-process only")
    ap.add_argument("--skip-in-process", action="store_true", help="gloo only")
    add_json_arg(ap)
    args = ap.parse_args(argv)
    cfg = {
        "tokens": args.tokens,
        "dim": args.dim,
        "hidden": args.hidden,
        "experts": args.experts,
        "top_k": args.top_k,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "threads": args.threads,
        "skew": args.skew,
    }
    record = Record(
        "moe",
        dict(cfg, devices=args.devices, skip_gloo=args.skip_gloo, skip_in_process=args.skip_in_process),
        argv,
    )
    torch.set_num_threads(args.threads)
    t, k = args.tokens, args.top_k
    print(
        f"MoE fwd+bwd T={t} D={args.dim} H={args.hidden} E={args.experts} k={k} fp32"
        f"{' skewed router' if args.skew else ''}, {args.threads} thread(s), {args.repeats} repeats, "
        f"torch {torch.__version__}"
    )
    rows = [] if args.skip_in_process else in_process(args, cfg)
    if not args.skip_gloo and args.devices == NPROCS:  # the same layout in-process, for bit equality
        params, x, ct = make(cfg, t)
        if args.skew:
            params, x = skew_router(params, x)
        inproc = objective(expert_layer(fpar.make_mesh((NPROCS,), ("expert",)), k), ct)(params, x)

    if not args.skip_gloo:
        res = fpar.launch(worker, NPROCS, cfg, timeout=600.0)
        form = formula(cfg, NPROCS, t // NPROCS)
        print(f"gloo, {NPROCS} processes x {args.threads} thread(s), T/{NPROCS} tokens each, exact counts:")
        for rank, r in enumerate(res):
            med = {kk: statistics.median(v) * 1e3 for kk, v in r["times"].items()}
            st = r["stats"]["expert"]
            print(
                f"  rank {rank}: fpar median {med['fpar']:.1f} ms (min {min(r['times']['fpar']) * 1e3:.1f}), "
                f"torch {med['torch']:.1f} ms (min {min(r['times']['torch']) * 1e3:.1f}); ratio "
                f"{med['fpar'] / med['torch']:.2f}x; peak RSS {r['peak_mib']:.0f} MiB"
            )
            print(
                f"          vs the same grouped MoE on its tokens with every expert local (no exchange, "
                f"{med['grouped, no exchange']:.1f} ms): {med['fpar'] / med['grouped, no exchange']:.2f}x"
            )
            print(
                f"          all_to_all {st['all_to_all']['bytes']:,} B (rows it routed: {r['expected']:,}; "
                f"balanced formula {form['balanced']:,}), psum {st['psum']['bytes']:,} B (formula {form['psum']:,})"
            )
        if args.devices == NPROCS:
            paths, leaves, _ = optree.tree_flatten_with_path(inproc)
            diff = {
                "/".join(map(str, path)): float((a - b).abs().max())
                for path, a, b in zip(paths, leaves, optree.tree_leaves(res[0]["grads"]))
            }
            print(f"  gradients vs the in-process mesh's (expert={NPROCS}), max |diff| per leaf: {diff}")
        r0 = res[0]
        med0 = {kk: statistics.median(v) * 1e3 for kk, v in r0["times"].items()}
        st0 = r0["stats"]["expert"]
        rows.append(
            (
                f"{NPROCS} gloo procs, T/{NPROCS} each",
                med0["fpar"],
                med0["torch"],
                st0["all_to_all"]["bytes"],
                r0["expected"],
            )
        )

    print()
    print("| bench/moe.py | fpar (ms) | torch MoE (ms) | ratio | all_to_all B/device fwd+bwd (formula) |")
    print("|---|---|---|---|---|")
    for name, a, b, got, want in rows:
        byt = "–" if got is None else f"{got:,} ({want:,})"
        print(f"| {name} | {a:.1f} | {b:.1f} | {a / b:.2f}x | {byt} |")
    print(f"<!-- {platform.processor() or platform.machine()}, torch {torch.__version__} -->")

    layer = (
        f"MoE layer fwd+bwd, T={t} D={args.dim} H={args.hidden} E={args.experts} k={k} fp32"
        f"{', every token to experts 0..k-1' if args.skew else ''}"
    )
    if not args.skip_in_process:
        ti = args.in_process_times
        record.compare(
            "in_process",
            f"{layer}, in-process mesh expert={args.devices}, {args.threads} thread: "
            '`fpar.ops.moe(axis="expert")` vs the plain torch MoE on all T tokens',
            [("fpar EP", ti["fpar EP"], "torch MoE", ti["torch"])],
        )
        record.compare(
            "unsharded",
            f"{layer}, one process: `fpar.ops.moe(axis=None)` vs the plain torch MoE",
            [
                ("fpar unsharded", ti["fpar unsharded"], "torch MoE", ti["torch"]),
            ],
        )
    if not args.skip_gloo:
        tg = res[0]["times"]
        record.compare(
            "gloo",
            f"{layer}, {NPROCS} gloo processes x {args.threads} thread, T/{NPROCS} tokens each (rank 0): "
            "fpar's expert-parallel layer vs the plain torch MoE on the same tokens",
            [("fpar EP", tg["fpar"], "torch MoE", tg["torch"])],
        )
        record.compare(
            "exchange",
            f"{layer}, {NPROCS} gloo processes (rank 0): fpar's layer vs the same grouped "
            "layer with every expert local (no exchange): what the exchange costs",
            [
                ("fpar EP", tg["fpar"], "grouped, no exchange", tg["grouped, no exchange"]),
            ],
        )
        record.data["extra"] = {
            "peak_rss_mib": [r["peak_mib"] for r in res],
            "all_to_all_bytes": [r["stats"]["expert"]["all_to_all"]["bytes"] for r in res],
            "routed_bytes": [r["expected"] for r in res],
        }
    record.write(args.json)


if __name__ == "__main__":
    main()
