"""Train a byte-level GPT on real text with data x tensor x pipeline parallelism (fpar's flagship).

The model is GPT-2 in miniature (``fpar.ops``: pre-LayerNorm blocks, learned positions, an untied
head) on bytes (vocabulary 256) of Python's own standard library sources, or ``--data FILE``.
By default it runs on an 8-device in-process mesh, ``pipeline=2 x data=2 x tensor=2``:

* **pipeline** (``fpar.pipeline.pipeline``, 1F1B by default): the layers are split into 2 stages;
  the embedding runs before stage 0's blocks, the final LayerNorm, head and loss after stage 1's.
  Each global batch is cut into ``2 x stages`` microbatches.
* **tensor** (Megatron 1D) inside every stage: attention heads and MLP columns split over
  ``tensor``, the embedding and the head split over the vocabulary (the ``[B, T, 256]`` logits
  never exist whole on a device).
* **data**: each microbatch's rows are split over ``data``; the loss is ``pmean``'d over it.

AdamW (``fpar.optim``) with linear warmup and cosine decay and gradient clipping by the global
norm runs inside ``fpar.shard`` over the whole mesh (``fpar.optim.zero_update``, stage 0), so the
norm is the norm of the whole model however it is split; ``--zero 1`` splits the AdamW state
over ``data``, ``--zero 3`` the weights too.  Batches are a pure function of the step, so
``--resume`` from a checkpoint reproduces the uninterrupted run's losses exactly; the checkpoint
holds the model's layout (layers stacked, split over ``pipeline``; ZeRO state as the blocks its
chunks are cut from), so a run can resume on another mesh, or ``--single-device``: under
``torchrun --nnodes 1:2`` a job that loses or gains a node continues on the layout that fits
(``tests/test_elastic.py``).  Checkpoints are written in the background
(``fpar.checkpoint.save(..., blocking=False)``) while the next steps run.
``--compute-dtype bfloat16`` computes the layers in bfloat16 on float32 master weights (the stages
send bfloat16 activations; the loss accumulates in float32); ``--sums native`` then sums the
tensor-parallel all-reduces in bfloat16 as Megatron-LM does (``fpar.low_precision_sums``), where
fpar's default sums them in float32, rounded once.

Meters: tokens/s; MFU = model FLOPs per step (6 per weight per token, plus PaLM's attention term
12 L T D per token) / step time / the peak: one device's FLOP/s (a 512x512 matmul measured at
start-up by rank 0 alone, or ``--peak-tflops``) times the devices computing at once (processes
sharing cores count once per core; in-process, one); the peak used is printed; bytes sent per step per mesh axis, from
``fpar.comm_stats()`` (reset every step) plus the pipeline's point-to-point sends, which the
example counts itself.  At the end: a held-out loss, a sample, and the loss curve as a PNG.

The same file runs under torchrun, one process per device (a real mesh over gloo/NCCL):

    python examples/train_gpt.py                                  # 8 in-process devices, ~2 min
    python examples/train_gpt.py --single-device                  # the same model, no parallelism
    python examples/train_gpt.py --parallel "pipeline=2,data=1,tensor=4"
    python examples/train_gpt.py --config "dict(pipeline=2, tensor=dict(size=2, mode='1d'))"
    python examples/train_gpt.py --steps 400 --resume             # continue the last run
    torchrun --nproc-per-node 8 examples/train_gpt.py --steps 20 --tiny
    torchrun --nproc-per-node 4 examples/train_gpt.py --steps 20 --tiny   # pipeline=2 x data=2

With no layout flags the mesh is ``_common.default_layout`` of the devices: data, pipeline and
tensor get 2 each in that order while they fit (8: 2 x 2 x 2; 4: pipeline=2 x data=2; 2: data=2).

Shape suffixes (torchtitan style); inside ``fpar.shard`` they name the per-device block:
    N corpus bytes   M microbatches   B batch rows (B/M per microbatch, /data per device)
    T sequence       D model width    V vocabulary (256; V/tensor per device)   L layers
    S pipeline stages, K = L/S layers per stage
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

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common.py, next to this file
import _common as C  # noqa: E402
from _common import DATA, PIPE, TENSOR  # noqa: E402

import fpar  # noqa: E402
import fpar.ops as ops  # noqa: E402
import fpar.optim as fo  # noqa: E402
import fpar.pipeline as pp  # noqa: E402
from fpar import P  # noqa: E402

VOCAB = 256  # bytes
SCHEDULES = {"1f1b": pp.one_f_one_b, "gpipe": pp.gpipe, "zb": pp.zb_h1}


# Data: bytes of text, windows chosen by the step number ----------------------------------------------


def load_corpus(path: str | None, max_bytes: int) -> tuple[torch.Tensor, str]:
    """The corpus as token ids ``[N]``: ``path``'s bytes, or the standard library's ``.py`` files."""
    if path is not None:
        return torch.frombuffer(
            bytearray(Path(path).read_bytes()[:max_bytes]), dtype=torch.uint8
        ).long(), path
    stdlib = Path(os.__file__).parent
    chunks, size = [], 0
    for f in sorted(stdlib.glob("*.py")):
        chunks.append(f.read_bytes())
        size += len(chunks[-1])
        if size >= max_bytes:
            break
    data = b"\n".join(chunks)[:max_bytes]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long(), f"{len(chunks)} .py files in {stdlib}"


def batch_at(tokens_N: torch.Tensor, step: int, batch: int, seq: int, seed: int):
    """Step ``step``'s batch ``(ids_BT, targets_BT)``: random windows drawn from (seed, step) alone."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    start_B = torch.randint(0, len(tokens_N) - seq - 1, (batch,), generator=g)
    window_BT = tokens_N[start_B[:, None] + torch.arange(seq + 1)]
    return window_BT[:, :-1], window_BT[:, 1:]


