"""Llama- and GPT-shaped training steps built from fpar's own pieces, for planning by size.

``build_step(model, layout, mesh)`` returns the whole training step (forward, backward, AdamW)
and its arguments on ``mesh``, in the layout ``layout`` names: Megatron tensor parallelism with
sequence parallelism over ``"tensor"``, ZeRO over ``"data"``, a pipeline over ``"pipeline"``
(fpar.pipeline's executor and schedules), per-layer activation recomputation
(``fpar.optim.remat``).  Parameters and optimizer state are float32 (master weights); every
layer casts its weights to the compute dtype (bfloat16) as it uses them, as autocast does.
Attention is the flash kernel (causal; no ``s x s`` matrix kept), or with ``Model(attention="eager")``
the scores materialised; GQA by repeating key/value heads.
A ``Model(kind="gpt")`` is GPT-shaped instead (Megatron-LM's GPT): LayerNorm with biases, a
GeLU MLP of two matrices with biases, learned positions and an output head tied to the token
embedding (with a pipeline, the last stage computes with the first stage's table, and the two
stages' gradients of it are summed; the executor already hands every stage both).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F

from .. import ops
from .. import optim as fo
from .. import pipeline as pp
from .._collectives import pmean, psum, psum_scatter
from .._global import device_put, init, normal, ones, zeros
from .._mesh import Mesh
from .._shard import shard
from .._spec import P
from .._sums import MODES as SUM_MODES
from .._sums import low_precision_sums
from ..pipeline._builders import interleaved_group
from ._paper import abstract_mesh

__all__ = ["MODELS", "Layout", "Model", "model_step"]

PIPE, DATA, TENSOR = "pipeline", "data", "tensor"
REMAT_POLICIES = {"dots": fo.save_dots, "alternate_dots": fo.save_alternate_dots}  # Layout(remat=...)


@dataclasses.dataclass(frozen=True)
class Model:
    """A decoder-only transformer's shape.

    ``kind="llama"``: RMSNorm, GQA, SwiGLU, rotary, untied head.  ``kind="gpt"``: LayerNorm and
    biases, multi-head attention (``n_kv_heads == n_heads``), a GeLU MLP ``d -> d_ffn -> d``,
    learned positions, head tied to the embedding (Megatron-LM's GPT).  ``attention="flash"``:
    the fused causal kernel (torch's SDPA); ``"eager"``: the ``s x s`` scores materialised, masked
    and soft-maxed between two batched matmuls (Megatron-LM before FlashAttention, Hugging Face's
    ``attn_implementation="eager"``).
    """

    name: str
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ffn: int
    vocab: int
    seq: int
    kind: str = "llama"
    attention: str = "flash"

    def __post_init__(self):
        if self.kind not in ("llama", "gpt"):
            raise ValueError(f"fpar.plan.Model: kind={self.kind!r}; choose 'llama' or 'gpt'.")
        if self.attention not in ("flash", "eager"):
            raise ValueError(f"fpar.plan.Model: attention={self.attention!r}; choose 'flash' or 'eager'.")
        if self.kind == "gpt" and self.n_kv_heads != self.n_heads:
            raise ValueError(
                f"fpar.plan.Model: a GPT-shaped model has as many key/value heads as heads; got "
                f"n_kv_heads={self.n_kv_heads}, n_heads={self.n_heads}."
            )

    @property
    def n_params(self) -> int:
        """Parameters: the blocks, the embedding (and positions) and the head, the final norm."""
        d, hd = self.d_model, self.d_model // self.n_heads
        attn = d * hd * (2 * self.n_heads + 2 * self.n_kv_heads)
        if self.kind == "gpt":  # Megatron-LM's 12 l h^2 (1 + 13 / 12h + (V + s) / 12lh)
            block = attn + 2 * d * self.d_ffn + 4 * d + self.d_ffn + 5 * d
            return self.n_layers * block + (self.vocab + self.seq) * d + 2 * d
        block = attn + 3 * d * self.d_ffn + 2 * d
        return self.n_layers * block + 2 * self.vocab * d + d


MODELS = {
    "llama-8b": Model("llama-8b", 4096, 32, 32, 8, 14336, 128256, 8192),
    "llama-70b": Model("llama-70b", 8192, 80, 64, 8, 28672, 128256, 4096),
    "llama-405b": Model("llama-405b", 16384, 126, 128, 8, 53248, 128256, 8192),
    "tiny": Model("tiny", 64, 4, 4, 2, 128, 256, 32),
    # Megatron-LM's GPT rows (Narayanan et al. 2021, Table 1): h, l, heads; vocab 51,200; seq 2,048
    "gpt-1.7b": Model("gpt-1.7b", 2304, 24, 24, 24, 4 * 2304, 51200, 2048, "gpt"),
    "gpt-18b": Model("gpt-18b", 6144, 40, 48, 48, 4 * 6144, 51200, 2048, "gpt"),
    "gpt-39b": Model("gpt-39b", 8192, 48, 64, 64, 4 * 8192, 51200, 2048, "gpt"),
    "gpt-175b": Model("gpt-175b", 12288, 96, 96, 96, 4 * 12288, 51200, 2048, "gpt"),
}


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a step is laid out: axis sizes, ZeRO stage, microbatches, recomputation, schedule.

    ``batch`` is the global batch in sequences; each step runs it as ``microbatches`` microbatches
    of ``batch / (data x microbatches)`` sequences per device (``micro_batch``).  ``virtual``:
    model chunks per pipeline stage (interleaved 1F1B, Megatron-LM's virtual stages, when above 1).
    ``remat``: recompute each layer in the backward (True), or selectively (``"dots"``: keep the
    matmuls' and attention's outputs, ``fpar.optim.save_dots``; ``"alternate_dots"``: keep
    attention's and every other matmul's, torchtitan's "op" policy, ``fpar.optim.save_alternate_dots``).
    ``sums``: how the step's bf16 sums over devices accumulate (``fpar.low_precision_sums``):
    ``"float32"`` (fpar's rule, twice the bytes) or ``"native"`` (Megatron-LM's 16-bit all-reduces).
    ``reduce_once``: ZeRO 2 or 3: the microbatches' gradients summed unreduced and reduce-scattered
    once a step (True), or each microbatch's reduced as its backward ends and accumulated as
    chunks (False).  ``None``: each path's default, which is what its peers do: False without a
    pipeline (``fpar.optim.zero_step``, as FSDP2), True inside one (``fpar.optim.zero_pipeline``,
    as torchtitan; False there reduces each chunk's gradient as each of its backwards ends).
    ``group``: with ``virtual > 1``, the microbatches interleaved 1F1B runs through a chunk before
    the next (Megatron-LM's ``microbatch_group_size_per_vp_stage``; None: ``pipeline``), which lets
    ``microbatches`` be other than a multiple of ``pipeline`` (``fpar.pipeline.interleaved_1f1b``).
    ``reshard_after_forward``: ZeRO-3 inside a pipeline: each model chunk gathered for its own
    forward and backward and freed after (True), or the stage gathered once a step and held
    (False, torchtitan's choice in a pipeline): ``fpar.optim.zero_pipeline``'s option.
    """

    pipeline: int = 1
    data: int = 1
    tensor: int = 1
    zero: int = 1
    microbatches: int = 1
    batch: int = 1
    remat: bool | str = False
    schedule: str = "1f1b"
    sequence_parallel: bool = True
    virtual: int = 1
    sums: str = "float32"
    reduce_once: bool | None = None
    group: int | None = None
    reshard_after_forward: bool = False

    @property
    def devices(self) -> int:
        return self.pipeline * self.data * self.tensor

    @property
    def micro_batch(self) -> int:
        """Sequences per microbatch per device."""
        return self.batch // (self.data * self.microbatches)

    def describe(self) -> str:
        return (
            f"pipeline={self.pipeline} data={self.data} tensor={self.tensor} zero={self.zero} "
            f"microbatches={self.microbatches}x{self.micro_batch} remat={self.remat}"
            + ("" if self.sequence_parallel or self.tensor == 1 else " sp=False")
            + (f" schedule={self.schedule}" if self.pipeline > 1 else "")
            + (f" virtual={self.virtual}" if self.virtual > 1 else "")
            + (f" sums={self.sums}" if self.sums != "float32" else "")
            + (" reduce_once" if self.reduce_once else "")
            + (" reduce_once=False" if self.reduce_once is False and self.pipeline > 1 else "")
            + (f" group={self.group}" if self.group is not None else "")
            + (" reshard_after_forward" if self.reshard_after_forward else "")
        )

    def mesh(self) -> Mesh:
        """The abstract mesh of this layout (pipeline, data, tensor)."""
        return abstract_mesh((self.pipeline, self.data, self.tensor), (PIPE, DATA, TENSOR))


def check_layout(model: Model, layout: Layout) -> None:
    """Raise ``ValueError`` naming the dimension a layout does not divide, before any work."""
    if layout.sums not in SUM_MODES:
        raise ValueError(
            f"fpar.plan: sums={layout.sums!r}; choose 'float32' (fpar's rule) or 'native' "
            f"(bf16 sums in bf16, as Megatron-LM's): fpar.low_precision_sums."
        )
    if not isinstance(layout.remat, bool) and layout.remat not in REMAT_POLICIES:
        raise ValueError(
            f"fpar.plan: remat={layout.remat!r}; choose True, False or a selective policy: "
            f"{', '.join(repr(k) for k in REMAT_POLICIES)}."
        )
    t, p, d = layout.tensor, layout.pipeline, layout.data
    rules = [
        ("n_heads", model.n_heads, t, "tensor"),
        ("n_kv_heads", model.n_kv_heads, t, "tensor"),
        ("d_ffn", model.d_ffn, t, "tensor"),
        ("vocab", model.vocab, t, "tensor"),
        ("batch", layout.batch, d * layout.microbatches, "data x microbatches"),
    ]
    if layout.sequence_parallel:
        rules.append(("seq", model.seq, t, "tensor (sequence parallel)"))
    for name, size, n, axis in rules:
        if size % n:
            raise ValueError(
                f"fpar.plan: layout {layout.describe()} does not divide {model.name}'s {name}={size} "
                f"by {axis}={n}; choose a {axis} size that divides {size}."
            )
    chunk_layers(model, layout)
    if layout.virtual != 1 and (p == 1 or layout.schedule != "1f1b"):
        raise ValueError(
            f"fpar.plan: virtual={layout.virtual} (interleaved 1F1B) needs pipeline > 1 and schedule "
            f"'1f1b'; got {layout.describe()}."
        )
    if layout.group is not None and layout.virtual == 1:
        raise ValueError(
            f"fpar.plan: group={layout.group} is interleaved 1F1B's microbatches a group: it needs "
            f"virtual > 1; got {layout.describe()}."
        )
    if layout.virtual != 1:
        try:
            interleaved_group(p, layout.microbatches, layout.group)
        except pp.ScheduleError as e:
            raise ValueError(f"fpar.plan: layout {layout.describe()}: {e}") from None
    if layout.zero not in (0, 1, 2, 3):
        raise ValueError(f"fpar.plan: zero={layout.zero}; choose ZeRO stage 0, 1, 2 or 3.")
    if layout.reduce_once not in (None, True, False):
        raise TypeError(f"fpar.plan: reduce_once must be None, True or False, got {layout.reduce_once!r}.")
    if layout.zero < 2 and (layout.reduce_once or (layout.reduce_once is False and p > 1)):
        raise ValueError(
            f"fpar.plan: reduce_once={layout.reduce_once} is for ZeRO 2 or 3 (ZeRO 0 and 1 reduce once "
            f"a step: their gradients are whole until the update); got {layout.describe()}."
        )
    if not isinstance(layout.reshard_after_forward, bool):
        raise TypeError(
            f"fpar.plan: reshard_after_forward must be True or False, got {layout.reshard_after_forward!r}."
        )
    if layout.reshard_after_forward and (p == 1 or layout.zero != 3):
        raise ValueError(
            f"fpar.plan: reshard_after_forward=True is ZeRO-3 inside a pipeline (each model chunk "
            f"gathered for its own actions; without a pipeline ZeRO-3 gathers a layer at a time "
            f"already); got {layout.describe()}."
        )


def chunk_layers(model: Model, layout: Layout) -> list[int]:
    """Layers per model chunk (virtual stage, in model order) of a pipelined layout.

    Every chunk holds ``k = ceil(n_layers / (pipeline x virtual))`` layers, except the first and
    the last, which also hold the embedding and the head: when the chunks' ``k`` slots outnumber
    the layers, they give up the difference, the last chunk the larger half (Llama 3's 126 layers
    on 16 stages: one fewer on the first and on the last stage).  Raises ``ValueError`` when the
    two end chunks cannot absorb it.
    """
    n = layout.pipeline * layout.virtual
    k = -(-model.n_layers // n)
    empty = n * k - model.n_layers
    first, last = empty // 2, empty - empty // 2
    if last > k:
        raise ValueError(
            f"fpar.plan: layout {layout.describe()} does not divide {model.name}'s n_layers="
            f"{model.n_layers} by pipeline x virtual={n}: with {k} a chunk, {empty} of the {n * k} layer "
            f"slots would be empty, and only the first and the last chunk may hold fewer layers (at "
            f"most {2 * k} empty slots); "
            f"choose a pipeline x virtual that divides {model.n_layers}, or one that leaves at most "
            f"{2 * k} slots empty."
        )
    out = [k] * n
    out[0] -= first
    out[-1] -= last
    return out


def _block_specs(model: Model | None = None) -> dict:
    col, row = P(None, TENSOR), P(TENSOR, None)
    if model is not None and model.kind == "gpt":
        names = ("ln1", "ln1_b", "bo", "ln2", "ln2_b", "b2")
        out = {k: P() for k in names}
        out.update(wq=col, wk=col, wv=col, bq=P(TENSOR), bk=P(TENSOR), bv=P(TENSOR), wo=row)
        out.update(w1=col, b1=P(TENSOR), w2=row)
        return out
    return {
        "ln1": P(),
        "wq": col,
        "wk": col,
        "wv": col,
        "wo": row,
        "ln2": P(),
        "w1": col,
        "w3": col,
        "w2": row,
    }


def _block_inits(model: Model, lead: tuple) -> dict:
    d, hd = model.d_model, model.d_model // model.n_heads
    std, out_std = 0.02, 0.02 / math.sqrt(2 * model.n_layers)
    if model.kind == "gpt":
        out = {k: normal((*lead, d, model.n_heads * hd), std=std) for k in ("wq", "wk", "wv")}
        out.update({k: zeros((*lead, model.n_heads * hd)) for k in ("bq", "bk", "bv")})
        out.update({k: ones((*lead, d)) for k in ("ln1", "ln2")})
        out.update({k: zeros((*lead, d)) for k in ("ln1_b", "ln2_b", "bo", "b2")})
        out.update(wo=normal((*lead, model.n_heads * hd, d), std=out_std))
        out.update(w1=normal((*lead, d, model.d_ffn), std=std), b1=zeros((*lead, model.d_ffn)))
        out.update(w2=normal((*lead, model.d_ffn, d), std=out_std))
        return out
    return {
        "ln1": ones((*lead, d)),
        "wq": normal((*lead, d, model.n_heads * hd), std=std),
        "wk": normal((*lead, d, model.n_kv_heads * hd), std=std),
        "wv": normal((*lead, d, model.n_kv_heads * hd), std=std),
        "wo": normal((*lead, model.n_heads * hd, d), std=out_std),
        "ln2": ones((*lead, d)),
        "w1": normal((*lead, d, model.d_ffn), std=std),
        "w3": normal((*lead, d, model.d_ffn), std=std),
        "w2": normal((*lead, model.d_ffn, d), std=out_std),
    }


def _rms_norm(x, w, eps: float = 1e-5):
    return ops.rms_norm(x, w, eps)  # keeps x and a number a row, as fused kernels do


_ROTARY: dict = {}  # (seq, head dim, dtype, device) -> (cos, sin): computed once, as models keep them


def _rotary(x, seq: int):
    """Rotary position embedding on ``x[b, s, h, hd]``.

    Its result is contiguous in that layout: the attention kernel's output takes its query's
    layout, and ``[b, s, h, hd]`` flattens to the output projection's input without a copy.
    """
    hd = x.shape[-1]
    key = (seq, hd, x.dtype, str(x.device))
    if key not in _ROTARY:
        with torch.no_grad():
            inv = 1.0 / (10000 ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd))
            ang = torch.arange(seq, device=x.device, dtype=torch.float32)[:, None] * inv[None]
            _ROTARY[key] = (ang.cos().to(x.dtype), ang.sin().to(x.dtype))
    cos, sin = (t[:, None] for t in _ROTARY[key])  # over the heads
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2)


_MASKS: dict = {}  # (seq, device) -> the causal mask above the diagonal, made once as models keep it


def _attention(q, k, v, eager: bool = False):
    """Causal attention ``[b, h, s, hd]``: the flash kernel (no ``s x s`` matrix is kept), or eager.

    ``k`` and ``v`` may have fewer heads (grouped-query attention): the flash kernel reads each
    group's key and value heads itself, so only those are kept for the backward.
    """
    if k.shape[1] != q.shape[1] and (eager or q.device.type != "meta"):
        if eager:
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))
        else:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    if eager:  # the scores materialised: a batched matmul, the mask, a softmax, a batched matmul
        s = q.shape[-2]
        key = (s, str(q.device))
        if key not in _MASKS:
            with torch.no_grad():
                _MASKS[key] = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
        scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)
        return torch.softmax(scores.masked_fill(_MASKS[key], float("-inf")), dim=-1) @ v
    if q.device.type == "meta":
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[0]
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _gpt_block(project, out, hq: int, hd: int, eager: bool):
    """Megatron-LM's GPT layer: LayerNorm, attention with biases, a GeLU MLP with biases."""

    def block(w, x):
        h = F.layer_norm(x, x.shape[-1:], w["ln1"], w["ln1_b"])
        qkv = project(h, [w[n] for n, _ in _QKV])
        q, k, v = ((y + w[b]).unflatten(-1, (hq, hd)).transpose(1, 2) for y, (_, b) in zip(qkv, _QKV))
        o = _attention(q, k, v, eager).transpose(1, 2).flatten(2)
        x = x + out(o @ w["wo"]) + w["bo"]
        (u,) = project(F.layer_norm(x, x.shape[-1:], w["ln2"], w["ln2_b"]), [w["w1"]])
        return x + out(F.gelu(u + w["b1"], approximate="tanh") @ w["w2"]) + w["b2"]

    return block


