"""Rank 1 raises with its call's first message in flight, while rank 0 waits for it elsewhere.

Run under ``torchrun --nproc-per-node 2``.  At step 2 rank 0 enters a barrier first (it waits
for rank 1 there) and rank 1 makes the step's call, whose first message (the loss ``pmean``,
sent async and checked at its first use) rank 0 never joins, then raises.  Rank 1 must exit
promptly: then rank 0's barrier fails on the closed connection and torchrun ends the job naming
rank 1's error.  Regression: rank 1's exit handler ran the message's verdict, which waited for
rank 0, which waited for rank 1 to exit; the job hung until the collective's timeout.
"""

from __future__ import annotations

import torch
from torch.distributed.elastic.multiprocessing.errors import record

import fpar
from fpar import P


@record
def main() -> None:
    fpar.init_distributed(backend="gloo", timeout=600)  # a hang outlasts the test's bound
    mesh = fpar.make_mesh((2,), ("data",))
    x = fpar.device_put(torch.arange(8.0), mesh, P("data"))
    f = fpar.shard(lambda x: fpar.pmean(x.square().mean(), "data"), mesh, (P("data"),), P())
    rank = torch.distributed.get_rank()
    for step in range(4):
        if step == 2 and rank == 0:
            torch.distributed.barrier()  # rank 1 never comes
        loss = f(x)
        if step == 2:
            raise RuntimeError(f"rank {rank} raised at step 2 with its call's first message in flight")
        print(f"rank {rank} step {step} loss {float(loss)}", flush=True)


if __name__ == "__main__":
    main()
