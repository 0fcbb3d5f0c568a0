"""Train a Vision Transformer on scikit-learn's digits with data x tensor x pipeline parallelism.

The images are the 1,797 8x8 handwritten digits bundled with scikit-learn (1,500 to train, 297
held out).  Each image is cut into 16 patches of 2x2 pixels, embedded, and a learned class token
is put in front (17 tokens); the blocks are pre-LayerNorm transformer blocks with *non-causal*
attention (``fpar.ops.attention(..., causal=False)`` and ``fpar.ops.mlp``, Megatron 1D); the
class token's final state goes through a LayerNorm and a linear head to 10 classes (Dosovitskiy
et al. 2020, arXiv:2010.11929).  By default on an 8-device in-process mesh,
``pipeline=2 x data=2 x tensor=2``:

* **pipeline** (``fpar.pipeline.pipeline``, 1F1B): the blocks split into 2 stages; the patch
  embedding runs before stage 0's blocks, the head and the loss after the last stage's;
* **tensor**: attention heads and MLP columns split over ``tensor`` inside every stage;
* **data**: each microbatch's images split over ``data``, the loss ``pmean``'d over it.

The optimizer, checkpoints, meters and command line are ``train_gpt.py``'s (see there and
``_common.py``).  Batches are a pure function of the step (a fixed permutation per epoch).

    python examples/train_vit.py                          # ~1 min, ~97% held-out accuracy
    python examples/train_vit.py --single-device          # the same model, no parallelism
    python examples/train_vit.py --parallel "pipeline=1,data=4,tensor=2"
    torchrun --nproc-per-node 8 examples/train_vit.py --steps 20
    torchrun --nproc-per-node 4 examples/train_vit.py --steps 20 --tiny   # pipeline=2 x data=2

With no layout flags the mesh is ``_common.default_layout`` of the devices (``--devices N``
in-process, the world size under torchrun): data, pipeline and tensor get 2 each in that order
while they fit (8: 2 x 2 x 2; 4: pipeline=2 x data=2; 2: data=2).

Shape suffixes; inside ``fpar.shard`` they name the per-device block:
    N images   B batch (B/M per microbatch, /data per device)   M microbatches
    Q patches (16)   R pixels per patch (4)   S tokens (Q + 1)   D model width   C classes (10)
    L layers   K layers per stage
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import NamedTuple

import optree
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common.py, next to this file
import _common as C  # noqa: E402
from _common import DATA, PIPE, TENSOR  # noqa: E402

import fpar  # noqa: E402
import fpar.ops as ops  # noqa: E402
import fpar.optim as fo  # noqa: E402
import fpar.pipeline as pp  # noqa: E402
from fpar import P  # noqa: E402

SIDE, CLASSES, N_TEST = 8, 10, 297
SCHEDULES = {"1f1b": pp.one_f_one_b, "gpipe": pp.gpipe, "zb": pp.zb_h1}


# Data: the digits, in an order that is a function of the step -----------------------------------------


def load_digits(dtype: torch.dtype):
    """``(x_train_N64, y_train_N), (x_test, y_test)``: pixels standardised with the train statistics."""
    from sklearn.datasets import load_digits as sk_digits

    d = sk_digits()
    perm = torch.randperm(len(d.target), generator=torch.Generator().manual_seed(0))  # file is not shuffled
    x_N64 = torch.tensor(d.data, dtype=torch.float64)[perm]
    y_N = torch.tensor(d.target, dtype=torch.int64)[perm]
    mean, std = x_N64[:-N_TEST].mean(), x_N64[:-N_TEST].std()
    x_N64 = ((x_N64 - mean) / std).to(dtype)
    return (x_N64[:-N_TEST], y_N[:-N_TEST]), (x_N64[-N_TEST:], y_N[-N_TEST:])


def batch_at(x_N64: torch.Tensor, y_N: torch.Tensor, step: int, batch: int, seed: int):
    """Step ``step``'s batch: slice ``step`` of epoch ``step // steps_per_epoch``'s permutation."""
    per_epoch = len(y_N) // batch  # the last partial batch of an epoch is dropped
    epoch, i = divmod(step, per_epoch)
    perm = torch.randperm(len(y_N), generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
    idx_B = perm[i * batch : (i + 1) * batch]
    return x_N64[idx_B], y_N[idx_B]


# The model in pipeline pieces ----------------------------------------------------------------------

BLOCK_SPECS = ops.gpt_block_specs(TENSOR)  # a ViT block has a GPT block's parameters
FIRST_SPECS = {"w_patch": P(), "b_patch": P(), "cls": P(), "pos": P()}  # tiny: replicated
LAST_SPECS = {"ln_f": ops.layer_norm_specs(), "w_head": P(), "b_head": P()}
SPECS = {"stages": C.stacked_specs(BLOCK_SPECS), "first": FIRST_SPECS, "last": LAST_SPECS}


def patches(x_B64: torch.Tensor, p: int) -> torch.Tensor:
    """``[B, 64] -> [B, Q, R]``: non-overlapping ``p x p`` patches, row-major."""
    g = SIDE // p
    return x_B64.reshape(-1, g, p, g, p).transpose(2, 3).reshape(-1, g * g, p * p)


def embed(w: dict, x_B64: torch.Tensor, p: int) -> torch.Tensor:
    """Patch embedding + class token + positions: ``[B, 64] -> [B, S, D]``."""
    x_BQD = patches(x_B64, p) @ w["w_patch"] + w["b_patch"]
    cls_B1D = w["cls"].expand(x_BQD.shape[0], 1, -1)
    return torch.cat([cls_B1D, x_BQD], dim=1) + w["pos"]


def vit_block(w: dict, x_BSD: torch.Tensor, n_heads: int, dropout: float = 0.0, key=None) -> torch.Tensor:
    """A pre-LayerNorm block with bidirectional attention: ``[B, S, D] -> [B, S, D]``.

    With ``dropout`` (training): dropout on the attention probabilities and on the attention and
    MLP outputs (``fold_in(key, 0 / 1 / 2)``), masks from ``fpar.random`` (the same at any
    data x tensor layout).
    """
    keys = [fpar.random.fold_in(key, i) for i in range(3)] if dropout else [None] * 3
    x_ln = ops.layer_norm(w["ln1"], x_BSD)
    a = ops.attention(
        w["attn"],
        x_ln,
        axis=TENSOR,
        n_heads=n_heads,
        causal=False,
        dropout=dropout,
        key=keys[0],
        batch_axes=DATA,
    )
    x_BSD = x_BSD + (ops.dropout(keys[1], a, dropout, spec=P(DATA)) if dropout else a)
    h = ops.mlp(w["mlp"], ops.layer_norm(w["ln2"], x_BSD), axis=TENSOR)
    return x_BSD + (ops.dropout(keys[2], h, dropout, spec=P(DATA)) if dropout else h)


def head(w: dict, x_BSD: torch.Tensor) -> torch.Tensor:
    """The class token's logits: ``[B, S, D] -> [B, C]``."""
    return ops.layer_norm(w["ln_f"], x_BSD[:, 0]) @ w["w_head"] + w["b_head"]


