"""Time of a simulated step: ops from the hardware's peak, messages from α–β, overlap, bubble.

* An op takes ``max(FLOPs / (peak(dtype) × efficiency), bytes / memory bandwidth)`` plus the
  hardware's per-op overhead (a roofline; matmul-class ops reach ``matmul_efficiency`` of peak,
  the best a large GEMM reaches, times the GEMM's tile and wave quantization on the device's
  SMs: ``Hardware.matmul_rate``); a fused attention kernel reaches ``attention_efficiency``.
  On hardware measured here (``"this"``) an op's kernel is timed on this machine instead
  (``Op.seconds``); the overhead is then fpar's measured cost per op of a real step.
* A message of ``S`` bytes sent per device (``fpar.comm_stats``' count, which already holds the
  ring's ``(n-1)/n`` factors) over an axis group takes ``steps × α + S / β``: ``2(n-1)`` steps for
  an all-reduce, ``n-1`` for all-gather, reduce-scatter and all-to-all, one for a
  point-to-point send.  β and α are the node's links when every device of the group shares this
  device's node (the mesh's last axes are inside a node); a group over several nodes crosses
  them over its members' NICs (``comm_seconds``).
* Compute runs in order on one stream, each process group's messages in order on a stream of
  their own (NCCL runs every communicator on its own CUDA stream; PyTorch's ``ProcessGroupNCCL``
  makes one per group and device): a blocking collective (fpar's collectives in the forward and
  backward) makes compute wait for it; one issued to overlap (gradient buckets, ZeRO's
  prefetches and reduce-scatters) runs beside the compute that follows and is waited for at the
  end of the step, as fpar runs them.  So a tensor-parallel all-gather waits for the
  tensor-parallel messages before it, never behind a data-parallel bucket in flight over the
  NICs (it did, with one message stream: Llama 3 405B's pipeline drain then waited for every
  stage's gradient all-reduce in turn).  Groups that share a link are not slowed by each other:
  the model leaves that contention out.  On CPU hardware (``cores``) nothing overlaps: a
  message's copies, its sums and the TCP stack run on the cores the compute needs, so every
  message's time adds to the step.
* A pipeline's stages: each compute action's time is the time of its ops and blocking messages;
  the schedule replays with those times (``fpar.pipeline``'s dependency rules) and the idle
  time inside the makespan is the bubble.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ._hardware import Hardware
from ._record import Comm, Op

__all__ = ["Timing", "op_seconds", "time_events"]

_STEPS = {"psum": 2, "pmean": 2, "pmax": 2, "pmin": 2}
_MATMUL = {
    "aten.mm",
    "aten.addmm",
    "aten.bmm",
    "aten.baddbmm",
    "aten.convolution",
    "aten._grouped_mm",
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention",
    "aten._flash_attention_forward",
    "aten._efficient_attention_forward",
    "aten._scaled_dot_product_flash_attention_backward",
    "aten._scaled_dot_product_efficient_attention_backward",
    "aten.convolution_backward",
}


_ATTENTION = {n for n in _MATMUL if "attention" in n}


@dataclasses.dataclass
class Timing:
    """One device's step: total seconds and how they split."""

    total: float = 0.0
    compute: float = 0.0
    comm: float = 0.0  # seconds the messages take (exposed or not)
    by_mark: dict = dataclasses.field(default_factory=dict)  # pipeline action -> seconds
    unmarked: float = 0.0  # seconds outside any pipeline action
    flops: float = 0.0
    ops: int = 0
    flops_by_dtype: dict = dataclasses.field(default_factory=dict)
    # where the time goes (Estimate.losses): matmul seconds and their seconds at peak, the
    # recomputed forwards' seconds and FLOPs, the optimizer's seconds (ops after the backward
    # outside any pipeline action), the exposed seconds per message axes
    matmul: float = 0.0
    matmul_at_peak: float = 0.0
    recompute: float = 0.0  # seconds of the recomputed forwards' ops
    recompute_flops: float = 0.0
    update: float = 0.0
    exposed: dict = dataclasses.field(default_factory=dict)


def op_seconds(op: Op, hw: Hardware, share: float) -> float:
    """Seconds of one op on ``hw``; ``share`` is the fraction of a core each device gets (CPU)."""
    if op.seconds is not None:  # its kernel timed on this machine
        return (op.seconds + hw.op_overhead) / share
    # torch counts a causal attention kernel's whole s x s; the kernel skips the masked half, and
    # its efficiency is measured on the half it computes (flash-attention's benchmarks count FLOPs so)
    causal = op.dims == ("causal",)
    work = op.flops / 2 if causal else op.flops
    if op.name in _ATTENTION and hw.attention_efficiency:
        rate = hw.peak(op.dtype) * hw.attention_efficiency
    elif op.name in _MATMUL:
        rate = hw.matmul_rate(work, op.dtype, None if causal else op.dims)
    else:
        rate = hw.peak(op.dtype)
    compute = work / (rate * share) if work else 0.0
    memory = op.nbytes / (hw.memory_bandwidth * share) if op.nbytes else 0.0
    if not (op.flops or op.nbytes) and not hw.cores:
        return 0.0  # a view on an accelerator: no kernel (its CPU dispatch overlaps the device's work)
    return max(compute, memory) + hw.op_overhead / share


