"""fpar.plan at scale: microbatches simulated once, the layouts published runs used, the time model."""

from __future__ import annotations

import dataclasses

import plan_programs as PP
import pytest

import fpar.plan as plan
from fpar.plan import _repeat
from fpar.plan._models import pipeline_schedule

SMALL = plan.Model("small", 32, 2, 2, 2, 64, 64, 16)


def _estimate(layout, model=SMALL, hardware="h100-sxm", *, repeat=True):
    _repeat.ENABLED[0] = repeat
    try:
        step, args = plan.model_step(model, layout)
        return plan.estimate(step, *args, hardware=hardware)
    finally:
        _repeat.ENABLED[0] = True


GPT = plan.Model("gpt-small", 32, 4, 2, 2, 128, 64, 16, "gpt")


@pytest.mark.parametrize(
    "schedule, virtual, model, m, group",
    [
        ("1f1b", 1, SMALL, 6, None),
        ("zb", 1, SMALL, 6, None),
        ("1f1b", 2, GPT, 10, None),
        ("1f1b", 2, GPT, 8, None),
        ("1f1b", 2, GPT, 14, 4),  # Megatron's groups of 4 microbatches: 4, 4, 4, then 2
    ],
    ids=["1f1b", "zb", "interleaved-gpt", "interleaved-gpt-8", "interleaved-gpt-group-4"],
)
def test_repeating_the_steady_microbatch_equals_simulating_every_one(schedule, virtual, model, m, group):
    # every microbatch runs the same program: a stage simulates the first few and the last, and
    # the steady one's ops and messages stand for the others; nothing an estimate reports moves.
    # With 2 chunks a stage the peak's state (which chunks are in flight, the first holding the
    # embedding) took more microbatches than their count in flight: 8 of 10 on stage 0, where 5
    # planned its peak 656 bytes low (ZeRO-1's sums in buffers of their own)
    layout = plan.Layout(
        pipeline=2,
        data=2,
        tensor=2,
        microbatches=m,
        batch=2 * m,
        schedule=schedule,
        virtual=virtual,
        group=group,
    )
    kept = [_repeat.kept_microbatches(pipeline_schedule(layout), s) for s in range(2)]
    assert any(k is not None and len(k) < m for k in kept), kept
    fast, full = _estimate(layout, model), _estimate(layout, model, repeat=False)
    assert [c.peak_bytes for c in fast.devices] == [c.peak_bytes for c in full.devices]
    assert [c.comm for c in fast.devices] == [c.comm for c in full.devices]
    assert [c.flops for c in fast.devices] == [c.flops for c in full.devices]
    assert fast.step_time == pytest.approx(full.step_time, rel=1e-12)
    for k in ("compute", "exposed_comm", "bubble"):
        assert fast.time_breakdown[k] == pytest.approx(full.time_breakdown[k], rel=1e-9, abs=1e-15)


def test_reducing_each_chunk_simulates_every_microbatch_and_equals_it():
    """``reduce_once=False``'s reductions are in flight from one backward to the next, across the
    forwards between: a steady microbatch's events do not stand for another's (the repeated
    estimate was 512 bytes low on stage 1 and 4 us short), so a measured run simulates every
    microbatch, though the schedule would allow repeating one.  Both estimates then agree."""
    layout = plan.Layout(
        pipeline=2, data=2, tensor=2, microbatches=10, batch=20, virtual=2, zero=3, reduce_once=False
    )
    kept = [_repeat.kept_microbatches(pipeline_schedule(layout), s) for s in range(2)]
    assert any(k is not None and len(k) < layout.microbatches for k in kept), kept
    fast, full = _estimate(layout, GPT), _estimate(layout, GPT, repeat=False)
    assert [c.peak_bytes for c in fast.devices] == [c.peak_bytes for c in full.devices]
    assert [c.comm for c in fast.devices] == [c.comm for c in full.devices]
    assert fast.step_time == pytest.approx(full.step_time, rel=1e-12)


