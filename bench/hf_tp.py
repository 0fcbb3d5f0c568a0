"""Tensor-parallel training step of a Hugging Face GPT-2: fpar against DTensor's parallelize_module.

Both sides train the same randomly initialised ``GPT2LMHeadModel`` (float32, eager attention,
dropout off) on the same batch, Megatron-split over 2 gloo processes on this machine, with the
same split: attention (``c_attn`` column-parallel by heads, ``c_proj`` row-parallel) and MLP
(``c_fc`` column, ``c_proj`` row) in every block; embeddings, LayerNorms and the tied head
replicated (DTensor's ``RowwiseParallel`` embedding plus a vocab-parallel loss would need
``loss_parallel`` around HF's loss; the blocks are where the work is):

* **fpar**: ``fpar.ops.tensor_parallel(model, mesh, plan=...)`` on the unmodified model;
  ``torch.func.grad_and_value`` of ``fpar.shard(apply_fn(p, ids, labels=ids).loss)``, and the
  same sharded loss differentiated with ``.backward()`` (fpar supports both).
* **DTensor**: ``parallelize_module`` with ``ColwiseParallel``/``RowwiseParallel``.  DTensor's
  styles split ``nn.Linear`` only, so the baseline's ``Conv1D`` layers are replaced by equivalent
  ``nn.Linear`` (transposed weights), ``c_attn``'s rows regrouped per device (each rank's block
  holds its heads of q, k and v, as fpar does) and the attention's ``split_size``/``num_heads``
  set to per-rank sizes: what a user must do by hand for DTensor.  ``loss.backward()``.

Both update with the same plain SGD (``torch._foreach_add_``).  Checked first: the two sides'
losses and updated parameters agree after one step from the same initial values.  Then both are
warmed up and timed interleaved (the order alternates), each full step after a barrier; medians
from rank 0 and the ratio fpar / DTensor (target <= 1.0).  Timings are printed, never asserted.

Run:
    python bench/hf_tp.py                            # d=256, 4 layers, batch 8 x 128, 15 repeats
    python bench/hf_tp.py --d-model 512 --repeats 21
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

try:
    import fpar
except ImportError:  # run from a checkout without installing: use the repo's fpar/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import fpar
from _common import Record, add_json_arg, interleaved

from fpar import P

NPROCS = 2
LR = 1e-3
PLAN = {
    "*.attn.c_attn": "colwise",
    "*.attn.c_proj": "rowwise",
    "*.mlp.c_fc": "colwise",
    "*.mlp.c_proj": "rowwise",
}


def build(cfg: dict):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=cfg["vocab"],
        n_positions=cfg["seq"],
        n_embd=cfg["d_model"],
        n_layer=cfg["layers"],
        n_head=cfg["heads"],
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).eval()
    model.set_attn_implementation("eager")
    return model


def dtensor_model(model, n: int):
    """The DTensor baseline: Conv1D -> nn.Linear, c_attn regrouped per rank, per-rank head counts."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = copy.deepcopy(model)
    for block in model.transformer.h:
        for owner, name in (
            (block.attn, "c_attn"),
            (block.attn, "c_proj"),
            (block.mlp, "c_fc"),
            (block.mlp, "c_proj"),
        ):
            conv = getattr(owner, name)
            linear = nn.Linear(conv.nx, conv.nf)
            with torch.no_grad():
                w = conv.weight.t()  # [out, in]
                b = conv.bias
                if name == "c_attn" and owner is block.attn:  # [q|k|v] rows -> per rank [q_r|k_r|v_r]
                    w = w.unflatten(0, (3, n, -1)).transpose(0, 1).reshape(w.shape)
                    b = b.unflatten(0, (3, n, -1)).transpose(0, 1).reshape(b.shape)
                linear.weight.copy_(w)
                linear.bias.copy_(b)
            setattr(owner, name, linear)
        block.attn.split_size //= n
        block.attn.num_heads //= n
    mesh = init_device_mesh("cpu", (n,))
    plan = {}
    for i in range(len(model.transformer.h)):
        plan.update(
            {
                f"transformer.h.{i}.attn.c_attn": ColwiseParallel(),
                f"transformer.h.{i}.attn.c_proj": RowwiseParallel(),
                f"transformer.h.{i}.mlp.c_fc": ColwiseParallel(),
                f"transformer.h.{i}.mlp.c_proj": RowwiseParallel(),
            }
        )
    return parallelize_module(model, mesh, plan)


