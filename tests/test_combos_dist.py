"""Features that worked alone but not in combination on the real mesh (issue: every feature on both meshes).

Each test failed before its fix: ``fpar.gather`` of a replicated block returned the block itself
on a real mesh (a donated update then changed what the user had gathered);
``torch.compile(fpar.shard(f, ...), fullgraph=True)`` raised Dynamo's "found no compiled frames".
``fpar.optim.remat``: ``test_remat_dist.py``.
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


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_compile_of_a_sharded_function_fullgraph_on_both_meshes():
    for unplanned, eager, compiled in [cp.compiled_shard(), *fpar.launch(cp.compiled_shard, 2, timeout=300)]:
        assert unplanned is not None and "no eager call with these argument shapes yet" in unplanned
        for a, b in zip(eager, compiled):
            torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
