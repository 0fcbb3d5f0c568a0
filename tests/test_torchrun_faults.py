"""Under torchrun: a rank that raises fails the whole job promptly, naming the error; a killed rank
is restarted by ``--max-restarts`` and the flagship's ``--resume`` continues with the same losses
and ends with a final checkpoint bitwise equal to the uninterrupted run's.

Every run is bounded in time, and its whole process group is killed if it overruns.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torchrun_util import children, free_port, run, started, wait

import fpar

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[1]
PROGRAMS = Path(__file__).resolve().parent / "torchrun_programs"
STEP_LINE = re.compile(r"step\s+(\d+)/\d+ \| loss ([0-9.]+)")


def _torchrun(n: int, *args: str, restarts: int = 0) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(n),
        "--max-restarts",
        str(restarts),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        "--rdzv-id",  # not torchrun's default ("none"): tests that run at once never share a job
        uuid.uuid4().hex,
        *args,
    ]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _run(cmd: list[str], timeout: float, cwd: Path = ROOT) -> tuple[int, str, float]:
    start = time.monotonic()
    res = run(cmd, timeout=timeout, merge=True, cwd=cwd, env=_env())
    return res.returncode, res.stdout, time.monotonic() - start


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_rank_that_raises_fails_the_job_naming_its_error(when):
    # "before": rank 1 raises before its call's first collective (fpar's signature check tells
    # the others, which raise naming rank 1); "after": it raises after a psum, while the others
    # wait in the next collective (torchrun stops them once rank 1 has exited)
    rc, out, seconds = _run(_torchrun(4, str(PROGRAMS / "raise_mid_step.py"), when), timeout=150)
    assert rc != 0
    assert "the model raised on rank 1 at step 2" in out
    # torchrun's report of the failed job (its "Failures" and "Root Cause" sections, from the
    # ranks' error files) names rank 1's exception; the root cause is whichever rank torchrun
    # saw fail first: rank 1, a rank fpar's check told (before), or one whose gloo connection
    # to rank 1 closed (after)
    report = out[out.index("raise_mid_step.py FAILED") :]
    assert "the model raised on rank 1 at step 2" in report, report
    assert "step 3 done" not in out


def test_a_rank_that_raises_with_a_message_in_flight_exits_at_once():
    # Rank 1's call has sent its first message, which rank 0 (waiting for rank 1 in a barrier)
    # never joins; rank 1's exit must not wait for it, or the job hangs until the collective's
    # timeout (600 s here, past this run's bound)
    rc, out, _ = _run(_torchrun(2, str(PROGRAMS / "raise_in_flight.py")), timeout=150)
    assert rc != 0
    report = out[out.index("raise_in_flight.py FAILED") :]
    assert "rank 1 raised at step 2 with its call's first message in flight" in report, report
    assert "fpar: ending the process on the error above without waiting" in out, out[-3000:]
    assert "step 2 loss" not in out


def _losses(out: str) -> dict[int, str]:
    return {int(k): v for k, v in STEP_LINE.findall(out)}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds torchrun's workers in /proc")
def test_a_killed_rank_restarts_and_resume_gives_the_uninterrupted_losses(tmp_path):
    steps = 8
    args = [
        "--tiny",
        "--steps",
        str(steps),
        "--ckpt-every",
        "1",
        "--log-every",
        "1",
        "--plot",
        "none",
        "--sample",
        "0",
    ]
    script = str(ROOT / "examples" / "train_gpt.py")
    rc, straight, _ = _run(_torchrun(2, script, *args, "--ckpt-dir", str(tmp_path / "a")), timeout=240)
    assert rc == 0, straight[-3000:]
    want = _losses(straight)
    assert sorted(want) == list(range(1, steps + 1))

    ckpt = tmp_path / "b"
    cmd = _torchrun(2, script, *args, "--resume", "--ckpt-dir", str(ckpt), restarts=1)
    with started(cmd, merge=True, cwd=ROOT, env=_env()) as proc:
        deadline = time.monotonic() + 180
        killed = None
        while killed is None and time.monotonic() < deadline and proc.poll() is None:
            step = fpar.checkpoint.latest_step(ckpt) if ckpt.exists() else None
            if step is not None and step >= 2:
                kids = sorted(children(proc.pid))  # torchrun's agent -> its workers
                workers = [k for pid in kids for k in children(pid)] or kids
                if workers:
                    killed = workers[-1]
                    os.kill(killed, signal.SIGKILL)
                    break
            time.sleep(0.02)
        out, _ = wait(proc, 240)  # the restarted run
    assert killed is not None, "the run ended before a rank could be killed: make it longer"
    assert proc.returncode == 0, out[-4000:]
    assert re.search(r"resumed from .* at step [2-9]", out), out[-4000:]
    got = _losses(out)  # both attempts' lines: the steps redone after the restart print again, the same
    assert set(got) == set(want)
    for line_step, loss in STEP_LINE.findall(out):
        assert loss == want[int(line_step)], (
            f"step {line_step}: {loss} after the restart, {want[int(line_step)]} straight"
        )
    # The final checkpoints (parameters, optimizer state) are bitwise equal, not just the printed
    # losses: the restarted run's first step traces each signature, and a traced call must add
    # its microbatches' gradients in the order the uninterrupted run's steady calls do.
    _assert_same_final_checkpoint(tmp_path / "a", ckpt, steps, tmp_path)


@pytest.mark.parametrize(
    "parallel", ["pipeline=1,data=1,tensor=2", "pipeline=2,data=1,tensor=1"], ids=["tensor2", "pipeline2"]
)
def test_a_stopped_and_resumed_run_ends_bitwise_as_the_uninterrupted_one(tmp_path, parallel):
    # Data=2 is the killed-rank test's; here the other two axes: a tensor-parallel run (whose
    # first step after the resume traces the row-parallel sums) and a pipelined one (whose
    # executor defers the stages' data sums), each stopped after step 2 and resumed to step 4.
    steps = 4
    args = [
        "--tiny",
        "--steps",
        str(steps),
        "--microbatches",
        "2",
        "--parallel",
        parallel,
        "--ckpt-every",
        "1",
        "--log-every",
        "1",
        "--plot",
        "none",
        "--sample",
        "0",
    ]
    script = str(ROOT / "examples" / "train_gpt.py")
    rc, straight, _ = _run(_torchrun(2, script, *args, "--ckpt-dir", str(tmp_path / "a")), timeout=180)
    assert rc == 0, straight[-3000:]
    b = str(tmp_path / "b")
    rc, first, _ = _run(_torchrun(2, script, *args, "--ckpt-dir", b, "--stop-after", "2"), timeout=180)
    assert rc == 0, first[-3000:]
    assert fpar.checkpoint.latest_step(b) == 2, first[-3000:]
    rc, second, _ = _run(_torchrun(2, script, *args, "--ckpt-dir", b, "--resume"), timeout=180)
    assert rc == 0, second[-3000:]
    assert re.search(r"resumed from .* at step 2", second), second[-3000:]
    assert _losses(first) | _losses(second) == _losses(straight)
    _assert_same_final_checkpoint(tmp_path / "a", tmp_path / "b", steps, tmp_path)


def _assert_same_final_checkpoint(straight: Path, resumed: Path, step: int, tmp: Path) -> None:
    """Every tensor of the two runs' checkpoints at ``step`` (parameters, optimizer state) is equal."""
    want = load_file(fpar.checkpoint.merge(straight, tmp / "straight.safetensors", step=step))
    got = load_file(fpar.checkpoint.merge(resumed, tmp / "resumed.safetensors", step=step))
    assert want.keys() == got.keys()
    differ = {k: (want[k] - got[k]).abs().max().item() for k in want if not torch.equal(want[k], got[k])}
    assert not differ, f"the resumed run's final checkpoint differs from the uninterrupted run's: {differ}"
