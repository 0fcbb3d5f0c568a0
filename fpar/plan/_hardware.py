"""Hardware descriptions for ``fpar.plan``: peak FLOP/s, memory, links, by name or measured here.

Presets are vendor datasheet figures (dense, no sparsity) for SXM parts in 8-GPU HGX nodes:

| preset | BF16 | FP32 | HBM | HBM B/s | NVLink per GPU, one way | network per GPU |
|---|---|---|---|---|---|---|
| ``"a100-80g"`` | 312 T | 19.5 T | 80 GB | 2.0 T | 300 GB/s | 25 GB/s (200 Gb/s HDR) |
| ``"h100-sxm"`` | 989 T | 67 T | 80 GB | 3.35 T | 450 GB/s | 50 GB/s (400 Gb/s NDR) |
| ``"b200"`` | 2250 T | 80 T | 180 GB | 8 T | 900 GB/s | 50 GB/s (400 Gb/s) |

``"this"`` is measured on the machine that runs the estimate: float32 matmul FLOP/s by size
(32 to 1024: small matmuls reach less of the peak) and float64/bfloat16 at 512, with the
threads torch uses; memory bandwidth from a large copy; the per-op overhead of an eager
training step (tiny ops recorded by autograd, and their backward); gloo's all-reduce latency and
bandwidth between two local processes (α and β fit from two message sizes; α at least the
latency of a small all-reduce issued right after each process's own compute, which waits out
their skew, as a training step's blocking collectives do); and the matmul throughput of one
process while another computes over the same window (the cores the devices share); so that a
prediction can be checked here against a real run.  On a shared VM these figures move by
about ±30 % from one measurement to the next (bench/README.md, plan.py).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time

import torch

__all__ = ["PRESETS", "Hardware", "hardware"]


@dataclasses.dataclass(frozen=True)
class Hardware:
    """A device and its links, as the time and memory model sees them.

    Attributes:
      name: what it is called in tables.
      flops: peak dense FLOP/s per dtype name (``"bfloat16"``, ``"float16"``, ``"float32"``,
        ``"float64"``); a dtype not listed uses ``"float32"``'s.
      matmul_efficiency: the fraction of peak a large matmul reaches (a datasheet preset: the
        0.7 that good large runs' kernels reach; measured presets: 1.0, their FLOP/s are achieved).
      memory_bytes: memory per device.
      memory_bandwidth: bytes per second per device (elementwise ops are costed by it).
      op_overhead: seconds every op costs besides its FLOPs and bytes (a kernel launch).
      devices_per_node: devices that share the fast links; mesh order puts the last axes inside a node.
      intra_bandwidth, intra_latency: one direction's bytes/s and the per-step latency α inside a node.
      inter_bandwidth, inter_latency: the same across nodes (per device).
      nodes: how many nodes exist (``None``: as many as asked for).
      cores: CPU hardware only: the cores' worth of compute the devices of a node share (each
        device a process; measured: the cores times what a process reaches while another
        computes too, over what it reaches alone); devices beyond them share them.
    """

    name: str
    flops: dict
    memory_bytes: int
    memory_bandwidth: float
    devices_per_node: int
    intra_bandwidth: float
    intra_latency: float
    inter_bandwidth: float
    inter_latency: float
    matmul_efficiency: float = 0.7
    op_overhead: float = 4e-6
    nodes: int | None = None
    cores: float | None = None
    matmul_curve: tuple = ()  # measured: ((FLOPs of one matmul, achieved FLOP/s), ...) by size, float32
    reduce_scatter_all_reduces: bool = False  # the backend runs a reduce-scatter as an all-reduce (gloo)

    def peak(self, dtype: torch.dtype) -> float:
        """Peak FLOP/s for ``dtype``."""
        name = str(dtype).replace("torch.", "")
        return float(self.flops.get(name, self.flops["float32"]))

    def matmul_rate(self, flops: float, dtype: torch.dtype) -> float:
        """FLOP/s a matmul of ``flops`` reaches: the measured curve where there is one, else peak x efficiency."""
        if self.matmul_curve and dtype == torch.float32:
            for f, rate in self.matmul_curve:
                if flops <= f:
                    return rate
            return self.matmul_curve[-1][1]
        return self.peak(dtype) * self.matmul_efficiency

    def describe(self) -> list[str]:
        """The assumptions this hardware makes, one line each."""
        tf = ", ".join(f"{k} {v / 1e12:.4g} TFLOP/s" for k, v in self.flops.items())
        lines = [
            f"hardware {self.name}: {tf}; matmul efficiency {self.matmul_efficiency:g}",
            f"  memory {self.memory_bytes / 2**30:.4g} GiB at {self.memory_bandwidth / 1e9:.4g} GB/s; "
            f"{self.op_overhead * 1e6:.3g} us per op",
            f"  {self.devices_per_node} devices per node: {self.intra_bandwidth / 1e9:.4g} GB/s, "
            f"alpha {self.intra_latency * 1e6:.3g} us inside; {self.inter_bandwidth / 1e9:.4g} GB/s, "
            f"alpha {self.inter_latency * 1e6:.3g} us across nodes",
        ]
        if self.cores:
            lines.append(f"  {self.cores:.2f} CPU cores' worth of compute shared by the devices (processes) of the node")
        if self.reduce_scatter_all_reduces:
            lines.append("  reduce-scatter runs as an all-reduce (gloo): twice the bytes, 2(n-1) steps")
        return lines


PRESETS: dict[str, Hardware] = {
    "a100-80g": Hardware(
        "a100-80g", {"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12, "float64": 19.5e12},
        memory_bytes=80 * 10**9, memory_bandwidth=2.0e12, devices_per_node=8,
        intra_bandwidth=300e9, intra_latency=5e-6, inter_bandwidth=25e9, inter_latency=10e-6,
    ),
    "h100-sxm": Hardware(
        "h100-sxm", {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12, "float64": 67e12},
        memory_bytes=80 * 10**9, memory_bandwidth=3.35e12, devices_per_node=8,
        intra_bandwidth=450e9, intra_latency=5e-6, inter_bandwidth=50e9, inter_latency=10e-6,
    ),
    "b200": Hardware(
        "b200", {"bfloat16": 2250e12, "float16": 2250e12, "float32": 80e12, "float64": 40e12},
        memory_bytes=180 * 10**9, memory_bandwidth=8e12, devices_per_node=8,
        intra_bandwidth=900e9, intra_latency=5e-6, inter_bandwidth=50e9, inter_latency=10e-6,
    ),
}

_THIS: list = [None]


def hardware(spec: str | Hardware) -> Hardware:
    """A ``Hardware`` from a preset name, ``"this"`` (measured here, once per process), or as given.

    Raises:
      ValueError: an unknown name (the message lists the presets).
    """
    if isinstance(spec, Hardware):
        return spec
    if spec == "this":
        if _THIS[0] is None:
            _THIS[0] = measure_this()
        return _THIS[0]
    if isinstance(spec, str) and spec in PRESETS:
        return PRESETS[spec]
    raise ValueError(
        f"fpar.plan: unknown hardware {spec!r}; choose one of {sorted(PRESETS) + ['this']} or pass "
        f"fpar.plan.Hardware(...)."
    )


def measure_this(*, comm: bool = True) -> Hardware:
    """Measure this machine: matmul FLOP/s, memory bandwidth, per-op overhead, gloo α and β."""
    curve = tuple((2.0 * n**3, _matmul_flops(torch.float32, n)) for n in (32, 64, 128, 256, 512, 1024))
    flops = {"float32": curve[-1][1], "float64": _matmul_flops(torch.float64)}
    flops["bfloat16"] = flops["float16"] = _matmul_flops(torch.bfloat16)
    alpha, beta, busy = _gloo_alpha_beta() if comm else (50e-6, 1e9, None)
    cores = float(os.cpu_count() or 1)
    if busy:  # two processes computing at once each reach less than one alone (shared cores, caches)
        cores *= min(1.0, busy / curve[-2][1])
    return Hardware(
        "this", flops, memory_bytes=_memory_bytes(), memory_bandwidth=_copy_bandwidth(),
        devices_per_node=1024, intra_bandwidth=beta, intra_latency=alpha, inter_bandwidth=beta,
        inter_latency=alpha, matmul_efficiency=1.0, op_overhead=_op_overhead(), nodes=1,
        cores=cores, matmul_curve=curve, reduce_scatter_all_reduces=True,
    )


def _median_time(fn, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _matmul_flops(dtype: torch.dtype, n: int = 512) -> float:
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    return 2 * n**3 / _median_time(lambda: a @ b, repeats=7 if n >= 256 else 31)


def _copy_bandwidth(n: int = 1 << 24) -> float:
    a = torch.empty(n)
    b = torch.empty(n)
    return 2 * 4 * n / _median_time(lambda: b.copy_(a))


def _op_overhead() -> float:
    """Seconds per op of a training step's eager overhead: tiny ops, recorded by autograd, and their backward."""
    w = torch.ones(8, requires_grad=True)
    counted = []

    def step():
        x = w
        for _ in range(100):
            x = (x * 1.01).tanh()
        x.sum().backward()

    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counted.append(func)
            return func(*args, **(kwargs or {}))

    with Count():
        step()
    return _median_time(step) / len(counted)


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * 2**30


