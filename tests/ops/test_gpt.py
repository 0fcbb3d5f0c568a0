"""The GPT block and the whole GPT: values, gradients, parameter layout and the traffic of a training step."""

from __future__ import annotations

import math

import optree
import pytest
import torch
import unsharded as ref
from hypothesis import given
from hypothesis import strategies as st
from opstest import (
    FEW,
    ITEM,
    Sharded,
    all_gather,
    all_reduce,
    assert_tree_close,
    block_shapes,
    bytes_of,
    check_values_and_grads,
    mesh,
    randn,
    randomize,
    reduce_scatter,
    traffic,
)

import fpar
import fpar.ops as ops
from fpar import P

SEQ = P(None, "tensor")


def is_spec(x):
    return isinstance(x, P)


# Values and gradients ---------------------------------------------------------------------------


@FEW
@given(n=st.sampled_from([1, 2, 4]), sp=st.booleans(), k=st.integers(1, 2), tb=st.integers(1, 2))
def test_gpt_block(n, sp, k, tb):
    n_heads = n
    d = n_heads * k
    p = randomize(ops.init_gpt_block(d), seed=n)
    x = randn(2, n * tb, d, seed=1)
    layer = ops.sp_gpt_block if sp else ops.gpt_block
    spec = SEQ if sp else P()

    def block(p, x):
        return layer(p, x, axis="tensor", n_heads=n_heads)

    f = Sharded(block, mesh(n), (ops.gpt_block_specs(), spec), spec)
    check_values_and_grads(f, lambda p, x: ref.gpt_block(p, x, n_heads), (p, x), (0, 1))


@FEW
@given(
    n=st.sampled_from([1, 2, 4]),
    data=st.sampled_from([1, 2]),
    sp=st.booleans(),
    tied=st.booleans(),
    v=st.integers(1, 3),
    tb=st.integers(1, 2),
)
def test_gpt_loss(n, data, sp, tied, v, tb):
    """The per-token loss and the gradient of every parameter equal the unsharded GPT's."""
    n_heads, d, t = 2 * n if n < 4 else n, 8, n * tb
    vocab = n * v * 2
    p = randomize(ops.init_gpt(vocab, d, 1, t + 1, tied=tied), seed=v, scale=0.3)
    gen = torch.Generator().manual_seed(tb)
    ids, targets = (torch.randint(0, vocab, (2 * data, t), generator=gen) for _ in range(2))
    batch = P("data") if data > 1 else P()

    def loss(p, ids, targets):
        return ops.gpt_loss(p, ids, targets, axis="tensor", n_heads=n_heads, sequence_parallel=sp)

    f = Sharded(loss, mesh(n, data), (ops.gpt_specs(1, tied=tied), batch, batch), batch)
    check_values_and_grads(f, lambda p, i, tg: ref.gpt_loss(p, i, tg, n_heads), (p, ids, targets), 0)


