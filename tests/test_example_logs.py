"""The examples' logs stay readable (issue 33): a progress bar only on a terminal (or in a notebook);
written to a file or a pipe, one plain line per logging interval and no carriage returns."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))

import _common  # noqa: E402

pytest.importorskip("tqdm")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _drive(bar: _common.Bar) -> None:
    for step in range(6):
        bar.update(step, f"loss {1.0 / (step + 1):.3f}")
        if (step + 1) % 3 == 0:
            bar.write(f"step {step + 1}/6 | loss {1.0 / (step + 1):.4f}")
    bar.close()


def test_to_a_file_or_pipe_one_plain_line_per_interval(monkeypatch):
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    assert not _common.interactive()
    bar = _common.Bar(6, 0, enabled=True)
    assert bar.bar is None
    _drive(bar)
    assert out.getvalue() == "step 3/6 | loss 0.3333\nstep 6/6 | loss 0.1667\n"
    assert err.getvalue() == ""


def test_on_a_terminal_a_progress_bar(monkeypatch):
    out, err = _Terminal(), _Terminal()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.delitem(sys.modules, "ipykernel", raising=False)
    assert _common.interactive()
    bar = _common.Bar(6, 0, enabled=True)
    assert bar.bar is not None
    _drive(bar)
    assert "\r" in err.getvalue() and "6/6" in err.getvalue()  # the bar, redrawn in place
    assert "step 3/6 | loss 0.3333" in out.getvalue()  # the logged lines still print


def test_a_piped_example_run_has_no_carriage_returns(tmp_path):
    # The flagship's smallest run, its output to a pipe as in `python train_gpt.py | tee log`.
    argv = [
        "--tiny",
        "--steps",
        "4",
        "--warmup",
        "1",
        "--threads",
        "0",
        "--log-every",
        "2",
        "--plot",
        "none",
        "--sample",  # no generated text: its bytes could hold a carriage return of their own
        "0",
        "--ckpt-dir",
        str(tmp_path / "ckpt"),
    ]
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "train_gpt.py"), *argv],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "\r" not in proc.stdout and "\r" not in proc.stderr, (proc.stdout, proc.stderr)
    logged = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert logged == ["1/4", "2/4", "4/4"], proc.stdout  # the first step, then one line per interval
