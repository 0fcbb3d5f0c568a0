"""``fpar.shard_map``: ``fpar.shard`` under JAX's current name and keywords.

``jax.shard_map(f, *, mesh, in_specs, out_specs, check_vma=True)`` (JAX >= 0.7; ``check_vma``
was ``check_rep``).  Same engine, one code path: this only renames the keywords.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._mesh import Mesh
from ._shard import shard

__all__ = ["shard_map"]


def shard_map(
    f: Callable | None = None, *, mesh: Mesh, in_specs: Any, out_specs: Any, check_vma: bool = True
) -> Callable:
    """Map a per-device function over a mesh, spelled like ``jax.shard_map``.

    Exactly ``fpar.shard(f, mesh, in_specs, out_specs, check_rep=check_vma)``; see ``fpar.shard``.
    Without ``f`` it returns a decorator, as JAX's does.

    Args:
      f: the per-device function (positional arguments), or ``None`` for a decorator.
      mesh: the mesh, from ``fpar.make_mesh``.
      in_specs: a pytree prefix of the argument tuple of ``fpar.P`` (or ``None`` for static).
      out_specs: a pytree prefix of ``f``'s output of ``fpar.P``.
      check_vma: check statically that outputs whose spec leaves a mesh axis out do not vary
        over it (JAX's varying-manual-axes check; ``check_rep`` of ``fpar.shard``).

    Returns:
      The global function (or a decorator making one).

    Example:
      >>> @fpar.shard_map(mesh=mesh, in_specs=(P(None, "tensor"), P("data")), out_specs=P())
      ... def loss(w, x):
      ...     return fpar.pmean(fpar.psum((x @ w).sum(), "tensor"), "data")
    """
    if f is None:
        return lambda g: shard(g, mesh, in_specs, out_specs, check_rep=check_vma)
    return shard(f, mesh, in_specs, out_specs, check_rep=check_vma)
