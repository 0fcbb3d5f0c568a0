"""Mixed precision: bf16/fp16 compute with fp32 master weights, dynamic loss scaling, global skips."""

from __future__ import annotations

import dist_workers_optim as W
import optree
import pytest
import torch

import fpar
import fpar.optim as fo
from fpar import P

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


def _mesh(**axes):
    return fpar.make_mesh(tuple(axes.values()), tuple(axes))


def _setup(opt, params, mesh, stage, specs=None):
    layout = fo.zero_layout(params, mesh, P() if specs is None else specs, stage=stage)
    stored, state = fo.zero_init(opt, params, layout)
    return layout, stored, state


def _full(stored, layout):
    return fo.zero_params(stored, layout)


# bf16 -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_bf16_compute_keeps_fp32_masters_and_tracks_fp32(stage):
    params, batch = W.tp_problem(dtype=F32)
    mesh = _mesh(data=2, tensor=2)
    seen = set()

    def loss(p, b):
        seen.update({p["a1"].dtype, b[0].dtype})
        return W.tp_loss(p, b)

    runs = {}
    for name, opt in (
        ("fp32", fo.adamw(1e-2)),
        ("bf16", fo.mixed_precision(fo.adamw(1e-2), compute_dtype=BF16)),
    ):
        layout, stored, state = _setup(opt, params, mesh, stage, W.TP_SPECS)
        step = fo.zero_step(loss, opt, layout)
        losses = []
        for _ in range(3):
            stored, state, m = step(stored, state, batch)
            losses.append(float(m["loss"]))
        runs[name] = (_full(stored, layout), losses, state)
    assert BF16 in seen
    full, losses, state = runs["bf16"]
    assert all(v.dtype == F32 for v in full.values())  # master weights stay fp32
    state_leaves = optree.tree_leaves(state, none_is_leaf=True)
    assert all(v.dtype in (F32, torch.int64) for v in state_leaves)  # and so does the state
    assert losses == pytest.approx(runs["fp32"][1], rel=3e-2)
    for k, v in full.items():
        torch.testing.assert_close(v, runs["fp32"][0][k], rtol=0.05, atol=0.01)


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("sums", ["float32", "native"])
def test_bf16_communication_bytes(stage, sums):
    # Stage 3 gathers bf16 chunks: half the bytes of fp32.  The gradients of the bf16 copies are
    # summed over devices in float32 and rounded once (fpar's rule: the same bytes as fp32), or in
    # bf16 under fpar.low_precision_sums("native") (half; DDP's and FSDP2's default).
    params, batch = W.mlp_problem(dtype=F32)
    mesh = _mesh(data=4)
    stats = {}
    for name, opt in (
        ("fp32", fo.adamw(1e-2)),
        ("bf16", fo.mixed_precision(fo.adamw(1e-2), compute_dtype=BF16)),
    ):
        layout, stored, state = _setup(opt, params, mesh, stage)
        step = fo.zero_step(W.mlp_loss, opt, layout)
        with fpar.low_precision_sums(sums):
            fpar.reset_comm_stats()
            step(stored, state, batch)
        stats[name] = fpar.comm_stats()["data"]
    summed = "psum" if stage == 0 else "psum_scatter"
    ratio = 2 if sums == "native" else 1
    assert stats["bf16"][summed]["bytes"] * ratio == stats["fp32"][summed]["bytes"]
    if stage == 3:
        assert stats["bf16"]["all_gather"]["bytes"] * 2 == stats["fp32"]["all_gather"]["bytes"]
        assert "psum" not in stats["bf16"]  # loss_scale=None: no overflow check, no extra collective


# fp16 with dynamic loss scaling ---------------------------------------------------------------------------


def _overflow_problem():
    # grad w[0] = mean over rows of x[:, 0] (times the loss scale): only device 1's rows are huge.
    w = torch.full((8,), 0.1)
    x = torch.linspace(-1, 1, 32).reshape(4, 8)
    x[2:, 0] = 6.0e4
    return {"w": w}, x