# The model in pipeline pieces --------------------------------------------------------------------

BLOCK_SPECS = ops.gpt_block_specs(TENSOR)
FIRST_SPECS = {"w_emb": P(TENSOR, None), "w_pos": P()}  # vocab-parallel embedding
LAST_SPECS = {"ln_f": ops.layer_norm_specs(), "w_head": P(None, TENSOR)}  # vocab-parallel head
SPECS = {"stages": C.stacked_specs(BLOCK_SPECS), "first": FIRST_SPECS, "last": LAST_SPECS}


def build_step(mesh: fpar.Mesh, schedule, n_heads: int, k: int, dropout: float = 0.0, compute=None):
    """The pipelined training step: ``step(params, xs_MBT, targets_MBT, key) -> StepResult``.

    ``compute``: the dtype the layers compute in (``None``: the parameters'); the parameters stay
    in theirs (float32 masters with bfloat16 compute: each layer casts its weights, the stages
    send bfloat16 activations, the loss accumulates in float32).

    ``key`` is this step's ``fpar.random`` key for GPT-2's dropout (``dropout > 0``).  The pipeline
    executor hands microbatch ``j`` the key ``key_j = fold_in(key, j)`` (the embedding's dropout
    uses it) and chunk ``c`` (in model order) ``fold_in(key_j, c)``, whose block ``i`` uses
    ``fold_in(., i)``: every microbatch, chunk and block draws its own masks, and they do not
    depend on the data or tensor layout.
    """
    sub = mesh.submesh((DATA, TENSOR))  # each stage's devices
    rows = P(DATA)

    def cast(tree):
        return tree if compute is None else optree.tree_map(lambda t: t.to(compute), tree)

    def embed(w, ids_BT, key):  # stage 0, before its blocks: [B, T] -> [B, T, D]
        w = cast(w)
        x_BTD = ops.vocab_embedding(ids_BT, w["w_emb"], axis=TENSOR)
        x_BTD = x_BTD + w["w_pos"][: ids_BT.shape[1]]
        return ops.dropout(key, x_BTD, dropout, spec=rows) if dropout else x_BTD

    def blocks(w, x_BTD, key):  # one stage: its K blocks, each leaf of w stacked [K, ...]
        for i in range(k):
            layer = cast(optree.tree_map(lambda t, i=i: t[i], w))
            drop = dict(dropout=dropout, key=fpar.random.fold_in(key, i), batch_axes=DATA) if dropout else {}
            x_BTD = ops.gpt_block(layer, x_BTD, axis=TENSOR, n_heads=n_heads, **drop)
        return x_BTD

    def head_loss(w, x_BTD, targets_BT):  # the last stage, after its blocks: mean next-byte loss
        w = cast(w)
        logits_BTV = ops.column_linear(ops.layer_norm(w["ln_f"], x_BTD), w["w_head"], axis=TENSOR)
        ce_BT = ops.vocab_cross_entropy(logits_BTV, targets_BT, axis=TENSOR)
        return fpar.pmean((ce_BT if compute is None else ce_BT.float()).mean(), DATA)

    stage_k = fpar.shard(blocks, sub, (C.stacked_specs(BLOCK_SPECS, pipe_dim=False), rows, P()), rows)
    first_k = fpar.shard(embed, sub, (FIRST_SPECS, rows, P()), rows)
    loss = fpar.shard(head_loss, sub, (LAST_SPECS, rows, rows), P())

    run = pp.pipeline(stage_k, schedule, mesh, loss=loss, first=first_k, axis=PIPE)

    def step(params, xs_MBT, targets_MBT, key):
        return run(params, xs_MBT, targets_MBT, key=key)

    return step


