"""fpar: JAX-style functional sharding on PyTorch.

A model is a pure function over a parameter pytree.  ``fpar.shard(f, mesh, in_specs, out_specs)``
runs a per-device function over a named device mesh exactly like ``jax.shard_map``; collectives
name mesh axes; the same program runs in one process (an in-process mesh) and as many processes
under ``torchrun`` (a real mesh over ``torch.distributed``).
"""

from ._collectives import all_gather as all_gather
from ._collectives import all_gather_invariant as all_gather_invariant
from ._collectives import all_to_all as all_to_all
from ._collectives import axis_index as axis_index
from ._collectives import axis_size as axis_size
from ._collectives import pmax as pmax
from ._collectives import pmean as pmean
from ._collectives import pmin as pmin
from ._collectives import ppermute as ppermute
from ._collectives import psum as psum
from ._collectives import psum_scatter as psum_scatter
from ._collectives import pvary as pvary
from ._config import mesh_from_config as mesh_from_config
from ._defer import defer_reduction as defer_reduction
from ._dist import LaunchError as LaunchError
from ._dist import init_distributed as init_distributed
from ._dist import launch as launch
from ._errors import ReplicationError as ReplicationError
from ._errors import SpecError as SpecError
from ._errors import UnboundAxisError as UnboundAxisError
from ._functional import functionalize as functionalize
from ._functional import spec_rules as spec_rules
from ._global import Init as Init
from ._global import device_put as device_put
from ._global import from_dtensor as from_dtensor
from ._global import full as full
from ._global import gather as gather
from ._global import init as init
from ._global import normal as normal
from ._global import ones as ones
from ._global import to_dtensor as to_dtensor
from ._global import uniform as uniform
from ._global import zeros as zeros
from ._mesh import Mesh as Mesh
from ._mesh import make_mesh as make_mesh
from ._shard import shard as shard
from ._shard_map import shard_map as shard_map
from ._spec import P as P
from ._spec import PartitionSpec as PartitionSpec
from ._stats import comm_stats as comm_stats
from ._stats import reset_comm_stats as reset_comm_stats
from ._sums import low_precision_sums as low_precision_sums

# Subpackages last. They import the core modules above directly, never this facade
# (tests/test_tree.py).
# isort: off
from . import checkpoint as checkpoint  # noqa: E402
from . import hf as hf  # noqa: E402
from . import ops as ops  # noqa: E402
from . import optim as optim  # noqa: E402
from . import pipeline as pipeline  # noqa: E402
from . import plan as plan  # noqa: E402
from . import random as random  # noqa: E402
from . import testing as testing  # noqa: E402

# isort: on

__version__ = "0.2.0"

__all__ = [
    "Init",
    "LaunchError",
    "Mesh",
    "P",
    "PartitionSpec",
    "ReplicationError",
    "SpecError",
    "UnboundAxisError",
    "all_gather",
    "all_gather_invariant",
    "all_to_all",
    "axis_index",
    "axis_size",
    "checkpoint",
    "ops",
    "comm_stats",
    "defer_reduction",
    "device_put",
    "from_dtensor",
    "full",
    "functionalize",
    "gather",
    "hf",
    "init",
    "init_distributed",
    "launch",
    "low_precision_sums",
    "make_mesh",
    "mesh_from_config",
    "normal",
    "ones",
    "optim",
    "pmax",
    "pmean",
    "pmin",
    "ppermute",
    "psum",
    "psum_scatter",
    "pipeline",
    "plan",
    "pvary",
    "random",
    "reset_comm_stats",
    "shard",
    "shard_map",
    "spec_rules",
    "testing",
    "to_dtensor",
    "uniform",
    "zeros",
]
