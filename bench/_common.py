"""What the 2-process benchmarks share: timing one step on every rank, interleaving, profiling.

Imported as ``_common`` (a script's own folder is first on ``sys.path``).
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable

import torch.distributed as dist


def timed(step: Callable[[], object], cpu: list[float] | None = None) -> float:
    """Wall time of one full step, every rank starting it together (after a barrier, when launched).

    ``cpu``: where to append the step's CPU time on this thread (``time.thread_time``): no
    waits, no time the thread sat preempted, so other load moves it less than the wall time.
    It shows a step's own work (Python, kernels, posting messages), not its communication.
    """
    if dist.is_initialized():
        dist.barrier()
    c0 = time.thread_time()
    t0 = time.perf_counter()
    step()
    t = time.perf_counter() - t0
    if cpu is not None:
        cpu.append(time.thread_time() - c0)
    return t


def interleaved(
    steps: dict[str, Callable[[], object]], repeats: int, cpu: dict[str, list[float]] | None = None
) -> dict[str, list[float]]:
    """Time each step ``repeats`` times, rotating their order every repeat, with the GC paused.

    Rotating spreads slow phases of a shared machine over every side; no collector pauses land
    inside a timed step.  ``cpu``: filled with each step's CPU times on this thread (``timed``).
    """
    names = list(steps)
    times: dict[str, list[float]] = {k: [] for k in names}
    if cpu is not None:
        cpu.update({k: [] for k in names})
    gc.collect()
    gc.disable()
    try:
        for i in range(repeats):
            k = i % len(names)
            for name in names[k:] + names[:k]:
                times[name].append(timed(steps[name], None if cpu is None else cpu[name]))
    finally:
        gc.enable()
    return times


def profile_table(step: Callable[[], object], repeats: int = 3) -> str:
    """``torch.profiler``'s op table (self CPU time) of ``repeats`` calls of ``step``."""
    from torch.profiler import ProfilerActivity, profile

    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18)


def backward_step(f: Callable, params: dict, keys, *args, lr: float) -> Callable[[], None]:
    """An SGD step written PyTorch's way: leaf copies of ``params[k]``, ``f(...).backward()``,
    the update from ``.grad`` (``torch._foreach_add_``).  ``f`` takes ``{k: leaf}`` then ``args``."""
    import torch

    leaves = [params[k].detach().clone().requires_grad_() for k in keys]

    def step() -> None:
        for p in leaves:
            p.grad = None
        f(dict(zip(keys, leaves)), *args).backward()
        with torch.no_grad():
            torch._foreach_add_(leaves, [p.grad for p in leaves], alpha=-lr)

    step.leaves = leaves  # for checks against the other sides
    return step


# --- JSON records (``--json PATH``): what bench/report.py renders into the performance table ---


def add_json_arg(parser) -> None:
    """Add ``--json PATH``: also write the run's results as one JSON record (``Record``)."""
    parser.add_argument(
        "--json",
        metavar="PATH",
        default=None,
        help="also write the results as a JSON record (bench/report.py renders these)",
    )


def machine() -> dict:
    """Where a run was taken: platform, CPUs, Python, torch, fpar and the checkout's commit."""
    import os
    import platform
    import subprocess
    import sys

    import torch

    fpar = sys.modules.get("fpar")
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        commit = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "fpar": getattr(fpar, "__version__", None),
        "commit": commit,
    }


def time_stats(times) -> dict:
    """A side's figures in milliseconds: ``times`` is a list of seconds, or ``(median_s, min_s)``."""
    if isinstance(times, tuple):
        med, lo, n = times[0], times[1], None
    else:
        med, lo, n = statistics.median(times), min(times), len(times)
    return {"median_ms": med * 1e3, "min_ms": lo * 1e3, "repeats": n}


LOADED = 2.0  # a run whose 1-minute load average is above this many times the CPUs is marked


def overloaded(load: float, cpus: int | None) -> bool:
    """Whether a load average is high enough that other work shared the run's cores (> 2x the CPUs)."""
    return bool(cpus) and load > LOADED * cpus  # type: ignore[operator]


def warn_if_loaded(what: str) -> None:
    """Say on stderr, before a run, that the machine is loaded (its timings will move more)."""
    import os
    import sys

    load, cpus = os.getloadavg()[0], os.cpu_count()
    if overloaded(load, cpus):
        print(
            f"{what}: the load average is {load:.1f}, above {LOADED:g} x this machine's {cpus} CPUs: other "
            f"work shares the cores, so these timings move more than usual and compare badly with a "
            f"quiet run's; the record says so (bench/report.py marks its rows). Rerun when it is quiet.",
            file=sys.stderr,
        )


class Record:
    """One benchmark run as a JSON record: what it ran, where, when, and its comparisons.

    Made at the start of ``main`` (the load average before), filled with ``compare`` (times:
    per side the median and min, and the ratio to its baseline) and ``memory`` (a memory figure
    per side and its ratio), written by ``write`` (the load average after).  ``bench/report.py``
    renders the records into the performance table; a script's printed output does not change.
    """

    def __init__(self, benchmark: str, config: dict, argv: list[str] | None = None):
        import os
        import sys

        args = sys.argv[1:] if argv is None else list(argv)
        warn_if_loaded(f"bench/{benchmark}.py")
        self.data = {
            "benchmark": benchmark,
            "command": " ".join(["python", f"bench/{benchmark}.py", *args]),
            "config": dict(config),
            "date": None,
            "machine": machine(),
            "load_before": list(os.getloadavg()),
            "load_after": None,
            "comparisons": [],
            "extra": {},
        }

    def compare(self, id: str, step: str, pairs: list[tuple[str, object, str, object]]) -> None:
        """Time comparison ``id``: ``pairs`` of (side name, its times, baseline name, its times).

        Times are lists of seconds, or ``(median_s, min_s)`` where a script keeps only those.
        Each pair's ``ratio`` is median / baseline median, ``min_ratio`` min / baseline min.
        """
        out = []
        for name, times, base_name, base_times in pairs:
            side, base = time_stats(times), time_stats(base_times)
            out.append(
                {
                    "side": dict(name=name, **side),
                    "baseline": dict(name=base_name, **base),
                    "ratio": side["median_ms"] / base["median_ms"],
                    "min_ratio": side["min_ms"] / base["min_ms"],
                }
            )
        self.data["comparisons"].append({"id": id, "step": step, "unit": "ms", "pairs": out})

    def memory(self, id: str, step: str, pairs: list[tuple[str, float, str, float]]) -> None:
        """Memory comparison ``id``: ``pairs`` of (side name, bytes, baseline name, bytes)."""
        out = [
            {
                "side": {"name": name, "peak_mib": nbytes / 2**20},
                "baseline": {"name": base_name, "peak_mib": base_bytes / 2**20},
                "ratio": nbytes / base_bytes,
            }
            for name, nbytes, base_name, base_bytes in pairs
        ]
        self.data["comparisons"].append({"id": id, "step": step, "unit": "MiB", "pairs": out})

    def write(self, path: str | None) -> None:
        """Write the record to ``path`` (nothing when ``None``: ``--json`` not given)."""
        import datetime
        import json
        import os

        if path is None:
            return
        self.data["date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        self.data["load_after"] = list(os.getloadavg())
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(_rounded(self.data), f, indent=1, default=str)
            f.write("\n")


def _rounded(x):
    """``x`` with its floats kept to 6 significant digits (the records stay readable)."""
    if isinstance(x, float):
        return float(f"{x:.6g}")
    if isinstance(x, dict):
        return {str(k): _rounded(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_rounded(v) for v in x]
    return x
