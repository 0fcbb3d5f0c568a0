"""``Estimate.plot``: memory per device class, stacked by kind, and the step's time split."""

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
