"""fpar.plan at scale: microbatches simulated once, the layouts published runs used, the time model."""

from __future__ import annotations

import pytest

import fpar.plan as plan
from fpar.plan import _repeat

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
    "schedule, virtual, model",
    [("1f1b", 1, SMALL), ("zb", 1, SMALL), ("1f1b", 2, GPT)],
    ids=["1f1b", "zb", "interleaved-gpt"],
)
def test_repeating_the_steady_microbatch_equals_simulating_every_one(schedule, virtual, model):
    # every microbatch runs the same program: a stage simulates the first few and the last, and
    # the steady one's ops and messages stand for the others; nothing an estimate reports moves
    layout = plan.Layout(
        pipeline=2, data=2, tensor=2, microbatches=6, batch=12, schedule=schedule, virtual=virtual
    )
    kept = [_repeat.kept_microbatches(_schedule(layout), s) for s in range(2)]
    assert all(k is not None and len(k) < 6 for k in kept), kept
    fast, full = _estimate(layout, model), _estimate(layout, model, repeat=False)
    assert [c.peak_bytes for c in fast.devices] == [c.peak_bytes for c in full.devices]
    assert [c.comm for c in fast.devices] == [c.comm for c in full.devices]
    assert [c.flops for c in fast.devices] == [c.flops for c in full.devices]
    assert fast.step_time == pytest.approx(full.step_time, rel=1e-12)
    for k in ("compute", "exposed_comm", "bubble"):
        assert fast.time_breakdown[k] == pytest.approx(full.time_breakdown[k], rel=1e-9, abs=1e-15)


def _schedule(layout):
    import fpar.pipeline as pp

    if layout.virtual > 1:
        return pp.interleaved_1f1b(layout.pipeline, layout.microbatches, layout.virtual)
    builders = {"1f1b": pp.one_f_one_b, "zb": pp.zb_h1, "gpipe": pp.gpipe}
    return builders[layout.schedule](layout.pipeline, layout.microbatches)


def test_the_kept_microbatches_reach_the_schedules_most_in_flight():
    import fpar.pipeline as pp

    sch = pp.one_f_one_b(4, 32)
    # 1F1B: stage s holds p - s microbatches at most; it simulates that many, one steady, the last
    assert [len(_repeat.kept_microbatches(sch, s)) for s in range(4)] == [6, 5, 4, 3]
    assert all(31 in _repeat.kept_microbatches(sch, s) for s in range(4))
    assert _repeat.kept_microbatches(pp.one_f_one_b(2, 3), 0) is None  # too few to save any