def test_gpt_logits_stay_vocab_sharded():
    """gpt returns each device's V/n slice of the logits; gathered, they are the unsharded logits."""
    n, vocab, d, t = 4, 16, 8, 4
    p = randomize(ops.init_gpt(vocab, d, 2, t), seed=3, scale=0.3)
    ids = torch.randint(0, vocab, (2, t))
    seen = {}

    def logits(p, ids):
        out = ops.gpt(p, ids, axis="tensor", n_heads=4)
        seen["block"] = tuple(out.shape)
        return out

    f = fpar.shard(logits, mesh(n), (ops.gpt_specs(2), P()), P(None, None, "tensor"))
    assert_tree_close(f(p, ids), ref.gpt(p, ids, 4))
    assert seen["block"] == (2, t, vocab // n)


# Parameters: specs, initialisers, memory --------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False])
def test_specs_match_init_and_layout_independent_values(tied):
    """gpt_specs has the tree of init_gpt; the same seed gives the same model on any mesh."""
    inits = ops.init_gpt(32, 8, 2, 16, tied=tied, dtype=torch.float64)
    specs = ops.gpt_specs(2, tied=tied)
    is_init = lambda x: isinstance(x, fpar.Init)  # noqa: E731
    assert optree.tree_structure(inits, is_leaf=is_init) == optree.tree_structure(specs, is_leaf=is_spec)
    one = fpar.init(inits, mesh(1), ops.gpt_specs(2, "tensor", tied=tied), seed=3)
    many = fpar.init(inits, mesh(4, data=2), specs, seed=3)
    assert_tree_close(one, many)
    assert float(one["blocks"][0]["ln1"]["w"].min()) == 1.0  # LayerNorm starts as the identity
    # GPT-2's residual scaling: output projections have std / sqrt(2 L).
    assert one["blocks"][1]["mlp"]["w_out"].std() < 0.7 * one["blocks"][1]["mlp"]["w_in"].std()


@pytest.mark.parametrize("n", [2, 4])
def test_per_device_parameter_memory(n):
    """Per device: the weight matrices and the vocabulary are 1/n; LayerNorms, w_pos and row biases are whole."""
    vocab, d, layers, t = 16, 8, 2, 8
    p = randomize(ops.init_gpt(vocab, d, layers, t))
    blocks = block_shapes(p, ops.gpt_specs(layers), mesh(n))
    per_device = sum(math.prod(s) for s in blocks.values())
    split = vocab * d + layers * (3 * d * d + 3 * d + d * d + 4 * d * d + 4 * d + 4 * d * d)
    whole = t * d + 2 * d + layers * (d + d + 4 * d)  # w_pos, ln_f, per block b_o, b_out, ln1, ln2
    assert per_device == split // n + whole
    assert sum(p.numel() for p in optree.tree_leaves(p)) == split + whole


# Traffic of a whole step ---------------------------------------------------------------------------


def gpt_step_traffic(n, data, sp, b, t, d, vocab, layers, tied=True):
    p = randomize(ops.init_gpt(vocab, d, layers, t, tied=tied), scale=0.3)
    ids = torch.randint(0, vocab, (b, t))
    batch = P("data") if data > 1 else P()

    def loss(p, ids):
        tok = ops.gpt_loss(p, ids, ids, axis="tensor", n_heads=4, sequence_parallel=sp)
        return fpar.pmean(tok.mean(), "data") if data > 1 else tok.mean()

    f = fpar.shard(loss, mesh(n, data), (ops.gpt_specs(layers, tied=tied), batch), P())
    return p, traffic(f, (p, ids), argnums=0)


@pytest.mark.parametrize("n", [2, 4])
def test_traffic_gpt_1d(n):
    """2 all-reduces of [B, T, D] per layer each way, 1 for the embedding (fwd) and 1 for the head (bwd);
    the loss adds 3 all-reduces of [B, T] (one pmax, two psums) and its backward nothing."""
    b, t, d, vocab, layers = 2, 8, 8, 16, 3
    _, stats = gpt_step_traffic(n, 1, False, b, t, d, vocab, layers)
    act, tok = all_reduce(n, b * t * d * ITEM), all_reduce(n, b * t * ITEM)
    assert stats["tensor"] == {
        "psum": {"calls": 2 * (2 * layers + 1) + 2, "bytes": 2 * (2 * layers + 1) * act + 2 * tok},
        "pmax": {"calls": 1, "bytes": tok},
    }


@pytest.mark.parametrize("n", [2, 4])
def test_traffic_gpt_sequence_parallel(n):
    """SP: every all-reduce of [B, T, D] becomes an all-gather + a reduce-scatter (the same bytes),
    and each column-parallel entry (attention, MLP, the head) all-gathers its input's blocks again
    in the backward (Megatron-LM's re-gather); the replicated parameters used on sequence shards
    (LayerNorms, row biases, this device's slice of w_pos) have their gradients all-reduced."""
    b, t, d, vocab, layers = 2, 8, 8, 16, 3
    _, sp = gpt_step_traffic(n, 1, True, b, t, d, vocab, layers)
    _, one_d = gpt_step_traffic(n, 1, False, b, t, d, vocab, layers)
    act = b * t * d * ITEM
    tok = all_reduce(n, b * t * ITEM)
    regions = 2 * layers + 1  # attention, MLP per block; embedding / head
    params = all_reduce(n, t * d * ITEM) + (layers * 6 + 2) * all_reduce(n, d * ITEM)
    regather = regions * all_gather(n, act // n)  # 2 per block and the head's
    assert bytes_of(sp) == {
        "all_gather": 2 * regions * all_gather(n, act // n) + regather,
        "psum_scatter": 2 * regions * reduce_scatter(n, act),
        "psum": 2 * tok + params,
        "pmax": tok,
    }
    activations_sp = bytes_of(sp)["all_gather"] + bytes_of(sp)["psum_scatter"]
    activations_1d = bytes_of(one_d)["psum"] - 2 * tok
    assert activations_sp == activations_1d + regather


@pytest.mark.parametrize("tied", [True, False])
def test_traffic_gpt_data_parallel_gradients(tied):
    """Over "data": one all-reduce of each parameter's block per use (a tied embedding is used twice)."""
    n, data, layers = 2, 2, 2
    p, stats = gpt_step_traffic(n, data, False, 4, 8, 8, 16, layers, tied=tied)
    specs = optree.tree_leaves(ops.gpt_specs(layers, tied=tied), is_leaf=is_spec)
    leaves = optree.tree_leaves(p)
    block_bytes = [x.numel() * ITEM // (n if "tensor" in s.axes() else 1) for x, s in zip(leaves, specs)]
    uses = len(block_bytes) + tied
    want = sum(all_reduce(data, nb) for nb in block_bytes) + tied * all_reduce(
        data, p["w_emb"].numel() * ITEM // n
    )
    assert stats["data"]["psum"] == {"calls": uses, "bytes": want}


# Errors ---------------------------------------------------------------------------------------------


def test_gpt_errors():
    p = randomize(ops.init_gpt(16, 8, 1, 4), scale=0.3)
    f = fpar.shard(
        lambda p, i: ops.gpt(p, i, axis="tensor", n_heads=2),
        mesh(2),
        (ops.gpt_specs(1), P()),
        P(None, None, "tensor"),
    )
    with pytest.raises(ValueError, match="ids has 6 positions but w_pos only 4"):
        f(p, torch.zeros(1, 6, dtype=torch.long))
    g = fpar.shard(
        lambda p, i: ops.gpt(p, i, axis="tensor", n_heads=2, sequence_parallel=True),
        mesh(2),
        (ops.gpt_specs(1), P()),
        P(None, None, "tensor"),
    )
    with pytest.raises(ValueError, match="sequence length = 3 is not divisible by 2"):
        g(p, torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(TypeError, match="n_layers must be a non-negative int"):
        ops.gpt_specs("2")
