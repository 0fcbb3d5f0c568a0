"""fpar.ops' GPT trained with pipe x data x tensor parallelism (2 x 2 x 2 on 8 devices).

The model is ``fpar.ops.gpt`` (GPT-2 shaped, tiny, untied head): vocab-parallel token embedding
plus learned positions, ``p * v = 4`` ``fpar.ops.gpt_block``s, a final LayerNorm, a
vocab-parallel head and ``fpar.ops.vocab_cross_entropy``.  Parallelism:

* **pipeline** over "pipe": the 4 blocks are 4 chunks, 2 per stage, run by
  ``fpar.pipeline.interleaved_1f1b(p=2, m=4, v=2)`` (Megatron's interleaved schedule,
  arXiv:2104.04473 §2.2): chunk k lives on stage k % 2.  The embedding runs on stage 0
  (``first``), the final LayerNorm, head and loss on stage 1 (``loss``).
* **tensor** inside every piece (Megatron 1D, arXiv:1909.08053): attention heads and MLP columns
  split over "tensor", the embedding and head split over the vocabulary.
* **data**: each microbatch's rows are split over "data"; the loss is ``pmean``'d over it, which
  makes the gradients of replicated parameters the data-parallel sums.

The layout fits the devices it is given (``--devices N`` in-process, the world size under
torchrun): always 2 pipeline stages, then tensor=2 if it fits, data takes the rest, so
2 devices are pipe=2, 4 are pipe=2 x tensor=2, 8 are 2 x 2 x 2.  An odd count cannot hold 2
stages and is refused.

Each stage's functions are ``fpar.shard``s over ``mesh.submesh(("data", "tensor"))``.  The text is
the Zen of Python (``import this``), bundled with CPython; its last tenth is held out.  The script
prints the schedule once, checks the first step's loss and every gradient against the same GPT
unpipelined (``fpar.ops.gpt_loss`` sharded over data x tensor), prints the loss per step (Adam),
and at the end the loss on the held-out text.  About 20 s on 2 CPU cores.

Run:
    python examples/gpt_pipeline.py --steps 40                  # 8 in-process devices
    python examples/gpt_pipeline.py --devices 4                 # pipe=2 x tensor=2
    torchrun --nproc-per-node 4 examples/gpt_pipeline.py        # the same, one process per device

Shape suffixes: M microbatches, B batch rows, T time, D model width, V vocabulary.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import io
import math
import sys
import time
from pathlib import Path

import optree
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common.py, next to this file
import _common as C  # noqa: E402

import fpar  # noqa: E402
import fpar.ops as ops  # noqa: E402
import fpar.pipeline as pp  # noqa: E402
from fpar import P  # noqa: E402

P_STAGES, V_CHUNKS, M_MICRO = 2, 2, 4
D, N_HEADS, T = 64, 4, 32
L = P_STAGES * V_CHUNKS


# The model in pipeline pieces -----------------------------------------------------------------


def block(w: dict, x_BTD: torch.Tensor) -> torch.Tensor:
    return ops.gpt_block(w, x_BTD, axis="tensor", n_heads=N_HEADS)


def embed(w: dict, ids_BT: torch.Tensor) -> torch.Tensor:
    return ops.vocab_embedding(ids_BT, w["w_emb"], axis="tensor") + w["w_pos"][: ids_BT.shape[1]]


def head_loss(w: dict, x_BTD: torch.Tensor, tgt_BT: torch.Tensor) -> torch.Tensor:
    logits_BTV = ops.column_linear(ops.layer_norm(w["ln_f"], x_BTD), w["w_head"], axis="tensor")
    return fpar.pmean(ops.vocab_cross_entropy(logits_BTV, tgt_BT, axis="tensor").mean(), "data")


FIRST_SPECS = {"w_emb": P("tensor", None), "w_pos": P()}
LAST_SPECS = {"ln_f": ops.layer_norm_specs(), "w_head": P(None, "tensor")}
BLOCK_SPECS = ops.gpt_block_specs("tensor")
# the pipeline's parameters: chunks stacked on dim 0, split over "pipe" (each stage its v chunks)
SPECS = {
    "stages": C.tree_map_specs(lambda s: P("pipe", *s), BLOCK_SPECS),
    "first": FIRST_SPECS,
    "last": LAST_SPECS,
}


def layout(devices: int) -> tuple[int, int, int]:
    """(pipe, data, tensor) for ``devices``: 2 stages, tensor=2 if it fits, data the rest."""
    if devices % P_STAGES:
        raise SystemExit(
            f"gpt_pipeline.py runs {P_STAGES} pipeline stages, so it needs an even number of devices "
            f"(2, 4, 8, ...); got {devices}."
        )
    rest = devices // P_STAGES
    tensor = 2 if rest % 2 == 0 else 1
    return P_STAGES, rest // tensor, tensor


def split_params(gpt: dict) -> dict:
    """``fpar.ops.gpt``'s parameters as pipeline groups; blocks stacked in stage-major order."""
    stacked = optree.tree_map(lambda *ws: torch.stack(ws), *gpt["blocks"])
    return {
        "stages": pp.stage_major(stacked, P_STAGES, V_CHUNKS),
        "first": {"w_emb": gpt["w_emb"], "w_pos": gpt["w_pos"]},
        "last": {"ln_f": gpt["ln_f"], "w_head": gpt["w_head"]},
    }


