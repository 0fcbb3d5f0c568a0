"""Calls to fpar's public API for mypy (tests/test_typing.py): never run, only type-checked.

A line that ends in ``# error: CODE`` must get exactly that mypy error; every other line must get
none, so the file also shows that correct calls pass.
"""

from __future__ import annotations

import torch

import fpar
from fpar import P

mesh = fpar.make_mesh((2,), ("data",))


def per_device(x: torch.Tensor) -> torch.Tensor:
    return fpar.psum(x, "data")


f = fpar.shard(per_device, mesh, (P("data"),), P())
fpar.shard(per_device, "data", (P("data"),), P())  # error: arg-type
fpar.make_mesh(2, ("data",))  # error: arg-type
fpar.shard(per_device, mesh, (P("data"),), P(), bucket_mb="25")  # error: arg-type
fpar.optim.adamw(1e-3, b1="0.9")  # error: arg-type
fpar.checkpoint.save("run", {"w": torch.ones(2)}, mesh, {"w": P()}, step="1")  # error: arg-type
fpar.checkpoint.save("run", {"w": torch.ones(2)}, mesh, {"w": P()}, step=1)