@pytest.mark.parametrize(
    "layout",
    [
        plan.Layout(pipeline=2, data=2, tensor=2, microbatches=8, batch=16, virtual=2, zero=1),
        plan.Layout(pipeline=2, data=2, tensor=1, microbatches=6, batch=12, zero=3),
    ],
    ids=["interleaved-zero1", "1f1b-fsdp"],
)
def test_a_run_that_only_plans_runs_the_fewest_microbatches_and_moves_nothing(monkeypatch, layout):
    # The first stage's first run and the loss's stage's only plan: microbatches 0, 1 and the
    # last.  A stage whose run plans a call it was not expected to (here the loss's, when not
    # told) drops the microbatches not begun from then on.  What the measured runs report
    # equals an estimate whose planning runs run every microbatch.
    from fpar.plan import _estimate as estimate_module
    from fpar.plan import _paper

    m = layout.microbatches
    fewest = frozenset({0, 1, m - 1})
    planned, narrowed = [], []
    kept, narrow = _paper.Simulation.kept, _paper.Simulation.narrowed

    def spy_kept(self, schedule, stage, every=False):
        keep = kept(self, schedule, stage, every)
        if self.planning:
            planned.append((stage, keep))
        return keep

    def spy_narrowed(self, schedule, keep, begun):
        out = narrow(self, schedule, keep, begun)
        if out is not keep:
            narrowed.append((frozenset(begun), out))
        return out

    monkeypatch.setattr(_paper.Simulation, "kept", spy_kept)
    monkeypatch.setattr(_paper.Simulation, "narrowed", spy_narrowed)
    fast = _estimate(layout, GPT)
    assert planned == [(0, fewest), (1, fewest)] and narrowed == []
    planned.clear()
    monkeypatch.setattr(estimate_module, "last_stage", lambda schedule: None)
    late = _estimate(layout, GPT)
    assert planned == [(0, fewest)]
    assert len(narrowed) == 1  # the last stage, once, keeping what had begun
    begun, keep = narrowed[0]
    assert keep == begun | fewest and len(keep) < m
    monkeypatch.setattr(_paper, "_planning", lambda schedule: None)  # plan with every microbatch
    full = _estimate(layout, GPT)
    for est in (fast, late):
        assert [c.peak_bytes for c in est.devices] == [c.peak_bytes for c in full.devices]
        assert [c.breakdown for c in est.devices] == [c.breakdown for c in full.devices]
        assert [c.comm for c in est.devices] == [c.comm for c in full.devices]
        assert [c.flops for c in est.devices] == [c.flops for c in full.devices]
        assert est.step_time == full.step_time


@pytest.mark.parametrize(
    "layout",
    [
        plan.Layout(pipeline=2, data=2, tensor=2, microbatches=4, batch=8, zero=3),
        plan.Layout(pipeline=1, data=2, tensor=2, microbatches=2, batch=4, zero=1, sequence_parallel=False),
    ],
    ids=["pipeline-fsdp-sp", "zero1-tp"],
)
def test_a_collective_on_paper_accounts_what_the_fake_process_group_did(monkeypatch, layout):
    # On paper the one-buffer all-gathers, reduce-scatters and all-reduces skip torch.distributed
    # (Simulation.collective); through it, the fake process group's c10d ops give the same estimate.
    import torch.distributed as dist

    from fpar._dist import exchange

    fast = _estimate(layout, GPT)
    monkeypatch.setattr(exchange, "all_gather_single", exchange._all_gather_single)
    monkeypatch.setattr(exchange, "reduce_scatter_single", exchange._reduce_scatter_single)
    monkeypatch.setattr(
        exchange,
        "all_reduce",
        lambda x, op=dist.ReduceOp.SUM, *, group, async_op=False: dist.all_reduce(
            x, op=op, group=group, async_op=async_op
        ),
    )
    through = _estimate(layout, GPT)
    for a, b in zip(fast.devices, through.devices, strict=True):
        assert (a.peak_bytes, a.breakdown, a.saved_activations) == (
            b.peak_bytes,
            b.breakdown,
            b.saved_activations,
        )
        assert (a.comm, a.flops, a.step_time) == (b.comm, b.flops, b.step_time)


