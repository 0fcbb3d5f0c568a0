"""Real-mesh signature agreement without an extra message, and failure behaviour (2 gloo processes)."""

from __future__ import annotations

import dist_faults as D
import pytest
import torch

import fpar

pytestmark = pytest.mark.multiprocess

_RUN: list = []


def _results() -> list:
    if not _RUN:
        _RUN.append(fpar.launch(D.agreement_cases, 2, timeout=60.0))
    return _RUN[0]


def _reference():
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(3, 2, generator=gen, dtype=D.F64), torch.randn(4, 3, generator=gen, dtype=D.F64)
    loss = lambda w: ((x @ w) ** 2).mean()  # noqa: E731 - the unsharded function
    return w, x, loss(w), torch.func.grad(loss)(w)


def test_steady_state_sends_no_separate_agreement_message():
    """A warm DP step sends one 512-byte message: the check, the loss pmean and the gradient bucket."""
    _, x, _, g = _reference()
    wire = 8 * fpar._dist.agreement._WIRE0[1]
    for r, res in enumerate(_results()):
        torch.testing.assert_close(res["grad"], g)
        assert res["dp_sent"] == [wire], res["dp_sent"]
        # a function with no collective: the check goes alone, once, before returning
        assert res["local_sent"] == [wire], res["local_sent"]
        torch.testing.assert_close(res["local"], 2 * x[2 * r : 2 * r + 2])


def test_warm_dtype_mismatch_raises_on_every_rank():
    for res in _results():
        kind, msg = res["warm_dtype"]
        assert kind == "ValueError", msg
        assert "args[0] has a different dtype" in msg and "args[1] has a different dtype" in msg, msg
        assert "rank 0: torch.float64" in msg and "rank 1: torch.float32" in msg, msg


def test_warm_mismatch_with_a_held_bucket_raises_on_every_rank_and_drops_it():
    """Rank 1 is behind and calls with another dtype: rank 0's ready bucket rides in the call's
    first message with the check (its resend held, in case some rank's did not ride), then the
    check's error comes on every rank and the bucket is never sent again (the ranks stay in
    step: the later calls of ``agreement_cases`` match)."""
    res = _results()
    assert res[0]["held"] == 1, res[0]["held"]
    wire = 8 * fpar._dist.agreement._WIRE0[1]
    for r in res:
        assert r["held_sent"] == [wire], r["held_sent"]  # the first message only
    for r in res:
        kind, msg = r["warm_dtype_grad"]
        assert kind == "ValueError", msg
        assert "rank 0: torch.float64" in msg and "rank 1: torch.float32" in msg, msg
        torch.testing.assert_close(r["sync"], torch.full((2,), 2.0, dtype=D.F64))


def test_rank_raising_before_first_collective_is_named_not_waited_on():
    res = _results()
    assert res[1]["raised_before"] == ("ZeroDivisionError", "deliberate failure inside the function")
    kind, msg = res[0]["raised_before"]
    assert kind == "RuntimeError", msg
    assert "1 of the 2 ranks raised before this call's first collective (global rank 1)" in msg, msg
    _, _, loss, _ = _reference()
    for r in res:  # and the ranks stay in step afterwards
        torch.testing.assert_close(r["after_raise"], loss)
        torch.testing.assert_close(r["sync"], torch.full((2,), 2.0, dtype=D.F64))


def test_partly_carried_check_falls_back_to_the_plain_collective():
    _, _, loss, _ = _reference()
    res = _results()
    for r in res:
        torch.testing.assert_close(r["partial"], loss)
        torch.testing.assert_close(r["loss"], loss)
    wire = 8 * fpar._dist.agreement._WIRE0[1]
    assert res[0]["partial_sent"] == [wire, 8]  # carried, then the plain pmean again
    assert res[1]["partial_sent"] == [wire, 8]  # the check alone, then the pmean


