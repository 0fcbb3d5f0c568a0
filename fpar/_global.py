"""Moving between global values and the blocks a process holds.

In-process, a "local" value *is* the global tensor (the mesh's devices all live in this
process), so ``device_put`` and ``gather`` only validate.  On a real mesh a process holds its
own block of each value (the block its spec names), and these functions slice and gather.
The same script therefore runs in both places: put inputs with ``device_put``, call the
sharded function, bring results home with ``gather``.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import torch

from ._mesh import Mesh
from ._spec import PartitionSpec, check_spec
from ._tree import broadcast_prefix, keystr, tree_flatten_with_path, tree_unflatten

__all__ = [
    "Init",
    "device_put",
    "from_dtensor",
    "full",
    "gather",
    "init",
    "normal",
    "ones",
    "to_dtensor",
    "uniform",
    "zeros",
]

Tensor = torch.Tensor


# API ----------------------------------------------------------------------------------------


def device_put(x: Any, mesh: Mesh, spec: Any) -> Any:
    """Return this process's block of each global tensor in ``x``.

    Args:
      x: a pytree of global tensors (every process passes the same values).
      mesh: the mesh.
      spec: a pytree prefix of ``x`` of ``fpar.P``.

    Returns:
      The blocks (on the in-process mesh: ``x`` itself, after checking the specs).
    """
    return _map(
        "device_put", x, mesh, spec, lambda t, s: t if mesh.backend == "local" else _dist().block(t, s, mesh)
    )


def gather(x: Any, mesh: Mesh, spec: Any) -> Any:
    """Return the full global tensors, on every process, from each process's blocks.

    Differentiable (its transpose keeps each process's block of the cotangent).  The result is a
    new tensor on both meshes, never the block itself (a replicated block is copied), so it is
    the user's to keep: a later in-place update of the blocks (``zero_step(..., donate=True)``)
    does not change it.

    Args:
      x: a pytree of blocks, as ``fpar.shard`` returns them on a real mesh.
      mesh: the mesh.
      spec: a pytree prefix of ``x`` of ``fpar.P`` (the out_specs they were returned with).
    """
    if mesh.backend == "local":
        return _map("gather", x, mesh, spec, lambda t, s: t.clone())
    return _map("gather", x, mesh, spec, lambda t, s: _dist().gather(t, s, mesh), blocks=True)


def to_dtensor(x: Tensor, mesh: Mesh, spec: PartitionSpec):
    """Wrap this process's block ``x`` as a ``DTensor`` (real mesh only), for interop and DCP."""
    _need_dist("to_dtensor", mesh)
    return _dist().to_dtensor(x, spec, mesh)


def from_dtensor(dt, mesh: Mesh, spec: PartitionSpec) -> Tensor:
    """This process's block of a ``DTensor``, laid out as ``spec`` (redistributing if needed)."""
    _need_dist("from_dtensor", mesh)
    return _dist().from_dtensor(dt, spec, mesh)


# A sharded initialiser ------------------------------------------------------------------------

_TILE = 128  # elements per tile along each dim; tiles are what the random streams are keyed on


@dataclasses.dataclass(frozen=True)
class Init:
    """How to fill one parameter: its global shape, dtype and distribution."""

    shape: tuple[int, ...]
    kind: str
    params: tuple = ()
    dtype: torch.dtype = torch.float32


def normal(shape, *, std: float = 1.0, mean: float = 0.0, dtype: torch.dtype = torch.float32) -> Init:
    """A parameter drawn from N(mean, std^2)."""
    return Init(tuple(shape), "normal", (mean, std), dtype)


def uniform(shape, *, low: float = 0.0, high: float = 1.0, dtype: torch.dtype = torch.float32) -> Init:
    """A parameter drawn uniformly from [low, high)."""
    return Init(tuple(shape), "uniform", (low, high), dtype)


def zeros(shape, *, dtype: torch.dtype = torch.float32) -> Init:
    """A parameter of zeros."""
    return Init(tuple(shape), "full", (0.0,), dtype)


def ones(shape, *, dtype: torch.dtype = torch.float32) -> Init:
    """A parameter of ones."""
    return Init(tuple(shape), "full", (1.0,), dtype)


def full(shape, value: float, *, dtype: torch.dtype = torch.float32) -> Init:
    """A parameter filled with ``value``."""
    return Init(tuple(shape), "full", (float(value),), dtype)


def init(inits: Any, mesh: Mesh, specs: Any, *, seed: int = 0) -> Any:
    """Build each process's block of a parameter tree, never the full tree.

    The global values depend only on ``seed``, each leaf's pytree path and its ``Init``, not on
    the mesh or the specs: the tensor is cut into fixed tiles, each drawn from its own random
    stream, and a process draws only the tiles its block overlaps.  So the same seed gives the
    same model on one process, on 8, and under any layout.

    Args:
      inits: a pytree whose leaves are ``fpar.normal(...)``, ``fpar.zeros(...)`` and the like.
      mesh: the mesh.
      specs: a pytree prefix of ``inits`` of ``fpar.P``.
      seed: the seed.

    Returns:
      The tree of tensors: global ones in-process, this process's blocks on a real mesh.

    Example:
      >>> params = fpar.init({"w": fpar.normal((64, 256), std=0.02)}, mesh, {"w": P(None, "tensor")})
    """
    paths, leaves, treedef = tree_flatten_with_path(inits)
    leaf_specs = _prefix("init", specs, inits)
    # A real mesh on NCCL: the blocks live on this rank's GPU (drawn on the CPU, the same
    # stream on every backend, then moved once).
    device = torch.device("cpu")
    if mesh.backend == "dist" and not mesh.abstract:
        device = _dist()._device([])
    out = []
    for path, leaf, spec in zip(paths, leaves, leaf_specs):
        where = f"fpar.init: inits{keystr(path)}"
        if not isinstance(leaf, Init):
            raise TypeError(f"{where} is {leaf!r}; leaves must be fpar.normal/uniform/zeros/ones/full(...).")
        check_spec(spec, leaf.shape, mesh.shape, where=where)
        start, size = _block_region(leaf.shape, spec, mesh)
        if mesh.abstract:  # a mesh on paper (fpar.plan): the block's shape, no values, no memory
            out.append(torch.empty(size, dtype=leaf.dtype, device="meta"))
            continue
        out.append(_fill(leaf, start, size, _stream_key(seed, keystr(path))).to(device))
    return tree_unflatten(treedef, out)


def _block_region(shape, spec: PartitionSpec, mesh: Mesh) -> tuple[list[int], list[int]]:
    """Start and size of this process's block along each dim (the whole tensor in-process)."""
    if mesh.backend == "local":
        return [0] * len(shape), list(shape)
    coords = mesh._dist.coords
    start, size = [0] * len(shape), list(shape)
    for d, entry in enumerate(spec.normalized()):
        index, n = 0, 1
        for a in entry:
            index = index * mesh.shape[a] + coords[a]
            n *= mesh.shape[a]
        size[d] = shape[d] // n
        start[d] = index * size[d]
    return start, size


def _stream_key(seed: int, path: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}/{path}".encode(), digest_size=7).digest(), "little")


def _fill(leaf: Init, start: list[int], size: list[int], key: int) -> Tensor:
    out = torch.empty(size, dtype=leaf.dtype)
    if leaf.kind == "full":
        return out.fill_(leaf.params[0])
    tiles = [range(s // _TILE, -(-(s + n) // _TILE)) for s, n in zip(start, size)]
    for tile in _product(tiles):
        lo = [t * _TILE for t in tile]
        hi = [min(lo_d + _TILE, full_d) for lo_d, full_d in zip(lo, leaf.shape)]
        g = torch.Generator().manual_seed((key + _ravel(tile, leaf.shape)) % (2**63))
        values = _draw(leaf, [h - lo_d for h, lo_d in zip(hi, lo)], g)
        src = tuple(slice(max(s, a) - a, min(s + n, b) - a) for s, n, a, b in zip(start, size, lo, hi))
        dst = tuple(slice(max(s, a) - s, min(s + n, b) - s) for s, n, a, b in zip(start, size, lo, hi))
        out[dst] = values[src]
    return out


def _draw(leaf: Init, shape: list[int], g: torch.Generator) -> Tensor:
    if leaf.kind == "normal":
        mean, std = leaf.params
        return torch.randn(shape, generator=g, dtype=leaf.dtype) * std + mean
    low, high = leaf.params
    return torch.rand(shape, generator=g, dtype=leaf.dtype) * (high - low) + low


def _ravel(tile, shape) -> int:
    """A tile's index, counted over the tile grid of ``shape`` (row-major)."""
    r = 0
    for t, n in zip(tile, shape):
        r = r * -(-n // _TILE) + t
    return r


def _product(ranges):
    if not ranges:
        yield ()
        return
    for first in ranges[0]:
        for rest in _product(ranges[1:]):
            yield (first, *rest)


# Error checking and messages ---------------------------------------------------------------


def _dist():
    from . import _dist

    return _dist


def _need_dist(api: str, mesh: Mesh) -> None:
    if mesh.backend != "dist":
        raise ValueError(
            f"fpar.{api}: DTensors live on process groups; {mesh} is in-process. Build the mesh "
            f"under torchrun or fpar.launch (backend='dist')."
        )


def _prefix(api: str, specs: Any, tree: Any) -> list:
    from ._errors import SpecError

    try:
        return broadcast_prefix(specs, tree, is_leaf=lambda s: s is None or isinstance(s, PartitionSpec))
    except ValueError as e:
        raise SpecError(
            f"fpar.{api}: spec is not a pytree prefix of the values: {e}. Give it the structure of "
            f"the values, down to where one P covers a whole subtree; a single P applies to everything."
        ) from None


def _map(api: str, x: Any, mesh: Mesh, spec: Any, fn, *, blocks: bool = False) -> Any:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"fpar.{api}: mesh must be a fpar.Mesh, got {mesh!r}.")
    paths, leaves, treedef = tree_flatten_with_path(x)
    specs = _prefix(api, spec, x)
    out = []
    for path, leaf, s in zip(paths, leaves, specs):
        where = f"fpar.{api}: x{keystr(path)}"
        if not isinstance(s, PartitionSpec):
            raise TypeError(f"{where}: spec {s!r} must be a fpar.P.")
        if not isinstance(leaf, Tensor):
            raise TypeError(f"{where} is a {type(leaf).__name__}, not a tensor.")
        check_spec(s, tuple(leaf.shape), mesh.shape, where=where, blocks=blocks)
        out.append(fn(leaf, s))
    return tree_unflatten(treedef, out)