def test_the_kept_microbatches_reach_the_schedules_most_in_flight():
    import fpar.pipeline as pp

    sch = pp.one_f_one_b(4, 32)
    # 1F1B: stage s holds p - s microbatches at most, also in a forward after its first backward
    # (its gradient sums made): it simulates that many and one more (at most), one steady, the last
    assert [len(_repeat.kept_microbatches(sch, s)) for s in range(4)] == [7, 6, 5, 3]
    assert all(31 in _repeat.kept_microbatches(sch, s) for s in range(4))
    assert _repeat.kept_microbatches(pp.one_f_one_b(2, 3), 0) is None  # too few to save any


def test_a_gpt_model_has_megatrons_parameter_count_and_its_head_is_the_embedding():
    import torch

    step, args = plan.model_step(GPT, plan.Layout())
    held = sum(t.numel() for t in torch.utils._pytree.tree_leaves(args[0]) if isinstance(t, torch.Tensor))
    assert held == GPT.n_params
    h, n, v, s = 32, 4, 64, 16  # Megatron-LM: 12 l h^2 (1 + 13 / 12h + (V + s) / 12lh), 4h MLP
    megatron = 12 * n * h * h * (1 + 13 / (12 * h) + (v + s) / (12 * n * h))
    assert GPT.n_params == round(megatron) + 2 * h  # and the final LayerNorm, which it leaves out
    assert plan.MODELS["gpt-175b"].n_params == pytest.approx(175e9, rel=0.01)


@pytest.mark.parametrize(
    "layout, match",
    [
        (plan.Layout(pipeline=1, virtual=2), r"virtual=2 \(interleaved 1F1B\) needs pipeline > 1"),
        (
            plan.Layout(pipeline=2, microbatches=3, batch=3, virtual=2),
            r"microbatches=3x1 .* virtual=2: .*m=3 is not divisible by the number of stages p=2.*group=3 fits",
        ),
        (
            plan.Layout(pipeline=2, microbatches=5, batch=5, virtual=2, group=4),
            r"group=4 leaves a last group of 1 microbatches \(m=5\), fewer than the p=2 stages.*group=3 fits",
        ),
        (
            plan.Layout(pipeline=2, microbatches=4, batch=4, group=2),
            r"group=2 is interleaved 1F1B's microbatches a group: it needs virtual > 1",
        ),
        (
            plan.Layout(remat="selective"),
            r"remat='selective'; choose True, False or a selective policy: 'dots'",
        ),
        (plan.Layout(zero=4), r"zero=4; choose ZeRO stage 0, 1, 2 or 3"),
        (
            plan.Layout(pipeline=4, microbatches=4, batch=4, virtual=2),
            r"n_layers=4 by pipeline x virtual=8: with 1 a chunk, 4 of the 8 layer slots would be empty",
        ),
    ],
)
def test_a_layout_fpar_cannot_express_names_what_is_missing(layout, match):
    with pytest.raises(ValueError, match=match):
        plan.model_step(GPT, layout)
    with pytest.raises(ValueError, match="kind='bert'"):
        plan.Model("m", 8, 1, 1, 1, 8, 8, 8, "bert")
    with pytest.raises(ValueError, match="attention='sparse'; choose 'flash' or 'eager'"):
        plan.Model("m", 8, 1, 1, 1, 8, 8, 8, attention="sparse")


