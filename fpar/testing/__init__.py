"""fpar.testing: prove that a sharded layout computes the unsharded function.

* :func:`assert_equivalent` runs ``fpar.shard(fn, ...)`` and a plain reference on the same global
  inputs and compares values and gradients, naming the leaf and the mesh coordinates of the
  blocks that differ;
* :func:`distributed` runs a test body on local gloo processes (a real mesh);
* :mod:`fpar.testing.strategies` (needs hypothesis: ``pip install fpar[test]``) draws meshes,
  valid specs and arrays for property tests.
"""

from ._distributed import distributed as distributed
from ._equivalent import assert_equivalent as assert_equivalent
from ._equivalent import default_tolerance as default_tolerance

__all__ = ["assert_equivalent", "default_tolerance", "distributed"]
