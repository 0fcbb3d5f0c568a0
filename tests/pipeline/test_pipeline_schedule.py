"""Schedules as data: the builders meet the DESIGN §5 formulas, the validator names what is wrong.

Formulas (p stages, m microbatches, v chunks per stage), on the tick grid where every compute
action takes one tick:

| schedule | makespan (ticks) | bubble fraction | peak stash on stage s |
|---|---|---|---|
| GPipe | 2 (m + p - 1) | (p - 1)/(m + p - 1) | m |
| 1F1B | 2 (m + p - 1) | (p - 1)/(m + p - 1) | min(p - s, m) |
| interleaved 1F1B | 2 (v m + p - 1) | (p - 1)/(v m + p - 1) | min(2 (p - s - 1) + (v - 1) p + 1, v m) |
| ZB-H1 (m >= p) | 3 m + p - 1 | (p - 1)/(3 m + p - 1) | min(p, m) |

and with t_F = t_B = t_W = 1 (``simulate``), ZB-H1's bubble time is p - 1 against 1F1B's
3 (p - 1): a third.
"""

from __future__ import annotations

import dataclasses
import re
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fpar.pipeline as pp
from fpar.pipeline import Action, ScheduleError

# ----------------------------------------------------------------------------------------------
# Builders against the formulas


def _bubble(t: pp.Timeline) -> Fraction:
    return Fraction(sum(t.idle), len(t.busy) * t.makespan)


@settings(max_examples=60)
@given(p=st.integers(1, 6), m=st.integers(1, 12))
def test_gpipe_and_1f1b_formulas(p, m):
    for schedule, stash in [
        (pp.gpipe(p, m), [m] * p),
        (pp.one_f_one_b(p, m), [min(p - s, m) for s in range(p)]),
    ]:
        t = pp.timeline(schedule)
        assert t.makespan == 2 * (m + p - 1)
        assert t.busy == (2 * m,) * p
        assert _bubble(t) == Fraction(p - 1, m + p - 1)
        assert list(t.peak_stash) == stash
        assert pp.validate(schedule) is schedule


@settings(max_examples=60)
@given(p=st.integers(1, 5), groups=st.integers(1, 3), v=st.integers(2, 4))
def test_interleaved_formulas(p, groups, v):
    m = groups * p
    t = pp.timeline(pp.interleaved_1f1b(p, m, v))
    assert t.makespan == 2 * (v * m + p - 1)
    assert _bubble(t) == Fraction(p - 1, v * m + p - 1)
    assert list(t.peak_stash) == [min(2 * (p - s - 1) + (v - 1) * p + 1, v * m) for s in range(p)]
    # In stages' worth of activations (a chunk is 1/v of a stage): p + (p - 1)/v on stage 0.
    if v * m >= 2 * (p - 1) + (v - 1) * p + 1:
        assert Fraction(t.peak_stash[0], v) == p + Fraction(p - 1, v)


@settings(max_examples=60)
@given(p=st.integers(1, 6), extra=st.integers(0, 6))
def test_zb_h1_formulas(p, extra):
    m = p + extra
    zb, ofob = pp.zb_h1(p, m), pp.one_f_one_b(p, m)
    t = pp.timeline(zb)
    assert t.makespan == 3 * m + p - 1
    assert _bubble(t) == Fraction(p - 1, 3 * m + p - 1)
    assert t.peak_stash == (p,) * p  # <= p on every stage, like 1F1B's stage 0
    # Time-weighted, t_F = t_B = t_W: ZB-H1's bubble is a third of 1F1B's (arXiv:2401.10241 §3).
    bubble_zb = pp.simulate(zb).makespan - 3 * m
    bubble_1f1b = pp.simulate(ofob).makespan - 3 * m
    assert (bubble_zb, bubble_1f1b) == (p - 1, 3 * (p - 1))


@pytest.mark.parametrize("p,m", [(2, 1), (3, 2), (4, 3)])
def test_zb_h1_with_few_microbatches_stays_within_memory(p, m):
    assert max(pp.timeline(pp.zb_h1(p, m)).peak_stash) <= min(p, m)


