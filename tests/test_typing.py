"""fpar's annotations are checked: mypy reports a wrong argument type at a public function.

Runs mypy (the version pinned in pyproject's ``lint`` extra, which CI installs) on
``tests/typing/public_calls.py`` and compares its errors with the lines marked there. Skipped
where mypy is not installed. ``.ci/run`` checks ``fpar/`` itself before the tests.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import fpar

ROOT = Path(__file__).resolve().parent.parent
CALLS = ROOT / "tests" / "typing" / "public_calls.py"


def _expected() -> set[tuple[int, str]]:
    marked = re.compile(r"#\s*error:\s*([a-z-]+)\s*$")
    return {
        (n, m[1]) for n, line in enumerate(CALLS.read_text().splitlines(), 1) if (m := marked.search(line))
    }


def test_mypy_reports_a_wrong_argument_type_at_a_public_function():
    pytest.importorskip("mypy", reason="mypy is in the lint extra (scripts/dev.sh setup installs it)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-error-summary", "--show-error-codes", str(CALLS)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,  # a cold cache analyses torch's stubs; .ci/run's mypy step leaves it warm
    )
    errors = re.findall(r"^[^:\n]*public_calls\.py:(\d+): error: .*\[([a-z-]+)\]$", run.stdout, re.M)
    got = {(int(n), code) for n, code in errors}
    assert got == _expected(), run.stdout + run.stderr
    assert run.returncode == 1, run.stdout + run.stderr


def test_version_agrees_with_pyproject_and_changelog():
    pyproject = (ROOT / "pyproject.toml").read_text()  # no tomllib on Python 3.10
    assert re.search(r'^version = "([^"]+)"$', pyproject, re.M)[1] == fpar.__version__
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert f"## [{fpar.__version__}]" in changelog, "CHANGELOG.md has no section for this version"


def test_py_typed_is_shipped():
    assert (ROOT / "fpar" / "py.typed").is_file()
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^\[tool\.setuptools\.package-data\]\nfpar = \[.*"py\.typed"', pyproject, re.M)
