"""The in-process mesh: every device of the mesh in this process, one ``vmap`` level per mesh axis.

The twin of ``_dist/`` (the real mesh), one purpose per file:

* ``shard.py``: ``fpar.shard`` in-process: split the inputs, run the vmap nest, assemble the
  outputs, the replication check;
* ``collective.py``: the collectives' ``autograd.Function``, whose vmap rule turns the levels of
  the axes a collective names into explicit dims (``Frame.collective`` in-process); which mesh
  axes a value varies over; the implicit pvary of replicated operands;
* ``exchange.py``: what each collective does to the stacked blocks of every device (plain
  differentiable torch ops, so gradients are exact by construction);
* ``mode.py``: the torch-function mode inside the nest: implicit pvary of replicated operands,
  matmuls folded across mesh levels, the random-op guard.

The collectives' public API is shared by both meshes and lives in ``_collectives.py``; it
dispatches each call to the running frame's backend (here, ``collective.py``).
"""

from .exchange import LocalBackend
from .mode import ShardMode, storage_of
from .shard import LocalCall

__all__ = ["LocalBackend", "LocalCall", "ShardMode", "storage_of"]