def build(mesh: fpar.Mesh):
    """The pipelined step, and the same GPT unpipelined over data x tensor (for the check)."""
    sub = mesh.submesh(("data", "tensor"))
    rows = P("data")
    stage = fpar.shard(block, sub, (BLOCK_SPECS, rows), rows)
    first = fpar.shard(embed, sub, (FIRST_SPECS, rows), rows)
    loss = fpar.shard(head_loss, sub, (LAST_SPECS, rows, rows), P())
    schedule = pp.interleaved_1f1b(P_STAGES, M_MICRO, V_CHUNKS)
    step = pp.pipeline(stage, schedule, mesh, loss=loss, first=first)

    def gpt_loss(params, ids_BT, tgt_BT):
        tok_BT = ops.gpt_loss(params, ids_BT, tgt_BT, axis="tensor", n_heads=N_HEADS)
        return fpar.pmean(tok_BT.mean(), "data")

    specs = ops.gpt_specs(L, "tensor", tied=False)
    unpipelined = fpar.shard(gpt_loss, sub, (specs, rows, rows), P())
    return schedule, step, unpipelined, sub, specs


# Data and optimiser ---------------------------------------------------------------------------


def zen() -> str:
    """The Zen of Python: ``import this`` prints it; its text is kept rot13-encoded in ``this.s``."""
    with contextlib.redirect_stdout(io.StringIO()):
        import this
    return codecs.decode(this.s, "rot13")


def batches(text_ids: torch.Tensor, batch: int, seed: int):
    """Random windows of the text: (ids, next ids), each ``[M, B/M, T]``."""
    g = torch.Generator().manual_seed(seed)
    while True:
        start = torch.randint(0, len(text_ids) - T - 1, (batch,), generator=g).tolist()
        x_BT = torch.stack([text_ids[s : s + T] for s in start])
        y_BT = torch.stack([text_ids[s + 1 : s + T + 1] for s in start])
        yield x_BT.reshape(M_MICRO, -1, T), y_BT.reshape(M_MICRO, -1, T)


def adam(params, grads, state, *, lr=3e-3, b1=0.9, b2=0.99, eps=1e-8):
    """One Adam step over matching pytrees; returns the new parameters."""
    p_leaves, td = optree.tree_flatten(params)
    g_leaves = optree.tree_leaves(grads)
    if not state:
        state.update(
            t=0, m=[torch.zeros_like(p) for p in p_leaves], v=[torch.zeros_like(p) for p in p_leaves]
        )
    state["t"] += 1
    out = []
    for i, (p, g) in enumerate(zip(p_leaves, g_leaves)):
        state["m"][i] = b1 * state["m"][i] + (1 - b1) * g
        state["v"][i] = b2 * state["v"][i] + (1 - b2) * g * g
        m_hat = state["m"][i] / (1 - b1 ** state["t"])
        v_hat = state["v"][i] / (1 - b2 ** state["t"])
        out.append(p - lr * m_hat / (v_hat.sqrt() + eps))
    return optree.tree_unflatten(td, out)


# Training -------------------------------------------------------------------------------------


def as_gpt(params: dict) -> dict:
    """Whole parameters in the pipeline's layout -> ``fpar.ops.gpt``'s (the inverse of ``split_params``)."""
    stacked = pp.model_major(params["stages"], P_STAGES, V_CHUNKS)  # [L, ...], in model order
    blocks = [optree.tree_map(lambda t, k=k: t[k], stacked) for k in range(L)]
    return {**params["first"], "blocks": blocks, **params["last"]}


