"""A real-mesh call under ``torch.func.grad`` runs on plain autograd inside (``fpar/_dist/lowered.py``).

``torch.func.grad`` records the backward for a higher derivative (pytorch#134612): everything the
backward saves lives until it ends.  Where no higher derivative can follow, the real mesh runs
the sharded function below the transform, differentiated as a ``.backward()`` step.  These tests
hold it to the same values and gradients as the unsharded function, to ``.backward()``'s memory,
and to the cases where it must not lower (a captured differentiated tensor, ``torch.func.vjp``,
parameters autograd records outside the transform).
"""

from __future__ import annotations

import lowered_workers as W
import pytest
import torch

import fpar

pytestmark = pytest.mark.multiprocess

TIMEOUT = 60.0


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_grad_and_value_is_lowered_from_the_first_call_and_equals_the_unsharded_function():
    params, x, y = W._data()
    value, aux, grads = W.reference(params, x, y, scale=0.5)
    for levels, pending, got, outer in fpar.launch(W.lowered_run, 2, timeout=TIMEOUT):
        # lowered in every call (the first, traced, too), not under nn.Parameters with grad mode on
        assert levels[:4] == [None, None, None, None]
        assert levels[4:] == [1]
        assert pending == [False, True, True]  # the first call is traced: its sums are waited for
        for g, v, a in got[:3]:
            _close(g, grads)
            assert v == pytest.approx(float(value), rel=1e-12)
            assert a == pytest.approx(float(aux), rel=1e-12)
        _close(got[3][0], {"w": 2 * params["w"], "b": torch.zeros_like(params["b"])})
        _close(got[4][0], grads)
        assert outer == {"w": True, "b": True}  # still differentiable outside, as torch.func.grad's


def test_a_captured_differentiated_tensor_is_not_lowered_and_keeps_its_gradient():
    params, x, _ = W._data(1)
    w = params["w"]
    want_v = torch.func.grad(lambda w: torch.tanh(x @ (w * 3)).square().mean())(w)
    want_r = torch.func.grad(lambda w: (x @ (w * 3)).sin().sum())(w)
    for levels, out in fpar.launch(W.captured_run, 2, timeout=TIMEOUT):
        # each function's first call is tried lowered (level None) until it meets the captured tensor,
        # then runs at the transform's level
        assert levels == [None, 1, 1, None, 1, 1]
        _close(out[0], want_v)
        _close(out[1], want_v)
        _close(out[2], want_r)
        _close(out[3], want_r)


def test_vjp_is_not_lowered_and_its_vjp_fn_runs_twice():
    params, x, _ = W._data(2)
    w = params["w"]
    ct = torch.ones_like(x)
    _, vjp_fn = torch.func.vjp(lambda w: torch.tanh(x @ w), w)
    (want,) = vjp_fn(ct)
    for levels, out in fpar.launch(W.vjp_run, 2, timeout=TIMEOUT):
        assert levels == [1, 1]
        for once, twice in out:
            _close(once, want)
            _close(twice, 2 * want)


def test_a_lowered_step_holds_what_backward_holds():
    """8 layers whose activations outweigh the weights: by torch.func.grad the step's peak was 2.3x
    the same sharded loss's by .backward() (the recorded backward kept every saved activation and
    the backward's own intermediates); lowered, within 10 % of it."""
    for by_grad, by_backward in fpar.launch(W.memory_run, 2, timeout=TIMEOUT):
        assert by_grad <= 1.1 * by_backward, (by_grad, by_backward)
