"""Exception types.

Every fpar error is a ``TypeError`` or ``ValueError`` (or ``NameError``,
for an unbound axis, as in JAX) so that ordinary ``except`` clauses keep working.
"""

from __future__ import annotations

__all__ = [
    "ReplicationError",
    "SpecError",
    "UnboundAxisError",
    "check_in_leaf",
    "check_out_leaf",
    "remat_reads_message",
    "replication_message",
]


class SpecError(ValueError):
    """A PartitionSpec does not fit the mesh or the value it describes."""


class ReplicationError(ValueError):
    """An out_spec promises replication over a mesh axis the output varies over."""


class UnboundAxisError(NameError):
    """A collective names an axis that is not bound: outside ``fpar.shard`` or not in the mesh."""


def check_in_leaf(where: str, leaf, spec) -> None:
    """An argument with an in_spec (not ``None``) must be a tensor: both backends' first check."""
    if not _is_tensor(leaf):
        raise TypeError(
            f"{where} is a {type(leaf).__name__}, not a tensor, but its in_spec is {spec}. "
            f"Pass a tensor, or give it the in_spec None to pass it through untouched."
        )


def check_out_leaf(where: str, leaf, spec) -> bool:
    """An output agrees with its out_spec's kind; returns whether it is a static (``None``-spec) one."""
    if spec is None:
        if _is_tensor(leaf):
            raise TypeError(
                f"{where} is a tensor but its out_spec is None; give it a fpar.P out_spec "
                f"(None is for non-tensor outputs, which are returned as they are)."
            )
        return True
    if not _is_tensor(leaf):
        raise TypeError(
            f"{where} is a {type(leaf).__name__}, not a tensor, but its out_spec is {spec}; "
            f"return a tensor, or give it the out_spec None."
        )
    return False


def _is_tensor(x) -> bool:
    import torch  # the error vocabulary itself needs no torch at import

    return isinstance(x, torch.Tensor)


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


def remat_reads_message(name: str, what: str) -> str:
    """The error for a value read inside ``fpar.optim.remat``'s function in a sharded call (both meshes)."""
    return (
        f"fpar.optim.remat({name}) inside fpar.shard: {name} reads a tensor's value ({what}), e.g. "
        f"Python control flow on a tensor or .item(). A recomputed function must follow its data flow "
        f"alone, as jax.checkpoint's: the in-process mesh runs it under vmap over devices, which has "
        f"no per-device value to read, so both meshes refuse it. Compute both branches and select with "
        f"torch.where, or move the read out of the sharded function."
    )
