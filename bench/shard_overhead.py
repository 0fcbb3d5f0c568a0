"""Measure what fpar.shard costs: a sharded MLP step against the same step in plain torch.

The work is one forward + backward of a 2-layer MLP (Megatron layout: w1 column-parallel,
w2 row-parallel, batch split over "data") on the in-process mesh data=2 x tensor=4, i.e. 8
devices simulated in one process with ``torch.func.vmap``. The baseline is what a user would
otherwise run on this machine: the same global function in plain torch, differentiated with
``torch.func.grad`` w.r.t. both weights. Both do the same FLOPs, so the ratio is fpar's
overhead (block layout copies, the vmap'd batched matmuls, the collectives as tensor ops).

The two are timed in one run, interleaved (the order alternates each repeat, after a warm-up),
and medians are reported. The gradients are checked once to agree, so both sides do the same
work. Timings are printed, never asserted.

Run:
    python bench/shard_overhead.py                  # 20 repeats, torch's default thread count
    python bench/shard_overhead.py --repeats 50 --threads 2

Shape suffixes (torchtitan style; inside the sharded function, per-device blocks):
    B  batch: 256 global, 128 per device (split over "data")
    D  model dim: 1024, never split
    H  hidden: 4096 global, 1024 per device (split over "tensor")
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

try:
    import fpar
except ImportError:  # run from a checkout without installing: use the repo's fpar/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import fpar
from _common import Record, add_json_arg

from fpar import P

B, D, H = 256, 1024, 4096
MESH_SHAPE, MESH_AXES = (2, 4), ("data", "tensor")
PARAM_SPECS = {"w1": P(None, "tensor"), "w2": P("tensor", None)}


def loss_local(params, x_BD, y_BD):
    """Per-device loss: column- then row-parallel MLP, MSE averaged over "data"."""
    h_BH = torch.relu(x_BD @ params["w1"])  # (B/2, H/4): column-parallel, no collective
    out_BD = fpar.psum(h_BH @ params["w2"], "tensor")  # (B/2, D): row-parallel all-reduce
    return fpar.pmean(((out_BD - y_BD) ** 2).mean(), "data")


def loss_unsharded(params, x_BD, y_BD):
    """The same loss on global tensors in plain torch."""
    out_BD = torch.relu(x_BD @ params["w1"]) @ params["w2"]  # (B, D)
    return ((out_BD - y_BD) ** 2).mean()


def make_inputs():
    """Return (params, x_BD, y_BD) in float32 from a fixed seed."""
    gen = torch.Generator().manual_seed(0)
    params = {
        "w1": torch.randn(D, H, generator=gen) / D**0.5,  # DH
        "w2": torch.randn(H, D, generator=gen) / H**0.5,  # HD
    }
    x_BD = torch.randn(B, D, generator=gen)
    y_BD = torch.randn(B, D, generator=gen)
    return params, x_BD, y_BD


def time_once(fn, *args) -> float:
    """Return the wall time of one call in seconds."""
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def check_same_grads(grad_sharded, grad_unsharded, args) -> float:
    """Raise SystemExit unless both gradient sets agree; return the max relative difference."""
    g, r = grad_sharded(*args), grad_unsharded(*args)
    worst = 0.0
    for k in r:
        rel = ((g[k] - r[k]).norm() / r[k].norm()).item()
        worst = max(worst, rel)
        if not torch.allclose(g[k], r[k], rtol=1e-4, atol=1e-6 * r[k].abs().max().item()):
            raise SystemExit(f"FAIL: gradient {k!r} differs (relative norm diff {rel:.3e})")
    return worst


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20, help="timed calls of each (median)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls of each first")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    add_json_arg(parser)
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    record = Record(
        "shard_overhead",
        {
            "repeats": args.repeats,
            "warmup": args.warmup,
            "threads": torch.get_num_threads(),
            "batch": B,
            "dim": D,
            "hidden": H,
        },
        argv,
    )

    mesh = fpar.make_mesh(MESH_SHAPE, MESH_AXES)
    sharded = fpar.shard(loss_local, mesh, in_specs=(PARAM_SPECS, P("data"), P("data")), out_specs=P())
    grad_sharded = torch.func.grad(sharded)
    grad_unsharded = torch.func.grad(loss_unsharded)
    inputs = make_inputs()

    rel = check_same_grads(grad_sharded, grad_unsharded, inputs)
    print(f"gradients agree: max relative norm diff {rel:.2e}")

    for _ in range(args.warmup):
        grad_sharded(*inputs)
        grad_unsharded(*inputs)

    times = {"sharded": [], "unsharded": []}
    fns = {"sharded": grad_sharded, "unsharded": grad_unsharded}
    gc.collect()
    gc.disable()  # no collector pauses inside a timed call
    try:
        for i in range(args.repeats):
            order = ("sharded", "unsharded") if i % 2 == 0 else ("unsharded", "sharded")
            for name in order:
                times[name].append(time_once(fns[name], *inputs))
    finally:
        gc.enable()

    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    lo = {k: min(v) * 1e3 for k, v in times.items()}
    hi = {k: max(v) * 1e3 for k, v in times.items()}
    ratio = med["sharded"] / med["unsharded"]
    threads = torch.get_num_threads()
    mesh_str = " x ".join(f"{n}={s}" for n, s in zip(MESH_AXES, MESH_SHAPE))
    print(
        f"MLP fwd+bwd, B={B} D={D} H={H} float32, mesh {mesh_str} (in-process, {mesh.size} "
        f"devices), fpar {fpar.__version__}, torch {torch.__version__}, {threads} threads, {args.repeats} repeats"
    )
    for k in ("sharded", "unsharded"):
        print(f"  {k:9s}  median {med[k]:8.2f} ms   min {lo[k]:8.2f}   max {hi[k]:8.2f}")
    min_ratio = lo["sharded"] / lo["unsharded"]
    print(
        f"  ratio sharded/unsharded: {ratio:.2f}x (medians), {min_ratio:.2f}x (minima); when the "
        f"two disagree much, other load shared the cores: rerun"
    )
    print()
    print("| benchmark | config | sharded (ms) | unsharded (ms) | ratio | threads |")
    print("|---|---|---|---|---|---|")
    print(
        f"| shard_overhead | MLP fwd+bwd B={B} D={D} H={H} fp32, {mesh_str} in-process "
        f"| {med['sharded']:.1f} | {med['unsharded']:.1f} | {ratio:.2f}x | {threads} |"
    )
    print(f"<!-- {platform.processor() or platform.machine()}, torch {torch.__version__} -->")

    record.compare(
        "step",
        f"MLP fwd+bwd B={B} D={D} H={H} fp32, in-process mesh {mesh_str}, {threads} thread{'s' if threads > 1 else ''}: "
        "`fpar.shard` vs the unsharded torch step (`torch.func.grad`)",
        [("fpar", times["sharded"], "torch unsharded", times["unsharded"])],
    )
    record.data["extra"] = {"max_rel_grad_diff": rel}
    record.write(args.json)


if __name__ == "__main__":
    main()
