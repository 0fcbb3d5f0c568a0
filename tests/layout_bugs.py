"""Layout bugs a user's ``fpar.testing`` test must catch, run the same on either mesh.

``check_catches(mesh)`` takes a mesh with a ``tensor`` axis of 2 devices (in-process or real) and
asserts that :func:`fpar.testing.assert_equivalent` fails on each bug with a message naming value
or gradient, the leaf and the mesh coordinates of only the wrong blocks, and passes the right
layouts.  It returns the messages, so a test can check that both meshes say the same.
Every process of a real mesh builds the same inputs (fixed seeds).
"""

from __future__ import annotations

import re

import pytest
import torch

import fpar
from fpar import P
from fpar.testing import assert_equivalent


def rand(*shape, seed=0, dtype=torch.float64):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


X, W = rand(4, 6, seed=1), rand(6, 5, seed=2)
ROW = (P(None, "tensor"), P("tensor"))  # x split over its columns, w over its rows


def row_parallel(x, w):
    return fpar.psum(x @ w, "tensor")


def row_parallel_no_psum(x, w):
    return x @ w


def row_parallel_pmean(x, w):
    return fpar.pmean(x @ w, "tensor")


class _DoubleWrongBackward(torch.autograd.Function):
    """y = 2x, but the backward forgets the factor 2 (on every device)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return 2 * x

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g


def wrong_backward(x, w):
    return fpar.psum(_DoubleWrongBackward.apply(x) @ w, "tensor")


class _TripleOnDeviceOne(torch.autograd.Function):
    """The identity, whose backward triples the cotangent of the device at ``index == 1``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(w, index):
        return w.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[1])

    @staticmethod
    def backward(ctx, g):
        (index,) = ctx.saved_tensors
        return g * torch.where(index == 1, 3.0, 1.0).to(g.dtype), None


def gradient_bug_on_one_block(params, x):
    return x @ _TripleOnDeviceOne.apply(params["w"], fpar.axis_index("tensor"))


def value_bug_on_one_device(x):
    return torch.where(fpar.axis_index("tensor") == 1, x * 2, x)


def _message(reference, fn, mesh, in_specs, out_specs, *args) -> str:
    with pytest.raises(AssertionError) as info:
        assert_equivalent(reference, fn, mesh, in_specs, out_specs, *args)
    return str(info.value)


def _error_part(start: str) -> str:
    numbers = r" max abs error [0-9.e+-]+, max rel error [0-9.e+-]+ \(rtol=1e-07, atol=1e-07\), "
    return re.escape(start) + numbers


def check_catches(mesh: fpar.Mesh) -> dict[str, str]:
    """Assert the kit passes the right layouts and locates each bug on ``mesh``; return the messages."""
    assert dict(mesh.shape) == {"tensor": 2}
    assert_equivalent(torch.matmul, row_parallel, mesh, ROW, P(), X, W)
    assert_equivalent(lambda x: x, lambda x: x, mesh, P("tensor"), P("tensor"), X)
    messages = {}

    msg = messages["missing psum"] = _message(torch.matmul, row_parallel_no_psum, mesh, ROW, P(), X, W)
    assert re.fullmatch(
        _error_part("value out of row_parallel_no_psum differs from the reference:")
        + re.escape(
            "in the devices at tensor=0; tensor=1 (2 of 2). Its out_spec P() promises the same value on "
            "every device along ('tensor',), but the copies differ: a missing psum/pmean over those axes?"
        ),
        msg,
    ), msg

    msg = messages["pmean for psum"] = _message(torch.matmul, row_parallel_pmean, mesh, ROW, P(), X, W)
    assert re.fullmatch(
        _error_part("value out of row_parallel_pmean differs from the reference:")
        + re.escape("in the devices at tensor=0; tensor=1 (2 of 2)."),
        msg,
    ), msg

    # the value is right: only the gradient w.r.t. x (args[0]) is wrong, on both of its blocks
    msg = messages["wrong custom backward"] = _message(
        lambda x, w: (2 * x) @ w, wrong_backward, mesh, ROW, P(), X, W
    )
    assert re.fullmatch(
        _error_part("gradient w.r.t. args[0] of wrong_backward differs from the reference:")
        + re.escape("in the blocks at tensor=0; tensor=1 (2 of 2)."),
        msg,
    ), msg

    msg = messages["value on one device"] = _message(
        lambda x: x, value_bug_on_one_device, mesh, P("tensor"), P("tensor"), X
    )
    assert re.fullmatch(
        _error_part("value out of value_bug_on_one_device differs from the reference:")
        + re.escape("in the devices at tensor=1 (1 of 2)."),
        msg,
    ), msg

    msg = messages["gradient on one block"] = _message(
        lambda p, x: x @ p["w"],
        gradient_bug_on_one_block,
        mesh,
        ({"w": P(None, "tensor")}, P()),
        P(None, "tensor"),
        {"w": rand(6, 4, seed=3)},
        X,
    )
    assert re.fullmatch(
        _error_part("gradient w.r.t. args[0]['w'] of gradient_bug_on_one_block differs from the reference:")
        + re.escape("in the blocks at tensor=1 (1 of 2)."),
        msg,
    ), msg
    return messages


def without_numbers(messages: dict[str, str]) -> dict[str, str]:
    """The messages with their error magnitudes masked (the last digits may differ by mesh)."""
    return {k: re.sub(r"error [0-9.e+-]+", "error N", m) for k, m in messages.items()}
