"""GPU tier for pipelines: every schedule on CUDA tensors in-process, and over NCCL.

Skipped without CUDA (the CPU tiers cover the semantics; this tier checks the device paths:
every tensor the executor sends or receives, activations, gradients, shape headers, the loss and
the stats, lives on the stage's device, as NCCL requires).  The NCCL test needs two devices;
its 16 MB activations check that neighbours exchanging in both directions in one tick do not
deadlock (each tick's sends and receives go as one batch).
"""

from __future__ import annotations

import dist_workers as W
import pytest
import torch

import fpar

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PIPE2 = (("pipe", 2),)
EVERY = [
    ("exec_job", (PIPE2, "gpipe", 2, 3, 1)),
    ("exec_job", (PIPE2, "1f1b", 2, 4, 1)),
    ("exec_job", (PIPE2, "interleaved", 2, 4, 2)),
    ("exec_job", (PIPE2, "zb_h1", 2, 3, 1)),
    ("exec_job", (PIPE2, "zb_v", 2, 4, 2)),
    ("exec_job", (PIPE2, "dualpipe_v", 2, 4, 2)),
    ("big_exec_job", (PIPE2, "1f1b", 2, 4, 1)),
    ("big_exec_job", (PIPE2, "zb_v", 2, 4, 2)),
]


def _same(got: dict, want: dict, where: str) -> None:
    for key, e in want.items():
        g = got[key]
        if key in ("first", "last") and g is None:
            continue  # this rank's stage does not hold that part of the model
        if key == "stats":
            assert g == e, f"{where} stats"
        else:
            torch.testing.assert_close(g, e, msg=lambda msg, k=key: f"{where} {k}: {msg}")


def test_every_schedule_on_cuda_equals_cpu():
    for (status, got), (kind, args) in zip(W.run_jobs_on_cuda(EVERY), EVERY):
        assert status == "ok", got
        _same(got, getattr(W, kind)(*args), f"{args[1]} on cuda")


@pytest.mark.multiprocess
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices for NCCL")
def test_every_schedule_on_nccl_equals_in_process():
    _on_nccl(EVERY, 2, timeout=120)


def _on_nccl(jobs: list, nprocs: int, *, timeout: float) -> None:
    """Run ``jobs`` on ``nprocs`` NCCL ranks; every rank's result equals the in-process CPU run."""
    launched = fpar.launch(W.run_jobs_on_cuda, nprocs, jobs, backend="nccl", timeout=timeout)
    for index, (kind, args) in enumerate(jobs):
        want = getattr(W, kind)(*args)
        for rank, results in enumerate(launched):
            status, got = results[index]
            assert status == "ok", f"rank {rank}:\n{got}"
            _same(got, want, f"{args[1]} on {nprocs} stages, rank {rank} over NCCL")


PIPE4 = (("pipe", 4),)
FOUR = [
    ("exec_job", (PIPE4, "1f1b", 4, 4, 1)),
    ("exec_job", (PIPE4, "interleaved", 4, 4, 2)),
    ("big_exec_job", (PIPE4, "zb_v", 4, 8, 2)),
]


@pytest.mark.multiprocess
@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs four CUDA devices for NCCL")
def test_four_stages_on_nccl_equal_in_process():
    """With four stages a tick's batch of p2p ops involves two of the pipe group's four ranks:
    the group's NCCL communicator must already exist (``MeshGroups._connect_axes``)."""
    _on_nccl(FOUR, 4, timeout=180)
