"""PartitionSpec: how each tensor dim is split over mesh axes.

``P(e0, e1, ...)`` has one entry per leading tensor dim: ``None`` (not split), an axis name, or a
tuple of axis names (split over all of them, major-to-minor in the order written).  Trailing
dims may be left out.  Mesh axes a spec does not name mean replication (inputs) or a promise of
replication (outputs), exactly as in ``jax.sharding.PartitionSpec``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

__all__ = ["P", "PartitionSpec"]

Entry = tuple[str, ...]  # normalised entry: () for None


class PartitionSpec:
    """A tuple of per-dim entries naming the mesh axes each dim is split over.

    Example:
      >>> P("data", None)          # dim 0 split over 'data', dim 1 whole
      P('data', None)
      >>> P(("data", "tensor"))    # dim 0 split over 8 = 2 x 4 blocks, 'data' major
      P(('data', 'tensor'),)
    """

    __slots__ = ("_entries",)

    def __init__(self, *entries: str | tuple[str, ...] | None):
        for e in entries:
            _check_entry(e)
        self._entries = tuple(tuple(e) if isinstance(e, list) else e for e in entries)

    def __iter__(self) -> Iterator[str | tuple[str, ...] | None]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, i):
        return self._entries[i]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PartitionSpec):
            return _canon(self._entries) == _canon(other._entries)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(_canon(self._entries))

    def __repr__(self) -> str:
        inner = ", ".join(repr(e) for e in self._entries)
        return f"P({inner}{',' if len(self._entries) == 1 and isinstance(self._entries[0], tuple) else ''})"

    # -- helpers used by the rest of fpar ------------------------------------------------------

    def normalized(self) -> tuple[Entry, ...]:
        """Entries as tuples of axis names (``None`` becomes ``()``)."""
        return tuple(_as_tuple(e) for e in self._entries)

    def axes(self) -> tuple[str, ...]:
        """Every axis name the spec mentions, in the order written."""
        return tuple(a for e in self.normalized() for a in e)


P = PartitionSpec


def _as_tuple(e) -> Entry:
    if e is None:
        return ()
    if isinstance(e, str):
        return (e,)
    return tuple(e)


def _canon(entries) -> tuple[Entry, ...]:
    out = [_as_tuple(e) for e in entries]
    while out and out[-1] == ():  # trailing None entries mean nothing
        out.pop()
    return tuple(out)


def _check_entry(e) -> None:
    if e is None or isinstance(e, str):
        return
    if isinstance(e, (tuple, list)) and all(isinstance(a, str) for a in e):
        return
    raise TypeError(
        f"PartitionSpec entry {e!r} must be None, a mesh axis name (str), or a tuple of axis "
        f"names, e.g. P('data', None) or P(('data', 'tensor'))."
    )


# Error checking and messages ---------------------------------------------------------------


def check_spec(
    spec: PartitionSpec,
    shape: tuple[int, ...] | None,
    mesh_shape: Mapping[str, int],
    *,
    where: str,
    blocks: bool = False,
) -> None:
    """Check ``spec`` against the mesh and (if given) the shape of the value it describes.

    Args:
      spec: the spec.
      shape: the value's shape, or ``None`` to check only against the mesh.
      mesh_shape: ordered mapping of axis name to size.
      where: the message prefix naming the API, function and pytree path.
      blocks: ``shape`` is one device's block (an output), so only the rank is checked.

    Raises:
      SpecError: unknown axis, an axis used twice, spec longer than the rank, or a dim that the
        product of its axis sizes does not divide.
    """
    from ._errors import SpecError

    seen: set[str] = set()
    for a in spec.axes():
        if a not in mesh_shape:
            raise SpecError(
                f"{where}: spec {spec} names {a!r}, which is not an axis of the mesh "
                f"(mesh axes: {tuple(mesh_shape)}). Use one of those names, or None for a dim "
                f"that is not split."
            )
        if a in seen:
            raise SpecError(
                f"{where}: spec {spec} uses mesh axis {a!r} more than once; a tensor can be split "
                f"over each mesh axis at most once. To split one dim over two axes write a tuple, "
                f"e.g. P(('data', 'tensor'))."
            )
        seen.add(a)
    if shape is None:
        return
    if len(spec) > len(shape):
        hint = " For a scalar (rank 0) use P()." if len(shape) == 0 else ""
        raise SpecError(
            f"{where}: spec {spec} has length {len(spec)}, which is longer than the rank of the "
            f"value ({len(shape)}, shape {tuple(shape)}). A spec has at most one entry per dim.{hint}"
        )
    if blocks:
        return
    for d, entry in enumerate(spec.normalized()):
        n = _blocks(entry, mesh_shape)
        if shape[d] % n:
            sizes = ", ".join(f"{a!r}: {mesh_shape[a]}" for a in entry)
            raise SpecError(
                f"{where}: dim {d} of size {shape[d]} is not evenly divisible by the mesh axes "
                f"{entry} of total size {n} ({sizes}), as spec {spec} requires. Pad dim {d} to a "
                f"multiple of {n}, or split it over fewer axes."
            )


def block_shape(spec: PartitionSpec, shape, mesh_shape: Mapping[str, int]) -> tuple[int, ...]:
    """Shape of one device's block of a value of global ``shape``."""
    out = list(shape)
    for d, entry in enumerate(spec.normalized()):
        out[d] //= _blocks(entry, mesh_shape)
    return tuple(out)


def global_shape(spec: PartitionSpec, block, mesh_shape: Mapping[str, int]) -> tuple[int, ...]:
    """Shape of the global value whose blocks have shape ``block``."""
    out = list(block)
    for d, entry in enumerate(spec.normalized()):
        out[d] *= _blocks(entry, mesh_shape)
    return tuple(out)


def _blocks(entry: Entry, mesh_shape: Mapping[str, int]) -> int:
    """How many blocks a dim split over the axes of ``entry`` has (1 for no axes).

    A plain loop rather than ``math.prod`` over a generator, which ``torch.compile`` (Dynamo)
    cannot trace.
    """
    n = 1
    for a in entry:
        n *= mesh_shape[a]
    return n
