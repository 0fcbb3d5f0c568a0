"""Sharded code behaves as torch does: every matmul/linear call form, autocast, keyword arguments,
in-place ops on inputs, and nothing kept alive after a call.  Each test failed before its fix."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

import fpar
from fpar import P
from fpar.testing import assert_equivalent

MESH = fpar.make_mesh((2,), ("tensor",))
MESH_DT = fpar.make_mesh((2, 2), ("data", "tensor"))


def _rand(*shape, seed=0, dtype=torch.float64):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def _autocast(fn):
    def run(*args):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return fn(*args)

    run.__name__ = fn.__name__
    return run


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_linear_with_bias_under_autocast_keeps_autocast_dtype(x_dtype):
    """bf16 (or fp32) input, fp32 weight and bias under autocast: torch gives bf16, so must fpar."""
    x, w, b = (
        _rand(4, 6, seed=1, dtype=x_dtype),
        _rand(8, 6, seed=2, dtype=torch.float32),
        _rand(8, seed=3, dtype=torch.float32),
    )

    def linear(x, w, b):
        return F.linear(x, w, b)

    f = _autocast(linear)
    assert f(x, w, b).dtype == torch.bfloat16
    assert_equivalent(f, f, MESH_DT, (P("data"), P("tensor"), P("tensor")), P("data", "tensor"), x, w, b)


@pytest.mark.parametrize(
    "form",
    ["positional", "weight=", "input=,weight=,bias=", "bias="],
)
def test_linear_every_call_form(form):
    x, w, b = _rand(4, 6, seed=1), _rand(8, 6, seed=2), _rand(8, seed=3)
    calls = {
        "positional": lambda x, w, b: F.linear(x, w, b),
        "weight=": lambda x, w, b: F.linear(x, weight=w) + b,
        "input=,weight=,bias=": lambda x, w, b: F.linear(input=x, weight=w, bias=b),
        "bias=": lambda x, w, b: F.linear(x, w, bias=b),
    }
    fn = calls[form]
    assert_equivalent(fn, fn, MESH_DT, (P("data"), P("tensor"), P("tensor")), P("data", "tensor"), x, w, b)


def test_linear_bias_of_another_dtype_raises_as_torch_does():
    x, w, b = _rand(4, 6, dtype=torch.float32), _rand(5, 6, dtype=torch.float32), _rand(5)
    with pytest.raises(RuntimeError):
        F.linear(x, w, b)
    f = fpar.shard(lambda x, w, b: F.linear(x, w, b), MESH, (P("tensor"), P(), P()), P("tensor"))
    with pytest.raises(
        RuntimeError,
        match=r"F.linear got input, weight, bias of dtypes torch.float32, torch.float32, torch.float64",
    ):
        f(x, w, b)


def test_mm_of_a_3d_tensor_raises_as_torch_does():
    a, b = _rand(2, 3, 4), _rand(4, 5)
    with pytest.raises(RuntimeError):
        torch.mm(a, b)
    for mm in (torch.mm, torch.Tensor.mm):
        with pytest.raises(RuntimeError):
            fpar.shard(lambda a, b, mm=mm: mm(a, b), MESH, (P("tensor"), P()), P("tensor"))(a, b)


@pytest.mark.parametrize(
    "name",
    ["@", "matmul", "Tensor.matmul", "mm", "rmatmul", "einsum", "batched @", "vector @"],
)
def test_matmul_forms_fold_like_torch(name):
    forms = {
        "@": (lambda x, w: x @ w, (6, 4), (4, 6)),
        "matmul": (torch.matmul, (6, 4), (4, 6)),
        "Tensor.matmul": (torch.Tensor.matmul, (6, 4), (4, 6)),
        "mm": (torch.mm, (6, 4), (4, 6)),
        "rmatmul": (lambda x, w: w.__rmatmul__(x), (6, 4), (4, 6)),
        "einsum": (lambda x, w: torch.einsum("bk,kn->bn", x, w), (6, 4), (4, 6)),
        "batched @": (lambda x, w: x @ w, (2, 6, 4), (2, 4, 6)),
        "vector @": (lambda x, w: x @ w, (6, 4), (4,)),
    }
    fn, xs, ws = forms[name]
    x, w = _rand(*xs, seed=1), _rand(*ws, seed=2)
    out_rank = len(fn(x, w).shape)
    for w_spec in (P(), P(*([None] * (len(ws) - 1)), "tensor") if len(ws) > 1 else P()):
        out = P("data", *([None] * (out_rank - 1)))
        if "tensor" in w_spec.axes():
            out = P("data", *([None] * (out_rank - 2)), "tensor")
        x_spec = P("data") if len(xs) == 2 else P(None, "data")
        if len(xs) == 3:
            out = P(None, "data", "tensor") if "tensor" in w_spec.axes() else P(None, "data")
        assert_equivalent(fn, fn, MESH_DT, (x_spec, w_spec), out, x, w)


def test_keyword_arguments_are_replicated():
    def f(x, *, scale, bias=None, tag="plain"):
        assert tag == "kw"
        return x * scale + (0 if bias is None else bias)

    x, b = _rand(4, 3, seed=1), _rand(3, seed=2)
    sharded = fpar.shard(f, MESH, P("tensor"), P("tensor"))
    torch.testing.assert_close(sharded(x, scale=2.0, bias=b, tag="kw"), x * 2 + b)
    grad = torch.func.grad(
        lambda b: sharded(x, scale=torch.tensor(2.0, dtype=torch.float64), bias=b, tag="kw").sum()
    )(b)
    torch.testing.assert_close(grad, torch.full((3,), 4.0, dtype=torch.float64))
    # every device saw the whole bias: a split bias would have shape (3,) only with a spec
    seen = []
    fpar.shard(lambda x, *, b: seen.append(b.shape) or x, MESH, P("tensor"), P("tensor"))(x, b=b)
    assert seen == [torch.Size([3])]


def test_keyword_arguments_with_a_wrong_positional_spec_still_say_so():
    f = fpar.shard(lambda x, y, *, z: x, MESH, (P("tensor"),), P("tensor"))
    with pytest.raises(
        fpar.SpecError, match=r"in_specs has 1 entries, but <lambda> was called with 2 positional arguments"
    ):
        f(torch.zeros(4), torch.zeros(4), z=torch.zeros(4))


@pytest.mark.parametrize(
    "op",
    ["add_", "+=", "setitem", "relu_", "inplace=True", "out=", "view add_"],
)
def test_in_place_op_on_an_input_raises_and_leaves_the_caller_alone(op):
    ops = {
        "add_": lambda x: x.add_(1),
        "+=": lambda x: x.__iadd__(1),
        "setitem": lambda x: x.__setitem__(0, 5.0),
        "relu_": torch.relu_,
        "inplace=True": lambda x: F.relu(x, inplace=True),
        "out=": lambda x: torch.add(x, 1, out=x),
        "view add_": lambda x: x[0].add_(1),
    }
    x = _rand(4, 3)
    before = x.clone()

    def per_device(x):
        ops[op](x)
        return x

    with pytest.raises(RuntimeError, match=r"writes in place into args\[0\] \(or a view of it\)"):
        fpar.shard(per_device, MESH, P("tensor"), P("tensor"))(x)
    assert torch.equal(x, before)


def test_in_place_op_on_a_copy_is_fine():
    def per_device(x):
        y = x.clone()
        y += 1
        y[0] = 0.0
        return y

    x = _rand(4, 3)
    want = x + 1
    want[0], want[2] = 0.0, 0.0
    torch.testing.assert_close(fpar.shard(per_device, MESH, P("tensor"), P("tensor"))(x), want)


def test_frames_do_not_keep_tensors_alive():
    captured = []

    def per_device(w, x):
        captured.append(fpar._collectives.frames()[-1])
        return fpar.psum((x * w).sum(), "tensor")  # w replicated meets x varying: implicit pvary

    w, x = _rand(3), _rand(4, 3)
    alive = weakref.ref(w)
    out = fpar.shard(per_device, MESH, (P(), P("tensor")), P())(w, x)
    (frame,) = captured
    del w
    gc.collect()
    assert alive() is None  # the frame, still referenced here, does not hold the input
    assert not frame.pvaried and not frame.index and frame.token is None and not frame.inputs
    assert out.shape == ()
