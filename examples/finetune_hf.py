"""Fine-tune a Hugging Face causal LM from a checkpoint directory, with data x tensor x pipeline x ZeRO.

The model is whatever ``--model PATH`` holds (a directory ``save_pretrained`` wrote: config.json
and safetensors, e.g. a Qwen3 or Llama you downloaded elsewhere).  With no ``--model`` the
example first writes a small random-init Qwen3 (byte vocabulary, 256) with
``fpar.hf.save_pretrained``, since nothing can be downloaded here.  Then:

* ``fpar.hf.from_pretrained(path, mesh)`` builds the model on ``meta`` and reads only this
  process's blocks of each tensor: Megatron tensor parallelism from the model's own HF plan
  (heads and MLP columns split over ``tensor``, the vocabulary over ``tensor`` too);
* ``fpar.hf.pipeline_stages`` cuts it where its ``base_model_pp_plan`` says: the embedding on
  stage 0, the decoder layers split over ``pipeline``, final norm, head and loss on the last
  stage, run by ``fpar.pipeline``'s 1F1B (or ``--schedule gpipe``); one stage when the mesh has
  no pipeline.  The random model ties its embedding and head (as Qwen3-0.6B does): the pipeline
  uses the one weight at both ends and returns the sum of both gradients;
* ``--ep N`` adds an ``expert`` axis of ``N`` devices (with no ``--model`` the random model is then
  a Qwen3-MoE, max(4, N) experts, top-2, as ``--moe`` writes): the model's own ``base_model_ep_plan``
  splits its experts over it (``from_pretrained(..., expert_axis="expert")``), each (token,
  choice) pair goes to its expert's device and back with ``all_to_all``, and the rows are split
  over ``data`` x ``expert``, with or without a pipeline;
* each microbatch's rows are split over ``data`` (and ``expert``); AdamW with ZeRO stage ``--zero`` (default 1:
  the optimizer state split over ``data``; 3: FSDP, on one stage each parameter gathered at its
  first use and freed after its last, in a pipeline each stage gathered once a step) and
  global-norm clipping (``fpar.optim``); ``fpar.hf.lean`` lets the model's RMSNorms and SwiGLU
  MLPs keep only their inputs for the backward, ``--remat`` recomputes each decoder layer
  (``fpar.hf.remat``), and ``--sp`` splits the norms and residuals along the sequence over
  ``tensor`` (Megatron sequence parallelism: ``from_pretrained(..., sequence_parallel=True)``), in
  every layout;
* at the end ``fpar.hf.save_pretrained`` writes the fine-tuned model (each process its own shard
  files, no process gathering the model), and the example loads it back with
  ``fpar.hf.from_pretrained`` and checks that it holds the trained weights and gives the same
  held-out loss.  ``transformers.AutoModelForCausalLM.from_pretrained`` loads it too.

The text is ``--text FILE``'s bytes, or the standard library's ``.py`` sources (as
``train_gpt.py``).  The mesh is (pipeline, data, tensor): with no layout flags tensor=2, then
data=2, then pipeline=2 while they fit (2 devices: tensor=2; 4: data=2 x tensor=2; 8: all three);
``--parallel "pipeline=2,data=1,tensor=2"`` or ``--pp/--dp/--tp`` choose another.

    python examples/finetune_hf.py                                   # 4 in-process devices
    python examples/finetune_hf.py --model ~/models/Qwen3-0.6B --text notes.txt --devices 8
    torchrun --nproc-per-node 4 examples/finetune_hf.py --tiny --steps 3
    torchrun --nproc-per-node 4 examples/finetune_hf.py --tiny --pp 2   # pipeline=2 x tensor=2
    torchrun --nproc-per-node 4 examples/finetune_hf.py --tiny --pp 2 --dp 2 --tp 1 --zero 3  # FSDP x pipeline
    torchrun --nproc-per-node 4 examples/finetune_hf.py --tiny --ep 2   # a Qwen3-MoE: expert=2 x tensor=2
    python examples/finetune_hf.py --remat      # each decoder layer recomputed (fpar.hf.remat)

Needs ``pip install fpar[hf,examples]``.  Shape suffixes: M microbatches, B rows, T time.
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
from _common import AXES, DATA, PIPE, TENSOR  # noqa: E402
from train_gpt import batch_at, load_corpus  # noqa: E402

import fpar  # noqa: E402
import fpar.optim as fo  # noqa: E402
import fpar.pipeline as pp  # noqa: E402
from fpar import P  # noqa: E402

SCHEDULES = {"1f1b": pp.one_f_one_b, "gpipe": pp.gpipe, "zb": pp.zb_h1}
EXPERT = "expert"  # the mesh axis experts are split over (--ep): (pipeline, data, expert, tensor)


def rows_axes(mesh: fpar.Mesh) -> tuple[str, ...]:
    """The mesh axes a batch's rows are split over: data, and expert when the mesh has it."""
    return (DATA, EXPERT) if EXPERT in mesh.axis_names else (DATA,)


