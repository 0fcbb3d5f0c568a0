"""``fpar.plan.search``: try layouts, keep those that fit, rank them by predicted step time."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from ._estimate import Estimate, estimate
from ._hardware import Hardware, hardware as _hardware
from ._models import Layout, layout_choices

__all__ = ["Result", "ranking", "search"]


@dataclasses.dataclass
class Result:
    """One layout tried by ``search``: its estimate, or why it was dropped."""

    layout: Layout
    estimate: Estimate | None
    seconds: float  # how long its estimate took here
    dropped: str | None = None  # "does not fit: ...", or the error that building it raised

    def __iter__(self):  # (layout, estimate), as search's list promises
        yield self.layout
        yield self.estimate


def search(
    build: Callable[[Layout], tuple[Callable, tuple]],
    devices: int,
    hardware: str | Hardware = "h100-sxm",
    *,
    model=None,
    keep_dropped: bool = False,
    **choices: Any,
) -> list:
    """Estimate every layout of ``devices`` the choices allow; rank those that fit by step time.

    ``build(layout) -> (step, args)`` turns a ``fpar.plan.Layout`` into the user's step over
    ``layout.mesh()`` (an abstract mesh of axes ``pipeline``, ``data``, ``tensor``) and its
    arguments; ``choices`` are lists of values per ``Layout`` field (``pipeline``, ``tensor``,
    ``zero``, ``microbatches``, ``remat``, ``schedule``, ``batch``, ...); ``data`` is what the
    devices leave.  With ``model`` (a ``fpar.plan.Model``), layouts that do not divide its
    dimensions are skipped before any work.

    Returns:
      ``[(layout, estimate), ...]`` fastest first, for the layouts whose peak memory fits the
      hardware (each item is a ``fpar.plan.Result``; ``keep_dropped=True`` appends the others,
      with ``estimate=None`` or over memory and the reason in ``.dropped``).

    Raises:
      ValueError: an unknown hardware or choice, or no layout of ``devices`` left to try.
    """
    hw = _hardware(hardware)
    if not isinstance(devices, int) or devices <= 0:
        raise ValueError(f"fpar.plan.search: devices must be a positive integer, got {devices!r}.")
    layouts = layout_choices(model, devices, **choices)
    if not layouts:
        raise ValueError(
            f"fpar.plan.search: no layout of {devices} devices from {choices}"
            + (f" divides {model.name}" if model is not None else "")
            + "; widen the choices (the product pipeline x tensor must divide the devices)."
        )
    kept, dropped = [], []
    for layout in layouts:
        start = time.perf_counter()
        try:
            step, args = build(layout)
            est = estimate(step, *args, hardware=hw)
        except ValueError as e:
            dropped.append(Result(layout, None, time.perf_counter() - start, str(e)))
            continue
        r = Result(layout, est, time.perf_counter() - start)
        if est.fits:
            kept.append(r)
        else:
            r.dropped = f"does not fit: {est.peak_bytes / 2**30:.1f} GiB > {hw.memory_bytes / 2**30:.1f} GiB"
            dropped.append(r)
    kept.sort(key=lambda r: r.estimate.step_time)
    return kept + dropped if keep_dropped else kept


def ranking(results: list, *, tokens_per_step: int | None = None) -> str:
    """A table of ``search``'s results: layout, peak memory, step time and its split, MFU."""
    lines = [
        f"{'#':>3}  {'layout':<66}{'peak GiB':>9}{'step s':>9}{'compute':>9}{'comm':>8}{'bubble':>8}{'MFU':>7}"
        + ("  tokens/s" if tokens_per_step else "")
    ]
    for i, r in enumerate(results, 1):
        layout, est = r.layout, r.estimate
        if est is None:
            lines.append(f"{'-':>3}  {layout.describe():<66}  dropped: {r.dropped}")
            continue
        tb = est.time_breakdown
        row = (
            f"{i if r.dropped is None else '-':>3}  {layout.describe():<66}{est.peak_bytes / 2**30:>9.1f}"
            f"{est.step_time:>9.3f}{tb['compute']:>9.3f}{tb['exposed_comm']:>8.3f}{tb['bubble']:>8.3f}"
            f"{est.mfu:>7.1%}"
        )
        if tokens_per_step:
            row += f"  {tokens_per_step / est.step_time:>9.3g}"
        if r.dropped is not None:
            row += f"  ({r.dropped})"
        lines.append(row)
    return "\n".join(lines)
