"""Activation checkpointing on a real 2-process mesh: ``fpar.optim.remat`` against torch's
``checkpoint`` in a DDP step, side by side.

Both sides train the same residual MLP (``L`` blocks ``x + W2 relu(W1 x + b1)``, float32, MSE
loss) on the same global batch split over 2 gloo processes:

* **fpar**: parameters replicated (``P()``), the batch split over "data"; each block wrapped in
  ``fpar.optim.remat``; ``loss.backward()`` through ``fpar.shard`` (the data-parallel all-reduce is
  fpar's bucketed one).  Also timed without remat, and with selective recomputation
  (``policy=fpar.optim.save_dots``: the matmuls' outputs kept, the rest recomputed).
* **DDP**: the same blocks as ``nn.Module``\\ s in ``DistributedDataParallel``, each block run
  through ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``; also without checkpoint, and
  with torch's selective checkpointing (``create_selective_checkpoint_contexts``, ``aten.mm`` saved).

Each side: forward, backward, SGD update.  Timed interleaved (``_common.interleaved``), 1 thread a
process, medians of rank 0.  The two sides' updated parameters are checked equal once first.
Prints each median and the ratios fpar-remat / DDP-checkpoint (full and selective) and remat / no
remat on each side.

    python bench/remat.py [--blocks 4] [--dim 512] [--hidden 2048] [--batch 128] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

import fpar  # noqa: E402
import fpar.optim as fo  # noqa: E402
from fpar import P  # noqa: E402

LR = 1e-3


def _block(p, x):
    return x + torch.relu(x @ p["w1"] + p["b1"]) @ p["w2"]


def _params(blocks, d, h, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "w1": torch.randn(d, h, generator=g) / d**0.5,
            "b1": torch.zeros(h),
            "w2": torch.randn(h, d, generator=g) / h**0.5 / blocks,
        }
        for _ in range(blocks)
    ]


class Block(torch.nn.Module):
    def __init__(self, p):
        super().__init__()
        self.w1, self.b1, self.w2 = (torch.nn.Parameter(p[k].clone()) for k in ("w1", "b1", "w2"))

    def forward(self, x):
        return x + torch.relu(x @ self.w1 + self.b1) @ self.w2


def _save_mm(ctx, func, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    keep = func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def _selective():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_save_mm)


class Net(torch.nn.Module):
    def __init__(self, params, checkpoint):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(p) for p in params)
        self.checkpoint = checkpoint  # False, True, or "selective"

    def forward(self, x):
        for b in self.blocks:
            if not self.checkpoint:
                x = b(x)
            elif self.checkpoint == "selective":
                x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=False, context_fn=_selective)
            else:
                x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=False)
        return x


def run(args):
    torch.set_num_threads(1)
    mesh = fpar.make_mesh((2,), ("data",))
    rank = torch.distributed.get_rank()
    params = _params(args.blocks, args.dim, args.hidden)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.dim, generator=g)
    y = torch.randn(args.batch, args.dim, generator=g)
    xb, yb = (fpar.device_put(t, mesh, P("data")) for t in (x, y))

    def fpar_step(remat, policy=None):
        block = fo.remat(_block, policy=policy) if remat else _block

        def loss(ps, x, y):
            for p in ps:
                x = block(p, x)
            return fpar.pmean(((x - y) ** 2).mean(), "data")

        f = fpar.shard(loss, mesh, (P(), P("data"), P("data")), P())
        ps = [{k: v.clone().requires_grad_() for k, v in p.items()} for p in params]
        leaves = [v for p in ps for v in p.values()]

        def step():
            f(ps, xb, yb).backward()
            with torch.no_grad():
                torch._foreach_add_(leaves, [v.grad for v in leaves], alpha=-LR)
            for v in leaves:
                v.grad = None

        return step, leaves

    def ddp_step(checkpoint):
        net = torch.nn.parallel.DistributedDataParallel(Net(params, checkpoint))
        opt = torch.optim.SGD(net.parameters(), lr=LR, foreach=True)

        def step():
            opt.zero_grad(set_to_none=True)
            ((net(xb) - yb) ** 2).mean().backward()
            opt.step()

        return step, list(net.parameters())

    sides = {
        "fpar remat": fpar_step(True),
        "fpar remat dots": fpar_step(True, fo.save_dots),
        "fpar": fpar_step(False),
        "DDP checkpoint": ddp_step(True),
        "DDP selective": ddp_step("selective"),
        "DDP": ddp_step(False),
    }
    # the same work: one step of each from the same parameters gives the same update
    for step, _ in sides.values():
        step()
    ref = sides["DDP"][1]
    for name, (_, leaves) in sides.items():
        err = max((a.detach() - b.detach()).abs().max().item() for a, b in zip(leaves, ref))
        assert err < 1e-5, (name, err)
    for _ in range(2):  # warm-up
        for step, _ in sides.values():
            step()
    times = _common.interleaved({k: v[0] for k, v in sides.items()}, args.repeats)
    return {k: statistics.median(v) for k, v in times.items()} if rank == 0 else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    med = fpar.launch(run, 2, args, timeout=600)[0]
    print(
        f"residual MLP, {args.blocks} blocks D={args.dim} H={args.hidden} B={args.batch} (global) fp32, "
        f"2 gloo processes x 1 thread, medians of {args.repeats}:"
    )
    for k, v in med.items():
        print(f"  {k:16s} {1000 * v:8.1f} ms")
    print(f"  fpar remat / DDP checkpoint: {med['fpar remat'] / med['DDP checkpoint']:.2f}x")
    print(
        f"  fpar remat dots / DDP selective (mm saved): {med['fpar remat dots'] / med['DDP selective']:.2f}x"
    )
    print(
        f"  remat / none: fpar {med['fpar remat'] / med['fpar']:.2f}x, DDP {med['DDP checkpoint'] / med['DDP']:.2f}x"
    )
    print(
        f"  selective / none: fpar {med['fpar remat dots'] / med['fpar']:.2f}x, "
        f"DDP {med['DDP selective'] / med['DDP']:.2f}x"
    )


if __name__ == "__main__":
    main()
