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