_QKV = (("wq", "bq"), ("wk", "bk"), ("wv", "bv"))


def _block(model: Model, layout: Layout, dtype):
    t = layout.tensor
    hq, hkv, hd = model.n_heads // t, model.n_kv_heads // t, model.d_model // model.n_heads
    sp = layout.sequence_parallel and t > 1

    def project(h, ws):  # Megatron-SP: the whole sequence, once per region, re-gathered in the backward
        return ops.sp_gather_matmul(h, ws, axis=TENSOR, seq_dim=1) if sp else [h @ w for w in ws]

    def out(y):  # row-parallel's sum: reduce-scatter the sequence (SP) or all-reduce
        return psum_scatter(y, TENSOR, scatter_dimension=1, tiled=True) if sp else psum(y, TENSOR)

    eager = model.attention == "eager"
    gpt = _gpt_block(project, out, hq, hd, eager) if model.kind == "gpt" else None

    def block(w, x):
        w = {k: v.to(dtype) for k, v in w.items()}
        if gpt is not None:
            return gpt(w, x)
        q, k, v = project(_rms_norm(x, w["ln1"]), [w["wq"], w["wk"], w["wv"]])
        s = q.shape[1]
        q = _rotary(q.unflatten(-1, (hq, hd)), s).transpose(1, 2)
        k = _rotary(k.unflatten(-1, (hkv, hd)), s).transpose(1, 2)
        v = v.unflatten(-1, (hkv, hd)).transpose(1, 2)
        o = _attention(q, k, v, eager).transpose(1, 2).flatten(2)
        x = x + out(o @ w["wo"])
        gate, up = project(_rms_norm(x, w["ln2"]), [w["w1"], w["w3"]])
        return x + out(ops.swiglu(gate, up) @ w["w2"])

    if not layout.remat:
        return block
    return fo.remat(block, policy=REMAT_POLICIES[layout.remat] if isinstance(layout.remat, str) else None)


