"""fpar against the independent reference (reference.py) beyond float64.

* every collective x axis or axis tuple x spec (harness.collective_cases on two meshes) on
  float32, bfloat16, float16, int64, int32 and bool blocks, values and (floating) gradients;
* the low-precision rule: sums and means over devices accumulate in float32 and round once, so
  pmean does not overflow float16 where the mean fits, and bf16/fp16 layers stay within the
  stated tolerance of the float32 unsharded model;
* the matmul routing paths (``@``, ``torch.matmul``, ``Tensor.matmul``, ``torch.mm``, ``F.linear``
  positional and by keyword, ``einsum``, ``__rmatmul__``, with bias, batched), on random meshes
  and layouts (batch-, column- and row-split, the latter completed by a psum), in float64,
  float32, bfloat16, float16 and int64, inside and outside autocast, with a keyword argument.
"""

from __future__ import annotations

import math

import pytest
import strategies as S
import torch
import torch.nn.functional as F
from harness import assert_tree_close, both, case_specs, collective_cases, mesh_of, scalar_loss
from hypothesis import given, note, settings
from hypothesis import strategies as st
from reference import shard_reference

import fpar
from fpar import P
from fpar.testing import default_tolerance

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool]
CASES = [c for c in collective_cases() if c.id.split("-")[-2] in ("x2y3", "a2b1c2")]


