"""``fpar.defer_reduction`` and deferred gradient reduction in ``fpar.optim.accumulate``.

On a real mesh (one launch of 2 gloo processes): accumulating 4 microbatches gives the same
gradients as reducing every microbatch and as the unsharded model, with exactly one all-reduce
per gradient bucket per step (counted as issued by ``fpar.comm_stats``), through
``torch.func.grad`` and ``.backward()``, and a step whose calls trace (a signature's first) is
bitwise the steady steps; each misuse raises a clear error and leaves the state
clean.  In-process the context changes nothing.
"""

from __future__ import annotations

import defer_workers as W
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fpar
from fpar import P


def _close(got: dict, expected: dict) -> None:
    for k in expected:
        torch.testing.assert_close(
            got[k], expected[k], rtol=1e-12, atol=1e-12, msg=lambda m, k=k: f"{k}: {m}"
        )


def test_in_process_mesh_is_unchanged():
    mesh = fpar.make_mesh((2,), ("data",))
    prob = W.problem()
    f = fpar.shard(W.mlp_loss, mesh, (P(), P("data"), P("data")), P())

    def grad_fn(p, batch):
        return torch.func.grad_and_value(f)(p, *batch)

    acc = fpar.optim.accumulate(grad_fn, W.N_MICRO, mesh, (P("data"), P("data")))
    g, _ = acc(prob["params"], (prob["x"], prob["y"]))
    _close(g, W.unsharded_grad(prob))
    with fpar.defer_reduction():  # no messages in-process: gradients as without the context
        inside = torch.func.grad(f)(prob["params"], prob["x"], prob["y"])
    _close(inside, W.unsharded_grad(prob))


@pytest.fixture(scope="module")
def launched():
    return fpar.launch(W.run, 2, ["accumulate_job", "misuse_job", "reuse_job"], timeout=90.0)


