"""fpar.random.uniform (Philox-4x32-10 as integer tensor ops) vs torch.rand, same sizes.

Each row draws one device's local block of ``n`` float32 elements: ``fpar.random.uniform`` of
a global shape computed outside ``fpar.shard`` (the same work a device does for its block inside
``shard`` with a spec), next to ``torch.rand(n)`` (CPU: mt19937; CUDA: Philox in one fused
kernel).  One extra row times the block inside ``fpar.shard`` on an in-process mesh of 4
devices, ``spec=P("data")``, against ``torch.rand`` of the same global size.  The two sides are
interleaved; medians over ``--reps`` after a warm-up; the ratio is fpar / torch.  Rows marked
"compiled" use ``fpar.random.set_compiled(True)`` (the same bits from a ``torch.compile``d Philox
kernel; its one-time compile is excluded by the warm-up and printed on its own).

    python bench/rng.py                 # CPU, 1 thread
    python bench/rng.py --device cuda   # on a GPU
    python bench/rng.py --guard         # also: the real mesh's fast-call draw check, on vs off

``--guard`` times a fast (planned) call of a small sharded function on a 2-process gloo mesh
with the check that torch's generators did not draw during the call (``_generator_states``
before and after) on, and off (the check replaced by a constant), interleaved.
"""

from __future__ import annotations

import os
import sys

# This file is named like the standard library's ``random``: keep its folder off the import path.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

import fpar  # noqa: E402
from fpar import P  # noqa: E402


def timed(fn, sync) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def compare(a, b, reps: int, sync) -> tuple[float, float]:
    for _ in range(2):  # warm-up
        a(), b()
    ta, tb = [], []
    for _ in range(reps):
        ta.append(timed(a, sync))
        tb.append(timed(b, sync))
    return statistics.median(ta), statistics.median(tb)


def compiled(fn):
    """``fn`` with the compiled Philox kernel on."""

    def run():
        fpar.random.set_compiled(True)
        try:
            return fn()
        finally:
            fpar.random.set_compiled(False)

    return run


def guard_cost(reps: int) -> list:
    """Per rank: median seconds of a fast call with the generator check on and off."""
    from fpar._dist import shard as dist_shard

    mesh = fpar.make_mesh((2,), ("data",))
    w = torch.randn(64, 64)
    f = fpar.shard(lambda w, x: torch.tanh(x @ w), mesh, (P(), P("data")), P("data"))
    x = torch.randn(8, 64)
    real = dist_shard._generator_states

    def on():
        dist_shard._generator_states = real
        f(w, x)

    def off():
        dist_shard._generator_states = lambda: ()
        f(w, x)

    ta, tb = compare(on, off, reps, lambda: None)
    dist_shard._generator_states = real
    return ta, tb


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--sizes", default="65536,1048576,4194304")
    ap.add_argument("--guard", action="store_true", help="time the real mesh's fast-call draw check")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    key = fpar.random.key(0, device=dev)
    print(f"device {dev}, {torch.get_num_threads()} thread(s), torch {torch.__version__}")
    t0 = time.perf_counter()
    compiled(lambda: fpar.random.uniform(key, (4096,)))()
    sync()
    print(f"first compiled draw (compile, or load from inductor's cache): {time.perf_counter() - t0:.1f} s")
    print(f"{'case':34s} {'n':>9s} {'fpar ms':>9s} {'torch ms':>9s} {'ratio':>6s}")
    for n in (int(s) for s in args.sizes.split(",")):
        rows = [
            (
                "uniform float32 (n,)",
                lambda n=n: fpar.random.uniform(key, (n,)),
                lambda n=n: torch.rand(n, device=dev),
            ),
            (
                "uniform float32 (n/1024, 1024)",
                lambda n=n: fpar.random.uniform(key, (n // 1024, 1024)),
                lambda n=n: torch.rand(n // 1024, 1024, device=dev),
            ),
            (
                "bernoulli 0.9 (dropout mask)",
                lambda n=n: fpar.random.bernoulli(key, 0.9, (n,)),
                lambda n=n: torch.rand(n, device=dev) < 0.9,
            ),
            (
                "uniform float32 (n,) compiled",
                compiled(lambda n=n: fpar.random.uniform(key, (n,))),
                lambda n=n: torch.rand(n, device=dev),
            ),
            (
                "bernoulli 0.9 compiled",
                compiled(lambda n=n: fpar.random.bernoulli(key, 0.9, (n,))),
                lambda n=n: torch.rand(n, device=dev) < 0.9,
            ),
        ]
        for name, a, b in rows:
            ta, tb = compare(a, b, args.reps, sync)
            print(f"{name:34s} {n:9d} {1e3 * ta:9.3f} {1e3 * tb:9.3f} {ta / tb:6.2f}")
    mesh = fpar.make_mesh((4,), ("data",))
    n = 1 << 20
    inside = fpar.shard(lambda k: fpar.random.uniform(k, (n,), spec=P("data")), mesh, (P(),), P("data"))
    ta, tb = compare(lambda: inside(key), lambda: torch.rand(n, device=dev), args.reps, sync)
    print(f"{'in shard, 4 devices, P(data)':34s} {n:9d} {1e3 * ta:9.3f} {1e3 * tb:9.3f} {ta / tb:6.2f}")
    if args.guard:
        for rank, (ta, tb) in enumerate(fpar.launch(guard_cost, 2, 200)):
            print(
                f"real mesh fast call, rank {rank}: check on {1e6 * ta:.1f} us, off {1e6 * tb:.1f} us, "
                f"cost {1e6 * (ta - tb):.1f} us ({ta / tb:.3f}x)"
            )


if __name__ == "__main__":
    main()
