"""The real mesh: one process per device over torch.distributed (the only importer of it)."""

from __future__ import annotations

import torch.distributed as dist


def is_initialized() -> bool:
    """Whether a default process group is up."""
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    """The number of processes in the default group."""
    return dist.get_world_size()


def attach(mesh) -> None:
    """Build the process groups of ``mesh`` (filled in by the real-mesh work)."""
    raise NotImplementedError("fpar: the real (multi-process) mesh is not built yet.")


def run(call, views, labels):
    """Run one sharded call on the real mesh."""
    raise NotImplementedError("fpar: the real (multi-process) mesh is not built yet.")
