"""Kill a process at random points of its background saves; every load afterwards gets the newest
complete checkpoint.

The victim (``python tests/checkpoint_kill.py victim RUN PROCS``) resumes from the newest complete
step under ``RUN`` and then saves step after step with ``blocking=False`` and ``keep=2``, each step's
tensors filled with the step number, on an in-process mesh (``PROCS`` 1) or on a real mesh of
``PROCS`` gloo processes (``fpar.launch``).  After each commit it prints ``committed N``.  The
driver starts it, SIGKILLs its whole process tree at a random moment (seeded), then checks that
``latest_step`` is at least the last step reported committed, that ``load`` of the run directory
returns exactly that step's values, and counts the kills that left a save half-written.

    python tests/checkpoint_kill.py 20            # 20 kills, in-process victim
    python tests/checkpoint_kill.py 20 --procs 2  # 20 kills of a 2-process real mesh
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

import torch

import fpar
from fpar import P

ROOT = Path(__file__).resolve().parents[1]
ROWS, COLS = 256, 1024  # 2 MiB per float64 leaf: a write takes a while, so kills land inside it
SPECS = {"w": P("data"), "m": {"mu": P("data"), "nu": P()}, "step": None}


def tree_at(step: int, mesh: fpar.Mesh) -> dict:
    """Step ``step``'s tree (this process's blocks): every element is ``step`` (``-step`` in ``nu``)."""
    full = {
        "w": torch.full((ROWS, COLS), float(step), dtype=torch.float64),
        "m": {"mu": torch.full((ROWS, 8), float(step)), "nu": torch.full((4,), -float(step))},
    }
    return {**fpar.device_put(full, mesh, {k: SPECS[k] for k in full}), "step": step}


def check(run: str, step: int) -> None:
    """Load the run's newest checkpoint in-process and check it is step ``step``'s, whole."""
    got = fpar.checkpoint.load(run, fpar.make_mesh((1,), ("data",)), {"w": P(), "m": P(), "step": None})
    want = tree_at(step, fpar.make_mesh((1,), ("data",)))
    same = got["step"] == step and all(
        torch.equal(a, b)
        for a, b in zip((got["w"], got["m"]["mu"], got["m"]["nu"]), (want["w"], *want["m"].values()))
    )
    if not same:
        raise AssertionError(
            f"{run}: the newest complete checkpoint (step {step}) does not hold step {step}'s values"
        )


# The victim ------------------------------------------------------------------------------------------


def _save_forever(run: str, procs: int) -> None:
    mesh = fpar.make_mesh((procs,), ("data",))
    start = (fpar.checkpoint.latest_step(run) or 0) + 1
    if fpar.checkpoint.latest_step(run) is not None:
        fpar.checkpoint.load(run, mesh, SPECS)  # a resumed run reads what it continues from
    work = torch.randn(128, 128)
    for step in range(start, start + 10_000):
        handle = fpar.checkpoint.save(
            run, tree_at(step, mesh), mesh, SPECS, step=step, keep=2, blocking=False
        )
        for _ in range(5):  # the "training step" overlapping the write
            work = torch.tanh(work @ work)
        handle.wait()
        if torch.distributed.is_initialized() is False or torch.distributed.get_rank() == 0:
            print(f"committed {step}", flush=True)


def victim(run: str, procs: int) -> None:
    torch.set_num_threads(1)
    if procs == 1:
        _save_forever(run, 1)
    else:
        fpar.launch(_save_forever, procs, run, procs, timeout=3600.0)


# The driver ------------------------------------------------------------------------------------------


def kill_and_check(
    run: Path, kills: int, *, seed: int = 0, procs: int = 1, timeout: float = 120.0, verbose: bool = False
) -> dict:
    """SIGKILL the victim ``kills`` times at random points; check every load.  Returns counts."""
    from torchrun_util import kill_tree, started

    rng = random.Random(seed)
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
    }
    counts = {"kills": 0, "loads_checked": 0, "half_written_at_kill": 0, "newest_step": None}
    for _ in range(kills):
        cmd = [sys.executable, str(Path(__file__).resolve()), "victim", str(run), str(procs)]
        committed, deadline = [], time.monotonic() + timeout
        with started(cmd, merge=True, env=env) as proc:
            line = proc.stdout.readline()  # the first commit: the victim is in its save loop
            while line and not line.startswith("committed"):
                line = proc.stdout.readline()
            if not line:
                raise AssertionError(f"the victim exited before its first commit (rc {proc.wait()})")
            committed.append(int(line.split()[1]))
            time.sleep(rng.uniform(0.0, 0.6))  # then die at a random point of a later save
            kill_tree(proc.pid)
            rest, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        committed += [int(x.split()[1]) for x in rest.splitlines() if x.startswith("committed")]
        counts["kills"] += 1
        latest = fpar.checkpoint.latest_step(run)
        if latest is None or latest < committed[-1]:
            raise AssertionError(
                f"latest_step {latest} after the kill, but step {committed[-1]} had committed"
            )
        check(str(run), latest)
        counts["loads_checked"] += 1
        counts["newest_step"] = latest
        partial = [d for d in os.listdir(run) if not (run / d / "metadata.json").exists()]
        counts["half_written_at_kill"] += bool(partial)
        if verbose:
            print(
                f"kill {counts['kills']}: newest complete step {latest}, half-written: {bool(partial)}",
                flush=True,
            )
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kills", nargs="?", default="20")
    ap.add_argument("args", nargs="*")
    ap.add_argument("--procs", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ns = ap.parse_args()
    if ns.kills == "victim":
        victim(ns.args[0], int(ns.args[1]))
        return
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    with tempfile.TemporaryDirectory() as tmp:
        counts = kill_and_check(Path(tmp) / "run", int(ns.kills), seed=ns.seed, procs=ns.procs, verbose=True)
    print(counts)


if __name__ == "__main__":
    main()
