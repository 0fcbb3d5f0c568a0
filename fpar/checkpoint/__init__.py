"""Checkpoints of sharded pytrees: per-process blocks, atomic commits, resharding loads.

``save(path, tree, mesh, specs, step=...)`` has each process write its own blocks (a block
replicated over some mesh axes is written once); ``load(path, mesh, specs)`` reads them back
onto any mesh and any layout, each process reading only the slices its new block overlaps (the
resharding of DCP and Megatron's ``dist_checkpointing``); ``merge(path, out_file)`` writes one
safetensors file of full tensors (OSLO's ``merge_checkpoints=True``).  Parameters and optimizer
state are just pytrees: save ``{"params": ..., "opt": ..., "step": ...}``.

On disk (``save(run, tree, mesh, specs, step=100)`` on a (data=2, tensor=2) real mesh)::

    run/step_00000100/
      metadata.json                  # the commit: tree structure, per leaf dtype, global shape,
                                     # spec, and its blocks (file, offsets, shape); mesh, step
      g000000-p00000.safetensors     # process 0's blocks, one tensor per leaf ("params.w1"), and
      g000000-p00001.safetensors     # JSON metadata: global shape, spec, offsets of each block,
                                     # the mesh shape, the process, the save's generation

Only safetensors and JSON are ever read: loading never unpickles, and refuses anything else.
Every file is written to a temporary name, fsynced and renamed; ``metadata.json`` is replaced
last and names its save's files (``g<generation>-``), and the previous save's files are removed
only after it, so a crash never damages the last good checkpoint.  A real mesh needs a
filesystem that every process sees.

``save(..., blocking=False)`` returns at once with a ``PendingSave``: the blocks are copied to
host memory and written, then committed, by a background thread that agrees with the other
processes through the filesystem alone (``_async`` says how); ``wait()`` waits for the commit.
"""

from ._async import PendingSave as PendingSave
from ._async import wait as wait
from ._core import latest_step as latest_step
from ._core import load as load
from ._core import merge as merge
from ._core import save as save
from ._format import CheckpointError as CheckpointError

__all__ = ["CheckpointError", "PendingSave", "latest_step", "load", "merge", "save", "wait"]
