"""fpar.plan without processes: bad input, the in-process mesh's traffic, model states, search, CLI."""

from __future__ import annotations

import dataclasses
import re

import plan_programs as PP
import pytest
import torch

import fpar
import fpar.plan as plan
from fpar import P
from fpar.plan._search import _argument_bytes

# -- bad input: a clear error before any work --------------------------------------------------------


def _calls():
    calls = []

    def step(*args):
        calls.append(args)
        return args

    return step, calls


def test_unknown_hardware_is_refused_before_the_step_runs():
    step, calls = _calls()
    with pytest.raises(
        ValueError,
        match=r"unknown hardware 'h200x'; choose one of \['a100-80g', 'b200', 'h100-sxm', 'this'\]",
    ):
        plan.estimate(step, torch.zeros(2), hardware="h200x")
    assert calls == []


def test_a_mesh_larger_than_the_hardware_is_refused_before_any_op():
    small = dataclasses.replace(plan.PRESETS["h100-sxm"], nodes=1)
    mesh = plan.abstract_mesh((16,), ("data",))
    f = fpar.shard(lambda x: fpar.psum(x.sum(), "data"), mesh, P("data"), P())
    x = fpar.device_put(torch.empty(32, device="meta"), mesh, P("data"))
    with pytest.raises(
        ValueError, match=r"has 16 devices, but hardware 'h100-sxm' has 1 node\(s\) of 8 devices"
    ):
        plan.estimate(f, x, hardware=small)


def test_a_step_that_reads_a_value_names_the_read():
    mesh = plan.abstract_mesh((2,), ("data",))
    f = fpar.shard(lambda x: fpar.psum(x.sum(), "data"), mesh, P("data"), P())

    def step(x):
        loss = f(x)
        if loss.item() > 0:  # data-dependent control flow
            return loss
        return -loss

    with pytest.raises(plan.PlanError, match=r"reads a tensor's value \(\.item\(\), \.tolist\(\), bool\(t\)"):
        plan.estimate(step, fpar.device_put(torch.zeros(4), mesh, P("data")))


def test_a_step_on_no_abstract_mesh_is_refused():
    with pytest.raises(plan.PlanError, match="ran nothing on an abstract mesh"):
        plan.estimate(lambda x: x * 2, torch.zeros(3))


def test_a_layout_that_does_not_divide_names_the_dimension_and_axis():
    with pytest.raises(ValueError, match=r"does not divide tiny's n_kv_heads=2 by tensor=4"):
        plan.model_step("tiny", plan.Layout(tensor=4, batch=4))
    with pytest.raises(ValueError, match=r"unknown model 'llama-7'"):
        plan.model_step("llama-7", plan.Layout())
    mesh = plan.abstract_mesh((4,), ("data",))
    with pytest.raises(fpar.SpecError):  # a user's own layout: fpar's spec check, before any work
        fpar.device_put(torch.empty(6, device="meta"), mesh, P("data"))


@pytest.mark.parametrize("zero", [2, 3])
def test_microbatches_hold_one_sum_of_chunks_more_than_one_microbatch(zero):
    # Sharded accumulation (FSDP2's): each microbatch's reduced chunks are added into the step's sum
    # as they arrive, so 4 microbatches of 1 sequence peak at most the sum (Psi / N) over 1 of 1
    # sequence (once a second sum, the microbatch's whole chunks beside it: 2 Psi / N).
    peak, held = {}, {}
    for m in (1, 4):
        step, args = plan.model_step("tiny", plan.Layout(data=2, zero=zero, microbatches=m, batch=2 * m))
        est = plan.estimate(step, *args)
        peak[m], held[m] = est.peak_bytes, est.devices[0].state_bytes["params"]
    psi = 2 * held[1] if zero == 3 else held[1]  # float32, N = 2 (stage 3 stores chunks)
    assert peak[4] - peak[1] <= 1.01 * psi / 2, (peak, psi)


