"""Exception types.

Every fpar error is a ``TypeError`` or ``ValueError`` (or ``NameError``,
for an unbound axis, as in JAX) so that ordinary ``except`` clauses keep working.
"""

from __future__ import annotations

__all__ = ["ReplicationError", "SpecError", "UnboundAxisError", "replication_message"]


class SpecError(ValueError):
    """A PartitionSpec does not fit the mesh or the value it describes."""


class ReplicationError(ValueError):
    """An out_spec promises replication over a mesh axis the output varies over."""


class UnboundAxisError(NameError):
    """A collective names an axis that is not bound: outside ``fpar.shard`` or not in the mesh."""


def replication_message(where: str, spec, broken: list[str]) -> str:
    """The ``ReplicationError`` text: ``where`` varies over ``broken`` axes its out_spec ``spec`` leaves out."""
    axes = ", ".join(repr(a) for a in broken)
    first = broken[0]
    return (
        f"{where} varies over mesh axis {first!r}"
        + (f" (and {', '.join(repr(a) for a in broken[1:])})" if len(broken) > 1 else "")
        + f", but its out_spec {spec} leaves {axes} out, which promises the value is the same on "
        f"every device along {'them' if len(broken) > 1 else 'it'}. Reduce it first (e.g. "
        f"fpar.psum or fpar.pmean over {first!r}), name {first!r} in the out_spec to return every "
        f"device's block, or pass check_rep=False to return the block at coordinate 0 unchecked."
    )