def check_against_unpipelined(step_result, unpipelined, mesh, sub, specs, params, xs, ys) -> None:
    """The first step's loss and gradients against the GPT unpipelined (compared as whole tensors)."""
    gpt = fpar.device_put(as_gpt(fpar.gather(params, mesh, SPECS)), sub, specs)
    ids, tgt = (fpar.device_put(t.flatten(0, 1), sub, P("data")) for t in (xs, ys))  # mean of means = mean
    ref = unpipelined(gpt, ids, tgt)
    ref_grads = split_params(fpar.gather(torch.func.grad(unpipelined)(gpt, ids, tgt), sub, specs))
    got_grads = fpar.gather(step_result.grads, mesh, SPECS)
    diff = max(
        (a - b).abs().max().item()
        for a, b in zip(optree.tree_leaves(got_grads), optree.tree_leaves(ref_grads))
    )
    loss_diff = abs(step_result.loss - ref).item()
    C.say(f"step 1 vs the unpipelined GPT: |loss diff| {loss_diff:.1e}, max |grad diff| {diff:.1e}")


def main(argv=None) -> list[float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=16, help="sequences per step (4 microbatches)")
    ap.add_argument("--devices", type=int, default=8, help="in-process devices (torchrun: the world size)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the ops are tiny: 1 is fastest)")
    args = ap.parse_args(argv)
    C.start(args.threads)  # under torchrun: join the process group (a real mesh)

    text = zen()
    chars = sorted(set(text))
    vocab = 2 * math.ceil(len(chars) / 2)  # divisible by the tensor axis; the extra ids are unused
    ids = torch.tensor([chars.index(c) for c in text])
    split = int(0.9 * len(ids))  # the last tenth is held out
    real = torch.distributed.is_initialized()
    devices = torch.distributed.get_world_size() if real else args.devices
    mesh = fpar.make_mesh(layout(devices), ("pipe", "data", "tensor"))
    if args.batch % (M_MICRO * mesh.shape["data"]):
        data = mesh.shape["data"]
        raise SystemExit(f"--batch {args.batch} must divide into {M_MICRO} microbatches x data={data}")
    schedule, step, unpipelined, sub, specs = build(mesh)
    kind = "real: one process per device" if mesh.backend == "dist" else "in-process"
    C.say(f"mesh {dict(mesh.shape)} ({kind}), vocab {vocab}, {len(text)} characters of the Zen of Python\n")
    C.say(pp.draw(schedule), "\n")

    gpt = fpar.init(ops.init_gpt(vocab, D, L, T, tied=False), mesh, P(), seed=0)  # whole, on every process
    params = fpar.device_put(split_params(gpt), mesh, SPECS)  # this process's blocks
    rows = P(None, "data")  # [M, B/M, T]: each microbatch's rows split over "data"
    data = batches(ids[:split], args.batch, seed=0)
    xs, ys = next(data)
    res = step(params, *fpar.device_put((xs, ys), mesh, rows))
    check_against_unpipelined(res, unpipelined, mesh, sub, specs, params, xs, ys)
    C.say(res.stats.table(), "\n")

    state: dict = {}
    losses, start = [], time.perf_counter()
    for i in range(args.steps):
        if i:
            xs, ys = next(data)
            res = step(params, *fpar.device_put((xs, ys), mesh, rows))
        params = adam(params, res.grads, state)
        losses.append(res.loss.item())
        C.say(f"step {i + 1:4d}/{args.steps} | loss {losses[-1]:.4f}")
    seconds = time.perf_counter() - start
    C.say(f"\n{args.steps} steps in {seconds:.1f} s (a uniform guess has loss {math.log(len(chars)):.3f})")

    # held out: the last tenth of the text, through the same GPT unpipelined
    x_val, y_val = (t.flatten(0, 1) for t in next(batches(ids[split:], args.batch, seed=1)))
    gpt = fpar.device_put(as_gpt(fpar.gather(params, mesh, SPECS)), sub, specs)
    with torch.no_grad():
        val = unpipelined(gpt, *fpar.device_put((x_val, y_val), sub, P("data"))).item()
    C.say(f"held-out loss {val:.4f} (the last tenth of the text)")
    return losses


if __name__ == "__main__":
    C.entry(main)