@pytest.mark.parametrize("zero", [2, 3])
def test_reduce_once_plans_one_reduce_scatter_a_step_and_at_most_a_whole_gradient_more(zero):
    est = {}
    for once in (False, True):
        layout = plan.Layout(data=2, zero=zero, microbatches=4, batch=8, reduce_once=once)
        step, args = plan.model_step("tiny", layout)
        est[once] = plan.estimate(step, *args)
    scatter = {once: e.comm["data"]["psum_scatter"] for once, e in est.items()}
    assert scatter[False]["bytes"] == 4 * scatter[True]["bytes"]  # 4 microbatches, each reduced
    assert scatter[True]["calls"] < scatter[False]["calls"]
    held = est[True].devices[0].state_bytes["params"]
    psi = 2 * held if zero == 3 else held  # one whole float32 gradient (stage 3 stores chunks, N = 2)
    assert est[True].devices[0].breakdown["grads"] <= psi  # the held sum, never a second one
    # ... and, at the final reduce-scatter, one bucket's concatenation (here the whole tiny model)
    assert est[True].peak_bytes - est[False].peak_bytes <= 2 * psi
    with pytest.raises(
        ValueError, match=r"reduce_once=True is for ZeRO 2 or 3 \(ZeRO 0 and 1 reduce.*zero=1"
    ):
        plan.model_step("tiny", plan.Layout(data=2, zero=1, microbatches=2, batch=4, reduce_once=True))
    with pytest.raises(ValueError, match=r"reduce_once=False is for ZeRO 2 or 3 .*pipeline=2 .*zero=1"):
        plan.model_step("tiny", plan.Layout(pipeline=2, zero=1, microbatches=2, batch=4, reduce_once=False))
    with pytest.raises(TypeError, match=r"reduce_once must be None, True or False, got 'yes'"):
        plan.model_step("tiny", plan.Layout(data=2, zero=zero, microbatches=2, batch=4, reduce_once="yes"))
    with pytest.raises(ValueError, match=r"reshard_after_forward=True is ZeRO-3 inside a pipeline .*data=2"):
        plan.model_step("tiny", plan.Layout(data=2, zero=3, batch=2, reshard_after_forward=True))
    with pytest.raises(ValueError, match=r"reshard_after_forward=True is ZeRO-3 inside a pipeline .*zero=2"):
        plan.model_step("tiny", plan.Layout(pipeline=2, zero=2, batch=2, reshard_after_forward=True))
    with pytest.raises(TypeError, match=r"reshard_after_forward must be True or False, got None"):
        plan.model_step("tiny", plan.Layout(pipeline=2, zero=3, batch=2, reshard_after_forward=None))


def test_zero_in_a_pipeline_reducing_each_chunk_plans_a_chunk_of_gradient_not_the_stage():
    """``Layout(pipeline>1, zero=3, reduce_once=False)``: each chunk's gradient reduced as its
    backward ends (``zero_pipeline(..., reduce_once=False)``).  Each microbatch's gradient goes out
    (up to m times the bytes of one reduce-scatter a step, at least one message per chunk and
    microbatch); what a stage holds of its gradient is its chunk of the sum (1/N) and the chunk in
    flight, not the whole stage's float32 sums.  ``reduce_once=True`` is the pipeline's default."""
    model = plan.Model("pipe-deep", 128, 8, 4, 4, 384, 256, 32)
    m, v = 4, 4
    est = {}
    for once in (None, True, False):
        layout = plan.Layout(
            pipeline=2, data=4, zero=3, microbatches=m, batch=16, virtual=v, reduce_once=once
        )
        step, args = plan.model_step(model, layout, dtype=torch.bfloat16)
        est[once] = plan.estimate(step, *args)
    assert est[True].peak_bytes == est[None].peak_bytes and est[True].comm == est[None].comm
    for a, b in zip(est[False].devices, est[None].devices):
        each, once = a.comm["data"]["psum_scatter"], b.comm["data"]["psum_scatter"]
        assert each["calls"] >= m * v > once["calls"], (a.coords, each, once)
        # each microbatch's sums go out, and only those a stage made (reduced once, every stage
        # also reduce-scatters zeros for the embedding or head it does not use)
        assert 0.9 * m * once["bytes"] <= each["bytes"] <= m * once["bytes"], (a.coords, each, once)
        # the gradient a stage holds at its peak: its chunk of the float32 sums (1/4) beside the one
        # chunk of the model being reduced (1/4 of the stage), not the stage's whole float32 sums
        # (the stage's float32 bytes: its float32 chunks over the 4 data ranks, 4 times over)
        held, whole = a.breakdown["grads"] + a.breakdown["comm_buffers"], 4 * a.state_bytes["params"]
        assert held <= 0.6 * whole, (a.coords, held, whole)


