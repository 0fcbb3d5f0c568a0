"""fpar.optim: optimizers step for step against torch.optim, schedules, clipping, remat.

Everything here is in-process and small (float64 where exactness is the point).
"""

from __future__ import annotations

import math

import optree
import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

import fpar
import fpar.optim as fo
from fpar import P

F64 = torch.float64


def _params(seed=0, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(5, 3, generator=g, dtype=dtype), "b": torch.randn(7, generator=g, dtype=dtype)}


def _loss(p, i):
    # A different, non-quadratic loss at every step, so moments and momentum matter.
    return ((p["w"].sum(1) * (i + 1)) ** 2).sum() + 0.1 * (p["b"] ** 3).sum() + (p["w"] * p["w"].sin()).sum()


def _run_fpar(opt, steps=6, dtype=F64):
    p = _params(dtype=dtype)
    state = opt.init(p)
    out = []
    for i in range(steps):
        g = torch.func.grad(_loss)(p, i)
        u, state = opt.update(g, state, p)
        p = fo.apply_updates(p, u)
        out.append(p)
    return out, state


def _run_torch(make, steps=6, dtype=F64, scheduler=None):
    p = {k: v.clone().requires_grad_() for k, v in _params(dtype=dtype).items()}
    opt = make(list(p.values()))
    sched = scheduler(opt) if scheduler else None
    out = []
    for i in range(steps):
        opt.zero_grad()
        _loss(p, i).backward()
        opt.step()
        if sched:
            sched.step()
        out.append({k: v.detach().clone() for k, v in p.items()})
    return out


def _assert_traj(a, b, rtol=1e-12, atol=1e-12):
    for i, (x, y) in enumerate(zip(a, b)):
        for k in x:
            torch.testing.assert_close(x[k], y[k], rtol=rtol, atol=atol, msg=f"step {i} leaf {k}")


# Optimizers against torch.optim -----------------------------------------------------------------


@pytest.mark.parametrize(
    "kw",
    [dict(), dict(weight_decay=0.0), dict(weight_decay=0.3, b1=0.8, b2=0.99, eps=1e-6)],
    ids=["default", "no-decay", "custom"],
)
def test_adamw_matches_torch(kw):
    lr = 1e-2
    mine, state = _run_fpar(fo.adamw(lr, **kw))
    tkw = {"weight_decay": kw.get("weight_decay", 0.01), "eps": kw.get("eps", 1e-8)}
    tkw["betas"] = (kw.get("b1", 0.9), kw.get("b2", 0.999))
    ref = _run_torch(lambda ps: torch.optim.AdamW(ps, lr=lr, **tkw))
    _assert_traj(mine, ref)
    # The state is a pytree of tensors: two moments shaped like the params and a count.
    adam_state = state[0]
    assert int(adam_state.count) == 6
    assert adam_state.mu["w"].shape == (5, 3) and adam_state.nu["b"].shape == (7,)


def test_adamw_float32_matches_torch():
    mine, _ = _run_fpar(fo.adamw(1e-2), dtype=torch.float32)
    ref = _run_torch(lambda ps: torch.optim.AdamW(ps, lr=1e-2), dtype=torch.float32)
    _assert_traj(mine, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "kw",
    [dict(), dict(momentum=0.9), dict(momentum=0.9, nesterov=True), dict(momentum=0.5, weight_decay=0.1)],
    ids=["plain", "momentum", "nesterov", "momentum-wd"],
)
def test_sgd_matches_torch(kw):
    mine, _ = _run_fpar(fo.sgd(0.01, **kw))
    ref = _run_torch(lambda ps: torch.optim.SGD(ps, lr=0.01, **kw))
    _assert_traj(mine, ref)


def test_schedule_as_lr_matches_torch_lambdalr():
    sched = fo.warmup_cosine(1e-2, warmup_steps=2, total_steps=6, end=1e-3)
    mine, _ = _run_fpar(fo.adamw(sched))
    ref = _run_torch(
        lambda ps: torch.optim.AdamW(ps, lr=1.0),
        scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda t: float(sched(t))),
    )
    _assert_traj(mine, ref)


def test_adamw_is_a_chain_of_transforms():
    chained = fo.chain(fo.scale_by_adam(), fo.add_decayed_weights(0.01), fo.scale_by_learning_rate(1e-2))
    _assert_traj(_run_fpar(chained)[0], _run_fpar(fo.adamw(1e-2))[0], rtol=0, atol=0)


