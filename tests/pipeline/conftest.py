"""Pipeline tests: sibling-module imports (``pipe_models``, ``dist_workers``) and one torch thread.

The pipeline tests run many tiny ops (microbatches of a few rows); on a shared 2-core machine,
torch's intra-op threads cost far more than they give there (measured: a step 10x slower with
2 threads under load), so each test here runs with one thread and restores the setting after.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