def test_eager_attention_equals_the_flash_kernel_and_materialises_the_scores():
    import dataclasses
    from collections import Counter

    import torch

    from fpar.plan._models import _attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 16, 8, generator=g, dtype=torch.float64) for _ in range(3))
    torch.testing.assert_close(_attention(q, k, v, eager=True), _attention(q, k, v))
    eager = dataclasses.replace(GPT, attention="eager", seq=32)  # 4 layers, 2 heads of 16
    step, args = plan.model_step(eager, plan.Layout(batch=2))
    events = plan.estimate(step, *args, hardware="a100-80g").devices[0]._events[0]
    names = Counter(getattr(e, "name", None) for e in events)
    assert not [n for n in names if n and "attention" in n]
    assert names["aten._softmax"] == 4 and names["aten._softmax_backward_data"] == 4
    # the scores and the context: [b h, s, hd] x [b h, hd, s] and [b h, s, s] x [b h, s, hd], per layer
    dims = Counter(e.dims for e in events if getattr(e, "name", None) == "aten.bmm" and e.phase == "forward")
    assert dims == {(4, 32, 16, 32): 4, (4, 32, 32, 16): 4}


# the in-process mesh vmaps the stages' shard over their devices; torch runs the CPU flash kernel
# under vmap by its per-sample fallback (a loop: slower, the same values) and warns so
@pytest.mark.filterwarnings(
    "ignore:There is a performance drop because we have not yet implemented:UserWarning"
)
def test_uneven_stages_give_the_end_chunks_fewer_layers_and_equal_the_unpipelined_model():
    import dataclasses

    import torch

    import fpar
    from fpar.pipeline._schedule import locate
    from fpar.plan._models import chunk_layers

    # 6 layers over 2 stages x 2 chunks: 8 slots, the first and the last chunk hold one layer
    model = dataclasses.replace(plan.MODELS["tiny"], name="tiny-6", n_layers=6)
    layout = plan.Layout(pipeline=2, virtual=2, microbatches=2, batch=2, zero=0)
    counts = chunk_layers(model, layout)
    assert counts == [1, 2, 2, 1]
    assert chunk_layers(plan.MODELS["llama-405b"], dataclasses.replace(layout, pipeline=16, virtual=8)) == (
        [0] + [1] * 126 + [0]  # Llama 3: the first chunk only the embedding, the last only the head
    )
    mesh = fpar.make_mesh((2, 1, 1), ("pipeline", "data", "tensor"), backend="local")
    step, (params, state, xs, ys) = plan.model_step(model, layout, mesh, dtype=torch.float32)
    rows = [(locate(k, 2, 2), counts[k]) for k in range(4)]

    def model_order(stacked):  # the layers the chunks use, in model order
        return torch.cat([stacked[s * 2 + c, :n] for (s, c), n in rows])

    (new, _), loss = step(params, state, xs, ys)
    flat = plan.Layout(microbatches=2, batch=2, zero=0)
    mesh1 = fpar.make_mesh((1, 1, 1), ("pipeline", "data", "tensor"), backend="local")
    step1, (_, state1, batch1) = plan.model_step(model, flat, mesh1, dtype=torch.float32)
    blocks = {n: model_order(t) for n, t in params["stages"].items()}
    new1, _, out1 = step1(
        {"blocks": blocks, "first": params["first"], "last": params["last"]}, state1, batch1
    )
    torch.testing.assert_close(loss, out1["loss"])
    for n, t in new["stages"].items():  # AdamW's first update moves each weight by ~3e-4
        torch.testing.assert_close(model_order(t), new1["blocks"][n], atol=2e-5, rtol=0)
    for g in ("first", "last"):
        torch.testing.assert_close(new[g], new1[g], atol=2e-5, rtol=0)


