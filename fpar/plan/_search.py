"""``fpar.plan.search``: try layouts, keep those that fit, rank them by predicted step time."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import torch

from ._estimate import Estimate, _state_bytes, estimate
from ._hardware import Hardware
from ._hardware import hardware as _hardware
from ._models import Layout, Model, check_layout

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
    workers: int | None = None,
    **choices: Any,
) -> list:
    """Estimate every layout of ``devices`` the choices allow; rank those that fit by step time.

    ``build(layout) -> (step, args)`` turns a ``fpar.plan.Layout`` into the user's step over
    ``layout.mesh()`` (an abstract mesh of axes ``pipeline``, ``data``, ``tensor``) and its
    arguments; ``choices`` are lists of values per ``Layout`` field (``pipeline``, ``tensor``,
    ``zero``, ``microbatches``, ``remat``, ``schedule``, ``virtual``, ``sequence_parallel``,
    ``batch``, ...) or ``micro_batch`` (sequences per microbatch per device, instead of
    ``microbatches``); ``data`` is what the devices leave.  With ``model`` (a ``fpar.plan.Model``), layouts that do not divide its
    dimensions are skipped before any work.  Layouts are estimated in ``workers`` forked
    processes at once (default: one per CPU; ``workers=1``, or a platform without ``fork``,
    estimates them one after another in this process).

    Returns:
      ``[(layout, estimate), ...]`` fastest first, for the layouts whose peak memory fits the
      hardware (each item is a ``fpar.plan.Result``; ``keep_dropped=True`` appends the others,
      with ``estimate=None`` or over memory and the reason in ``.dropped``).  A layout whose
      arguments alone (one device's parameters, optimizer state and batch) exceed the memory is
      dropped without an estimate: it cannot fit whatever its step does.

    Raises:
      ValueError: an unknown hardware or choice, or no layout of ``devices`` left to try; with
        ``keep_dropped=False``, none of the layouts fits (the error names the one whose peak is
        smallest: a search never answers an empty ranking).
    """
    hw = _hardware(hardware, estimate=estimate)
    if not isinstance(devices, int) or devices <= 0:
        raise ValueError(f"fpar.plan.search: devices must be a positive integer, got {devices!r}.")
    layouts = layout_choices(model, devices, **choices)
    if not layouts:
        raise ValueError(
            f"fpar.plan.search: no layout of {devices} devices from {choices}"
            + (f" divides {model.name}" if model is not None else "")
            + "; widen the choices (the product pipeline x tensor must divide the devices)."
        )
    if workers is None:
        workers = os.cpu_count() or 1
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ValueError(f"fpar.plan.search: workers must be a positive integer, got {workers!r}.")
    workers = min(workers, len(layouts))
    if workers > 1 and "fork" in mp.get_all_start_methods():
        _JOB[:] = [build, hw]  # what the forked workers inherit (build need not be picklable)
        try:
            with ProcessPoolExecutor(
                workers, mp_context=mp.get_context("fork"), initializer=_worker_init
            ) as pool:
                results = list(pool.map(_try_in_worker, layouts))
        finally:
            _JOB.clear()
    else:
        results = [_try(build, hw, layout) for layout in layouts]
    kept = [r for r in results if r.dropped is None]
    dropped = [r for r in results if r.dropped is not None]
    kept.sort(key=lambda r: r.estimate.step_time)
    if not kept and not keep_dropped:
        raise ValueError(_none_fits(devices, hw, dropped))
    return kept + dropped if keep_dropped else kept


def _none_fits(devices: int, hw: Hardware, dropped: list[Result]) -> str:
    """The error for a search none of whose layouts fits: the closest one, and why the others went."""
    over = [r for r in dropped if r.estimate is not None]  # estimated, over memory
    head = f"fpar.plan.search: none of the {len(dropped)} layouts of {devices} devices fits {hw.name}'s "
    head += f"{hw.memory_bytes / 2**30:.1f} GiB"
    if over:
        best = min(over, key=lambda r: r.estimate.peak_bytes)
        head += (
            f"; the smallest peak is {best.layout.describe()}'s, {best.estimate.peak_bytes / 2**30:.1f} GiB. Widen the "
            f"choices (more pipeline or tensor devices, ZeRO-3, recomputation, smaller microbatches)"
        )
    elif dropped:  # none estimated: each one's arguments alone were over, or it could not be built
        head += f"; {dropped[0].layout.describe()} was dropped: {dropped[0].dropped}"
    return head + ". keep_dropped=True returns every layout with the reason it was dropped."


def _try(build, hw: Hardware, layout: Layout) -> Result:
    """Build and estimate one layout: its ``Result``, dropped where it fails or does not fit."""
    start = time.perf_counter()
    try:
        step, args = build(layout)
        held = _argument_bytes(args)
        if held > hw.memory_bytes:  # a device holds its arguments all step: no need to simulate it
            return Result(
                layout,
                None,
                time.perf_counter() - start,
                f"does not fit: its arguments alone (parameters, optimizer state, batch) are "
                f"{held / 2**30:.1f} GiB > {hw.memory_bytes / 2**30:.1f} GiB",
            )
        est = estimate(step, *args, hardware=hw)
    except (ValueError, NotImplementedError) as e:  # a layout fpar cannot build or run: dropped, named
        return Result(layout, None, time.perf_counter() - start, str(e).splitlines()[0])
    r = Result(layout, est, time.perf_counter() - start)
    if not est.fits:
        r.dropped = f"does not fit: {est.peak_bytes / 2**30:.1f} GiB > {hw.memory_bytes / 2**30:.1f} GiB"
    return r


def _argument_bytes(args) -> int:
    """Bytes of one device's arguments (each storage once): a floor under the step's peak."""
    return sum(_state_bytes(args, {}).values())


_JOB: list = []  # (build, hardware) of the search running now, for its forked workers


def _worker_init() -> None:
    torch.set_num_threads(1)  # an estimate is Python on meta tensors: one thread per worker


def _try_in_worker(layout: Layout) -> Result:
    r = _try(_JOB[0], _JOB[1], layout)  # its mesh pickles without the process-group proxy
    if r.estimate is not None:
        for c in r.estimate.devices:
            c._events = None  # every op and message: too much to send back (retime needs them)
    return r


def ranking(results: list, *, tokens_per_step: int | None = None) -> str:
    """A table of ``search``'s results: layout, peak memory, step time and its split, MFU."""
    w = max([66] + [len(r.layout.describe()) + 1 for r in results])  # interleaved layouts run longer
    lines = [
        f"{'#':>3}  {'layout':<{w}}{'peak GiB':>9}{'step s':>9}{'compute':>9}{'comm':>8}{'bubble':>8}{'MFU':>7}"
        + ("  tokens/s" if tokens_per_step else "")
    ]
    for i, r in enumerate(results, 1):
        layout, est = r.layout, r.estimate
        if est is None:
            lines.append(f"{'-':>3}  {layout.describe():<{w}}  dropped: {r.dropped}")
            continue
        tb = est.time_breakdown
        row = (
            f"{i if r.dropped is None else '-':>3}  {layout.describe():<{w}}{est.peak_bytes / 2**30:>9.1f}"
            f"{est.step_time:>9.3f}{tb['compute']:>9.3f}{tb['exposed_comm']:>8.3f}{tb['bubble']:>8.3f}"
            f"{est.mfu:>7.1%}"
        )
        if tokens_per_step:
            row += f"  {tokens_per_step / est.step_time:>9.3g}"
        if r.dropped is not None:
            row += f"  ({r.dropped})"
        lines.append(row)
    return "\n".join(lines)


def layout_choices(model: Model | None, devices: int, **choices: Any) -> list[Layout]:
    """Every layout of ``devices`` from the choices (lists per field) that divides the model."""
    import itertools

    fields: dict[str, list[Any]] = {f.name: [f.default] for f in dataclasses.fields(Layout)}
    micro = choices.pop("micro_batch", None)  # sequences per microbatch: sets microbatches
    if micro is not None:
        if "microbatches" in choices:
            raise ValueError("fpar.plan.search: choose micro_batch or microbatches, not both.")
        fields["micro_batch"] = list(micro) if isinstance(micro, (list, tuple, range)) else [micro]
    for name, values in choices.items():
        if name not in fields:
            raise ValueError(
                f"fpar.plan.search: unknown choice {name!r}; choose from {sorted([*fields, 'micro_batch'])}."
            )
        fields[name] = list(values) if isinstance(values, (list, tuple, range)) else [values]
    out = []
    for combo in itertools.product(*fields.values()):
        kw = dict(zip(fields, combo))
        if "data" not in choices:
            pt = kw["pipeline"] * kw["tensor"]
            if devices % pt:
                continue
            kw["data"] = devices // pt
        if "micro_batch" in kw:
            mb = kw.pop("micro_batch")
            if kw["batch"] % (kw["data"] * mb):
                continue
            kw["microbatches"] = kw["batch"] // (kw["data"] * mb)
        layout = Layout(**kw)
        if layout.devices != devices:
            continue
        if model is not None:
            try:
                check_layout(model, layout)
            except ValueError:
                continue
        out.append(layout)
    return out
