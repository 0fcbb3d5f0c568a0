"""fpar.random and fpar.ops.dropout: known answers, layout independence, statistics, errors.

The reference for every sharded draw is the same draw outside ``fpar.shard`` (the whole global
array); sharded results must equal it bit for bit at every drawn mesh and spec.  The generator
itself is checked against the Random123 known-answer vectors (kat_vectors, "philox4x32 10").
"""

from __future__ import annotations

import math
import re

import pytest
import strategies as S
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import fpar
from fpar import P
from fpar.random._philox import philox

M = 0xFFFFFFFF

# Random123 kat_vectors: counter (4 words), key (2 words) -> output (4 words).
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((M, M, M, M), (M, M), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


def _mesh(axes: dict[str, int]):
    return fpar.make_mesh(tuple(axes.values()), tuple(axes))


# Known answers --------------------------------------------------------------------------------


@pytest.mark.parametrize("ctr,key,want", KAT, ids=["zeros", "ones", "pi"])
def test_philox_known_answers(ctr, key, want):
    out = philox(*(torch.tensor(c) for c in ctr), *(torch.tensor(k) for k in key))
    assert [int(o) for o in out] == list(want)
    batched = philox(*(torch.tensor([c, 0]) for c in ctr), *(torch.tensor(k) for k in key))
    assert [int(o[0]) for o in batched] == list(want)  # elementwise: one lane never leaks into another


def test_draws_are_the_philox_words_in_row_major_order():
    # key(seed) is (low word, high word); element i of a 32-bit draw is word i % 4 of counter i // 4.
    k = fpar.random.key((0x299F31D0 << 32) | 0xA4093822)
    assert k.tolist() == [0xA4093822, 0x299F31D0]
    words = [philox(torch.tensor(c), torch.tensor(0), 0, 0, k[0], k[1]) for c in range(3)]
    flat = [int(w) for block in words for w in block]
    assert fpar.random.bits(k, (12,)).tolist() == flat
    assert fpar.random.bits(k, (3, 4)).flatten().tolist() == flat
    assert fpar.random.bits(k, (4, 3)).flatten().tolist() == flat  # rows not a multiple of 4: slow path
    u = fpar.random.uniform(k, (12,))
    assert u.tolist() == [(w >> 8) / 2**24 for w in flat]


def test_key_split_fold_in():
    k = fpar.random.key(7)
    assert k.dtype == torch.int64 and k.shape == (2,)
    ks = fpar.random.split(k, 5)
    assert ks.shape == (5, 2) and len({tuple(r) for r in ks.tolist()}) == 5
    assert torch.equal(fpar.random.split(k)[1], ks[1])  # split(k, n)[i] does not depend on n
    assert torch.equal(fpar.random.fold_in(k, 3), fpar.random.fold_in(k, torch.tensor(3)))
    assert not torch.equal(fpar.random.fold_in(k, 3), fpar.random.fold_in(k, 4))
    assert fpar.random.fold_in(k, torch.arange(4)).shape == (4, 2)
    assert torch.equal(fpar.random.fold_in(k, torch.arange(4))[2], fpar.random.fold_in(k, 2))
    assert torch.equal(fpar.random.key(-1), fpar.random.key(2**64 - 1))
    a, b = fpar.random.uniform(ks[0], (1000,)), fpar.random.uniform(ks[1], (1000,))
    assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1]) < 0.15


# Layout independence: sharded == unsharded, bit for bit ---------------------------------------

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


@given(data=st.data())
def test_draws_sharded_equal_unsharded(data):
    axes = data.draw(S.meshes(max_devices=8))
    shape, entries = data.draw(S.sharded_shapes(axes, min_rank=0))
    spec = P(*entries)
    dtype = data.draw(st.sampled_from(DTYPES))
    k = fpar.random.fold_in(fpar.random.key(3), data.draw(st.integers(0, 2**40)))
    mesh = _mesh(axes)

    def per_device(k):
        return (
            fpar.random.uniform(k, shape, dtype, spec=spec),
            fpar.random.normal(k, shape, dtype, spec=spec),
            fpar.random.bernoulli(k, 0.3, shape, spec=spec),
            fpar.random.bits(k, shape, spec=spec),
        )

    got = fpar.shard(per_device, mesh, (P(),), spec)(k)
    want = (
        fpar.random.uniform(k, shape, dtype),
        fpar.random.normal(k, shape, dtype),
        fpar.random.bernoulli(k, 0.3, shape),
        fpar.random.bits(k, shape),
    )
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w)


@given(data=st.data())
def test_replicated_draw_inside_shard_is_the_whole_array(data):
    axes = data.draw(S.meshes(max_devices=8))
    spec = data.draw(st.sampled_from([None, P()]))
    k = fpar.random.key(11)

    def per_device(k):
        return fpar.random.uniform(k, (3, 5), spec=spec), fpar.random.normal(k, (7,), spec=spec)

    u, n = fpar.shard(per_device, _mesh(axes), (P(),), P())(k)  # passes the replication check
    assert torch.equal(u, fpar.random.uniform(k, (3, 5))) and torch.equal(n, fpar.random.normal(k, (7,)))


