"""bf16 tensor-parallel sums in float32 (fpar's rule) or in bf16 (Megatron-LM's): the loss curves.

``examples/train_gpt.py`` three ways on the same in-process mesh (``data=2 x tensor=4``: a sum over
4 devices rounds differently in bf16 than in float32, over 2 it does not), the same seed and data:

* float32 everything (the reference curve);
* bfloat16 compute on float32 master weights, sums over devices in float32 rounded once
  (``fpar.low_precision_sums("float32")``, the default);
* the same with bf16 sums (``"native"``: half the bytes of every tensor-parallel all-reduce).

Printed: each curve's mean loss over the last 20 steps, each bf16 curve's
largest and mean distance from the float32 one over the run, and the bytes the tensor axis sent
per step.  Decides whether the float32 rule earns its bytes (issue 52, item 4).

Run:
    python bench/low_precision_sums.py                 # 300 steps each
    python bench/low_precision_sums.py --steps 100
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))

import train_gpt  # noqa: E402


def run(steps: int, extra: list[str], ckpt: str) -> train_gpt.Result:
    argv = ["--parallel", "pipeline=1,data=2,tensor=4", "--steps", str(steps), "--quiet", "--sample", "0"]
    argv += ["--plot", "none", "--ckpt-dir", ckpt, "--ckpt-every", "0", *extra]
    return train_gpt.main(argv)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args(argv)
    ways = {
        "float32": [],
        "bf16 compute, float32 sums": ["--compute-dtype", "bfloat16", "--sums", "float32"],
        "bf16 compute, bf16 sums": ["--compute-dtype", "bfloat16", "--sums", "native"],
    }
    got = {}
    for name, extra in ways.items():
        with tempfile.TemporaryDirectory() as d:
            got[name] = run(args.steps, extra, d)
    ref = got["float32"].losses
    print(f"# examples/train_gpt.py, data=2 x tensor=4 in-process, {args.steps} steps, seed 0")
    print("| run | last-20 mean loss | max abs diff from float32 | mean abs diff | tensor bytes / step |")
    print("|---|---|---|---|---|")
    for name, res in got.items():
        diffs = [abs(a - b) for a, b in zip(res.losses, ref)]
        tensor = res.comm.get("tensor", 0)
        print(
            f"| {name} | {statistics.fmean(res.losses[-20:]):.4f} | {max(diffs):.4f} | "
            f"{statistics.fmean(diffs):.4f} | {tensor / 1e6:.2f} MB |"
        )
    a, b = got["bf16 compute, float32 sums"].losses, got["bf16 compute, bf16 sums"].losses
    between = [abs(x - y) for x, y in zip(a, b)]
    print(f"\nbf16 sums against float32 sums: max {max(between):.4f}, mean {statistics.fmean(between):.4f}")


if __name__ == "__main__":
    main()
