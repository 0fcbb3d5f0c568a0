"""fpar.ops.rms_norm and fpar.ops.swiglu: the plain forms' values and gradients, fewer saved bytes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import fpar
import fpar.ops as ops
from fpar import P

DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def plain_rms_norm(x, w=None, eps=1e-6):
    """The Llama family's RMSNorm as Hugging Face writes it (in float32, float64 for float64)."""
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    y = (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if w is None else y * w.to(x.dtype)


def saved(fn, *args):
    """What the forward of ``fn(*args)`` keeps for its backward: (dtype, shape) of each saved tensor."""
    out = []

    def pack(t):
        out.append((t.dtype, tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return out


def leaves(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g, dtype=torch.float64)).to(dtype).requires_grad_()
    ct = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return x, w, ct


shapes = (
    st.lists(st.integers(1, 5), min_size=0, max_size=2)
    .map(tuple)
    .flatmap(lambda lead: st.integers(1, 40).map(lambda d: (*lead, d)))
)


@settings(max_examples=25, deadline=None)
@given(shape=shapes, dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16), weighted=st.booleans())
def test_rms_norm_is_the_plain_norm(shape, dtype, seed, weighted):
    x, w, ct = leaves(shape, dtype, seed)
    args = (x, w) if weighted else (x,)
    got, want = ops.rms_norm(*args, eps=1e-5), plain_rms_norm(*args, eps=1e-5)
    assert got.dtype == x.dtype and torch.equal(got, want)  # the forward runs the same ops
    g_got = torch.autograd.grad(got, args, ct)
    g_want = torch.autograd.grad(want, args, ct)
    # the backward is written out (autograd orders the plain one's sums its own way): rounding apart
    tol = {torch.float64: 1e-12, torch.float32: 1e-5}.get(dtype, 2e-2)
    for a, b in zip(g_got, g_want):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * max(1.0, b.abs().max().item()))


@settings(max_examples=25, deadline=None)
@given(shape=shapes, dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_swiglu_is_the_plain_swiglu_bit_for_bit(shape, dtype, seed):
    gate, _, ct = leaves(shape, dtype, seed)
    up, _, _ = leaves(shape, dtype, seed + 1)
    got, want = ops.swiglu(gate, up), F.silu(gate) * up
    assert torch.equal(got, want)
    for a, b in zip(torch.autograd.grad(got, (gate, up), ct), torch.autograd.grad(want, (gate, up), ct)):
        assert torch.equal(a, b)


def test_they_keep_their_inputs_only():
    x, w, _ = leaves((2, 8, 64), torch.bfloat16, 0)
    # the input, the weight and a float32 number a row; plain torch keeps float32 copies of x too
    assert saved(ops.rms_norm, x, w) == [
        (torch.bfloat16, (2, 8, 64)),
        (torch.bfloat16, (64,)),
        (torch.float32, (2, 8, 1)),
    ]
    big = [s for s in saved(plain_rms_norm, x, w) if s[1] == (2, 8, 64)]
    assert (torch.float32, (2, 8, 64)) in big and len(big) >= 2
    up, _, _ = leaves((2, 8, 64), torch.bfloat16, 1)
    assert saved(ops.swiglu, x, up) == [(torch.bfloat16, (2, 8, 64))] * 2
    assert len(saved(lambda a, b: F.silu(a) * b, x, up)) == 3  # gate, silu(gate), up


def test_under_torch_func_transforms():
    x, w, _ = leaves((3, 4, 16), torch.float64, 2)
    x, w = x.detach(), w.detach()

    def loss(norm, glu):
        return lambda x, w: glu(norm(x, w), norm(x, None)).pow(2).sum()

    mine = loss(lambda x, w: ops.rms_norm(x, w), ops.swiglu)
    ref = loss(plain_rms_norm, lambda a, b: F.silu(a) * b)
    got = torch.func.vmap(torch.func.grad(mine, argnums=(0, 1)), in_dims=(0, None))(x, w)
    want = torch.func.vmap(torch.func.grad(ref, argnums=(0, 1)), in_dims=(0, None))(x, w)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("sequence_split", [False, True])
def test_inside_shard_equals_the_unsharded_layer(sequence_split):
    """x split over data (and its sequence over tensor), the weight replicated: its gradient is summed."""
    mesh = fpar.make_mesh((2, 2), ("data", "tensor"))
    x, w, _ = leaves((4, 6, 16), torch.float64, 3)
    up, _, _ = leaves((4, 6, 16), torch.float64, 4)
    x_spec = P("data", "tensor" if sequence_split else None)

    def layer(norm, glu):
        return lambda x, w, up: glu(norm(x, w), up).pow(2).sum()

    mine = layer(ops.rms_norm, ops.swiglu)

    def per_device(x, w, up):
        return fpar.psum(mine(x, w, up), ("data", "tensor") if sequence_split else "data")

    sharded = fpar.shard(per_device, mesh, in_specs=(x_spec, P(), x_spec), out_specs=P())
    want = layer(plain_rms_norm, lambda a, b: F.silu(a) * b)
    args = (x.detach(), w.detach(), up.detach())
    got_g, got_v = torch.func.grad_and_value(sharded, argnums=(0, 1, 2))(*args)
    want_g, want_v = torch.func.grad_and_value(want, argnums=(0, 1, 2))(*args)
    torch.testing.assert_close(got_v, want_v, rtol=1e-12, atol=1e-12)
    for a, b in zip(got_g, want_g):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_rms_norm_computes_in_the_dtype_asked():
    """Hugging Face's norms compute in float32 whatever the input: ``compute_dtype=torch.float32``."""
    x, w, ct = leaves((3, 16), torch.float64, 5)

    def hf(x, w):
        wide = x.to(torch.float32)
        return (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w

    got = ops.rms_norm(x, w, compute_dtype=torch.float32)
    assert torch.equal(got, hf(x, w)) and not torch.equal(got, ops.rms_norm(x, w))
    for a, b in zip(torch.autograd.grad(got, (x, w), ct), torch.autograd.grad(hf(x, w), (x, w), ct)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    with pytest.raises(
        TypeError, match="fpar.ops.rms_norm: compute_dtype must be a floating dtype, got torch.int32"
    ):
        ops.rms_norm(x, w, compute_dtype=torch.int32)


def test_bad_input_is_named():
    x = torch.randn(2, 8)
    with pytest.raises(
        ValueError, match=r"fpar.ops.rms_norm: weight must be \[8\] \(x's last dim\), got \[4\]"
    ):
        ops.rms_norm(x, torch.ones(4))
    with pytest.raises(TypeError, match="fpar.ops.rms_norm: x must be a floating tensor, got torch.int64"):
        ops.rms_norm(torch.ones(2, 8, dtype=torch.long))
    with pytest.raises(ValueError, match=r"fpar.ops.swiglu: gate \[2, 8\] and up \[2, 4\] differ in shape"):
        ops.swiglu(x, torch.randn(2, 4))