@pytest.mark.parametrize("p,m,v", [(2, 2, 2), (3, 4, 2), (2, 3, 3)])
def test_looped_gpipe_bubble(p, m, v):
    t = pp.timeline(pp.gpipe(p, m, v))
    assert _bubble(t) == Fraction(p - 1, v * m + p - 1)
    assert t.peak_stash == (v * m,) * p


def test_interleaved_order_is_megatrons():
    """Microbatch groups of size p per chunk, chunks visited forward then in reverse for backward."""
    s = pp.interleaved_1f1b(2, 4, 2)
    order = [a.label(2) for a in s.compute_order(0)]
    assert order[:8] == ["F0a", "F1a", "F0b", "F1b", "F2a", "B0b", "F3a", "B1b"]
    assert [a.label(2) for a in s.compute_order(0) if a.kind == "BW"][:4] == ["B0b", "B1b", "B0a", "B1a"]


def test_simulate_durations():
    s = pp.one_f_one_b(3, 4)
    t = pp.simulate(s, f=1, b=2, w=0)  # backward twice the forward, the Megatron picture
    assert t.makespan == 3 * 4 + 2 * 3  # m (f + b) + (p - 1)(f + b)
    assert t.busy == (12, 12, 12)


def test_place_from_strings_and_tuples():
    s = pp.place([["F0", "F1", "BW0", "BW1"], [("F", 0), ("BW", 0), ("F", 1, 0), ("BW", 1, 0)]], m=2)
    assert pp.timeline(s).makespan == 6
    assert {a.kind for a in s.actions} == {"F", "BW", "SEND_F", "RECV_F", "SEND_B", "RECV_B"}


# ----------------------------------------------------------------------------------------------
# Errors: every message names the stage, the tick and the action


def _without(schedule, pred):
    return dataclasses.replace(schedule, actions=tuple(a for a in schedule.actions if not pred(a)))


def _moved(schedule, pred, dt):
    acts = tuple(dataclasses.replace(a, tick=a.tick + dt) if pred(a) else a for a in schedule.actions)
    return dataclasses.replace(schedule, actions=acts)


def _raises(schedule, *phrases):
    with pytest.raises(ScheduleError) as info:
        pp.validate(schedule)
    for phrase in phrases:
        assert phrase in str(info.value), f"{phrase!r} not in: {info.value}"
    return str(info.value)


def test_send_without_receive_is_a_deadlock():
    s = _without(pp.one_f_one_b(2, 2), lambda a: a.kind == "RECV_F" and a.microbatch == 1)
    _raises(s, "stage 0, tick 1, action SEND_F(microbatch=1, chunk=0)", "no matching receive", "deadlock")


def test_receive_without_send_is_a_deadlock():
    s = _without(pp.one_f_one_b(2, 2), lambda a: a.kind == "SEND_B" and a.microbatch == 0)
    _raises(
        s,
        "stage 0, tick 2, action RECV_B(microbatch=0, chunk=0)",
        "stage 1 sends nothing matching at tick 2",
        "waiting forever",
    )


def test_receive_at_another_tick_than_its_send():
    s = _moved(pp.one_f_one_b(2, 3), lambda a: a.kind == "RECV_F" and a.microbatch == 2, -1)
    _raises(s, "stage 1, tick 3, action RECV_F(microbatch=2, chunk=0)", "(it sends it at tick 4)", "deadlock")


def test_input_used_before_it_arrives():
    s = _moved(pp.gpipe(2, 2), lambda a: a.stage == 1 and a.kind == "F" and a.microbatch == 0, -1)
    _raises(s, "stage 1, tick 0, action F(microbatch=0, chunk=0)", "only received at tick 0")


def test_two_compute_actions_in_one_tick():
    s = _moved(pp.gpipe(1, 2), lambda a: a.kind == "F" and a.microbatch == 1, -1)
    _raises(s, "stage 0, tick 0", "already runs F(microbatch=0, chunk=0)")


