"""``Estimate``'s table (``print(est)``) and picture (``est.plot``): memory, time, traffic."""

from __future__ import annotations

from ._record import CATEGORIES

_COLOURS = {
    "params": "#4c72b0",
    "grads": "#dd8452",
    "optimizer": "#55a868",
    "activations": "#c44e52",
    "comm_buffers": "#8172b3",
    "other": "#937860",
    "compute": "#4c72b0",
    "exposed_comm": "#dd8452",
    "bubble": "#c7c7c7",
}


def plot(est, path: str) -> str:
    """Save the picture to ``path`` (PNG, SVG or PDF by its suffix); return ``path``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - matplotlib is in fpar's "plot" extra
        raise ImportError("Estimate.plot needs matplotlib: pip install 'fpar[plot]'.") from e
    gib = 2**30
    names = [",".join(f"{a}={v}" for a, v in c.coords.items()) or "every device" for c in est.devices]
    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    bottom = [0.0] * len(est.devices)
    for kind in CATEGORIES:
        vals = [c.breakdown.get(kind, 0) / gib for c in est.devices]
        ax_mem.bar(names, vals, bottom=bottom, label=kind, color=_COLOURS[kind])
        bottom = [b + v for b, v in zip(bottom, vals)]
    cap = est.hardware.memory_bytes / gib
    if est.peak_bytes / gib > 0.2 * cap:  # the device's memory, where it is in sight
        ax_mem.axhline(cap, color="black", linestyle="--", linewidth=1)
        ax_mem.text(0, cap, f" {est.hardware.name} memory", va="bottom", fontsize=8)
    ax_mem.set_ylabel("GiB per device at its peak")
    ax_mem.set_title(f"memory per device class ({est.mesh.size} devices, {cap:.0f} GiB each)")
    ax_mem.legend(fontsize=8, loc="upper right")
    left = 0.0
    for kind in ("compute", "exposed_comm", "bubble"):
        v = est.time_breakdown.get(kind, 0.0)
        ax_time.barh(["step"], [v], left=[left], color=_COLOURS[kind], label=kind.replace("_", " "))
        left += v
    ax_time.set_xlabel("seconds")
    ax_time.set_title(f"step {est.step_time:.3g} s, MFU {est.mfu:.1%}")
    ax_time.legend(fontsize=8, loc="lower right")
    fig.suptitle(f"fpar.plan: {est.mesh} on {est.hardware.name}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def table(est) -> str:
    """``print(estimate)``: memory per class, the step's time and losses, traffic, assumptions."""
    hw = est.hardware
    gib, unit = next(
        (u, n)
        for u, n in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"))
        if est.peak_bytes >= u or n == "KiB"
    )
    lines = [
        f"fpar.plan estimate: {est.mesh} on {hw.name} ({est.mesh.size} devices)",
        "",
        f"memory per device ({unit})"
        + ("" if est.fits else f"  -- DOES NOT FIT in {hw.memory_bytes / 2**30:.1f} GiB"),
        f"  {'class':<16}{'count':>7}{'peak':>9}" + "".join(f"{c[:11]:>12}" for c in CATEGORIES),
    ]
    for c in est.devices:
        name = ",".join(f"{a}={v}" for a, v in c.coords.items()) or "every device"
        lines.append(
            f"  {name:<16}{c.count:>7}{c.peak_bytes / gib:>9.3f}"
            + "".join(f"{c.breakdown.get(k, 0) / gib:>12.3f}" for k in CATEGORIES)
        )
    tb = est.time_breakdown
    lines += [
        "",
        f"step time {_s(est.step_time)}: compute {_s(tb.get('compute', 0))}, exposed communication "
        f"{_s(tb.get('exposed_comm', 0))}, bubble {_s(tb.get('bubble', 0))}; MFU {est.mfu:.1%}",
        "  where the rest goes: " + ", ".join(f"{k} {v:.1%}" for k, v in est.losses.items()),
        "",
        "bytes sent per device per step (busiest class)",
    ]
    for axes, kinds in sorted(est.comm.items()):
        for kind, v in sorted(kinds.items()):
            lines.append(f"  {axes:<20}{kind:<22}{v['calls']:>6} calls {v['bytes'] / 2**20:>14.2f} MiB")
    lines += ["", "assumptions:"] + [f"  {a}" for a in est.assumptions]
    lines += ["", "not seen (keep a margin for them):"] + [f"  {x}" for x in est.limits]
    if est.not_costed:
        ops = ", ".join(f"{k} x{v}" for k, v in sorted(est.not_costed.items()))
        lines.append(f"  ops with no FLOP formula, costed by their bytes only: {ops}")
    return "\n".join(lines)


def _s(t: float) -> str:
    return f"{t * 1e3:.2f} ms" if t < 1 else f"{t:.3f} s"