def worker(cfg: dict) -> dict:
    torch.set_num_threads(cfg["threads"])
    n = dist.get_world_size()
    model = build(cfg)
    ids = torch.randint(
        0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=torch.Generator().manual_seed(1)
    )

    # (a) fpar on the unmodified model
    mesh = fpar.make_mesh((n,), ("tensor",))
    apply_fn, params, specs = fpar.ops.tensor_parallel(model, mesh, plan=PLAN)
    params = {k: v.clone() for k, v in fpar.device_put(params, mesh, specs).items()}
    loss_fn = fpar.shard(lambda p, x: apply_fn(p, x, labels=x, use_cache=False).loss, mesh, (specs, P()), P())
    grad_fn = torch.func.grad_and_value(loss_fn)
    names = list(params)
    plist = [params[k] for k in names]
    out = {}

    def fpar_step():
        g, loss = grad_fn(params, ids)
        torch._foreach_add_(plist, [g[k] for k in names], alpha=-LR)
        out["fpar"] = float(loss)

    # (a') fpar, differentiated with .backward() instead of torch.func.grad
    leaves = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    llist = list(leaves.values())

    def fpar_backward_step():
        loss = loss_fn(leaves, ids)
        loss.backward()
        with torch.no_grad():
            torch._foreach_add_(llist, [p.grad for p in llist], alpha=-LR)
        for p in llist:
            p.grad = None

    # (b) DTensor parallelize_module
    dmodel = dtensor_model(model, n)
    from torch.distributed.tensor import DTensor

    dparams = list(dmodel.parameters())
    groups = [
        [p for p in dparams if isinstance(p, DTensor)],
        [p for p in dparams if not isinstance(p, DTensor)],
    ]

    def dtensor_step():
        loss = dmodel(ids, labels=ids, use_cache=False).loss
        loss.backward()
        with torch.no_grad():  # foreach refuses DTensors mixed with tensors: one call per kind
            for group in groups:
                torch._foreach_add_(group, [p.grad for p in group], alpha=-LR)
        for p in dparams:
            p.grad = None
        out["dtensor"] = float(loss.detach())

    # Check: one step of each from the same values gives the same loss and c_fc update.
    fpar_step()
    dtensor_step()
    loss_diff = abs(out["fpar"] - out["dtensor"])
    w_f = params["transformer.h.0.mlp.c_fc.weight"]  # [in, out/n] block (Conv1D layout)
    w_d = dmodel.transformer.h[0].mlp.c_fc.weight.detach().to_local().t()
    weight_diff = float((w_f - w_d).abs().max())

    steps = {"fpar": fpar_step, "fpar .backward()": fpar_backward_step, "dtensor": dtensor_step}
    for _ in range(cfg["warmup"]):
        for step in steps.values():
            step()
    times = interleaved(steps, cfg["repeats"])
    fpar.reset_comm_stats()
    fpar_step()
    return {"times": times, "loss_diff": loss_diff, "weight_diff": weight_diff, "stats": fpar.comm_stats()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--timeout", type=float, default=600.0)
    add_json_arg(ap)
    args = ap.parse_args(argv)
    cfg = {k.replace("-", "_"): v for k, v in vars(args).items() if k != "json"}
    record = Record("hf_tp", cfg, argv)
    res = fpar.launch(worker, NPROCS, cfg, timeout=args.timeout)
    r0 = res[0]
    print(
        f"after one step from the same values: |loss fpar - DTensor| = {max(r['loss_diff'] for r in res):.2e}, "
        f"max |c_fc block fpar - DTensor| = {max(r['weight_diff'] for r in res):.2e}"
    )
    psum = r0["stats"].get("tensor", {}).get("psum", {})
    print(
        f"fpar traffic per step per device (forward + backward): {psum.get('calls', 0)} all-reduces, "
        f"{psum.get('bytes', 0) / 1e6:.2f} MB ({args.layers} blocks: 2 forward + 2 backward each)"
    )
    med = {k: statistics.median(v) * 1e3 for k, v in r0["times"].items()}
    print(
        f"HF GPT2LMHeadModel train step (fwd+bwd+SGD), d={args.d_model} L={args.layers} H={args.heads} "
        f"V={args.vocab}, batch {args.batch} x {args.seq}, float32, {NPROCS} gloo processes x {args.threads} "
        f"thread(s), torch {torch.__version__}, {args.repeats} repeats, interleaved"
    )
    for k, t in r0["times"].items():
        print(f"  {k:16s}  median {med[k]:8.2f} ms   min {min(t) * 1e3:8.2f}   max {max(t) * 1e3:8.2f}")
    print(f"  ratio fpar / DTensor = {med['fpar'] / med['dtensor']:.3f} (torch.func.grad), ", end="")
    print(f"{med['fpar .backward()'] / med['dtensor']:.3f} (.backward())  (target <= 1.0)")

    t = r0["times"]
    record.compare(
        "step",
        f"an unmodified HF GPT-2 train step, d={args.d_model} L={args.layers} V={args.vocab}, batch {args.batch} x "
        f"{args.seq}, fp32, {NPROCS} gloo processes x {args.threads} thread: `fpar.ops.tensor_parallel`, "
        "`torch.func.grad` / `.backward()`, vs DTensor `parallelize_module`",
        [
            ("fpar torch.func.grad", t["fpar"], "DTensor", t["dtensor"]),
            ("fpar .backward()", t["fpar .backward()"], "DTensor", t["dtensor"]),
        ],
    )
    record.data["extra"] = {
        "allreduces": psum.get("calls", 0),
        "allreduce_bytes": psum.get("bytes", 0),
        "loss_diff": max(r["loss_diff"] for r in res),
        "weight_diff": max(r["weight_diff"] for r in res),
    }
    record.write(args.json)


if __name__ == "__main__":
    main()
