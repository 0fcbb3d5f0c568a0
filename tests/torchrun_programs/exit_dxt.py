"""A small data x tensor fpar program for torchrun (``tests/test_torchrun_exit.py``).

Run::

    torchrun --nproc-per-node 4 tests/torchrun_programs/exit_dxt.py [--no-destroy] [--backward]
                                                                     [--slow-exit S]

Mesh (2, 2) ("data", "tensor"): a Megatron MLP whose loss sums the row-parallel partials with
``fpar.psum`` over "tensor" and averages with ``fpar.pmean`` over "data".  A few SGD steps with
``torch.func.grad`` (or ``.backward()``), then an evaluation on a few batches: the loss, and the
sum of the predictions (one ``fpar.psum`` over both axes).  Rank 0 checks every loss, the
gathered gradients (so the trained parameters) and the evaluation against the unsharded
function computed in this process, and prints ``OK``.  The other ranks read nothing, as in a
script that prints on rank 0 only: their last call's first message, sent without waiting, is
still unsettled when they exit.

Every process must then exit 0, with or without ``destroy_process_group()`` (``--no-destroy``):
this program exists to catch an abort at interpreter exit ("terminate called without an active
exception": a gloo worker thread needing the GIL during finalization, see ``close`` in
``fpar/_dist/groups.py``).  ``--slow-exit S`` makes that abort all but certain where the bug is.
"""

from __future__ import annotations

import argparse
import atexit
import sys
import time
from pathlib import Path

_SPIN_AT_EXIT = [0.0]  # --slow-exit: seconds the process's last exit handler keeps the GIL


def _spin_at_exit() -> None:
    """A slow exit: busy in Python, never blocking, so a thread that wants the GIL waits.

    Registered before fpar is imported, so it runs after fpar's exit handlers, just before the
    interpreter finalizes: a gloo worker that finishes a message meanwhile and then needs the
    GIL (to free a buffer whose last reference it holds) gets it only once finalization began.
    """
    end = time.monotonic() + _SPIN_AT_EXIT[0]
    while time.monotonic() < end:
        pass


atexit.register(_spin_at_exit)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's fpar
import fpar  # noqa: E402
from fpar import P  # noqa: E402

SPECS = {"w1": P(None, "tensor"), "w2": P("tensor", None)}
D, H, B, LR = 8, 16, 8, 0.1
EVAL_BATCHES = 3


def loss_local(params, x, y):
    out = fpar.psum(torch.relu(x @ params["w1"]) @ params["w2"], "tensor")
    return fpar.pmean(((out - y) ** 2).mean(), "data")


def loss_global(params, x, y):
    return ((torch.relu(x @ params["w1"]) @ params["w2"] - y) ** 2).mean()


def total_prediction_local(params, x):
    """The sum of the batch's predictions: the row-parallel sum and the batch sum in one psum."""
    partial = torch.relu(x @ params["w1"]) @ params["w2"]
    return fpar.psum(partial.sum(), ("data", "tensor"))


def total_prediction_global(params, x):
    return (torch.relu(x @ params["w1"]) @ params["w2"]).sum()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-destroy", action="store_true", help="leave the process group up at exit")
    ap.add_argument("--backward", action="store_true", help="loss.backward() instead of torch.func.grad")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument(
        "--slow-exit",
        type=float,
        default=0.0,
        metavar="S",
        help="stress the exit: rank 0 comes S/4 s late to the evaluation, so the others' last "
        "message is still in flight when they exit, and their exit ends with S s of busy Python "
        "that never lets another thread have the GIL (no thread switch)",
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    fpar.init_distributed(backend="gloo", timeout=60.0)
    rank = dist.get_rank()
    mesh = fpar.make_mesh((2, 2), ("data", "tensor"))
    sharded = fpar.shard(loss_local, mesh, in_specs=(SPECS, P("data"), P("data")), out_specs=P())
    predict = fpar.shard(total_prediction_local, mesh, in_specs=(SPECS, P("data")), out_specs=P())

    gen = torch.Generator().manual_seed(0)
    params = {
        "w1": torch.randn(D, H, generator=gen, dtype=torch.float64) / D**0.5,
        "w2": torch.randn(H, 1, generator=gen, dtype=torch.float64) / H**0.5,
    }
    ref = dict(params)
    bad = []
    for step in range(args.steps):
        x = torch.randn(B, D, generator=gen, dtype=torch.float64)
        y = torch.randn(B, 1, generator=gen, dtype=torch.float64)
        blocks = fpar.device_put(params, mesh, SPECS)
        xb, yb = fpar.device_put((x, y), mesh, (P("data"), P("data")))
        if args.backward:
            leaves = {k: v.detach().requires_grad_() for k, v in blocks.items()}
            loss = sharded(leaves, xb, yb)
            loss.backward()
            grads = {k: v.grad for k, v in leaves.items()}
        else:
            grads, loss = torch.func.grad_and_value(sharded)(blocks, xb, yb)
        full = fpar.gather(grads, mesh, SPECS)  # a collective: every rank
        ref_grads, ref_loss = torch.func.grad_and_value(loss_global)(ref, x, y)
        if rank == 0:
            if not torch.allclose(loss.detach(), ref_loss, rtol=1e-10, atol=1e-12):
                bad.append(f"step {step}: loss {float(loss)} != {float(ref_loss)}")
            for k in SPECS:
                if not torch.allclose(full[k], ref_grads[k], rtol=1e-10, atol=1e-12):
                    bad.append(f"step {step}: grad {k} differs by {(full[k] - ref_grads[k]).abs().max():.3g}")
        params = {k: params[k] - LR * full[k] for k in SPECS}
        ref = {k: ref[k] - LR * ref_grads[k] for k in SPECS}

    # The evaluation: forward calls whose values are read on rank 0 only.  The total prediction's
    # psum is the call's first collective, spans every mesh axis and is returned unread, so
    # from its second (planned) call on it rides in the call's first message, sent without
    # waiting (fpar/_dist/pending.py): on the other ranks the last one is still in flight when
    # they exit.
    blocks = fpar.device_put(params, mesh, SPECS)
    for batch in range(EVAL_BATCHES):
        x = torch.randn(B, D, generator=gen, dtype=torch.float64)
        y = torch.randn(B, 1, generator=gen, dtype=torch.float64)
        xb, yb = fpar.device_put((x, y), mesh, (P("data"), P("data")))
        with torch.no_grad():
            loss = sharded(blocks, xb, yb)
            if batch == EVAL_BATCHES - 1 and args.slow_exit:
                if rank == 0:
                    time.sleep(args.slow_exit / 4)
                else:
                    sys.setswitchinterval(1000.0)  # a thread waiting for the GIL never forces a switch
                    _SPIN_AT_EXIT[0] = args.slow_exit
            total = predict(blocks, xb)
        if rank == 0:
            if not torch.allclose(loss, loss_global(ref, x, y), rtol=1e-10, atol=1e-12):
                bad.append(f"eval batch {batch}: loss {float(loss)} != {float(loss_global(ref, x, y))}")
            if not torch.allclose(total, total_prediction_global(ref, x), rtol=1e-10, atol=1e-12):
                bad.append(
                    f"eval batch {batch}: total {float(total)} != {float(total_prediction_global(ref, x))}"
                )
    if bad:
        print(f"rank {rank}: FAIL " + "; ".join(bad), flush=True)
        return 1
    if rank == 0:
        print(f"OK eval loss {float(loss):.6f}", flush=True)
    if not args.no_destroy:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
