"""What the 2-process benchmarks share: timing one step on every rank, interleaving, profiling.

Imported as ``_common`` (a script's own folder is first on ``sys.path``).
"""

from __future__ import annotations

import gc
import time
from typing import Callable

import torch.distributed as dist


def timed(step: Callable[[], object], cpu: list[float] | None = None) -> float:
    """Wall time of one full step, every rank starting it together (after a barrier).

    ``cpu``: where to append the step's CPU time on this thread (``time.thread_time``): no
    waits, no time the thread sat preempted, so other load moves it less than the wall time.
    It shows a step's own work (Python, kernels, posting messages), not its communication.
    """
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
