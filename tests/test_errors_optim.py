"""fpar.optim with mismatched trees names the trees and the leaf (not a raw torch error)."""

from __future__ import annotations

import pytest
import torch

import fpar

PARAMS = {"w1": torch.zeros(2, 2), "w2": torch.zeros(2)}
ADAM = fpar.optim.adamw(1e-3)
SGD = fpar.optim.sgd(0.1, momentum=0.9)
STATE_FIX = (
    "The grads must have one leaf per parameter, and the state must come from this optimizer's "
    "init(params) for the same params."
)


@pytest.mark.parametrize(
    ("grads", "message"),
    [
        pytest.param(
            {"w1": torch.zeros(2, 2)},
            "fpar.optim.scale_by_adam: updates and state.mu are not the same tree: state.mu has ['w2'] "
            "that updates lacks. " + STATE_FIX,
            id="grads-missing-a-leaf",
        ),
        pytest.param(
            {"w1": torch.zeros(2, 2), "w2": torch.zeros(2), "b": torch.zeros(1)},
            "fpar.optim.scale_by_adam: updates and state.mu are not the same tree: updates has ['b'] "
            "that state.mu lacks. " + STATE_FIX,
            id="grads-extra-leaf",
        ),
        pytest.param(
            {"w1": torch.zeros(3, 3), "w2": torch.zeros(2)},
            "fpar.optim.scale_by_adam: updates and state.mu are not the same tree: at ['w1'] updates "
            "is a tensor float32[3, 3], state.mu a tensor float32[2, 2]. " + STATE_FIX,
            id="grads-wrong-shape",
        ),
    ],
)
def test_adam_with_mismatched_grads(grads, message):
    with pytest.raises(ValueError) as info:
        ADAM.update(grads, ADAM.init(PARAMS), PARAMS)
    assert str(info.value) == message


def test_momentum_with_mismatched_grads():
    with pytest.raises(ValueError) as info:
        SGD.update({"w1": torch.zeros(2, 2)}, SGD.init(PARAMS), PARAMS)
    assert str(info.value).startswith(
        "fpar.optim.trace: updates and state.trace are not the same tree: state.trace has ['w2'] that updates lacks."
    )


def test_state_of_another_optimizer():
    with pytest.raises(ValueError) as info:
        ADAM.update(PARAMS, SGD.init(PARAMS), PARAMS)
    assert str(info.value) == (
        "fpar.optim.chain: state is a tuple of 2 entries, but this chain has 3 transformations: the "
        "state comes from another optimizer. Build it with this optimizer's init(params)."
    )


def test_state_of_another_tree():
    with pytest.raises(ValueError) as info:
        ADAM.update(PARAMS, ADAM.init({"a": torch.zeros(2)}), PARAMS)
    assert str(info.value).startswith(
        "fpar.optim.scale_by_adam: updates and state.mu are not the same tree: updates has ['w1'], "
        "['w2'] that state.mu lacks; state.mu has ['a'] that updates lacks."
    )


def test_weight_decay_with_other_params():
    opt = fpar.optim.add_decayed_weights(0.1)
    with pytest.raises(
        ValueError,
        match=r"add_decayed_weights: updates and params are not the same tree: params has \['w2'\]",
    ):
        opt.update({"w1": torch.zeros(2, 2)}, opt.init(PARAMS), PARAMS)


def test_apply_updates_with_mismatched_trees():
    with pytest.raises(ValueError) as info:
        fpar.optim.apply_updates(PARAMS, {"w1": torch.zeros(2, 2)})
    assert str(info.value) == (
        "fpar.optim.apply_updates: params and updates are not the same tree: params has ['w2'] that "
        "updates lacks. Pass the updates that update() returned for these params (one per "
        "parameter, same shapes)."
    )
    with pytest.raises(
        ValueError, match=r"at \['w2'\] params is a tensor float32\[2\], updates a tensor float32\[3\]"
    ):
        fpar.optim.apply_updates(PARAMS, {"w1": torch.zeros(2, 2), "w2": torch.zeros(3)})


def test_matching_trees_still_step():
    state = ADAM.init(PARAMS)
    grads = {"w1": torch.ones(2, 2), "w2": torch.ones(2)}
    updates, state = ADAM.update(grads, state, PARAMS)
    new = fpar.optim.apply_updates(PARAMS, updates)
    assert torch.all(new["w1"] < 0)


# ZeRO: the gradient of one's own sharded loss handed to zero_update (issue 33) -----------------


def _tour_loss(params, x, y):
    h = x @ params["w1"] + params["b"]
    out = fpar.psum(torch.relu(h) @ params["w2"], "tensor")
    return fpar.pmean(((out - y) ** 2).mean(), "data")


@pytest.mark.parametrize(
    ("stage", "leaf", "given", "want"),
    [
        (1, "['b']", "(32,)", "(2, 32)"),
        (2, "['w1']", "(16, 32)", "(512,)"),
        (3, "['w1']", "(16, 32)", "(512,)"),
    ],
)
def test_zero_update_given_the_global_gradient_says_what_it_takes(stage, leaf, given, want):
    P = fpar.P
    mesh = fpar.make_mesh((2, 2), ("data", "tensor"))
    specs = {"w1": P(None, "tensor"), "w2": P("tensor", None), "b": P("tensor")}
    sharded = fpar.shard(_tour_loss, mesh, in_specs=(specs, P("data"), P("data")), out_specs=P())
    g = torch.Generator().manual_seed(0)
    params = {
        "w1": torch.randn(16, 32, generator=g),
        "w2": torch.randn(32, 16, generator=g),
        "b": torch.zeros(32),
    }
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
    opt = fpar.optim.adamw(1e-3)
    layout = fpar.optim.zero_layout(params, mesh, specs, stage=stage)
    stored, state = fpar.optim.zero_init(opt, params, layout)
    update = fpar.optim.zero_update(opt, layout)
    grads = torch.func.grad(sharded)(params, x, y)
    fpar.reset_comm_stats()
    with pytest.raises(ValueError) as info:
        update(grads, state, stored)
    assert fpar.comm_stats() == {}  # raised before any communication
    message = str(info.value)
    assert message.startswith(
        f"fpar.optim.zero_update (ZeRO stage {stage}): grads{leaf} has shape {given} (the parameter's shape: "
        "a gradient of the global loss)"
    ), message
    assert f"shape {want} here" in message, message
    assert "already summed over 'data', which only stage 0 takes" in message
    assert "fpar.optim.zero_grads(loss_fn, layout)" in message and "fpar.optim.zero_step(" in message
    # Stage 0 takes exactly that gradient.
    layout0 = fpar.optim.zero_layout(params, mesh, specs, stage=0)
    stored0, state0 = fpar.optim.zero_init(opt, params, layout0)
    fpar.optim.zero_update(opt, layout0)(grads, state0, stored0)
