"""fpar.plan's datasheet time model: GEMMs by shape, collectives by group span, retiming a trace.

Each mechanism is checked against a sum computed by hand here (no timing of this machine), and
the recorded events an estimate keeps time again to the estimate itself (``retime``, the stored
traces of docs/plan.md's published runs).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import fpar.plan as plan
from fpar.plan import _cost, _estimate, _trace
from fpar.plan._models import pipeline_schedule
from fpar.plan._record import Comm, Op

GPT = plan.Model("gpt-tiny", 32, 4, 2, 2, 128, 64, 16, "gpt")
H100, A100 = plan.PRESETS["h100-sxm"], plan.PRESETS["a100-80g"]


def test_a_gemm_loses_its_tile_and_wave_quantization_on_the_sms():
    # 132 SMs; tiles 256 x 128 or 128 x 256: 12 x 11 = 132 tiles of 256 x 128 fill one wave exactly
    assert H100.gemm_quantization((1, 12 * 256, 4096, 11 * 128)) == 1.0
    # one row more: 13 x 11 = 143 tiles of 256 x 128 (two waves) or 25 x 6 = 150 of 128 x 256 (two)
    m, n = 12 * 256 + 1, 11 * 128
    best = max(m * n / (2 * 132 * 256 * 128), m * n / (2 * 132 * 128 * 256))
    assert H100.gemm_quantization((1, m, 4096, n)) == pytest.approx(best)
    assert best < 0.51
    # a batched GEMM's tiles are counted over its batch; one small GEMM fills a fraction of a wave
    assert H100.gemm_quantization((2, 256, 64, 128)) == pytest.approx(2 / 132)
    assert H100.gemm_quantization(None) == 1.0
    # the rate: peak x the best-shaped GEMM's efficiency (MAMF) x the quantization
    dims = (1, 12 * 256, 4096, 11 * 128)
    flops = 2.0 * 12 * 256 * 4096 * 11 * 128
    op = Op("aten.mm", flops, 0, torch.bfloat16, "forward", dims=dims)
    assert _cost.op_seconds(op, H100, 1.0) == pytest.approx(flops / (989e12 * 792.1 / 989) + H100.op_overhead)
    small = dataclasses.replace(op, dims=(1, m, 4096, n), flops=2.0 * m * 4096 * n)
    assert _cost.op_seconds(small, H100, 1.0) == pytest.approx(
        small.flops / (792.1e12 * best) + H100.op_overhead
    )


def test_a_fused_attention_kernel_runs_at_its_own_efficiency():
    op = Op("aten._scaled_dot_product_flash_attention", 1e12, 0, torch.bfloat16, "forward")
    assert _cost.op_seconds(op, H100, 1.0) == pytest.approx(1e12 / (989e12 * 0.3) + H100.op_overhead)
    assert _cost.op_seconds(op, A100, 1.0) == pytest.approx(1e12 / (312e12 * 0.5) + A100.op_overhead)
    # causal: torch counts the whole s x s, the kernel computes half of it (at that efficiency),
    # and so it does without a fused-attention efficiency (costed as a large matmul)
    causal = dataclasses.replace(op, dims=("causal",))
    assert _cost.op_seconds(causal, H100, 1.0) == pytest.approx(0.5e12 / (989e12 * 0.3) + H100.op_overhead)
    plain = dataclasses.replace(H100, attention_efficiency=0.0)
    assert _cost.op_seconds(causal, plain, 1.0) == pytest.approx(0.5e12 / 792.1e12 + H100.op_overhead)


def test_a_causal_attention_kernel_is_recorded_causal_forward_backward_and_recomputed():
    from collections import Counter

    step, args = plan.model_step(GPT, plan.Layout(remat=True))
    events = plan.estimate(step, *args, hardware="h100-sxm").devices[0]._events[0]
    got = Counter((e.name, e.dims, e.recompute) for e in events if "attention" in getattr(e, "name", ""))
    flash = "aten._scaled_dot_product_flash_attention"
    assert got == {
        (flash, ("causal",), False): 4,
        (flash, ("causal",), True): 4,
        (flash + "_backward", ("causal",), False): 4,
    }


def test_a_collective_over_nodes_crosses_them_on_its_members_nics():
    nbytes = 10**9
    ar = Comm("psum", ("data",), nbytes, 32, True, "backward")
    a_in, a_out, b_in, nic = (
        H100.intra_latency,
        H100.inter_latency,
        H100.intra_bandwidth,
        H100.inter_bandwidth,
    )
    # 8 devices of one node: a ring on NVLink, 2(n-1) steps
    inside = dataclasses.replace(ar, n=8)
    assert _cost.comm_seconds(inside, H100, (1, 8)) == pytest.approx(14 * a_in + nbytes / b_in)
    # 32 devices, 8 on each of 4 nodes: 8 NICs a node carry it (400 GB/s < NVLink's 450);
    # latency: NCCL's tree over the nodes (log2 4 = 2 steps) and the ring inside, twice (all-reduce)
    assert _cost.comm_seconds(ar, H100, (4, 8)) == pytest.approx(
        2 * (2 * a_out + 7 * a_in) + nbytes / min(b_in, 8 * nic)
    )
    # one device on each of 32 nodes (a data axis across tensor=8 nodes): one NIC each
    assert _cost.comm_seconds(ar, H100, True) == pytest.approx(2 * 5 * a_out + nbytes / nic)
    assert _cost.comm_seconds(ar, H100, (32, 1)) == _cost.comm_seconds(ar, H100, True)
    # an all-gather: the tree once; a send between nodes: one step on one NIC
    ag = dataclasses.replace(ar, kind="all_gather")
    assert _cost.comm_seconds(ag, H100, (4, 8)) == pytest.approx(2 * a_out + 7 * a_in + nbytes / (8 * nic))
    send = dataclasses.replace(ar, kind="send", n=2)
    assert _cost.comm_seconds(send, H100, (2, 1)) == pytest.approx(a_out + nbytes / nic)


def test_an_estimate_spans_each_group_over_the_nodes_of_its_members():
    mesh = plan.abstract_mesh((4, 8), ("data", "tensor"))
    groups = {("data",): (0, 8, 16, 24), ("tensor",): tuple(range(8)), ("data", "tensor"): tuple(range(32))}
    assert _estimate._spans(groups, H100) == {
        ("data",): (4, 1),
        ("tensor",): (1, 8),
        ("data", "tensor"): (4, 8),
    }
    assert mesh.size == 32


def _fresh(layout, hardware):
    step, args = plan.model_step(GPT, layout)  # a fresh step: no buffers kept from another estimate
    return plan.estimate(step, *args, hardware=hardware)


@pytest.mark.parametrize(
    "layout",
    [
        plan.Layout(pipeline=2, data=2, microbatches=4, batch=8, virtual=2, remat=True),
        plan.Layout(data=16, tensor=2, zero=1, microbatches=2, batch=64),
    ],
    ids=["interleaved-pipeline", "data-x-tensor-over-nodes"],
)
def test_retiming_the_recorded_events_equals_estimating_on_that_hardware(layout):
    first = _fresh(layout, "h100-sxm")  # a layout's first estimate runs one op more (a cache filled once)
    direct = _fresh(layout, "a100-80g")
    again = _fresh(layout, "h100-sxm")
    est = _estimate.retime(direct, "h100-sxm")
    assert est.step_time == pytest.approx(again.step_time, rel=1e-12)
    assert est.time_breakdown == pytest.approx(again.time_breakdown, rel=1e-12, abs=1e-15)
    assert est.losses == pytest.approx(again.losses, rel=1e-9, abs=1e-12)
    assert (est.mfu, est.peak_bytes, est.comm) == (pytest.approx(again.mfu), again.peak_bytes, again.comm)
    # the trace (JSON) of the events times back to the very same estimate
    data = json.loads(json.dumps(_trace.dump(first)))
    back = _trace.load(data, H100, pipeline_schedule(layout) if layout.pipeline > 1 else None)
    assert back.step_time == first.step_time and back.losses == first.losses
    assert [c.peak_bytes for c in back.devices] == [c.peak_bytes for c in first.devices]
    assert [c.comm for c in back.devices] == [c.comm for c in first.devices]
    with pytest.raises(ValueError, match="retime takes datasheet hardware"):
        _estimate.retime(first, dataclasses.replace(H100, timed_ops=True))


def test_a_later_microbatchs_forward_is_a_forward_not_the_update():
    # the Recorder once called everything after the first backward "update": a pipeline's steady
    # forwards and an accumulating step's later microbatches (their activations as optimizer state)
    for layout in (
        plan.Layout(tensor=2, sequence_parallel=False, microbatches=2, batch=2, zero=0, remat=True),
        plan.Layout(pipeline=2, microbatches=4, batch=4, zero=0),
    ):
        est = _fresh(layout, "h100-sxm")
        for c in est.devices:
            events = c._events[0]
            marked = [e for e in events if getattr(e.mark, "kind", None) == "F"]
            assert marked or layout.pipeline == 1
            assert all(e.phase == "forward" for e in marked)
            tp = [e for e in events if isinstance(e, Comm) and e.axes == ("tensor",) and e.nbytes > 64]
            assert {e.phase for e in tp} <= {"forward", "backward"}
            # the update comes after the last backward and only there
            last = max(i for i, e in enumerate(events) if e.phase == "backward")
            assert all(i > last for i, e in enumerate(events) if e.phase == "update")


def test_the_ranking_keeps_its_columns_with_interleaved_layouts():
    from types import SimpleNamespace

    est = SimpleNamespace(
        peak_bytes=40 * 2**30,
        step_time=4.0,
        time_breakdown={"compute": 3.0, "exposed_comm": 0.5, "bubble": 0.5},
        mfu=0.4,
    )
    layouts = [
        plan.Layout(pipeline=8, data=16, tensor=8, microbatches=16, batch=256, remat=True, virtual=2),
        plan.Layout(data=128, tensor=8, zero=3, microbatches=1, batch=256),
    ]
    table = plan.ranking([plan.Result(lay, est, 1.0) for lay in layouts]).splitlines()
    end = table[0].index("peak GiB") + len("peak GiB")
    assert all(row[end - 4 : end] == "40.0" for row in table[1:]), table
    assert "virtual=2" in table[1]


def test_zero3_gathers_are_prefetched_one_ahead_and_gradient_sums_overlap_to_the_end():
    op = Op("aten.mm", 1e13, 0, torch.bfloat16, "forward")  # no dims: peak x MAMF
    compute = _cost.op_seconds(op, H100, 1.0)
    gather = Comm("all_gather", ("data",), 10**9, 8, True, "forward")
    g = _cost.comm_seconds(gather, H100, (1, 8))
    assert g < compute
    # the first gather is waited for; the second travels during the first layer's compute
    t = _cost.time_events([gather, op, gather, op], H100, {("data",): (1, 8)}, 1.0)
    assert t.total == pytest.approx(g + 2 * compute)
    # gathers slower than the compute: each waits for the previous one's use before it starts
    slow = dataclasses.replace(gather, nbytes=gather.nbytes * 8)
    gs = _cost.comm_seconds(slow, H100, (1, 8))
    t = _cost.time_events([slow, op, slow, op], H100, {("data",): (1, 8)}, 1.0)
    assert t.total == pytest.approx(2 * gs + compute)
    # a gradient reduce-scatter overlaps everything after it, waited for at the end of the step
    rs = Comm("psum_scatter", ("data",), 10**9, 8, True, "backward")
    r = _cost.comm_seconds(rs, H100, (1, 8))
    t = _cost.time_events([rs, op], H100, {("data",): (1, 8)}, 1.0)
    assert t.total == pytest.approx(max(r, compute))
