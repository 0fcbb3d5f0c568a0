"""A real-mesh program under torchrun exits 0: no abort at interpreter exit.

Regression: a data x tensor program that computed the right values still failed under
``torchrun --nproc-per-node 4`` in about one run of four, with "terminate called without an
active exception" (SIGABRT at exit).  A planned call's first message is an async all-reduce
whose verdict waits for its first use; a script that exits without reading the last value
(rank 0 prints, the others do not) left it in flight, and fpar's meshes kept their process
groups alive into interpreter finalization.  The gloo worker that finished the message then
held the last reference to its buffer and needed the GIL to free it while the interpreter was
finalizing, which ends the thread inside a ``noexcept`` destructor: ``std::terminate``.
``fpar/_dist/groups.py`` ``close`` (an exit handler) now waits for every message fpar sent and
tears the process groups down while the interpreter is whole.

The program (``tests/torchrun_programs/exit_dxt.py``) checks its own values against the
unsharded function on rank 0 and prints ``OK``.  ``--slow-exit`` makes the abort all but certain
where the bug is: rank 0 comes late to the last call, and the other ranks end their exit with a
second of busy Python that never lets a waiting thread have the GIL (so their message completes
just before finalization, as it did by chance in the reported runs).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from torchrun_util import torchrun

pytestmark = pytest.mark.multiprocess

PROGRAM = Path(__file__).resolve().parent / "torchrun_programs" / "exit_dxt.py"
TIMEOUT_S = 150  # one torchrun run (about 10-15 s on an idle 2-core machine)


def _torchrun(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return torchrun(4, [PROGRAM, *args], timeout=TIMEOUT_S, cwd=cwd)


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(["--slow-exit", "1"], id="destroy"),
        pytest.param(["--no-destroy", "--backward", "--slow-exit", "1"], id="no-destroy-backward"),
    ],
)
def test_program_exits_zero(args: list[str], tmp_path: Path):
    """Right values, and exit code 0 on every rank, with and without ``destroy_process_group()``."""
    res = _torchrun(args, tmp_path)
    said = f"--- stdout ---\n{res.stdout[-3000:]}\n--- stderr ---\n{res.stderr[-5000:]}"
    assert "terminate called" not in res.stderr, f"a rank aborted at exit\n{said}"
    assert "FAIL" not in res.stdout, said
    assert res.stdout.count("OK eval loss") == 1, said  # rank 0 checked every value against the unsharded run
    assert res.returncode == 0, said


_ENDING = """
import atexit, sys
from fpar._dist import pending
atexit.register(lambda: print("ending on error:", pending.ending_on_error(), flush=True))
exec(sys.argv[1])
"""


@pytest.mark.parametrize(
    ("how", "flags", "want"),
    [
        pytest.param("raise RuntimeError('x')", [], True, id="uncaught"),
        pytest.param("pass", [], False, id="normal"),
        pytest.param("sys.exit(3)", [], False, id="sys-exit"),
        pytest.param("pass", ["-i"], False, id="interactive-after-an-error"),
    ],
)
def test_the_exit_handlers_know_an_uncaught_exception_ends_the_process(how, flags, want):
    # What decides whether fpar's exit handler may wait for peers (groups.close): only an
    # uncaught exception ending a script counts; an interactive session shows errors and goes on
    stdin = "raise ValueError('at the prompt')\n" if flags else None
    res = subprocess.run(
        [sys.executable, *flags, "-c", _ENDING, how],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert f"ending on error: {want}" in res.stdout, res.stdout + res.stderr
