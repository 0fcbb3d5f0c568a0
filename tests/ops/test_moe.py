"""fpar.ops.moe against a plain per-token loop: values, grads, aux loss, meshes, dtypes, traffic, errors."""

from __future__ import annotations

import math

import moe_dist_workers
import optree
import pytest
import torch
import torch.nn.functional as F
from harness import without_gradient_sums
from hypothesis import assume, given
from hypothesis import strategies as st
from opstest import FEW, assert_tree_close, randn

import fpar
import fpar.ops as ops
from fpar import P

# The reference ---------------------------------------------------------------------------------


def reference(params, x, top_k, capacity_factor=None, *, stats=False):
    """The issue's semantics, one token and one choice at a time (no grouping, no sorting).

    With ``capacity_factor``: expert ``e`` serves the first ``ceil(cf * T * k / E)`` pairs routed
    to it in token order; a later pair adds nothing (zero expert output, weight kept as is).
    """
    router, w_in, w_out = params["router"], params["w_in"], params["w_out"]
    t_all, e = x.shape[0], router.shape[1]
    cap = math.inf if capacity_factor is None else math.ceil(capacity_factor * t_all * top_k / e)
    ys, load, served, dropped, prob_sum = [], [0] * e, [0] * e, 0, 0
    for t in range(t_all):
        probs = torch.softmax(x[t] @ router, dim=-1)
        prob_sum = prob_sum + probs
        w, idx = torch.topk(probs, top_k)
        w = w / w.sum()
        y = torch.zeros_like(x[t])
        for j in range(top_k):
            ex = int(idx[j])
            load[ex] += 1
            if served[ex] >= cap:
                dropped += 1
                continue
            served[ex] += 1
            y = y + w[j] * (F.gelu(x[t] @ w_in[ex]) @ w_out[ex])
        ys.append(y)
    f = torch.tensor(load, dtype=x.dtype) / (t_all * top_k)
    out = torch.stack(ys), e * (f * prob_sum / t_all).sum()
    if stats:
        return out + ({"counts": torch.tensor(load), "dropped": torch.tensor(dropped)},)
    return out