def build_step(mesh: fpar.Mesh, schedule, n_heads: int, k: int, patch: int, dropout: float = 0.0):
    """The pipelined training step: ``step(params, xs_MB64, ys_MB, key) -> StepResult``.

    ``key``: this step's ``fpar.random`` key.  The pipeline executor hands microbatch ``j`` the key
    ``key_j = fold_in(key, j)`` (the embedding's dropout uses it) and chunk ``c`` (in model order)
    ``fold_in(key_j, c)``, whose block ``i`` uses ``fold_in(., i)``: every microbatch, chunk and
    block draws its own masks, and they do not depend on the data x tensor layout.
    """
    sub = mesh.submesh((DATA, TENSOR))
    rows = P(DATA)

    def blocks(w, x_BSD, key):  # one stage: its K blocks, each leaf of w stacked [K, ...]
        for i in range(k):
            x_BSD = vit_block(
                optree.tree_map(lambda t, i=i: t[i], w), x_BSD, n_heads, dropout, fpar.random.fold_in(key, i)
            )
        return x_BSD

    def embed_drop(w, x, key):
        x_BSD = embed(w, x, patch)
        return ops.dropout(key, x_BSD, dropout, spec=rows) if dropout else x_BSD

    def loss(w, x_BSD, y_B):
        return fpar.pmean(F.cross_entropy(head(w, x_BSD), y_B), DATA)

    stage_k = fpar.shard(blocks, sub, (C.stacked_specs(BLOCK_SPECS, pipe_dim=False), rows, P()), rows)
    first_k = fpar.shard(embed_drop, sub, (FIRST_SPECS, rows, P()), rows)
    last = fpar.shard(loss, sub, (LAST_SPECS, rows, rows), P())
    run = pp.pipeline(stage_k, schedule, mesh, loss=last, first=first_k, axis=PIPE)

    def step(params, xs_MB64, ys_MB, key):
        return run(params, xs_MB64, ys_MB, key=key)

    return step