@pytest.mark.parametrize("virtual", [1, 2])
def test_zero3_in_a_pipeline_holds_the_papers_bytes_a_parameter_summing_once_a_step(virtual):
    """ZeRO-3 inside a pipeline, its gradients summed over the microbatches and reduce-scattered once
    a step (the default): the stage's bfloat16 weights, its float32 sums and its chunks of the
    float32 masters and AdamW's moments, 2 + 4 + 12/N bytes a parameter (N = 2), with parameters
    that dwarf the activations.  With several chunks a stage the chunks' sums are stacked a leaf
    at a time, each let go as its leaf is (stacking them all held the stage's sums twice, 16.0
    here), after the gathered stage is freed (held beside one stacked leaf's sum, 13.0 here), and
    each leaf's sum is freed as its bucket is reduce-scattered (12.6 with one chunk a stage before)."""
    model = plan.Model("wide", 1024, 4, 8, 8, 4096, 64, 8)
    layout = plan.Layout(pipeline=2, data=2, zero=3, microbatches=4, batch=8, virtual=virtual)
    step, args = plan.model_step(model, layout, dtype=torch.bfloat16)
    for d in plan.estimate(step, *args).devices:
        params = d.state_bytes["params"] * 2 / 4  # float32 chunks over N = 2
        bound = (2 + 4 + 12 / 2) * params
        assert d.peak_bytes <= 1.03 * bound, (d.coords, d.peak_bytes / params, bound / params)


def test_zero3_in_a_pipeline_resharded_after_forward_plans_two_chunks_of_weights_not_the_stage():
    """``Layout(reshard_after_forward=True)``: each of a stage's ``v`` chunks gathered for its own
    actions (``zero_pipeline``'s option).  A stage holds the running chunk's bfloat16 weights and
    the next one's, not all ``v``: 2 (v - 2) / v bytes a parameter fewer at the backward's peak
    (here v = 4: 1; each chunk's gradient reduced as it ends, so that the peak is the backward's),
    for at least a gather a chunk and microbatch; the gradients' messages are the same."""
    model = plan.Model("wide", 1024, 8, 8, 8, 4096, 64, 8)
    m, v = 4, 4
    est = {}
    for reshard in (False, True):
        layout = plan.Layout(
            pipeline=2,
            data=2,
            zero=3,
            microbatches=m,
            batch=8,
            virtual=v,
            reduce_once=False,
            reshard_after_forward=reshard,
        )
        step, args = plan.model_step(model, layout, dtype=torch.bfloat16)
        est[reshard] = plan.estimate(step, *args)
    for a, b in zip(est[True].devices, est[False].devices):
        params = b.state_bytes["params"] * 2 / 4  # float32 chunks over N = 2
        saved = (b.peak_bytes - a.peak_bytes) / params
        assert 0.9 * 2 * (v - 2) / v <= saved <= 1.1 * 2 * (v - 2) / v, (a.coords, saved)
        gathers = (a.comm["data"]["all_gather_invariant"], b.comm["data"]["all_gather_invariant"])
        assert gathers[0]["calls"] >= m * v > gathers[1]["calls"], (a.coords, gathers)
        assert a.comm["data"]["psum_scatter"] == b.comm["data"]["psum_scatter"]


@pytest.mark.parametrize("shape", [(0, 2), (2, -1), (2.0,)])
def test_abstract_mesh_sizes_must_be_positive_integers(shape):
    names = ("a", "b")[: len(shape)]
    with pytest.raises(ValueError, match="must be positive"):
        plan.abstract_mesh(shape, names)


def test_an_abstract_mesh_has_no_processes_but_set_up_code_runs_as_device_0():
    mesh = plan.abstract_mesh((4, 256), ("pipeline", "data"))
    assert mesh.size == 1024 and mesh.abstract and "abstract" in repr(mesh)
    params = fpar.init({"w": fpar.normal((1024, 64))}, mesh, {"w": P("data")})
    assert params["w"].shape == (4, 64) and params["w"].device.type == "meta"
    opt = fpar.optim.adamw(1e-3)
    layout = fpar.optim.zero_layout(params, mesh, {"w": P()}, stage=1, data_axis="data")
    _, state = fpar.optim.zero_init(opt, params, layout)  # a sharded call outside estimate: device 0
    assert all(
        t.device.type == "meta" for t in torch.utils._pytree.tree_leaves(state) if isinstance(t, torch.Tensor)
    )
    assert not torch.distributed.is_initialized()