def test_first_bucket_rides_in_the_first_message_and_goes_again_when_a_rank_read_early():
    """A small DP step makes one round trip: the signature check, the loss pmean and the gradient
    bucket in one all-reduce, once the wire has grown (after the first planned call).  A rank
    that reads its loss before the backward sends the check without the bucket; every rank then
    sends the bucket again, and the values stay right."""
    gen = torch.Generator().manual_seed(3)
    w, x = torch.randn(16, 8, generator=gen), torch.randn(6, 16, generator=gen)

    def reference(w):
        loss = lambda w: ((x.to(w.dtype) @ w) ** 2).mean()  # noqa: E731 - the unsharded function
        return loss(w), torch.func.grad(loss)(w)

    head = fpar._dist.agreement._HEAD
    room = 4 * (head + 1 + w.numel())  # float32: header, loss, the bucket (w's gradient)
    ref32, ref64 = reference(w), reference(w.double())
    for r, res in enumerate(fpar.launch(D.riding_cases, 2, timeout=60.0)):
        for loss, _, grad in [
            *res["first"],
            res["steady"],
            res["early"],
            res["after_early"],
            *res["f32_again"],
        ]:
            assert loss == pytest.approx(ref32[0].item(), rel=1e-6)
            torch.testing.assert_close(grad, ref32[1])
        for loss, _, grad in res["f64"]:
            assert loss == pytest.approx(ref64[0].item(), rel=1e-12)
            torch.testing.assert_close(grad, ref64[1])
        assert res["wire"] == ("torch.float32", room // 4)
        assert res["steady_sent"] == [room], res["steady_sent"]
        assert res["early"][1] == (pytest.approx(ref32[0].item(), rel=1e-6) if r == 0 else None)
        assert res["early_sent"] == [room, 4 * w.numel()], res["early_sent"]
        assert res["after_early_sent"] == [room], res["after_early_sent"]
        assert res["wire64"] == ("torch.float64", room // 4)  # the same elements, now float64
        assert res["wire_again"] == ("torch.float32", room // 4)
        # another sharded call between forward and backward: the first message went alone,
        # then the plan sends it in the forward (header and loss), its bucket on its own
        small = 4 * fpar._dist.agreement._WIRE0[1]
        first, second = res["interleaved_sent"]
        assert first == [room, room, 4 * w.numel()], first  # f alone; other (its psum rides); bucket
        assert second == [room, room, 4 * w.numel()], second
        for loss, total, grad in res["interleaved"]:
            assert loss == pytest.approx(ref32[0].item(), rel=1e-6)
            torch.testing.assert_close(total, torch.full((2,), 2.0))
            torch.testing.assert_close(grad, ref32[1])
        assert res["lone_sent"] == [room, 4 * w.numel()], res["lone_sent"]
        assert res["lone"][0] == pytest.approx(ref32[0].item(), rel=1e-6)
        torch.testing.assert_close(res["lone"][2], ref32[1])
        assert res["wire_after"] == ("torch.float32", small // 4)


def test_carried_sum_under_plain_autograd_has_no_function_and_right_second_order():
    """Under plain autograd a warm call's carried psum/pmean applies no custom Function either;
    ``.backward()`` gives the unsharded gradient, and differentiating the gradient with respect
    to the loss's cotangent (it goes through pvary, whose transpose is a psum over "data")
    gives the unsharded value too, not one device's share."""
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(3, 2, generator=gen, dtype=D.F64), torch.randn(4, 3, generator=gen, dtype=D.F64)
    u = torch.randn(3, 2, generator=gen, dtype=D.F64)
    for res in fpar.launch(D.carried_sum_plain_autograd, 2, timeout=60.0):
        for name, (_, plain) in D._carried_losses().items():
            if plain is None:
                continue
            got = res[name]
            assert got["functions"] == [], (name, got)
            assert got["lazy"] == ("Tensor" if name == "vector" else "Pending"), (name, got)
            want_grad, want = torch.func.grad_and_value(plain)(w, x)
            torch.testing.assert_close(got["value"], want)
            torch.testing.assert_close(got["grad"], want_grad)
            torch.testing.assert_close(got["dv"], (want_grad * u).sum())  # d/dv of v * dL/dw . u


def test_random_call_sequences_keep_every_rank_in_step_and_right():
    """Property over random schedules (fixed seeds): whatever mix of riding, early reads on some
    ranks, interleaved collectives, dtype switches and unfinished graphs, every rank finishes
    (gloo aborts on any mismatched message) and every loss and gradient equals the unsharded
    function's."""
    gen = torch.Generator().manual_seed(5)
    ws = {n: torch.randn(n, 4, generator=gen) for n in (8, 40)}
    xs = {n: torch.randn(6, n, generator=gen) for n in (8, 40)}
    seeds = [11, 12, 13]
    res = fpar.launch(D.random_schedules, 2, seeds, 24, timeout=120.0)
    for seed in seeds:
        assert len(res[0][seed]) == len(res[1][seed]) == 24
        for (n, dtype, loss, grad), (n1, _, loss1, grad1) in zip(res[0][seed], res[1][seed]):
            dt = getattr(torch, dtype.split(".")[1])
            w, x = ws[n].to(dt), xs[n].to(dt)
            plain = lambda w, x=x: ((x @ w) ** 2).mean()  # noqa: E731 - the unsharded function
            want_grad, want = torch.func.grad_and_value(plain)(w)
            tol = 1e-12 if dt == torch.float64 else 1e-5
            assert n == n1 and loss == loss1
            assert loss == pytest.approx(want.item(), rel=tol)
            if grad is not None:
                torch.testing.assert_close(grad, want_grad)
                torch.testing.assert_close(grad1, want_grad)


def test_repeated_launches_exit_cleanly():
    """Every rank exits with code 0 after delivering (launch checks the exit codes), every time."""
    results = [fpar.launch(D.dp_steps, 2, 3, timeout=60.0) for _ in range(3)]
    for res in results:
        assert res[0] == res[1] == results[0][0]


def test_planned_call_returns_before_the_other_ranks_arrive_and_its_loss_reads_right():
    """A warm DP call sends its loss pmean and check without waiting; every read waits for it."""
    w, x, loss, g = _reference()
    grad = lambda w: torch.func.grad(lambda w: ((x @ w) ** 2).mean())(w)  # noqa: E731
    for res in fpar.launch(D.pending_cases, 2, timeout=60.0):
        assert res["lazy"] == "Pending"
        torch.testing.assert_close(res["backward_grad"], g)
        reads = res["reads"]
        for k in ("item", "float", "numpy"):
            assert reads[k] == pytest.approx(loss.item(), rel=1e-12), k
        assert reads["tolist"] == pytest.approx(loss.item(), rel=1e-12)
        torch.testing.assert_close(reads["times_two"], 2 * loss)
        torch.testing.assert_close(reads["saved"], loss)
        assert type(reads["saved"]) is torch.Tensor
        assert reads["repr"] == repr(loss)
        assert reads["format"] == f"{loss.item():.6f}"
        torch.testing.assert_close(reads["deepcopy"], loss)
        torch.testing.assert_close(res["value"], loss)
        torch.testing.assert_close(res["grad"], g)
        # the reused gradient buffers
        assert res["held_intact"]
        torch.testing.assert_close(res["other"], grad(2 * w))
        assert res["reused"]
        torch.testing.assert_close(res["again"], g)
        torch.testing.assert_close(res["accumulated"], 2 * g)


def test_carried_sum_under_func_grad_has_plain_history_and_right_values():
    """Under ``torch.func.grad`` a warm call's carried psum/pmean applies no custom Function and
    comes back unsettled; values and gradients equal the unsharded function's (an inf loss too)."""
    _, x, _, _ = _reference()
    w = _reference()[0]
    for res in fpar.launch(D.carried_sum_under_grad, 2, timeout=60.0):
        for name, (_, plain) in D._carried_losses().items():
            got = res[name]
            # a sum the function goes on computing with was waited for inside the call
            assert got["functions"] == [], (name, got)
            assert got["lazy"] == ("Tensor" if name == "vector" else "Pending"), (name, got)
            if plain is None:  # the inf loss
                assert got["value"].item() == float("inf"), got["value"]
                continue
            want_grad, want = torch.func.grad_and_value(plain)(w, x)
            torch.testing.assert_close(got["value"], want)
            torch.testing.assert_close(got["grad"], want_grad)