def _draw(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if not dtype.is_floating_point:
        return torch.randint(-5, 6, shape, generator=g).to(dtype)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _tol(dtype):
    rtol, atol = default_tolerance(dtype)
    return {"rtol": rtol, "atol": atol} if dtype.is_floating_point else {"rtol": 0, "atol": 0}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_collective_on_every_dtype(dtype):
    for case in CASES:
        axes, ax, prog, block, varies = case.values
        shape, in_spec, out_spec = case_specs(axes, ax, block, varies)
        x = _draw(shape, dtype, seed=shape[0])
        f, r = both(prog, axes, in_spec, out_spec)
        try:
            want = r(x)
        except RuntimeError:  # torch has no such op for this dtype (e.g. amax of bool)
            with pytest.raises(RuntimeError):
                f(x)
            continue
        got = f(x)
        assert_tree_close(got, want, what=f"{case.id} value", **_tol(want.dtype))
        if dtype.is_floating_point:
            gf = torch.func.grad(scalar_loss(f))(x)
            gr = torch.func.grad(scalar_loss(r))(x)
            assert_tree_close(gf, gr, what=f"{case.id} grad", **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_low_precision_sums_accumulate_in_float32(dtype):
    mesh = fpar.make_mesh((4,), ("i",))
    big = torch.full((4, 3), 40000.0 if dtype == torch.float16 else 3e38, dtype=dtype)
    mean = fpar.shard(lambda x: fpar.pmean(x, "i"), mesh, P("i"), P())(big)
    assert torch.equal(mean, big[:1])  # the sum overflows, the mean fits: no inf
    # one rounding of the float32 sum, not four
    x = _draw((4, 64), dtype, seed=3) * 100 + 1
    got = fpar.shard(lambda x: fpar.psum(x, "i"), mesh, P("i"), P())(x)
    assert torch.equal(got[0], x.float().sum(0).to(dtype))
    scattered = fpar.shard(
        lambda x: fpar.psum_scatter(x, "i", scatter_dimension=1, tiled=True), mesh, P("i"), P(None, "i")
    )(x)
    assert torch.equal(scattered[0], x.float().sum(0).to(dtype))


def _mlp_fp32(p, x):
    return F.gelu(x @ p["w_in"] + p["b_in"]) @ p["w_out"] + p["b_out"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_low_precision_layers_near_the_float32_model(dtype):
    check_low_precision_layers(fpar.make_mesh((2,), ("tensor",)), dtype)


def check_low_precision_layers(mesh, dtype):
    """bf16/fp16 Megatron MLP, ring attention and vocab-parallel CE against the float32 unsharded
    model, within the kit's tolerance for the dtype (bf16 2e-2 rel + 1e-2 abs, fp16 2e-3 + 1e-3,
    here scaled by 4 for the longer chains of roundings), on an in-process or real mesh with a
    2-device 'tensor' axis (test_testing_dist.py runs it on gloo processes)."""
    rtol, atol = (4 * t for t in default_tolerance(dtype))

    def run(f, in_specs, out_specs, *args):
        blocks = fpar.device_put(args, mesh, in_specs)
        return fpar.gather(fpar.shard(f, mesh, in_specs, out_specs)(*blocks), mesh, out_specs)

    gen = torch.Generator().manual_seed(0)
    p = {
        k: torch.randn(s, generator=gen) * 0.3
        for k, s in dict(w_in=(8, 16), b_in=(16,), w_out=(16, 8), b_out=(8,)).items()
    }
    x = torch.randn(4, 8, generator=gen)
    low = {k: v.to(dtype) for k, v in p.items()}
    got = run(
        lambda p, x: fpar.ops.mlp(p, x, axis="tensor"), (fpar.ops.mlp_specs(), P()), P(), low, x.to(dtype)
    )
    assert got.dtype == dtype
    want = _mlp_fp32(p, x)
    torch.testing.assert_close(got.float(), want, rtol=rtol, atol=atol)

    q, k, v = (torch.randn(2, 8, 2, 4, generator=gen) for _ in range(3))
    got = run(
        lambda q, k, v: fpar.ops.ring_attention(q, k, v, axis="tensor"),
        P(None, "tensor"),
        P(None, "tensor"),
        q.to(dtype),
        k.to(dtype),
        v.to(dtype),
    )
    assert got.dtype == dtype
    want = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
    ).transpose(1, 2)
    torch.testing.assert_close(got.float(), want, rtol=rtol, atol=atol)

    logits = torch.randn(6, 10, generator=gen) * 4
    targets = torch.randint(0, 10, (6,), generator=gen)
    got = run(
        lambda z, t: fpar.ops.vocab_cross_entropy(z, t, axis="tensor"),
        (P(None, "tensor"), P()),
        P(),
        logits.to(dtype),
        targets,
    )
    assert got.dtype == dtype
    torch.testing.assert_close(
        got.float(), F.cross_entropy(logits, targets, reduction="none"), rtol=rtol, atol=atol
    )


# The matmul routing paths ------------------------------------------------------------------------

FORMS = (
    "@",
    "matmul",
    "Tensor.matmul",
    "mm",
    "rmatmul",
    "einsum",
    "linear",
    "linear-kw",
    "batched @",
    "broadcast @",
)


def product(x, w, b, form):
    """``x @ w (+ b)`` written in one of the call forms; ``w`` is [K, N] or [G, K, N]."""
    if form == "linear":
        return F.linear(x, w.transpose(-1, -2), b)
    if form == "linear-kw":
        return F.linear(x, weight=w.transpose(-1, -2), bias=b)
    y = {
        "@": lambda: x @ w,
        "matmul": lambda: torch.matmul(x, w),
        "Tensor.matmul": lambda: x.matmul(w),
        "mm": lambda: torch.mm(x, w),
        "rmatmul": lambda: w.__rmatmul__(x),
        "einsum": lambda: torch.einsum("...k,kn->...n", x, w),
        "batched @": lambda: x @ w,
        "broadcast @": lambda: x @ w,
    }[form]()
    return y if b is None else y + b


@st.composite
def _matmul_layouts(draw):
    mesh = draw(S.meshes(max_devices=8))
    form = draw(st.sampled_from(FORMS))
    roles = {a: draw(st.sampled_from([None, "B", "N", "K"])) for a in mesh}
    if form == "batched @":
        roles = {a: r if r != "B" else "G" for a, r in roles.items()}
    n = {r: math.prod(mesh[a] for a in mesh if roles[a] == r) for r in ("G", "B", "N", "K")}
    axes = {r: tuple(a for a in mesh if roles[a] == r) or None for r in ("G", "B", "N", "K")}
    size = {r: n[r] * draw(st.integers(1, 2)) for r in n}
    dtype = draw(st.sampled_from([torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64]))
    autocast = dtype.is_floating_point and draw(st.booleans())
    bias = dtype.is_floating_point and draw(st.booleans())
    keyword = draw(st.booleans())
    return mesh, form, axes, size, dtype, autocast, bias, keyword


@settings(max_examples=max(20, settings().max_examples), deadline=None)
@given(_matmul_layouts())
def test_matmul_routing_matches_reference(layout):
    mesh, form, axes, size, dtype, autocast, bias, keyword = layout
    note(
        f"mesh={mesh} form={form} axes={axes} size={size} dtype={dtype} autocast={autocast} bias={bias} kw={keyword}"
    )
    G, B, N, K = (size[r] for r in "GBNK")
    if form == "batched @":
        x_shape, w_shape = (G, B, K), (G, K, N)
        x_spec, w_spec, out_spec = (
            P(axes["G"], axes["B"], axes["K"]),
            P(axes["G"], axes["K"], axes["N"]),
            P(axes["G"], axes["B"], axes["N"]),
        )
    elif form == "broadcast @":
        x_shape, w_shape = (2, B, K), (K, N)
        x_spec, w_spec, out_spec = (
            P(None, axes["B"], axes["K"]),
            P(axes["K"], axes["N"]),
            P(None, axes["B"], axes["N"]),
        )
    else:
        x_shape, w_shape = (B, K), (K, N)
        x_spec, w_spec, out_spec = P(axes["B"], axes["K"]), P(axes["K"], axes["N"]), P(axes["B"], axes["N"])
    x, w = _draw(x_shape, dtype, 1), _draw(w_shape, dtype, 2)
    b = _draw((N,), dtype, 3) if bias else None
    scale = (
        torch.tensor(0.5, dtype=torch.float64).to(dtype)
        if dtype.is_floating_point
        else torch.tensor(2, dtype=dtype)
    )
    k_split = axes["K"]

    def per_device(c, x, w, b, scale):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            # a bias on a row-parallel product is added once, after the psum
            y = product(x, w, None if k_split else b, form)
        if k_split:
            y = c.psum(y, k_split)
            if b is not None:
                y = y + b.to(y.dtype)
        return y * scale.to(y.dtype)

    specs = (x_spec, w_spec, P(axes["N"]) if bias else None, P())
    ref = shard_reference(per_device, mesh, specs, out_spec)
    if keyword:  # the scale travels as a keyword argument (replicated)

        def fpar_device(x, w, b, *, scale):
            return per_device(fpar_c, x, w, b, scale)

        sharded = fpar.shard(fpar_device, mesh_of(mesh), specs[:3], out_spec)

        def run(x, w, b, scale):
            return sharded(x, w, b, scale=scale)
    else:

        def fpar_device(x, w, b, scale):
            return per_device(fpar_c, x, w, b, scale)

        run = fpar.shard(fpar_device, mesh_of(mesh), specs, out_spec)
    want = ref(x, w, b, scale)
    got = run(x, w, b, scale)
    assert_tree_close(got, want, **_tol(want.dtype))
    if dtype.is_floating_point:
        argnums = (0, 1, 2) if bias else (0, 1)
        gf = torch.func.grad(scalar_loss(run), argnums=argnums)(x, w, b, scale)
        gr = torch.func.grad(scalar_loss(ref), argnums=argnums)(x, w, b, scale)
        rtol, atol = default_tolerance(torch.bfloat16 if autocast and dtype != torch.float64 else dtype)
        assert_tree_close(gf, gr, what="grad", rtol=2 * rtol, atol=2 * atol * max(1, K))


class _FparC:
    def psum(self, x, axis_name):
        return fpar.psum(x, axis_name)


fpar_c = _FparC()