# -- traffic: the in-process mesh counts the bytes the estimate predicts -------------------------------


def _bytes(comm: dict, mesh_shape: dict) -> dict:
    """Bytes per (axes without size-1 ones, collective): the same group however it is named."""
    out: dict = {}
    for axes, kinds in comm.items():
        key_axes = ",".join(a for a in axes.split(",") if mesh_shape.get(a, 2) > 1)
        for kind, v in kinds.items():
            if v["bytes"]:
                out[(key_axes, kind)] = out.get((key_axes, kind), 0) + v["bytes"]
    return out


@pytest.mark.parametrize("name", ["dp", "zero1", "zero2", "zero3", "tp", "sp"])
def test_estimated_bytes_equal_the_in_process_mesh(name):
    step, args = _built(name, "abstract")
    est = plan.estimate(step, *args)
    step, args = _built(name, "local")
    comm, _ = PP.steady(step, args, repeats=1)
    shape = dict(PP.mesh_for(name, "local").shape)
    assert [_bytes(c.comm, shape) for c in est.devices] == [_bytes(comm, shape)]


def _built(name, kind):
    mesh = PP.mesh_for(name, kind)
    return PP.build(name, mesh)


@pytest.mark.parametrize("kind", ["llama", "gpt"])
@pytest.mark.parametrize("reshard", [False, True])
def test_zero3_in_a_pipeline_gathers_the_embedding_and_the_head_only_on_the_stages_that_read_them(
    kind, reshard
):
    """ZeRO-3 inside a pipeline: the embedding is gathered by the first stage, the head by the last
    (and the embedding too where the head is tied to it, GPT), neither by a stage in between (each
    stage gathered both until 2026-12-03: 1 GiB of bfloat16 tables held all step on every stage of
    Llama 3 405B's 8,192-GPU layout)."""
    model = plan.Model("vocab", 64, 4, 4, 4, 256, 8192, 8, kind)
    layout = plan.Layout(pipeline=4, data=2, zero=3, microbatches=4, batch=8, reshard_after_forward=reshard)
    step, args = plan.model_step(model, layout, dtype=torch.bfloat16)
    gathered = [d.comm["data"]["all_gather_invariant"]["bytes"] for d in plan.estimate(step, *args).devices]
    table = model.vocab * model.d_model  # bytes a rank receives gathering a bfloat16 V x d table over 2
    assert gathered[1] == gathered[2], gathered
    for end in (gathered[0], gathered[3]):  # the table, and a norm or positions (under 1 %)
        assert table <= end - gathered[1] <= 1.01 * table, gathered


@pytest.mark.parametrize("kind", ["llama", "gpt"])
@pytest.mark.parametrize("zero", [2, 3])
def test_zero_in_a_pipeline_reduce_scatters_the_embedding_and_the_head_only_on_the_stages_that_read_them(
    kind, zero
):
    """ZeRO-2/3 inside a pipeline, gradients summed once a step: a stage reduce-scatters over its data
    group the gradient of the embedding and the head only where it read them (the embedding on the
    first stage, the head on the last: GPT's head is its embedding).  A stage in between sent a whole
    float32 zero block of each table until 2026-12-03, made for the purpose (4 bytes a parameter of
    both tables, held at the step's end)."""
    model = plan.Model("vocab", 64, 4, 4, 4, 256, 8192, 8, kind)
    layout = plan.Layout(pipeline=4, data=2, zero=zero, microbatches=4, batch=8)
    step, args = plan.model_step(model, layout, dtype=torch.bfloat16)
    sent = [d.comm["data"]["psum_scatter"]["bytes"] for d in plan.estimate(step, *args).devices]
    # bytes a rank sends reduce-scattering a float32 V x d table over 2
    table = 4 * model.vocab * model.d_model // 2
    assert sent[1] == sent[2], sent
    for end in (sent[0], sent[3]):  # one table each (GPT's head is its embedding), a norm or positions
        assert table <= end - sent[1] <= 1.01 * table, sent