def make(t, d, h, e, *, seed=0, skew=0.0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    params = {
        "router": torch.randn(d, e, generator=gen, dtype=torch.float64),
        "w_in": torch.randn(e, d, h, generator=gen, dtype=torch.float64) / math.sqrt(d),
        "w_out": torch.randn(e, h, d, generator=gen, dtype=torch.float64) / math.sqrt(h),
    }
    params["router"][:, 0] += skew  # skew > 0 sends most tokens to expert 0
    x = torch.randn(t, d, generator=gen, dtype=torch.float64) + 0.5
    return optree.tree_map(lambda a: a.to(dtype), params), x.to(dtype)


def layer(mesh, *, top_k, axis="expert", token_spec=None, token_axes=None, tensor_axis=None, **kw):
    """The sharded layer: tokens split over ``token_spec`` (default ``P(axis)``), experts over ``axis``."""
    specs = ops.moe_specs(axis, tensor_axis=tensor_axis)
    tokens = P(axis) if token_spec is None else token_spec

    def per_device(p, x):
        return ops.moe(p, x, top_k=top_k, axis=axis, token_axes=token_axes, tensor_axis=tensor_axis, **kw)

    outs = (tokens, P(), P()) if kw.get("return_stats") else (tokens, P())
    return fpar.shard(per_device, mesh, (specs, tokens), outs)


def check(fn, params, x, top_k, *, grads=True, capacity_factor=None):
    """``fn(params, x) == reference``: y, aux, and the gradients of <y, ct> + 3 aux."""
    want = reference(params, x, top_k, capacity_factor)
    assert_tree_close(fn(params, x), want)
    if not grads:
        return
    ct = randn(*x.shape, seed=7)

    def objective(f):
        def o(p, x):
            y, aux = f(p, x)
            return (y * ct).sum() + 3 * aux

        return o

    got = torch.func.grad(objective(fn), argnums=(0, 1))(params, x)
    ref = lambda p, x: reference(p, x, top_k, capacity_factor)  # noqa: E731
    want = torch.func.grad(objective(ref), argnums=(0, 1))(params, x)
    assert_tree_close(got, want, "grad")


# Unsharded ------------------------------------------------------------------------------------------


@FEW
@given(
    t=st.integers(1, 8),
    e=st.integers(1, 6),
    k=st.integers(1, 3),
    skew=st.sampled_from([0.0, 3.0, 30.0]),
    seed=st.integers(0, 2**16),
)
def test_unsharded_equals_per_token_loop(t, e, k, skew, seed):
    assume(k <= e)
    params, x = make(t, 3, 5, e, seed=seed, skew=skew)
    check(lambda p, x: ops.moe(p, x, top_k=k), params, x, k)


def test_ties_follow_torch_topk():
    params, x = make(6, 3, 4, 5)
    params["router"] = torch.zeros_like(params["router"])  # every probability equal: pure ties
    check(lambda p, x: ops.moe(p, x, top_k=2), params, x, 2)


def test_leading_dims_are_tokens():
    params, x = make(12, 3, 4, 4)
    y, aux = ops.moe(params, x.view(3, 4, 3), top_k=2)
    y_ref, aux_ref = reference(params, x, 2)
    assert_tree_close((y.reshape(12, 3), aux), (y_ref, aux_ref))


# Expert parallel ------------------------------------------------------------------------------------


@FEW
@given(
    n=st.sampled_from([1, 2, 4]),
    per_device=st.integers(1, 2),
    tokens=st.integers(1, 3),
    k=st.integers(1, 3),
    skew=st.sampled_from([0.0, 3.0, 30.0]),
    seed=st.integers(0, 2**16),
)
def test_expert_parallel_equals_per_token_loop(n, per_device, tokens, k, skew, seed):
    e = n * per_device
    assume(k <= e)
    params, x = make(n * tokens, 3, 4, e, seed=seed, skew=skew)
    check(layer(fpar.make_mesh((n,), ("expert",)), top_k=k), params, x, k)


def test_all_tokens_on_one_expert_are_not_dropped():
    """Every pair goes to device 0: the static slots hold them all (dropless)."""
    params, x = make(8, 3, 4, 4, skew=1e3)
    check(layer(fpar.make_mesh((4,), ("expert",)), top_k=1), params, x, 1)
    params, x = make(8, 3, 4, 8, skew=0.0)
    params["router"][:, 4:] -= 1e3  # devices 2, 3 get nothing, devices 0, 1 everything
    check(layer(fpar.make_mesh((4,), ("expert",)), top_k=2), params, x, 2)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_low_precision_values(dtype, tol):
    params, x = make(32, 8, 8, 4, seed=5, dtype=dtype)
    probs = torch.softmax(x.double() @ params["router"].double(), -1).sort(-1, descending=True).values
    clear = (probs[:, 1] - probs[:, 2]) > 1e-2  # drop near-ties whose rounding could flip the choice
    x = x[clear][: 2 * (int(clear.sum()) // 2)]
    assert x.shape[0] >= 16
    y_ref, aux_ref = reference(optree.tree_map(torch.Tensor.double, params), x.double(), 2)
    for fn in (lambda p, x: ops.moe(p, x, top_k=2), layer(fpar.make_mesh((2,), ("expert",)), top_k=2)):
        y, aux = fn(params, x)
        assert y.dtype == dtype and aux.dtype == dtype
        torch.testing.assert_close(y.double(), y_ref, rtol=tol, atol=tol)
        torch.testing.assert_close(aux.double(), aux_ref, rtol=tol, atol=tol)


def test_data_times_expert_aux_loss_is_global():
    mesh = fpar.make_mesh((2, 2), ("data", "expert"))
    params, x = make(8, 3, 4, 4, seed=1, skew=2.0)
    tokens = P(("data", "expert"))
    check(layer(mesh, top_k=2, token_spec=tokens, token_axes=("data", "expert")), params, x, 2)
    # Leaving "data" out of token_axes gives each data shard's own aux loss, which varies over
    # "data": fpar.shard's replication check refuses to return it as one value.
    with pytest.raises(fpar.ReplicationError, match="varies over mesh axis 'data'"):
        layer(mesh, top_k=2, token_spec=tokens)(params, x)


def test_expert_tensor_parallel():
    mesh = fpar.make_mesh((2, 2), ("expert", "tensor"))
    params, x = make(6, 3, 6, 4, seed=2, skew=1.0)
    check(layer(mesh, top_k=2, tensor_axis="tensor"), params, x, 2)


def test_experts_replicated_tensor_parallel_only():
    mesh = fpar.make_mesh((2,), ("tensor",))
    params, x = make(5, 3, 4, 3, seed=4)
    check(layer(mesh, top_k=2, axis=None, token_spec=P(), tensor_axis="tensor"), params, x, 2)


# Capacity factor (token dropping) and the layer's stats ---------------------------------------------


@FEW
@given(
    n=st.sampled_from([None, 1, 2, 4]),
    per_device=st.integers(1, 2),
    tokens=st.integers(1, 3),
    k=st.integers(1, 3),
    cf=st.sampled_from([0.1, 0.5, 1.0, 1.25, 2.0]),
    skew=st.sampled_from([0.0, 3.0, 30.0]),
    seed=st.integers(0, 2**16),
)
def test_capacity_equals_per_token_loop(n, per_device, tokens, k, cf, skew, seed):
    """First come, first served per expert in global token order; dropped pairs add nothing."""
    e = (n or 2) * per_device
    assume(k <= e)
    params, x = make((n or 2) * tokens, 3, 4, e, seed=seed, skew=skew)
    if n is None:
        fn = lambda p, x: ops.moe(p, x, top_k=k, capacity_factor=cf)  # noqa: E731
    else:
        fn = layer(fpar.make_mesh((n,), ("expert",)), top_k=k, capacity_factor=cf)
    check(fn, params, x, k, capacity_factor=cf)


def test_capacity_is_layout_independent():
    """Tokens over data x expert: the kept pairs are the unsharded layer's (global token order)."""
    mesh = fpar.make_mesh((2, 2), ("data", "expert"))
    params, x = make(16, 3, 4, 4, seed=3, skew=2.0)
    tokens = P(("data", "expert"))
    for cf in (0.5, 1.0):
        fn = layer(mesh, top_k=2, token_spec=tokens, token_axes=("data", "expert"), capacity_factor=cf)
        check(fn, params, x, 2, capacity_factor=cf)
        unsharded = lambda p, x, cf=cf: ops.moe(p, x, top_k=2, capacity_factor=cf)  # noqa: E731
        check(unsharded, params, x, 2, capacity_factor=cf)


@pytest.mark.parametrize("cf", [None, 0.5])
def test_stats_count_routed_and_dropped_pairs(cf):
    params, x = make(12, 3, 4, 4, seed=8, skew=3.0)
    _, _, want = reference(params, x, 2, cf, stats=True)
    assert cf is None or want["dropped"] > 0
    sharded = layer(fpar.make_mesh((2,), ("expert",)), top_k=2, capacity_factor=cf, return_stats=True)
    for got in (ops.moe(params, x, top_k=2, capacity_factor=cf, return_stats=True)[2], sharded(params, x)[2]):
        assert got["counts"].dtype == torch.int64
        assert torch.equal(got["counts"], want["counts"]) and int(got["dropped"]) == int(want["dropped"])


def test_skewed_router_dropless_at_scale():
    """Every token to one expert, T=8192: the exact path holds only the routed rows."""
    params, x = make(8192, 16, 32, 8, seed=1, dtype=torch.float32)
    x = x.abs() + 0.1
    params["router"] = torch.zeros(16, 8)
    params["router"][:, 0] = 1.0  # expert 0 wins every token
    y, _, st = ops.moe(params, x, top_k=1, return_stats=True)
    assert int(st["counts"][0]) == 8192 and int(st["dropped"]) == 0
    w = params
    want = F.gelu(x @ w["w_in"][0]) @ w["w_out"][0]
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)


def test_grouped_mm_path_equals_per_expert_matmuls(monkeypatch):
    """fp32 with 16-byte rows takes torch._grouped_mm where it exists: the same values and grads."""
    import fpar.ops._moe_dispatch as moe_mod

    params, x = make(64, 8, 16, 4, seed=2, skew=1.0, dtype=torch.float32)
    ct = randn(*x.shape, seed=7).float()
    mesh = fpar.make_mesh((2,), ("expert",))
    three = fpar.make_mesh((2, 2, 2), ("data", "expert", "tensor"))
    tokens = P(("data", "expert"))
    layers = {  # unsharded (exact shapes), in-process expert parallel (static slots under vmap)
        "unsharded": lambda p, x: ops.moe(p, x, top_k=2, capacity_factor=0.75),
        "in-process EP": layer(mesh, top_k=2, capacity_factor=0.75),
        "data x expert x tensor": layer(
            three, top_k=2, token_spec=tokens, token_axes=("data", "expert"), tensor_axis="tensor"
        ),
    }

    def run(fn):
        return torch.func.grad_and_value(lambda p, x: (fn(p, x)[0] * ct).sum(), argnums=(0, 1))(params, x)

    def traffic(fn):
        fpar.reset_comm_stats()
        run(fn)
        return {a: v for a, v in fpar.comm_stats().items() if a != "tensor"}  # tensor: rows vs padded tiles

    fast, fast_traffic = {}, {}
    for name, fn in layers.items():
        calls = []
        if moe_mod._GROUPED_MM:
            real = torch._grouped_mm
            monkeypatch.setattr(
                torch,
                "_grouped_mm",
                lambda *a, calls=calls, real=real, **kw: calls.append(1) or real(*a, **kw),
            )
        fast[name] = run(fn)
        assert len(calls) == (2 if moe_mod._GROUPED_MM else 0), name
        monkeypatch.undo()
        fast_traffic[name] = traffic(fn)
    monkeypatch.setattr(moe_mod, "_GROUPED_MM", False)
    for name, fn in layers.items():
        torch.testing.assert_close(
            fast[name], run(fn), msg=lambda m, name=name: f"{name}: {m}"
        )  # fp32 tolerances
        # the same implicit pvaries (e.g. the experts' gradient sum over "data") on both paths
        assert fast_traffic[name] == traffic(fn), name
    p64, x64 = optree.tree_map(torch.Tensor.double, (params, x))
    for cf, fn in ((0.75, layers["in-process EP"]), (None, layers["data x expert x tensor"])):
        want = torch.func.grad_and_value(
            lambda p, x, cf=cf: (reference(p, x, 2, cf)[0] * ct.double()).sum(), argnums=(0, 1)
        )(p64, x64)
        got = next(fast[k] for k, v in layers.items() if v is fn)
        torch.testing.assert_close(optree.tree_map(torch.Tensor.double, got), want, rtol=1e-4, atol=1e-4)


# Traffic -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n, e, k", [(2, 4, 2), (4, 4, 2), (2, 8, 3)])
def test_bytes_equal_the_static_slot_formula(n, e, k):
    t_local, d = 3, 5
    params, x = make(n * t_local, d, 4, e, seed=6)
    fn = layer(fpar.make_mesh((n,), ("expert",)), top_k=k)
    cap = t_local * min(e // n, k)
    payload = (n - 1) * cap * d * 8  # (n-1)/n of an [n, cap, D] float64 block
    ids = (n - 1) * cap * 8  # the int64 local expert id of every slot
    fpar.reset_comm_stats()
    fn(params, x)
    fwd = fpar.comm_stats()["expert"]
    assert fwd["all_to_all"]["bytes"] == 2 * payload + ids
    assert fwd["psum"]["bytes"] == 2 * (n - 1) * (2 * e * 8) // n  # the aux loss's [2, E] sums
    fpar.reset_comm_stats()
    torch.func.grad(lambda p, x: fn(p, x)[0].sum(), argnums=(0, 1))(params, x)
    both = fpar.comm_stats()["expert"]
    assert both["all_to_all"]["bytes"] == 4 * payload + ids  # the payload's two transposes
    fpar.reset_comm_stats()


# The GPT option -----------------------------------------------------------------------------------------


def test_moe_gpt_equals_its_unsharded_run():
    n_layers, vocab, d, seq = 2, 16, 8, 6
    init = ops.init_gpt(vocab, d, n_layers, seq, d_hidden=6, n_experts=4, dtype=torch.float64)
    one = fpar.make_mesh((1,), ("tensor",))
    params = fpar.init(init, one, ops.gpt_specs(n_layers, moe=True, expert_axis=None), seed=0)
    assert "moe" in params["blocks"][1] and "mlp" in params["blocks"][0]
    ids = torch.randint(0, vocab, (4, seq), generator=torch.Generator().manual_seed(0))

    def unsharded(p, ids):
        loss, aux = ops.gpt_loss(p, ids, ids, axis="tensor", n_heads=2, moe=dict(top_k=2))
        return loss.mean() + 0.1 * aux

    def sharded(p, ids):
        moe = dict(top_k=2, axis="expert", token_axes=("data", "expert"))
        loss, aux = ops.gpt_loss(p, ids, ids, axis="tensor", n_heads=2, moe=moe)
        return fpar.pmean(loss.mean(), ("data", "expert")) + 0.1 * aux

    mesh = fpar.make_mesh((2, 2, 2), ("data", "expert", "tensor"))
    want = torch.func.grad_and_value(
        fpar.shard(unsharded, one, (ops.gpt_specs(n_layers, moe=True, expert_axis=None), P()), P())
    )(params, ids)
    got = torch.func.grad_and_value(
        fpar.shard(sharded, mesh, (ops.gpt_specs(n_layers, moe=True), P(("data", "expert"))), P())
    )(params, ids)
    assert_tree_close(got, want)


def test_moe_gpt_needs_the_moe_option():
    init = ops.init_gpt(16, 8, 2, 6, n_experts=2)
    one = fpar.make_mesh((1,), ("tensor",))
    specs = ops.gpt_specs(2, moe=True, expert_axis=None)
    params = fpar.init(init, one, specs, seed=0)
    ids = torch.zeros(1, 6, dtype=torch.long)
    logits = P(None, None, "tensor")
    run = fpar.shard(lambda p, i: ops.gpt(p, i, axis="tensor", n_heads=2), one, (specs, P()), logits)
    with pytest.raises(ValueError, match="params have MoE blocks but moe is None"):
        run(params, ids)
    run = fpar.shard(
        lambda p, i: ops.gpt(p, i, axis="tensor", n_heads=2, moe=dict(top_k=3)), one, (specs, P()), logits
    )
    fpar.reset_comm_stats()
    msg = r"gpt \(blocks\[1\]\): top_k must be an int with 1 <= top_k <= E = 2"
    with pytest.raises(ValueError, match=msg):
        run(params, ids)
    assert fpar.comm_stats() == {}  # before the embedding's psum


# Bad input: a clear error, before any communication ----------------------------------------------------


def _error(mesh, params, x, match, exc=ValueError, **kw):
    specs = ops.moe_specs(None if kw.pop("replicated", False) else "expert")

    def per_device(p, x):
        return ops.moe(p, x, axis="expert", **kw)

    fn = fpar.shard(per_device, mesh, (specs, P("expert")), (P("expert"), P()))
    fpar.reset_comm_stats()
    with pytest.raises(exc, match=match):
        fn(params, x)
    assert fpar.comm_stats() == {}


def test_bad_input_is_named_before_any_communication():
    mesh = fpar.make_mesh((2,), ("expert",))
    params, x = make(4, 3, 4, 4)
    _error(mesh, params, x, r"top_k must be an int with 1 <= top_k <= E = 4", top_k=5)
    _error(mesh, params, x, r"top_k must be an int with 1 <= top_k <= E = 4", top_k=0)
    msg = r"w_in.shape\[0\] \(experts on this device\) != E / n = 4 / 2 \(4 != 2\). Give w_in"
    _error(mesh, params, x, msg, replicated=True)
    odd, _ = make(4, 3, 4, 3)
    msg = r"router has E = 3 experts, not divisible by the size 2 of axis 'expert'"
    _error(mesh, odd, x, msg, replicated=True)
    bad = dict(params, router=torch.randn(5, 4, dtype=torch.float64))
    _error(mesh, bad, x, r"x's last dim != router.shape\[0\] \(3 != 5\)")
    bad = dict(params, w_out=torch.randn(4, 5, 3, dtype=torch.float64))
    _error(mesh, bad, x, r"w_out.shape\[1\] != w_in.shape\[2\] \(H\) \(5 != 4\)")
    _error(mesh, params, x, r"token_axes=\(\) leaves out \['expert'\]", token_axes=())
    for cf in (0, -1.0, float("nan"), float("inf"), True, "1"):
        _error(
            mesh,
            params,
            x,
            r"capacity_factor must be None \(dropless\) or a finite number > 0",
            capacity_factor=cf,
        )
    # Tokens not divisible over the axis: fpar.shard's own check, naming the argument.
    msg = r"args\[1\]: dim 0 of size 3 is not evenly divisible by the mesh axes \(.expert.,\)"
    _error(mesh, params, x[:3], msg, exc=fpar.SpecError, top_k=2)
    with pytest.raises(ValueError, match="top_k must be an int"):
        ops.moe(params, x, top_k=True)


# Real mesh ----------------------------------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.parametrize("cf, all_to_one", [(None, False), (0.5, False), (None, True)])
def test_real_mesh_equals_in_process(cf, all_to_one):
    """Exact-count dispatch on 2 gloo processes: the in-process values and gradients (first call,
    planned call, plain .backward()), and all_to_all bytes = the rows each rank actually sends."""
    results = fpar.launch(moe_dist_workers.worker, 2, cf, all_to_one, timeout=120.0)
    want = moe_dist_workers.program(fpar.make_mesh((2,), ("expert",)), cf, all_to_one)
    params, x, _ = moe_dist_workers.inputs(all_to_one)
    assert_tree_close(want[:2], reference(params, x, moe_dist_workers.TOP_K, cf))
    for rank, got in enumerate(results):
        assert_tree_close(got[:3], want[:3], what=f"rank {rank}")
        assert_tree_close(got[4], want[:3], what=f"rank {rank}, planned call")
        assert_tree_close(got[5], want[2][0], what=f"rank {rank}, .backward()")
        traffic = without_gradient_sums(got[3])["expert"]
        assert traffic["all_to_all"]["bytes"] == moe_dist_workers.exact_bytes(rank, 2, cf, all_to_one)
        assert traffic["all_to_all"]["calls"] == 5  # counts; dispatch, combine and their transposes


@pytest.mark.multiprocess
def test_real_mesh_data_times_expert_with_capacity():
    """4 gloo processes, tokens over data x expert, experts over expert: the capacity's global token
    order (an all_gather over both axes), the stats, and exact-count exchanges inside each expert
    group equal the in-process mesh and the per-token reference, traced and planned calls."""
    cf = 0.5
    results = fpar.launch(moe_dist_workers.worker_data_expert, 4, cf, timeout=180.0)
    want = moe_dist_workers.program_data_expert(fpar.make_mesh((2, 2), ("data", "expert")), cf)
    params, x, _ = moe_dist_workers.inputs()
    y_ref, aux_ref, stats_ref = reference(params, x, moe_dist_workers.TOP_K, cf, stats=True)
    assert_tree_close(want[0][:2], (y_ref, aux_ref))
    assert torch.equal(want[0][2]["counts"], stats_ref["counts"]) and int(want[0][2]["dropped"]) > 0
    for rank, got in enumerate(results):
        for call in range(2):
            assert_tree_close(got[call], want[0], what=f"rank {rank}, call {call}")


# The example --------------------------------------------------------------------------------------------


def test_example_parallel_equals_single_device():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    import train_moe_gpt

    small = ["--steps", "3", "--quiet", "--d-model", "16", "--d-hidden", "16", "--layers", "2"]
    small += ["--heads", "2", "--seq", "16", "--batch", "8", "--max-bytes", "50000"]
    parallel = train_moe_gpt.main([*small, "--devices", "8", "--dp", "2", "--expert", "2", "--tensor", "2"])
    single = train_moe_gpt.main([*small, "--single-device"])
    assert single[-1] < single[0]
    torch.testing.assert_close(parallel, single, rtol=1e-4, atol=1e-5)


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_compiled_float32_layer_equals_the_eager_one_in_process():
    # float32 rows that fit torch._grouped_mm's stride rule take the grouped path eagerly; compiled,
    # Dynamo cannot trace its check of the functorch interpreter stack (the whole feature matrix's
    # compiled fp16 MoE raised in-process): a compiled layer runs the static tiles, the same values
    params, x = make(16, 8, 8, 4, seed=3, dtype=torch.float32)
    fn = layer(fpar.make_mesh((2,), ("expert",)), top_k=2)
    y_eager, aux_eager = fn(params, x)  # the eager call plans the signature; then one graph
    y, aux = torch.compile(fn, backend="aot_eager", fullgraph=True)(params, x)
    torch.testing.assert_close(y, y_eager, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(aux, aux_eager, rtol=1e-5, atol=1e-6)
