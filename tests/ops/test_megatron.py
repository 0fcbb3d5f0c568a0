"""Megatron 1D layers: values, gradients, parameter memory and traffic equal the unsharded layer / formulas."""

from __future__ import annotations

import math

import optree
import pytest
import torch
import unsharded as ref
from hypothesis import given
from hypothesis import strategies as st
from opstest import (
    DTYPE,
    FEW,
    ITEM,
    all_reduce,
    block_shapes,
    bytes_of,
    check_values_and_grads,
    mesh,
    randn,
    randomize,
    sharded,
    traffic,
)

import fpar
import fpar.ops as ops
from fpar import P

SIZES = st.sampled_from([1, 2, 4])


# Values and gradients ---------------------------------------------------------------------------


@FEW
@given(n=SIZES, b=st.integers(1, 3), d=st.integers(1, 5), f=st.integers(1, 3), bias=st.booleans())
def test_column_then_row_linear(n, b, d, f, bias):
    """column_linear's output stays split; row_linear completes it: both equal x @ w + b."""
    x, w1, w2 = randn(b, 2, d, seed=1), randn(d, n * f, seed=2), randn(n * f, d, seed=3)
    b1, b2 = (randn(n * f, seed=4), randn(d, seed=5)) if bias else (None, None)
    col = sharded(
        ops.column_linear,
        mesh(n),
        (P(), P(None, "tensor"), P("tensor") if bias else None),
        P(None, None, "tensor"),
    )
    row = sharded(
        ops.row_linear, mesh(n), (P(None, None, "tensor"), P("tensor", None), P() if bias else None), P()
    )
    check_values_and_grads(col, ref.linear, (x, w1, b1), (0, 1, 2) if bias else (0, 1))
    h = randn(b, 2, n * f, seed=6)
    check_values_and_grads(row, ref.linear, (h, w2, b2), (0, 1, 2) if bias else (0, 1))


@FEW
@given(n=SIZES, data=st.sampled_from([1, 2]), d=st.integers(1, 6), f=st.integers(1, 3), bias=st.booleans())
def test_mlp(n, data, d, f, bias):
    p = randomize(ops.init_mlp(d, n * f, bias=bias), seed=n + d)
    x = randn(2 * data, 3, d, seed=7)
    f_ = sharded(
        ops.mlp,
        mesh(n, data),
        (ops.mlp_specs(bias=bias), P("data") if data > 1 else P()),
        P("data") if data > 1 else P(),
    )
    check_values_and_grads(f_, ref.mlp, (p, x), (0, 1))


@FEW
@given(
    n=SIZES,
    heads=st.integers(1, 2),
    k=st.integers(1, 3),
    t=st.integers(1, 5),
    causal=st.booleans(),
    bias=st.booleans(),
)
def test_attention(n, heads, k, t, causal, bias):
    n_heads = n * heads
    d = n_heads * k
    p = randomize(ops.init_attention(d, bias=bias), seed=t)
    x = randn(2, t, d, seed=8)
    f = sharded(
        ops.attention, mesh(n), (ops.attention_specs(bias=bias), P()), P(), n_heads=n_heads, causal=causal
    )
    check_values_and_grads(f, lambda p, x: ref.attention(p, x, n_heads, causal), (p, x), (0, 1))


@FEW
@given(n=SIZES, v=st.integers(1, 4), d=st.integers(1, 4), data=st.sampled_from([1, 2]))
def test_vocab_embedding(n, v, d, data):
    vocab = n * v
    ids = torch.randint(0, vocab, (2 * data, 5), generator=torch.Generator().manual_seed(v))
    w = randn(vocab, d, seed=9)
    spec = P("data") if data > 1 else P()
    f = sharded(ops.vocab_embedding, mesh(n, data), (spec, P("tensor", None)), spec)
    check_values_and_grads(f, ref.embedding, (ids, w), 1)