def random_checkpoint(path: Path, args, mesh: fpar.Mesh) -> None:
    """A random-init Qwen3 (byte vocabulary; a Qwen3-MoE with ``--moe``) written with ``fpar.hf.save_pretrained``."""
    import transformers

    moe = {}
    if args.moe:  # every layer's MLP a mixture of max(4, --ep) experts, each token routed to 2
        moe = dict(num_experts=max(4, args.ep), num_experts_per_tok=2, moe_intermediate_size=args.d_model)
        moe.update(decoder_sparse_step=1, norm_topk_prob=True)
    kind = "Qwen3Moe" if args.moe else "Qwen3"
    config = getattr(
        transformers, f"{kind}Config"
    )(
        **moe,
        vocab_size=256,
        hidden_size=args.d_model,
        intermediate_size=2 * args.d_model,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=args.d_model // 4,
        max_position_embeddings=args.seq,
        tie_word_embeddings=True,  # as Qwen3-0.6B: in a pipeline, held by the first stage's params, used by both ends
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(args.seed)  # the same model on every process
    model = getattr(transformers, f"{kind}ForCausalLM")(config).eval()
    apply_fn, params, specs = fpar.ops.tensor_parallel(model, mesh, expert_axis=expert_axis(mesh))
    fpar.hf.save_pretrained(path, apply_fn, fpar.device_put(params, mesh, specs), mesh)


def layout(devices: int) -> dict:
    """With no flags: tensor=2, then data=2, then pipeline=2 while they fit; data takes the rest."""
    sizes, rest = {}, devices
    for axis in (TENSOR, DATA, PIPE):
        sizes[axis] = 2 if rest % 2 == 0 else 1
        rest //= sizes[axis]
    sizes[DATA] *= rest
    return sizes


def expert_axis(mesh: fpar.Mesh) -> str | None:
    return EXPERT if EXPERT in mesh.axis_names else None


def build_mesh(args) -> fpar.Mesh:
    if args.ep > 1:
        return expert_mesh(args)
    if (
        args.parallel
        or args.config
        or args.single_device
        or any(v is not None for v in (args.pp, args.dp, args.tp))
    ):
        return C.build_mesh(args)
    real = torch.distributed.is_available() and torch.distributed.is_initialized()
    sizes = layout(torch.distributed.get_world_size() if real else args.devices)
    return fpar.make_mesh(tuple(sizes[a] for a in AXES), AXES, devices=None if real else args.devices)


def expert_mesh(args) -> fpar.Mesh:
    """(pipeline, data, expert, tensor): ``--ep`` devices on the expert axis; the others as without it."""
    if args.config or args.single_device:
        raise SystemExit(
            "--ep: give the other axes with --pp/--dp/--tp or --parallel, not --config or --single-device"
        )
    real = torch.distributed.is_available() and torch.distributed.is_initialized()
    world = torch.distributed.get_world_size() if real else args.devices
    if world % args.ep:
        raise SystemExit(f"--ep {args.ep} does not divide the {world} devices")
    rest = world // args.ep
    if args.parallel or any(v is not None for v in (args.pp, args.dp, args.tp)):
        sizes = C.flag_sizes(args, rest)
        if sizes[DATA] == -1:
            sizes[DATA] = rest // (sizes[PIPE] * sizes[TENSOR])
    else:
        sizes = layout(rest)
    if sizes[PIPE] * sizes[DATA] * sizes[TENSOR] != rest:
        raise SystemExit(
            f"--ep {args.ep} with pipeline={sizes[PIPE]} data={sizes[DATA]} tensor={sizes[TENSOR]} needs "
            f"{args.ep * sizes[PIPE] * max(sizes[DATA], 1) * sizes[TENSOR]} devices; there are {world}"
        )
    shape = (sizes[PIPE], sizes[DATA], args.ep, sizes[TENSOR])
    return fpar.make_mesh(shape, (PIPE, DATA, EXPERT, TENSOR), devices=None if real else args.devices)


def token_loss(apply_fn, p, ids_BT, targets_BT) -> torch.Tensor:
    """This device's mean next-token loss (per-device code: the logits may be split over the vocabulary)."""
    logits_BTV = apply_fn(p, ids_BT, use_cache=False).logits
    if apply_fn.plan.get("lm_head") == "vocab":
        return fpar.ops.vocab_cross_entropy(logits_BTV, targets_BT, axis=TENSOR).mean()
    return torch.nn.functional.cross_entropy(logits_BTV.transpose(1, 2), targets_BT)


def held_out_loss(apply_fn, specs, mesh, params, val_N, args) -> float:
    """Mean next-token loss on 2 batches of the held-out text, the model unpipelined over data x tensor."""
    rows = rows_axes(mesh)
    sub = mesh.submesh((*rows, TENSOR))

    def per_device(p, ids_BT, targets_BT):
        return fpar.pmean(token_loss(apply_fn, p, ids_BT, targets_BT), rows)

    loss = fpar.shard(per_device, sub, (specs, P(rows), P(rows)), P())
    total = 0.0
    with torch.no_grad():
        for i in range(2):
            ids_BT, targets_BT = batch_at(val_N, i, args.batch, args.seq, args.seed + 1)
            total += float(loss(params, *fpar.device_put((ids_BT, targets_BT), sub, P(rows))))
    return total / 2


def build_step(args, apply_fn, params, specs, mesh, opt):
    """``(step(state, ids_BT, targets_BT) -> (state, loss), state, to_flat(state) -> params)``.

    One stage: ``fpar.optim.zero_step`` at ZeRO stage ``--zero`` over data.  Several: the
    pipeline executor (``fpar.hf.pipeline_stages``), then ``fpar.optim.zero_update``: ``--zero 0``
    plain AdamW on every data rank (the gradients summed over data once a step); ``--zero 1`` or
    ``2`` the AdamW state split over data, and ``--zero 3`` the parameters too, gathered once a
    step (``fpar.optim.zero_pipeline``: each stage's gradients reduce-scattered over data; in a
    pipeline the gradient is summed whole over the microbatches, so stages 1 and 2 are one).
    """
    s, m = mesh.shape[PIPE], C.microbatches(args, mesh)
    rows = rows_axes(mesh)
    if args.batch % (m * math.prod(mesh.shape[a] for a in rows)):
        split = " x ".join(f"{a}={mesh.shape[a]}" for a in rows)
        raise SystemExit(
            f"--batch {args.batch} must divide into {m} microbatches x {split} (the layout {dict(mesh.shape)})"
        )
    if s == 1:
        zero = fo.zero_layout(params, mesh, specs, stage=args.zero, data_axis=DATA)
        params, opt_state = fo.zero_init(opt, params, zero)

        def loss(p, batch):  # this device's mean; zero_step averages it over data, this over expert
            return (
                fpar.pmean(token_loss(apply_fn, p, *batch), rows[1:])
                if rows[1:]
                else token_loss(apply_fn, p, *batch)
            )

        run = fo.zero_step(loss, opt, zero, batch_specs=P(rows))

        def step(state, ids_BT, targets_BT):
            params, opt_state, metrics = run(*state, fpar.device_put((ids_BT, targets_BT), mesh, P(rows)))
            return (params, opt_state), metrics["loss"]

        C.say(f"one stage, ZeRO-{args.zero} over data (fpar.optim.zero_step)", quiet=args.quiet)
        # ZeRO-3 stores each rank's chunks: fpar.optim.zero_params gathers the blocks back
        return step, (params, opt_state), lambda state: fo.zero_params(state[0], zero)

    stages = fpar.hf.pipeline_stages(apply_fn, specs, mesh, pipe=PIPE)
    schedule = SCHEDULES[args.schedule](s, m)
    run = pp.pipeline(stages.stage, schedule, mesh, loss=stages.loss, first=stages.first, axis=PIPE)
    pipe_params = stages.split(params)  # {"stages": layers stacked per chunk, "first", "last"}
    stage = {0: 0, 1: 2, 2: 2, 3: 3}[args.zero]
    zero = fo.zero_layout(pipe_params, mesh, stages.specs, stage=stage, data_axis=DATA)
    pipe_params, opt_state = fo.zero_init(opt, pipe_params, zero)
    update = fo.zero_update(opt, zero)
    if stage:  # each stage's gradients reduce-scattered over data; stage 3 gathers once a step
        run = fo.zero_pipeline(run, zero)

    def step(state, ids_BT, targets_BT):
        xs_MBT, ys_MBT = (
            fpar.device_put(t.unflatten(0, (m, -1)), mesh, P(None, rows)) for t in (ids_BT, targets_BT)
        )
        res = run(state[0], xs_MBT, ys_MBT)
        return update(res.grads, state[1], state[0]), res.loss

    kind = {0: "data parallel AdamW", 2: "AdamW state split over data (ZeRO-1/2)", 3: "FSDP (ZeRO-3)"}[stage]
    C.say(f"{s} pipeline stages, {m} microbatches ({schedule.name}), {kind}", quiet=args.quiet)
    return step, (pipe_params, opt_state), lambda state: stages.merge(fo.zero_params(state[0], zero))


def main(argv=None) -> list[float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a checkpoint directory (default: write a small random Qwen3 first)")
    ap.add_argument("--text", help="fine-tune on this file's bytes (default: the standard library's sources)")
    ap.add_argument("--out", default="checkpoints/finetune_hf", help="where the checkpoints go")
    ap.add_argument("--max-bytes", type=int, default=1_000_000)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=64, help="the random model's width (no --model)")
    ap.add_argument("--layers", type=int, default=4, help="the random model's layers (no --model)")
    ap.add_argument("--zero", type=int, default=1, choices=(0, 1, 2, 3), help="ZeRO stage over data")
    ap.add_argument("--tiny", action="store_true", help="a very small model (tests, torchrun on CPU)")
    ap.add_argument("--moe", action="store_true", help="the random model (no --model) is a Qwen3-MoE")
    ap.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel size: the model's experts split over an 'expert' axis",
    )
    ap.add_argument(
        "--remat", action="store_true", help="recompute each decoder layer in the backward (fpar.hf.remat)"
    )
    ap.add_argument(
        "--sp",
        action="store_true",
        help="Megatron sequence parallelism over tensor: norms and residuals on sequence blocks",
    )
    C.add_args(ap, steps=40, batch=16, lr=3e-3, warmup=4)
    args = ap.parse_args(argv)
    args.moe = args.moe or args.ep > 1
    if args.tiny:
        args.d_model, args.layers, args.seq, args.batch = 32, 2, 16, 8
        args.max_bytes = min(args.max_bytes, 200_000)
    C.start(args.threads)
    quiet, out = args.quiet, Path(args.out)
    mesh = build_mesh(args)
    kind = "real: one process per device" if mesh.backend == "dist" else "in-process"
    C.say(f"mesh {dict(mesh.shape)} ({kind})", quiet=quiet)

    # --- The checkpoint, loaded shard by shard -----------------------------------------------
    path = Path(args.model) if args.model else out / "init"
    if not args.model:
        random_checkpoint(path, args, mesh)
        C.say(
            f"wrote a random-init {'Qwen3-MoE' if args.moe else 'Qwen3'} to {path} (fpar.hf.save_pretrained)",
            quiet=quiet,
        )
    dtype = C.DTYPES[args.dtype]
    apply_fn, params, specs = fpar.hf.from_pretrained(
        path, mesh, dtype=dtype, expert_axis=expert_axis(mesh), sequence_parallel=args.sp
    )
    # the model's RMSNorms and SwiGLU MLPs keep only their inputs for the backward (its own values)
    lean = fpar.hf.lean(apply_fn)
    if args.remat:  # keep each layer's input, run the layer again in the backward
        fpar.hf.remat(apply_fn)
    n_params = sum(p.numel() for p in apply_fn.module.parameters())
    if apply_fn.expert_axis is not None:
        C.say(
            f"experts split over {apply_fn.expert_axis}={mesh.shape[EXPERT]} (its base_model_ep_plan: "
            f"{len(apply_fn.experts)} expert weights; tokens sent to their experts' devices with all_to_all)",
            quiet=quiet,
        )
    C.say(
        f"{type(apply_fn.module).__name__}: {n_params / 1e6:.2f}M parameters from {path}; "
        f"{lean['rms_norm']} norms and {lean['swiglu']} MLPs as fused kernels keep memory (fpar.hf.lean)"
        + (", each decoder layer recomputed in the backward (fpar.hf.remat)" if args.remat else ""),
        quiet=quiet,
    )
    tokens_N, source = load_corpus(args.text, args.max_bytes)
    split = int(0.95 * len(tokens_N))
    train_N, val_N = tokens_N[:split], tokens_N[split:]
    C.say(f"text: {len(tokens_N):,} bytes from {source}", quiet=quiet)

    # --- The step: pipeline stages or one, ZeRO ---------------------------------------------------
    lr = fo.warmup_cosine(args.lr, min(args.warmup, args.steps // 2), args.steps, end=args.lr / 10)
    opt = fo.chain(fo.clip_by_global_norm(args.clip), fo.adamw(lr, b2=0.95, weight_decay=args.weight_decay))
    step_fn, state, to_flat = build_step(args, apply_fn, params, specs, mesh, opt)
    del params  # the step's state holds them now

    # --- Fine-tuning ------------------------------------------------------------------------------
    losses, t0 = [], time.perf_counter()
    for step in range(args.steps):
        state, loss = step_fn(state, *batch_at(train_N, step, args.batch, args.seq, args.seed))
        losses.append(float(loss))
        if (step + 1) % args.log_every == 0 or step == 0 or step + 1 == args.steps:
            C.say(f"step {step + 1:4d}/{args.steps} | loss {losses[-1]:.4f}", quiet=quiet)
    seconds = time.perf_counter() - t0
    C.say(
        f"{args.steps} steps in {seconds:.1f} s: loss {losses[0]:.3f} -> {losses[-1]:.3f} "
        f"(uniform guess {math.log(256):.3f})",
        quiet=quiet,
    )
    params = to_flat(state)  # from_pretrained's layout: flat names, tensor-parallel blocks
    val = held_out_loss(apply_fn, specs, mesh, params, val_N, args)
    C.say(f"held-out loss {val:.4f} (the last 5% of the text)", quiet=quiet)

    # --- Save, and load back ------------------------------------------------------------------------
    final = out / "final"
    fpar.hf.save_pretrained(final, apply_fn, params, mesh)
    apply_fn2, params2, specs2 = fpar.hf.from_pretrained(
        final, mesh, dtype=dtype, expert_axis=expert_axis(mesh), sequence_parallel=args.sp
    )
    diff = max((params2[k] - params[k]).abs().max().item() for k in params)
    val2 = held_out_loss(apply_fn2, specs2, mesh, params2, val_N, args)
    C.say(
        f"saved to {final} (fpar.hf.save_pretrained); reloaded with fpar.hf.from_pretrained: "
        f"max |weight diff| {diff:.1e}, held-out loss {val2:.4f}",
        quiet=quiet,
    )
    if diff != 0.0 or abs(val2 - val) > 1e-6:
        raise SystemExit(f"the reloaded checkpoint differs from the trained model ({diff}, {val2} vs {val})")
    return losses


if __name__ == "__main__":
    C.entry(main)