def comm_seconds(c: Comm, hw: Hardware, span: Any, link_share: float = 1.0) -> float:
    """Seconds of one message of ``c.nbytes`` bytes over a group of ``c.n`` devices.

    ``span``: how the group lies on the nodes, ``(nodes, members per node)``; ``False`` is one
    node, ``True`` one member on each of ``c.n`` nodes.  Inside a node a collective is a ring over
    the node's links: ``steps × α + S / β``.  A group over several nodes (NCCL): its bytes cross
    the nodes over the NICs of its members on each node (one NIC per device, as on DGX/HGX), so
    its bus bandwidth is ``min(β inside the node, members per node × β of one NIC)``; its latency
    is NCCL's tree across the nodes (``⌈log2 nodes⌉`` steps of the network's α, twice for an
    all-reduce) plus the ring inside each node.

    ``link_share`` (CPU, more devices per core than when β was measured): the bytes' copies, sums
    and TCP stack are work for the shared cores, so ``S / β`` grows by its inverse; the latency
    (waiting for the peers) does not.
    """
    if c.kind == "recv":
        return 0.0  # the peer's send carries it
    nodes, per_node = _span(span, c.n)
    twice = _STEPS.get(c.kind, 1)
    nbytes = c.nbytes
    if c.kind == "psum_scatter" and hw.reduce_scatter_all_reduces:
        twice, nbytes = 2, 2 * nbytes
    if nodes <= 1:
        steps = 1 if c.kind == "send" else twice * max(c.n - 1, 0)
        alpha, beta = hw.intra_latency, hw.intra_bandwidth
        for kind, latency in hw.kind_latency:  # measured hardware: this kind's own latency
            if c.kind in (kind, kind + "_invariant"):
                alpha = latency
        return steps * alpha + nbytes / (beta * link_share)
    if c.kind == "send":
        return hw.inter_latency + nbytes / (hw.inter_bandwidth * link_share)
    latency = twice * (math.ceil(math.log2(nodes)) * hw.inter_latency + (per_node - 1) * hw.intra_latency)
    beta = per_node * hw.inter_bandwidth
    if per_node > 1:
        beta = min(beta, hw.intra_bandwidth)
    return latency + nbytes / (beta * link_share)


def _span(span: Any, n: int) -> tuple[int, int]:
    if span is True:
        return n, 1
    if not span:
        return 1, n
    return span


def time_events(
    events: list, hw: Hardware, inter_axes: dict[tuple, Any], share: float, link_share: float = 1.0
) -> Timing:
    """Replay one device's ops and messages on a compute stream and a message stream per group.

    ``inter_axes``: per message axes, how its group lies on the nodes (``comm_seconds``' span).
    ``share``: the fraction of a core each device gets (CPU); ``link_share``: the speed of messages
    against the conditions α and β were measured in (CPU, more devices per core: below 1).
    """
    t = Timing()
    last_backward = max(
        (i for i, e in enumerate(events) if getattr(e, "phase", "") == "backward"), default=-1
    )
    now = 0.0  # the compute stream's clock
    free: dict[str, float] = {}  # per group's axes: when its message stream is next free (CPU: one)
    synced = 0.0  # the compute clock at the last blocking message (the peers' drift grows from it)
    gathers: dict = {}  # axes -> the compute clock when the last prefetched gather was used
    for i, e in enumerate(events):
        if isinstance(e, Op):
            dt = op_seconds(e, hw, share)
            t.ops += 1
            t.compute += dt
            t.flops += e.flops
            if e.flops:
                t.flops_by_dtype[e.dtype] = t.flops_by_dtype.get(e.dtype, 0.0) + e.flops
            if e.name in _MATMUL and not e.recompute:
                t.matmul += dt
                t.matmul_at_peak += e.flops / hw.peak(e.dtype)
            if e.recompute:
                t.recompute += dt
                t.recompute_flops += e.flops
            elif i > last_backward and e.mark is None:
                t.update += dt
            now += dt
            _charge(t, e.mark, dt)
            continue
        dt = comm_seconds(e, hw, inter_axes.get(e.axes, False), link_share)
        if dt == 0.0:
            continue
        blocking = not e.overlap or hw.cores  # on a CPU the message's copies and sums use the same cores
        if blocking and hw.skew:  # measured hardware: wait out the peers' drift since the last one
            dt += hw.skew * max(now - synced, 0.0)
        t.comm += dt
        key = ",".join(e.axes)
        stream = "" if hw.cores else key
        if e.overlap and e.kind == "all_gather" and not hw.cores:
            # ZeRO-3's gathers are prefetched one ahead: each started when the previous one was
            # used (its event: fpar counts a gather where it is waited for), and waited for now
            start = max(gathers.get(key, now), free.get(stream, 0.0))
            free[stream] = done = start + dt
            if done > now:
                t.exposed[key] = t.exposed.get(key, 0.0) + done - now
                _charge(t, e.mark, done - now)
                now = done
            gathers[key] = now  # the next one starts once this one is in use
            continue
        free[stream] = done = max(now, free.get(stream, 0.0)) + dt
        if blocking:
            _charge(t, e.mark, done - now)
            t.exposed[key] = t.exposed.get(key, 0.0) + done - now
            now = synced = done
    end = max(free.values(), default=0.0)
    t.total = max(now, end)
    if end > now:  # the overlapped messages still in flight when the compute ends
        t.unmarked += end - now
        last = max(free, key=free.__getitem__)  # a GPU's stream, named by its axes (a CPU blocks)
        t.exposed[last] = t.exposed.get(last, 0.0) + end - now
    return t


def _charge(t: Timing, mark: Any, dt: float) -> None:
    if mark is None:
        t.unmarked += dt
    else:
        t.by_mark[mark] = t.by_mark.get(mark, 0.0) + dt
