"""Train a small byte-level GPT with data x tensor parallelism (Megatron 1D, optionally Megatron-SP).

The model is GPT-2 in miniature (pre-LayerNorm blocks, learned positions, tied embedding) built
from ``fpar.ops``: a vocab-parallel embedding, head-parallel attention and column/row MLPs
(Shoeybi et al. 2019, arXiv:1909.08053), and a vocab-parallel cross-entropy whose ``[B, T, 256]``
logits are never gathered.  ``--sequence-parallel`` keeps the activations between the parallel
regions split along the sequence (Korthikanti et al. 2022, arXiv:2205.05198): the same numbers
and the same bytes moved, less activation memory.

The text is, by default, Python's own standard library: the ``.py`` files next to the ``os``
module, read as bytes (vocabulary 256).  ``--data FILE`` trains on any file instead.

The mesh is ``data x tensor``: ``--tp`` (default 2), and data takes the rest of the devices: the
``--devices N`` of an in-process mesh (default 4: data=2 x tensor=2; 2 devices: tensor=2 alone) or,
under torchrun, the world size, one process per device.  Gradients are ``torch.func.grad`` of the
sharded loss, i.e. of the global loss: the data-parallel all-reduce and Megatron's ``f``/``g``
backward all-reduces need no code here.  The optimizer is Adam written as a pair of pure functions
over the parameter pytree.

Before training, the first ``--check-steps`` steps are also run on an unsharded copy of the model
(plain torch, written below) from the same initial weights and batches; the script says whether
the two loss sequences agree and exits non-zero if they do not.

Run:
    python examples/gpt_tensor_parallel.py                        # data=2 x tensor=2, 100 steps
    torchrun --nproc-per-node 4 examples/gpt_tensor_parallel.py   # the same, one process per device
    python examples/gpt_tensor_parallel.py --sample 200           # then generate 200 bytes
    python examples/gpt_tensor_parallel.py --devices 8 --tp 4 --sequence-parallel
    python examples/gpt_tensor_parallel.py --data README.md --steps 300

Shape suffixes (torchtitan style); inside the sharded function they name the per-device block:
    B  batch (BATCH global, BATCH / dp per device)    T  sequence (SEQ)    D  model dim
    V  vocabulary (256 bytes; V / tp per device)
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path
from typing import NamedTuple

import optree
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common.py, next to this file
import _common as C  # noqa: E402

import fpar  # noqa: E402
import fpar.ops as ops  # noqa: E402
from fpar import P  # noqa: E402

VOCAB = 256  # bytes

# ---------------------------------------------------------------------------------------------
# Data: bytes of text, random windows
# ---------------------------------------------------------------------------------------------


def load_corpus(path: str | None, max_bytes: int) -> torch.Tensor:
    """Return the corpus as uint8 token ids: ``path``'s bytes, or the stdlib's own .py sources."""
    if path is not None:
        data = Path(path).read_bytes()[:max_bytes]
        source = path
    else:
        stdlib = Path(os.__file__).parent
        chunks, size = [], 0
        for f in sorted(stdlib.glob("*.py")):
            chunks.append(f.read_bytes())
            size += len(chunks[-1])
            if size >= max_bytes:
                break
        data = b"\n".join(chunks)[:max_bytes]
        source = f"{len(chunks)} .py files of the standard library in {stdlib}"
    C.say(f"corpus: {len(data):,} bytes from {source}")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def batches(tokens_N: torch.Tensor, batch: int, seq: int, seed: int):
    """Yield (ids_BT, targets_BT) forever: random windows, targets shifted by one byte."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        start_B = torch.randint(0, len(tokens_N) - seq - 1, (batch,), generator=gen)
        window_BT = start_B[:, None] + torch.arange(seq + 1)
        chunk = tokens_N[window_BT]
        yield chunk[:, :-1], chunk[:, 1:]


# ---------------------------------------------------------------------------------------------
# The unsharded model, for the parity check: plain torch on global tensors
# ---------------------------------------------------------------------------------------------


