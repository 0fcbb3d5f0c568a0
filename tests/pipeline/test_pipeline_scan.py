"""GPipe as a scan: ``gpipe_scan`` inside ``fpar.shard`` equals the unpipelined model, values and grads.

Differentiating the sharded scan is the GPipe backward; the tests compare the loss and the
gradients w.r.t. every stage chunk and the input activations (float64) with the plain-torch
model over random (p, m, v), with tensor parallelism inside the stages, and with a stage that
is NaN on the zeros bubble ticks compute on.
"""

from __future__ import annotations

import pipe_models as M
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fpar
import fpar.pipeline as pp
from fpar import P


def _sharded_loss(mesh, stage_fn):
    spec = M.stage_spec(mesh)

    def loss(w, h_MBD, t_MBO, head):
        ys = pp.gpipe_scan(stage_fn, w, h_MBD)
        return ((ys @ head - t_MBO) ** 2).mean()

    return fpar.shard(loss, mesh, (spec, P(), P(), P()), P())


def _reference(stages, h_MBD, t_MBO, head, block):
    for k in range(stages["a"].shape[0]):
        h_MBD = block({"a": stages["a"][k], "b": stages["b"][k]}, h_MBD)
    return ((h_MBD @ head - t_MBO) ** 2).mean()


def _check(mesh, p, m, v, seed=0, block=None):
    prob = M.problem(p, m, v, seed=seed)
    fns = M.make_fns(mesh.axis_names)
    stage_fn = block if block is not None else fns["stage"]
    plain = block if block is not None else M.make_fns()["stage"]
    h = prob["first"]["emb"][prob["xs"]]
    args = (pp.stage_major(prob["stages"], p, v), h, prob["ts"], prob["last"]["head"])
    sharded = _sharded_loss(mesh, stage_fn)
    got = sharded(*args)
    got_g = torch.func.grad(sharded, argnums=(0, 1, 3))(*args)

    def ref(s, h, head):
        return _reference(s, h, prob["ts"], head, plain)

    want = ref(prob["stages"], h, prob["last"]["head"])
    want_g = torch.func.grad(ref, argnums=(0, 1, 2))(prob["stages"], h, prob["last"]["head"])
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_g[0], pp.stage_major(want_g[0], p, v))
    torch.testing.assert_close(got_g[1], want_g[1])
    torch.testing.assert_close(got_g[2], want_g[2])
    return got_g


@settings(max_examples=12)
@given(p=st.integers(1, 3), m=st.integers(1, 4), v=st.integers(1, 2), seed=st.integers(0, 9))
def test_scan_equals_unpipelined(p, m, v, seed):
    if v > 1 and m < p:
        m = p
    _check(fpar.make_mesh((p,), ("pipe",)), p, m, v, seed)


@pytest.mark.parametrize("m,v", [(3, 1), (2, 2)])
def test_scan_with_tensor_parallel_stages(m, v):
    _check(fpar.make_mesh((2, 2), ("pipe", "tensor")), 2, m, v)


def test_bubble_ticks_do_not_leak_nan_into_gradients():
    """A stage that normalises its input is NaN on the zeros of a bubble tick; nothing of it leaks."""

    def normalise_block(w, h_BD):
        u_BD = h_BD / h_BD.norm(dim=-1, keepdim=True)
        return u_BD + torch.tanh(u_BD @ w["a"]) @ w["b"]

    zeros = torch.zeros(2, M.D, dtype=M.F64)
    w0 = {"a": torch.ones(M.D, M.H, dtype=M.F64), "b": torch.ones(M.H, M.D, dtype=M.F64)}
    assert normalise_block(w0, zeros).isnan().all()  # so the test below can fail
    grads = _check(fpar.make_mesh((3,), ("pipe",)), 3, 2, 1, block=normalise_block)
    assert all(g.isfinite().all() for g in (grads[0]["a"], grads[0]["b"], grads[1]))


def test_looped_scan_needs_enough_microbatches():
    mesh = fpar.make_mesh((3,), ("pipe",))
    with pytest.raises(ValueError, match=r"2 microbatches with v=2 chunks per stage on 3 stages.*m >= p"):
        _check(mesh, 3, 2, 2)


def test_stage_params_must_share_the_stacked_dim():
    mesh = fpar.make_mesh((2,), ("pipe",))
    bad = {"a": torch.zeros(2, 4, 4), "b": torch.zeros(4, 4, 4)}
    f = fpar.shard(lambda w, xs: pp.gpipe_scan(lambda w, h: h, w, xs), mesh, (P("pipe"), P()), P())
    with pytest.raises(ValueError, match=r"same leading \(stacked\) dim.*got leading dims \[1, 2\]"):
        f(bad, torch.zeros(2, 3, 4))
