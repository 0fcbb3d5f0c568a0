"""Job for ``test_pipeline_defer.py``: a pipe x data step whose data-parallel gradients are
all-reduced once per step (``fpar.defer_reduction`` in the executor), on a real mesh.

Module level, so ``fpar.launch`` can unpickle it.
"""

from __future__ import annotations

import pipe_models as M

import fpar
import fpar.pipeline as pp
from fpar import P

P_, M_, V_ = 2, 4, 1  # stages, microbatches, chunks per stage


def pipe_data_job(steps: int = 3) -> dict:
    """``steps`` 1F1B steps on pipe=2 x data=2: loss, gathered gradients, comm_stats per step."""
    mesh = fpar.make_mesh((2, 2), ("pipe", "data"))
    prob = M.problem(P_, M_, V_)
    fns = M.stage_fns(mesh)
    spec = M.stage_spec(mesh)
    params = {
        "stages": fpar.device_put(pp.stage_major(prob["stages"], P_, V_), mesh, spec),
        "first": prob["first"],
        "last": prob["last"],
    }
    rows = P(None, "data")
    xs, ts = fpar.device_put(prob["xs"], mesh, rows), fpar.device_put(prob["ts"], mesh, rows)
    step = pp.pipeline(fns["stage"], pp.one_f_one_b(P_, M_), mesh, loss=fns["loss"], first=fns["first"])
    out = []
    for _ in range(steps):
        fpar.reset_comm_stats()
        res = step(params, xs, ts)
        out.append(
            {
                "loss": res.loss,
                "stages": fpar.gather(res.grads["stages"], mesh, spec),
                "first": res.grads["first"],
                "last": res.grads["last"],
                "stats": fpar.comm_stats(),
            }
        )
    return {"pipe": mesh._dist.coords["pipe"], "steps": out}