def test_weight_gradient_before_input_gradient():
    s = pp.zb_h1(2, 2)
    w = next(a for a in s.actions if a.stage == 1 and a.kind == "W" and a.microbatch == 0)
    b = next(a for a in s.actions if a.stage == 1 and a.kind == "B" and a.microbatch == 0)
    swapped = tuple(
        dataclasses.replace(a, tick=b.tick)
        if a == w
        else dataclasses.replace(a, tick=w.tick)
        if a == b
        else a
        for a in s.actions
    )
    _raises(dataclasses.replace(s, actions=swapped), "stage 1", "action W(microbatch=0, chunk=0)", "before")


def test_missing_backward():
    s = _without(pp.gpipe(1, 2), lambda a: a.kind == "BW" and a.microbatch == 1)
    _raises(s, "stage 0, tick", "action BW(microbatch=1, chunk=0)", "never runs")


def test_stash_over_the_bound():
    s = dataclasses.replace(pp.gpipe(3, 4), stash_bound=(3, 2, 1))
    _raises(s, "stage 0, tick 3, action F(microbatch=3, chunk=0)", "stashes 4", "bound 3")


def test_send_past_the_last_stage():
    extra = (Action(5, 1, "SEND_F", 0, 0),)
    s = dataclasses.replace(pp.one_f_one_b(2, 2), actions=pp.one_f_one_b(2, 2).actions + extra)
    _raises(s, "stage 1, tick 5, action SEND_F(microbatch=0, chunk=0)", "nobody to send to")


def test_place_reports_a_deadlock_with_what_each_stage_waits_for():
    # Stage 0 runs microbatch 0's backward before microbatch 1's forward; stage 1 wants F1 first.
    with pytest.raises(ScheduleError) as info:
        pp.place([["F0", "BW0", "F1", "BW1"], ["F1", "F0", "BW0", "BW1"]], m=2)
    msg = str(info.value)
    assert "deadlock at tick 1" in msg
    assert "stage 0 waits to run BW(microbatch=0, chunk=0)" in msg and "gradient of microbatch 0" in msg
    assert "stage 1 waits to run F(microbatch=1, chunk=0)" in msg and "activation of microbatch 1" in msg


@pytest.mark.parametrize(
    "orders,phrase",
    [
        ([["F0", "BW0"], ["F0", "F0", "BW0"]], "stage 1, position 1, action F0: repeats"),
        ([["F0", "BW0"], ["F0"]], "stage 1: the order never runs BW (or B and W)"),
        ([["BW0", "F0"], ["F0", "BW0"]], "stage 0, position 0: the backward of microbatch 0"),
        ([["F0", "B0", "W0"], ["F0", "W0", "B0"]], "stage 1, position 1: W of microbatch 0"),
        ([["F0", "BW0"], ["F0", "X0"]], "stage 1, position 1: cannot read action 'X0'"),
        ([["F0", "BW0"], ["F0", "BW0", "SEND_F0"]], "cannot read action"),
    ],
)
def test_place_checks_orders(orders, phrase):
    with pytest.raises(ScheduleError, match=re.escape(phrase)):
        pp.place(orders, m=1)


def test_interleaved_needs_m_divisible_by_p_or_a_group():
    with pytest.raises(
        ScheduleError, match=r"m=5 is not divisible by the number of stages p=2.*Use m=6.*group=3 fits"
    ):
        pp.interleaved_1f1b(2, 5, 2)
    with pytest.raises(ScheduleError, match=r"m=7 is not divisible .* p=4.*group=7 fits"):
        pp.interleaved_1f1b(4, 7, 2)  # 7 % 4, 7 % 5, 7 % 6 are under 4: only one group of 7
    with pytest.raises(ScheduleError, match=r"m=1 is not divisible .* no group fits .* use m >= 2"):
        pp.interleaved_1f1b(2, 1, 2)
    with pytest.raises(ScheduleError, match="needs v >= 2"):
        pp.interleaved_1f1b(2, 4, 1)


@pytest.mark.parametrize(
    "p, m, group, phrase",
    [
        (2, 5, 1, r"group=1; a group is an int N with p=2 <= N <= m=5 .*: group=3 fits"),
        (2, 5, 6, r"group=6; a group is an int N with p=2 <= N <= m=5"),
        (2, 4, True, r"group=True; a group is an int"),
        (2, 4, 2.0, r"group=2.0; a group is an int"),
        (
            3,
            7,
            6,
            r"group=6 leaves a last group of 1 microbatches \(m=7\), fewer than the p=3 stages.*group=4 fits",
        ),
    ],
)
def test_interleaved_group_is_checked(p, m, group, phrase):
    with pytest.raises(ScheduleError, match=phrase):
        pp.interleaved_1f1b(p, m, 2, group)