@FEW
@given(n=SIZES, v=st.integers(1, 4), t=st.integers(1, 4), scale=st.sampled_from([1.0, 30.0]))
def test_vocab_cross_entropy(n, v, t, scale):
    """Large logits too: the pmax shift must keep exp finite; grads are softmax - onehot."""
    vocab = n * v
    logits = randn(2, t, vocab, seed=t, scale=scale)
    targets = torch.randint(0, vocab, (2, t), generator=torch.Generator().manual_seed(v))
    f = sharded(ops.vocab_cross_entropy, mesh(n), (P(None, None, "tensor"), P()), P())
    check_values_and_grads(f, ref.cross_entropy, (logits, targets), 0)
    # The backward is the closed form of Megatron's _VocabParallelCrossEntropy.
    g = torch.func.grad(lambda lg: f(lg, targets).sum())(logits)
    torch.testing.assert_close(
        g, torch.softmax(logits, -1) - torch.nn.functional.one_hot(targets, vocab).to(DTYPE)
    )


def test_vocab_cross_entropy_ties_in_the_max():
    """Equal maxima on several devices (pmax ties) still give the exact loss and gradient."""
    logits = torch.zeros(1, 2, 8, dtype=DTYPE)
    logits[..., 1] = logits[..., 5] = 3.0
    targets = torch.tensor([[5, 0]])
    f = sharded(ops.vocab_cross_entropy, mesh(2), (P(None, None, "tensor"), P()), P())
    check_values_and_grads(f, ref.cross_entropy, (logits, targets), 0)


