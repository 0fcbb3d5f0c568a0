"""Sequence parallelism (Megatron-SP, Ulysses, ring attention): values, gradients, memory and traffic."""

from __future__ import annotations

import pytest
import torch
import unsharded as ref
from hypothesis import given
from hypothesis import strategies as st
from opstest import (
    FEW,
    ITEM,
    all_gather,
    all_reduce,
    all_to_all,
    block_shapes,
    bytes_of,
    check_values_and_grads,
    mesh,
    randn,
    randomize,
    reduce_scatter,
    sharded,
    traffic,
)

import fpar
import fpar.ops as ops
from fpar import P

SIZES = st.sampled_from([1, 2, 4])
SEQ = P(None, "tensor")  # [B, T, ...] split along the sequence


# Values and gradients ---------------------------------------------------------------------------


@FEW
@given(n=SIZES, tb=st.integers(1, 3), d=st.integers(1, 5), f=st.integers(1, 3), bias=st.booleans())
def test_sp_mlp(n, tb, d, f, bias):
    p = randomize(ops.init_mlp(d, n * f, bias=bias), seed=d)
    x = randn(2, n * tb, d, seed=1)
    layer = sharded(ops.sp_mlp, mesh(n), (ops.mlp_specs(bias=bias), SEQ), SEQ)
    check_values_and_grads(layer, ref.mlp, (p, x), (0, 1))


@FEW
@given(n=SIZES, heads=st.integers(1, 2), k=st.integers(1, 3), tb=st.integers(1, 3), causal=st.booleans())
def test_sp_attention(n, heads, k, tb, causal):
    n_heads = n * heads
    p = randomize(ops.init_attention(n_heads * k), seed=k)
    x = randn(2, n * tb, n_heads * k, seed=2)
    layer = sharded(
        ops.sp_attention, mesh(n), (ops.attention_specs(), SEQ), SEQ, n_heads=n_heads, causal=causal
    )
    check_values_and_grads(layer, lambda p, x: ref.attention(p, x, n_heads, causal), (p, x), (0, 1))


@FEW
@given(n=SIZES, v=st.integers(1, 3), tb=st.integers(1, 3), d=st.integers(1, 4))
def test_sp_vocab_embedding(n, v, tb, d):
    ids = torch.randint(0, n * v, (2, n * tb), generator=torch.Generator().manual_seed(d))
    w = randn(n * v, d, seed=3)
    layer = sharded(ops.sp_vocab_embedding, mesh(n), (P(), P("tensor", None)), SEQ)
    check_values_and_grads(layer, ref.embedding, (ids, w), 1)


@FEW
@given(n=SIZES, heads=st.integers(1, 2), k=st.integers(1, 3), tb=st.integers(1, 3), causal=st.booleans())
def test_ulysses_attention(n, heads, k, tb, causal):
    n_heads = n * heads
    p = randomize(ops.init_attention(n_heads * k), seed=k + 1)
    x = randn(2, n * tb, n_heads * k, seed=4)
    layer = sharded(
        ops.ulysses_attention, mesh(n), (ops.attention_specs(None), SEQ), SEQ, n_heads=n_heads, causal=causal
    )
    check_values_and_grads(layer, lambda p, x: ref.attention(p, x, n_heads, causal), (p, x), (0, 1))


@FEW
@given(
    n=st.sampled_from([1, 2, 3, 4]),
    h=st.integers(1, 2),
    k=st.integers(1, 3),
    tb=st.integers(1, 3),
    causal=st.booleans(),
    scale=st.sampled_from([1.0, 20.0]),
)
def test_ring_attention(n, h, k, tb, causal, scale):
    """Large scores too: the online softmax's rescaling must stay exact."""
    q, kk, v = (randn(2, n * tb, h, k, seed=s, scale=scale if s == 5 else 1.0) for s in (5, 6, 7))
    layer = sharded(ops.ring_attention, mesh(n), (SEQ, SEQ, SEQ), SEQ, causal=causal)
    check_values_and_grads(layer, lambda q, k, v: ref.sdpa(q, k, v, causal), (q, kk, v), (0, 1, 2))


@FEW
@given(n=SIZES, n_heads=st.integers(1, 3), k=st.integers(1, 2), tb=st.integers(1, 3))
def test_ring_self_attention(n, n_heads, k, tb):
    """Any number of heads: the ring splits the sequence, not the heads."""
    p = randomize(ops.init_attention(n_heads * k), seed=n_heads)
    x = randn(2, n * tb, n_heads * k, seed=8)
    layer = sharded(ops.ring_self_attention, mesh(n), (ops.attention_specs(None), SEQ), SEQ, n_heads=n_heads)
    check_values_and_grads(layer, lambda p, x: ref.attention(p, x, n_heads, True), (p, x), (0, 1))


