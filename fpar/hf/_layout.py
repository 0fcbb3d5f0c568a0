"""Where fpar's tensors come from in a checkpoint, and which block of each a process holds.

``tensor_parallel`` may hold a parameter in another order than the checkpoint (GPT-2's and
Phi-3's fused weights regrouped per device) or with rows repeated (kv heads replicated when
there are fewer than tensor devices): ``apply_fn.source(name)`` says how, as ``(dim, index)``
with ``fpar_global == hf_tensor.index_select(dim, index)``, or ``None`` for the tensor itself.
"""

from __future__ import annotations

import torch

from .._mesh import Mesh
from .._spec import PartitionSpec

__all__ = ["block_ranges", "process_index", "source", "spec_of_block"]

Tensor = torch.Tensor


def source(apply_fn, name: str, shape: tuple[int, ...]) -> tuple[int, Tensor] | None:
    """``(dim, index)`` with ``fpar's global tensor == stored.index_select(dim, index)``, or ``None``.

    ``apply_fn.source`` where ``tensor_parallel`` provides it; else from ``apply_fn.regrouped``
    (``{name: (groups, dim)}``: ``[g0 | g1 | ...]`` columns regrouped per device).
    """
    fn = getattr(apply_fn, "source", None)
    if callable(fn):
        return fn(name)
    regrouped = getattr(apply_fn, "regrouped", {})
    if name not in regrouped:
        return None
    groups, dim = regrouped[name]
    size, n = shape[dim], apply_fn.n
    index = torch.arange(size).unflatten(0, (groups, n, size // (groups * n))).transpose(0, 1).reshape(size)
    return dim, index


def block_ranges(shape: tuple[int, ...], spec: PartitionSpec, mesh: Mesh) -> list[tuple[int, int]]:
    """This process's ``[start, stop)`` per dim of a global ``shape`` split as ``spec``.

    The whole range of every dim in-process (a value there is global); on a real mesh the block
    ``fpar.device_put`` gives (axes of one dim major-to-minor in the order written).
    """
    ranges = [(0, s) for s in shape]
    if mesh.backend == "local":
        return ranges
    coords = mesh._dist.coords
    for d, entry in enumerate(spec.normalized()):
        index, n = 0, 1
        for a in entry:
            index = index * mesh.shape[a] + coords[a]
            n *= mesh.shape[a]
        size = shape[d] // n
        ranges[d] = (index * size, (index + 1) * size)
    return ranges


def process_index(mesh: Mesh) -> int:
    """This process's place in the mesh, row-major over its axes (0 in-process)."""
    if mesh.backend == "local":
        return 0
    index = 0
    for a in mesh.axis_names:
        index = index * mesh.shape[a] + mesh._dist.coords[a]
    return index


def spec_of_block(name: str, block: tuple[int, ...], whole: tuple[int, ...], axis: str, n: int, api: str):
    """The spec of a tensor-parallel block: the dims where it is ``1/n`` of the global tensor."""
    if len(block) != len(whole):
        raise ValueError(
            f"{api}: params[{name!r}] has shape {tuple(block)}, the model's has rank {len(whole)} "
            f"({tuple(whole)}); pass the params tensor_parallel / from_pretrained returned."
        )
    entries = []
    for b, w in zip(block, whole):
        if b == w:
            entries.append(None)
        elif b * n == w:
            entries.append(axis)
        else:
            raise ValueError(
                f"{api}: params[{name!r}] has shape {tuple(block)}, which is neither the global shape "
                f"{tuple(whole)} nor its block over {axis!r} (size {n}); pass this process's blocks as "
                f"from_pretrained / fpar.device_put(params, mesh, specs) give them."
            )
    return PartitionSpec(*entries)
