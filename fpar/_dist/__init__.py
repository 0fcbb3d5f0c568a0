"""The real mesh: one process per device over ``torch.distributed`` (the only importer of it).

One purpose per file:

* ``groups.py``: ranks <-> mesh coordinates, process groups per set of axes, point-to-point;
* ``exchange.py``: the collectives on local blocks as differentiable ``autograd.Function``s;
* ``shard.py``: ``fpar.shard`` on a real mesh: the plan per signature, the fast calls on plain
  local tensors;
* ``tracker.py``: the traced first call: varying axes, implicit pvaries, which sums the plan keeps;
* ``agreement.py``: the per-call signature check, carried by the call's first message;
* ``buckets.py``: the bucketed, overlapped gradient all-reduces of replicated inputs;
* ``values.py``: ``device_put``/``gather``/DTensor interop on a real mesh;
* ``launch.py``: ``init_distributed`` and ``fpar.launch``;
* ``agree.py``: every rank passed the same description of a step (the pipeline executor's check).

Nothing here imports ``fpar._mesh`` (which imports this package lazily, to attach groups).
"""

from .agree import check_same
from .exchange import _Exchange, _TakeFirst
from .groups import (
    Incoming,
    MeshGroups,
    _device,
    attach,
    device_type,
    is_initialized,
    on_paper,
    p2p,
    rank,
    simulated,
    simulation,
    world_size,
)
from .launch import LaunchError, init_distributed, launch
from .values import block, from_dtensor, gather, to_dtensor

__all__ = [
    "Incoming",
    "LaunchError",
    "MeshGroups",
    "attach",
    "block",
    "check_same",
    "device_type",
    "from_dtensor",
    "gather",
    "init_distributed",
    "is_initialized",
    "launch",
    "on_paper",
    "p2p",
    "rank",
    "simulated",
    "simulation",
    "to_dtensor",
    "world_size",
    "_Exchange",
    "_TakeFirst",
    "_device",
]