# -- model states: exactly the sharded parameter count, and ZeRO's formulas ---------------------------


def _sharded_params(model: plan.Model, layout: plan.Layout) -> int:
    """Parameters one device of a (pipeline, data, tensor) layout holds (every stage holds the embedding
    and the head: they are replicated over the pipeline axis)."""
    t, p = layout.tensor, layout.pipeline
    hd = model.d_model // model.n_heads
    split = model.d_model * hd * (2 * model.n_heads + 2 * model.n_kv_heads) + 3 * model.d_model * model.d_ffn
    per_layer = split // t + 2 * model.d_model
    return model.n_layers // p * per_layer + 2 * model.vocab * model.d_model // t + model.d_model


@pytest.mark.parametrize("zero", [0, 1])
def test_llama_70b_state_bytes_equal_the_sharded_parameter_count(zero):
    # Llama-70B's dimensions with 4 layers (2 per stage), so the test stays quick; the layer count only scales
    model = dataclasses.replace(plan.MODELS["llama-70b"], n_layers=4, seq=256)
    layout = plan.Layout(pipeline=2, data=4, tensor=8, zero=zero, microbatches=2, batch=8)
    step, args = plan.model_step(model, layout)
    est = plan.estimate(step, *args)
    psi = _sharded_params(model, layout)
    n = layout.data
    for c in est.devices:
        assert c.state_bytes["params"] == 4 * psi  # float32 master weights, exactly
        adam = c.state_bytes["optimizer"]
        # AdamW's m and v in float32: 8 psi, or 8 psi / N under ZeRO-1 (chunks padded to N; a step count)
        want = 8 * psi if zero == 0 else 8 * psi / n
        assert abs(adam - want) <= 0.001 * want, (adam, want)
    assert sum(c.count for c in est.devices) == 64


@pytest.mark.parametrize("frozen_before", [False, True])
def test_an_estimate_leaves_the_cyclic_collector_as_it_found_it(frozen_before):
    # The simulation pauses the collector and freezes what was there before it (_collector_paused):
    # the collector's state, the frozen objects and the estimate itself come back unchanged, and a
    # caller's own frozen objects (fpar.launch freezes its processes') stay frozen.
    import gc

    model = plan.MODELS["tiny"]
    layout = plan.Layout(pipeline=2, data=2, tensor=1, zero=1, microbatches=2, batch=8)
    want = plan.estimate(*_flat(plan.model_step(model, layout)))
    if frozen_before:
        gc.freeze()
    try:
        count = gc.get_freeze_count()
        for enabled in (True, False):
            (gc.enable if enabled else gc.disable)()
            got = plan.estimate(*_flat(plan.model_step(model, layout)))
            assert gc.isenabled() is enabled
            if frozen_before:  # still frozen (some of them freed meanwhile, which leaves the count)
                assert gc.get_freeze_count() > count // 2
            else:
                assert gc.get_freeze_count() == 0
            assert (got.step_time, got.peak_bytes, got.comm) == (want.step_time, want.peak_bytes, want.comm)
    finally:
        gc.enable()
        gc.unfreeze()


def test_an_estimate_with_dynamos_trace_autograd_ops_on_equals_one_with_it_off():
    # What a user who compiles their step turns on (docs/compile.md). The first step of a
    # signature then runs the compiled step's form; in 2 microbatches it once ran it in the first
    # only, whose deferred gradients the last never claimed (a RuntimeError).
    import torch._dynamo

    model = plan.MODELS["tiny"]
    layout = plan.Layout(pipeline=1, data=2, tensor=2, zero=1, microbatches=2, batch=8)
    off = plan.estimate(*_flat(plan.model_step(model, layout)))
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        on = plan.estimate(*_flat(plan.model_step(model, layout)))
    # the same traffic; the compiled form's memory differs a little (torch.autograd keeps what
    # torch.func.grad frees)
    assert on.comm == off.comm and abs(on.peak_bytes - off.peak_bytes) <= 0.01 * off.peak_bytes


def _flat(step_args):
    step, args = step_args
    return (step, *args)


# -- search and the command line ------------------------------------------------------------------------


