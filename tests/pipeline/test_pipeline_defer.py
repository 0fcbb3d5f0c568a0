"""The pipeline executor reduces data-parallel gradients once per step, and counts its p2p.

One launch of 4 gloo processes (pipe=2 x data=2, 1F1B, 4 microbatches): every step's loss and
gradients equal the unpipelined model's, each rank issues exactly one data-axis all-reduce per
gradient bucket per step (its stage function's parameters, and the embedding or the head),
carrying 2 (n-1)/n x their bytes, and the point-to-point messages counted equal the executor's
formula (activations, gradients, the shape header, the stats row, the first/last gradients).
"""

from __future__ import annotations

import pipe_defer_workers as W
import pipe_models as M
import pytest
import torch

import fpar
import fpar.pipeline as pp

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def launched():
    return fpar.launch(W.pipe_data_job, 4, timeout=90.0)


def _bytes(tree) -> int:
    return sum(t.numel() * t.element_size() for t in tree.values())


def test_values_equal_the_unpipelined_model(launched):
    prob = M.problem(W.P_, W.M_, W.V_)
    loss, g_stages, g_first, g_last = M.reference_grads(prob)
    for rank, res in enumerate(launched):
        for s in res["steps"]:
            torch.testing.assert_close(s["loss"], loss, msg=lambda m, r=rank: f"rank {r} loss: {m}")
            for k, g in pp.stage_major(g_stages, W.P_, W.V_).items():
                torch.testing.assert_close(s["stages"][k], g, msg=lambda m, r=rank, k=k: f"rank {r} {k}: {m}")
            torch.testing.assert_close(s["first"]["emb"], g_first["emb"])
            torch.testing.assert_close(s["last"]["head"], g_last["head"])


def test_one_data_all_reduce_per_bucket_per_step(launched):
    prob = M.problem(W.P_, W.M_, W.V_)
    chunk = {k: v[0] for k, v in prob["stages"].items()}  # one stage's parameters
    for rank, res in enumerate(launched):
        # stage 0 also holds the embedding (first), stage 1 the head (last): two buckets each
        own = _bytes(chunk) + (_bytes(prob["first"]) if res["pipe"] == 0 else _bytes(prob["last"]))
        for s in res["steps"][1:]:  # warm steps (the first traces each signature's first call)
            psum = s["stats"]["data"]["psum"]
            assert psum == {"calls": 2, "bytes": own}, (rank, s["stats"])  # 2 (n-1)/n = 1 for n = 2


def _p2p_formula(stage: int, prob: dict) -> dict:
    """What a stage of the 2-stage executor sends per step: calls and bytes (float64 = 8 B)."""
    rows = prob["xs"].shape[1] // 2  # this rank's rows of a microbatch (data = 2)
    act = rows * M.D * 8  # one activation (stage 0 -> 1) or its gradient (1 -> 0)
    stats_row = 6 * 8  # the loss, its dtype and 4 counters, to the other stage, once per step
    if stage == 0:  # + the first activation's shape header (10 int64) + the embedding's gradient
        return {
            "calls": W.M_ + 3,
            "bytes": W.M_ * act + 10 * 8 + stats_row + prob["first"]["emb"].numel() * 8,
        }
    return {"calls": W.M_ + 2, "bytes": W.M_ * act + stats_row + prob["last"]["head"].numel() * 8}


def test_p2p_messages_counted_equal_the_formula(launched):
    prob = M.problem(W.P_, W.M_, W.V_)
    for i in range(len(launched[0]["steps"])):
        sent = [res["steps"][i]["stats"]["pipe"]["send"] for res in launched]
        got = [res["steps"][i]["stats"]["pipe"]["recv"] for res in launched]
        assert sum(s["calls"] for s in sent) == sum(g["calls"] for g in got)
        assert sum(s["bytes"] for s in sent) == sum(g["bytes"] for g in got)
        for res, s in zip(launched, sent):
            assert s == _p2p_formula(res["pipe"], prob), (res["pipe"], s)