@given(data=st.data())
def test_dropout_sharded_equals_unsharded_values_and_grads(data):
    axes = data.draw(S.meshes(max_devices=8))
    shape, entries = data.draw(S.sharded_shapes(axes, min_rank=1))
    spec = P(*entries)
    rate = data.draw(st.sampled_from([0.0, 0.1, 0.5, 0.9]))
    k = fpar.random.key(data.draw(st.integers(0, 1000)))
    x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    cot = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def per_device(x, k):
        return torch.sin(fpar.ops.dropout(k, x, rate, spec=spec))

    sharded = fpar.shard(per_device, _mesh(axes), (spec, P()), spec)
    out, vjp = torch.func.vjp(lambda x: sharded(x, k), x)
    ref, ref_vjp = torch.func.vjp(lambda x: torch.sin(fpar.ops.dropout(k, x, rate)), x)
    assert torch.equal(out, ref)
    assert torch.equal(vjp(cot)[0], ref_vjp(cot)[0])


def test_dropout_gradient_is_mask_over_keep_probability():
    k, rate = fpar.random.key(5), 0.3
    x = torch.randn(64, 32, requires_grad=True)
    y = fpar.ops.dropout(k, x, rate)
    (g,) = torch.autograd.grad(y.sum(), x)
    keep = fpar.random.bernoulli(k, 1 - rate, (64, 32))
    assert torch.equal(g, keep.float() / (1 - rate))
    torch.testing.assert_close(y, torch.where(keep, x / (1 - rate), 0.0))
    assert torch.equal(y != 0, keep)
    assert fpar.ops.dropout(k, x, 0.0) is x


def test_per_device_streams_from_axis_index():
    mesh = fpar.make_mesh((4,), ("data",))
    k = fpar.random.key(1)

    def per_device(k):
        mine = fpar.random.fold_in(k, fpar.axis_index("data"))
        return fpar.random.uniform(mine, (1, 3))

    got = fpar.shard(per_device, mesh, (P(),), P("data"))(k)
    want = torch.cat([fpar.random.uniform(fpar.random.fold_in(k, i), (1, 3)) for i in range(4)])
    assert torch.equal(got, want)


# Statistics (2**20 draws; bounds are 6 standard errors) -------------------------------------

N = 2**20


def test_uniform_statistics():
    u = fpar.random.uniform(fpar.random.key(0), (N,), torch.float64)
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 6 * math.sqrt(1 / 12 / N)
    assert abs(float(u.var()) - 1 / 12) < 6 * math.sqrt((1 / 80 - 1 / 144) / N)
    counts = torch.histc(u.float(), bins=64, min=0.0, max=1.0)
    chi2 = float(((counts - N / 64) ** 2 / (N / 64)).sum())
    assert chi2 < 63 + 6 * math.sqrt(2 * 63)  # chi-square with 63 degrees of freedom
    lag = torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1]
    assert abs(float(lag)) < 6 / math.sqrt(N)
    f32 = fpar.random.uniform(fpar.random.key(0), (N,))
    assert (
        float(f32.max()) < 1.0
        and float(fpar.random.uniform(fpar.random.key(0), (N,), torch.bfloat16).max()) < 1.0
    )


def test_normal_statistics():
    z = fpar.random.normal(fpar.random.key(1), (N,), torch.float64)
    assert abs(float(z.mean())) < 6 / math.sqrt(N)
    assert abs(float(z.var()) - 1) < 6 * math.sqrt(2 / N)
    # fourth moment (kurtosis 3) and the tail mass beyond 3 sigma (0.27%)
    assert abs(float((z**4).mean()) - 3) < 6 * math.sqrt(96 / N)
    tail = float((z.abs() > 3).double().mean())
    assert abs(tail - 0.0026998) < 6 * math.sqrt(0.0027 / N)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_bernoulli_and_dropout_keep_fraction(p):
    b = fpar.random.bernoulli(fpar.random.key(2), p, (N,))
    assert b.dtype == torch.bool
    assert abs(float(b.double().mean()) - p) < 6 * math.sqrt(p * (1 - p) / N)
    rate = 1 - p
    y = fpar.ops.dropout(fpar.random.key(3), torch.ones(N, dtype=torch.float64), rate)
    assert abs(float((y != 0).double().mean()) - p) < 6 * math.sqrt(p * (1 - p) / N)
    assert abs(float(y.mean()) - 1) < 6 * math.sqrt(rate / (1 - rate) / N)  # dropout keeps the mean
    assert fpar.random.bernoulli(fpar.random.key(2), 0.0, (100,)).sum() == 0
    assert fpar.random.bernoulli(fpar.random.key(2), 1.0, (100,)).all()


# torch's stateful random ops inside shard -----------------------------------------------------

RANDOM_CALLS = {
    "torch.rand": lambda x: x + torch.rand(x.shape),
    "torch.randn": lambda x: x + torch.randn(x.shape),
    "torch.randn_like": lambda x: x + torch.randn_like(x),
    "torch.randint": lambda x: x + torch.randint(0, 3, x.shape),
    "torch.bernoulli": lambda x: torch.bernoulli(x.sigmoid()),
    "torch.nn.functional.dropout": lambda x: F.dropout(x, 0.1),
    "nn.Dropout": lambda x: torch.nn.Dropout(0.1)(x),
    "torch.Tensor.uniform_": lambda x: x.clone().uniform_(),
    "torch.Tensor.normal_": lambda x: torch.empty_like(x).normal_(),
}


@pytest.mark.parametrize("name", list(RANDOM_CALLS))
def test_torch_random_ops_inside_shard_raise(name):
    mesh = fpar.make_mesh((2,), ("data",))
    shown = "torch.nn.functional.dropout" if name == "nn.Dropout" else name
    with pytest.raises(
        RuntimeError,
        match=re.escape(shown) + r" was called inside the sharded function.*fpar\.(random|ops\.dropout)",
    ):
        fpar.shard(RANDOM_CALLS[name], mesh, (P("data"),), P("data"))(torch.zeros(4, 3))


