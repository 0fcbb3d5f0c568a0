"""Step time with a checkpoint every N steps: blocking, ``blocking=False``, and DCP's ``async_save``.

Two gloo processes (``fpar.launch``), 1 thread each, hold the same state: ``L`` weight matrices
``[D, D]`` float32 and their AdamW moments (3 x L tensors), each split over ``data`` (one half per
process, ZeRO style).  A step is compute on that state and an in-place update of all of it
(``x @ w``, ``w -= ...``, the moments' ``mul_``/``add_``) plus one small all-reduce that keeps the
processes in step, as a gradient all-reduce does.  Every ``N``-th step saves the state:

* **none**: no save (the baseline step);
* **fpar blocking**: ``fpar.checkpoint.save(run, state, mesh, specs, step=s, keep=2)``;
* **fpar background**: the same with ``blocking=False`` (the blocks are copied to host memory,
  a thread writes and commits them; the next save waits for this one);
* **DCP async**: ``torch.distributed.checkpoint.async_save`` of the same blocks as DTensors
  (``fpar.to_dtensor``), on a separate gloo group as DCP's docs advise, the previous future
  waited before the next save (DCP's own pattern); a new directory per save.

Each side runs ``--steps`` steps (its saves included) after a warm-up, the sides interleaved
over ``--repeats`` rounds; the figure is the mean step time of a round (a save's stall shows in
it), median over rounds, from rank 0.  Ratios: each side / none, and fpar background / DCP async.
Every side waits for its last save to commit before the round's clock stops.

    python bench/checkpoint.py                       # D=1024 L=6 (~72 MiB of state), N=5
    python bench/checkpoint.py --every 2 --repeats 5
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

try:
    import fpar
except ImportError:  # run from a checkout without installing: use the repo's fpar/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import fpar
from fpar import P

SIDES = ("none", "fpar blocking", "fpar background", "DCP async")


def _state(d: int, layers: int, mesh) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(0)
    full = {
        f"w{i}": {k: torch.randn(d, d, generator=g) * 0.01 for k in ("param", "mu", "nu")}
        for i in range(layers)
    }
    specs = {name: {k: P("data") for k in leaf} for name, leaf in full.items()}
    return fpar.device_put(full, mesh, specs), specs


def _train_step(state: dict, x: torch.Tensor, ping: torch.Tensor) -> None:
    for leaf in state.values():
        w, mu, nu = leaf["param"], leaf["mu"], leaf["nu"]
        y = x @ w.T  # [B, D/2]
        grad = y.T @ x[:, : w.shape[1]] * 1e-3
        mu.mul_(0.9).add_(grad, alpha=0.1)
        nu.mul_(0.999).addcmul_(grad, grad, value=0.001)
        w.sub_(mu / (nu.sqrt() + 1e-8), alpha=1e-4)
    dist.all_reduce(ping)


def _run(args) -> dict | None:
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(1)
    mesh = fpar.make_mesh((2,), ("data",))
    state, specs = _state(args.d, args.layers, mesh)
    x = torch.randn(args.batch, args.d)
    ping = torch.zeros(1)
    dcp_group = dist.new_group(backend="gloo")
    root = Path(args.dir)
    pending = {"dcp": None, "count": 0}

    def save(side: str, step: int) -> None:
        run = root / side.replace(" ", "_")
        if side == "fpar blocking":
            fpar.checkpoint.save(run, state, mesh, specs, step=step, keep=2)
        elif side == "fpar background":
            fpar.checkpoint.save(run, state, mesh, specs, step=step, keep=2, blocking=False)
        elif side == "DCP async":
            if pending["dcp"] is not None:
                pending["dcp"].result()
            dtensors = {
                f"{name}.{k}": fpar.to_dtensor(t, mesh, P("data"))
                for name, leaf in state.items()
                for k, t in leaf.items()
            }
            pending["count"] += 1
            pending["dcp"] = dcp.async_save(
                dtensors, checkpoint_id=str(run / f"save_{pending['count']}"), process_group=dcp_group
            )

    def finish(side: str) -> None:
        if side == "fpar background":
            fpar.checkpoint.wait()
        elif side == "DCP async" and pending["dcp"] is not None:
            pending["dcp"].result()
            pending["dcp"] = None

    def round_of(side: str, steps: int) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for s in range(1, steps + 1):
            _train_step(state, x, ping)
            if side != "none" and s % args.every == 0:
                save(side, s)
        finish(side)
        dist.barrier()
        return (time.perf_counter() - t0) / steps

    for side in SIDES:  # warm-up: first saves create directories, DCP plans, threads
        round_of(side, args.every)
    times: dict[str, list[float]] = {side: [] for side in SIDES}
    for r in range(args.repeats):
        order = SIDES[r % len(SIDES) :] + SIDES[: r % len(SIDES)]
        for side in order:
            times[side].append(round_of(side, args.steps))
    dist.barrier()
    return times if dist.get_rank() == 0 else None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, default=1024, help="width D of each [D, D] matrix")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--every", type=int, default=5, help="save every N steps")
    ap.add_argument("--steps", type=int, default=20, help="steps per timed round")
    ap.add_argument("--repeats", type=int, default=5, help="rounds per side (interleaved)")
    args = ap.parse_args(argv)
    mib = 3 * args.layers * args.d * args.d * 4 / 2**20
    tmp = tempfile.mkdtemp(prefix="fpar-bench-ckpt-")
    try:
        args.dir = tmp
        times = fpar.launch(_run, 2, args, timeout=3600.0)[0]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"checkpoint every {args.every} steps: D={args.d} L={args.layers} ({mib:.0f} MiB of state, "
        f"{mib / 2:.0f} MiB per process), batch {args.batch}, 2 gloo processes, {args.repeats} rounds "
        f"of {args.steps} steps; {tempfile.gettempdir()}"
    )
    med = {side: statistics.median(t) for side, t in times.items()}
    for side in SIDES:
        print(f"  {side:16s} {1e3 * med[side]:8.1f} ms/step  ({med[side] / med['none']:.2f}x no save)")
    print(f"  fpar background / DCP async: {med['fpar background'] / med['DCP async']:.2f}")
    print(f"  fpar background / fpar blocking: {med['fpar background'] / med['fpar blocking']:.2f}")


if __name__ == "__main__":
    main()
