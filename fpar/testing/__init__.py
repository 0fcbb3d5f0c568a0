"""fpar.testing: prove that a sharded layout computes the unsharded function.

* :func:`assert_equivalent` runs ``fpar.shard(fn, ...)`` and a plain reference on the same global
  inputs and compares values and gradients, naming the leaf and the mesh coordinates of the
  blocks that differ;
* :func:`distributed` runs a test body on local gloo processes (a real mesh);
* :func:`assert_same_on_real_mesh` runs your own training loop on a real mesh and on the
  in-process mesh of the same shape and compares every global value it returns;
  :class:`TrainingProgram` describes a whole drawn training program (mesh, model, gradient API,
  ZeRO stage, pipeline, optimizer, evaluation) and :func:`assert_programs_on_real_mesh` runs a
  list of them on gloo processes against the in-process mesh (the randomized real-mesh tier);
* :mod:`fpar.testing.strategies` (needs hypothesis: ``pip install fpar[test]``) draws meshes,
  valid specs and arrays for property tests, and ``training_programs`` for the real mesh.
"""

from ._distributed import distributed as distributed
from ._equivalent import assert_equivalent as assert_equivalent
from ._equivalent import default_tolerance as default_tolerance
from ._program import TrainingProgram as TrainingProgram
from ._random_mesh import assert_programs_on_real_mesh as assert_programs_on_real_mesh
from ._real_mesh import RealMeshMismatch as RealMeshMismatch
from ._real_mesh import assert_same_on_real_mesh as assert_same_on_real_mesh

__all__ = [
    "RealMeshMismatch",
    "TrainingProgram",
    "assert_equivalent",
    "assert_programs_on_real_mesh",
    "assert_same_on_real_mesh",
    "default_tolerance",
    "distributed",
]
