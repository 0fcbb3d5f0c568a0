"""The layers on a real mesh (gloo processes) give the in-process numbers and the same traffic counts.

One launch of 2 processes covers the vocab-parallel embedding and loss, head-parallel attention,
the MLP, Megatron-SP and ring attention.
"""

from __future__ import annotations

import ops_dist_workers
import pytest
from harness import without_gradient_sums
from opstest import assert_tree_close

import fpar


@pytest.mark.multiprocess
def test_real_mesh_equals_in_process():
    results = fpar.launch(ops_dist_workers.worker, 2, timeout=60.0)
    want = ops_dist_workers.programs(fpar.make_mesh((2,), ("tensor",)))
    for rank, got in enumerate(results):
        assert set(got) == set(want)
        for name in want:
            value, grads, stats = got[name]
            assert_tree_close(value, want[name][0], what=f"rank {rank} {name} value")
            assert_tree_close(grads, want[name][1], what=f"rank {rank} {name} grads")
            if stats is None:
                continue  # a repeated call: its values only
            # every collective but the gradient sums, which the real mesh issues per source
            # (bucketed) and the in-process mesh counts per use: tests/test_defer.py, test_dist.py
            assert without_gradient_sums(stats) == without_gradient_sums(want[name][2]), (
                f"rank {rank} {name} traffic"
            )


@pytest.mark.multiprocess
def test_bucket_layout_does_not_depend_on_the_hash_seed(monkeypatch):
    """The plan's gradient-bucket order is the same under any PYTHONHASHSEED.

    Ranks start with different string-hash seeds; a bucket order taken from a set's iteration
    made them all-reduce differently laid-out buffers, silently summing unrelated gradients
    (a data x tensor GPT's fast calls had wrong LayerNorm and bias gradients).
    """
    orders = []
    # each launch is spawned (a forked process keeps the fork server's seed): two seeds, not more
    for seed in ("1", "2"):
        monkeypatch.setenv("PYTHONHASHSEED", seed)
        order, other = fpar.launch(ops_dist_workers.bucket_order, 2, timeout=60.0)
        assert other == order  # both ranks, with this seed
        orders.append(order)
    fast, slots, axes = orders[0]
    assert fast and len(slots) > 4 and set(axes) == {("data",)}
    assert orders[1] == orders[0]


@pytest.mark.multiprocess
def test_sequence_parallel_keeps_the_block_not_the_gathered_input():
    """Megatron-SP as Megatron-LM runs it (Korthikanti et al.'s 34 s b h / t a layer): the backward
    of a column-parallel matmul gathers its input's sequence blocks again, so the forward keeps
    the LayerNorm's output block ``[B, T/n, D]``, not the gathered ``[B, T, D]``.  Kept by a
    LayerNorm then ``sp_mlp`` on each of 2 processes, traced call and planned call alike: the
    norm's output block and statistics, the GeLU's input and output (the whole sequence, F/n
    columns).  The same layer with a plain all-gather keeps the whole sequence instead of the
    block."""
    n, b, t, d = 2, 2, 8, 8
    f, item = 4 * d // n, 8
    want = (b * (t // n) * d + 2 * b * (t // n) + 2 * b * t * f) * item
    for rank in fpar.launch(ops_dist_workers.sp_saved, 2, b, t, d, timeout=60.0):
        for call, (got, shapes) in enumerate(rank["megatron"]):
            assert got == want, (call, shapes)
        for call, (got, shapes) in enumerate(rank["gathered"]):
            assert got == want + (b * t * d - b * (t // n) * d) * item, (call, shapes)