def test_ring_attention_with_data_axis():
    """A (data, seq) mesh: the ring runs within each data replica."""
    q, k, v = (randn(4, 6, 2, 3, seed=s) for s in (1, 2, 3))
    spec = P("data", "tensor")
    layer = sharded(ops.ring_attention, mesh(3, data=2), (spec, spec, spec), spec)
    check_values_and_grads(layer, ref.sdpa, (q, k, v), (0, 1, 2))


# Activation memory -------------------------------------------------------------------------------


def test_sp_activations_are_sequence_blocks():
    """Between the parallel regions each device holds T/n positions: what SP saves over 1D."""
    n, b, t, d = 4, 2, 8, 8
    seen = {}

    def probe(p, x):
        seen["x"] = tuple(x.shape)
        y = ops.sp_mlp(p, x, axis="tensor")
        seen["y"] = tuple(y.shape)
        return y

    f = fpar.shard(probe, mesh(n), (ops.mlp_specs(), SEQ), SEQ)
    f(randomize(ops.init_mlp(d)), randn(b, t, d))
    assert seen == {"x": (b, t // n, d), "y": (b, t // n, d)}
    blocks = block_shapes(randomize(ops.init_mlp(d)), ops.mlp_specs(), mesh(n))
    assert blocks[("w_in",)] == (d, 4 * d // n)  # the weights are those of 1D


# Traffic ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 4])
def test_traffic_sp_mlp_is_1d_and_one_all_gather(n):
    """SP: all-gather + reduce-scatter each way, the same bytes as 1D's two all-reduces, and one
    all-gather more in the backward: the input's sequence blocks gathered again for w_in's gradient
    (Megatron-LM's trade: the forward keeps the block, not the whole sequence).

    The row-parallel bias, replicated but added to sequence shards, has its gradient all-reduced.
    """
    b, t, d = 2, 8, 8
    act = b * t * d * ITEM
    p, x = randomize(ops.init_mlp(d)), randn(b, t, d)
    sp = traffic(sharded(ops.sp_mlp, mesh(n), (ops.mlp_specs(), SEQ), SEQ), (p, x), argnums=(0, 1))
    one_d = traffic(sharded(ops.mlp, mesh(n), (ops.mlp_specs(), P()), P()), (p, x), argnums=(0, 1))
    assert bytes_of(sp) == {
        # forward into w_in, its backward again (the re-gather), backward of the reduce-scatter
        "all_gather": 3 * all_gather(n, act // n),
        "psum_scatter": 2 * reduce_scatter(n, act),  # forward out of w_out, backward of the all-gather
        "psum": all_reduce(n, d * ITEM),  # b_out's gradient
    }
    assert bytes_of(one_d) == {"psum": 2 * all_reduce(n, act)}
    assert sp["tensor"]["all_gather"]["calls"] == 3 and sp["tensor"]["psum_scatter"]["calls"] == 2
    activations = bytes_of(sp)["all_gather"] + bytes_of(sp)["psum_scatter"]
    assert activations == bytes_of(one_d)["psum"] + all_gather(n, act // n)


@pytest.mark.parametrize("n", [2, 4])
def test_traffic_sp_attention(n):
    b, t, d = 2, 8, 8
    act = b * t * d * ITEM
    p, x = randomize(ops.init_attention(d)), randn(b, t, d)
    stats = traffic(
        sharded(ops.sp_attention, mesh(n), (ops.attention_specs(), SEQ), SEQ, n_heads=4),
        (p, x),
        argnums=(0, 1),
    )
    assert bytes_of(stats) == {
        "all_gather": 3 * all_gather(n, act // n),  # with the re-gather for w_qkv's gradient
        "psum_scatter": 2 * reduce_scatter(n, act),
        "psum": all_reduce(n, d * ITEM),  # b_o's gradient
    }


@pytest.mark.parametrize("n", [2, 4])
def test_traffic_sp_vocab_embedding(n):
    """A reduce-scatter along the sequence instead of an all-reduce; its transpose (an all-gather) backward."""
    b, t, d, v = 2, 8, 4, 16
    act = b * t * d * ITEM
    ids = torch.randint(0, v, (b, t))
    f = sharded(ops.sp_vocab_embedding, mesh(n), (P(), P("tensor", None)), SEQ)
    assert bytes_of(traffic(f, (ids, randn(v, d)))) == {"psum_scatter": reduce_scatter(n, act)}
    assert bytes_of(traffic(f, (ids, randn(v, d)), argnums=1)) == {
        "psum_scatter": reduce_scatter(n, act),
        "all_gather": all_gather(n, act // n),
    }


@pytest.mark.parametrize("n", [2, 4])
def test_traffic_ulysses(n):
    """Forward: one all-to-all of q, k, v (3x the block) and one of the output (1x): 4 (n-1)/n of the block.

    Backward: the transposed all-to-alls, and the all-reduce of the replicated weights' gradients.
    """
    b, t, d = 2, 8, 8
    block = b * (t // n) * d * ITEM  # this device's [B, T/n, D]
    p, x = randomize(ops.init_attention(d)), randn(b, t, d)
    f = sharded(ops.ulysses_attention, mesh(n), (ops.attention_specs(None), SEQ), SEQ, n_heads=4)
    fwd = traffic(f, (p, x))
    assert fwd["tensor"] == {
        "all_to_all": {"calls": 2, "bytes": all_to_all(n, 3 * block) + all_to_all(n, block)}
    }
    both = traffic(f, (p, x), argnums=(0, 1))
    weights = [d * 3 * d, 3 * d, d * d, d]  # w_qkv, b_qkv, w_o, b_o
    assert bytes_of(both) == {
        "all_to_all": 2 * (all_to_all(n, 3 * block) + all_to_all(n, block)),
        "psum": sum(all_reduce(n, w * ITEM) for w in weights),
    }


@pytest.mark.parametrize("n", [2, 3, 4])
def test_traffic_ring_attention(n):
    """n-1 rotations of the K and V blocks forward, n-1 of their gradients backward; nothing else.

    One call per tensor: K and V are two ppermutes per rotation.
    """
    b, t, h, k = 2, 2 * n, 2, 4
    q = randn(b, t, h, k)
    kv_block = b * (t // n) * h * k * ITEM
    f = sharded(ops.ring_attention, mesh(n), (SEQ, SEQ, SEQ), SEQ)
    assert traffic(f, (q, q, q))["tensor"] == {
        "ppermute": {"calls": 2 * (n - 1), "bytes": 2 * (n - 1) * kv_block}
    }
    both = traffic(f, (q, q, q), argnums=(0, 1, 2))
    assert both["tensor"] == {"ppermute": {"calls": 4 * (n - 1), "bytes": 4 * (n - 1) * kv_block}}


# Errors -----------------------------------------------------------------------------------------


def test_sequence_errors_before_any_communication():
    p = randomize(ops.init_attention(8))
    fpar.reset_comm_stats()
    bad = dict(ops.attention_specs(), w_qkv=P())
    sp = sharded(ops.sp_attention, mesh(2), (bad, SEQ), SEQ, n_heads=2)
    with pytest.raises(ValueError, match=r"expected \(8, 3, 4\)"):
        sp(p, randn(1, 4, 8))
    col = sharded(ops.sp_column_linear, mesh(2), (SEQ, P("tensor", None)), P(None, None, "tensor"))
    with pytest.raises(ValueError, match=r"spec P\(None, axis\)"):
        col(randn(1, 4, 8), randn(8, 4))
    assert fpar.comm_stats() == {}
    uly = sharded(ops.ulysses_attention, mesh(4), (ops.attention_specs(None), SEQ), SEQ, n_heads=2)
    with pytest.raises(ValueError, match="n_heads=2 is not divisible by the axis size 4"):
        uly(p, randn(1, 8, 8))
    split = sharded(ops.ulysses_attention, mesh(2), (ops.attention_specs(), SEQ), SEQ, n_heads=2)
    with pytest.raises(ValueError, match=r"attention_specs\(None\)"):
        split(p, randn(1, 4, 8))
    ring = sharded(ops.ring_attention, mesh(2), (SEQ, SEQ, SEQ), SEQ)
    with pytest.raises(ValueError, match="same shape"):
        ring(randn(1, 4, 2, 3), randn(1, 4, 2, 3), randn(1, 4, 2, 2))
    row = sharded(ops.sp_row_linear, mesh(4), (P(None, None, "tensor"), P("tensor", None)), SEQ)
    with pytest.raises(ValueError, match="sequence length = 6 is not divisible by 4"):
        row(randn(1, 6, 8), randn(8, 2))
