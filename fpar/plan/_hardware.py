"""Hardware descriptions for ``fpar.plan``: peak FLOP/s, memory, links, by name or measured here.

Presets are vendor datasheet figures (dense, no sparsity) for SXM parts in 8-GPU HGX nodes:

| preset | BF16 | FP32 | HBM | HBM B/s | NVLink per GPU, one way | network per GPU |
|---|---|---|---|---|---|---|
| ``"a100-80g"`` | 312 T | 19.5 T | 80 GB: 79.2 GiB | 2.0 T | 300 GB/s | 25 GB/s (200 Gb/s HDR) |
| ``"h100-sxm"`` | 989 T | 67 T | 80 GB: 79.2 GiB | 3.35 T | 450 GB/s | 50 GB/s (400 Gb/s NDR) |
| ``"b200"`` | 2250 T | 80 T | 192 GB: 178.4 GiB | 8 T | 900 GB/s | 50 GB/s (400 Gb/s) |

A part's memory is what CUDA gives a process on it (``torch.cuda.get_device_properties(0)
.total_memory``, the "total capacity" of PyTorch's out-of-memory message), not the datasheet's
figure read as decimal gigabytes: an "80 GB" A100 or H100 carries 80 GiB of HBM (nvidia-smi:
81,920 and 81,559 MiB) of which the driver keeps under 1 GiB, so CUDA reports 85,056,798,720
bytes on an A100-SXM4-80GB and 85,019,590,656 on an H100 80GB HBM3 (79.2 GiB; 80e9 bytes would be
74.5), and 182,642 MiB on a B200 (nvidia-smi 183,359 MiB). The CUDA context and NCCL's buffers
come out of it too: ``Estimate.limits`` says so.

``"this"`` is measured on the machine that runs the estimate (about 30 s, once per process):
float32 matmul FLOP/s by size (32 to 1024) and float64/bfloat16 at 512 (the roofline of ops too
large to time), memory bandwidth from a large copy; each op of a step is timed here once per
signature (``fpar.plan._optime``), plus fpar's per-op overhead (a tiny model's real step less its
timed kernels, over its ops); gloo's α and β fit to what an all-reduce adds to a loop of two
processes that compute a small layer's work between messages, and the all-gather's,
reduce-scatter's and send's own latencies measured the same way; and the speed one process keeps
while the other computes (the cores the devices share).  So a prediction can be checked here
against a real run.  On a shared VM these figures move by about ±30 % from one measurement to the
next (bench/README.md, plan.py).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time

import torch

from . import _optime

__all__ = ["PRESETS", "Hardware", "hardware"]


@dataclasses.dataclass(frozen=True)
class Hardware:
    """A device and its links, as the time and memory model sees them.

    Attributes:
      name: what it is called in tables.
      flops: peak dense FLOP/s per dtype name (``"bfloat16"``, ``"float16"``, ``"float32"``,
        ``"float64"``); a dtype not listed uses ``"float32"``'s.
      matmul_efficiency: the fraction of peak the best-shaped large matmul reaches (datasheet
        presets: the Maximum Achievable Matmul FLOPS measured by Bekman's mamf-finder, BF16;
        measured presets: 1.0, their FLOP/s are achieved).  Other shapes lose their tile and wave
        quantization on ``sms`` (``gemm_quantization``).
      attention_efficiency: the fraction of peak a fused attention kernel (torch's SDPA:
        FlashAttention-2) reaches, forward and backward; 0: costed as a large matmul.
      memory_bytes: memory per device, as CUDA reports it to a process (``total_memory``).
      memory_bandwidth: bytes per second per device (elementwise ops are costed by it).
      op_overhead: seconds every op costs besides its FLOPs and bytes (a kernel launch).
      devices_per_node: devices that share the fast links; mesh order puts the last axes inside a node.
      intra_bandwidth, intra_latency: one direction's bytes/s and the per-step latency α inside a node.
      inter_bandwidth, inter_latency: the same across nodes: one NIC's bytes/s (each device has
        its own, as on DGX/HGX: a group with g devices on each node crosses on g NICs).
      nodes: how many nodes exist (``None``: as many as asked for).
      cores: CPU hardware only: the cores' worth of compute the devices of a node share (each
        device a process; measured: the cores times what a process reaches while another
        computes too, over what it reaches alone); devices beyond them share them.
      link_devices: CPU hardware only: how many processes shared the cores when α and β were
        measured.  A collective on a CPU is work for the cores too (copies, the reduction, the
        TCP stack): where more devices share each core than then, a message's bytes take longer
        in proportion (its latency, waiting for the peers, is as measured).
      skew: measured hardware only: the seconds a blocking message waits for its peers per second
        of compute since this device's last blocking message (processes that share noisy cores
        drift apart while they compute; a message waits out the drift).
      threads: measured hardware only: the threads each device's process computes with, as the
        ops of a step are timed (``None``: what torchrun gives its workers, ``OMP_NUM_THREADS=1``
        on a mesh of more than one device, else this process's own).
      kind_latency: measured hardware only: ``(kind, α)`` pairs, a collective kind's own latency
        per step, where it differs from the all-reduce's (gloo's all-gather and reduce-scatter
        take more: their time is nearly the same at 64 KB as at 1 MB).
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
    timed_ops: bool = False  # this machine: each op's kernel is timed here (fpar.plan._optime)
    link_devices: int | None = None  # CPU: the processes α and β were measured between (below)
    kind_latency: tuple = ()  # measured: ((collective kind, its own α), ...); other kinds use α
    skew: float = 0.0  # measured: seconds a blocking message waits per second computed since the last
    threads: int | None = None  # measured: threads per process the ops are timed with (None: torchrun's)
    attention_efficiency: float = 0.0  # fused attention's fraction of peak (0: as a matmul)
    sms: int = 0  # streaming multiprocessors: a GEMM's tiles run in waves over them (0: not modelled)
    gemm_tiles: tuple = ((256, 128), (128, 256))  # cuBLAS's most efficient output tiles (m, n)

    def peak(self, dtype: torch.dtype) -> float:
        """Peak FLOP/s for ``dtype``."""
        name = str(dtype).replace("torch.", "")
        return float(self.flops.get(name, self.flops["float32"]))

    def matmul_rate(self, flops: float, dtype: torch.dtype, dims: tuple | None = None) -> float:
        """FLOP/s a matmul of ``flops`` reaches.

        Measured hardware: its curve by size.  A datasheet device: peak × ``matmul_efficiency``
        (the best a large GEMM reaches) × ``gemm_quantization(dims)`` (its tiles and waves on
        the SMs; 1 without ``sms`` or a GEMM shape).
        """
        if self.matmul_curve and dtype == torch.float32:
            for f, rate in self.matmul_curve:
                if flops <= f:
                    return rate
            return self.matmul_curve[-1][1]
        return self.peak(dtype) * self.matmul_efficiency * self.gemm_quantization(dims)

    def gemm_quantization(self, dims: tuple | None) -> float:
        """The useful fraction of the tiles a GEMM ``(batch, m, k, n)`` runs on the SMs.

        cuBLAS splits the ``m × n`` output into tiles, one per SM at a time (NVIDIA, *Matrix
        Multiplication Background User's Guide*, "Dimension quantization effects"): a dimension
        that is not a multiple of the tile wastes part of its last tile (tile quantization), and
        a tile count that is not a multiple of the SMs leaves SMs idle in the last wave (wave
        quantization).  The best of ``gemm_tiles`` (cuBLAS picks its kernel per shape).
        """
        if not self.sms or dims is None:
            return 1.0
        b, m, _, n = dims
        best = 0.0
        for tm, tn in self.gemm_tiles:
            tiles = b * -(-m // tm) * -(-n // tn)
            waves = -(-tiles // self.sms)
            best = max(best, b * m * n / (waves * self.sms * tm * tn))
        return best

    def describe(self) -> list[str]:
        """The assumptions this hardware makes, one line each."""
        tf = ", ".join(f"{k} {v / 1e12:.4g} TFLOP/s" for k, v in self.flops.items())
        lines = [
            f"hardware {self.name}: {tf}; matmul efficiency {self.matmul_efficiency:.3g}"
            + (f" x tile/wave quantization on {self.sms} SMs" if self.sms else "")
            + (f"; attention {self.attention_efficiency:.3g}" if self.attention_efficiency else ""),
            f"  memory {self.memory_bytes / 2**30:.4g} GiB at {self.memory_bandwidth / 1e9:.4g} GB/s; "
            f"{self.op_overhead * 1e6:.3g} us per op",
            f"  {self.devices_per_node} devices per node: {self.intra_bandwidth / 1e9:.4g} GB/s, "
            f"alpha {self.intra_latency * 1e6:.3g} us inside; {self.inter_bandwidth / 1e9:.4g} GB/s, "
            f"alpha {self.inter_latency * 1e6:.3g} us across nodes",
        ]
        if self.cores:
            lines.append(
                f"  {self.cores:.2f} CPU cores' worth of compute shared by the devices (processes) of the node"
            )
        if self.cores and self.link_devices:
            lines.append(
                f"  alpha and beta measured between {self.link_devices} processes computing between messages; "
                "more devices per core than then slow a message's bytes (not its latency) in proportion"
            )
        if self.skew:
            lines.append(
                f"  a blocking message waits {self.skew:.3f} s per second computed since the last one (the peers' drift)"
            )
        if self.kind_latency:
            lines.append(
                "  alpha per kind: " + ", ".join(f"{k} {a * 1e6:.3g} us" for k, a in self.kind_latency)
            )
        if self.timed_ops:
            lines.append(
                "  each op's kernel timed on this machine once per signature (median of 5), plus the per-op "
                "overhead, with "
                + (
                    f"{self.threads} thread(s)"
                    if self.threads
                    else "torchrun's threads (1 per process on 2+ devices)"
                )
            )
        if self.reduce_scatter_all_reduces:
            lines.append("  reduce-scatter runs as an all-reduce (gloo): twice the bytes, 2(n-1) steps")
        return lines


PRESETS: dict[str, Hardware] = {
    "a100-80g": Hardware(
        "a100-80g",
        {"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12, "float64": 19.5e12},
        memory_bytes=85_056_798_720,  # an A100-SXM4-80GB's total_memory (79.2 GiB)
        memory_bandwidth=2.0e12,
        devices_per_node=8,
        intra_bandwidth=240e9,
        intra_latency=3.4e-6,  # NCCL's ring step on NVLink, Simple protocol (tuning.cc hwLat)
        inter_bandwidth=25e9,
        inter_latency=9.6e-6,  # NCCL's ring step over the network, Simple protocol (tuning.cc hwLat)
        matmul_efficiency=267.9 / 312,
        attention_efficiency=0.5,
        sms=108,
    ),
    "h100-sxm": Hardware(
        "h100-sxm",
        {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12, "float64": 67e12},
        memory_bytes=85_019_590_656,  # an H100 80GB HBM3's total_memory (79.2 GiB)
        memory_bandwidth=3.35e12,
        devices_per_node=8,
        intra_bandwidth=450e9,
        intra_latency=3.4e-6,  # NCCL's ring step on NVLink, Simple protocol (tuning.cc hwLat)
        inter_bandwidth=50e9,
        inter_latency=9.6e-6,  # NCCL's ring step over the network, Simple protocol (tuning.cc hwLat)
        matmul_efficiency=792.1 / 989,
        attention_efficiency=0.3,
        sms=132,
    ),
    "b200": Hardware(
        "b200",
        {"bfloat16": 2250e12, "float16": 2250e12, "float32": 80e12, "float64": 40e12},
        memory_bytes=182_642 * 2**20,  # a B200's (178.4 GiB)
        memory_bandwidth=8e12,
        devices_per_node=8,
        intra_bandwidth=900e9,
        intra_latency=3.4e-6,  # NCCL's ring step on NVLink, Simple protocol (tuning.cc hwLat)
        inter_bandwidth=50e9,
        inter_latency=9.6e-6,  # NCCL's ring step over the network, Simple protocol (tuning.cc hwLat)
        matmul_efficiency=792.1 / 989,  # not measured in the sources: the H100's fractions
        attention_efficiency=0.3,
        sms=148,
    ),
}

_THIS: list = [None]


def hardware(spec: str | Hardware, *, estimate=None) -> Hardware:
    """A ``Hardware`` from a preset name, ``"this"`` (measured here, once per process), or as given.

    ``estimate``: ``fpar.plan.estimate``, for ``"this"``'s per-op overhead (see ``measure_this``).

    Raises:
      ValueError: an unknown name (the message lists the presets).
    """
    if isinstance(spec, Hardware):
        return spec
    if spec == "this":
        if _THIS[0] is None:
            _THIS[0] = measure_this(estimate=estimate)
        return _THIS[0]
    if isinstance(spec, str) and spec in PRESETS:
        return PRESETS[spec]
    raise ValueError(
        f"fpar.plan: unknown hardware {spec!r}; choose one of {sorted(PRESETS) + ['this']} or pass "
        f"fpar.plan.Hardware(...)."
    )


def measure_this(*, comm: bool = True, repeats: int = 7, estimate=None) -> Hardware:
    """Measure this machine: matmul FLOP/s, memory bandwidth, per-op overhead, gloo α and β, cores.

    The ops of the estimates that follow are timed afresh (``fpar.plan._optime``): a measurement
    starts a new table, so that a machine whose speed moves is timed at one time.  Given
    ``estimate`` (``fpar.plan.estimate``, passed in: the estimator is built on this module), the
    per-op overhead is fpar's, from a tiny model's real step; else a bare autograd loop's.
    """
    _optime.reset()
    curve = tuple((2.0 * n**3, _matmul_flops(torch.float32, n)) for n in (32, 64, 128, 256, 512, 1024))
    flops = {"float32": curve[-1][1], "float64": _matmul_flops(torch.float64)}
    flops["bfloat16"] = flops["float16"] = _matmul_flops(torch.bfloat16)
    alpha, beta, busy, latency, skew = _gloo_alpha_beta(repeats) if comm else (50e-6, 1e9, 1.0, (), 0.0)
    cores = float(os.cpu_count() or 1) * busy
    hw = Hardware(
        "this",
        flops,
        memory_bytes=_memory_bytes(),
        memory_bandwidth=_copy_bandwidth(),
        devices_per_node=1024,
        intra_bandwidth=beta,
        intra_latency=alpha,
        inter_bandwidth=beta,
        inter_latency=alpha,
        matmul_efficiency=1.0,
        op_overhead=_op_overhead(),
        nodes=1,
        cores=cores,
        matmul_curve=curve,
        reduce_scatter_all_reduces=True,
        timed_ops=True,
        link_devices=2,
        kind_latency=latency,
        skew=skew,
    )
    if (
        comm and estimate is not None
    ):  # an fpar step's cost per op beyond its kernels (Python, autograd, fpar)
        hw = dataclasses.replace(hw, op_overhead=_step_overhead(hw, estimate))
    return hw


def _send_recv(dist, block) -> None:
    if dist.get_rank() == 0:
        dist.isend(block, 1).wait()
    else:
        dist.irecv(torch.empty_like(block), 0).wait()


_TINY = ("calibration", 64, 2, 4, 2, 128, 256, 32)  # fpar.plan.Model fields: kernels that cost little


def _step_overhead(hw: Hardware, estimate) -> float:
    """Seconds per op an fpar training step costs beyond its kernels, measured on a tiny model.

    The step (fpar.plan.model_step: forward, backward, AdamW) runs on a one-process real mesh;
    its median time, less its ops' kernels as timed here (``estimate`` on ``hw`` without the
    overhead), over its number of ops.
    """
    from .._dist import launch
    from ._models import Layout, Model, model_step

    measured = launch(_tiny_step_seconds, 1, timeout=120.0)[0]
    step, args = model_step(Model(*_TINY), Layout(**_TINY_LAYOUT), dtype=torch.float32)
    timing = estimate(step, *args, hardware=dataclasses.replace(hw, op_overhead=0.0)).devices[0]._timing
    return max((measured - timing.compute) / max(timing.ops, 1), hw.op_overhead / 4)


_TINY_LAYOUT = {"data": 1, "zero": 0, "microbatches": 1, "batch": 2}


def _tiny_step_seconds(repeats: int = 15) -> float:
    from .._mesh import make_mesh
    from ._models import Layout, Model, model_step

    mesh = make_mesh((1, 1, 1), ("pipeline", "data", "tensor"))
    step, args = model_step(Model(*_TINY), Layout(**_TINY_LAYOUT), mesh, dtype=torch.float32)

    def run():
        out = step(*args)
        loss = out[-1] if isinstance(out, tuple) else None
        if isinstance(loss, torch.Tensor):
            float(loss)  # the step is done when its loss is

    for _ in range(3):
        run()
    return _median_time(run, repeats)


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
    return _median_time(step, repeats=31) / len(counted)


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * 2**30


def _gloo_alpha_beta(repeats: int = 7) -> tuple[float, float, float, tuple, float]:
    """Fit gloo's all-reduce ``2α + S/β`` between two local processes, as a training step pays it.

    Each process computes a burst of one small layer's work (matmuls over 0.4 MB weights and a
    1 MB activation, as a step's ops between two collectives), then communicates; α and β are fit
    to what an all-reduce *adds* to such a loop (with it against without it, the medians of
    alternating runs), at 8 bytes and 4 MB.  That is more than an idle ping-pong's time: it
    holds the wait for the other process's skew, waking up, and the caches the exchange's copies
    evicted.  An all-gather of 0.5 MB blocks, a reduce-scatter of 1 MB and a send of 0.5 MB (a
    pipeline's) are measured the same way: their own latencies (what is left after their bytes at
    β) are returned, with the drift a message waits out per second of compute before it, and the
    fraction of its lone speed a process keeps while the other computes the same bursts (the
    cores two devices share).
    """
    from .._dist import launch

    ranks = launch(_gloo_times, 2, 16, repeats, timeout=300.0)
    keys = ("small", "big", "all_gather", "psum_scatter", "send", "short", "long", "short_burst")
    m = {k: statistics.fmean(r[k] for r in ranks) for k in keys}
    size = ranks[0]["size"]
    # the wait for the other's drift grows with the compute since the last message: the small
    # all-reduce after a long and a short burst gives its slope (seconds waited per second computed)
    skew = max((m["small"] - m["short"]) / max(m["long"] - m["short_burst"], 1e-6), 0.0)
    drift = skew * m["long"]  # what the long-burst measurements waited for it
    alpha = max((m["small"] - drift) / 2, 1e-6)
    beta = size / max(m["big"] - m["small"], size / 20e9)
    # each kind's own latency per step: what is left of its time after its bytes at β and the
    # drift (one device's bytes as fpar.comm_stats counts them, n = 2; gloo's reduce-scatter is an all-reduce)
    steps_bytes = {"all_gather": (1, size / 8), "psum_scatter": (2, size / 4), "send": (1, size / 8)}
    latency = tuple(
        (k, max((m[k] - drift - nbytes / beta) / steps, alpha)) for k, (steps, nbytes) in steps_bytes.items()
    )
    return alpha, beta, min(1.0, ranks[0]["busy"]), latency, skew


def _gloo_times(rounds: int = 16, repeats: int = 7) -> dict:
    import torch.distributed as dist

    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(1024, 256, generator=g)
    ws = [
        (torch.randn(256, 384, generator=g) * 0.05, torch.randn(384, 256, generator=g) * 0.05)
        for _ in range(3)
    ]

    def burst(pairs: int = 3):
        h = x0
        for w1, w2 in ws[:pairs]:
            h = (h @ w1).tanh() @ w2

    numel = 1 << 20  # 4 MB
    small, big = torch.ones(2), torch.ones(numel)
    block, full = torch.ones(numel // 8), torch.ones(numel // 4)  # 0.5 MB gathered; 1 MB scattered
    exchanges = {
        "small": lambda: dist.all_reduce(small),
        "big": lambda: dist.all_reduce(big),
        "all_gather": lambda: dist.all_gather([torch.empty_like(block) for _ in range(2)], block),
        "psum_scatter": lambda: dist.reduce_scatter(torch.empty_like(block), list(full.chunk(2))),
        "send": lambda: _send_recv(dist, block),  # a pipeline's hand-over: 0.5 MB one way
    }

    def loop(exchange=None, alone: bool = False, pairs: int = 3) -> float:
        dist.barrier()
        t = time.perf_counter()
        if not alone or dist.get_rank() == 0:
            for _ in range(rounds):
                burst(pairs)
                if exchange is not None:
                    exchange()
        elapsed = time.perf_counter() - t
        dist.barrier()
        return elapsed / rounds

    for exchange in exchanges.values():
        loop(exchange)
    added: dict = {k: [] for k in (*exchanges, "short")}
    share, long, short = [], [], []
    for _ in range(repeats):
        base = loop()
        long.append(base)
        for k, exchange in exchanges.items():
            added[k].append(loop(exchange) - base)
        share.append(loop(alone=True) / base)  # rank 0's lone burst over both at once
        base = loop(pairs=1)  # a third of the compute between two messages: less skew to wait out
        short.append(base)
        added["short"].append(loop(exchanges["small"], pairs=1) - base)
    out = {k: statistics.median(v) for k, v in added.items()}
    # one device sends 2 (n-1)/n S = S bytes of an n=2 all-reduce: time = 2 alpha + S / beta
    out.update(size=4 * numel, busy=statistics.median(share))  # rank 0's is the one that ran alone
    out.update(long=statistics.median(long), short_burst=statistics.median(short))
    return out
