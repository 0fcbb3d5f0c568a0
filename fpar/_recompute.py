"""Where a backend's collective meets ``fpar.optim.remat``'s selective recomputation.

A remat body run under a policy (``fpar.optim.save_dots``) keeps the outputs of the ops the policy
names, and its recompute in the backward reuses them.  A kept matmul whose output only a sum over
the mesh reads (the row-parallel linear: ``psum(x @ w)``, or under sequence parallelism
``psum_scatter(x @ w)``) is better kept *reduced*: the sum's output is what the rest of the body
reads, it is ``t`` times smaller under sequence parallelism, and the recompute then runs neither
the matmul nor the sum's communication again (Megatron-LM's selective recomputation never
communicates twice).  The real mesh runs its collectives through ``collective`` below, so the
remat mode active in this thread (``fpar/optim/_remat.py``'s ``_Keep`` in the forward, ``_Reuse``
in the recompute) sees each as one unit: it may keep the unit's output, and serve it again; the
recompute's ``_Exchange`` Function then gives the served value its transpose, as for any sum.

The in-process mesh does not: there a collective's last vmap level computes it with plain ops
that the recompute's gradient differentiates, so a served value would have no gradient.  Its
recompute runs the sum again (the values and gradients are the same; only the memory and the
messages differ, and the in-process mesh's are a simulation).

This module imports nothing of fpar's: the backends and ``fpar.optim`` both import it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

_ACTIVE = threading.local()


def modes() -> list:
    """The remat modes active in this thread, innermost last."""
    if not hasattr(_ACTIVE, "stack"):
        _ACTIVE.stack = []
    return _ACTIVE.stack


def collective(kind: str, x: torch.Tensor, run: Callable[[], torch.Tensor]) -> torch.Tensor:
    """A backend's collective ``kind`` of ``x``, computed by ``run()`` unless a remat mode serves it."""
    stack = modes()
    if not stack:
        return run()
    mode: Any = stack[-1]
    return mode.collective(kind, x, run)
