"""A data-parallel training step through ``fpar.shard`` against the same step in JAX's ``shard_map``.

fpar is ``jax.shard_map`` on PyTorch: a user who knows JAX compares the two first.  Both sides
train the same 2-layer MLP (``gelu(x @ w1.T + b1) @ w2.T + b2``, exact GELU, float32, MSE loss)
on the same batch, split over a ``data`` axis of 2 devices in this one process, the parameters
replicated, with SGD (momentum 0.9, lr 0.01):

* **JAX**: ``jax.jit`` of the step (``jax.grad`` of ``jax.shard_map(loss, mesh,
  in_specs=(P(), P("data"), P("data")), out_specs=P())``, the loss ``jax.lax.pmean`` over
  ``data``, then the momentum update), parameters and momentum donated, on 2 host-platform CPU
  devices (``--xla_force_host_platform_device_count=2``); each timed step waits for its result
  (``block_until_ready``).
* **fpar compiled**: the same step on fpar's in-process mesh ``data=2`` compiled whole,
  ``torch.compile(step, fullgraph=True)`` (the sharded loss, its backward, the all-reduce and
  ``fpar.optim.sgd``'s update in one graph: ``bench/compile.py``'s "whole step"), inductor.
* **fpar eager**: the same step eagerly, ``loss.backward()`` and the same update.

JAX compiles the whole step, so the compiled fpar step is its counterpart; the eager one is
shown for what compiling buys.  Threads: torch gets ``--threads`` (default 2, the machine's
cores) and XLA its default CPU thread pool.

Checked first: from the same parameters, 3 steps of each side give the same parameters
(float32 tolerance).  Then the sides are warmed up (compilation included) and timed interleaved,
the order rotating every repeat; medians and the ratios fpar / JAX are printed, never asserted.
JAX is not a dependency of fpar: ``pip install jax`` (CPU) to run this.

Run:
    python bench/jax_shard_map.py                      # D=512 H=2048 B=128, 30 repeats
    python bench/jax_shard_map.py --tiny --repeats 200 # D=64 H=256 B=16: the fixed cost of a step

Shape suffixes: B batch (global), D model dim, H hidden.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

# before JAX is imported: two CPU devices in this process (JAX's own way to try shard_map on a CPU)
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
).strip()

import torch

try:
    import fpar
except ImportError:  # run from a checkout without installing: use the repo's fpar/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import fpar
import compile as _compile
from _common import Record, add_json_arg, interleaved

LR, MOMENTUM = _compile.LR, 0.9


def jax_side(params: list[torch.Tensor], x_BD: torch.Tensor, y_BD: torch.Tensor):
    """JAX's step: ``jit(grad(shard_map(loss)))`` and the momentum update; returns ``(step, read)``.

    ``read()`` gives the current parameters as torch tensors (for the check against fpar's).
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as JP

    devices = jax.devices("cpu")
    if len(devices) < 2:
        raise SystemExit(f"JAX sees {len(devices)} CPU device(s); XLA_FLAGS was set too late")
    mesh = jax.sharding.Mesh(np.array(devices[:2]), ("data",))

    def per_device_loss(ps, x, y):
        w1, b1, w2, b2 = ps
        h = jax.nn.gelu(x @ w1.T + b1, approximate=False)  # torch's F.gelu: the exact erf form
        return jax.lax.pmean(jnp.mean((h @ w2.T + b2 - y) ** 2), "data")

    loss = jax.shard_map(per_device_loss, mesh=mesh, in_specs=(JP(), JP("data"), JP("data")), out_specs=JP())

    def step(ps, vs, x, y):
        g = jax.grad(loss)(ps, x, y)
        vs = [MOMENTUM * v + gi for v, gi in zip(vs, g)]  # torch.optim.SGD's momentum (no dampening)
        return [p - LR * v for p, v in zip(ps, vs)], vs

    jstep = jax.jit(step, donate_argnums=(0, 1))
    rep, rows = NamedSharding(mesh, JP()), NamedSharding(mesh, JP("data"))
    state = {
        "ps": [jax.device_put(p.numpy(), rep) for p in params],
        "vs": [jax.device_put(np.zeros(tuple(p.shape), np.float32), rep) for p in params],
    }
    xj, yj = jax.device_put(x_BD.numpy(), rows), jax.device_put(y_BD.numpy(), rows)

    def run() -> None:
        state["ps"], state["vs"] = jstep(state["ps"], state["vs"], xj, yj)
        jax.block_until_ready(state["ps"])

    def read() -> list[torch.Tensor]:
        return [torch.from_numpy(np.asarray(p).copy()) for p in state["ps"]]

    return run, read


def fpar_sides(params: list[torch.Tensor], x_BD: torch.Tensor, y_BD: torch.Tensor) -> dict:
    """fpar's eager and compiled-whole steps on the in-process mesh ``data=2`` (``bench/compile.py``'s)."""
    mesh = fpar.make_mesh((2,), ("data",))
    loss = fpar.shard(_compile.per_device_loss, mesh, _compile.SPECS, fpar.P())
    return {
        "fpar eager": _compile._side(loss, params, x_BD, y_BD, False),
        "fpar compiled": _compile._side(loss, params, x_BD, y_BD, "whole"),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30, help="timed steps of each (median)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps of each first")
    parser.add_argument("--batch", type=int, default=128, help="B, the global batch (split over 2)")
    parser.add_argument("--dim", type=int, default=512, help="D, the model width")
    parser.add_argument("--hidden", type=int, default=2048, help="H, the hidden width")
    parser.add_argument("--tiny", action="store_true", help="D=64 H=256 B=16: the fixed cost of a step")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (XLA: its default pool)")
    add_json_arg(parser)
    args = parser.parse_args(argv)
    if args.tiny:
        args.dim, args.hidden, args.batch = 64, 256, 16
    try:
        import jax
    except ImportError:
        raise SystemExit(
            "bench/jax_shard_map.py needs JAX, which fpar does not depend on: pip install jax"
        ) from None
    cfg = {k: getattr(args, k) for k in ("repeats", "warmup", "batch", "dim", "hidden", "threads")}
    record = Record("jax_shard_map", cfg, argv)
    torch.set_num_threads(args.threads)
    params, x_BD, y_BD = _compile._data(cfg)

    sides = fpar_sides(params, x_BD, y_BD)
    run_jax, read_jax = jax_side(params, x_BD, y_BD)
    for _ in range(3):  # the same parameters after 3 steps of each
        for step, _ in sides.values():
            step()
        run_jax()
    worst = 0.0
    for name, (_, ps) in sides.items():
        for i, (a, b) in enumerate(zip(read_jax(), ps)):
            b = b.detach()
            rel = float((a - b).norm() / a.norm())
            worst = max(worst, rel)
            if not torch.allclose(a, b, rtol=1e-3, atol=1e-5):
                raise AssertionError(f"{name}: parameter {i} differs from JAX's after 3 steps: rel {rel:.2e}")
    steps = {name: step for name, (step, _) in sides.items()}
    steps["JAX"] = run_jax
    for _ in range(args.warmup):
        for step in steps.values():
            step()
    times = interleaved(steps, args.repeats)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    B, D, H = args.batch, args.dim, args.hidden
    setup = (
        f"MLP train step B={B} (global) D={D} H={H} fp32, SGD momentum, 2 devices of one process "
        f"(fpar's in-process mesh, {args.threads} torch threads; JAX {jax.__version__} on 2 host-platform CPU devices)"
    )
    print(f"{setup}; {args.repeats} repeats; the same parameters after 3 steps: max rel diff {worst:.1e}")
    for k in steps:
        print(f"  {k:14s} median {med[k]:8.2f} ms   min {min(times[k]) * 1e3:8.2f}")
    print(
        f"  fpar compiled / JAX: {med['fpar compiled'] / med['JAX']:.2f}x; fpar eager / JAX: "
        f"{med['fpar eager'] / med['JAX']:.2f}x (medians)"
    )
    record.compare(
        "whole",
        f"{setup}: fpar's step compiled whole (`torch.compile(step, fullgraph=True)`) vs `jax.jit` of "
        f"`jax.shard_map`'s",
        [("fpar compiled", times["fpar compiled"], "JAX", times["JAX"])],
    )
    record.compare(
        "eager",
        f"{setup}: fpar's eager step vs `jax.jit` of `jax.shard_map`'s",
        [("fpar eager", times["fpar eager"], "JAX", times["JAX"])],
    )
    record.data["extra"]["max_rel_diff"] = worst
    record.write(args.json)


if __name__ == "__main__":
    main()
