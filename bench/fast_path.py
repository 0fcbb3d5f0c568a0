"""What each mechanism of the real mesh's fast path buys: the data-parallel step with it taken out.

The step is ``bench/data_parallel.py``'s (a 2-layer MLP, replicated parameters, the batch split
over "data" on 2 gloo processes, SGD), by ``torch.func.grad`` and by ``.backward()``.  Each side
below is fpar with one mechanism switched off (by patching fpar's private functions while that
side's step runs, so the others run the library as shipped); all sides are timed interleaved in
one launch, and each prints its median against the full fast path's:

* **no plan**: every call runs traced (the ``TorchFunctionMode`` that types every op and inserts
  a pvary per use), as the first call of a signature does: what planning once per signature buys;
* **no carry**: the signature check goes in a message of its own, before the loss's ``pmean``
  and the gradient buckets, instead of riding in the first of them;
* **no pending**: the loss ``pmean`` (carrying the check) is waited for where it is issued,
  instead of being a ``Pending`` value read at its first use;
* **no hold**: a gradient bucket that is ready while the check is still on its way waits for
  the check there (a blocking wait in the backward) and then starts its all-reduce, instead of
  being held and sent at the next settling (``pending.hold``): what holding costs or buys in
  overlap of that bucket's all-reduce with the rest of the backward;
* **DDP**: torch's ``DistributedDataParallel`` on the same model, for scale.

Each side is checked, before timing, to give the full fast path's update.  A mechanism whose
gain is inside the run-to-run spread of the full side against itself (also printed: the same
step timed as two sides) does not pay.

Run:
    python bench/fast_path.py                 # D=512 H=2048 B=128, 20 repeats
    python bench/fast_path.py --tiny --repeats 100   # D=64 H=256 B=16: the fixed cost per call
"""

from __future__ import annotations

import argparse
import contextlib
import statistics

import _common
import data_parallel as _dp
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import fpar
from fpar import P
from fpar._dist import agreement, buckets, pending, tracker

KEYS, LR = _dp.KEYS, _dp.LR


@contextlib.contextmanager
def without(mechanism: str):
    """fpar with ``mechanism`` switched off while the block runs."""
    if mechanism == "plan":
        finish = tracker._Tracker.finish

        def traced(self):
            finish(self)
            self.plan.fast = False

        tracker._Tracker.finish = traced
        try:
            yield
        finally:
            tracker._Tracker.finish = finish
    elif mechanism == "carry":
        carry, join = agreement._Agreement.carry, agreement._Agreement.join

        def alone(self, kind, axes, x, params):
            if self.pending:
                self._exchange(None, failed=False)
            return params

        agreement._Agreement.carry = alone
        agreement._Agreement.join = lambda self, bucket: False
        try:
            yield
        finally:
            agreement._Agreement.carry, agreement._Agreement.join = carry, join
    elif mechanism == "pending":
        may = agreement._may_wait_later
        agreement._may_wait_later = lambda: False
        try:
            yield
        finally:
            agreement._may_wait_later = may
    elif mechanism == "hold":
        launch = buckets._State.launch

        def waiting(self, *, hold: bool = True):
            riding = self.rider is not None and self.rider.first is not None  # bucket 0 sends it
            if hold and self.work is None and self.flat is not None and not riding and pending.in_flight():
                pending.settle()  # waits for the check here; launch then finds nothing in flight
            return launch(self, hold=hold)

        buckets._State.launch = waiting
        try:
            yield
        finally:
            buckets._State.launch = launch
    else:
        yield


MECHANISMS = ("full again", "plan", "carry", "pending", "hold")


def worker(cfg: dict) -> dict:
    torch.set_num_threads(cfg["threads"])
    mesh, params, x_local, y_local = _dp.setup(cfg)
    sides: dict = {}
    state: dict = {}
    for form in ("grad", "bw"):
        for mech in ("full", *MECHANISMS):
            f = fpar.shard(_dp.loss_local, mesh, (P(), P("data"), P("data")), P())  # its own plans
            ps = {k: params[k].detach().clone() for k in KEYS}
            if form == "grad":
                grad_fn = torch.func.grad(f)

                def step(grad_fn=grad_fn, ps=ps, mech=mech):
                    with without(mech):
                        g = grad_fn(ps, x_local, y_local)
                        torch._foreach_add_([ps[k] for k in KEYS], [g[k] for k in KEYS], alpha=-LR)

                state[(form, mech)] = [ps[k] for k in KEYS]
            else:
                inner = _dp.backward_step(f, params, KEYS, x_local, y_local, lr=LR)

                def step(inner=inner, mech=mech):
                    with without(mech):
                        inner()

                state[(form, mech)] = inner.leaves
            sides[f"{form}: {mech}"] = step
    model = DDP(_dp.make_module(params))
    opt = torch.optim.SGD(model.parameters(), lr=LR, foreach=True)

    def ddp_step():
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(x_local), y_local).backward()
        opt.step()

    sides["ddp"] = ddp_step
    # the same update from every side (each starts from the same parameters)
    for step in sides.values():
        step()
    worst = 0.0
    for form in ("grad", "bw"):
        ref = state[(form, "full")]
        for mech in MECHANISMS:
            for a, b in zip(state[(form, mech)], ref):
                worst = max(worst, ((a.detach() - b.detach()).abs().max()).item())
    if worst > 1e-6:
        raise AssertionError(f"a side's update differs from the full fast path's by {worst:.2e}")
    for _ in range(cfg["warmup"]):
        for step in sides.values():
            step()
    cpu: dict = {}
    times = _common.interleaved(sides, cfg["repeats"], cpu)
    return {"times": times, "cpu": cpu, "worst": worst}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="D=64 H=256 B=16")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    dim, hidden, batch = (64, 256, 16) if args.tiny else (512, 2048, 128)
    cfg = dict(
        repeats=args.repeats, warmup=args.warmup, threads=args.threads, dim=dim, hidden=hidden, batch=batch
    )
    res = fpar.launch(worker, 2, cfg, timeout=900)
    r0 = res[0]
    med = {k: statistics.median(v) * 1e3 for k, v in r0["times"].items()}
    cpu = {k: statistics.median(v) * 1e3 for k, v in r0["cpu"].items()}
    print(
        f"data-parallel MLP step, D={dim} H={hidden} B={batch} float32, 2 gloo processes x {args.threads} "
        f"thread(s), {args.repeats} repeats, torch {torch.__version__}; the same update from every side "
        f"(max diff {r0['worst']:.1e})"
    )
    for form, name in (("grad", "torch.func.grad"), ("bw", ".backward()")):
        full = med[f"{form}: full"]
        print(f"  {name}: full fast path median {full:.2f} ms (CPU {cpu[f'{form}: full']:.2f} ms)")
        for mech in MECHANISMS:
            k = f"{form}: {mech}"
            label = "the same, timed again (noise)" if mech == "full again" else f"without {mech}"
            print(
                f"    {label:32s} {med[k]:8.2f} ms  {med[k] / full:5.2f}x   CPU {cpu[k]:6.2f} ms  "
                f"{cpu[k] / cpu[f'{form}: full']:5.2f}x"
            )
    print(f"  DDP median {med['ddp']:.2f} ms (CPU {cpu['ddp']:.2f} ms)")


if __name__ == "__main__":
    main()
