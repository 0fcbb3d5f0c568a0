"""A data x tensor training loop in which rank 1 raises in the middle of step 2 (after some collectives).

Run under ``torchrun --nproc-per-node 4``.  The job must fail (every rank exits), promptly, and
torchrun's summary must name rank 1's error: ``record`` writes it to torchrun's error file.
Rank 0 is then blocked in a collective that rank 1 never joins: torchrun stops it.
"""

from __future__ import annotations

import sys

import torch
from torch.distributed.elastic.multiprocessing.errors import record

import fpar
from fpar import P


@record
def main() -> None:
    fpar.init_distributed(backend="gloo")
    mesh = fpar.make_mesh((2, 2), ("data", "tensor"))
    g = torch.Generator().manual_seed(0)
    w = fpar.device_put(
        {"a": torch.randn(4, 8, generator=g), "b": torch.randn(8, 4, generator=g)},
        mesh,
        {"a": P(None, "tensor"), "b": P("tensor", None)},
    )
    x = fpar.device_put(torch.randn(8, 4, generator=g), mesh, P("data"))

    after = sys.argv[1:] == ["after"]  # raise after the call's first collective, or before it

    def loss(w, x):
        h = torch.relu(x @ w["a"])
        if not after:
            maybe_raise()
        y = fpar.psum(h @ w["b"], "tensor")
        if after:
            maybe_raise()
        return fpar.pmean(y.square().mean(), "data")

    f = torch.func.grad(
        fpar.shard(loss, mesh, ({"a": P(None, "tensor"), "b": P("tensor", None)}, P("data")), P())
    )
    for step in range(4):
        STEP[0] = step
        grads = f(w, x)
        w = {k: w[k] - 0.1 * grads[k] for k in w}
        print(f"rank {torch.distributed.get_rank()} step {step} done", flush=True)


STEP = [0]


def maybe_raise() -> None:
    if torch.distributed.get_rank() == 1 and STEP[0] == 2:
        raise RuntimeError("the model raised on rank 1 at step 2")


if __name__ == "__main__":
    main()
