"""The in-process mesh under ``torch.compile(fullgraph=True)``: the whole step in one graph.

Every collective kind, over one axis and over a tuple of axes, with replicated, split and
keyword inputs, sharded and non-tensor outputs, ``check_rep=False``: a step (the sharded loss,
``.backward()``) compiled whole equals the eager step exactly in float64 — the loss and every
gradient.  The eager in-process step is itself tested against the unsharded function elsewhere
(test_collectives, test_shard_map, test_properties); here it is the reference the compiled one must reproduce.
The GPT training step (with an ``fpar.optim`` update) and the refusals run in
test_compile_step.py.  Tests use the ``aot_eager`` backend (Dynamo and AOTAutograd: where a
wrong trace would show).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

import fpar
from fpar import P
from fpar._compile import WHOLE_STEP

F64 = torch.float64
TOL = 1e-12
MESH = fpar.make_mesh((2, 2), ("a", "b"))
pytestmark = [
    pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning"),
    pytest.mark.skipif(not WHOLE_STEP, reason="the whole step in one graph needs torch 2.13 or newer"),
]


def _tp_dp(w1, w2, x):
    out = fpar.psum(torch.tanh(x @ w1) @ w2, "b")
    return fpar.pmean((out**2).mean(), "a")


def _gathers(x, c):
    tiled = fpar.all_gather(x, "b", axis=0, tiled=True)  # (2R, C)
    stacked = fpar.all_gather(x * c, ("a", "b"), axis=1)  # (R, 4, C)
    return fpar.psum((tiled**2).sum() + stacked.sin().sum(), ("a", "b"))


def _scatter(x, c):  # x replicated: psum_scatter over both axes, then its square summed
    s = fpar.psum_scatter(x * c, ("a", "b"), scatter_dimension=0, tiled=True)
    return fpar.psum((s**2).sum(), ("b", "a"))


def _all_to_all(x, c):
    y = fpar.all_to_all(x * c, "b", split_axis=0, concat_axis=1, tiled=True)
    z = fpar.all_to_all(y.tanh(), ("a", "b"), split_axis=1, concat_axis=0, tiled=True)
    return fpar.psum((z**2).sum(), ("a", "b"))


def _permute_extremes(x, c):
    shifted = fpar.ppermute(x, ("a", "b"), [(i, (i + 1) % 4) for i in range(4)])
    partial = fpar.ppermute(x * c, "b", [(0, 1)])  # device b=0 receives nothing: zeros
    top = fpar.pmax(x.max(), ("a", "b")) + fpar.pmin((x * c).min(), "b").sum()
    return fpar.psum((shifted * c).sum() + partial.sum(), ("a", "b")) + fpar.pmean(top, "a")


def _index_and_pvary(x, c):
    i = fpar.axis_index(("a", "b")).to(x.dtype) + 1
    v = fpar.pvary(c, "b") * fpar.axis_index("b").to(c.dtype)
    g = fpar.all_gather_invariant(x * i, "a", tiled=True)
    return fpar.psum(g.sum() + (v**2).sum(), "b")


def _varying_out(x, c):  # check_rep=False: block (0, 0) of a value varying over both axes
    return (x * c).sum()


def _sharded_out(x, c):  # one block per device back to a global tensor; loss outside
    return torch.tanh(x) * c, 3


def _keywords(x, c, *, scale, label):
    assert label == "scale"
    return fpar.psum(((x * scale) ** 2).sum(), ("a", "b")) + c.sum()


def _data(*shapes):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*s, dtype=F64, generator=g) for s in shapes]


CASES = {  # name: (per-device f, in_specs, out_specs, shapes, check_rep, kwargs shape or None)
    "psum and pmean (tensor x data parallel)": (
        _tp_dp,
        (P(None, "b"), P("b"), P("a")),
        P(),
        ((6, 8), (8, 6), (4, 6)),
        True,
    ),
    "all_gather, one axis and two": (_gathers, (P("a", "b"), P()), P(), ((4, 6), (3,)), True),
    "psum_scatter over two axes": (_scatter, (P(), P(None, "a")), P(), ((8, 2), (8, 4)), True),
    "all_to_all, one axis and two": (_all_to_all, (P("a"), P()), P(), ((8, 4), (4,)), True),
    "ppermute, pmax, pmin": (_permute_extremes, (P(("a", "b")), P("b")), P(), ((8, 3), (4, 3)), True),
    "axis_index, pvary, all_gather_invariant": (_index_and_pvary, (P("b"), P()), P(), ((4, 3), (3,)), True),
    "check_rep=False output": (_varying_out, (P("a", "b"), P()), P(), ((4, 6), (3,)), False),
    "sharded and non-tensor outputs": (
        _sharded_out,
        (P("a", "b"), P("b")),
        (P("a", "b"), None),
        ((4, 6), (6,)),
        True,
    ),
}


def _loss(out):
    out = out[0] if isinstance(out, tuple) else out
    return (out**2).sum()


@pytest.mark.parametrize("name", CASES)
def test_a_step_compiled_whole_equals_the_eager_step(name):
    f, in_specs, out_specs, shapes, check_rep = CASES[name]
    sharded = fpar.shard(f, MESH, in_specs, out_specs, check_rep=check_rep)
    args = _data(*shapes)

    def step(*leaves):
        out = sharded(*leaves)
        _loss(out).backward()
        return (
            tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in out)
            if isinstance(out, tuple)
            else out.detach()
        )

    def run(fn):
        leaves = [a.clone().requires_grad_() for a in args]
        out = fn(*leaves)
        return out, [p.grad for p in leaves]

    torch._dynamo.reset()
    want, want_grads = run(step)  # eager: checks the signature (the replication check)
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        got, got_grads = run(torch.compile(step, backend="aot_eager", fullgraph=True))
    if isinstance(want, tuple):
        assert got[1] == want[1]
        got, want = got[0], want[0]
    assert got.shape == want.shape
    assert float((got - want).abs().max()) < TOL
    for g, w in zip(got_grads, want_grads):
        assert w is not None and float(w.abs().max()) > 0, "a case whose gradient is zero tests nothing"
        assert float((g - w).abs().max()) < TOL


def test_keyword_tensors_are_replicated_in_the_compiled_step():
    sharded = fpar.shard(_keywords, MESH, (P("a"), P()), P())
    x, c, s = _data((4, 3), (3,), (3,))

    def step(x, c, s):
        loss = sharded(x, c, scale=s, label="scale")
        loss.backward()
        return loss.detach()

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in (x, c, s)]
        return fn(*leaves), [p.grad for p in leaves]

    torch._dynamo.reset()
    want, want_grads = run(step)
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        got, got_grads = run(torch.compile(step, backend="aot_eager", fullgraph=True))
    assert float((got - want).abs().max()) < TOL
    for g, w in zip(got_grads, want_grads):
        assert float((g - w).abs().max()) < TOL


def test_a_broken_replication_promise_is_caught_before_any_compiled_step():
    # The static check reads vmap's batching, which Dynamo cannot trace: the eager call makes it.
    sharded = fpar.shard(_varying_out, MESH, (P("a", "b"), P()), P())
    x, c = _data((4, 6), (3,))
    torch._dynamo.reset()
    with pytest.raises(fpar.ReplicationError):
        sharded(x, c)
    with pytest.raises(torch._dynamo.exc.Unsupported, match="no eager call with these argument shapes yet"):
        torch.compile(lambda x, c: sharded(x, c) * 2, backend="aot_eager", fullgraph=True)(x, c)


@pytest.mark.parametrize("capacity_factor", [None, 1.5])
def test_an_expert_parallel_moe_step_compiled_whole_equals_the_eager_step(capacity_factor):
    mesh = fpar.make_mesh((2,), ("expert",))
    w_router, w_in, w_out, x = _data((8, 4), (4, 8, 16), (4, 16, 8), (16, 8))
    params = {"router": w_router, "w_in": w_in * 0.3, "w_out": w_out * 0.3}

    def f(params, x):
        y, aux = fpar.ops.moe(params, x, top_k=2, axis="expert", capacity_factor=capacity_factor)
        return fpar.psum((y**2).sum(), "expert") + aux

    sharded = fpar.shard(f, mesh, (fpar.ops.moe_specs("expert"), P("expert")), P())

    def step(params, x):
        loss = sharded(params, x)
        loss.backward()
        return loss.detach()

    def run(fn):
        ps = {k: v.clone().requires_grad_() for k, v in params.items()}
        return fn(ps, x), {k: p.grad for k, p in ps.items()}

    torch._dynamo.reset()
    want, want_grads = run(step)
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        got, got_grads = run(torch.compile(step, backend="aot_eager", fullgraph=True))
    assert float((got - want).abs()) < TOL
    for k in params:
        assert float(want_grads[k].abs().max()) > 0
        assert float((got_grads[k] - want_grads[k]).abs().max()) < TOL
