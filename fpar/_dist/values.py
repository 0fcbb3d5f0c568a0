"""Global values on a real mesh: this rank's block, gathering, DTensor interop."""

from __future__ import annotations

import torch

from .. import _stats as stats
from .._spec import PartitionSpec, check_spec
from .exchange import _Exchange

Tensor = torch.Tensor


def block(x: Tensor, spec: PartitionSpec, mesh) -> Tensor:
    """This rank's block of the global ``x`` (a copy, so the global tensor can be freed)."""
    coords = mesh._dist.coords
    for d, entry in enumerate(spec.normalized()):
        index, n = 0, 1
        for a in entry:
            index = index * mesh.shape[a] + coords[a]
            n *= mesh.shape[a]
        if n > 1:
            x = x.narrow(d, index * (x.shape[d] // n), x.shape[d] // n)
    if mesh.abstract:  # a mesh on paper (fpar.plan): the block's shape and dtype only
        return torch.empty(x.shape, dtype=x.dtype, device="meta")
    return x.clone()


def gather(x: Tensor, spec: PartitionSpec, mesh) -> Tensor:
    """The global tensor on every rank, from each rank's block ``x`` (differentiable).

    The result is one replicated value, so the transpose keeps each rank's own block of the
    cotangent (``all_gather_invariant``), as in-process, where ``gather`` copies.  Not
    counted in ``fpar.comm_stats``: it moves data out of the mesh, like ``device_put`` into it.
    """
    out = x
    with stats.uncounted():
        for d, entry in enumerate(spec.normalized()):
            if entry:
                out = _Exchange.apply(out, "all_gather_invariant", (d, True), 0, entry, mesh._dist)
    # a replicated block is returned as a copy, as every gathered one is new: the caller may keep
    # it while the block is updated in place (a donated optimizer step)
    return x.clone() if out is x else out


def _placements(spec: PartitionSpec, mesh, api: str):
    from torch.distributed.tensor import Replicate, Shard

    where = {a: d for d, entry in enumerate(spec.normalized()) for a in entry}
    for d, entry in enumerate(spec.normalized()):
        order = [mesh.axis_names.index(a) for a in entry]
        if order != sorted(order):
            raise ValueError(
                f"fpar.{api}: spec {spec} splits dim {d} over {entry}, not in mesh order "
                f"{mesh.axis_names}; DTensor nests shards in mesh order only."
            )
    return [Shard(where[a]) if a in where else Replicate() for a in mesh.axis_names]


def to_dtensor(x: Tensor, spec: PartitionSpec, mesh):
    """Wrap this rank's block as a DTensor on the mesh's DeviceMesh."""
    from torch.distributed.tensor import DTensor

    from .._spec import global_shape

    check_spec(spec, tuple(x.shape), mesh.shape, where="fpar.to_dtensor", blocks=True)
    shape = global_shape(spec, tuple(x.shape), mesh.shape)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(
        x,
        mesh._dist.device_mesh,
        _placements(spec, mesh, "to_dtensor"),
        run_check=False,
        shape=shape,
        stride=stride,
    )


def from_dtensor(dt, spec: PartitionSpec, mesh) -> Tensor:
    """This rank's block of ``dt`` laid out as ``spec``."""
    placements = _placements(spec, mesh, "from_dtensor")
    return dt.redistribute(mesh._dist.device_mesh, placements).to_local()
