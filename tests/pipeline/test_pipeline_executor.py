"""The executor: every schedule computes the unpipelined model's loss and gradients, and reports
what it ran, which must match DESIGN §5's formulas.

In-process (the real mesh is ``test_pipeline_dist.py``), float64, with an embedding on the first
stage and a head + loss on the last: hypothesis over schedules and (p, m, v) on a pure pipeline,
and a sample with tensor and data parallelism inside the stages.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import pipe_models as M
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fpar
import fpar.pipeline as pp
from fpar import P


def _run(mesh, name, p, m, v, *, seed=0, schedule=None, group=None):
    prob = M.problem(p, m, v, seed=seed)
    fns = M.stage_fns(mesh)
    sch = schedule if schedule is not None else M.schedule(name, p, m, v, group)
    step = pp.pipeline(fns["stage"], sch, mesh, loss=fns["loss"], first=fns["first"])
    stages = pp.stage_major(prob["stages"], p, v, layout=sch.layout)
    params = {"stages": stages, "first": prob["first"], "last": prob["last"]}
    return prob, sch, step(params, prob["xs"], prob["ts"])


def _check_values(prob, res, p, v, layout="interleaved"):
    loss, g_stages, g_first, g_last = M.reference_grads(prob)
    torch.testing.assert_close(res.loss, loss)
    torch.testing.assert_close(res.grads["stages"], pp.stage_major(g_stages, p, v, layout=layout))
    torch.testing.assert_close(res.grads["first"], g_first)
    torch.testing.assert_close(res.grads["last"], g_last)


def _expected_stash(name, p, m, v, group=None):
    if name == "gpipe":
        return [v * m] * p
    if name == "1f1b":
        return [min(p - s, m) for s in range(p)]
    if name == "interleaved":
        n = p if group is None else group  # Megatron's microbatches a group
        return [min(2 * (p - s - 1) + (v - 1) * n + 1, v * m) for s in range(p)]
    if name == "zb_v":
        return [2 * p] * p  # m >= 2p: p stage-microbatches, 1F1B's first stage
    if name == "dualpipe_v":
        return [2 * p + 1] * p
    return [min(p, m)] * p  # zb_h1


def _expected_makespan(name, p, m, v):
    if name == "zb_h1":
        return 3 * m + p - 1
    if name == "zb_v":
        return 6 * m + p - 1  # m >= 2p - 1
    if name == "dualpipe_v":
        return 4 * m + 2 * p - 1  # m >= 2p; pairs F with a fused BW, so fewer, longer ticks
    return 2 * (v * m + p - 1)


def _expected_bubble(name, p, m, v):
    if name == "zb_h1":
        return Fraction(p - 1, 3 * m + p - 1)
    if name == "zb_v":
        return Fraction(p - 1, 6 * m + p - 1)
    return Fraction(p - 1, v * m + p - 1)


def _check_measured(name, sch, stats, p, m, v, group=None):
    """What the executor ran (its own counts, its live stash) against the formulas."""
    assert list(stats.peak_stash) == _expected_stash(name, p, m, v, group)
    assert stats.makespan == sch.num_ticks == _expected_makespan(name, p, m, v)
    if name != "dualpipe_v":  # DualPipeV mixes fused and split backwards: busy differs per stage
        per_mb = 3 if name in ("zb_h1", "zb_v") else 2  # F + B + W, or F + BW
        assert stats.busy == (per_mb * v * m,) * p
        bubble = _expected_bubble(name, p, m, v)
        assert Fraction(sum(stats.idle), p * stats.makespan) == bubble
        assert stats.bubble_fraction == pytest.approx(float(bubble))
    assert len(stats.compute_s) == p and stats.wall_s > 0


@st.composite
def _cases(draw):
    name = draw(st.sampled_from(["gpipe", "1f1b", "interleaved", "zb_h1", "zb_v", "dualpipe_v"]))
    p = draw(st.integers(1, 3))
    v = draw(st.integers(2, 3)) if name == "interleaved" else (2 if name in ("zb_v", "dualpipe_v") else 1)
    group = None
    if name == "interleaved":
        m = p * draw(st.integers(1, 2)) + draw(st.sampled_from([0, 0, 1, p + 1]))
        fits = [n for n in range(p, m + 1) if m % n == 0 or m % n >= p]  # Megatron's rule
        group = draw(st.sampled_from(fits)) if m % p or draw(st.booleans()) else None
    elif name == "zb_h1":
        m = p + draw(st.integers(0, 2))  # the ZB-H1 bubble formula holds for m >= p
    elif name in ("zb_v", "dualpipe_v"):
        m = 2 * p + draw(st.integers(0, 2))  # the V schedules' formulas hold for m >= 2p
    else:
        m = draw(st.integers(1, 4))
    return name, p, m, v, group, draw(st.integers(0, 9))


@settings(max_examples=30, deadline=None)
@given(case=_cases())
def test_every_schedule_equals_the_unpipelined_model(case):
    name, p, m, v, group, seed = case
    prob, sch, res = _run(fpar.make_mesh((p,), ("pipe",)), name, p, m, v, seed=seed, group=group)
    _check_values(prob, res, p, v, sch.layout)
    _check_measured(name, sch, res.stats, p, m, v, group)


@pytest.mark.parametrize(
    "axes,name,m,v",
    [
        ((("pipe", 2), ("tensor", 2)), "1f1b", 3, 1),
        ((("pipe", 2), ("tensor", 2)), "interleaved", 2, 2),
        ((("pipe", 2), ("tensor", 2)), "zb_h1", 2, 1),
        ((("pipe", 2), ("data", 2), ("tensor", 2)), "gpipe", 2, 1),
        ((("pipe", 2), ("data", 2), ("tensor", 2)), "interleaved", 2, 2),
        ((("pipe", 2), ("data", 2)), "interleaved", 5, 2),  # groups of 3, then 2 (Megatron's N=3)
        ((("pipe", 2), ("data", 2), ("tensor", 2)), "zb_v", 4, 2),
        ((("pipe", 2), ("tensor", 2)), "dualpipe_v", 4, 2),
    ],
    ids=lambda x: "x".join(f"{n}{s}" for n, s in x) if isinstance(x, tuple) else str(x),
)
def test_with_tensor_and_data_parallel_stages(axes, name, m, v):
    mesh = fpar.make_mesh(tuple(s for _, s in axes), tuple(n for n, _ in axes))
    group = 3 if name == "interleaved" and m % 2 else None
    prob, sch, res = _run(mesh, name, 2, m, v, group=group)
    _check_values(prob, res, 2, v, sch.layout)
    _check_measured(name, sch, res.stats, 2, m, v, group)


def test_hand_written_schedule_with_a_late_send():
    """A placed schedule whose first message is sent one tick after it is computed still runs."""
    base = pp.one_f_one_b(2, 2)
    late = {("SEND_F", 0, 1), ("RECV_F", 1, 1)}
    moved = []
    for a in base.actions:
        key = (a.kind, a.stage, a.microbatch)
        shift = 1 if key in late or a.tick >= 2 else 0  # tick 2 now only carries the late message
        moved.append(dataclasses.replace(a, tick=a.tick + shift))
    sch = pp.validate(dataclasses.replace(base, actions=tuple(moved), name="late"))
    prob, _, res = _run(fpar.make_mesh((2,), ("pipe",)), None, 2, 2, 1, schedule=sch)
    _check_values(prob, res, 2, 1)
    assert res.stats.peak_inbox == (1, 1)


def test_custom_split_backward_schedule():
    """A hand-ordered schedule that splits every backward and runs all Ws at the end."""
    orders = [
        ["F0", "F1", "B0", "B1", "W0", "W1"],
        ["F0", "B0", "F1", "B1", "W1", "W0"],
    ]
    sch = pp.place(orders, m=2, name="late W")
    prob, _, res = _run(fpar.make_mesh((2,), ("pipe",)), None, 2, 2, 1, schedule=sch)
    _check_values(prob, res, 2, 1)
    assert res.stats.peak_stash == (2, 2)


def test_step_without_first_and_last():
    mesh = fpar.make_mesh((2,), ("pipe",))
    prob = M.problem(2, 3, 1)
    fns = M.make_fns()
    step = pp.pipeline(fns["stage"], pp.one_f_one_b(2, 3), mesh, loss=lambda w, h, t: (h**2).mean())
    h = prob["first"]["emb"][prob["xs"]]
    res = step({"stages": prob["stages"]}, h, None)

    def ref(stages):
        total = 0.0
        for j in range(3):
            x = h[j]
            for k in range(2):
                x = fns["stage"]({"a": stages["a"][k], "b": stages["b"][k]}, x)
            total = total + (x**2).mean()
        return total / 3

    torch.testing.assert_close(res.loss, ref(prob["stages"]))
    torch.testing.assert_close(res.grads["stages"], torch.func.grad(ref)(prob["stages"]))
    assert set(res.grads) == {"stages"}


def test_each_chunk_can_run_its_own_function():
    # interleaved 2 x 2: chunk 0 (beside the embedding) and chunk 3 (beside the head) compute
    # less than the middle chunks, as uneven stages do; chunk 0 uses none of its parameters
    p, m, v = 2, 4, 2
    mesh = fpar.make_mesh((p,), ("pipe",))
    prob = M.problem(p, m, v)
    fns = M.make_fns()
    block = fns["stage"]
    chunks = [lambda w, h: h, block, block, lambda w, h: h + torch.tanh(h @ w["a"]) @ w["b"] * 0.5]
    step = pp.pipeline(chunks, pp.interleaved_1f1b(p, m, v), mesh, loss=fns["loss"], first=fns["first"])
    params = {"stages": pp.stage_major(prob["stages"], p, v), "first": prob["first"], "last": prob["last"]}
    res = step(params, prob["xs"], prob["ts"])

    def ref(stages, first, last):
        total = 0.0
        for j in range(m):
            x = fns["first"](first, prob["xs"][j])
            for k in range(p * v):
                x = chunks[k]({"a": stages["a"][k], "b": stages["b"][k]}, x)
            total = total + fns["loss"](last, x, prob["ts"][j])
        return total / m

    args = (prob["stages"], prob["first"], prob["last"])
    torch.testing.assert_close(res.loss, ref(*args))
    grads = torch.func.grad(ref, argnums=(0, 1, 2))(*args)
    torch.testing.assert_close(pp.model_major(res.grads["stages"], p, v), grads[0])
    torch.testing.assert_close(res.grads["first"], grads[1])
    torch.testing.assert_close(res.grads["last"], grads[2])
    assert not pp.model_major(res.grads["stages"], p, v)["a"][0].any()  # chunk 0's: zeros


@pytest.mark.parametrize(
    "stage, got",
    [
        ([lambda w, h: h] * 3, "a list of 3"),
        ([lambda w, h: h, None], "a list of 2 with a non-callable"),
        (7, "a int"),
    ],
)
def test_a_list_of_chunk_functions_must_have_one_per_chunk(stage, got):
    with pytest.raises(TypeError) as info:
        pp.pipeline(
            stage, pp.one_f_one_b(2, 2), fpar.make_mesh((2,), ("pipe",)), loss=lambda w, h, t: h.sum()
        )
    assert "a list of p * v = 2 functions (chunk k's at k, in model order), got " + got in str(info.value)


# ----------------------------------------------------------------------------------------------
# Errors


def _step(p=2, m=2, mesh=None):
    mesh = mesh if mesh is not None else fpar.make_mesh((p,), ("pipe",))
    fns = M.make_fns()
    return pp.pipeline(fns["stage"], pp.one_f_one_b(p, m), mesh, loss=fns["loss"], first=fns["first"])


def test_mesh_must_match_the_schedule():
    with pytest.raises(ValueError, match=r"p=2 stages but mesh axis 'pipe' has size 3"):
        _step(mesh=fpar.make_mesh((3,), ("pipe",)))
    with pytest.raises(ValueError, match=r"'pipe' is not an axis of the mesh"):
        _step(mesh=fpar.make_mesh((2,), ("stages",)))


def test_invalid_schedule_is_rejected_before_running():
    bad = dataclasses.replace(pp.gpipe(2, 2), stash_bound=(1, 1))
    with pytest.raises(pp.ScheduleError, match=r"stage 0, tick 1, action F\(microbatch=1, chunk=0\)"):
        pp.pipeline(lambda w, h: h, bad, fpar.make_mesh((2,), ("pipe",)), loss=lambda w, h, t: h.sum())


@pytest.mark.parametrize(
    "params,xs,phrase",
    [
        ({"first": {}}, torch.zeros(2, 4, dtype=torch.long), "must be a dict with key 'stages'"),
        ({"stages": {"a": torch.zeros(3, 4, 8)}}, torch.zeros(2, 4, dtype=torch.long), "p * v = 2 chunks"),
        ({"stages": {"a": torch.zeros(2, 4, 8)}, "head": {}}, torch.zeros(2, 4), "unknown keys ['head']"),
        ({"stages": {"a": torch.zeros(2, 4, 8)}}, torch.zeros(3, 4), "xs must be the 2 microbatches"),
    ],
)
def test_step_checks_its_arguments(params, xs, phrase):
    with pytest.raises((TypeError, ValueError)) as info:
        _step()(params, xs, torch.zeros(2, 4, 3))
    assert phrase in str(info.value)


def test_a_stage_that_raises_is_named():
    def stage(w, h):
        if h.shape[0] and bool((h == 2.0).any()):  # microbatch 1 only
            raise RuntimeError("bad activation")
        return h * w["a"][0]

    step = pp.pipeline(
        stage, pp.one_f_one_b(2, 2), fpar.make_mesh((2,), ("pipe",)), loss=lambda w, h, t: h.sum()
    )
    xs = torch.tensor([[1.0], [2.0]])
    with pytest.raises(RuntimeError, match="bad activation") as info:
        step({"stages": {"a": torch.ones(2, 1)}}, xs, None)
    assert "raised on pipeline stage 0 running F of microbatch 1, chunk 0" in "".join(info.value.__notes__)


def test_stats_table_is_readable():
    _, _, res = _run(fpar.make_mesh((2,), ("pipe",)), "1f1b", 2, 2, 1)
    table = res.stats.table()
    assert table.splitlines()[0].startswith("1F1B: makespan 6, bubble 0.3333")
    assert "peak_stash" in table and "compute_s" in table


def test_shard_stage_spec_sanity():
    """The stacked-parameter specs the tests use split chunks over pipe, columns/rows over tensor."""
    mesh = fpar.make_mesh((2, 2), ("pipe", "tensor"))
    assert M.stage_spec(mesh) == {"a": P("pipe", None, "tensor"), "b": P("pipe", "tensor", None)}


def test_split_backward_defers_the_weight_matmuls():
    """B leaves the linear layers' weight gradients to W, which computes them from (x, dy) alone."""
    from fpar.pipeline._split import capture, weight_grads

    g = torch.Generator().manual_seed(0)
    w1 = torch.randn(5, 4, dtype=torch.float64, generator=g, requires_grad=True)  # F.linear (out, in)
    b1 = torch.randn(5, dtype=torch.float64, generator=g, requires_grad=True)
    w2 = torch.randn(1, 5, 3, dtype=torch.float64, generator=g, requires_grad=True)  # used as w2[0]
    scale = torch.randn(3, dtype=torch.float64, generator=g, requires_grad=True)  # not a matmul
    x = torch.randn(2, 6, 4, dtype=torch.float64, generator=g, requires_grad=True)

    def f(x):
        h = torch.tanh(torch.nn.functional.linear(x, w1, b1))
        return (h @ w2.reshape(5, 3)) * scale

    dy = torch.randn(2, 6, 3, dtype=torch.float64, generator=g)
    want = torch.autograd.grad(f(x), (x, w1, b1, w2, scale), dy)
    records: list = []
    with capture([w1, b1, w2, scale], records):
        y = f(x)
    torch.autograd.backward(y, dy, inputs=[x, w1, b1, w2, scale])  # B
    assert [r.kind for r in records] == ["matmul", "linear"]
    assert w1.grad is None and b1.grad is None and w2.grad is None  # left to W
    torch.testing.assert_close(x.grad, want[0])
    torch.testing.assert_close(scale.grad, want[4])  # not a linear weight: computed in B
    into: dict = {}
    weight_grads(records, into)  # W
    for leaf, expected in ((w1, want[1]), (b1, want[2]), (w2, want[3])):
        torch.testing.assert_close(into[id(leaf)], expected)


