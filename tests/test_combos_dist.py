"""Features that worked alone but not in combination on the real mesh (issue: every feature on both meshes).

Each test failed before its fix: ``fpar.gather`` of a replicated block returned the block itself
on a real mesh (a donated update then changed what the user had gathered); a final call after
``fpar.defer_reduction()`` on other tensors or shapes reduced only its own gradient (the deferred
ones were reported at the next scope, or never: now at the end of that call's backward);
ZeRO-3 with microbatches over a tensor axis deferred sums of its per-microbatch gathered parameters;
``torch.compile(fpar.shard(f, ...), fullgraph=True)`` raised Dynamo's "found no compiled frames".
``fpar.optim.remat``: ``test_remat_dist.py``.
"""

from __future__ import annotations

import combo_programs as cp
import pytest
import torch

import fpar
from fpar.testing import TrainingProgram, assert_programs_on_real_mesh

pytestmark = pytest.mark.multiprocess


def test_gather_returns_a_copy_on_both_meshes():
    local = cp.gather_is_a_copy()
    for shared, kept in [local, *fpar.launch(cp.gather_is_a_copy, 2)]:
        assert shared == {"rep": False, "split": False}
        assert kept == {"rep": True, "split": True}  # the in-place update did not reach the gathered copy


def test_defer_unmatched_final_call_is_an_error_at_the_end_of_its_backward():
    results = fpar.launch(cp.defer_cases, 2, timeout=120)
    local = [cp.defer_unmatched(c) for c in ("matched", "shared")]
    for matched, shared, other, shorter in results:
        for message in (other, shorter):
            assert isinstance(message, str), f"no error: {message}"
            assert "1 earlier deferred call(s) of the same sharded function were never reduced" in message
            assert "same parameter tensors with the same shapes" in message
        # the error names both calls: how the final call differs from the deferred ones
        assert (
            "same argument shapes but other tensors than the deferred calls at replicated tensor argument(s) #0"
            in other
        )
        assert (
            "args[1]: float64[4, 4] P('data') in the deferred call(s), float64[2, 4] P('data') in this one"
            in shorter
        )
        # the matched step (and each layer of the shared function): the sum of both microbatches,
        # as in-process (where nothing is deferred)
        torch.testing.assert_close(matched[0], local[0][0], rtol=1e-12, atol=1e-12)
        for got, want in zip(shared, local[1]):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # in-process nothing is deferred (no messages): every case runs, none has sums to lose
    assert all(isinstance(cp.defer_unmatched(c), list) for c in ("other_tensors", "shorter"))


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_compile_of_a_sharded_function_fullgraph_on_both_meshes():
    for unplanned, eager, compiled in [cp.compiled_shard(), *fpar.launch(cp.compiled_shard, 2, timeout=300)]:
        assert unplanned is not None and "no eager call with these argument shapes yet" in unplanned
        for a, b in zip(eager, compiled):
            torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


def test_dropout_inside_remat_when_two_values_of_one_shape_vary_differently():
    """ZeRO-3's gathered parameters and the activations share a shape but not their varying axes,
    so the plan stays traced; dropout inside remat asked the recomputation which axes a value varies
    over and got "ambiguous" (the random real-mesh tier drew it): the recompute's tracker answers."""
    program = TrainingProgram(
        (1, 2, 1), ("pipe", "data", "tensor"), driver="zero", zero_stage=3, layers=2, dropout=0.25,
        clip=0.05, remat=True, steps=1, seed=0,
    )  # fmt: skip
    assert_programs_on_real_mesh([program], timeout=300)


def test_zero3_with_microbatches_over_a_tensor_axis():
    """ZeRO-3 gathers its parameters afresh each microbatch: accumulate's deferral must not defer
    their sums over the tensor axis (no later microbatch passes the same tensors); the feature
    matrix found the second step raising in the reduce-scatter hook (``.grad`` None)."""
    program = TrainingProgram(
        (1, 2), ("data", "tensor"), driver="zero", zero_stage=3, n_micro=2, steps=2, seed=13
    )
    assert_programs_on_real_mesh([program], timeout=300)