def test_foreach_and_per_leaf_paths_agree():
    # Plain tensors take torch._foreach_*; under a transform (vmap) each leaf is updated alone.
    opt = fo.chain(fo.clip_by_global_norm(0.5), fo.adamw(fo.linear_warmup(1e-2, 3)))
    p, g = _params(), _params(seed=1)
    state = opt.init(p)
    u1, s1 = opt.update(g, state, p)

    def one(p, g):
        return opt.update(g, opt.init(p), p)

    batch = lambda t: {k: v.unsqueeze(0) for k, v in t.items()}  # noqa: E731
    u2, s2 = torch.func.vmap(one)(batch(p), batch(g))
    for k in p:
        torch.testing.assert_close(u1[k], u2[k][0], rtol=1e-14, atol=1e-15)


def test_apply_updates_keeps_param_dtype_and_does_not_mutate():
    p = {"a": torch.ones(3, dtype=torch.bfloat16), "b": torch.ones(2)}
    u = {"a": torch.full((3,), 0.5), "b": torch.full((2,), 0.25, dtype=F64)}
    out = fo.apply_updates(p, u)
    assert out["a"].dtype == torch.bfloat16 and out["b"].dtype == torch.float32
    assert torch.equal(p["a"], torch.ones(3, dtype=torch.bfloat16))
    assert torch.equal(out["b"], torch.full((2,), 1.25))


def test_identity_and_empty_chain():
    p = _params()
    u, s = fo.chain().update(p, fo.chain().init(p), p)
    assert u is p and s == ()
    u, s = fo.identity().update(p, fo.identity().init(p))
    assert u is p and s == fo.EmptyState()


# Schedules --------------------------------------------------------------------------------------


def test_warmup_cosine_values():
    s = fo.warmup_cosine(1.0, warmup_steps=4, total_steps=12, end=0.1)
    got = [float(s(t)) for t in range(14)]
    want = [t / 4 for t in range(4)]
    want += [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (t - 4) / 8)) for t in range(4, 12)]
    want += [0.1, 0.1]
    assert got == pytest.approx(want, abs=1e-15)
    assert float(s(torch.tensor(6))) == pytest.approx(want[6])  # a tensor count, as the state keeps it


def test_linear_warmup_and_constant_values():
    s = fo.linear_warmup(2.0, 4, init=1.0)
    assert [float(s(t)) for t in range(6)] == pytest.approx([1.0, 1.25, 1.5, 1.75, 2.0, 2.0])
    assert float(fo.linear_warmup(3.0, 0)(5)) == 3.0
    assert [float(fo.constant(0.3)(t)) for t in (0, 7)] == [0.3, 0.3]


def test_schedule_errors():
    with pytest.raises(ValueError, match="warmup_steps <= total_steps"):
        fo.warmup_cosine(1.0, 5, 3)
    with pytest.raises(ValueError, match="must be >= 0"):
        fo.linear_warmup(1.0, -1)
    with pytest.raises(ValueError, match="nesterov=True needs momentum"):
        fo.sgd(0.1, nesterov=True)


# Global-norm clipping ------------------------------------------------------------------------------


def test_clip_by_global_norm_matches_torch():
    g = {k: 3 * v for k, v in _params(seed=2).items()}
    clipped, _ = fo.clip_by_global_norm(1.0).update(g, fo.EmptyState())
    ref = [torch.zeros_like(t, requires_grad=True) for t in g.values()]
    for r, t in zip(ref, g.values()):
        r.grad = t.clone()
    norm = torch.nn.utils.clip_grad_norm_(ref, 1.0)
    assert float(norm) > 1.0
    assert float(fo.global_norm(g)) == pytest.approx(float(norm), rel=1e-14)
    for k, r in zip(g, ref):
        torch.testing.assert_close(clipped[k], r.grad, rtol=1e-14, atol=0)
    small, _ = fo.clip_by_global_norm(1e6).update(g, fo.EmptyState())
    assert all(torch.equal(small[k], g[k]) for k in g)


TP_SPECS = {
    "col": P(None, "tensor"),  # split over tensor
    "row": P("tensor", None),
    "both": P("data", "tensor"),  # split over data and tensor
    "rep": P(),  # replicated: counted once
    "vec": P(("tensor", "data")),
}


def _mixed_tree():
    g = torch.Generator().manual_seed(3)
    shapes = {"col": (3, 4), "row": (4, 5), "both": (2, 6), "rep": (5,), "vec": (8,)}
    return {k: torch.randn(*s, generator=g, dtype=F64) for k, s in shapes.items()}


