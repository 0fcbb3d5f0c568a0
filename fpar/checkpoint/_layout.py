"""Where blocks live: regions of a global tensor, who writes them, and what a reader copies.

Pure functions of shapes, specs and mesh coordinates (no files, no processes), so the planning
that DCP does with ``SavePlan``/``LoadPlan`` can be tested on its own.  Processes are numbered
row-major over the mesh (fpar's rank -> coordinates rule); on the in-process mesh there is one
process, holding every global tensor whole.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence

from .._spec import PartitionSpec

__all__ = ["Block", "Read", "all_coords", "blocks", "plan", "region", "writes"]


@dataclasses.dataclass(frozen=True)
class Block:
    """One stored block of a global tensor: the process that wrote it and where it sits."""

    process: int
    offsets: tuple[int, ...]
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Read:
    """Copy ``block``'s ``src`` slices into the reader's block at ``dst``."""

    block: int
    src: tuple[slice, ...]
    dst: tuple[slice, ...]
    numel: int


def all_coords(mesh_shape: Mapping[str, int]) -> list[dict[str, int]]:
    """The coordinates of every process, in rank order (row-major over the mesh)."""
    names = list(mesh_shape)
    return [dict(zip(names, c)) for c in itertools.product(*(range(mesh_shape[a]) for a in names))]


def region(
    shape: Sequence[int], spec: PartitionSpec, mesh_shape: Mapping[str, int], coords: Mapping[str, int] | None
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Offsets and sizes of the block at ``coords`` (``None``: the whole tensor, in-process)."""
    start, size = [0] * len(shape), list(shape)
    if coords is None:
        return tuple(start), tuple(size)
    for d, entry in enumerate(spec.normalized()):
        index, n = 0, 1
        for a in entry:  # major-to-minor in the order written
            index = index * mesh_shape[a] + coords[a]
            n *= mesh_shape[a]
        size[d] = shape[d] // n
        start[d] = index * size[d]
    return tuple(start), tuple(size)


def writes(spec: PartitionSpec, coords: Mapping[str, int] | None) -> bool:
    """Whether the process at ``coords`` writes its block: replica 0 along every unnamed axis."""
    if coords is None:
        return True
    named = set(spec.axes())
    return all(c == 0 for a, c in coords.items() if a not in named)


def blocks(
    shape: Sequence[int], spec: PartitionSpec, mesh_shape: Mapping[str, int], distributed: bool
) -> list[Block]:
    """Every stored block of a tensor, each written once (replicas deduplicated, like Megatron's replica_id)."""
    if not distributed:
        return [Block(0, (0,) * len(shape), tuple(shape))]
    out = []
    for p, coords in enumerate(all_coords(mesh_shape)):
        if writes(spec, coords):
            out.append(Block(p, *region(shape, spec, mesh_shape, coords)))
    return out


def plan(start: Sequence[int], size: Sequence[int], stored: Sequence[Block]) -> list[Read]:
    """The reads that assemble the block ``(start, size)`` from ``stored`` blocks: only overlaps."""
    reads = []
    for i, b in enumerate(stored):
        lo = [max(s, o) for s, o in zip(start, b.offsets)]
        hi = [min(s + n, o + m) for s, n, o, m in zip(start, size, b.offsets, b.shape)]
        if any(h <= a for a, h in zip(lo, hi)):
            continue
        src = tuple(slice(a - o, h - o) for a, h, o in zip(lo, hi, b.offsets))
        dst = tuple(slice(a - s, h - s) for a, h, s in zip(lo, hi, start))
        reads.append(Read(i, src, dst, math.prod(h - a for a, h in zip(lo, hi))))
    return reads
