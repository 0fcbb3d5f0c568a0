"""A per-device function that compiles a helper on its first call, in processes torchrun starts
fresh (Dynamo not loaded): ``tests/test_compile.py``.

Run::

    torchrun --nproc-per-node 2 tests/torchrun_programs/compiled_inside.py   # the real mesh
    python tests/torchrun_programs/compiled_inside.py                        # in-process, data=2

Each process prints ``RESULT <Dynamo loaded before the first call> <largest difference>``
(``compile_programs.run_compiled_inside``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: compile_programs

import compile_programs as C  # noqa: E402

import fpar  # noqa: E402

if __name__ == "__main__":
    if "WORLD_SIZE" in os.environ:
        fpar.init_distributed(backend="gloo", timeout=60.0)
    loaded_before, worst = C.run_compiled_inside()
    os.write(1, f"RESULT {loaded_before} {worst}\n".encode())  # one write: lines of ranks never interleave