@pytest.mark.multiprocess
def test_accumulate_reduces_once_per_bucket_per_step(launched):
    prob = W.problem()
    expected = W.unsharded_grad(prob)
    param_bytes = sum(t.numel() * t.element_size() for t in prob["params"].values())
    for rank, (acc, *_) in enumerate(launched):
        for step in acc["steps"]:
            _close(step["grads"], expected)
        # warm steps: accumulate's torch.func.grad is lowered to plain autograd inside the call
        # (fpar/_dist/lowered.py), where each deferred microbatch defers each of its 2 buckets with
        # one _Defer Function, as .backward() does (tens of us there; ~0.4 ms each under functorch,
        # whose own path is tensor hooks)
        deferred = [0, 1] * (W.N_MICRO - 1)
        assert [step["functions"] for step in acc["steps"][1:]] == [deferred, deferred], acc["steps"]
        # the step whose calls traced (each signature's first) is bitwise the warm steps, in both
        # forms: accumulate's torch.func.grad and .backward() with the context by hand
        for k in expected:
            assert torch.equal(acc["steps"][0]["grads"][k], acc["steps"][1]["grads"][k]), (rank, k)
            first, warm = (s[k] for s in acc["first_steps"])
            assert torch.equal(first, warm), (rank, k)
            _close({k: first / W.N_MICRO}, {k: expected[k]})
        for got in acc["unused"]:  # a parameter only an ignored output uses: zero, the others exact
            assert torch.equal(got.pop("u"), torch.zeros(5, dtype=torch.float64))
            _close(got, expected)
        _close(acc["plain"], expected)
        _close(acc["backward"], expected)
        assert all(g is None for g in acc["after_deferred"].values()), "deferred calls gave a gradient"
        assert acc["direct_zeros_writable"] and acc["returned_writable"]
        # microbatches 0 and 1 of each rank's block of rows: the mean loss over those rows
        block = prob["x"].shape[0] // len(launched)
        rows = [r * block + j for r in range(len(launched)) for j in range(2 * block // W.N_MICRO)]
        two = W.unsharded_grad({**prob, "x": prob["x"][rows], "y": prob["y"][rows]})
        _close(acc["direct_sum"], two)
        for step in acc["steps"][1:]:
            # Warm steps: w2 closes the first (1 MiB) bucket, b1 and w1 share the second; each
            # bucket is all-reduced once per step, carrying the sum of the 4 microbatches:
            # 2 (n-1)/n x the parameter bytes = the parameter bytes for n = 2.
            assert step["stats"]["data"]["psum"] == {"calls": 2, "bytes": param_bytes}, (rank, step["stats"])
            assert step["stats"]["data"]["pmean"]["calls"] == W.N_MICRO
        # without deferral: one all-reduce per bucket per microbatch, the same bytes each time
        assert acc["plain_stats"]["data"]["psum"] == {
            "calls": 2 * W.N_MICRO,
            "bytes": W.N_MICRO * param_bytes,
        }


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("case", "kind", "phrase"),
    [
        ("in_place", "ValueError", "was modified in place between the deferred microbatches"),
        ("never_final", "RuntimeError", "were never reduced"),
        ("final_backward_first", "RuntimeError", "1 of the 1 deferred calls have not run their backward yet"),
        ("new_tensors", "RuntimeError", "fpar.optim.accumulate: gradients deferred under"),
        # ranks that defer different microbatches: before, gloo aborted the process (a collective
        # size mismatch) and NCCL would hang; the deferral salts the signature check
        (
            "ranks_disagree",
            "ValueError",
            "they are all-reduced (gradients enabled, outside fpar.defer_reduction()) on rank 1; deferred (inside fpar.defer_reduction()) on rank 0",
        ),
        (
            "ranks_disagree_accumulate",
            "ValueError",
            "on rank 1; deferred (inside fpar.defer_reduction()) on rank 0",
        ),
    ],
)
def test_misuse_raises_on_every_rank(launched, case, kind, phrase):
    for _, misuse, _ in launched:
        assert misuse[case] is not None, f"{case}: no error"
        got_kind, message = misuse[case]
        assert got_kind == kind, message
        assert phrase in message, message
        assert "fpar.shard(mlp_loss)" in message


@pytest.mark.multiprocess
def test_state_is_clean_after_errors(launched):
    for _, misuse, _ in launched:
        _close(misuse["recovered"], misuse["recovered_plain"])


@pytest.mark.multiprocess
def test_deferred_sums_reuse_buffers_only_once_nothing_holds_them(launched):
    prob = W.problem()
    for _, _, reuse in launched:
        for s, by_backward, by_accumulate in zip(reuse["scales"], reuse["backward"], reuse["accumulate"]):
            expected = W.unsharded_grad({**prob, "x": prob["x"] * s})
            _close(by_backward, expected)
            _close(by_accumulate, expected)
        assert reuse["same_memory"], "a step's deferred sums did not reuse the buffer the last step dropped"
        assert reuse["accumulate_same_memory"], (
            "accumulate's means did not reuse the buffers the caller dropped"
        )


def test_deferred_buffer_filled_per_call_is_whole_when_taken():
    """``add`` (the ``_Defer`` Function's backward) copies into an uninitialised buffer (the plan's
    kept one): a slot no cotangent reached in the first call is zero, never left-over memory."""
    from fpar import _defer

    cpu = torch.device("cpu")
    metas = [(torch.Size([2, 3]), torch.float64, cpu), (torch.Size([4]), torch.float64, cpu)]
    stale = lambda b, n, dtype, device: torch.full((n,), float("nan"), dtype=dtype, device=device)  # noqa: E731
    held = _defer.Deferred(_defer.defer_reduction(), "f", ("key",), [], 1, stale)
    held.calls = 2
    a, b = torch.arange(6.0, dtype=torch.float64).view(2, 3), torch.ones(4, dtype=torch.float64)
    held.add(0, [a, None], metas)  # call 1: only tensor 0 got a cotangent
    held.add(0, [a, b], metas)  # call 2: both
    torch.testing.assert_close(held.take(0), torch.cat([(2 * a).reshape(-1), b]))


def test_deferred_buffer_filled_per_tensor_is_whole_when_taken(monkeypatch):
    """``add_one`` (the per-tensor deferral hooks) copies into an uninitialised buffer; a slot no
    cotangent reached is zero when the final call takes the buffer, never left-over memory."""
    from fpar import _defer

    empty = torch.empty  # uninitialised memory, made visible: NaN
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan")))
    cpu = torch.device("cpu")
    metas = [(torch.Size([2, 3]), torch.float64, cpu), (torch.Size([4]), torch.float64, cpu)]
    held = _defer.Deferred(_defer.defer_reduction(), "f", ("key",), [], 1)
    held.calls = 2
    a, b = torch.arange(6.0, dtype=torch.float64).view(2, 3), torch.ones(2, 3, dtype=torch.float64)
    held.add_one(0, 0, a, metas, True)  # call 1: only tensor 0 got a cotangent
    held.add_one(0, 0, b, metas, True)  # call 2: the same
    flat = held.take(0)
    torch.testing.assert_close(flat, torch.cat([(a + b).reshape(-1), torch.zeros(4, dtype=torch.float64)]))


@given(
    shape=st.lists(st.integers(0, 4), min_size=0, max_size=4),
    before=st.integers(0, 7),
    start=st.integers(0, 5),
)
@settings(max_examples=60, deadline=None)
def test_block_is_the_slice_of_a_flat_buffer_viewed(shape, before, start):
    """``_buffers.block`` (every bucket's and message's slots) is ``flat[at:at+n].view(shape)``:
    the same values and the same memory, also for a flat buffer that is itself a slice of a
    larger one (a bucket that is the tail of the first message)."""
    from fpar._buffers import block, contiguous_strides

    shape = torch.Size(shape)
    n = shape.numel()
    big = torch.arange(float(start + before + n + 3))
    flat = big.narrow(0, start, before + n + 3)  # storage_offset start
    got = block(flat, before, shape)
    want = flat[before : before + n].view(shape)
    assert got.shape == want.shape and got.stride() == want.stride() == contiguous_strides(shape)
    torch.testing.assert_close(got, want)
    if n:
        got.fill_(-1.0)  # the same memory: a write through the block lands in the buffer
        assert (big[start + before : start + before + n] == -1.0).all()
        assert (big[: start + before] >= 0).all() and (big[start + before + n :] >= 0).all()