def test_split_backward_leaves_a_weight_seen_through_a_function_to_b():
    """A weight viewed by another autograd Function (a real mesh's all-reduce) is not deferred.

    Its gradient must pass through that Function's backward (here: doubled), which a deferred
    ``dy^T x`` would skip; a plain reshape of the leaf is still deferred.
    """
    from fpar.pipeline._split import capture, weight_grads

    class Doubled(torch.autograd.Function):  # identity forward, returns a view, doubles the cotangent
        @staticmethod
        def forward(w):
            return w.view_as(w)

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, g):
            return 2 * g

    g = torch.Generator().manual_seed(1)
    w = torch.randn(3, 4, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(4, 2, dtype=torch.float64, generator=g, requires_grad=True)
    x = torch.randn(5, 3, dtype=torch.float64, generator=g)
    dy = torch.randn(5, 2, dtype=torch.float64, generator=g)
    records: list = []
    with capture([w, v], records):
        y = x @ Doubled.apply(w) @ v.view(4, 2)
    torch.autograd.backward(y, dy, inputs=[w, v])
    assert [r.weight for r in records] == [v]  # only the plain view is deferred
    into: dict = {}
    weight_grads(records, into)
    want_w, want_v = torch.autograd.grad(x @ w @ v, (w, v), dy)
    torch.testing.assert_close(w.grad, 2 * want_w)
    torch.testing.assert_close(into[id(v)], want_v)


def test_split_backward_of_a_module_stage():
    """ZB-H1 on nn.Linear stages (torch.func.functional_call) equals the unpipelined gradient."""
    torch.manual_seed(0)
    mods = [
        torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 4)) for _ in range(2)
    ]
    mods = [mod.double() for mod in mods]
    template = mods[0]
    stacked = {
        k: torch.stack([dict(mod.named_parameters())[k].detach() for mod in mods])
        for k, _ in template.named_parameters()
    }
    xs = torch.randn(3, 5, 4, dtype=torch.float64)

    def stage(w, h):
        return torch.func.functional_call(template, w, (h,))

    step = pp.pipeline(
        stage, pp.zb_h1(2, 3), fpar.make_mesh((2,), ("pipe",)), loss=lambda w, h, t: (h**2).mean()
    )
    res = step({"stages": stacked}, xs, None)

    def ref(stacked):
        total = 0.0
        for j in range(3):
            h = xs[j]
            for k in range(2):
                h = stage({n: t[k] for n, t in stacked.items()}, h)
            total = total + (h**2).mean()
        return total / 3

    torch.testing.assert_close(res.loss, ref(stacked))
    torch.testing.assert_close(res.grads["stages"], torch.func.grad(ref)(stacked))