def init_params(args, mesh: fpar.Mesh, dtype: torch.dtype) -> dict:
    """The ViT's parameters in the pipeline's layout (the same values on every mesh), as blocks."""
    d, q, r = args.d_model, (SIDE // args.patch) ** 2, args.patch**2
    out_std = 0.02 / math.sqrt(2 * args.layers)
    inits = {
        "first": {
            "w_patch": fpar.normal((r, d), std=r**-0.5, dtype=dtype),
            "b_patch": fpar.zeros((d,), dtype=dtype),
            "cls": fpar.normal((d,), std=0.02, dtype=dtype),
            "pos": fpar.normal((q + 1, d), std=0.02, dtype=dtype),
        },
        "blocks": [ops.init_gpt_block(d, out_std=out_std, dtype=dtype) for _ in range(args.layers)],
        "last": {
            "ln_f": ops.init_layer_norm(d, dtype=dtype),
            "w_head": fpar.normal((d, CLASSES), std=0.02, dtype=dtype),
            "b_head": fpar.zeros((CLASSES,), dtype=dtype),
        },
    }
    vit = fpar.init(inits, mesh, P(), seed=args.seed)  # whole on every process (tiny), then cut
    s = mesh.shape[PIPE]
    stacked = optree.tree_map(
        lambda *ws: torch.stack(ws).unflatten(0, (s, -1)), *vit["blocks"]
    )  # [S, K, ...]
    return fpar.device_put({"stages": stacked, "first": vit["first"], "last": vit["last"]}, mesh, SPECS)


def model_flops(args) -> tuple[int, float]:
    """(parameters, training FLOPs per image): 6 per weight per token it multiplies + attention."""
    d, L, q, r = args.d_model, args.layers, (SIDE // args.patch) ** 2, args.patch**2
    s = q + 1
    n_params = L * (12 * d * d + 13 * d) + r * d + d + d + s * d + 2 * d + d * CLASSES + CLASSES
    flops = 6 * (L * 12 * d * d * s + r * d * q + d * CLASSES) + 12 * L * s * s * d
    return n_params, flops


# Training ----------------------------------------------------------------------------------------------


class Result(NamedTuple):
    losses: list  # every step's training loss (from the checkpoint's history too, on --resume)
    seconds: float  # wall time of this run's steps
    images_per_s: float
    mfu: float
    comm: dict  # bytes sent per step, per mesh axis
    accuracy: float  # on the 297 held-out images
    val_loss: float  # the mean cross-entropy on them


def main(argv=None) -> Result:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--patch", type=int, default=4, choices=(1, 2, 4, 8), help="patch side in pixels")
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--tiny", action="store_true", help="a very small model (smoke tests, torchrun on CPU)")
    ap.add_argument(
        "--dropout", type=float, default=0.1, help="dropout (0.1 as in Colossal-AI's ViT tutorial)"
    )
    C.add_args(ap, steps=200, batch=64, lr=5e-3, warmup=20)
    args = ap.parse_args(argv)
    if args.tiny:
        args.d_model, args.layers, args.heads, args.patch, args.batch = 32, 2, 2, 4, 16
    C.start(args.threads)
    quiet, dtype = args.quiet, C.DTYPES[args.dtype]
    ckpt_dir = args.ckpt_dir or "checkpoints/train_vit"

    # --- Mesh, data, model ---------------------------------------------------------------------
    mesh = C.build_mesh(args)
    s, m = mesh.shape[PIPE], C.microbatches(args, mesh)
    if args.layers % s:
        raise SystemExit(f"--layers {args.layers} must divide over {s} pipeline stages")
    (x_train, y_train), (x_test, y_test) = load_digits(dtype)
    n_params, flops_per_image = model_flops(args)
    n_tokens = (SIDE // args.patch) ** 2 + 1
    peak = C.peak_flops(args, mesh, dtype)
    C.say(
        f"mesh {dict(mesh.shape)} ({'real: one process per device' if mesh.backend == 'dist' else 'in-process'}); "
        f"ViT d={args.d_model} layers={args.layers} heads={args.heads} patches {args.patch}x{args.patch} "
        f"({n_tokens} tokens with the class token): {n_params:,} parameters; digits {len(y_train)} train / "
        f"{len(y_test)} test; batch {args.batch} = {m} microbatches, {args.schedule} schedule",
        quiet=quiet,
    )
    C.say(f"peak {peak / 1e9:.1f} GFLOP/s ({C.flops_note(args, mesh)}), {args.dtype}", quiet=quiet)

    step_fn = build_step(
        mesh, SCHEDULES[args.schedule](s, m), args.heads, args.layers // s, args.patch, args.dropout
    )
    run_key = fpar.random.key(args.seed)  # dropout: step t uses fold_in(run_key, t)
    params = init_params(args, mesh, dtype)
    warmup = min(args.warmup, args.steps // 2)
    lr = fo.warmup_cosine(args.lr, warmup, args.steps, end=args.lr / 10)
    opt = fo.chain(fo.clip_by_global_norm(args.clip), fo.adamw(lr, weight_decay=args.weight_decay))
    layout = fo.zero_layout(params, mesh, SPECS, stage=0, data_axis=DATA)  # stage 0: plain data parallel
    params, opt_state = fo.zero_init(opt, params, layout)
    update = fo.zero_update(opt, layout)  # AdamW on every device's blocks, inside fpar.shard
    state_specs = layout.state_specs(opt)

    start, losses = 0, []
    if args.resume and fpar.checkpoint.latest_step(ckpt_dir) is not None:
        start, params, opt_state, losses, run_key = C.restore(
            ckpt_dir, params, opt_state, mesh, SPECS, state_specs, key=run_key
        )
        C.say(f"resumed from {ckpt_dir} at step {start}", quiet=quiet)
    elif args.resume:
        C.say(f"--resume: no checkpoint in {ckpt_dir}; starting at step 0", quiet=quiet)
    stop = min(args.steps, args.stop_after or args.steps)

    # --- Training loop -------------------------------------------------------------------------
    bar = C.Bar(args.steps, start, enabled=not quiet)
    p2p = C.p2p_bytes(mesh, args.batch // mesh.shape[DATA], n_tokens * args.d_model, dtype.itemsize)
    seconds, comm = [], {}
    for step in range(start, stop):
        x_B64, y_B = batch_at(x_train, y_train, step, args.batch, args.seed)
        xs_MB64 = fpar.device_put(x_B64.unflatten(0, (m, -1)), mesh, P(None, DATA))  # this process's rows
        ys_MB = fpar.device_put(y_B.unflatten(0, (m, -1)), mesh, P(None, DATA))
        fpar.reset_comm_stats()
        t0 = time.perf_counter()
        res = step_fn(params, xs_MB64, ys_MB, fpar.random.fold_in(run_key, step))
        grads = res.grads
        params, opt_state = update(grads, opt_state, params)
        seconds.append(time.perf_counter() - t0)
        comm = C.comm_bytes(p2p)
        losses.append(res.loss.item())
        img_s = args.batch / seconds[-1]
        bar.update(step, f"loss {losses[-1]:.3f} {img_s:.0f} img/s")
        if (step + 1) % args.log_every == 0 or step == start or step + 1 == stop:
            util = C.mfu(flops_per_image * args.batch, seconds[-1], peak)
            bar.write(
                f"step {step + 1:4d}/{args.steps} | loss {losses[-1]:.4f} | {img_s:.0f} img/s | "
                f"MFU {100 * util:.2f}% | {1000 * seconds[-1]:.0f} ms | sent {C.fmt_bytes(sum(comm.values()))}"
            )
        if step == start:
            bar.write(f"bytes sent per step, per mesh axis: {C.fmt_comm(comm)}; {C.COMM_NOTE[mesh.backend]}")
        if step + 1 == args.steps or (args.ckpt_every and (step + 1) % args.ckpt_every == 0):
            C.save(ckpt_dir, step + 1, params, opt_state, losses, mesh, SPECS, state_specs, key=run_key)
    bar.close()

    # --- Summary, evaluation, plot ---------------------------------------------------------------
    timed = seconds[1:] or seconds  # the first step pays one-off costs
    mean_s = sum(timed) / len(timed) if timed else math.nan
    whole = fpar.gather(params, mesh, SPECS)  # every process gets the whole model (tiny)
    accuracy, val_loss = evaluate(args, whole, x_test, y_test)
    result = Result(
        losses,
        sum(seconds),
        args.batch / mean_s,
        C.mfu(flops_per_image * args.batch, mean_s, peak),
        comm,
        accuracy,
        val_loss,
    )
    if seconds:
        C.say(
            f"{len(seconds)} steps in {sum(seconds):.1f} s: loss {losses[start]:.3f} -> {losses[-1]:.3f} "
            f"(uniform guess {math.log(CLASSES):.3f}); {result.images_per_s:.0f} images/s, "
            f"MFU {100 * result.mfu:.2f}%",
            quiet=quiet,
        )
        C.say(
            f"bytes sent per step, per mesh axis: {C.fmt_comm(comm)}; {C.COMM_NOTE[mesh.backend]}",
            quiet=quiet,
        )
    C.say(f"held-out loss {val_loss:.4f}, accuracy {100 * accuracy:.1f}% ({len(y_test)} images)", quiet=quiet)
    if args.plot != "none" and losses and not quiet:
        C.plot_losses(losses, args.plot or f"{ckpt_dir}/loss.png", f"train_vit {dict(mesh.shape)}")
    return result


def evaluate(args, params: dict, x_N64: torch.Tensor, y_N: torch.Tensor) -> tuple[float, float]:
    """Held-out (accuracy, loss) of the whole model, unpipelined, on one in-process device."""
    one = fpar.make_mesh((1, 1), (DATA, TENSOR), backend="local")
    specs = {"stages": C.stacked_specs(BLOCK_SPECS, pipe_dim=False), "first": FIRST_SPECS, "last": LAST_SPECS}

    def logits(w, x_N64):
        x_NSD = embed(w["first"], x_N64, args.patch)
        for i in range(args.layers):
            x_NSD = vit_block(optree.tree_map(lambda t, i=i: t[i], w["stages"]), x_NSD, args.heads)
        return head(w["last"], x_NSD)

    flat = {**params, "stages": optree.tree_map(lambda t: t.flatten(0, 1), params["stages"])}  # [L, ...]
    with torch.no_grad():
        logits_NC = fpar.shard(logits, one, (specs, P()), P())(flat, x_N64)
    return (logits_NC.argmax(-1) == y_N).double().mean().item(), F.cross_entropy(logits_NC, y_N).item()


if __name__ == "__main__":
    C.entry(main)