def test_selective_recomputation_recomputes_what_its_policy_does_not_keep():
    import dataclasses

    # GPT-small: per layer 6 matmuls in the forward (q, k, v, o, the MLP's two) and the attention
    ests = {
        remat: _estimate(plan.Layout(batch=2, remat=remat), GPT)
        for remat in (False, True, "alternate_dots", "dots")
    }
    tokens, d, hd = 2 * GPT.seq, GPT.d_model, GPT.d_model // GPT.n_heads
    matmuls = 2 * tokens * d * 4 * d + 2 * 2 * tokens * d * GPT.d_ffn  # q, k, v, o; the MLP's two
    attention = 2 * 2 * (2 * GPT.n_heads) * GPT.seq * GPT.seq * hd  # its two batched products
    recomputed = {k: e.flops - e.model_flops for k, e in ests.items()}
    assert recomputed[False] == 0
    assert recomputed[True] == GPT.n_layers * (matmuls + attention)  # every layer's forward again
    assert recomputed["dots"] == 0  # matmuls and attention kept: only element-wise ops run again
    # every other matmul of each layer's 6 (k and o; the MLP's second): 2 of d x d and one of d x ffn
    assert recomputed["alternate_dots"] == GPT.n_layers * 2 * tokens * d * (2 * d + GPT.d_ffn)
    # what the forward keeps at the peak: a longer sequence, so that activations dominate it
    longer = dataclasses.replace(GPT, seq=128)
    kept = {
        k: _estimate(plan.Layout(batch=8, remat=k), longer).devices[0].breakdown["activations"]
        for k in (False, True, "alternate_dots", "dots")
    }
    assert kept[True] < kept["alternate_dots"] < kept["dots"] < kept[False]


def test_the_losses_say_where_the_step_goes_and_add_up_with_the_mfu():
    layout = plan.Layout(pipeline=2, data=2, tensor=2, microbatches=2, batch=4, remat=True)
    est = _estimate(layout, GPT)
    assert est.model_flops < est.flops and est.mfu < est.hfu  # the recomputed forward is not MFU
    assert est.mfu + sum(est.losses.values()) == pytest.approx(1.0)
    assert {"matmul_efficiency", "recompute", "optimizer", "bubble", "other"} <= set(est.losses)
    assert {"exposed_comm:tensor", "exposed_comm:data"} <= set(est.losses)
    assert est.losses["recompute"] > 0 and est.losses["bubble"] > 0
    assert "where the rest goes: matmul_efficiency" in str(est)


def test_search_choices_cover_interleaving_micro_batch_zero_and_recomputation():
    from fpar.plan._search import layout_choices

    got = layout_choices(
        plan.MODELS["llama-70b"],
        1024,
        pipeline=[1, 4, 8],
        tensor=[8],
        virtual=[1, 2],
        micro_batch=[1, 2],
        zero=[0, 1, 3],
        remat=[False, True],
        batch=[256],
    )
    assert all(lay.devices == 1024 and lay.micro_batch * lay.microbatches * lay.data == 256 for lay in got)
    assert {lay.virtual for lay in got if lay.pipeline > 1} == {1, 2}
    assert all(lay.virtual == 1 for lay in got if lay.pipeline == 1)  # interleaving needs a pipeline
    assert {(lay.zero, lay.remat) for lay in got if lay.pipeline == 1} == {
        (z, r) for z in (0, 1, 3) for r in (False, True)
    }
    # ZeRO inside a pipeline too (fpar.optim.zero_pipeline)
    assert {(lay.zero, lay.remat) for lay in got if lay.pipeline > 1} == {
        (z, r) for z in (0, 1, 3) for r in (False, True)
    }
    with pytest.raises(ValueError, match="choose micro_batch or microbatches, not both"):
        layout_choices(None, 8, micro_batch=[1], microbatches=[2])