def init_params(args, mesh: fpar.Mesh, dtype: torch.dtype) -> dict:
    """The GPT's parameters in the pipeline's layout, as this process's blocks.

    ``fpar.init`` draws values that depend only on the seed (not the mesh), so every layout, and
    ``--single-device``, starts from the same model.  The tiny model is drawn whole, then cut.
    """
    s = mesh.shape[PIPE]
    gpt = fpar.init(
        ops.init_gpt(VOCAB, args.d_model, args.layers, args.seq, tied=False, dtype=dtype),
        mesh,
        P(),
        seed=args.seed,
    )
    stacked = optree.tree_map(
        lambda *ws: torch.stack(ws).unflatten(0, (s, -1)), *gpt["blocks"]
    )  # [S, K, ...]
    params = {
        "stages": stacked,
        "first": {"w_emb": gpt["w_emb"], "w_pos": gpt["w_pos"]},
        "last": {"ln_f": gpt["ln_f"], "w_head": gpt["w_head"]},
    }
    return fpar.device_put(params, mesh, SPECS)


def as_gpt(params: dict) -> dict:
    """Whole parameters in the pipeline layout -> ``fpar.ops.gpt``'s layout (for evaluation)."""
    layers = optree.tree_map(lambda t: t.flatten(0, 1), params["stages"])
    n = optree.tree_leaves(layers)[0].shape[0]
    blocks = [optree.tree_map(lambda t, i=i: t[i], layers) for i in range(n)]
    return {**params["first"], "blocks": blocks, **params["last"]}


def model_flops(args) -> tuple[int, float]:
    """(parameters, training FLOPs per token): 6 per weight (not the embedding lookups) + attention."""
    d, L, T = args.d_model, args.layers, args.seq
    per_block = 12 * d * d + 13 * d  # qkv + out + 2 x (d x 4d) weights, biases, LayerNorms
    n_params = L * per_block + VOCAB * d + T * d + 2 * d + d * VOCAB
    n_matmul = L * 12 * d * d + d * VOCAB  # weights that multiply every token
    return n_params, 6 * n_matmul + 12 * L * T * d  # PaLM's attention term (scores + values, fwd + bwd)


# ZeRO ----------------------------------------------------------------------------------------------------


