"""Features that worked alone but not in combination on the real mesh (issue: every feature on both meshes).

Each test failed before its fix: ``fpar.gather`` of a replicated block returned the block itself
on a real mesh (a donated update then changed what the user had gathered); a final call after
``fpar.defer_reduction()`` on other tensors or shapes reduced only its own gradient (the deferred
ones were reported at the next scope, or never).  ``fpar.optim.remat``: ``test_remat_dist.py``.
"""

from __future__ import annotations

import combo_programs as cp
import pytest
import torch

import fpar

pytestmark = pytest.mark.multiprocess


def test_gather_returns_a_copy_on_both_meshes():
    local = cp.gather_is_a_copy()
    for shared, kept in [local, *fpar.launch(cp.gather_is_a_copy, 2)]:
        assert shared == {"rep": False, "split": False}
        assert kept == {"rep": True, "split": True}  # the in-place update did not reach the gathered copy


def test_defer_unmatched_final_call_is_an_error_at_that_call():
    results = fpar.launch(cp.defer_cases, 2, timeout=120)
    for matched, other, shorter in results:
        assert isinstance(matched, torch.Tensor)  # the matched step: the sum of both microbatches
        for message in (other, shorter):
            assert isinstance(message, str), message
            assert "comes after 1 deferred call(s) of the same sharded function" in message
            assert "same parameter tensors with the same shapes" in message
    # the matched step's gradient is the sum of the two microbatches' gradients, in-process too
    local = cp.defer_unmatched("matched")
    torch.testing.assert_close(results[0][0], local, rtol=1e-12, atol=1e-12)
    assert cp.defer_unmatched("other_tensors") is None  # in-process: nothing is deferred, all is right