def test_the_published_table_is_what_todays_time_model_predicts_from_the_stored_traces():
    # bench/plan.py published estimates every run (minutes each): it stores each run's recorded
    # ops and messages (bench/plan_published/*.json.gz), its record (bench/plan_published.json)
    # and the page's table.  Here every record is derived again from its trace with today's time
    # model and presets, and the page must show exactly what those records render: a change to
    # the time model that does not regenerate the table (--retime, seconds) fails here.
    import gzip
    import json
    from pathlib import Path

    from fpar.plan import _published
    from fpar.plan._models import check_layout

    root = Path(__file__).resolve().parents[2]
    records = json.loads((root / "bench" / "plan_published.json").read_text())
    assert set(records) <= {r.name for r in _published.RUNS}, "python bench/plan.py published"
    for run in _published.RUNS:
        check_layout(run.model, run.layout)  # each row's layout is one model_step builds
        if run.name not in records:  # not estimated yet: the page says so
            continue
        with gzip.open(root / "bench" / "plan_published" / f"{_published.slug(run)}.json.gz", "rt") as f:
            got = _published.record(_published.retimed(run, json.load(f)), run)
        want = records[run.name]
        for key in ("predicted_tflops", "step_time", "mfu", "hfu", "peak_gib"):
            assert got[key] == pytest.approx(want[key], rel=1e-9), (run.name, key)
        assert got["fits"] == want["fits"]
        assert got["losses"] == pytest.approx(want["losses"], rel=1e-9, abs=1e-12), run.name
        assert got["time_breakdown"] == pytest.approx(want["time_breakdown"], rel=1e-9, abs=1e-12)
    page = (root / "docs" / "plan.md").read_text()
    shown = page.split(_published.BEGIN)[1].split(_published.END)[0].strip()
    assert shown == _published.render(records), (
        "python bench/plan.py published --retime (never edit the table)"
    )


def test_ops_are_timed_with_the_threads_the_jobs_processes_get():
    import torch

    from fpar.plan import _optime

    seen = []

    def op(x):
        seen.append(torch.get_num_threads())
        return x + 1

    before = torch.get_num_threads()
    timer = _optime.OpTimer(repeats=1, budget=0.0)
    timer.threads = 1
    assert timer._time(op, (torch.ones(2),), {}) is not None
    assert set(seen) == {1} and torch.get_num_threads() == before
    # on a mesh of several devices, a "this" estimate times with torchrun's one thread per process
    hw = plan.Hardware("cpu", {"float32": 1e9}, 2**30, 1e9, 8, 1e9, 1e-5, 1e9, 1e-5, timed_ops=True)
    mesh = plan.abstract_mesh((2,), ("data",))
    import fpar
    from fpar import P

    f = fpar.shard(lambda x: fpar.psum(x * 2, "data"), mesh, P("data"), P())
    plan.estimate(f, fpar.device_put(torch.ones(4), mesh, P("data")), hardware=hw)
    assert _optime.timer().threads == 1 and any(k[1] == 1 for k in _optime.timer().table)
    import dataclasses

    plan.estimate(
        f, fpar.device_put(torch.ones(4), mesh, P("data")), hardware=dataclasses.replace(hw, threads=2)
    )
    assert _optime.timer().threads == 2


def test_zero3_with_microbatches_is_planned_gathering_per_microbatch():
    """FSDP with gradient accumulation (once refused): each microbatch gathers the parameters for its
    forward and its backward and reduce-scatters its gradient (FSDP2's default, sharded accumulation);
    ``tests/plan/test_plan.py`` holds the same path exact against 2 gloo processes (``zero3_micro``)."""
    step, args = plan.model_step(GPT, plan.Layout(data=2, zero=3, microbatches=1, batch=4))
    one = plan.estimate(step, *args)
    step, args = plan.model_step(GPT, plan.Layout(data=2, zero=3, microbatches=2, batch=4))
    two = plan.estimate(step, *args)
    for op in ("all_gather", "psum_scatter"):
        assert two.comm["data"][op]["bytes"] == 2 * one.comm["data"][op]["bytes"], op


def test_zero3_plans_a_layer_at_a_time_not_the_model():
    """ZeRO-3 over leaves of their own (4 layers, ``plan_programs``' ``zero3_donate``): the planned
    peak holds the stored state (parameter, gradient and AdamW chunks: 16 bytes a parameter over
    2 devices) plus about one gathered layer (4 bytes a parameter of a quarter of the model), not
    the whole gathered model (4 bytes a parameter more).  ``tests/plan/test_plan.py`` holds the
    same program exact against 2 gloo processes."""
    step, args = PP.build("zero3_donate", PP.mesh_for("zero3_donate", "abstract"))
    est = plan.estimate(step, *args)
    n = PP.LAYERS * 2 * PP.D * PP.H  # parameters
    state = 16 * n // 2
    assert state < est.peak_bytes < state + 2 * n  # the whole model gathered: state + 4 n


