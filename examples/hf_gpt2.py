"""Train a randomly initialised Hugging Face GPT-2, as it is, with data x tensor parallelism.

The model is ``transformers.GPT2LMHeadModel`` (byte-level: vocabulary 256), unmodified:
``fpar.ops.tensor_parallel`` makes it Megatron tensor parallel (each device holds 1/tensor of the
attention and MLP weights and runs heads/tensor heads; the embedding and tied head are split over
the vocabulary, and HF's ``labels=`` loss runs as fpar's vocab-parallel cross-entropy), and
``fpar.shard`` splits each batch's rows over ``data``.  AdamW (``fpar.optim``) updates each
device's blocks.  The corpus is Python's standard library sources (as ``train_gpt.py``).

At the end (``--export DIR``) the sharded parameters are checkpointed, merged into one
``model.safetensors`` with GPT-2's ``c_attn`` put back in ``[q|k|v]`` order, and loaded back with
``GPT2LMHeadModel.from_pretrained(DIR)``: the held-out loss is the same.

    python examples/hf_gpt2.py                       # in-process mesh data=2 x tensor=2
    python examples/hf_gpt2.py --data-size 1 --tensor-size 4
    python examples/hf_gpt2.py --devices 2           # tensor=2 alone
    torchrun --nproc-per-node 4 examples/hf_gpt2.py --steps 20   # a real mesh, data=2 x tensor=2

The mesh is ``data x tensor``: ``--tensor-size`` (default 2), data the rest of the devices
(``--devices`` in-process, the world size under torchrun).

Needs ``pip install fpar[hf,examples]``.  Shapes: B batch rows (B/data per device), T sequence.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common.py and train_gpt.py, next to this file
import _common as C  # noqa: E402
from train_gpt import batch_at, load_corpus  # noqa: E402

import fpar  # noqa: E402
import fpar.optim as fo  # noqa: E402
from fpar import P  # noqa: E402


@dataclasses.dataclass
class Result:
    losses: list
    val_loss: float
    exported_val_loss: float | None
    tokens_per_s: float


def build_model(args):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=256,
        n_positions=args.seq,
        n_embd=args.d_model,
        n_layer=args.layers,
        n_head=args.heads,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )  # dropout off: the per-device forward draws no random numbers
    torch.manual_seed(args.seed)
    return GPT2LMHeadModel(config).eval()


def main(argv=None) -> Result:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=16, help="global batch rows per step")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--data-size", type=int, default=-1, help="data axis (-1: devices / tensor)")
    ap.add_argument("--tensor-size", type=int, default=2)
    ap.add_argument("--devices", type=int, default=4, help="in-process devices (torchrun: the world size)")
    ap.add_argument("--max-bytes", type=int, default=1_000_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--export", help="write a from_pretrained directory here at the end, and check it")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    C.start(args.threads)
    real = torch.distributed.is_available() and torch.distributed.is_initialized()
    devices = torch.distributed.get_world_size() if real else args.devices
    if devices % args.tensor_size or args.data_size not in (-1, devices // args.tensor_size):
        raise SystemExit(
            f"--data-size {args.data_size} x --tensor-size {args.tensor_size} does not fit {devices} devices "
            "(--data-size -1: the rest)"
        )
    shape = (args.data_size, args.tensor_size)
    mesh = fpar.make_mesh(shape, ("data", "tensor"), devices=None if real else devices)
    rows = P("data")  # a batch's rows are split over "data"; each process passes its own

    tokens_N, source = load_corpus(None, args.max_bytes)
    split = int(0.95 * len(tokens_N))
    model = build_model(args)
    apply_fn, params, specs = fpar.ops.tensor_parallel(model, mesh)
    params = fpar.device_put(params, mesh, specs)  # this process's blocks (in-process: as they are)
    C.say(
        f"GPT2LMHeadModel, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, on {mesh}; "
        f"corpus: {source}",
        quiet=args.quiet,
    )

    def per_device(p, ids_BT):
        return fpar.pmean(apply_fn(p, ids_BT, labels=ids_BT, use_cache=False).loss, "data")

    loss_fn = fpar.shard(per_device, mesh, (specs, rows), P())
    value_and_grad = torch.func.grad_and_value(loss_fn)
    opt = fo.adamw(fo.warmup_cosine(args.lr, max(1, args.steps // 10), args.steps), weight_decay=0.01)
    state = opt.init(params)

    losses, t0 = [], time.perf_counter()
    bar = C.Bar(args.steps, 0, enabled=not args.quiet)
    for step in range(args.steps):
        ids_BT, _ = batch_at(tokens_N[:split], step, args.batch, args.seq, args.seed)
        grads, loss = value_and_grad(params, fpar.device_put(ids_BT, mesh, rows))
        updates, state = opt.update(grads, state, params)
        params = fo.apply_updates(params, updates)
        losses.append(float(loss))
        bar.update(step, f"loss {losses[-1]:.3f}")
        if (step + 1) % args.log_every == 0 or step == 0 or step + 1 == args.steps:
            bar.write(f"step {step + 1:4d}/{args.steps} | loss {losses[-1]:.4f}")
    bar.close()
    tok_s = args.steps * args.batch * args.seq / (time.perf_counter() - t0)

    val_BT, _ = batch_at(tokens_N[split:], 0, args.batch, args.seq, args.seed + 1)
    with torch.no_grad():
        val = float(loss_fn(params, fpar.device_put(val_BT, mesh, rows)))
    C.say(
        f"{args.steps} steps: loss {losses[0]:.3f} -> {losses[-1]:.3f} (uniform guess 5.545); "
        f"{tok_s:.0f} tokens/s",
        quiet=args.quiet,
    )
    C.say(f"held-out loss {val:.4f}", quiet=args.quiet)
    exported = export(args.export, params, mesh, specs, apply_fn, model, val_BT) if args.export else None
    if exported is not None:
        C.say(f"from_pretrained({args.export!r}): held-out loss {exported:.4f}", quiet=args.quiet)
    return Result(losses, val, exported, tok_s)


def export(directory: str, params, mesh, specs, apply_fn, model, val_BT) -> float:
    """Checkpoint the sharded parameters, merge them into HF's layout, reload: the held-out loss."""
    out = Path(directory)
    fpar.checkpoint.save(out / "fpar", params, mesh, specs, step=0)
    if C.rank() == 0:
        fpar.checkpoint.merge(out / "fpar", out / "model.safetensors", transform=apply_fn.export)
        model.config.save_pretrained(out)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    loaded = type(model).from_pretrained(out, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = loaded(val_BT, use_cache=False).logits[:, :-1]
        return float(torch.nn.functional.cross_entropy(logits.reshape(-1, 256), val_BT[:, 1:].reshape(-1)))


if __name__ == "__main__":
    C.entry(main)
