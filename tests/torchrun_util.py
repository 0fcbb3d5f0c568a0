"""What the torchrun tests share: a free port, a launcher's process tree, and killing all of it.

torchrun starts every worker in a session of its own, so killing the launcher's process group
alone would leave the workers running: ``kill_tree`` kills each descendant's group too.

``run`` is a command run to its end within a timeout; ``started`` a command the test talks to
while it runs (kills a rank, waits for a checkpoint), ``wait`` its bounded end; ``finish`` waits
for several. Each starts the
command in a session of its own, and whatever way the test leaves (a timeout, a failed assertion,
an interrupt), nothing it started is left running.

A command started with ``stack_env`` (``torchrun`` does) has every Python process of its tree
write its threads' stacks on SIGUSR2 (``stackdump/sitecustomize.py``). Before a timed-out command
is killed, ``dump_stacks`` asks its whole tree for them, so the failure shows where each process
waited, not only that it did (an elastic test's launcher that once did not end, 2026-12-01).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest


def free_port() -> int:
    """A port no socket holds now, from below the kernel's ephemeral range.

    The port is handed to a launcher that binds it seconds later (torchrun imports torch first).
    A port from the ephemeral range (what binding port 0 gives) can meanwhile become the local
    port of any outgoing connection on the machine, and the gloo processes of the tests running
    beside it make thousands: torchrun then fails to host its store there, takes the holder for
    another agent's store and times out connecting to it (a CI flake, 2026-11-30). Outside the
    range only another explicit bind can take it.
    """
    low, _ = _ephemeral_range()
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(200):
        port = rng.randrange(10_000, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # every try held: the kernel's choice, as before
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default
    return (low, high) if low > 10_100 else (32768, 60999)


STACKS = str(Path(__file__).parent / "stackdump")  # its sitecustomize: stacks on SIGUSR2
TAIL = 12_000  # characters of a timed-out command's output a failure shows (its stacks included)


def stack_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` with ``STACKS`` first on PYTHONPATH: its processes dump their stacks on SIGUSR2."""
    path = env.get("PYTHONPATH")
    return {**env, "PYTHONPATH": STACKS + (os.pathsep + path if path else "")}


def dump_stacks(pid: int, settle: float = 2.0) -> None:
    """Ask ``pid`` and every process below it for their Python stacks (SIGUSR2), and give them time.

    Only for a tree about to be killed: a process started without ``stack_env`` ends on it.
    """
    for p in [*descendants(pid), pid]:
        try:
            os.kill(p, signal.SIGUSR2)
        except ProcessLookupError:
            pass
    time.sleep(settle)


def children(pid: int) -> list[int]:
    """``pid``'s direct children (from /proc)."""
    return [c for c, p in _parents().items() if p == pid]


def descendants(pid: int) -> list[int]:
    parent = _parents()
    found, frontier = [], [pid]
    while frontier:
        kids = [c for c, pp in parent.items() if pp in frontier]
        found += kids
        frontier = kids
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL the launcher ``pid`` and every process below it, with their process groups."""
    for p in [*descendants(pid), pid]:
        try:
            os.killpg(p, signal.SIGKILL)  # p leads its group (the launcher, a worker)
        except (ProcessLookupError, PermissionError):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


def stop(*procs: subprocess.Popen) -> None:
    """Kill the tree of each of ``procs`` that is still running, and reap it (its output is dropped)."""
    for p in procs:
        if p.poll() is None:
            kill_tree(p.pid)
            p.communicate()


@contextlib.contextmanager
def started(cmd: Sequence[str], *, merge: bool = False, **popen: Any) -> Iterator[subprocess.Popen]:
    """``cmd`` started in a session of its own, text output piped (stderr into stdout if ``merge``).

    Leaving the block stops whatever of its tree still runs (``stop``).
    """
    popen.setdefault("stdout", subprocess.PIPE)
    popen.setdefault("stderr", subprocess.STDOUT if merge else subprocess.PIPE)
    proc = subprocess.Popen(list(cmd), text=True, start_new_session=True, **popen)
    try:
        yield proc
    finally:
        stop(proc)


def wait(proc: subprocess.Popen, timeout: float) -> tuple[str, str | None]:
    """``proc``'s (stdout, stderr) once it ends; past ``timeout`` seconds kill its tree and fail the test.

    The failure names the command and shows the tail of its output.
    """
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        dump_stacks(proc.pid)
        kill_tree(proc.pid)
        out, err = proc.communicate()
        pytest.fail(
            f"did not finish in {timeout:g} s: {' '.join(map(str, proc.args))}\n--- stdout (end) ---\n"
            f"{out[-TAIL:]}" + (f"\n--- stderr (end) ---\n{err[-TAIL:]}" if err else "")
        )


def run(
    cmd: Sequence[str], *, timeout: float, merge: bool = False, **popen: Any
) -> subprocess.CompletedProcess:
    """Run ``cmd`` (``started``) to its end within ``timeout`` seconds (``wait``).

    ``merge`` puts stderr into the result's ``stdout`` (its ``stderr`` is then ``None``).
    """
    with started(cmd, merge=merge, **popen) as proc:
        out, err = wait(proc, timeout)
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)


def finish(procs: Sequence[subprocess.Popen], timeout: float) -> list[str]:
    """Wait for every one of ``procs`` (their stdout merged), ``timeout`` seconds for all; their outputs.

    Past the timeout the test fails with every launcher's output, the stacks of each process still
    running in it (``dump_stacks``); every process still running is stopped either way.
    """
    outs: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            try:
                out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                rest = procs[len(outs) :]  # this one and those not waited for yet: all their stacks
                for q in rest:
                    if q.poll() is None:
                        dump_stacks(q.pid, settle=0)
                time.sleep(2)
                for q in rest:
                    if q.poll() is None:
                        kill_tree(q.pid)
                    outs.append(q.communicate()[0])
                pytest.fail(
                    f"a launcher did not finish in {timeout:g}s:\n" + "\n----\n".join(o[-TAIL:] for o in outs)
                )
            outs.append(out)
    finally:
        stop(*procs)
    return outs


def _parents() -> dict[int, int]:
    parent = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:  # gone meanwhile
            continue
        parent[int(stat.parent.name)] = int(fields[1])
    return parent


_DIST_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def torchrun(nproc: int, argv: Sequence[str], *, timeout: float, cwd: Path) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node nproc argv...`` to its end (``run``), as a user's shell runs it.

    No distributed variable of this process leaks in; ``OMP_NUM_THREADS=1``, unbuffered output.
    Run once more on a fresh port when another job took the free one before the launcher bound it.
    """
    env = stack_env({k: v for k, v in os.environ.items() if k not in _DIST_VARS})
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for _ in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
        cmd += ["--master-port", str(free_port()), *map(str, argv)]
        res = run(cmd, timeout=timeout, cwd=cwd, env=env)
        if res.returncode == 0 or "address already in use" not in res.stderr.lower():
            break
    return res