def test_inactive_dropout_inside_shard_is_allowed():
    mesh = fpar.make_mesh((2,), ("data",))
    x = torch.randn(4, 3)
    f = fpar.shard(
        lambda x: F.dropout(x, 0.5, training=False) + F.dropout(x, 0.0), mesh, (P("data"),), P("data")
    )
    assert torch.equal(f(x), 2 * x)
    torch.rand(2)  # outside shard torch's generator is untouched


# Bad input ----------------------------------------------------------------------------------


def _in_shard(fn, axes=None):
    mesh = fpar.make_mesh((2, 2), ("data", "tensor")) if axes is None else _mesh(axes)
    return fpar.shard(fn, mesh, (P(),), P())(fpar.random.key(0))


@pytest.mark.parametrize(
    "call,err,match",
    [
        (lambda k: fpar.ops.dropout(k, torch.ones(3), 1.0), ValueError, r"rate=1.0 must be in \[0, 1\)"),
        (lambda k: fpar.ops.dropout(k, torch.ones(3), -0.1), ValueError, r"rate=-0.1 must be in \[0, 1\)"),
        (lambda k: fpar.ops.dropout(k, torch.ones(3), "0.1"), TypeError, r"rate must be a Python number"),
        (
            lambda k: fpar.ops.dropout(k, torch.ones(3, dtype=torch.int64), 0.1),
            TypeError,
            r"x must be a floating",
        ),
        (
            lambda k: fpar.random.uniform(k.float(), (3,)),
            ValueError,
            r"key must be an int64 tensor of shape \(2,\)",
        ),
        (
            lambda k: fpar.random.uniform(torch.zeros(3, dtype=torch.int64), (3,)),
            ValueError,
            r"got dtype torch.int64 and shape \(3,\)",
        ),
        (lambda k: fpar.random.uniform(fpar.random.split(k), (3,)), ValueError, r"index one, e.g. keys\[0\]"),
        (lambda k: fpar.random.normal(0, (3,)), TypeError, r"key must be a key tensor from fpar.random.key"),
        (lambda k: fpar.random.uniform(k, (3,), torch.int32), TypeError, r"dtype must be one of"),
        (lambda k: fpar.random.uniform(k, (3, -1)), ValueError, r"negative size"),
        (lambda k: fpar.random.uniform(k, "abc"), TypeError, r"shape must be a tuple of ints"),
        (lambda k: fpar.random.bernoulli(k, 1.5, (3,)), ValueError, r"p=1.5 is not a probability"),
        (lambda k: fpar.random.split(k, 0), ValueError, r"num must be a positive int"),
        (lambda k: fpar.random.fold_in(k, 1.5), TypeError, r"data must be an int or an integer tensor"),
        (lambda k: fpar.random.fold_in(k, -1), ValueError, r"must be in \[0, 2\*\*64\)"),
        (lambda k: fpar.random.key(1.0), TypeError, r"seed must be a Python int"),
        (lambda k: fpar.random.uniform(k, (4,), spec="data"), TypeError, r"spec must be a fpar.P or None"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_bad_input_outside_shard(call, err, match):
    with pytest.raises(err, match=match):
        call(fpar.random.key(0))


@pytest.mark.parametrize(
    "fn,match",
    [
        (lambda k: fpar.random.uniform(k, (4,), spec=P("data", "tensor")), r"longer than the rank"),
        (
            lambda k: fpar.random.uniform(k, (4,), spec=P("pipe")),
            r"names 'pipe', which is not an axis of the mesh",
        ),
        (
            lambda k: fpar.random.uniform(k, (5, 4), spec=P("data")),
            r"dim 0 of size 5 is not evenly divisible",
        ),
        (lambda k: fpar.ops.dropout(k, torch.ones(4), 0.1, spec=P(None, "data")), r"longer than the rank"),
        (
            lambda k: fpar.ops.dropout(k, torch.ones(4), 0.1, spec=P("model")),
            r"'model', which is not an axis",
        ),
    ],
)
def test_bad_spec_inside_shard(fn, match):
    with pytest.raises(fpar.SpecError, match=match):
        _in_shard(fn)


def test_dropout_spec_must_name_the_axes_x_varies_over():
    mesh = fpar.make_mesh((2, 2), ("data", "tensor"))
    f = fpar.shard(
        lambda x, k: fpar.ops.dropout(k, x, 0.5, spec=P(None, "tensor")),
        mesh,
        (P("data", "tensor"), P()),
        P("data", "tensor"),
    )
    with pytest.raises(fpar.SpecError, match=r"x varies over mesh axis 'data', which the spec does not name"):
        f(torch.ones(4, 4), fpar.random.key(0))


# remat recomputes the same mask ------------------------------------------------------------


def test_remat_recomputes_the_same_mask():
    mesh = fpar.make_mesh((2, 2), ("data", "tensor"))
    k = fpar.random.key(9)
    w = torch.randn(8, 8, dtype=torch.float64)
    x = torch.randn(4, 8, dtype=torch.float64)

    def block(w, x, k):
        h = fpar.ops.dropout(k, torch.tanh(x @ w), 0.5, spec=P("data", "tensor"))
        return fpar.psum(h.sum(), ("data", "tensor"))

    def loss(block):
        return fpar.shard(block, mesh, (P(None, "tensor"), P("data"), P()), P())

    g_plain = torch.func.grad(loss(block))(w, x, k)
    g_remat = torch.func.grad(loss(fpar.optim.remat(block)))(w, x, k)
    g_ref = torch.func.grad(lambda w: fpar.ops.dropout(k, torch.tanh(x @ w), 0.5).sum())(w)
    assert torch.equal(g_plain, g_remat)
    torch.testing.assert_close(g_plain, g_ref)


# Real mesh == in-process -------------------------------------------------------------------


def _real_mesh_draws(seed: int):
    mesh = fpar.make_mesh((2,), ("data",))
    k = fpar.random.key(seed)
    x = torch.arange(24, dtype=torch.float64).reshape(4, 6)

    def per_device(x, k):
        return (
            fpar.random.uniform(k, (4, 6), spec=P("data")),
            fpar.random.normal(k, (6, 3), spec=P(None)),
            fpar.ops.dropout(k, x, 0.5, spec=P("data")),
        )

    specs = (P("data"), P(), P("data"))
    out = fpar.shard(per_device, mesh, (P("data"), P()), specs)(fpar.device_put(x, mesh, P("data")), k)
    try:  # torch's generator is refused on the real mesh too
        fpar.shard(lambda x: F.dropout(x, 0.5), mesh, (P("data"),), P("data"))(
            fpar.device_put(x, mesh, P("data"))
        )
        refused = ""
    except RuntimeError as e:
        refused = str(e)
    return [t.clone() for t in fpar.gather(out, mesh, specs)], refused


@pytest.mark.multiprocess
def test_real_mesh_draws_equal_in_process():
    got = fpar.launch(_real_mesh_draws, 2, 4, timeout=60.0)
    want, refused = _real_mesh_draws(4)
    assert "torch.nn.functional.dropout was called inside the sharded function" in refused
    for per_rank, refused_there in got:
        assert refused_there == refused
        for g, w in zip(per_rank, want):
            assert torch.equal(g, w)


def _gpt_dropout_runs(shape: tuple[int, int]):
    """gpt_loss with dropout on a data x tensor mesh: (loss, grads) twice (traced, then fast call)."""
    mesh = fpar.make_mesh(shape, ("data", "tensor"))
    specs = fpar.ops.gpt_specs(2)
    params = fpar.init(fpar.ops.init_gpt(32, 16, 2, 8, dtype=torch.float64), mesh, specs, seed=0)
    g = torch.Generator().manual_seed(0)
    ids, targets = torch.randint(0, 32, (4, 8), generator=g), torch.randint(0, 32, (4, 8), generator=g)
    ids, targets = fpar.device_put((ids, targets), mesh, P("data"))

    def loss(params, ids, targets, key):
        tok = fpar.ops.gpt_loss(params, ids, targets, axis="tensor", n_heads=4, dropout=0.3, key=key)
        return fpar.pmean(tok.mean(), "data")

    step = fpar.shard(loss, mesh, (specs, P("data"), P("data"), P()), P())
    grad_step = fpar.shard(loss, mesh, (specs, P("data"), P("data"), P()), P())
    key = fpar.random.fold_in(fpar.random.key(0), 3)
    grads = fpar.gather(torch.func.grad(grad_step)(params, ids, targets, key), mesh, specs)
    # the first call with a signature runs traced, later ones fast (no tracking): the dropout
    # sites' batch axes come from the traced call's record there
    keys = [fpar.random.fold_in(fpar.random.key(0), t) for t in (3, 3, 4)]
    losses = [step(params, ids, targets, k).clone() for k in keys]
    return losses, grads


def _real_mesh_gpt_dropout():
    return [_gpt_dropout_runs(shape) for shape in ((2, 1), (1, 2))]


@pytest.mark.multiprocess
def test_real_mesh_gpt_dropout_equals_in_process():
    # data=2: each data rank draws its rows' block of the global masks (not the same mask twice);
    # tensor=2: each tensor rank its heads' block of the attention-probability masks.
    got = fpar.launch(_real_mesh_gpt_dropout, 2, timeout=90.0)
    for i, shape in enumerate(((2, 1), (1, 2))):
        want_losses, want_grads = _gpt_dropout_runs(shape)
        assert not torch.equal(want_losses[0], want_losses[2])  # another key, other masks
        for losses, grads in (per_rank[i] for per_rank in got):
            torch.testing.assert_close(losses, want_losses, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(grads, want_grads, rtol=1e-10, atol=1e-12)


def _torch_dropout_in_a_fast_call():
    mesh = fpar.make_mesh((2,), ("data",))
    state = {"training": False}
    f = fpar.shard(lambda x: F.dropout(x, 0.5, training=state["training"]), mesh, (P("data"),), P("data"))
    x = fpar.device_put(torch.ones(4, 4), mesh, P("data"))
    f(x)  # traced: the dropout is inactive, allowed
    state["training"] = True  # the same signature runs fast now, with no interception
    try:
        f(x)
    except RuntimeError as e:
        return str(e)
    return ""


@pytest.mark.multiprocess
def test_real_mesh_refuses_a_torch_draw_that_first_appears_in_a_fast_call():
    for msg in fpar.launch(_torch_dropout_in_a_fast_call, 2, timeout=60.0):
        assert "a torch random op (torch.rand, torch.randn, torch.nn.functional.dropout, ...) drew" in msg
        assert "Use fpar.random with an explicit key instead" in msg


# Dropout in the GPT layers: the same masks at every layout -----------------------------------


def _gpt_loss_and_grads(axes: dict, sequence_parallel: bool, rate: float):
    mesh = _mesh(axes)
    specs = fpar.ops.gpt_specs(2)
    params = fpar.init(fpar.ops.init_gpt(32, 16, 2, 8, dtype=torch.float64), mesh, specs, seed=0)
    g = torch.Generator().manual_seed(0)
    ids, targets = torch.randint(0, 32, (4, 8), generator=g), torch.randint(0, 32, (4, 8), generator=g)

    def loss(params, ids, targets, key):
        tok = fpar.ops.gpt_loss(
            params,
            ids,
            targets,
            axis="tensor",
            n_heads=4,
            sequence_parallel=sequence_parallel,
            dropout=rate,
            key=key,
        )
        return fpar.pmean(tok.mean(), "data")

    step = fpar.shard(loss, mesh, (specs, P("data"), P("data"), P()), P())
    key = fpar.random.fold_in(fpar.random.key(0), 17)
    grads, loss = (
        torch.func.grad(step, has_aux=False)(params, ids, targets, key),
        step(params, ids, targets, key),
    )
    return loss, grads


@pytest.mark.parametrize("axes,sp", [({"data": 2, "tensor": 2}, False), ({"data": 2, "tensor": 4}, True)])
def test_gpt_dropout_does_not_depend_on_the_layout(axes, sp):
    ref_loss, ref_grads = _gpt_loss_and_grads({"data": 1, "tensor": 1}, False, 0.3)
    plain_loss, _ = _gpt_loss_and_grads({"data": 1, "tensor": 1}, False, 0.0)
    loss, grads = _gpt_loss_and_grads(axes, sp, 0.3)
    assert abs(float(ref_loss - plain_loss)) > 1e-3  # dropout is on
    torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grads, ref_grads, rtol=1e-8, atol=1e-10)


def _ulysses_or_attention(axes: dict, ulysses: bool, rate: float):
    """Attention with probability dropout: Ulysses over "tensor" (x split over data and sequence),
    or plain head-parallel attention (x split over data only), from the same global values."""
    mesh = _mesh(axes)
    d, n_heads = 16, 4
    params = fpar.ops.init_attention(d, dtype=torch.float64)
    x = torch.randn(4, 8, d, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    specs = fpar.ops.attention_specs(None if ulysses else "tensor")
    x_spec = P("data", "tensor") if ulysses else P("data")
    layer_fn = fpar.ops.ulysses_attention if ulysses else fpar.ops.attention

    def layer(p, x, key):
        return layer_fn(p, x, axis="tensor", n_heads=n_heads, dropout=rate, key=key)

    def loss(p, x, key):
        return fpar.psum(layer(p, x, key).square().sum(), "data" if not ulysses else ("data", "tensor"))

    f = fpar.shard(loss, mesh, (specs, x_spec, P()), P())
    placed = fpar.init(params, mesh, specs)
    key = fpar.random.fold_in(fpar.random.key(1), 5)
    grads = torch.func.grad(f, argnums=(0, 1))(placed, fpar.device_put(x, mesh, x_spec), key)
    return (
        f(placed, fpar.device_put(x, mesh, x_spec), key),
        fpar.gather(grads[0], mesh, specs),
        fpar.gather(grads[1], mesh, x_spec),
    )


@pytest.mark.parametrize("axes", [{"data": 1, "tensor": 2}, {"data": 2, "tensor": 2}])
def test_ulysses_attention_dropout_is_the_unsharded_attentions(axes):
    """Ulysses draws the heads block of the same global probability mask as ``attention``."""
    ref = _ulysses_or_attention({"data": 1, "tensor": 1}, False, 0.3)
    plain = _ulysses_or_attention({"data": 1, "tensor": 1}, False, 0.0)
    got = _ulysses_or_attention(axes, True, 0.3)
    assert abs(float(ref[0] - plain[0])) > 1e-3  # dropout is on
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def _ring(axes: dict, rate: float, causal: bool):
    """Ring attention with probability dropout (sequence over "tensor", batch over "data"), values and grads."""
    mesh = _mesh(axes)
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(4, 8, 2, 3, generator=g, dtype=torch.float64) for _ in range(3))
    spec = P("data", "tensor")
    key = fpar.random.fold_in(fpar.random.key(2), 9)

    def loss(q, k, v, key):
        o = fpar.ops.ring_attention(q, k, v, axis="tensor", causal=causal, dropout=rate, key=key)
        return fpar.psum(o.square().sum(), ("data", "tensor"))

    f = fpar.shard(loss, mesh, (spec, spec, spec, P()), P())
    placed = fpar.device_put((q, k, v), mesh, spec)
    grads = torch.func.grad(f, argnums=(0, 1, 2))(*placed, key)
    return f(*placed, key), fpar.gather(grads, mesh, spec), (q, k, v, key)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
    "axes", [{"data": 1, "tensor": 2}, {"data": 2, "tensor": 2}, {"data": 1, "tensor": 4}]
)
def test_ring_attention_dropout_is_dropout_of_the_unsharded_probabilities(axes, causal):
    """Each ring step draws its key block's part of one global mask: the result is
    ``dropout(softmax(q k^T / sqrt(K))) v`` of the whole sequence, with the same key."""
    value, grads, (q, k, v, key) = _ring(axes, 0.3, causal)

    def unsharded(q, k, v):
        drop = lambda p: fpar.ops.dropout(key, p, 0.3)  # noqa: E731
        return fpar.ops._megatron.attend(q, k, v, causal=causal, drop=drop).square().sum()

    want_grads = torch.func.grad(unsharded, argnums=(0, 1, 2))(q, k, v)
    plain = fpar.ops._megatron.attend(q, k, v, causal=causal).square().sum()
    assert abs(float(unsharded(q, k, v) - plain)) > 1e-3  # dropout is on
    torch.testing.assert_close(value, unsharded(q, k, v), rtol=1e-9, atol=1e-11)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def _real_mesh_sequence_dropout():
    """Ring (twice: the second call runs the cached plan) and Ulysses dropout on 2 processes."""
    ring = [_ring({"data": 1, "tensor": 2}, 0.3, True)[:2] for _ in range(2)]
    return ring, _ulysses_or_attention({"data": 1, "tensor": 2}, True, 0.3)


def test_real_mesh_sequence_parallel_dropout_equals_in_process():
    got = fpar.launch(_real_mesh_sequence_dropout, 2, timeout=90.0)
    want_ring = _ring({"data": 1, "tensor": 2}, 0.3, True)[:2]
    want_uly = _ulysses_or_attention({"data": 1, "tensor": 2}, True, 0.3)
    for ring, uly in got:
        for call in ring:
            torch.testing.assert_close(call, want_ring, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(uly, want_uly, rtol=1e-10, atol=1e-12)


def test_layer_dropout_needs_a_key():
    mesh = fpar.make_mesh((2,), ("tensor",))
    params = fpar.init(fpar.ops.init_gpt_block(16), mesh, fpar.ops.gpt_block_specs())
    f = fpar.shard(
        lambda p, x: fpar.ops.gpt_block(p, x, axis="tensor", n_heads=2, dropout=0.1),
        mesh,
        (fpar.ops.gpt_block_specs(), P()),
        P(),
    )
    with pytest.raises(ValueError, match=r"dropout=0.1 needs key="):
        f(params, torch.randn(2, 4, 16))


def test_accumulate_folds_the_microbatch_index_into_the_key():
    mesh = fpar.make_mesh((2,), ("data",))
    w = torch.randn(6, 5, dtype=torch.float64)
    x = torch.randn(8, 6, dtype=torch.float64)
    k = fpar.random.key(21)

    def loss(w, x, key):
        return fpar.pmean((fpar.ops.dropout(key, x @ w, 0.5, spec=P("data")) ** 2).mean(), "data")

    sharded = fpar.shard(loss, mesh, (P(), P("data"), P()), P())
    grad_fn = lambda w, x, key: (torch.func.grad(sharded)(w, x, key), sharded(w, x, key))  # noqa: E731
    g, value = fpar.optim.accumulate(grad_fn, 2, mesh, P("data"), key_arg=2)(w, x, k)

    def plain(w, rows, key):
        return (fpar.ops.dropout(key, rows @ w, 0.5) ** 2).mean()

    # microbatch i = piece i of each device's block of rows, with key fold_in(k, i)
    micro = [x.reshape(2, 2, 2, 6)[:, i].reshape(4, 6) for i in range(2)]
    want_g = sum(torch.func.grad(plain)(w, micro[i], fpar.random.fold_in(k, i)) for i in range(2)) / 2
    want_v = sum(plain(w, micro[i], fpar.random.fold_in(k, i)) for i in range(2)) / 2
    torch.testing.assert_close(g, want_g)
    torch.testing.assert_close(value, want_v)
    with pytest.raises(ValueError, match=r"key_arg=1 must be the position"):
        fpar.optim.accumulate(grad_fn, 2, mesh, P("data"), key_arg=1)


# Checkpoints store the key: a resumed run reproduces the uninterrupted run --------------------


def _train(mesh, steps: int, state: dict, ckpt=None, stop=None) -> list[float]:
    def loss(w, x, key):
        h = fpar.ops.dropout(key, torch.tanh(x @ w), 0.5, spec=P("data"))
        return fpar.pmean((h**2).mean(), "data")

    sharded = fpar.shard(loss, mesh, (P(), P("data"), P()), P())
    x = torch.randn(8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    losses = []
    for step in range(state["step"], steps):
        key = fpar.random.fold_in(state["key"], step)
        value, g = sharded(state["w"], x, key), torch.func.grad(sharded)(state["w"], x, key)
        state = {"w": state["w"] - 0.1 * g, "key": state["key"], "step": step + 1}
        losses.append(float(value))
        if stop is not None and step + 1 == stop:
            fpar.checkpoint.save(ckpt, state, mesh, P(), step=step + 1)
            break
    return losses


def test_resumed_run_reproduces_the_losses(tmp_path):
    mesh = fpar.make_mesh((2,), ("data",))
    start = {"w": torch.randn(6, 6, dtype=torch.float64), "key": fpar.random.key(123), "step": 0}
    whole = _train(mesh, 6, dict(start))
    first = _train(mesh, 6, dict(start), ckpt=tmp_path, stop=3)
    loaded = fpar.checkpoint.load(tmp_path, mesh, P())
    assert loaded["key"].dtype == torch.int64 and torch.equal(loaded["key"], start["key"])
    assert first + _train(mesh, 6, loaded) == whole  # exactly
    one = fpar.make_mesh((1,), ("data",))  # on another mesh: the same masks, sums in another order
    torch.testing.assert_close(first + _train(one, 6, fpar.checkpoint.load(tmp_path, one, P())), whole)


# Dropout in the 2D / 2.5D / 3D MLPs: the block of the unsharded MLP's masks -------------------

TP_MODES = {
    "2d": (
        (2, 2),
        ("tensor_row", "tensor_col"),
        lambda: fpar.ops.specs_2d(ndim=3),
        fpar.ops.mlp_2d,
        {"row_axis": "tensor_row", "col_axis": "tensor_col"},
    ),
    "2.5d": (
        (2, 2, 2),
        ("tensor_dep", "tensor_row", "tensor_col"),
        lambda: fpar.ops.specs_2p5d(ndim=3),
        fpar.ops.mlp_2p5d,
        {"dep_axis": "tensor_dep", "row_axis": "tensor_row", "col_axis": "tensor_col"},
    ),
    "3d": (
        (2, 2, 2),
        ("tensor_x", "tensor_y", "tensor_z"),
        lambda: fpar.ops.specs_3d(ndim=3),
        fpar.ops.mlp_3d,
        {"input_axis": "tensor_y", "weight_axis": "tensor_x", "output_axis": "tensor_z"},
    ),
}


@pytest.mark.parametrize("mode", TP_MODES)
def test_multi_dim_mlp_dropout_is_the_unsharded_mlps(mode):
    shape, names, specs, mlp, axes = TP_MODES[mode]
    s = specs()
    g = torch.Generator().manual_seed(0)
    p = {
        k: torch.randn(shp, generator=g, dtype=torch.float64)
        for k, shp in {"w_in": (8, 16), "b_in": (16,), "w_out": (16, 8), "b_out": (8,)}.items()
    }
    x = torch.randn(8, 2, 8, generator=g, dtype=torch.float64)
    k = fpar.random.key(31)
    layer = fpar.shard(
        lambda p, x, k: mlp(p, x, dropout=0.25, key=k, **axes),
        fpar.make_mesh(shape, names),
        (s.mlp, s.x, P()),
        s.x,
    )

    def reference(p, x):
        h = fpar.ops.dropout(fpar.random.fold_in(k, 0), F.gelu(x @ p["w_in"] + p["b_in"]), 0.25)
        return fpar.ops.dropout(fpar.random.fold_in(k, 1), h @ p["w_out"] + p["b_out"], 0.25)

    out, vjp = torch.func.vjp(lambda p, x: layer(p, x, k), p, x)
    ref, ref_vjp = torch.func.vjp(reference, p, x)
    torch.testing.assert_close(out, ref)
    cot = torch.randn(out.shape, generator=g, dtype=torch.float64)
    torch.testing.assert_close(vjp(cot), ref_vjp(cot))


# Pipelines: microbatch j has the key fold_in(key, j), chunk k fold_in(key_j, k) -------------------


def _pipe_problem(L: int, m: int):
    g = torch.Generator().manual_seed(5)
    stages = {
        "a": torch.randn(L, 4, 8, dtype=torch.float64, generator=g) * 0.5,
        "b": torch.randn(L, 8, 4, dtype=torch.float64, generator=g) * 0.5,
    }
    first = {"emb": torch.randn(7, 4, dtype=torch.float64, generator=g)}
    last = {"head": torch.randn(4, 3, dtype=torch.float64, generator=g)}
    xs, ts = torch.randint(0, 7, (m, 4), generator=g), torch.randn(m, 4, 3, dtype=torch.float64, generator=g)
    return stages, first, last, xs, ts


def _pipe_block(w, h, key, spec=None):
    return h + fpar.ops.dropout(key, torch.tanh(h @ w["a"]) @ w["b"], 0.4, spec=spec)


@pytest.mark.parametrize("name,v", [("1f1b", 1), ("interleaved", 2), ("zb_v", 2)])
def test_pipeline_dropout_equals_the_unpipelined_model_with_per_microbatch_keys(name, v):
    p, m = 2, 4
    mesh = fpar.make_mesh((p, 2), ("pipe", "data"))
    sub, rows = mesh.submesh(("data",)), P("data")
    block = lambda w, h, k: _pipe_block(w, h, k, rows)  # noqa: E731
    stage = fpar.shard(block, sub, ({"a": P(), "b": P()}, rows, P()), rows)
    first = fpar.shard(
        lambda w, x, k: fpar.ops.dropout(k, w["emb"][x], 0.4, spec=rows), sub, ({"emb": P()}, rows, P()), rows
    )
    loss = fpar.shard(
        lambda w, h, t: fpar.pmean(((h @ w["head"] - t) ** 2).mean(), "data"),
        sub,
        ({"head": P()}, rows, rows),
        P(),
    )
    sch = {
        "1f1b": lambda: fpar.pipeline.one_f_one_b(p, m),
        "interleaved": lambda: fpar.pipeline.interleaved_1f1b(p, m, v),
        "zb_v": lambda: fpar.pipeline.zb_v(p, m),
    }[name]()
    step = fpar.pipeline.pipeline(stage, sch, mesh, loss=loss, first=first)
    stages, first_p, last_p, xs, ts = _pipe_problem(p * v, m)
    key = fpar.random.key(77)
    stacked = fpar.pipeline.stage_major(stages, p, v, layout=sch.layout)
    params = {"stages": stacked, "first": first_p, "last": last_p}
    res = step(params, xs, ts, key=key)

    def reference(stages, first_p, last_p):  # unpipelined, unsharded, the documented keys
        total = 0.0
        for j in range(m):
            key_j = fpar.random.fold_in(key, j)
            h = fpar.ops.dropout(key_j, first_p["emb"][xs[j]], 0.4)
            for k in range(p * v):
                h = _pipe_block({"a": stages["a"][k], "b": stages["b"][k]}, h, fpar.random.fold_in(key_j, k))
            total = total + ((h @ last_p["head"] - ts[j]) ** 2).mean()
        return total / m

    want = reference(stages, first_p, last_p)
    g_stages, g_first, g_last = torch.func.grad(reference, argnums=(0, 1, 2))(stages, first_p, last_p)
    torch.testing.assert_close(res.loss, want)
    want_stages = fpar.pipeline.stage_major(g_stages, p, v, layout=sch.layout)
    torch.testing.assert_close(res.grads["stages"], want_stages)
    torch.testing.assert_close(res.grads["first"], g_first)
    torch.testing.assert_close(res.grads["last"], g_last)
    assert not torch.equal(step(params, xs, ts, key=fpar.random.key(78)).loss, res.loss)  # the key matters
    with pytest.raises(TypeError, match=r"step\(\.\.\., key=\) must be a fpar.random key"):
        step(params, xs, ts, key=torch.zeros(2))


# The optional compiled generator: the same bits -----------------------------------------------


def test_compiled_generator_gives_the_eager_bits():
    k = fpar.random.fold_in(fpar.random.key(3), 11)
    draws = [
        lambda: fpar.random.bits(k, (5, 12)),  # rows of whole Philox blocks
        lambda: fpar.random.bits(k, (3, 7)),  # element-wise counters
        lambda: fpar.random.uniform(k, (1, 6), dtype=torch.float64),  # two words per element
        lambda: fpar.random.bernoulli(k, 0.3, (40, 33)),
        lambda: fpar.random.uniform(k, (6, 8)),
    ]
    eager = [d() for d in draws]
    fpar.random.set_compiled(True)
    try:
        compiled = [d() for d in draws]
        kat = fpar.random.bits(fpar.random.key(0), (8,))[:4]  # counter 0, key 0: Random123's zeros vector
    finally:
        fpar.random.set_compiled(False)
    for a, b in zip(compiled, eager):
        assert torch.equal(a, b)
    assert kat.tolist() == list(KAT[0][2])
    with pytest.raises(TypeError, match=r"set_compiled: enabled must be a bool"):
        fpar.random.set_compiled(1)


# ViT blocks (non-causal attention, residual dropout as in examples/train_vit.py) -------------------


def _vit_loss_and_grads(axes: dict):
    mesh = _mesh(axes)
    specs = {"attn": fpar.ops.attention_specs(), "mlp": fpar.ops.mlp_specs()}
    init = {"attn": fpar.ops.init_attention(16, dtype=torch.float64)}
    init["mlp"] = fpar.ops.init_mlp(16, dtype=torch.float64)
    params = fpar.init(init, mesh, specs, seed=1)
    x = torch.randn(4, 5, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    def block(p, x, key):
        k = [fpar.random.fold_in(key, i) for i in range(3)]
        a = fpar.ops.attention(
            p["attn"], x, axis="tensor", n_heads=4, causal=False, dropout=0.2, key=k[0], batch_axes="data"
        )
        x = x + fpar.ops.dropout(k[1], a, 0.2, spec=P("data"))
        h = x + fpar.ops.dropout(k[2], fpar.ops.mlp(p["mlp"], x, axis="tensor"), 0.2, spec=P("data"))
        return fpar.pmean((h**2).mean(), "data")

    f = fpar.shard(block, mesh, (specs, P("data"), P()), P())
    key = fpar.random.key(5)
    return f(params, x, key), torch.func.grad(f)(params, x, key)


def test_vit_block_dropout_does_not_depend_on_the_layout():
    ref_loss, ref_grads = _vit_loss_and_grads({"data": 1, "tensor": 1})
    loss, grads = _vit_loss_and_grads({"data": 2, "tensor": 2})
    torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grads, ref_grads, rtol=1e-8, atol=1e-10)


def _pipe_dropout_run():
    """A 2-stage 1F1B pipeline with dropout and a step key: (loss, grads), on the mesh make_mesh gives."""
    mesh = fpar.make_mesh((2,), ("pipe",))
    sch = fpar.pipeline.one_f_one_b(2, 4)
    step = fpar.pipeline.pipeline(
        _pipe_block,
        sch,
        mesh,
        loss=lambda w, h, t: ((h @ w["head"] - t) ** 2).mean(),
        first=lambda w, x, k: fpar.ops.dropout(k, w["emb"][x], 0.4),
    )
    stages, first_p, last_p, xs, ts = _pipe_problem(2, 4)
    stacked = fpar.device_put(fpar.pipeline.stage_major(stages, 2, 1, layout=sch.layout), mesh, P("pipe"))
    res = step({"stages": stacked, "first": first_p, "last": last_p}, xs, ts, key=fpar.random.key(77))
    return res.loss, fpar.gather(res.grads["stages"], mesh, P("pipe")), res.grads["first"], res.grads["last"]


@pytest.mark.multiprocess
def test_real_mesh_pipeline_keys_equal_in_process():
    want = _pipe_dropout_run()
    for got in fpar.launch(_pipe_dropout_run, 2, timeout=60.0):
        torch.testing.assert_close(got, want)