def unsharded_loss(params, ids_BT, targets_BT, n_heads: int):
    """The same GPT as fpar.ops.gpt_loss (mean over tokens), with no parallelism at all."""

    def ln(p, x):
        return F.layer_norm(x, x.shape[-1:], p["w"], p["b"], eps=1e-5)

    b, t = ids_BT.shape
    x_BTD = params["w_emb"][ids_BT] + params["w_pos"][:t]
    d = x_BTD.shape[-1]
    for blk in params["blocks"]:
        a, m = blk["attn"], blk["mlp"]
        qkv = ln(blk["ln1"], x_BTD) @ a["w_qkv"].reshape(d, 3 * d) + a["b_qkv"].reshape(3 * d)
        q, k, v = qkv.reshape(b, t, 3, n_heads, d // n_heads).permute(2, 0, 3, 1, 4)  # each B,H,T,K
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x_BTD = x_BTD + o @ a["w_o"] + a["b_o"]
        h = F.gelu(ln(blk["ln2"], x_BTD) @ m["w_in"] + m["b_in"])
        x_BTD = x_BTD + h @ m["w_out"] + m["b_out"]
    logits_BTV = ln(params["ln_f"], x_BTD) @ params["w_emb"].t()
    return F.cross_entropy(logits_BTV.reshape(-1, VOCAB), targets_BT.reshape(-1))


# ---------------------------------------------------------------------------------------------
# Adam as a pair of pure functions (optax style)
# ---------------------------------------------------------------------------------------------


class Optimizer(NamedTuple):
    init: object
    update: object


def adam(lr: float, b1: float = 0.9, b2: float = 0.95, eps: float = 1e-8) -> Optimizer:
    """Adam (Kingma & Ba 2015) over a parameter pytree: ``update(grads, state, params) -> (params, state)``."""

    def init(params):
        zeros = optree.tree_map(torch.zeros_like, params)
        return {"m": zeros, "v": optree.tree_map(torch.zeros_like, params), "t": 0}

    def update(grads, state, params):
        t = state["t"] + 1
        m = optree.tree_map(lambda m, g: b1 * m + (1 - b1) * g, state["m"], grads)
        v = optree.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, state["v"], grads)
        step = lr * math.sqrt(1 - b2**t) / (1 - b1**t)
        params = optree.tree_map(lambda p, m, v: p - step * m / (v.sqrt() + eps), params, m, v)
        return params, {"m": m, "v": v, "t": t}

    return Optimizer(init, update)


