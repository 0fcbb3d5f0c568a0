"""A real-mesh plan that keeps some sums at their uses keeps every other sum at its source.

A tensor-parallel stage without sequence parallelism returns its residual stream replicated over
'tensor' and also reads it through a pvary: those sums over 'tensor' must sit at their uses, so
the signature stays traced (``fpar/_dist/tracker.py``).  Its parameters' sums over 'data' did too:
one all-reduce per parameter and microbatch, never deferred (a pipeline of such stages sent 3.8
times a step's data-parallel bytes in 43 times the messages).  Now only the sums joined to a
mixed source stay at their uses; the data-parallel ones are bucketed and deferred as in a fast plan.
"""

from __future__ import annotations

import partial_plan_workers as W
import pytest
import torch

import fpar

pytestmark = pytest.mark.multiprocess


def test_a_traced_plan_defers_its_data_parallel_sums_and_equals_the_unsharded_gradient():
    want = W.reference()
    for grads, stats, fast, at_use in fpar.launch(W.step_job, 4, timeout=180):
        for k, g in want.items():
            torch.testing.assert_close(grads[k], g, rtol=1e-12, atol=1e-12, msg=k)
        assert not fast
        # over 'tensor' only: the residual input x (slot 3, after the parameters g, w1, w2) and g
        # (slot 0), which the pvary of x * g sums together with it
        assert at_use == ["(('in', 0), 'tensor')", "(('in', 3), 'tensor')"], at_use
        # one deferred bucket over 'data' for the step's two microbatches (it was a sum per
        # parameter and microbatch at each use: 6)
        assert stats["data"]["psum"]["calls"] == 1, stats