@pytest.mark.parametrize("stage", [1, 2])
def test_zero1_and_2_donated_hold_the_papers_bytes_and_one_bucket(stage):
    """ZeRO stages 1 and 2 with AdamW, donated (4 layers of leaves of their own, a bucket a leaf;
    ``plan_programs``' ``zero1_donate`` / ``zero2_donate``): the planned peak holds the ZeRO paper's
    bytes a parameter with fp32 parameters and gradients (8 + 8/N and 4 + 12/N at N = 2) and about
    a bucket more, not a second copy of the gradients (stage 1 once kept every whole gradient
    through its update: 16.5 bytes a parameter where the paper says 12).  ``tests/plan/test_plan.py``
    holds the same programs exact against 2 gloo processes."""
    name = f"zero{stage}_donate"
    step, args = PP.build(name, PP.mesh_for(name, "abstract"))
    est = plan.estimate(step, *args)
    n = PP.LAYERS * 2 * PP.D * PP.H  # parameters
    paper = {1: 8 + 8 / 2, 2: 4 + 12 / 2}[stage] * n
    leaf = 4 * PP.D * PP.H  # a bucket's whole gradient (one leaf)
    assert paper < est.peak_bytes < paper + 3 * leaf, (est.peak_bytes / n, paper / n)


def test_fsdp_inside_a_pipeline_holds_one_gradient_sum_and_one_bucket():
    """ZeRO-3 inside a pipeline (``zero_pipeline``: a stage gathered in bfloat16 once a step, its
    gradients summed in float32 over 8 microbatches of 1F1B, reduce-scattered once): the planned
    peak of each stage holds the formula's bytes a parameter (bf16 stage 2, fp32 sum 4, fp32
    chunks of the parameters and AdamW 12/N) and about one bucket, not each microbatch's stacked
    gradient beside the sum (a chunk's layers' gradients and their stack: 2.5 more) nor zero
    chunks and copies at the reduce-scatter (1.6 more).  ``bench/pipeline_memory.py`` measures the
    same step on 4 gloo processes."""
    model = plan.Model("bench", 512, 8, 8, 8, 2048, 512, 16)
    layout = plan.Layout(pipeline=2, data=2, zero=3, microbatches=8, batch=16)
    est = plan.estimate(*_flat(plan.model_step(model, layout)))
    per_stage = (model.n_params - 2 * model.vocab * model.d_model) / 2
    bound = 2 + 4 + 12 / 2 + 25 * 2**20 / per_stage  # the formula and a 25 MiB bucket
    for c in est.devices:
        assert 12 < c.peak_bytes / per_stage < bound + 0.25, (c.coords, c.peak_bytes / per_stage, bound)


def _flat(step_args):
    step, args = step_args
    return (step, *args)


def _layer_activations(model, layout) -> tuple[float, float]:
    """One layer's bytes the forward leaves for the backward, less its bfloat16 weight copies, in
    units of ``s b h / t`` (``t`` the tensor size), with those copies' own share: the difference
    between 4 and 2 layers, as Korthikanti et al. count a layer."""
    saved, copies = [], []
    for layers in (2, 4):
        step, args = plan.model_step(dataclasses.replace(model, n_layers=layers), layout)
        c = plan.estimate(step, *args).devices[0]
        saved.append(c.saved_activations)
        copies.append(c.state_bytes["params"] / 2)  # float32 masters -> the bf16 copies matmuls keep
    unit = model.seq * layout.batch * model.d_model / layout.tensor
    return (saved[1] - saved[0]) / 2 / unit, (copies[1] - copies[0]) / 2 / unit