def test_interleaved_groups_as_megatron_orders_them():
    # Megatron-LM's get_schedule_table docstring: PP2, N3, M5, VP2
    s = pp.interleaved_1f1b(2, 5, 2, group=3)
    forwards = [(a.microbatch, a.chunk) for a in s.stage_actions(0) if a.kind == "F"]
    assert [j for j, _ in forwards] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert [c for _, c in forwards] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    backwards = [(a.microbatch, a.chunk) for a in s.stage_actions(0) if a.kind == "BW"]
    assert backwards == [(j, 1 - c) for j, c in forwards]
    assert s.name == "interleaved 1F1B (v=2, N=3)"


@settings(max_examples=60)
@given(p=st.integers(1, 4), v=st.integers(2, 3), m_extra=st.integers(0, 9), data=st.data())
def test_interleaved_group_formulas(p, v, m_extra, data):
    m = p + m_extra
    fits = [n for n in range(p, m + 1) if m % n == 0 or m % n >= p]
    n = data.draw(st.sampled_from(fits))
    s = pp.interleaved_1f1b(p, m, v, group=n)
    t = pp.timeline(s)
    assert t.makespan == 2 * (v * m + p - 1)  # the bubble of N = p, whatever the group
    assert _bubble(t) == Fraction(p - 1, v * m + p - 1)
    assert list(t.peak_stash) == [min(2 * (p - s - 1) + (v - 1) * n + 1, v * m) for s in range(p)]
    if m % p == 0 and n == p:  # the default: Megatron's closed form, microbatches round in groups of p
        ks = range(v * m)
        expect = [((k // (p * v)) * p + k % p, (k // p) % v) for k in ks]
        assert [(a.microbatch, a.chunk) for a in s.stage_actions(0) if a.kind == "F"] == expect
        assert pp.interleaved_1f1b(p, m, v) == s


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_builders_check_sizes(bad):
    with pytest.raises(ScheduleError, match="must be a positive int"):
        pp.one_f_one_b(bad, 2)


def test_v_layout_places_two_chunks_per_stage_in_a_v():
    """ZB-V/DualPipeV: stage s holds virtual stages s and 2p-1-s; the turn stays on stage p-1."""
    from fpar.pipeline._schedule import locate, next_stage, virtual

    p = 3
    assert [virtual(s, c, p, 2, "v") for s in range(p) for c in range(2)] == [0, 5, 1, 4, 2, 3]
    assert all(locate(virtual(s, c, p, 2, "v"), p, 2, "v") == (s, c) for s in range(p) for c in range(2))
    assert next_stage(p - 1, 0, p, 2, "v") == (p - 1, 1)  # the turn stays on the last stage
    assert next_stage(0, 1, p, 2, "v") is None  # the loss is on stage 0
    stacked = {"w": torch.arange(2 * p)}
    assert pp.stage_major(stacked, p, 2, layout="v")["w"].tolist() == [0, 5, 1, 4, 2, 3]
    assert torch.equal(
        pp.model_major(pp.stage_major(stacked, p, 2, layout="v"), p, 2, layout="v")["w"], stacked["w"]
    )


def test_v_schedules_check_their_sizes():
    with pytest.raises(
        ScheduleError, match=r"DualPipeV needs at least 2 p = 4 microbatches.*Use m >= 4 or zb_v"
    ):
        pp.dualpipe_v(2, 3)
    with pytest.raises(ScheduleError, match=r"the 'v' layout has v=2 chunks per stage, got v=3"):
        pp.place([["F0", "F0.1", "F0.2", "BW0.2", "BW0.1", "BW0"]], m=1, v=3, layout="v")
    with pytest.raises(ScheduleError, match=r"layout must be one of \('interleaved', 'v'\), got 'w'"):
        pp.place([["F0", "BW0"]], m=1, layout="w")