class Zero:
    """A ZeRO layout's conversions: to the model layout (for checkpoints, evaluation) and back."""

    def __init__(self, opt, layout, params):
        self.opt, self.layout, self.mesh = opt, layout, layout.mesh
        self.model_specs = fo.zero_layout(params, self.mesh, SPECS, stage=0, data_axis=DATA).state_specs(opt)
        self.specs = layout.state_specs(opt)
        self.shapes = C.block_shapes(params, self.mesh, SPECS)  # each parameter's block
        self.which = C.mirrors(opt, params)  # which parameter each state leaf mirrors

    def params(self, params):
        """The parameters in the model layout (stage 3 all-gathers its chunks)."""
        return fo.zero_params(params, self.layout)

    def grads(self, grads):
        """The pipeline's gradient (summed over data) in the form the stage's update takes."""
        return (
            grads if self.layout.stage == 0 else C.to_chunks(grads, self.mesh, SPECS, self.layout.chunk_specs)
        )

    def model_form(self, params, opt_state):
        if self.layout.stage == 0:
            return params, opt_state
        state = C.from_chunks(opt_state, self.mesh, self.specs, self.model_specs, self.shapes, self.which)
        return self.params(params), state

    def zero_form(self, params, opt_state):
        if self.layout.stage == 0:
            return params, opt_state
        if self.layout.stage == 3:
            params = C.to_chunks(params, self.mesh, SPECS, self.layout.param_specs)
        return params, C.to_chunks(opt_state, self.mesh, self.model_specs, self.specs, self.which)


# Training ----------------------------------------------------------------------------------------------


class Result(NamedTuple):
    losses: list  # every step's training loss (from the checkpoint's history too, on --resume)
    seconds: float  # wall time of this run's steps
    tokens_per_s: float
    mfu: float
    comm: dict  # bytes sent per device per step, per mesh axis