def _parts(model: Model, layout: Layout, dtype):
    """The per-device embedding, K blocks of a stage, and head + loss."""
    sp = layout.sequence_parallel and layout.tensor > 1
    block = _block(model, layout, dtype)

    def embed(w, ids):
        table = w["w_emb"].to(dtype)
        x = (
            ops.sp_vocab_embedding(ids, table, axis=TENSOR)
            if sp
            else ops.vocab_embedding(ids, table, axis=TENSOR)
        )
        if "w_pos" in w:  # learned positions: with SP each device holds its sequence block's rows
            x = x + w["w_pos"].to(dtype)
        return x

    def blocks(w, x, n_layers: int | None = None):
        if isinstance(w, list):  # ZeRO-3 (FSDP): a layer's parameters are leaves of their own
            for layer in w:
                x = block(layer, x)
            return x
        # unbind once: one stacked gradient at the end of the backward, not a stage-sized zero
        # gradient per layer (what indexing w[i] costs: select_backward per layer)
        names = list(w)
        layers = list(zip(*(w[n].unbind(0) for n in names)))
        for layer in layers[:n_layers]:  # a chunk with fewer layers uses its first n_layers slots
            x = block(dict(zip(names, layer)), x)
        return x

    def head_loss(w, x, targets):
        return pmean(_local_loss(w, x, targets), DATA)

    return embed, blocks, head_loss