@pytest.mark.parametrize("with_specs", [True, False], ids=["specs", "inferred"])
def test_global_norm_inside_shard_equals_unsharded(with_specs):
    mesh = fpar.make_mesh((2, 2), ("data", "tensor"))
    tree = _mixed_tree()
    specs = TP_SPECS if with_specs else None
    sharded = fpar.shard(lambda t: fo.global_norm(t, specs), mesh, (TP_SPECS,), P())
    want = torch.sqrt(sum((t**2).sum() for t in tree.values()))
    torch.testing.assert_close(sharded(tree), want, rtol=1e-14, atol=0)
    # and clipping scales every block by the same global factor
    clip = fo.clip_by_global_norm(1.0, specs=specs)
    out = fpar.shard(lambda t: clip.update(t, fo.EmptyState())[0], mesh, (TP_SPECS,), TP_SPECS)(tree)
    for k in tree:
        torch.testing.assert_close(out[k], tree[k] / (want + 1e-6), rtol=1e-14, atol=0)


# Remat ------------------------------------------------------------------------------------------

CALLS = {"n": 0}


def _block(w1, w2, h):
    CALLS["n"] += 1
    return torch.tanh(torch.tanh(h @ w1) @ w2)


def _stack(block, w1, w2, x, depth=3):
    h = x
    for _ in range(depth):
        h = block(w1, w2, h)
    return h


def _tensors(seed=0, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(16, 64, generator=g, dtype=dtype) / 4,
        torch.randn(64, 16, generator=g, dtype=dtype) / 8,
        torch.randn(32, 16, generator=g, dtype=dtype),
    )


def test_torch_checkpoint_does_not_compose_with_func_grad():
    # Why fpar.optim.remat exists: torch.utils.checkpoint relies on saved-tensor hooks.
    import torch.utils.checkpoint as cp

    w1, w2, x = _tensors()
    with pytest.raises(RuntimeError, match="saved tensor hooks"):
        torch.func.grad(lambda w: cp.checkpoint(_block, w, w2, x, use_reentrant=False).sum())(w1)


@pytest.mark.parametrize("how", ["autograd", "func.grad", "vmap(grad)"])
def test_remat_gradients_equal_plain(how):
    w1, w2, x = _tensors()

    def loss(block):
        return lambda w1, w2, x: (_stack(block, w1, w2, x) ** 2).sum()

    if how == "autograd":
        grads = []
        for block in (_block, fo.remat(_block)):
            a, b = w1.clone().requires_grad_(), w2.clone().requires_grad_()
            loss(block)(a, b, x).backward()
            grads.append((a.grad, b.grad))
    elif how == "func.grad":
        grads = [torch.func.grad(loss(b), argnums=(0, 1))(w1, w2, x) for b in (_block, fo.remat(_block))]
    else:
        xs = x.reshape(2, 16, 16)
        grads = [
            torch.func.vmap(torch.func.grad(loss(b), argnums=(0, 1)), (None, None, 0))(w1, w2, xs)
            for b in (_block, fo.remat(_block))
        ]
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-14)


def test_remat_second_derivative_by_plain_autograd():
    """A plain backward recomputes by ``torch.autograd.grad``; with ``create_graph`` (a Hessian-
    vector product) its gradients must carry their graph, as the plain function's do."""
    w1, w2, x = _tensors()
    v = torch.randn_like(w1)
    hvps = []
    for block in (_block, fo.remat(_block)):
        a, b = w1.clone().requires_grad_(), w2.clone().requires_grad_()
        (ga,) = torch.autograd.grad((_stack(block, a, b, x) ** 2).sum(), a, create_graph=True)
        hvps.append(torch.autograd.grad((ga * v).sum(), (a, b)))
    for got, want in zip(hvps[1], hvps[0]):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13)


MESH_TP = {"data": 2, "tensor": 2}


def _tp_block(p, h):  # Megatron MLP: column- then row-parallel, psum over tensor inside the region
    return fpar.psum(torch.tanh(h @ p["a"]) @ p["b"], "tensor")