def _gloo_alpha_beta() -> tuple[float, float, float]:
    """Fit gloo's all-reduce time ``2α + S/β`` (two local processes) from two message sizes.

    α is the larger of the idle fit's and the loaded latency (``_loaded_all_reduce``); also returns
    the float32 matmul FLOP/s of one process while both compute.
    """
    from .._dist import launch

    ranks = launch(_gloo_times, 2, timeout=120.0)
    small, big, size, busy, _ = ranks[0]
    alpha = max(small / 2, 1e-7)
    beta = size / max(big - 2 * alpha, 1e-9)
    # Between computing processes a small all-reduce also waits out their skew (each arrives when
    # its own compute ends): the alpha a training step's blocking collectives see.
    loaded = statistics.fmean(r[4] for r in ranks) / 2
    return max(alpha, loaded), beta, busy


def _gloo_times() -> tuple[float, float, int, float, float]:
    import torch.distributed as dist

    def timed(numel: int) -> float:
        x = torch.ones(numel)
        for _ in range(3):
            dist.all_reduce(x)
        times = []
        for _ in range(15):
            dist.barrier()
            t = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    numel = 1 << 20
    # one device sends 2 (n-1)/n S = S bytes of an n=2 all-reduce: time = 2 alpha + S / beta
    small, big = timed(2), timed(numel)
    busy = statistics.median(_concurrent_matmul_flops(dist) for _ in range(3))  # the other process multiplies too
    return small, big, 4 * numel, busy, _loaded_all_reduce(dist)


def _loaded_all_reduce(dist, n: int = 512, rounds: int = 20) -> float:
    """Mean seconds of a 2-element all-reduce issued right after two n x n matmuls (no barrier)."""
    a, b, x = torch.randn(n, n), torch.randn(n, n), torch.ones(2)
    dist.barrier()
    times = []
    for _ in range(rounds):
        a @ b
        a @ b
        t = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - t)
    dist.barrier()
    return statistics.fmean(times[2:])


def _concurrent_matmul_flops(dist, n: int = 512, window: float = 0.25) -> float:
    """float32 matmul FLOP/s of this process while every other one multiplies for the same window.

    Each process counts the matmuls it finishes in a fixed window after a barrier, so the windows
    overlap whole (a fixed count of matmuls would let a process that starts late run alone).
    """
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    dist.barrier()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < window:
        a @ b
        count += 1
    elapsed = time.perf_counter() - start
    dist.barrier()
    return 2 * n**3 * count / elapsed