def model_step(model: Model | str, layout: Layout, mesh: Mesh | None = None, *, dtype=torch.bfloat16):
    """``(step, args)``: ``layout``'s whole training step of ``model`` on ``mesh`` (default: an abstract one).

    ``model``: a ``fpar.plan.Model`` or a name of ``fpar.plan.MODELS`` (``"llama-8b"``,
    ``"llama-70b"``, ``"llama-405b"``, ``"tiny"``, Megatron-LM's ``"gpt-1.7b"`` ... ``"gpt-175b"``).

    The step is the one a user at scale runs: AdamW on float32 master weights, updated in place
    (``donate=True``: the arguments' parameters and state are written; one copy of the state),
    ZeRO 1-3 inside a pipeline through ``fpar.optim.zero_pipeline`` (ZeRO-1 as stage 2).

    Raises:
      ValueError: an unknown model name, or a layout that does not divide the model (the message
        names the dimension and the axis).
    """
    if isinstance(model, str):
        if model not in MODELS:
            raise ValueError(
                f"fpar.plan: unknown model {model!r}; choose one of {sorted(MODELS)} or pass a fpar.plan.Model."
            )
        model = MODELS[model]
    check_layout(model, layout)
    mesh = layout.mesh() if mesh is None else mesh
    p, m = layout.pipeline, layout.microbatches
    rows = layout.batch // (layout.data * m)  # sequences per microbatch per device
    embed, blocks, head_loss = _parts(model, layout, dtype)
    first_specs, last_specs, first_init, last_init = _ends(model, layout)
    gpt = model.kind == "gpt"
    opt = fo.adamw(3e-4, b2=0.95, weight_decay=0.1)
    if mesh.abstract:
        ids = torch.empty(m, rows * layout.data, model.seq, dtype=torch.long, device="meta")
    else:  # a real or in-process mesh: a batch of token ids to run it for real
        ids = torch.randint(
            0, model.vocab, (m, rows * layout.data, model.seq), generator=torch.Generator().manual_seed(0)
        )
    act = P(DATA, TENSOR) if layout.sequence_parallel and layout.tensor > 1 else P(DATA)
    if p == 1:
        specs = {"blocks": _stacked(_block_specs(model), False), "first": first_specs, "last": last_specs}
        inits = {"blocks": _block_inits(model, (model.n_layers,)), "first": first_init, "last": last_init}
        if layout.zero == 3:
            # FSDP's model: every layer's parameters are leaves of their own (not stacked), so
            # ZeRO-3 gathers them at their first use and frees them after their last, a layer
            # at a time, as FSDP2 does with fully_shard on every block
            specs["blocks"] = [_block_specs(model) for _ in range(model.n_layers)]
            inits["blocks"] = [_block_inits(model, ()) for _ in range(model.n_layers)]
        params = init(inits, mesh, specs)

        def loss_fn(w, batch):
            x_ids, y_ids = batch
            x = blocks(w["blocks"], embed(w["first"], x_ids))
            return _local_loss(_tied(w), x, y_ids)

        layout_z = fo.zero_layout(params, mesh, specs, stage=layout.zero, data_axis=DATA)
        params, state = fo.zero_init(opt, params, layout_z)
        # donated, as a user at scale runs it: parameters and AdamW state updated in place
        zstep = fo.zero_step(
            loss_fn,
            opt,
            layout_z,
            batch_specs=P(DATA),
            n_micro=m,
            donate=True,
            reduce_once=bool(layout.reduce_once),
        )
        batch = (ids.flatten(0, 1), ids.flatten(0, 1))
        batch = device_put(batch, mesh, P(DATA))

        def step(params, state, batch):
            with low_precision_sums(layout.sums):
                return zstep(params, state, batch)

        return step, (params, state, batch)

    v = layout.virtual
    counts = chunk_layers(model, layout)
    k = max(counts)
    specs = {"stages": _stacked(_block_specs(model), True), "first": first_specs, "last": last_specs}
    inits = {"stages": _block_inits(model, (p * v, k)), "first": first_init, "last": last_init}
    params = init(inits, mesh, specs)
    sub = mesh.submesh((DATA, TENSOR))
    chunk_specs = (_stacked(_block_specs(model), False), act)
    stage_k: Any
    if min(counts) == k:
        stage_k = shard(blocks, sub, chunk_specs, act)
    else:  # the end chunks hold fewer layers; their unused slots get zero gradients
        fns = {n: _chunk_fn(blocks, n, sub, chunk_specs, act) for n in set(counts)}
        stage_k = [fns[n] for n in counts]
    first_k = shard(embed, sub, (first_specs, P(DATA)), act)
    tied_specs = {**last_specs, "w_tied": first_specs["w_emb"]} if gpt else last_specs
    loss_k = shard(head_loss, sub, (tied_specs, act, P(DATA)), P())
    schedule = pipeline_schedule(layout)
    # GPT: the head computes with the embedding's table, held once (in first); the two uses'
    # gradients are summed
    ties = (("w_emb", "w_tied"),) if gpt else ()
    run = pp.pipeline(stage_k, schedule, mesh, loss=loss_k, first=first_k, axis=PIPE, tied=ties)
    # ZeRO 1-3 inside the pipeline: each stage's gradients reduce-scattered over data once a step
    # (ZeRO-1's state is stage 2's there), or at 2-3 with reduce_once=False each chunk's as each
    # of its backwards ends; stage 3 keeps chunks and gathers a stage once a step
    stage = {0: 0, 1: 2, 2: 2, 3: 3}[layout.zero]
    zl = fo.zero_layout(params, mesh, specs, stage=stage, data_axis=DATA)
    params, state = fo.zero_init(opt, params, zl)
    update = fo.zero_update(opt, zl, donate=True)  # in place, as a user at scale runs it
    if stage:  # ZeRO-3 gathers in a low compute dtype (FSDP2's param_dtype), sums in float32
        low = dtype if stage == 3 and dtype.itemsize < 4 else None
        run = fo.zero_pipeline(
            run,
            zl,
            compute_dtype=low,
            reduce_once=layout.reduce_once is not False,
            reshard_after_forward=layout.reshard_after_forward,
        )
    xs = device_put(ids, mesh, P(None, DATA))

    def step(params, state, xs, ys):
        with low_precision_sums(layout.sums):
            res = run(params, xs, ys)
            return update(res.grads, state, params), res.loss

    return step, (params, state, xs, xs)