@pytest.mark.parametrize("where", ["outer-grad", "inner-grad"])
def test_remat_inside_shard_with_collectives(where):
    mesh = fpar.make_mesh(tuple(MESH_TP.values()), tuple(MESH_TP))
    g = torch.Generator().manual_seed(1)
    p = {"a": torch.randn(8, 6, generator=g, dtype=F64), "b": torch.randn(6, 8, generator=g, dtype=F64) / 3}
    x = torch.randn(8, 8, generator=g, dtype=F64)
    specs = {"a": P(None, "tensor"), "b": P("tensor", None)}

    def make(block):
        def loss(p, x):
            return fpar.pmean((block(p, block(p, x)) ** 2).mean(), "data")

        return loss

    if where == "outer-grad":
        # Two layers with their own weights, and the same layer applied twice (tied weights).
        layers = {"l0": p, "l1": {k: v.flip(0) / 2 for k, v in p.items()}}
        layer_specs = {"l0": specs, "l1": specs}
        models = {
            "distinct": (lambda blk: lambda w, x: blk(w["l1"], blk(w["l0"], x)), layers, layer_specs),
            "tied": (lambda blk: lambda w, x: blk(w, blk(w, x)), p, specs),
        }
        for name, (model, weights, wspecs) in models.items():
            res = []
            for block in (_tp_block, fo.remat(_tp_block)):
                f = model(block)
                loss = lambda w, x, f=f: fpar.pmean((f(w, x) ** 2).mean(), "data")  # noqa: E731
                fpar.reset_comm_stats()
                res.append(
                    (
                        torch.func.grad(fpar.shard(loss, mesh, (wspecs, P("data")), P()))(weights, x),
                        fpar.comm_stats(),
                    )
                )
            (g0, s0), (g1, s1) = res
            for a, b in zip(optree.tree_leaves(g0), optree.tree_leaves(g1)):
                torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-14)
            # The recompute repeats the two forward psums over tensor, nothing else ...
            assert s1["tensor"]["psum"]["calls"] == s0["tensor"]["psum"]["calls"] + 2
            if name == "distinct":
                assert s1["data"] == s0["data"]
            else:
                # ... except that a weight used in two regions is all-reduced in each region's
                # backward (once per shard call without remat): documented in remat.
                assert s1["data"]["psum"]["calls"] == 2 * s0["data"]["psum"]["calls"]
    else:
        # A gradient taken inside the sharded function (one TP block: per-device grads are exact).
        def per_device(block):
            def f(p, x):
                g = torch.func.grad(lambda p: (block(p, x) ** 2).sum())(p)
                return {k: v.unsqueeze(0) for k, v in g.items()}  # each data rank's own gradient

            out_specs = {k: P("data", *s) for k, s in specs.items()}
            return fpar.shard(f, mesh, (specs, P("data")), out_specs)

        g0, g1 = (per_device(b)(p, x) for b in (_tp_block, fo.remat(_tp_block)))
        for k in p:
            torch.testing.assert_close(g0[k], g1[k], rtol=1e-13, atol=1e-14)


def test_remat_regathers_inside_shard():
    # ZeRO-3's pattern: an all_gather inside the region is done again in the backward.
    mesh = fpar.make_mesh((2,), ("data",))
    w1, _, x = _tensors()

    def body(chunk, x):
        return (torch.tanh(x @ fpar.all_gather(chunk, "data", tiled=True)) ** 2).mean()

    stats, grads = [], []
    for f in (body, fo.remat(body)):
        sh = fpar.shard(lambda c, x, f=f: f(c, x).reshape(1), mesh, (P("data"), P("data")), P("data"))
        fpar.reset_comm_stats()
        grads.append(torch.func.grad(lambda c, sh=sh: sh(c, x).sum())(w1))
        stats.append(fpar.comm_stats()["data"])
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-13, atol=1e-14)
    block = 8 * 64 * 8  # bytes of one device's chunk of w1
    assert stats[0] == {
        "all_gather": {"calls": 1, "bytes": block},
        "psum_scatter": {"calls": 1, "bytes": block},
    }
    assert stats[1] == {
        "all_gather": {"calls": 2, "bytes": 2 * block},
        "psum_scatter": {"calls": 1, "bytes": block},
    }