# Parameter memory -------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 4])
def test_weight_blocks_are_one_nth(n):
    """Every matrix of the MLP, attention and embedding is 1/n per device; replicated biases are whole."""
    d, f, v = 8, 16, 12
    params = {
        "mlp": randomize(ops.init_mlp(d, f)),
        "attn": randomize(ops.init_attention(d)),
        "emb": randn(v, d),
    }
    specs = {"mlp": ops.mlp_specs(), "attn": ops.attention_specs(), "emb": P("tensor", None)}
    blocks = block_shapes(params, specs, mesh(n))
    flat_paths, flat_leaves, _ = optree.tree_flatten_with_path(params)
    full = dict(zip(flat_paths, (tuple(t.shape) for t in flat_leaves)))
    replicated = {("mlp", "b_out"), ("attn", "b_o")}
    for path, shape in full.items():
        ratio = math.prod(shape) // math.prod(blocks[path])
        assert ratio == (1 if path in replicated else n), (path, shape, blocks[path])
    assert blocks[("attn", "w_qkv")] == (d, 3, d // n)  # q, k, v of the same heads on one device
    assert blocks[("emb",)] == (v // n, d)


# Traffic: exact bytes per device ----------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 4])
def test_traffic_linear_layers(n):
    """column_linear: nothing forward, one all-reduce of the input gradient (f); row_linear: one forward (g)."""
    b, t, d, f = 2, 3, 4, 8
    x, w1, w2 = randn(b, t, d), randn(d, f), randn(f, d)
    col = sharded(ops.column_linear, mesh(n), (P(), P(None, "tensor")), P(None, None, "tensor"))
    row = sharded(ops.row_linear, mesh(n), (P(None, None, "tensor"), P("tensor", None)), P())
    assert bytes_of(traffic(col, (x, w1))) == {}
    assert bytes_of(traffic(col, (x, w1), argnums=(0, 1))) == {"psum": all_reduce(n, b * t * d * ITEM)}
    assert bytes_of(traffic(col, (x, w1), argnums=1)) == {}  # x a constant: no input gradient to reduce
    h = randn(b, t, f)
    assert bytes_of(traffic(row, (h, w2))) == {"psum": all_reduce(n, b * t * d * ITEM)}
    assert bytes_of(traffic(row, (h, w2), argnums=(0, 1))) == {"psum": all_reduce(n, b * t * d * ITEM)}


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("layer", ["mlp", "attention"])
def test_traffic_mlp_and_attention(n, layer):
    """One all-reduce of b*s*h forward (g) and one backward (f): Megatron's count, Fig. 3 of 1909.08053."""
    b, t, d = 2, 4, 8
    x = randn(b, t, d)
    if layer == "mlp":
        p, specs, kw = randomize(ops.init_mlp(d)), ops.mlp_specs(), {}
    else:
        p, specs, kw = randomize(ops.init_attention(d)), ops.attention_specs(), {"n_heads": 4}
    f = sharded(getattr(ops, layer), mesh(n), (specs, P()), P(), **kw)
    one = all_reduce(n, b * t * d * ITEM)
    fwd = traffic(f, (p, x))
    assert fwd["tensor"]["psum"] == {"calls": 1, "bytes": one}
    both = traffic(f, (p, x), argnums=(0, 1))
    assert both["tensor"]["psum"] == {"calls": 2, "bytes": 2 * one}
    assert set(both) == {"tensor"} and set(both["tensor"]) == {"psum"}


@pytest.mark.parametrize("n", [2, 4])
def test_traffic_vocab_embedding_and_loss(n):
    """Embedding: one all-reduce of [B, T, D] forward, none backward.  Loss: three of [B, T], none backward."""
    b, t, d, v = 2, 4, 8, 16
    ids = torch.randint(0, v, (b, t))
    emb = sharded(ops.vocab_embedding, mesh(n), (P(), P("tensor", None)), P())
    stats = traffic(emb, (ids, randn(v, d)), argnums=1)
    assert stats["tensor"]["psum"] == {"calls": 1, "bytes": all_reduce(n, b * t * d * ITEM)}
    assert set(stats["tensor"]) == {"psum"}
    ce = sharded(ops.vocab_cross_entropy, mesh(n), (P(None, None, "tensor"), P()), P())
    stats = traffic(ce, (randn(b, t, v), ids), argnums=0)
    tok = all_reduce(n, b * t * ITEM)  # one number per token: b*s, not b*s*V
    assert stats["tensor"] == {"pmax": {"calls": 1, "bytes": tok}, "psum": {"calls": 2, "bytes": 2 * tok}}


# Errors -----------------------------------------------------------------------------------------


def test_heads_not_divisible_by_axis():
    p = randomize(ops.init_attention(8))
    f = sharded(ops.attention, mesh(4), (ops.attention_specs(), P()), P(), n_heads=2)
    with pytest.raises(ValueError, match="n_heads=2 is not divisible by the axis size 4"):
        f(p, randn(1, 2, 8))


def test_wrong_weight_spec_is_explained():
    """A row-split weight given to column_linear: the message names the spec to use."""
    f = sharded(ops.column_linear, mesh(2), (P(), P("tensor", None)), P(None, "tensor"))
    with pytest.raises(ValueError, match=r"spec P\(None, axis\)"):
        f(randn(3, 8), randn(8, 4))
    p = randomize(ops.init_attention(8))
    bad = dict(ops.attention_specs(), w_qkv=P(None, "tensor", None))
    with pytest.raises(fpar.SpecError):  # 3 is not divisible by 2: fpar itself refuses
        sharded(ops.attention, mesh(2), (bad, P()), P(), n_heads=2)(p, randn(1, 2, 8))
    bad = dict(ops.attention_specs(), w_qkv=P())
    with pytest.raises(ValueError, match=r"expected \(8, 3, 4\).*P\(None, None, axis\)"):
        sharded(ops.attention, mesh(2), (bad, P()), P(), n_heads=2)(p, randn(1, 2, 8))


def test_type_and_key_errors():
    emb = sharded(ops.vocab_embedding, mesh(2), (P(), P("tensor", None)), P())
    with pytest.raises(TypeError, match="integer tensor of token ids"):
        emb(randn(2, 3), randn(4, 2))
    mlp = sharded(ops.mlp, mesh(2), ({"w_in": P(None, "tensor"), "w_ot": P("tensor")}, P()), P())
    with pytest.raises(ValueError, match=r"missing \['w_out'\].*unknown \['w_ot'\].*mlp_specs"):
        mlp({"w_in": randn(2, 4), "w_ot": randn(4, 2)}, randn(1, 2))
    col = fpar.shard(lambda x, w: ops.column_linear(x, w, axis=0), mesh(2), (P(), P(None, "tensor")), P())
    with pytest.raises(TypeError, match="axis must be a mesh axis name"):
        col(randn(1, 2), randn(2, 4))
    with pytest.raises(fpar.UnboundAxisError, match="outside fpar.shard"):
        ops.row_linear(randn(1, 2), randn(2, 2), axis="tensor")