def _chunk_fn(blocks, n: int, sub: Mesh, in_specs: tuple, out_spec):
    """A chunk of ``n`` layers (of its stacked slots); none: the activation passes through."""
    if n == 0:
        return lambda w, h: h
    return shard(lambda w, x: blocks(w, x, n), sub, in_specs, out_spec)


def pipeline_schedule(layout: Layout):
    """The ``fpar.pipeline`` schedule ``model_step`` runs a pipelined layout with."""
    schedules = {"1f1b": pp.one_f_one_b, "gpipe": pp.gpipe, "zb": pp.zb_h1}
    if layout.schedule not in schedules:
        raise ValueError(
            f"fpar.plan: unknown schedule {layout.schedule!r}; choose one of {sorted(schedules)}."
        )
    p, m, v = layout.pipeline, layout.microbatches, layout.virtual
    return pp.interleaved_1f1b(p, m, v, layout.group) if v > 1 else schedules[layout.schedule](p, m)


def _ends(model: Model, layout: Layout) -> tuple:
    """Specs and inits of the first stage's (embedding) and the last stage's (head) parameters."""
    d = model.d_model
    first_specs, first_init = {"w_emb": P(TENSOR, None)}, {"w_emb": normal((model.vocab, d), std=0.02)}
    if model.kind != "gpt":
        last_specs = {"ln_f": P(), "w_head": P(None, TENSOR)}
        return (
            first_specs,
            last_specs,
            first_init,
            {"ln_f": ones((d,)), "w_head": normal((d, model.vocab), std=0.02)},
        )
    sp = layout.sequence_parallel and layout.tensor > 1
    first_specs["w_pos"] = P(TENSOR, None) if sp else P()  # SP: each device its sequence block's rows
    first_init["w_pos"] = normal((model.seq, d), std=0.02)
    return first_specs, {"ln_f": P(), "ln_f_b": P()}, first_init, {"ln_f": ones((d,)), "ln_f_b": zeros((d,))}


