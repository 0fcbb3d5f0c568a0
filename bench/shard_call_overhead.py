"""What fpar's per-op checks cost on a small sharded step (where per-op Python overhead shows most).

A 2-layer MLP (B=16, D=64, H=256; Megatron layout on the in-process mesh data=2 x tensor=2),
forward + backward with ``torch.func.grad``, timed with fpar's in-place guard (every torch call
inside the sharded function is checked for writing into an input) on and off.  Off = the guard's
method replaced by a no-op, i.e. the code before the guard existed.  Interleaved, warm-up,
medians; the ratio is printed, never asserted.

Run:
    python bench/shard_call_overhead.py --repeats 200
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

try:
    import fpar
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import fpar
from fpar import P
from fpar._local.mode import ShardMode

B, D, H = 16, 64, 256


def loss_local(params, x, y):
    h = torch.relu(x @ params["w1"] + params["b1"])
    out = fpar.psum(h @ params["w2"], "tensor")
    return fpar.pmean(((out - y) ** 2).mean(), "data")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    mesh = fpar.make_mesh((2, 2), ("data", "tensor"))
    specs = {"w1": P(None, "tensor"), "b1": P("tensor"), "w2": P("tensor", None)}
    step = torch.func.grad(fpar.shard(loss_local, mesh, (specs, P("data"), P("data")), P()))
    params = {"w1": torch.randn(D, H), "b1": torch.randn(H), "w2": torch.randn(H, D)}
    x, y = torch.randn(B, D), torch.randn(B, D)
    guard = ShardMode._check_in_place

    def timed(on: bool) -> float:
        ShardMode._check_in_place = guard if on else (lambda self, func, args, kwargs: None)
        t0 = time.perf_counter()
        step(params, x, y)
        return time.perf_counter() - t0

    for _ in range(args.warmup):
        timed(True), timed(False)
    times = {True: [], False: []}
    for i in range(args.repeats):
        for on in (True, False) if i % 2 == 0 else (False, True):
            times[on].append(timed(on))
    ShardMode._check_in_place = guard
    on, off = (statistics.median(times[k]) * 1e3 for k in (True, False))
    print(
        f"small MLP fwd+bwd, data=2 x tensor=2 in-process, {torch.get_num_threads()} threads, {args.repeats} repeats"
    )
    print(f"  in-place guard on   median {on:.3f} ms")
    print(f"  in-place guard off  median {off:.3f} ms")
    print(f"  ratio on/off: {on / off:.3f}x")


if __name__ == "__main__":
    main()
