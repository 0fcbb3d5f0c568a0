"""tests/torchrun_util.py: a command that overruns is killed with every process it started, and named.

The command stands in for torchrun: it starts a child in a session of its own (as torchrun starts
each worker), prints that child's pid and sleeps. No torch is imported, so this takes a second.
Started with ``stack_env``, an overrunning tree's failure shows where each of its processes was.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from torchrun_util import finish, run, stack_env, started

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the tree in /proc")

# the child does not hold the launcher's pipes, so the launcher's output ends when the launcher does
LAUNCHER = (
    "import subprocess as s, sys, time; "
    "c = s.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True, "
    "stdout=s.DEVNULL, stderr=s.DEVNULL); "
    "print(c.pid, flush=True); print('to stderr', file=sys.stderr, flush=True); time.sleep(120)"
)


def _gone(pid: int, within: float = 10.0) -> bool:
    """``pid`` has exited (or is a zombie waiting for its parent) within ``within`` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rpartition(")")[2].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_run_kills_the_whole_tree_on_timeout_and_names_the_command():
    with pytest.raises(pytest.fail.Exception) as info:
        run([sys.executable, "-c", LAUNCHER], timeout=3)
    msg = str(info.value)
    assert msg.startswith("did not finish in 3 s: ") and "time.sleep(120)" in msg, msg
    assert "--- stderr (end) ---\nto stderr" in msg, msg
    child = int(msg.split("--- stdout (end) ---\n")[1].split()[0])
    if not _gone(child):
        os.kill(child, signal.SIGKILL)
        pytest.fail(f"the launcher's child {child} (its own session) survived the timeout")


def test_started_stops_the_tree_when_the_block_raises():
    with (
        pytest.raises(RuntimeError, match="the test failed"),
        started([sys.executable, "-c", LAUNCHER]) as proc,
    ):
        child = int(proc.stdout.readline())
        raise RuntimeError("the test failed")
    if not _gone(child):
        os.kill(child, signal.SIGKILL)
        pytest.fail(f"the launcher's child {child} (its own session) survived leaving the block")
    assert proc.poll() is not None


def test_run_returns_the_result_of_a_command_that_ends():
    res = run([sys.executable, "-c", "import sys; print('out'); sys.exit(3)"], timeout=60, merge=True)
    assert (res.returncode, res.stdout, res.stderr) == (3, "out\n", None)
    assert isinstance(res, subprocess.CompletedProcess) and os.path.basename(res.args[0]).startswith("python")


# as LAUNCHER, but each process waits in a function of its own name, and the child writes to the
# launcher's stderr (as torchrun's workers do)
WAITING = (
    "import subprocess as s, sys, time\n"
    "CHILD = 'import time\\ndef worker_waits_here(): time.sleep(120)\\nworker_waits_here()'\n"
    "c = s.Popen([sys.executable, '-c', CHILD], start_new_session=True, stdout=s.DEVNULL)\n"
    "print(c.pid, flush=True)\n"
    "def launcher_waits_here(): time.sleep(120)\n"
    "launcher_waits_here()\n"
)


def test_an_overrunning_tree_shows_every_process_stack():
    env = stack_env(dict(os.environ))
    with started([sys.executable, "-c", WAITING], merge=True, env=env) as proc:
        child = int(proc.stdout.readline())
        time.sleep(1.0)  # the child is in its function (its interpreter up in ~0.05 s)
        with pytest.raises(pytest.fail.Exception) as info:
            finish([proc], timeout=1)
    msg = str(info.value)
    assert msg.startswith("a launcher did not finish in 1s:"), msg
    assert "launcher_waits_here" in msg and "worker_waits_here" in msg, msg
    assert msg.count("Current thread") + msg.count("Thread 0x") >= 2, msg
    if not _gone(child):
        os.kill(child, signal.SIGKILL)
        pytest.fail(f"the launcher's child {child} (its own session) survived the timeout")
