"""Donated optimizer updates (``zero_update(..., donate=True)``): in place, the same values.

Under ``fpar.optim._ops.donation`` the built-in transformations write into the tensors they
are given.  The reference is the same optimizer run functionally on copies: values must be
bit-for-bit equal (the same kernels), and the donated buffers must really be reused.
"""

from __future__ import annotations

import optree
import pytest
import torch

import fpar
import fpar.optim as fo
from fpar import P
from fpar.optim import _ops as ops

F64 = torch.float64


def _problem(seed=0, shapes=((5, 3), (7,), (2, 4, 3))):
    gen = torch.Generator().manual_seed(seed)
    params = {f"p{i}": torch.randn(s, generator=gen, dtype=F64) for i, s in enumerate(shapes)}
    grads = [{k: torch.randn(v.shape, generator=gen, dtype=F64) for k, v in params.items()} for _ in range(3)]
    return params, grads


def _clone(tree):
    return optree.tree_map(lambda t: t.clone(), tree)


def _addresses(tree):
    return [t.data_ptr() for t in optree.tree_leaves(tree) if isinstance(t, torch.Tensor) and t.dim() > 0]


OPTIMIZERS = {
    "adamw": lambda: fo.adamw(1e-2, weight_decay=0.1),
    "adam": lambda: fo.adam(3e-3),
    "sgd_momentum": lambda: fo.sgd(1e-2, momentum=0.9, weight_decay=0.05),
    "sgd_nesterov": lambda: fo.sgd(1e-2, momentum=0.9, nesterov=True),
    "sgd": lambda: fo.sgd(0.1),
    "clipped_adamw": lambda: fo.chain(fo.clip_by_global_norm(0.5), fo.adamw(1e-2)),
    "scheduled": lambda: fo.chain(fo.scale_by_adam(), fo.scale_by_learning_rate(lambda c: 1e-2 / (1.0 + c))),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_donated_updates_equal_functional_ones_bit_for_bit(name):
    opt = OPTIMIZERS[name]()
    params, grads = _problem()
    ref_p, ref_s = params, opt.init(params)
    don_p, don_s = _clone(params), _clone(ref_s)
    for g in grads:
        u, ref_s = opt.update(g, ref_s, ref_p)
        ref_p = fo.apply_updates(ref_p, u)
        before = _addresses((don_s, don_p))
        with ops.donation():
            u, don_s = opt.update(_clone(g), don_s, don_p)
            don_p = fo.apply_updates(don_p, u)
        assert _addresses((don_s, don_p)) == before  # the state and params were updated in place
    for a, b in zip(optree.tree_leaves((ref_p, ref_s)), optree.tree_leaves((don_p, don_s))):
        assert torch.equal(a, b)


def test_without_donation_nothing_is_written():
    opt = fo.adamw(1e-2)
    params, grads = _problem()
    state = opt.init(params)
    keep = _clone((params, state, grads[0]))
    u, _ = opt.update(grads[0], state, params)
    fo.apply_updates(params, u)
    for a, b in zip(optree.tree_leaves(keep), optree.tree_leaves((params, state, grads[0]))):
        assert torch.equal(a, b)


def test_aliased_or_expanded_buffers_are_not_written_in_place():
    # One gradient tensor for two parameters (autograd does this for x + y), and a stride-0
    # expansion (the gradient of a sum): writing into them would change another leaf too.
    shared = torch.randn(4, dtype=F64)
    grads = {"a": shared, "b": shared, "c": torch.ones((), dtype=F64).expand(4)}
    params = {k: torch.randn(4, dtype=F64) for k in grads}
    opt = fo.sgd(0.1, weight_decay=0.5)
    want, _ = opt.update(_clone(grads), opt.init(params), params)
    keep = shared.clone()
    with ops.donation():
        assert not ops.writable([shared, shared])
        assert not ops.writable([grads["c"]])
        assert not ops.writable([shared[:3], shared[1:]])  # overlapping views
        assert ops.writable([shared[:2], shared[2:]])
        got, _ = opt.update(grads, opt.init(params), params)
    assert torch.equal(shared, keep)
    for k in grads:
        assert torch.equal(got[k], want[k])


def test_meta_buffers_are_told_apart_by_storage():
    """fpar.plan runs a step on meta tensors, which have no addresses (``data_ptr()`` is 0 for all):
    donation must see distinct meta buffers as distinct, and views of one as overlapping, as on
    real tensors (else the planner costs a donated update as a functional one: twice the state)."""
    a, b = torch.empty(4, 3, device="meta"), torch.empty(4, 3, device="meta")
    with ops.donation():
        assert ops.writable([a, b])
        assert not ops.writable([a, a])
        assert not ops.writable([a[:3], a[2:]])  # overlapping rows of one storage
        assert ops.writable([a[:2], a[2:], b])
    assert not ops.writable([a, b])  # not donated


def test_scaled_mixed_precision_keeps_the_old_state_on_overflow_under_donation():
    opt = fo.mixed_precision(fo.adamw(1e-2), compute_dtype=torch.float16, loss_scale="dynamic")
    params = {"w": torch.randn(3, 4)}
    state = opt.init(params)
    _, state = opt.update({"w": torch.randn(3, 4)}, state, params)
    keep = _clone(state.inner)
    with ops.donation():
        _, new = opt.update({"w": torch.full((3, 4), float("inf"))}, state, params)
    for a, b in zip(optree.tree_leaves(keep), optree.tree_leaves(new.inner)):
        assert torch.equal(a, b)
    for a, b in zip(optree.tree_leaves(keep), optree.tree_leaves(state.inner)):
        assert torch.equal(a, b)  # not overwritten either


@pytest.mark.parametrize("stage", [0, 3])
def test_donate_in_process_stays_functional_and_equal(stage):
    mesh = fpar.make_mesh((2,), ("data",))
    gen = torch.Generator().manual_seed(3)
    params = {"w": torch.randn(4, 3, generator=gen, dtype=F64), "b": torch.randn(3, generator=gen, dtype=F64)}
    x, y = torch.randn(8, 4, generator=gen, dtype=F64), torch.randn(8, 3, generator=gen, dtype=F64)

    def loss(p, batch):
        return ((batch[0] @ p["w"] + p["b"] - batch[1]) ** 2).mean()

    layout = fo.zero_layout(params, mesh, P(), stage=stage)
    opt = fo.adamw(1e-2)
    runs = []
    for donate in (False, True):
        p, s = fo.zero_init(opt, params, layout)
        step = fo.zero_step(loss, opt, layout, donate=donate)
        kept = _clone((p, s))
        p2, s2, _ = step(p, s, (x, y))
        for a, b in zip(optree.tree_leaves(kept), optree.tree_leaves((p, s))):
            assert torch.equal(a, b)  # in-process the donated inputs are not written
        runs.append(optree.tree_leaves((p2, s2)))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
