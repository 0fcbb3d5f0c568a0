"""fpar's own ``autograd.Function``s.

The mode that runs during a sharded function (``_mode.py``) treats every op's tensor operands
as data that may need an implicit pvary.  fpar's own Functions also take a token tensor that is
batched at every mesh level only so that vmap calls their rules; they are registered here so
the mode passes them through.
"""

from __future__ import annotations

__all__ = ["INTERNAL", "internal"]

INTERNAL: set[type] = set()


def internal(cls: type) -> type:
    """Register an fpar autograd.Function (a class decorator)."""
    INTERNAL.add(cls)
    return cls
