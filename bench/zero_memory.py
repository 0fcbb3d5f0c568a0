"""Bytes a parameter at a ZeRO step's peak, stages 0-3 with AdamW: fpar on 2 gloo processes against the ZeRO paper.

The model is ``L`` residual MLP layers (``bench/zero.py``'s: float32, ``nn.Linear`` layout) with a
small batch, so that parameters dwarf activations and the peak is model states.  Each stage runs
``fpar.optim.zero_step(loss, fpar.optim.adamw(...), layout, donate=...)`` on a real 2-process mesh,
without and with donation (``donate=True``: the update writes parameters and AdamW state in place,
as ``torch.optim`` does).

Measured independently of fpar's own bookkeeping: torch's CPU allocator events under
``torch.profiler`` (``bench/zero.py``'s ``peak_bytes``: the bytes the step's inputs hold, plus the
highest running sum of allocations minus frees over one steady step).  Beside it, what
``fpar.plan.estimate`` predicts for the same step on an abstract mesh.  The paper's formula with
fp32 parameters and gradients (Rajbhandari et al. 2019, with K=8 for AdamW's two fp32 moments):
16, 8 + 8/N, 4 + 12/N, 16/N bytes a parameter for stages 0-3, N the data-parallel size.

Run:
    python bench/zero_memory.py                    # L=8 D=1024 H=4096 B=4 (67M parameters)
    python bench/zero_memory.py --layers 4 --dim 256 --hidden 1024
    python bench/zero_memory.py --stacked          # each kind of weight one [L, ...] leaf (a scanned model)
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

try:
    import fpar
except ImportError:  # run from a checkout without installing: use the repo's fpar/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import fpar
from zero import held_bytes, loss_local, make_params, peak_bytes

import fpar.optim as fo
from fpar import P

N = 2
STAGES = (0, 1, 2, 3)


def paper(stage: int, n: int = N) -> float:
    """The ZeRO paper's bytes a parameter, fp32 parameters and gradients, AdamW (K = 8)."""
    return {0: 16.0, 1: 8 + 8 / n, 2: 4 + 12 / n, 3: 16 / n}[stage]


def stacked_params(L: int, D: int, H: int) -> dict[str, torch.Tensor]:
    """``make_params``' values with each kind stacked over the layers: ``w1[L, H, D]`` and so on."""
    flat = make_params(L, D, H)
    return {k: torch.stack([flat[f"{i}.{k}"] for i in range(L)]) for k in ("w1", "b1", "w2", "b2")}


def stacked_loss(params, batch):
    """``loss_local`` over stacked leaves, each layer's slice taken with ``unbind`` (a scanned model)."""
    x_BD, y_BD = batch
    h = x_BD
    for w1, b1, w2, b2 in zip(*(params[k].unbind(0) for k in ("w1", "b1", "w2", "b2"))):
        h = h + F.linear(torch.relu(F.linear(h, w1, b1)), w2, b2)
    return F.mse_loss(h, y_BD)


def build(mesh, cfg: dict, stage: int, donate: bool):
    make, loss = (stacked_params, stacked_loss) if cfg["stacked"] else (make_params, loss_local)
    params = fpar.device_put(make(cfg["layers"], cfg["dim"], cfg["hidden"]), mesh, P())
    layout = fo.zero_layout(params, mesh, stage=stage, data_axis="data")
    opt = fo.adamw(1e-3, weight_decay=0.01)
    params, state = fo.zero_init(opt, params, layout)
    step = fo.zero_step(loss, opt, layout, batch_specs=P("data"), donate=donate)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(cfg["batch"], cfg["dim"], generator=gen)
    batch = fpar.device_put((x, torch.randn(x.shape, generator=gen)), mesh, P("data"))
    return step, params, state, batch


def measure(mesh, cfg: dict, stage: int, donate: bool) -> tuple[int, int]:
    """``(bytes the step's inputs hold, bytes at its peak)`` of one steady step on this rank."""
    step, params, state, batch = build(mesh, cfg, stage, donate)
    return peak_bytes(lambda: step(params, state, batch), lambda: held_bytes(params, state, batch))


def worker(cfg: dict) -> dict:
    torch.set_num_threads(1)
    mesh = fpar.make_mesh((N,), ("data",), backend="dist")
    return {
        (stage, donate): measure(mesh, cfg, stage, donate) for stage in STAGES for donate in (False, True)
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8, help="L, residual MLP layers")
    parser.add_argument("--dim", type=int, default=1024, help="D, the model width")
    parser.add_argument("--hidden", type=int, default=4096, help="H, the hidden width")
    parser.add_argument("--batch", type=int, default=4, help="B, the global batch (split over 2)")
    parser.add_argument(
        "--stacked", action="store_true", help="each kind of weight one [L, ...] leaf, layers by unbind"
    )
    args = parser.parse_args(argv)
    cfg = vars(args)
    n_params = sum(t.numel() for t in make_params(cfg["layers"], cfg["dim"], cfg["hidden"]).values())
    print(
        f"# ZeRO memory, AdamW, 2 gloo processes, L={cfg['layers']} D={cfg['dim']} H={cfg['hidden']} "
        f"B={cfg['batch']}{' stacked' if cfg['stacked'] else ''}: {n_params / 1e6:.1f}M parameters; "
        f"torch {torch.__version__}, "
        f"{platform.machine()}"
    )
    ranks = fpar.launch(worker, N, cfg, timeout=900.0)
    print(
        "| stage | donate | measured B/param (rank 0, 1) | fpar.plan B/param | ZeRO paper | measured / paper |"
    )
    print("|---|---|---|---|---|---|")
    for stage in STAGES:
        for donate in (False, True):
            got = [r[(stage, donate)][1] / n_params for r in ranks]
            step, params, state, batch = build(fpar.plan.abstract_mesh((N,), ("data",)), cfg, stage, donate)
            planned = fpar.plan.estimate(step, params, state, batch).peak_bytes / n_params
            print(
                f"| {stage} | {'yes' if donate else 'no'} | {got[0]:.2f}, {got[1]:.2f} | {planned:.2f} | "
                f"{paper(stage):.1f} | {max(got) / paper(stage):.2f} |"
            )


if __name__ == "__main__":
    main()
