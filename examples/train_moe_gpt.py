"""Train a mixture-of-experts GPT with expert parallelism on the Python standard library's sources.

The model is ``fpar.ops.gpt`` with a MoE MLP in every other block (``init_gpt(...,
n_experts=E)``): a dropless top-k router over ``E`` experts (``fpar.ops.moe``), trained with the
Switch load-balancing loss ``aux_weight * aux``.  The mesh is ``data x expert x tensor``:

* the batch is split over ``("data", "expert")`` (expert parallelism lives inside data
  parallelism, as in DeepSpeed-MoE / Megatron-Core), so the aux loss is taken over both
  (``token_axes``);
* each MoE block's experts are split over ``expert`` (``E / n`` per device); tokens travel to
  their experts' devices and back with two ``all_to_all`` per layer;
* attention, the dense MLPs, the embedding and the head are Megatron 1D over ``tensor``, and so
  is each expert's hidden dim (expert-TP).

The layout fits the devices it is given (``--devices N`` in-process, default 4; under torchrun
the world size, one process per device): ``--expert`` (default 2), then tensor=2 if it fits, and
data takes the rest: 2 devices are expert=2, 4 are expert=2 x tensor=2, 8 are
data=2 x expert=2 x tensor=2.

Every ``--log-every`` steps it prints the loss, the aux loss and the load per expert of each MoE
block (the (token, choice) pairs each expert got on a fixed probe batch of 8 x seq tokens, as the
layer reports them with ``return_stats=True``; equal counts are perfectly balanced, and with
``--capacity-factor`` the pairs dropped over capacity); at the end, the loss on held-out text
(the corpus' last 5%).  On a real mesh (torchrun) the tokens travel to their experts with
exact-count all_to_alls (the bytes printed at step 1 are the rows actually routed).

Run (about 1-2 minutes on 2 CPU cores with the defaults: 4 in-process devices):
    python examples/train_moe_gpt.py                          # data=1 x expert=2 x tensor=2
    python examples/train_moe_gpt.py --expert 4 --tensor 1    # one expert per device
    python examples/train_moe_gpt.py --devices 2              # expert=2
    python examples/train_moe_gpt.py --single-device          # the same model, unsharded
    python examples/train_moe_gpt.py --capacity-factor 1.25   # drop pairs over capacity (Switch)
    torchrun --nproc-per-node 4 examples/train_moe_gpt.py     # the same, one process per device
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common.py and train_gpt.py, next to this file
import _common as C  # noqa: E402
from train_gpt import VOCAB, batch_at, load_corpus  # noqa: E402

import fpar  # noqa: E402
import fpar.ops as ops  # noqa: E402
import fpar.optim as fo  # noqa: E402
from fpar import P  # noqa: E402

AXES = ("data", "expert", "tensor")
TOKENS = P(("data", "expert"))  # the batch rows: split over data and expert


def build(args, mesh: fpar.Mesh):
    """The training loss ``loss(params, ids, targets) -> (loss + w aux, loss, aux)`` and the specs."""
    specs = ops.gpt_specs(args.layers, "tensor", moe=True, expert_axis="expert")
    moe = dict(top_k=args.top_k, axis="expert", token_axes=("data", "expert"), **_capacity(args))

    def loss(params, ids_BT, targets_BT):
        tok_BT, aux = ops.gpt_loss(params, ids_BT, targets_BT, axis="tensor", n_heads=args.heads, moe=moe)
        mean = fpar.pmean(tok_BT.mean(), ("data", "expert"))
        return mean + args.aux_weight * aux, mean, aux

    return fpar.shard(loss, mesh, (specs, TOKENS, TOKENS), (P(), P(), P())), specs


def _capacity(args) -> dict:
    return {} if args.capacity_factor is None else {"capacity_factor": args.capacity_factor}


def expert_load(args, params: dict, ids_BT: torch.Tensor) -> tuple[list[list[int]], list[int]]:
    """Per MoE block: the (token, choice) pairs each expert gets on ``ids_BT``, and the pairs dropped.

    Recomputes the model's forward on whole parameters (one in-process device) up to each MoE
    block, as ``fpar.ops.gpt`` runs it, and reads the counts the layer itself reports
    (``fpar.ops.moe(..., return_stats=True)``: routed pairs per expert, pairs over capacity).
    """
    one = fpar.make_mesh((1,), ("tensor",), backend="local")
    specs = ops.gpt_specs(args.layers, "tensor", moe=True, expert_axis=None)
    moe = dict(top_k=args.top_k, **_capacity(args))

    def loads(p, ids):
        x = ops.vocab_embedding(ids, p["w_emb"], axis="tensor") + p["w_pos"][: ids.shape[1]]
        counts, dropped = [], []
        for block in p["blocks"]:
            if "moe" not in block:
                x = ops.gpt_block(block, x, axis="tensor", n_heads=args.heads)
                continue
            h = x + ops.attention(
                block["attn"], ops.layer_norm(block["ln1"], x), axis="tensor", n_heads=args.heads, causal=True
            )
            _, _, stats = ops.moe(
                block["moe"], ops.layer_norm(block["ln2"], h), tensor_axis="tensor", return_stats=True, **moe
            )
            counts.append(stats["counts"])
            dropped.append(stats["dropped"])
            x, _ = ops.moe_block(block, x, axis="tensor", n_heads=args.heads, moe=moe)
        return torch.stack(counts), torch.stack(dropped)

    with torch.no_grad():
        counts, dropped = fpar.shard(loads, one, (specs, P()), (P(), P()))(params, ids_BT)
    return counts.tolist(), dropped.tolist()


def layout(args, devices: int) -> tuple[int, int, int]:
    """(data, expert, tensor) for ``devices``: ``--expert``, then tensor=2 if it fits, data the rest."""
    if args.single_device:
        return 1, 1, 1
    expert = args.expert
    tensor = args.tensor if args.tensor is not None else (2 if devices % (2 * expert) == 0 else 1)
    data = devices // (expert * tensor) if args.dp == -1 else args.dp
    if data * expert * tensor != devices:
        given = "" if args.dp == -1 else f"data={args.dp} x "
        raise SystemExit(
            f"{given}expert={expert} x tensor={tensor} does not fit {devices} devices: the mesh is "
            f"data x expert x tensor (e.g. 2 devices: expert=2; 4: expert=2 x tensor=2; 8: data=2 x ...)"
        )
    if args.experts % expert:
        raise SystemExit(f"--experts {args.experts} must split evenly over expert={expert} devices")
    return data, expert, tensor


def main(argv=None) -> list[float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=4, help="in-process devices (torchrun: the world size)")
    ap.add_argument(
        "--data-size", "--dp", dest="dp", type=int, default=-1, help="data-parallel size (-1: the rest)"
    )
    ap.add_argument("--expert", type=int, default=2, help="expert-parallel size")
    ap.add_argument(
        "--tensor",
        type=int,
        help="tensor-parallel size, Megatron 1D + expert-TP (default 2 if it fits, else 1)",
    )
    ap.add_argument("--single-device", action="store_true", help="one device: the unsharded model")
    ap.add_argument("--experts", type=int, default=4, help="E, experts per MoE block")
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument(
        "--capacity-factor",
        type=float,
        help="drop pairs over ceil(cf * T * k / E) per expert (default: dropless)",
    )
    ap.add_argument("--aux-weight", type=float, default=0.01, help="weight of the load-balancing loss")
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--d-hidden", type=int, default=128, help="each expert's (and dense MLP's) hidden width")
    ap.add_argument("--layers", type=int, default=4, help="blocks; 2, 4, ... are MoE")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--max-bytes", type=int, default=1_000_000)
    ap.add_argument("--data", help="train on this file's bytes (default: the standard library's .py files)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    C.start(args.threads)
    say = lambda *a: C.say(*a, quiet=args.quiet)  # noqa: E731

    real = torch.distributed.is_initialized()
    if real and args.single_device:
        raise SystemExit("--single-device is for one process; run it without torchrun")
    mesh = fpar.make_mesh(layout(args, torch.distributed.get_world_size() if real else args.devices), AXES)
    step_loss, specs = build(args, mesh)
    tokens_N, source = load_corpus(args.data, args.max_bytes)
    split = int(0.95 * len(tokens_N))
    train_N, val_N = tokens_N[:split], tokens_N[split:]
    say(f"corpus: {len(tokens_N):,} bytes from {source}")
    kind = "real" if mesh.backend == "dist" else "in-process"
    say(
        f"mesh {dict(mesh.shape)} ({kind}); MoE GPT d={args.d_model} layers={args.layers} "
        f"(MoE: {list(range(1, args.layers, 2))}) experts={args.experts} top-{args.top_k}"
    )
    init = ops.init_gpt(
        VOCAB, args.d_model, args.layers, args.seq, d_hidden=args.d_hidden, n_experts=args.experts
    )
    params = fpar.init(init, mesh, specs, seed=args.seed)
    lr = fo.warmup_cosine(args.lr, args.steps // 10, args.steps, end=args.lr / 10)
    opt = fo.adamw(lr, weight_decay=0.0)
    state = opt.init(params)

    def objective(p, ids, targets):
        total, lm, aux = step_loss(p, ids, targets)
        return total, (lm, aux)

    value_fn = torch.func.grad_and_value(objective, has_aux=True)
    probe_BT, _ = batch_at(train_N, 10**6, 8, args.seq, args.seed + 1)

    losses, t0 = [], time.perf_counter()
    for step in range(args.steps):
        ids_BT, targets_BT = batch_at(train_N, step, args.batch, args.seq, args.seed)
        ids, targets = fpar.device_put((ids_BT, targets_BT), mesh, TOKENS)
        fpar.reset_comm_stats()
        grads, (_, (lm, aux)) = value_fn(params, ids, targets)
        updates, state = opt.update(grads, state, params)
        params = fo.apply_updates(params, updates)
        losses.append(lm.item())
        if step == 0:
            sent = {a: sum(v["bytes"] for v in d.values()) for a, d in fpar.comm_stats().items()}
            say("bytes sent per device per step: " + ", ".join(f"{a} {b:,}" for a, b in sent.items()))
        if (step + 1) % args.log_every == 0 or step == 0:
            counts, dropped = expert_load(args, fpar.gather(params, mesh, specs), probe_BT)
            shown = " | ".join("[" + " ".join(str(v) for v in blk) + "]" for blk in counts)
            per_block = aux.item() / len(counts)
            drops = f" | dropped {dropped}" if args.capacity_factor is not None else ""
            say(
                f"step {step + 1:4d}/{args.steps} | loss {lm.item():.4f} | aux {per_block:.4f} | "
                f"pairs per expert {shown}{drops}"
            )
    secs = time.perf_counter() - t0
    say(
        f"{args.steps} steps in {secs:.1f} s: loss {losses[0]:.3f} -> {losses[-1]:.3f} "
        f"(uniform guess {math.log(VOCAB):.3f}); aux is per MoE block, 1.0 when perfectly balanced"
    )
    val_BT, val_targets_BT = batch_at(val_N, 0, args.batch, args.seq, args.seed + 1)
    with torch.no_grad():
        _, val, _ = step_loss(params, *fpar.device_put((val_BT, val_targets_BT), mesh, TOKENS))
    say(f"held-out loss {val.item():.4f} (the last 5% of the corpus, without the aux loss)")
    return losses


if __name__ == "__main__":
    C.entry(main)