@pytest.mark.parametrize(
    "tensor, sp, remat, formula",
    [
        (1, False, False, 32.0),  # 34 s b h less the two dropout masks (fpar's GPT has none)
        (4, False, False, 8 * 4 + 24.0),  # tensor parallel: s b h (8 + 24/t)
        (4, True, False, 32.0),  # Megatron-SP: 32 s b h / t (the matmuls' inputs kept as blocks)
        (4, True, True, 2.0),  # full recomputation: the layer's input block
        (4, False, True, 2.0 * 4),  # ... the whole input without SP
        # save_dots: the input, q k v, attention's output, the first MLP matmul's output, and the
        # two row-parallel matmuls' outputs as their sums (16 + 6 t without SP, 22 with: the
        # reduce-scattered block, where the matmul's whole-sequence output made it 18 + 4 t)
        (1, False, "dots", 22.0),
        (4, False, "dots", 16 + 6 * 4.0),
        (4, True, "dots", 22.0),
    ],
)
def test_a_gpt_layer_keeps_korthikantis_activations(tensor, sp, remat, formula):
    """Activation memory per GPT layer (bf16, flash attention, no dropout) is Korthikanti et al.'s
    (2022) formula: 34 s b h / t with sequence parallelism, less 2 s b h / t of dropout masks.
    Sequence parallelism once kept each column-parallel matmul's gathered input (60 s b h / t at
    tensor 8).  Beside the formula: the statistics of two LayerNorms and attention's log-sum-exp
    (under 0.1), and the layer's bf16 weight copies (counted apart: issue 51's one copy a step)."""
    _check_layer("gpt-1.7b", dict(n_heads=8, n_kv_heads=8, d_ffn=4096), tensor, sp, remat, formula)


def _check_layer(name: str, shape: dict, tensor: int, sp: bool, remat: bool | str, formula: float) -> None:
    """One layer of ``name`` (d 1024, seq 1024, ``shape``) keeps ``formula`` s b h / t, and under 0.1 more."""
    model = dataclasses.replace(plan.MODELS[name], d_model=1024, seq=1024, vocab=4096, **shape)
    layout = plan.Layout(tensor=tensor, sequence_parallel=sp, remat=remat, batch=1, microbatches=1)
    act, copies = _layer_activations(model, layout)
    weights = 0.0 if remat else copies
    assert formula <= act - weights < formula + 0.1, (act, copies)


def _llama_layer(t: int, sp: bool) -> float:
    """Megatron-LM's Llama layer (fused RMSNorm and SwiGLU, flash attention) in ``s b h / t``: the
    norms' inputs, the matmuls' inputs, q, k and v (``g`` of the heads each), attention's output
    and SwiGLU's gate and up beside the down projection's input (``3 x 2 f``, ``f`` = ffn / h);
    without SP the four hidden-state tensors are the whole sequence (``t`` times a block).
    Attention's output is the output projection's input (a view: the kernel writes ``[b, s, h, d]``
    when the query is laid out so)."""
    g, f = 4 / 16, 2816 / 1024
    return 4 * 2 * (1 if sp else t) + 2 + 2 * 2 * g + 2 + 6 * f


@pytest.mark.parametrize(
    "tensor, sp, remat, formula",
    [
        (1, False, False, _llama_layer(1, False)),
        (4, False, False, _llama_layer(4, False)),
        (4, True, False, _llama_layer(4, True)),
        (4, True, True, 2.0),  # full recomputation: the layer's input block
    ],
)
def test_a_llama_layer_keeps_what_fused_kernels_keep(tensor, sp, remat, formula):
    """A Llama layer keeps Megatron-LM's activations with fused RMSNorm and SwiGLU (fpar.ops.rms_norm,
    fpar.ops.swiglu) and grouped-query flash attention: 29.5 s b h / t here at tensor 4 with SP,
    where float32 RMSNorm written out, silu's output and repeated keys and values kept 48.1 (96.1
    at tensor 4 without SP)."""
    _check_layer("llama-8b", dict(n_heads=16, n_kv_heads=4, d_ffn=2816), tensor, sp, remat, formula)
