"""Pictures of schedules: the Megatron-paper chart, one row per stage, blocks over time.

``draw(schedule)`` returns the chart as text for a terminal; ``draw(schedule, path="x.png")``
also writes it as an image with matplotlib (the optional extra ``fpar[plot]``).
"""

from __future__ import annotations

from ._schedule import COMPUTE, Schedule
from ._timeline import replay, timeline

__all__ = ["draw"]

# Forward blocks blue, backward green (input gradient) and orange (weight gradient), as in the
# Megatron and zero-bubble papers; later chunks in darker shades.
_COLOURS = {
    "F": ["#9ecae1", "#4292c6", "#08519c", "#08306b"],
    "B": ["#a1d99b", "#41ab5d", "#006d2c", "#00441b"],
    "BW": ["#a1d99b", "#41ab5d", "#006d2c", "#00441b"],
    "W": ["#fdae6b", "#f16913", "#a63603", "#7f2704"],
}


def draw(schedule: Schedule, path: str | None = None, *, durations: dict | None = None) -> str:
    """Draw a schedule: rows are stages, columns ticks, cells ``F3``/``B3``/``W3`` or ``.`` (idle).

    ``B`` is a full backward (``BW``) or, in zero-bubble schedules, the input-gradient half, and
    ``W`` the weight-gradient half.  With several chunks per stage a letter names the chunk
    (``F3a`` is microbatch 3 of chunk 0, ``F3b`` of chunk 1).

    Args:
      schedule: the schedule.
      path: if given, also write the chart as an image there (e.g. ``"1f1b.png"``); needs
        matplotlib.
      durations: for the image only, ``{"f": .., "b": .., "w": ..}``: draw blocks with these
        durations (``simulate``) instead of one tick each.

    Returns:
      The text chart (also returned when writing an image).

    Raises:
      ImportError: ``path`` given and matplotlib is not installed.
    """
    text = _text(schedule)
    if path is not None:
        _image(schedule, path, durations)
    return text


def _text(schedule: Schedule) -> str:
    v, ticks = schedule.v, schedule.num_ticks
    cells = [["." for _ in range(ticks)] for _ in range(schedule.p)]
    for a in schedule.actions:
        if a.kind in COMPUTE:
            cells[a.stage][a.tick] = a.label(v)
    width = max([len(c) for row in cells for c in row] + [len(str(ticks - 1))])
    bar = "-" * (8 + (width + 1) * ticks)
    head = f"{schedule.name}: p={schedule.p} stages, m={schedule.m} microbatches" + (
        f", v={v} chunks per stage" if v > 1 else ""
    )
    ruler = "tick    " + " ".join(str(t).rjust(width) if t % 5 == 0 else " " * width for t in range(ticks))
    rows = [head, ruler, bar]
    for s, row in enumerate(cells):
        rows.append(f"stage {s:<2}" + " ".join(c.rjust(width) for c in row))
    rows.append(bar)
    rows.append(_legend(schedule) + f"; bubble {timeline(schedule).bubble_fraction:.3f}")
    return "\n".join(r.rstrip() for r in rows)


def _legend(schedule: Schedule) -> str:
    legend = "F forward, B backward" + (", split: B input grad, W weight grad" if _split(schedule) else "")
    return legend + ", . idle" + (", a/b/.. model chunk" if schedule.v > 1 else "")


def _split(schedule: Schedule) -> bool:
    return any(a.kind == "W" for a in schedule.actions)


def _image(schedule: Schedule, path: str, durations: dict | None) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError(
            "fpar.pipeline.draw(path=...) needs matplotlib to write an image; install the optional "
            "extra with `pip install 'fpar[plot]'` (or `pip install matplotlib`), or call draw "
            "without path for the text chart."
        ) from e
    blocks = _blocks(schedule, durations)
    end = max((start + dur for _, start, dur, _ in blocks), default=1)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.32 * end + 1.5), 0.55 * schedule.p + 1.7))
    for a, start, dur, colour in blocks:
        ax.broken_barh([(start, dur)], (a.stage - 0.42, 0.84), facecolors=colour, edgecolor="white")
        ax.text(start + dur / 2, a.stage, str(a.microbatch), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(schedule.p), [f"stage {s}" for s in range(schedule.p)])
    ax.set_ylim(schedule.p - 0.5, -0.5)
    ax.set_xlim(0, end)
    ax.set_xlabel("time (ticks)" if durations is None else "time")
    bubble = 1 - sum(dur for _, _, dur, _ in blocks) / (schedule.p * end)
    ax.set_title(
        f"{schedule.name}: p={schedule.p}, m={schedule.m}"
        + (f", v={schedule.v}" if schedule.v > 1 else "")
        + f"; bubble {bubble:.3f}"
    )
    from matplotlib.patches import Patch

    kinds = [("F", "forward"), ("B", "input grad" if _split(schedule) else "backward")]
    kinds += [("W", "weight grad")] if _split(schedule) else []
    handles = [Patch(facecolor=_COLOURS[k][0], label=label) for k, label in kinds]
    handles.append(Patch(facecolor="white", edgecolor="grey", label="idle"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=len(handles), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _blocks(schedule: Schedule, durations: dict | None) -> list:
    """(action, start, duration, colour) per compute action."""
    out = []
    if durations is None:
        for a in schedule.actions:
            if a.kind in COMPUTE:
                out.append((a, float(a.tick), 1.0, _colour(a)))
        return out
    cost = {"F": durations.get("f", 1.0), "B": durations.get("b", 1.0), "W": durations.get("w", 1.0)}
    cost["BW"] = cost["B"] + cost["W"]
    starts = replay(schedule, cost)
    for a in schedule.actions:
        if a.kind in COMPUTE:
            out.append((a, starts[a], cost[a.kind], _colour(a)))
    return out


def _colour(a) -> str:
    shades = _COLOURS[a.kind]
    return shades[min(a.chunk, len(shades) - 1)]
