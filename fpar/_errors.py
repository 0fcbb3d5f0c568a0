"""Exception types.

Every fpar error is a ``TypeError`` or ``ValueError`` (or ``NameError``,
for an unbound axis, as in JAX) so that ordinary ``except`` clauses keep working.
"""

from __future__ import annotations

__all__ = ["ReplicationError", "SpecError", "UnboundAxisError"]


class SpecError(ValueError):
    """A PartitionSpec does not fit the mesh or the value it describes."""


class ReplicationError(ValueError):
    """An out_spec promises replication over a mesh axis the output varies over."""


class UnboundAxisError(NameError):
    """A collective names an axis that is not bound: outside ``fpar.shard`` or not in the mesh."""