def make_step(loss_fn, opt: Optimizer):
    """Return step(params, state, ids, targets) -> (params, state, loss)."""
    grad_and_loss = torch.func.grad_and_value(loss_fn)

    def step(params, state, ids_BT, targets_BT):
        grads, loss = grad_and_loss(params, ids_BT, targets_BT)
        params, state = opt.update(grads, state, params)
        return params, state, loss.detach()

    return step


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="train on this file's bytes (default: the stdlib's .py sources)")
    parser.add_argument("--max-bytes", type=int, default=1_000_000)
    parser.add_argument("--dp", type=int, default=-1, help="data-parallel size (-1: devices / tp)")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size")
    parser.add_argument("--devices", type=int, default=4, help="in-process devices (torchrun: world size)")
    parser.add_argument(
        "--sequence-parallel", action="store_true", help="Megatron-SP between parallel regions"
    )
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=8, help="global batch, divisible by --dp")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--check-steps", type=int, default=3, help="steps compared with an unsharded run")
    parser.add_argument("--sample", type=int, default=0, help="bytes to generate at the end (~0.1 s each)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--log-every", type=int, default=10, help="print the loss every N steps")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    C.start(args.threads)  # under torchrun: join the process group (a real mesh)

    tokens_N = load_corpus(args.data, args.max_bytes)
    split = int(0.95 * len(tokens_N))
    train_N, val_N = tokens_N[:split], tokens_N[split:]

    real = torch.distributed.is_initialized()
    devices = torch.distributed.get_world_size() if real else args.devices
    if devices % args.tp or (args.dp != -1 and args.dp * args.tp != devices):
        raise SystemExit(
            f"--dp {args.dp} x --tp {args.tp} does not fit {devices} devices (--dp -1: the rest)"
        )
    mesh = fpar.make_mesh((args.dp, args.tp), ("data", "tensor"), devices=None if real else devices)
    specs = ops.gpt_specs(args.layers, "tensor")
    inits = ops.init_gpt(VOCAB, args.d_model, args.layers, args.seq)
    params0 = fpar.init(inits, mesh, specs, seed=0)  # this process's blocks; the same values on any mesh
    rows = P("data")  # a batch's rows are split over "data"
    n_params = sum(p.numel() for p in optree.tree_leaves(fpar.gather(params0, mesh, specs)))
    mode = "tensor (Megatron 1D + sequence parallel)" if args.sequence_parallel else "tensor (Megatron 1D)"
    kind = "real: one process per device" if mesh.backend == "dist" else "in-process"
    C.say(
        f"mesh {dict(mesh.shape)} ({kind}): data x {mode}; GPT d={args.d_model} layers={args.layers} "
        f"heads={args.heads} seq={args.seq} vocab={VOCAB}, {n_params:,} parameters; batch {args.batch}"
    )

    def loss_local(params, ids_BT, targets_BT):
        """Per device: mean loss of this data shard's tokens, averaged over "data"."""
        tok_BT = ops.gpt_loss(
            params,
            ids_BT,
            targets_BT,
            axis="tensor",
            n_heads=args.heads,
            sequence_parallel=args.sequence_parallel,
        )
        return fpar.pmean(tok_BT.mean(), "data")  # equal shards: the mean of means is the global mean

    sharded_loss = fpar.shard(loss_local, mesh, in_specs=(specs, rows, rows), out_specs=P())
    opt = adam(args.lr)
    sharded_step = make_step(sharded_loss, opt)

    def step(params, state, ids_BT, targets_BT):  # each process passes its own rows (in-process: all)
        return sharded_step(params, state, *fpar.device_put((ids_BT, targets_BT), mesh, rows))

    # --- Parity: the first steps, sharded and unsharded, from the same weights and batches -----
    k = args.check_steps
    if k > 0:
        ref_step = make_step(lambda p, i, t: unsharded_loss(p, i, t, args.heads), opt)
        whole0 = fpar.gather(params0, mesh, specs)  # the unsharded copy: whole tensors, on every process
        got, want = [], []
        p_s, s_s, p_u, s_u = params0, opt.init(params0), whole0, opt.init(whole0)
        for _, (ids_BT, targets_BT) in zip(range(k), batches(train_N, args.batch, args.seq, seed=1)):
            p_s, s_s, loss_s = step(p_s, s_s, ids_BT, targets_BT)
            p_u, s_u, loss_u = ref_step(p_u, s_u, ids_BT, targets_BT)
            got.append(loss_s)
            want.append(loss_u)
        got, want = torch.stack(got), torch.stack(want)
        diff = (got - want).abs().max().item()
        ok = torch.allclose(got, want, rtol=1e-4, atol=1e-5)
        C.say(
            f"parity check, first {k} steps: sharded {[round(x, 5) for x in got.tolist()]} vs unsharded "
            f"{[round(x, 5) for x in want.tolist()]}: max |diff| {diff:.2e} -> {'OK' if ok else 'MISMATCH'}"
        )
        if not ok:
            raise SystemExit("FAIL: the sharded model does not train like the unsharded one")

    # --- Training --------------------------------------------------------------------------------
    params, state = params0, opt.init(params0)
    fpar.reset_comm_stats()
    t0 = time.perf_counter()
    losses = []
    for i, (ids_BT, targets_BT) in zip(range(args.steps), batches(train_N, args.batch, args.seq, seed=1)):
        params, state, loss = step(params, state, ids_BT, targets_BT)
        losses.append(loss.item())
        if i == 0:
            stats = fpar.comm_stats()  # one step's traffic, per device
        if (i + 1) % args.log_every == 0 or i == 0 or i == args.steps - 1:
            recent = sum(losses[-10:]) / len(losses[-10:])
            n = len(losses[-10:])
            C.say(f"step {i + 1:4d}/{args.steps} | loss {losses[-1]:.4f} | mean of last {n:2d} {recent:.4f}")
    elapsed = time.perf_counter() - t0
    C.say(f"{args.steps} steps in {elapsed:.1f} s ({1000 * elapsed / args.steps:.0f} ms/step)")
    for axis, kinds in stats.items():
        moved = ", ".join(f"{kind} {v['bytes']:,} B in {v['calls']} calls" for kind, v in kinds.items())
        C.say(f"  traffic per device per step over {axis!r}: {moved}")

    # --- Validation and a sample -----------------------------------------------------------------
    with torch.no_grad():
        val_ids, val_targets = fpar.device_put(next(batches(val_N, args.batch, args.seq, seed=2)), mesh, rows)
        C.say(f"held-out loss {sharded_loss(params, val_ids, val_targets).item():.4f}")
        if args.sample > 0:
            C.say("sample:\n" + generate(params, mesh, specs, args, train_N[: args.seq]))


def generate(params, mesh, specs, args, prompt_T) -> str:
    """Sample bytes (temperature 0.8) from the sharded model, which returns vocab-split logits."""
    logits = fpar.shard(
        lambda p, ids: ops.gpt(p, ids, axis="tensor", n_heads=args.heads),
        mesh,
        (specs, P()),
        P(None, None, "tensor"),
    )
    gen = torch.Generator().manual_seed(0)
    ids = prompt_T.tolist()
    for _ in range(args.sample):
        context = torch.tensor([ids[-args.seq :]])
        last_V = fpar.gather(logits(params, context), mesh, P(None, None, "tensor"))[0, -1]  # whole V
        ids.append(torch.multinomial(torch.softmax(last_V / 0.8, -1), 1, generator=gen).item())
    return bytes(ids[len(prompt_T) :]).decode("utf-8", errors="replace")


if __name__ == "__main__":
    C.entry(main)
