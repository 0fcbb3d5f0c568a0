"""Tensor-parallel linear layers side by side: 1D, 2D, 2.5D, 3D bytes moved and compute time.

One linear layer ``y = x @ w`` (``x [N, N]``, ``w [N, N]``, float32, so the activation, the
weight and the output all have the same size ``S``), one forward + backward (the vjp w.r.t. ``x``
and ``w``), on the in-process mesh, for each mode:

* 1D: Megatron's row-parallel linear (``fpar.ops.row_linear``: ``x`` split along its features,
  ``w`` by rows, one all-reduce of ``y`` forward), P = 4 and 8;
* 2D: SUMMA (``linear_2d``) on 2 x 2;
* 2.5D: Tesseract (``linear_2p5d``) on d=2 x 2 x 2;
* 3D: ``linear_3d`` on 2 x 2 x 2.

For each it prints the bytes one device sends (``fpar.comm_stats()``, forward + backward), the
formula of fpar's algorithm (which the measurement must equal), the Colossal-AI table's figure
for the same layer (DESIGN §6; see ``fpar/ops/_summa.py`` for why 2D/2.5D differ), and the time
of the sharded step against the unsharded ``x @ w`` step on this machine: medians, interleaved
after a warm-up, gradients checked once.  The in-process mesh runs every device in one process,
so both sides do the same FLOPs and the ratio is what the sharding costs on one machine, not a
multi-GPU speed-up.  Timings are printed, never asserted.

Run:
    python bench/tensor_parallel.py                 # N = 512, 7 repeats (~20 s on 2 cores)
    python bench/tensor_parallel.py --n 1024 --repeats 11 --threads 2

Shape suffixes (global tensors): N batch = in features = out features.
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import sys
import time
from fractions import Fraction
from functools import partial
from pathlib import Path

import torch

try:
    import fpar
except ImportError:  # run from a checkout without installing: use the repo's fpar/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import fpar
import fpar.ops
from fpar import P
from fpar.ops import linear_2d, linear_2p5d, linear_3d, specs_2d, specs_2p5d, specs_3d


def modes(n_bytes: int):
    """``(name, mesh, per-device fn, in_specs, out_spec, ours, paper)``; S = n_bytes per tensor."""
    S = Fraction(n_bytes)
    out = []
    for p in (4, 8):
        out.append(
            (
                "1D (Megatron row)",
                fpar.make_mesh((p,), ("tensor",)),
                partial(fpar.ops.row_linear, axis="tensor"),
                (P(None, "tensor"), P("tensor", None)),
                P(),
                2 * Fraction(p - 1, p) * S,  # one all-reduce of y forward; dx, dw local
                2 * Fraction(p - 1, p) * S,  # table: 2(P-1)/P of S
            )
        )
    q, d = 2, 2
    s = specs_2d()
    out.append(
        (
            "2D (SUMMA)",
            fpar.make_mesh((q, q), ("tensor_row", "tensor_col")),
            partial(linear_2d, row_axis="tensor_row", col_axis="tensor_col"),
            (s.x, s.w),
            s.y,
            2 * (q - 1) * (S + S) / q**2,  # all_gather + psum_scatter of x and of w
            Fraction(6 * (q - 1), q) * S / q,  # table: 6(q-1)/q in units of S/q
        )
    )
    s = specs_2p5d()
    out.append(
        (
            "2.5D (Tesseract)",
            fpar.make_mesh((d, q, q), ("tensor_dep", "tensor_row", "tensor_col")),
            partial(linear_2p5d, dep_axis="tensor_dep", row_axis="tensor_row", col_axis="tensor_col"),
            (s.x, s.w),
            s.y,
            2 * (q - 1) * (S / (d * q**2) + S / q**2) + 2 * Fraction(d - 1, d) * S / q**2,  # + depth dw
            Fraction(3 * (q - 1) * (d + 1), d * q) * S / q,  # table: 3(q-1)(d+1)/(dq), units S/q
        )
    )
    s = specs_3d()
    out.append(
        (
            "3D",
            fpar.make_mesh((q, q, q), ("tensor_x", "tensor_y", "tensor_z")),
            partial(linear_3d, input_axis="tensor_y", weight_axis="tensor_x", output_axis="tensor_z"),
            (s.x, s.w),
            s.y,
            2 * (q - 1) * (S + S + S) / q**3,  # x, w gathered, y scattered; transposes backward
            Fraction(6 * (q - 1), q**3) * S,  # table: 6(q-1)/q^3 of S
        )
    )
    return out


def step_fn(f):
    """One forward + backward: the vjp of ``f`` w.r.t. both arguments for a ones cotangent."""

    def step(x, w):
        y, vjp = torch.func.vjp(f, x, w)
        return vjp(torch.ones_like(y))

    return step


def unsharded(x, w):
    return x @ w


def measure_bytes(step, x, w) -> tuple[int, str]:
    """Bytes one device sends in one step, in total and per axis/collective."""
    fpar.reset_comm_stats()
    step(x, w)
    stats = fpar.comm_stats()
    total = sum(v["bytes"] for kinds in stats.values() for v in kinds.values())
    parts = [
        f"{ax} {k} {v['bytes'] / 2**10:.0f}"
        for ax, kinds in sorted(stats.items())
        for k, v in sorted(kinds.items())
        if v["bytes"]
    ]
    return total, "; ".join(parts)


def check_same(step, ref, x, w) -> None:
    for name, g, r in zip(("x", "w"), step(x, w), ref(x, w)):
        if not torch.allclose(g, r, rtol=1e-4, atol=1e-4 * r.abs().max().item()):
            raise SystemExit(f"FAIL: gradient of {name} differs from the unsharded one")


def time_pair(fns: dict, args, repeats: int, warmup: int) -> dict[str, float]:
    """Median ms of each, interleaved (the order alternates every repeat)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn(*args)
    times = {k: [] for k in fns}
    gc.collect()
    gc.disable()
    try:
        for i in range(repeats):
            for k in list(fns) if i % 2 == 0 else list(fns)[::-1]:
                t0 = time.perf_counter()
                fns[k](*args)
                times[k].append(time.perf_counter() - t0)
    finally:
        gc.enable()
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=512, help="batch = in = out features (divisible by 8)")
    parser.add_argument("--repeats", type=int, default=7, help="timed steps of each (median)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps of each first")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    n = args.n
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen) / n**0.5
    S = x.numel() * x.element_size()
    ref = step_fn(unsharded)

    rows = []
    for name, mesh, f, in_specs, out_spec, ours, paper in modes(S):
        step = step_fn(fpar.shard(f, mesh, in_specs, out_spec))
        check_same(step, ref, x, w)
        measured, parts = measure_bytes(step, x, w)
        ms = time_pair({"fpar": step, "unsharded": ref}, (x, w), args.repeats, args.warmup)
        shape = " x ".join(str(s) for s in mesh.axis_sizes)
        rows.append((name, shape, measured, ours, paper, parts, ms))

    print(
        f"one linear layer fwd+bwd, x [{n}, {n}] @ w [{n}, {n}] float32 (S = {S / 2**20:g} MiB per tensor), "
        f"in-process mesh, fpar {fpar.__version__}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {args.repeats} repeats (medians)"
    )
    print()
    print(
        "| mode | mesh | bytes/device measured | formula (fpar's algorithm) | measured/S | "
        "Colossal-AI table /S | fpar (ms) | unsharded (ms) | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, shape, measured, ours, paper, _, ms in rows:
        ok = "=" if measured == ours else "!="
        print(
            f"| {name} | {shape} | {measured:,} | {ok} {int(ours):,} | {measured / S:.3f} | "
            f"{float(paper / S):.3f} | {ms['fpar']:.1f} | {ms['unsharded']:.1f} | "
            f"{ms['fpar'] / ms['unsharded']:.2f}x |"
        )
    print()
    print("per axis and collective (KiB per device):")
    for name, shape, *_, parts, _ in rows:
        print(f"  {name} {shape}: {parts}")
    print(f"<!-- {platform.processor() or platform.machine()}, torch {torch.__version__} -->")
    if any(measured != ours for _, _, measured, ours, *_ in rows):
        raise SystemExit("FAIL: measured bytes differ from the formula")


if __name__ == "__main__":
    main()
