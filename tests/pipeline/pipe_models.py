"""A tiny model for the pipeline tests, written once for every backend and layout.

Legend: m microbatches, B batch rows per microbatch, D model width, H hidden width, V vocabulary,
L = p * v model chunks.  The model: an embedding (``first``, on stage 0), L residual MLP chunks
(``block``, Megatron column/row tensor-parallel when the mesh has a "tensor" axis), a linear
head with a squared-error loss (``loss``, on the last stage; ``pmean`` over "data" when the mesh
has it).  ``reference`` is the same model unpipelined and unsharded: plain torch.
"""

from __future__ import annotations

import torch

import fpar
import fpar.optim as fo
import fpar.pipeline as pp
from fpar import P

F64 = torch.float64
D, H, V, OUT = 4, 8, 7, 3


def problem(p: int, m: int, v: int, *, seed: int = 0, batch: int = 4, dtype=F64) -> dict:
    """Global parameters (stage chunks in model order), microbatches and targets."""
    g = torch.Generator().manual_seed(seed)
    L = p * v
    return {
        "stages": {
            "a": torch.randn(L, D, H, dtype=dtype, generator=g) * 0.5,
            "b": torch.randn(L, H, D, dtype=dtype, generator=g) * 0.5,
        },
        "first": {"emb": torch.randn(V, D, dtype=dtype, generator=g)},
        "last": {"head": torch.randn(D, OUT, dtype=dtype, generator=g)},
        "xs": torch.randint(0, V, (m, batch), generator=g),
        "ts": torch.randn(m, batch, OUT, dtype=dtype, generator=g),
    }


def make_fns(axes: tuple = ()) -> dict:
    """Per-device block, first and loss functions using collectives over those of "tensor", "data" in ``axes``."""
    tp, dp = "tensor" in axes, "data" in axes

    def block_fn(w: dict, h_BD: torch.Tensor) -> torch.Tensor:
        """A residual MLP chunk; with "tensor", w["a"] is split by columns and w["b"] by rows."""
        out_BD = torch.tanh(h_BD @ w["a"]) @ w["b"]
        return h_BD + (fpar.psum(out_BD, "tensor") if tp else out_BD)

    def first_fn(w: dict, x_B: torch.Tensor) -> torch.Tensor:
        return w["emb"][x_B]

    def loss_fn(w: dict, h_BD: torch.Tensor, t_BO: torch.Tensor) -> torch.Tensor:
        loss = ((h_BD @ w["head"] - t_BO) ** 2).mean()
        return fpar.pmean(loss, "data") if dp else loss

    return {"stage": block_fn, "first": first_fn, "loss": loss_fn}


BLOCK_SPECS = {"a": P(None, "tensor"), "b": P("tensor", None)}


def stage_fns(mesh: fpar.Mesh, axis: str = "pipe", remat: bool = False) -> dict:
    """The stage, first and loss callables for ``mesh``: shards over the submesh, or plain functions.

    ``remat``: the stage's block is recomputed in the backward (``fpar.optim.remat``)."""
    others = tuple(a for a in mesh.axis_names if a != axis)
    fns = make_fns(others)
    if remat:
        fns["stage"] = fo.remat(fns["stage"])
    if not others:
        return fns
    sub = mesh.submesh(others)
    rows = P("data") if "data" in others else P()
    specs = {k: _only(s, others) for k, s in BLOCK_SPECS.items()}
    return {
        "stage": fpar.shard(fns["stage"], sub, (specs, rows), rows),
        "first": fpar.shard(fns["first"], sub, ({"emb": P()}, rows), rows),
        "loss": fpar.shard(fns["loss"], sub, ({"head": P()}, rows, rows), P()),
    }


def _only(spec: P, axes: tuple) -> P:
    return P(*[e if e in axes else None for e in spec])


def stage_spec(mesh: fpar.Mesh, axis: str = "pipe") -> dict:
    """The in-spec of the stacked stage parameters on the full mesh: P(pipe, ...)."""
    others = tuple(a for a in mesh.axis_names if a != axis)
    return {k: P(axis, *_only(s, others)) for k, s in BLOCK_SPECS.items()}


def reference(stages: dict, first: dict, last: dict, xs, ts) -> torch.Tensor:
    """The unpipelined model: mean over microbatches of the loss, chunks in model order."""
    total = 0.0
    for j in range(xs.shape[0]):
        h = first["emb"][xs[j]]
        for k in range(stages["a"].shape[0]):
            h = h + torch.tanh(h @ stages["a"][k]) @ stages["b"][k]
        total = total + ((h @ last["head"] - ts[j]) ** 2).mean()
    return total / xs.shape[0]


def reference_grads(prob: dict) -> tuple:
    """(loss, grads of stages in model order, of first, of last) of ``reference``."""
    args = (prob["stages"], prob["first"], prob["last"])
    grads = torch.func.grad(lambda s, f, la: reference(s, f, la, prob["xs"], prob["ts"]), argnums=(0, 1, 2))(
        *args
    )
    return (reference(*args, prob["xs"], prob["ts"]), *grads)


def schedule(name: str, p: int, m: int, v: int = 1, group: int | None = None) -> pp.Schedule:
    if name == "gpipe":
        return pp.gpipe(p, m, v)
    if name == "1f1b":
        return pp.one_f_one_b(p, m)
    if name == "interleaved":
        return pp.interleaved_1f1b(p, m, v, group)
    if name == "zb_h1":
        return pp.zb_h1(p, m)
    if name == "zb_v":
        return pp.zb_v(p, m)
    if name == "dualpipe_v":
        return pp.dualpipe_v(p, m)
    raise ValueError(name)


def layout(name: str | None) -> str:
    """Where the schedule puts the model's chunks (``Schedule.layout``)."""
    return "v" if name in ("zb_v", "dualpipe_v") else "interleaved"