def test_search_ranks_the_layouts_that_fit_by_step_time():
    model = plan.MODELS["tiny"]
    results = plan.search(
        lambda layout: plan.model_step(model, layout),
        4,
        "h100-sxm",
        model=model,
        pipeline=[1, 2],
        tensor=[1, 2],
        zero=[1],
        batch=[8],
        microbatches=[2],
    )
    times = [est.step_time for _, est in results]
    assert len(results) == 4 and times == sorted(times)
    assert {(lay.pipeline, lay.tensor) for lay, _ in results} == {(1, 1), (1, 2), (2, 1), (2, 2)}
    table = plan.ranking(results)
    assert table.count("\n") == len(results)
    tiny_memory = dataclasses.replace(plan.PRESETS["h100-sxm"], memory_bytes=1)
    dropped = plan.search(
        lambda layout: plan.model_step(model, layout),
        4,
        tiny_memory,
        model=model,
        keep_dropped=True,
        pipeline=[1],
        tensor=[2],
        batch=[8],
        microbatches=[2],
    )
    assert [r.dropped.startswith("does not fit") for r in dropped] == [True] * len(dropped)
    # without keep_dropped, a search none of whose layouts fits is an error naming why (here each
    # one's arguments alone are over; test_search_with_no_layout_that_fits names the smallest peak)
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"fpar.plan.search: none of the {len(dropped)} layouts of 4 devices fits {tiny_memory.name}'s 0.0 GiB; "
            f"{dropped[0].layout.describe()} was dropped: {dropped[0].dropped}. keep_dropped=True returns"
        ),
    ):
        plan.search(
            lambda layout: plan.model_step(model, layout),
            4,
            tiny_memory,
            model=model,
            pipeline=[1],
            tensor=[2],
            batch=[8],
            microbatches=[2],
        )


def test_search_with_no_layout_that_fits_names_the_smallest_peak():
    # Memory above every layout's arguments and below every peak: each is estimated, none fits,
    # and the error names the layout whose peak comes closest.
    model = plan.MODELS["tiny"]
    build = lambda layout: plan.model_step(model, layout)  # noqa: E731
    choices = dict(pipeline=[1], tensor=[1, 2], zero=[1], batch=[8], microbatches=[2])
    every = plan.search(build, 4, "h100-sxm", model=model, keep_dropped=True, workers=1, **choices)
    floor = max(_argument_bytes(build(r.layout)[1]) for r in every)
    peaks = {r.layout.describe(): r.estimate.peak_bytes for r in every}
    assert floor < min(peaks.values())
    hw = dataclasses.replace(plan.PRESETS["h100-sxm"], memory_bytes=(floor + min(peaks.values())) // 2)
    smallest = min(peaks, key=peaks.get)
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"fpar.plan.search: none of the 2 layouts of 4 devices fits {hw.name}'s "
            f"{hw.memory_bytes / 2**30:.1f} GiB; the smallest peak is {smallest}'s, "
            f"{peaks[smallest] / 2**30:.1f} GiB. Widen the choices"
        ),
    ):
        plan.search(build, 4, hw, model=model, workers=1, **choices)