def _tied(w: dict) -> dict:
    """The head's parameters, with the embedding table it is tied to (GPT) under ``w_tied``."""
    if "w_pos" not in w["first"]:
        return w["last"]
    return {**w["last"], "w_tied": w["first"]["w_emb"]}


def _local_loss(w, x, y):
    """The head's loss without the data mean (``zero_step`` averages over the data axis itself)."""
    dtype = x.dtype
    if "ln_f_b" in w:  # GPT: LayerNorm, the head tied to the embedding table [V/t, d]
        h = F.layer_norm(x, x.shape[-1:], w["ln_f"].to(dtype), w["ln_f_b"].to(dtype))
        head = w["w_tied"].to(dtype).t()
    else:
        h = _rms_norm(x, w["ln_f"].to(dtype))
        head = w["w_head"].to(dtype)
    if x.shape[1] != y.shape[1]:  # sequence parallel: the whole sequence for the head
        logits = ops.sp_column_linear(h, head, axis=TENSOR)
    else:
        logits = ops.column_linear(h, head, axis=TENSOR)
    return ops.vocab_cross_entropy(logits, y, axis=TENSOR).mean()


def _stacked(specs: dict, pipe: bool) -> dict:
    lead = (PIPE, None) if pipe else (None,)
    return {k: P(*lead, *s) for k, s in specs.items()}
