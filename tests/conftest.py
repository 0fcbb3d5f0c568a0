"""Test configuration: hypothesis profiles, warnings as errors, sibling-module imports.

Profiles: ``ci`` is deterministic (derandomized, no example database, no deadline); ``dev`` keeps
hypothesis' randomness and database for exploring. ``ci`` is loaded when ``CI`` is set or
``HYPOTHESIS_PROFILE=ci``; otherwise ``HYPOTHESIS_PROFILE`` names the profile (default ``dev``).
"""

from __future__ import annotations

import os
import sys
import warnings

import torch
from hypothesis import HealthCheck, settings

# Let test modules `import reference, strategies, harness` whatever pytest's import mode is.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=50,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "dev",
    deadline=None,
    max_examples=30,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

if os.environ.get("CI") or os.environ.get("HYPOTHESIS_PROFILE") == "ci":
    settings.load_profile("ci")
else:
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

# Under pytest-xdist (scripts/dev.sh: two workers, one per core of the CI machine) each worker runs
# torch on one thread. Two workers of two threads each on two cores made torch's thread pool wait on
# a busy core for every op: the tiny models of many small ops ran up to 10x slower beside the other
# worker than alone (a linear-attention family: 7 s alone, 74 s in CI).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

# The first forward-mode AD call in a process makes torch load its jvp decompositions with
# torch.jit.script, which emits a DeprecationWarning from torch itself. Trigger it once here, quietly,
# so that "warnings are errors" only catches warnings caused by the code under test.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    torch.func.jvp(torch.sin, (torch.zeros(1),), (torch.ones(1),))


def pytest_configure(config):
    # Warnings are errors in tests (STYLE.md). If pyproject already lists filters, it owns them
    # (its own "error" plus deliberate ignores); appending "error" here would override the ignores.
    if not config.getini("filterwarnings"):
        config.addinivalue_line("filterwarnings", "error")