def test_search_drops_a_layout_whose_arguments_alone_exceed_memory_without_simulating_it():
    # A device holds its parameters and optimizer state all step: more than its memory cannot fit,
    # whatever the step does.  Memory between ZeRO-1's arguments and ZeRO-0's (AdamW's state
    # replicated): ZeRO-0 is dropped before its estimate, ZeRO-1 is estimated.
    model = plan.MODELS["tiny"]
    build = lambda layout: plan.model_step(model, layout)  # noqa: E731
    layouts = {z: plan.Layout(data=4, zero=z, batch=8, microbatches=2) for z in (0, 1)}
    held = {z: _argument_bytes(build(lay)[1]) for z, lay in layouts.items()}
    assert held[1] < held[0]
    hw = dataclasses.replace(plan.PRESETS["h100-sxm"], memory_bytes=(held[0] + held[1]) // 2)
    results = plan.search(
        build,
        4,
        hw,
        model=model,
        keep_dropped=True,
        workers=1,
        pipeline=[1],
        tensor=[1],
        zero=[0, 1],
        batch=[8],
        microbatches=[2],
    )
    by_zero = {r.layout.zero: r for r in results}
    assert by_zero[0].estimate is None
    assert by_zero[0].dropped == (
        f"does not fit: its arguments alone (parameters, optimizer state, batch) are "
        f"{held[0] / 2**30:.1f} GiB > {hw.memory_bytes / 2**30:.1f} GiB"
    )
    assert by_zero[1].estimate is not None
    # the simulation agrees: the dropped layout's peak is over the memory too
    assert plan.estimate(*_flat(build(layouts[0])), hardware=hw).peak_bytes > hw.memory_bytes


def test_search_in_forked_workers_equals_the_search_in_this_process():
    model = plan.MODELS["tiny"]
    choices = dict(
        model=model, keep_dropped=True, pipeline=[1, 2], tensor=[2], zero=[1], batch=[8], microbatches=[2]
    )
    serial = plan.search(lambda layout: plan.model_step(model, layout), 4, "h100-sxm", workers=1, **choices)
    forked = plan.search(lambda layout: plan.model_step(model, layout), 4, "h100-sxm", workers=2, **choices)
    assert [r.layout for r in forked] == [r.layout for r in serial] and len(serial) == 2
    for a, b in zip(serial, forked):
        assert (a.estimate.peak_bytes, a.estimate.step_time, a.estimate.comm) == (
            b.estimate.peak_bytes,
            b.estimate.step_time,
            b.estimate.comm,
        )
    assert "pipeline=" in plan.ranking(forked) and forked[0].estimate.mesh.abstract
    with pytest.raises(ValueError, match="workers must be a positive integer, got 0"):
        plan.search(lambda layout: plan.model_step(model, layout), 4, workers=0, **choices)


def test_command_line_prints_the_ranking(capsys):
    from fpar.plan.__main__ import main

    code = main(
        [
            "--model",
            "tiny",
            "--devices",
            "4",
            "--batch",
            "8",
            "--pipeline",
            "1,2",
            "--tensor",
            "2",
            "--zero",
            "1",
            "--microbatches",
            "2",
            "--remat",
            "no",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "2 layouts estimated" in out and "pipeline=2 data=1 tensor=2 zero=1" in out
    assert "the fastest layout in full" in out and "bytes sent per device per step" in out


def test_command_line_plans_interleaved_groups(capsys):
    # 3 microbatches on 2 stages: interleaving needs a group of 3 (Megatron-LM's
    # microbatch_group_size_per_vp_stage); the default group (the pipeline size) is skipped
    from fpar.plan.__main__ import main

    argv = "--model tiny --devices 2 --batch 6 --pipeline 2 --tensor 1 --zero 1 --microbatches 3"
    code = main([*argv.split(), "--virtual", "2", "--group", "3", "--remat", "no"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert (
        "1 layouts estimated" in out and "microbatches=3x2 remat=False schedule=1f1b virtual=2 group=3" in out
    )


def test_plot_draws_a_picture(tmp_path):
    pytest.importorskip("matplotlib")
    model = plan.MODELS["tiny"]
    step, args = plan.model_step(
        model, plan.Layout(pipeline=2, data=1, tensor=2, microbatches=2, batch=4, zero=0)
    )
    est = plan.estimate(step, *args)
    path = est.plot(str(tmp_path / "plan.png"))
    assert (tmp_path / "plan.png").stat().st_size > 10_000 and path.endswith("plan.png")
    text = str(est)
    assert "pipeline=0" in text and "pipeline=1" in text and "assumptions:" in text and "not seen" in text


def test_the_planning_example_runs(tmp_path, capsys):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    import plan_llama

    results = plan_llama.main(["--model", "tiny", "--devices", "8", "--plot", str(tmp_path / "p.png")])
    out = capsys.readouterr().out
    assert len(results) == 4 and (tmp_path / "p.png").exists()
    assert "ranking" not in out and "pipeline=2 data=2 tensor=2 zero=1" in out and "assumptions:" in out


def test_command_line_tiny_runs_on_its_defaults(capsys):
    """``python -m fpar.plan --model tiny`` alone (the wheel's smoke test) finds layouts: its defaults
    for ``tiny`` are a few devices its 4 layers and 2 kv heads divide (the cluster-sized defaults
    refused it: no layout of 1024 devices divides tiny)."""
    from fpar.plan.__main__ import main

    assert main(["--model", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "batch 8 sequences on 4 x h100-sxm" in out
    assert "layouts estimated" in out and "the fastest layout in full" in out