def _linear_loss(p, x):
    return (x * p["w"]).sum(1).mean()


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_dynamic_scale_skips_overflow_halves_and_grows(stage):
    params, x = _overflow_problem()
    mesh = _mesh(data=2)
    opt = fo.mixed_precision(
        fo.adamw(1e-4), compute_dtype=F16, loss_scale="dynamic", init_scale=4.0, growth_interval=2
    )
    layout, stored, state = _setup(opt, params, mesh, stage)
    step = fo.zero_step(_linear_loss, opt, layout)
    # Device 1's d loss / d w[0] = 6e4 (the mean of its x[:, 0]); its backward starts from
    # scale / 2 (the mean over 2 data ranks), so in fp16 (max 65504) scale 4 overflows, 2 fits.
    trace = []
    for _ in range(5):
        before = _full(stored, layout)["w"]
        stored, state, _ = step(stored, state, x)
        after = _full(stored, layout)["w"]
        adam_count = int(state.inner[0].count)
        trace.append((float(state.loss_scale), int(state.good_steps), torch.equal(before, after), adam_count))
    assert trace == [
        (2.0, 0, True, 0),  # scale 4 overflows: skipped, params and optimizer state unchanged, halve
        (2.0, 1, False, 1),  # scale 2 fits: a real step
        (4.0, 0, False, 2),  # 2 good steps in a row: grow
        (2.0, 0, True, 2),  # scale 4 overflows again: skip, halve
        (2.0, 1, False, 3),
    ]
    assert all(v.dtype == F32 for v in _full(stored, layout).values())


def test_overflow_check_is_global_across_shards():
    # ZeRO-2 on 2 data ranks: after the reduce-scatter only device 0's chunk holds the inf
    # (element 0); device 1's chunk is finite.  Both must skip, or the replicas would diverge.
    params, x = _overflow_problem()
    mesh = _mesh(data=2)
    opt = fo.mixed_precision(fo.sgd(1e-4), compute_dtype=F16, loss_scale="dynamic", init_scale=4.0)
    layout, stored, state = _setup(opt, params, mesh, 2)
    grads, _ = fo.zero_grads(_linear_loss, layout, compute_dtype=F16)(stored, x, state.loss_scale)
    chunks = grads["w"].reshape(2, 4)  # [device, chunk]
    assert not torch.isfinite(chunks[0]).all() and torch.isfinite(chunks[1]).all()
    fpar.reset_comm_stats()
    new, state, _ = fo.zero_step(_linear_loss, opt, layout)(stored, state, x)
    assert torch.equal(new["w"], params["w"])  # both halves unchanged
    assert float(state.loss_scale) == 2.0
    # the agreement: one all-reduce of an int32 flag over the mesh (2 (n-1)/n * 4 bytes)
    assert fpar.comm_stats()["data"]["psum"] == {"calls": 1, "bytes": 4}


def test_all_finite_agrees_on_every_device():
    mesh = _mesh(data=2, tensor=2)
    x = torch.ones(4, 4)
    x[3, 1] = float("nan")  # only the device at (data=1, tensor=0) sees it
    f = fpar.shard(lambda b: fo.all_finite({"x": b}), mesh, (P("data", "tensor"),), P())
    assert not bool(f(x))
    assert bool(f(torch.ones(4, 4)))
    assert not bool(fo.all_finite([torch.ones(2), torch.tensor([float("inf")])]))  # outside shard


def test_skipped_steps_leave_no_trace():
    # A dynamic run whose first two steps overflow then trains at 2^16 equals a static 2^16 run
    # without those steps: skips change nothing, and power-of-two scales are exact.  (Each of the
    # 2 devices' backward starts from scale / 2, the derivative of the mean over data ranks: at
    # 2^18 and 2^17 that is above fp16's max 65504, so the loss gradient itself is inf.)
    params, batch = W.mlp_problem(dtype=F32)
    mesh = _mesh(data=2)
    batches = [batch] * 2 + [W.mlp_problem(dtype=F32, seed=s)[1] for s in (1, 2, 3)]
    results = []
    for opt, data in (
        (
            fo.mixed_precision(fo.adamw(1e-2), compute_dtype=F16, loss_scale="dynamic", init_scale=2.0**18),
            batches,
        ),
        (fo.mixed_precision(fo.adamw(1e-2), compute_dtype=F16, loss_scale=2.0**16), batches[2:]),
    ):
        layout, stored, state = _setup(opt, params, mesh, 2)
        step = fo.zero_step(W.mlp_loss, opt, layout)
        for b in data:
            stored, state, _ = step(stored, state, b)
        results.append((stored, state))
    (a, sa), (b, sb) = results
    assert float(sa.loss_scale) == 2.0**16 and int(sa.good_steps) == 3
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert int(sa.inner[0].count) == int(sb.inner[0].count) == 3


def test_mixed_precision_errors():
    with pytest.raises(ValueError, match="loss_scale must be None, 'dynamic' or a number"):
        fo.mixed_precision(fo.sgd(0.1), loss_scale="auto")