def main(argv=None) -> Result:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", help="train on this file's bytes (default: the standard library's .py files)")
    ap.add_argument("--max-bytes", type=int, default=2_000_000)
    ap.add_argument("--d-model", type=int, default=96)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--sample", type=int, default=200, help="bytes to generate at the end")
    ap.add_argument("--prompt", default="def ", help="the sample's first bytes")
    ap.add_argument("--tiny", action="store_true", help="a very small model (smoke tests, torchrun on CPU)")
    ap.add_argument(
        "--dropout", type=float, default=0.0, help="GPT-2 dropout (GPT-2 used 0.1); fpar.random masks"
    )
    ap.add_argument(
        "--compute-dtype",
        choices=("float32", "bfloat16"),
        help="the dtype the layers compute in (default: --dtype's); bfloat16 keeps float32 master weights",
    )
    ap.add_argument(
        "--sums",
        default="float32",
        choices=("float32", "native"),
        help="bf16 sums over devices in float32, rounded once (fpar's rule) or in bf16 (Megatron's): "
        "fpar.low_precision_sums",
    )
    ap.add_argument(
        "--zero",
        type=int,
        default=0,
        choices=(0, 1, 3),
        help="ZeRO: 1 splits the AdamW state over data, 3 the weights too",
    )
    C.add_args(ap, steps=150, batch=32, lr=3e-3, warmup=15)
    args = ap.parse_args(argv)
    if args.tiny:
        args.d_model, args.layers, args.heads, args.seq, args.batch = 32, 2, 2, 16, 8
        args.max_bytes, args.sample = min(args.max_bytes, 200_000), min(args.sample, 40)
    C.start(args.threads)
    quiet = args.quiet
    dtype = C.DTYPES[args.dtype]
    ckpt_dir = args.ckpt_dir or "checkpoints/train_gpt"

    # --- Mesh, data, model ---------------------------------------------------------------------
    mesh = C.build_mesh(args)
    s, m = mesh.shape[PIPE], C.microbatches(args, mesh)
    if args.layers % s:
        raise SystemExit(f"--layers {args.layers} must divide over {s} pipeline stages")
    tokens_N, source = load_corpus(args.data, args.max_bytes)
    split = int(0.95 * len(tokens_N))
    train_N, val_N = tokens_N[:split], tokens_N[split:]
    n_params, flops_per_token = model_flops(args)
    tokens_per_step = args.batch * args.seq
    compute = None if args.compute_dtype in (None, args.dtype) else getattr(torch, args.compute_dtype)
    peak = C.peak_flops(args, mesh, compute or dtype)  # the layers' matmuls run in the compute dtype
    C.say(f"corpus: {len(tokens_N):,} bytes from {source}", quiet=quiet)
    C.say(
        f"mesh {dict(mesh.shape)} ({'real: one process per device' if mesh.backend == 'dist' else 'in-process'}); "
        f"GPT d={args.d_model} layers={args.layers} heads={args.heads} seq={args.seq} vocab={VOCAB}: "
        f"{n_params:,} parameters; batch {args.batch} = {m} microbatches, {args.schedule} schedule",
        quiet=quiet,
    )
    precision = args.dtype + (f", {args.compute_dtype} compute, {args.sums} sums" if compute else "")
    C.say(f"peak {peak / 1e9:.1f} GFLOP/s ({C.flops_note(args, mesh, peak)}), {precision}", quiet=quiet)

    fpar.low_precision_sums(args.sums)  # for the whole run
    step_fn = build_step(
        mesh, SCHEDULES[args.schedule](s, m), args.heads, args.layers // s, args.dropout, compute
    )
    run_key = fpar.random.key(args.seed)  # dropout: step t uses fold_in(run_key, t)
    params = init_params(args, mesh, dtype)
    warmup = min(args.warmup, args.steps // 2)
    lr = fo.warmup_cosine(args.lr, warmup, args.steps, end=args.lr / 10)
    opt = fo.chain(fo.clip_by_global_norm(args.clip), fo.adamw(lr, b2=0.95, weight_decay=args.weight_decay))
    # --zero 0: plain data parallel (AdamW on every device's blocks); 1: the AdamW state split
    # over data; 3: the parameters too, gathered for each step.  The pipeline's backward sums the
    # gradients over data already, so ZeRO-1 runs as stage 2's update (the same state).
    stage = {0: 0, 1: 2, 3: 3}[args.zero]
    layout = fo.zero_layout(params, mesh, SPECS, stage=stage, data_axis=DATA)
    zero = Zero(opt, layout, params)  # checkpoints hold the model layout, whatever the stage
    params, opt_state = fo.zero_init(opt, params, layout)
    update = fo.zero_update(opt, layout)  # AdamW inside fpar.shard

    start, losses = 0, []
    if args.resume and fpar.checkpoint.latest_step(ckpt_dir) is not None:
        start, params, opt_state, losses, run_key = C.restore(
            ckpt_dir, *zero.model_form(params, opt_state), mesh, SPECS, zero.model_specs, key=run_key
        )
        params, opt_state = zero.zero_form(params, opt_state)
        C.say(f"resumed from {ckpt_dir} at step {start}", quiet=quiet)
    elif args.resume:
        C.say(f"--resume: no checkpoint in {ckpt_dir}; starting at step 0", quiet=quiet)
    stop = min(args.steps, args.stop_after or args.steps)

    # --- Training loop -------------------------------------------------------------------------
    bar = C.Bar(args.steps, start, enabled=not quiet)
    p2p = C.p2p_bytes(mesh, args.batch // mesh.shape[DATA], args.seq * args.d_model, dtype.itemsize)
    seconds, comm = [], {}
    for step in range(start, stop):
        ids_BT, targets_BT = batch_at(train_N, step, args.batch, args.seq, args.seed)
        xs_MBT = fpar.device_put(ids_BT.unflatten(0, (m, -1)), mesh, P(None, DATA))  # this process's rows
        ys_MBT = fpar.device_put(targets_BT.unflatten(0, (m, -1)), mesh, P(None, DATA))
        fpar.reset_comm_stats()
        t0 = time.perf_counter()
        res = step_fn(zero.params(params), xs_MBT, ys_MBT, fpar.random.fold_in(run_key, step))  # loss, grads
        params, opt_state = update(zero.grads(res.grads), opt_state, params)
        seconds.append(time.perf_counter() - t0)
        comm = C.comm_bytes(p2p)
        losses.append(res.loss.item())
        tok_s = tokens_per_step / seconds[-1]
        util = C.mfu(flops_per_token * tokens_per_step, seconds[-1], peak)
        bar.update(step, f"loss {losses[-1]:.3f} {C.fmt_si(tok_s)} tok/s")
        if (step + 1) % args.log_every == 0 or step == start or step + 1 == stop:
            bar.write(
                f"step {step + 1:4d}/{args.steps} | loss {losses[-1]:.4f} | {C.fmt_si(tok_s)} tok/s | "
                f"MFU {100 * util:.2f}% | {1000 * seconds[-1]:.0f} ms | sent {C.fmt_bytes(sum(comm.values()))}"
            )
        if step == start:
            bar.write(f"bytes sent per step, per mesh axis: {C.fmt_comm(comm)}; {C.COMM_NOTE[mesh.backend]}")
        if step + 1 == args.steps or (args.ckpt_every and (step + 1) % args.ckpt_every == 0):
            # in the background: the blocks are copied, then written while the next steps run
            model = zero.model_form(params, opt_state)
            C.save(
                ckpt_dir, step + 1, *model, losses, mesh, SPECS, zero.model_specs, key=run_key, blocking=False
            )
    bar.close()
    fpar.checkpoint.wait()  # the last save has committed

    # --- Summary, evaluation, plot ---------------------------------------------------------------
    timed = seconds[1:] or seconds  # the first step pays one-off costs
    mean_s = sum(timed) / len(timed) if timed else math.nan
    result = Result(
        losses,
        sum(seconds),
        tokens_per_step / mean_s,
        C.mfu(flops_per_token * tokens_per_step, mean_s, peak),
        comm,
    )
    if seconds:
        C.say(
            f"{len(seconds)} steps in {sum(seconds):.1f} s: loss {losses[start]:.3f} -> {losses[-1]:.3f} "
            f"(uniform guess {math.log(VOCAB):.3f}); {C.fmt_si(result.tokens_per_s)} tokens/s, "
            f"MFU {100 * result.mfu:.2f}%",
            quiet=quiet,
        )
        C.say(
            f"bytes sent per step, per mesh axis: {C.fmt_comm(comm)}; {C.COMM_NOTE[mesh.backend]}",
            quiet=quiet,
        )
    whole = fpar.gather(zero.params(params), mesh, SPECS)  # every process gets the whole model (tiny)
    if not quiet and C.rank() == 0:
        evaluate(args, as_gpt(whole), val_N)
    if args.plot != "none" and losses and not quiet:
        C.plot_losses(losses, args.plot or f"{ckpt_dir}/loss.png", f"train_gpt {dict(mesh.shape)}")
    return result


def evaluate(args, gpt: dict, val_N: torch.Tensor) -> None:
    """Held-out loss and a sample, with ``fpar.ops.gpt`` unpipelined on one in-process device."""
    one = fpar.make_mesh((1, 1), (DATA, TENSOR), backend="local")
    specs = ops.gpt_specs(args.layers, TENSOR, tied=False)
    logits = fpar.shard(
        lambda p, ids: ops.gpt(p, ids, axis=TENSOR, n_heads=args.heads),
        one,
        (specs, P()),
        P(None, None, TENSOR),
    )
    with torch.no_grad():
        total = 0.0
        for i in range(4):
            ids_BT, targets_BT = batch_at(val_N, i, args.batch, args.seq, args.seed + 1)
            total += torch.nn.functional.cross_entropy(
                logits(gpt, ids_BT).flatten(0, 1), targets_BT.flatten()
            ).item()
        print(f"held-out loss {total / 4:.4f} (last 5% of the corpus)")
        if args.sample > 0:
            g = torch.Generator().manual_seed(0)
            ids = list(args.prompt.encode())
            for _ in range(args.sample):
                last_V = logits(gpt, torch.tensor([ids[-args.seq :]]))[0, -1].double()
                ids.append(torch.multinomial(torch.softmax(last_V / 0.8, -1), 1, generator=g).item())
            print("sample (temperature 0.8):\n" + bytes(ids).decode("utf-8", errors="replace"))


if __name__ == "__main__":
    C.entry(main)