def _saved_activation_bytes(fn, params, *args):
    """Distinct storages autograd saves during ``fn``'s forward, parameters excluded."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    saved: dict[int, int] = {}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in skip:
            saved[key] = t.untyped_storage().nbytes()
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        out = fn(*params, *args)
    return sum(saved.values()), out


def test_remat_saved_activations_and_recompute_count():
    # 3 blocks of x[32,16] -> tanh(x W1)[32,64] -> tanh(. W2)[32,16], fp32, on 2 in-process devices.
    mesh = fpar.make_mesh((2,), ("data",))
    w1, w2, x = (t.float() for t in _tensors())
    w1.requires_grad_()
    w2.requires_grad_()
    measured = {}
    for name, block in (("plain", _block), ("remat", fo.remat(_block))):
        loss = fpar.shard(
            lambda w1, w2, x, block=block: fpar.pmean((_stack(block, w1, w2, x) ** 2).mean(), "data"),
            mesh,
            (P(), P(), P("data")),
            P(),
        )
        CALLS["n"] = 0
        nbytes, out = _saved_activation_bytes(loss, (w1, w2), x)
        fwd = CALLS["n"]
        out.backward()
        measured[name] = (nbytes, fwd, CALLS["n"], w1.grad.clone())
        w1.grad = w2.grad = None
    io = 32 * 16 * 4  # one block input/output [32,16] fp32 (both devices)
    hidden = 32 * 64 * 4  # tanh(x W1) [32,64]
    # Without remat: the 4 block boundaries and every block's hidden activation.
    assert measured["plain"][:3] == (4 * io + 3 * hidden, 3, 3)
    # With remat: the 4 boundaries only (+ the mesh token and axis index, 8 + 16 bytes), one
    # extra forward per block in the backward.
    assert measured["remat"][:3] == (4 * io + 24, 3, 6)
    torch.testing.assert_close(measured["plain"][3], measured["remat"][3], rtol=1e-6, atol=1e-7)


def _matmuls_in_backward(f, w1, w2, x):
    """How many matmuls the backward of ``f``'s loss runs (the recompute's included), and the grads."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func._overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    w1, w2 = w1.detach().requires_grad_(), w2.detach().requires_grad_()
    loss = (f(w1, w2, x) ** 2).sum()
    with Count() as counted:
        loss.backward()
    return counted.ops["aten.mm"], (w1.grad, w2.grad)


def test_remat_policy_keeps_the_chosen_outputs_and_the_recompute_reuses_them():
    w1, w2, x = _tensors()

    def block(w1, w2, x):  # two matmuls: x W1, then tanh(.) W2
        return torch.tanh(torch.tanh(x @ w1) @ w2)

    plain, want = _matmuls_in_backward(block, w1, w2, x)
    assert plain == 3  # dW2, d(hidden), dW1 (x needs no gradient)
    for policy, recomputed in ((None, 2), (fo.save_dots, 0), (fo.save_alternate_dots, 1)):
        got, grads = _matmuls_in_backward(fo.remat(block, policy=policy), w1, w2, x)
        assert got == plain + recomputed, policy
        for g, w in zip(grads, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
    # the policy sees each op's name and its index among that name's ops in the call
    seen = []
    keep_second = lambda op, i: seen.append((op, i)) or (op == "aten.mm" and i == 1)  # noqa: E731
    got, grads = _matmuls_in_backward(fo.remat(block, policy=keep_second), w1, w2, x)
    assert got == plain + 1 and [s for s in seen if s[0] == "aten.mm"] == [("aten.mm", 0), ("aten.mm", 1)] * 2
    with pytest.raises(TypeError, match="policy must be a function"):
        fo.remat(block, policy="dots")


@pytest.mark.parametrize("second", ["bmm", "none"])
def test_remat_policy_refuses_a_recompute_that_runs_other_ops(second):
    w, x = torch.randn(4, 4, requires_grad=True), torch.randn(3, 4)
    calls = []

    def flaky(w, x):  # the recompute (the second call) multiplies another way
        calls.append(1)
        if len(calls) == 1:
            return torch.tanh(x @ w)
        if second == "bmm":
            return torch.tanh(torch.bmm(x[None], w[None])[0])
        return torch.tanh((x[:, :, None] * w[None]).sum(1))

    out = fo.remat(flaky, policy=fo.save_dots)(w, x).sum()
    match = (
        "ran aten.bmm \\(its #0\\) where the forward kept aten.mm" if second == "bmm" else "did not run 1 op"
    )
    with pytest.raises(RuntimeError, match=match):
        out.backward()


def test_remat_passes_integer_outputs_through_and_differentiates_the_rest():
    """A body returning indices beside its values (GLM-DSA's decoder layer: hidden state, top-k ids):
    the indices come out as they are, the gradient is the plain function's."""

    def body(w, x):
        y = torch.tanh(x @ w)
        return y, torch.topk(y, 2, dim=-1).indices

    w, x = torch.randn(4, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)

    def loss(f):
        return lambda w: (lambda y, ids: y.gather(-1, ids).sum() + y.square().sum())(*f(w, x))

    got, want = torch.func.grad(loss(fo.remat(body)))(w), torch.func.grad(loss(body))(w)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.equal(fo.remat(body)(w, x)[1], body(w, x)[1])


def test_remat_returns_pytrees_and_passes_constants():
    f = fo.remat(lambda d, k, scale=1.0: {"y": d["a"] * k * scale, "z": (d["a"].sum(),)})
    out = f({"a": torch.ones(3)}, 2, scale=3.0)
    assert torch.equal(out["y"], torch.full((3,), 6.0)) and float(out["z"][0]) == 3.0
    with pytest.raises(TypeError, match="must return a pytree of tensors"):
        fo.remat(lambda x: 3)(torch.ones(1))
