"""Elastic re-layout and several nodes, under torchrun on this host: the flagship's losses do not
depend on how many processes compute them.

* **A node lost**: two torchrun agents of 2 processes (``--nnodes 1:2``, c10d rendezvous,
  ``--max-restarts 3``) run ``examples/train_gpt.py --tiny --resume`` on pipeline=2 x data=2;
  after step ``K`` one agent and its workers are SIGKILLed; the other agent restarts its workers
  on data=2 (pipeline=1), which load the last checkpoint onto that layout and finish.
* **A node joining**: one agent starts alone (data=2); after step ``K`` a second agent joins, the
  first restarts its workers, and the job finishes on pipeline=2 x data=2.
* **Several nodes**: two launches of ``torchrun --nnodes 2 --nproc-per-node 2``, with c10d
  rendezvous and with static node ranks (``--node-rank``, ``--master-addr 127.0.0.1``).

Every printed loss must equal the in-process run's (``examples/train_gpt.py`` in this process,
4 devices, the same flags).  The tolerance is one unit in the printed last digit (1e-4):
the global batch, its order and every random bit are functions of the step alone, not of the
layout, so the runs compute the same training run; only sums reassociate (pipeline microbatches,
data-parallel means), which in float64 moves a loss by ~1e-15, far below the printed 4 decimals,
but can still flip a rounding.  Measured: every printed loss was identical.

The runs are bounded in time; every launcher and its workers are killed at the end.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torchrun_util import TAIL, children, dump_stacks, finish, free_port, kill_tree, stack_env, started

import fpar

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds torchrun's workers in /proc"),
]

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "examples" / "train_gpt.py")
STEP_LINE = re.compile(r"step\s+(\d+)/\d+ \| loss ([0-9.]+)")
STEPS, K = 20, 2  # 18 steps after K: time for a node to join while the job runs
FLAGS = ["--tiny", "--steps", str(STEPS), "--dtype", "float64", "--ckpt-every", "1", "--log-every", "1"]
QUIET = ["--plot", "none", "--sample", "0"]
# Elastic runs: both agents are clients of a c10d store the test hosts, so either can die.
# last_call: how long a rendezvous waits for more nodes once it has the minimum (the agents
# start together); keep_alive: a dead node leaves the rendezvous after 3 s without a heartbeat.
RDZV_CONF = "join_timeout=120,last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3"
_REFERENCE: dict[tuple, list[float]] = {}


def reference(*extra: str) -> list[float]:
    """The in-process run's losses (4 devices: pipeline=2 x data=2), computed once per flags.

    ``--zero`` is left out: ZeRO-1 and ZeRO-3 give the same losses as the default (AdamW is
    elementwise; the global-norm clip sums the same squares), which the runs below check too.
    """
    if extra not in _REFERENCE:
        sys.path.insert(0, str(ROOT / "examples"))
        import tempfile

        import train_gpt

        with tempfile.TemporaryDirectory() as tmp:
            flags = [
                *FLAGS,
                *QUIET,
                *extra,
                "--ckpt-every",
                "0",
                "--devices",
                "4",
                "--quiet",
                "--ckpt-dir",
                tmp,
            ]
            res = train_gpt.main(flags)
        _REFERENCE[extra] = res.losses
    return _REFERENCE[extra]


def _env() -> dict:
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE: torch 2.13's agents share the rendezvous store with
    # their workers, and an agent that stays rank 0 across rounds then never publishes the new
    # round's MASTER_ADDR, so a node that joins waits for it until its store times out (seen
    # here: scale-up failed that way); unshared, every round publishes it.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    return stack_env({**env, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})  # stacks on a timeout


# torchrun with its workers' store port drawn as free_port() draws (below the kernel's ephemeral
# range): with the store unshared (``_env``) the rank-0 agent picks that port by binding port 0,
# and an outgoing connection of the gloo tests beside it can take it before the workers bind it
# (a CI flake, 2026-11-30: "EADDRINUSE" in a worker's TCPStore, the joining run timed out).
PORTS = (
    f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import torchrun_util; "
    "import torch.distributed.elastic.rendezvous.api as a; a.get_free_port = torchrun_util.free_port; "
    "import torch.distributed.run as r; "
)
UNGATED = PORTS + "r.main()"
# ... its imports done, waiting for a line on stdin before it starts (so a joining agent registers
# within a second of the signal, not after seconds of imports on a busy machine)
GATED = PORTS + "sys.stdin.readline(); r.main()"


def _agent(
    port: int, ckpt: Path, *extra: str, nnodes: str = "1:2", static: int | None = None, gated: bool = False
):
    conf = RDZV_CONF + ",is_host=false" if nnodes != "2" else RDZV_CONF
    rdzv = (
        ["--node-rank", str(static), "--master-addr", "127.0.0.1", "--master-port", str(port)]
        if static is not None
        else [
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-conf",
            conf,
            # One job id per test: free_port() can hand two tests that run at once (pytest-xdist)
            # the same port, and with torchrun's default id ("none") their agents then joined one
            # rendezvous (seen: a job's first round held the other test's agent too).
            "--rdzv-id",
            hashlib.sha1(str(ckpt).encode()).hexdigest()[:16],
        ]
    )
    cmd = [
        sys.executable,
        "-c",
        GATED if gated else UNGATED,
        "--nnodes",
        nnodes,
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "3",
        *rdzv,
        SCRIPT,
        *FLAGS,
        *QUIET,
        *extra,
        "--resume",
        "--ckpt-dir",
        str(ckpt),
    ]
    return started(
        cmd, merge=True, cwd=ROOT, env=_env(), stdin=subprocess.PIPE if gated else subprocess.DEVNULL
    )


@pytest.fixture
def store_port():
    """A c10d store outside every agent (as on a cluster, where it runs on a node that stays)."""
    port = free_port()
    code = (
        "import datetime, time, torch.distributed as d; "
        f"s = d.TCPStore('127.0.0.1', {port}, is_master=True, timeout=datetime.timedelta(seconds=300)); "
        "print('ready', flush=True); time.sleep(3600)"
    )
    with started([sys.executable, "-c", code], env=_env(), stderr=None) as proc:
        assert proc.stdout.readline().strip() == "ready"
        yield port


def _wait_for_step(ckpt: Path, step: int, procs: list, timeout: float) -> None:
    """Wait until the run has committed ``step``; on a timeout kill every launcher and show their output."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        latest = fpar.checkpoint.latest_step(ckpt) if ckpt.exists() else None
        if latest is not None and latest >= step:
            return
        if any(p.poll() is not None for p in procs):
            return
        time.sleep(0.05)
    pytest.fail(f"no checkpoint of step {step} within {timeout:g} s:\n" + _killed(*procs))


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _told_to_stop(pid: int) -> bool:
    """Whether a stopped ``pid`` has a SIGTERM pending (its agent is restarting the workers)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    pending = {k: int(v, 16) for k, v in re.findall(r"^(SigPnd|ShdPnd):\s*([0-9a-f]+)$", status, re.M)}
    return any(mask >> (signal.SIGTERM - 1) & 1 for mask in pending.values())


def _killed(*procs) -> str:
    """Kill every launcher still running; their exit codes and the tails of their output (with stacks)."""
    running = [p for p in procs if p.poll() is None]
    for p in running:
        dump_stacks(p.pid, settle=0)
    if running:
        time.sleep(2)
    outs = []
    for p in procs:
        if p.poll() is None:
            kill_tree(p.pid)
        outs.append(f"rc {p.wait()}:\n{p.communicate()[0][-TAIL:]}")
    return "\n----\n".join(outs)


def _check_losses(outs: list[str], want: list[float], steps: int = STEPS) -> dict[int, float]:
    lines = [(int(s), float(v)) for out in outs for s, v in STEP_LINE.findall(out)]
    got = dict(lines)
    assert sorted(got) == list(range(1, steps + 1)), "\n----\n".join(o[-3000:] for o in outs)
    for step, loss in lines:  # every printed line, the steps redone after a restart included
        assert abs(loss - want[step - 1]) <= 1e-4, (
            f"step {step}: {loss} printed, {want[step - 1]:.6f} in-process"
        )
    return got


def _meshes(outs: list[str]) -> list[str]:
    return re.findall(r"mesh (\{[^}]*\}) \(real", "\n".join(outs))


def test_a_node_lost_mid_run_continues_on_fewer_processes_with_zero1_state(tmp_path, store_port):
    zero, want = "1", reference()
    port, ckpt = store_port, tmp_path / "run"
    with _agent(port, ckpt, "--zero", zero) as host, _agent(port, ckpt, "--zero", zero) as lost:
        _wait_for_step(ckpt, K, [host, lost], timeout=240)
        if lost.poll() is not None or host.poll() is not None:
            pytest.fail("a launcher ended before the kill:\n" + _killed(host, lost))
        kill_tree(lost.pid)  # its agent and its workers, as a node that loses power
        lost_out, _ = lost.communicate()
        (host_out,) = finish([host], timeout=300)
    assert host.returncode == 0, host_out[-4000:]
    assert re.search(r"resumed from .* at step ([2-9])", host_out), host_out[-4000:]
    meshes = _meshes([host_out, lost_out])
    assert (
        meshes[0] == "{'pipeline': 2, 'data': 2, 'tensor': 1}"
        and meshes[-1] == "{'pipeline': 1, 'data': 2, 'tensor': 1}"
    )
    _check_losses([host_out, lost_out], want)


def test_a_node_joining_grows_the_job_with_zero3_state(tmp_path, store_port):
    want = reference()
    port, ckpt = store_port, tmp_path / "run"
    # the second agent imports now and joins on the signal
    with _agent(port, ckpt, "--zero", "3") as first, _agent(port, ckpt, "--zero", "3", gated=True) as joined:
        _wait_for_step(ckpt, K, [first], timeout=240)
        if first.poll() is not None or joined.poll() is not None:
            pytest.fail("a launcher ended before the join:\n" + _killed(first, joined))
        # Hold the job still until the first agent has seen the new node: on a loaded machine its
        # remaining steps could otherwise end before the joining agent registers.
        workers = children(first.pid)
        _signal(workers, signal.SIGSTOP)
        joined.stdin.write("go\n")
        joined.stdin.flush()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not all(map(_told_to_stop, workers)):
            time.sleep(0.05)
        _signal(workers, signal.SIGCONT)
        outs = finish([first, joined], timeout=300)
    both = "\n----\n".join(o[-3000:] for o in outs)
    assert first.returncode == 0 and joined.returncode == 0, both
    meshes = _meshes(outs)
    assert meshes[0] == "{'pipeline': 1, 'data': 2, 'tensor': 1}", both
    assert meshes[-1] == "{'pipeline': 2, 'data': 2, 'tensor': 1}", both
    assert re.search(r"resumed from .* at step ([2-9])", "\n".join(outs))
    _check_losses(outs, want)


@pytest.mark.parametrize("rendezvous", ["c10d", "static"])
def test_two_node_launch_gives_the_in_process_losses(tmp_path, rendezvous):
    want = reference()
    port, ckpt = free_port(), tmp_path / "run"  # c10d: an agent hosts the store
    static = rendezvous == "static"
    with contextlib.ExitStack() as stack:
        procs = [
            stack.enter_context(
                _agent(port, ckpt, "--stop-after", "2", nnodes="2", static=(i if static else None))
            )
            for i in range(2)
        ]
        outs = finish(procs, timeout=300)
    assert all(p.returncode == 0 for p in procs), "\n----\n".join(o[-3000:] for o in outs)
    assert _meshes(outs) == ["{'pipeline': 2, 'data': 2, 'tensor': 1}"]
    _check_losses(outs, want, steps=2)
