"""The forwards ``tensor_parallel`` gives the split layers of its private local copy.

Each is installed with ``functools.partial`` over the module (and, where it wraps the module's own
forward, that bound forward), and runs on this device's blocks inside ``fpar.shard``.  fpar's
collectives give the exact gradient of each (a replicated input gets its summed cotangent), so
none needs a backward of its own: where transformers' plan styles add gradient all-reduces
(``replicated_with_grad_allreduce``, ``moe_tp_experts``' routing weights) fpar needs nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from .._collectives import all_gather, all_gather_invariant, axis_index, psum, psum_scatter
from ._megatron import _local_ids, vocab_cross_entropy

Tensor = torch.Tensor
_API = "fpar.ops.tensor_parallel"


def row_linear(module: nn.Linear, axis: str, x: Tensor) -> Tensor:
    """A row-parallel ``nn.Linear``: all-reduce the partial product, then add the bias once."""
    y = psum(F.linear(x, module.weight), axis)
    return y if module.bias is None else y + module.bias


def row_linear_heads(module: nn.Linear, axis: str, n: int, x: Tensor) -> Tensor:
    """A row-parallel ``nn.Linear`` whose output has one entry a head: this device's heads' block.

    Doge's ``dt_proj`` mixes every kv head's values into one gate a kv head: the partial product
    all-reduced, then the block of this device's heads (and their bias).
    """
    y = psum(F.linear(x, module.weight), axis)
    y = y.unflatten(-1, (n, -1)).movedim(-2, 0)[axis_index(axis)]
    return y if module.bias is None else y + module.bias


def row_conv1d(module: nn.Module, axis: str, x: Tensor) -> Tensor:
    """A row-parallel HF ``Conv1D`` (``[in/n, out]`` block): psum, then the bias."""
    y = psum(x @ module.weight, axis)
    return y if module.bias is None else y + module.bias


def sp_row(module: nn.Linear, axis: str, x: Tensor) -> Tensor:
    """Megatron-SP's exit: the partial product reduce-scattered along the sequence, then the bias.

    ``x[B, T, F/n] -> [B, T/n, D]``.
    """
    y = psum_scatter(F.linear(x, module.weight), axis, scatter_dimension=1, tiled=True)
    return y if module.bias is None else y + module.bias


def gather_sequence(axis: str, where: str, module: nn.Module, args: tuple, kwargs: dict):
    """A forward pre-hook of a tensor-parallel region (attention, MLP, the head): the input gathered.

    Its sequence blocks all-gathered, as torchtitan's ``PrepareModuleInput(Shard(1) -> Replicate())``.

    ``all_gather``, whose transpose reduce-scatters: each device's block gets the sum of every
    device's gradient for it.  The region's own code then runs on the whole sequence.
    """
    if args:
        return (all_gather(args[0], axis, axis=1, tiled=True), *args[1:]), kwargs
    if isinstance(kwargs.get("hidden_states"), Tensor):
        return args, {
            **kwargs,
            "hidden_states": all_gather(kwargs["hidden_states"], axis, axis=1, tiled=True),
        }
    raise TypeError(
        f"{_API}: sequence parallelism gathers the input of {where}, but it was called with no "
        f"positional argument and no hidden_states= tensor ({sorted(kwargs)})."
    )


def own_block(axis: str, n: int, module: nn.Module, args: tuple, output):
    """A forward hook: the output's sequence (dim 1) cut to this device's block.

    Of a tuple: its first element and every other of the gathered sequence's length.  With ``gather_sequence`` before it, a replicated module that mixes along the sequence (a
    linear attention's convolution and scan) runs on the whole sequence, and the residual stream
    takes back its block.
    """
    first = output[0] if isinstance(output, (tuple, list)) else output
    length = (
        args[0].shape[1] if args and isinstance(args[0], Tensor) and args[0].dim() > 1 else first.shape[1]
    )

    def block(t):
        return t.unflatten(1, (n, -1)).movedim(1, 0)[axis_index(axis)]

    if isinstance(output, (tuple, list)):
        # every per-token output: a hyper-connection's (post weights, mixed stream) both go on
        # along the residual (DeepSeek-V4's, HY-V4's)
        per_token = [
            block(t) if i == 0 or (isinstance(t, Tensor) and t.dim() > 1 and t.shape[1] == length) else t
            for i, t in enumerate(output)
        ]
        return type(output)(per_token)
    return block(output)


def sequence_block(axis: str, n: int, where: str, module: nn.Module, args: tuple, kwargs: dict):
    """A forward pre-hook of the first decoder layer: its hidden states cut to this device's block.

    The model's own code before the layers (embedding, positions, masks) runs on the whole
    sequence; from the first layer on the residual stream is split along the sequence.
    """
    x = args[0] if args else kwargs["hidden_states"]
    if x.dim() < 2 or x.shape[1] % n:
        raise ValueError(
            f"{_API}: sequence parallelism splits the sequence over {axis!r} ({n} devices), but "
            f"{where}'s hidden states have shape {tuple(x.shape)}: the sequence (dim 1) must be "
            f"divisible by {n}. Pad the sequence."
        )
    block = x.unflatten(1, (n, -1)).movedim(1, 0)[axis_index(axis)]
    if args:
        return (block, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": block}


def split_input(row, n: int, axis: str, x: Tensor) -> Tensor:
    """``rowwise_split_input``: the input arrives whole; take this device's slice, then ``row``."""
    return row(x.unflatten(-1, (n, -1)).movedim(-2, 0)[axis_index(axis)])


def gather_output(forward, axis: str, *args, **kwargs) -> Tensor:
    """``colwise_gather_output`` / ``embedding_colwise``: the split last dim all-gathered."""
    y = forward(*args, **kwargs)
    return all_gather_invariant(y, axis, axis=y.dim() - 1, tiled=True)


def all_reduce_output(forward, axis: str, *args, **kwargs):
    """``all_reduce`` (and ``moe_tp_experts``): the module's partial output summed over the axis."""
    y = forward(*args, **kwargs)
    return None if y is None else psum(y, axis)


def vocab_embedding(module: nn.Embedding, forward, axis: str, padding_idx, ids: Tensor) -> Tensor:
    """A vocabulary-parallel embedding: the module's own forward on the owned rows, one psum.

    A scaled embedding (Gemma's) keeps its scale; rows it does not own are zeros.  ``padding_idx``
    (global; the copy's is cleared) gets no gradient, as in ``nn.Embedding``.
    """
    local, outside = _local_ids(ids, module.weight.shape[0], axis)
    if padding_idx is None:
        x = forward(local)
    elif type(module).forward is nn.Embedding.forward:  # a plain lookup: its padding rows detached
        x = forward(local)
        x = torch.where((ids == padding_idx).unsqueeze(-1), x.detach(), x)
    else:  # a lookup and more (a norm after it, Inkling's): only the lookup's padding rows detached
        with _PaddingRows(module.weight, (ids == padding_idx).unsqueeze(-1)):
            x = forward(local)
    return psum(x.masked_fill(outside.unsqueeze(-1), 0.0), axis)


class _PaddingRows(TorchFunctionMode):
    """Inside an embedding module's own forward: its ``F.embedding`` lookups' padding rows detached.

    ``nn.Embedding(padding_idx=...)`` gives the table's padding row no gradient, not what follows
    the lookup: a module that normalises after it (a weighted norm) still trains the norm's
    weight on padding tokens.
    """

    def __init__(self, weight: Tensor, pad: Tensor):
        super().__init__()
        self.weight, self.pad = weight, pad

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is F.embedding and len(args) > 1 and args[1] is self.weight:
            out = torch.where(self.pad, out.detach(), out)
        return out


def split_rms_norm(module: nn.Module, axis: str, width: int, repeats: int, x: Tensor) -> Tensor:
    """OLMo 2's RMSNorm over a width split over the axis: the sum of squares psum'd.

    Same arithmetic as ``Olmo2RMSNorm`` (float32 statistics); ``repeats`` > 1 when the block holds
    replicated kv heads (each counted that many times by the psum).
    """
    dtype = x.dtype
    h = x.to(torch.float32)
    total = psum(h.pow(2).sum(-1, keepdim=True), axis)
    variance = (total / repeats if repeats > 1 else total) / width
    h = h * torch.rsqrt(variance + module.variance_epsilon)
    return (module.weight * h).to(dtype)


def tie_replicas(w: Tensor, axis: str, dim: int, rows: Tensor, kv: int, group: int) -> Tensor:
    """Replicated kv rows: their value unchanged, their gradient the sum over the replicas.

    ``rows`` are the replicated positions of this device's block; device ``r`` holds kv head
    ``r // group``.  The rows go through one ``psum`` of a ``[kv, ...]`` buffer (each device's rows in
    its head's slot) whose only use is its gradient: the backward sums each head's cotangents
    over the devices holding it in one all-reduce, so every replica gets bit-identical gradients
    (an optimizer keeps them equal).  The value is exactly the rows (``x - x.detach()`` is zero).
    """
    rows = rows.to(w.device)
    part = w.index_select(dim, rows)
    slot = torch.arange(kv, device=w.device) == axis_index(axis) // group
    slot = slot.to(w.dtype).reshape(kv, *([1] * part.dim()))
    mine = (psum(slot * part.unsqueeze(0), axis) * slot).sum(0)
    return w.index_copy(dim, rows, part.detach() + (mine - mine.detach()))


def vocab_loss(axis: str, loss_type, logits: Tensor, labels: Tensor, vocab_size: int, **kwargs) -> Tensor:
    """HF's ``ForCausalLMLoss`` on vocabulary-split logits (``fpar.ops.vocab_cross_entropy``)."""
    if loss_type not in (None, "ForCausalLM"):
        raise ValueError(
            f"{_API}: with a vocabulary-parallel lm_head the logits are split; the {loss_type} loss "
            f"cannot use them. Compute it from the logits with fpar.ops.vocab_cross_entropy(logits, "
            f"targets, axis={axis!r}), or mark the head 'replicate'."
        )
    ignore = kwargs.get("ignore_index", -100)
    shift = kwargs.get("shift_labels")
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()  # HF upcasts the loss computation
    if shift is None:
        shift = F.pad(labels, (0, 1), value=ignore)[..., 1:]
    valid = shift != ignore
    tok = vocab_cross_entropy(logits, shift.masked_fill(~valid, 0), axis=axis)
    total = tok.masked_fill(~valid, 0.0).sum()
    count = kwargs.get("num_items_in_batch")
    return total / (valid.sum() if count is None else count)


def expert_parallel(
    module: nn.Module,
    forward,
    axis: str,
    n: int,
    hidden_states: Tensor,
    top_k_index: Tensor,
    top_k_weights: Tensor,
) -> Tensor:
    """``ep_dispatch_experts``: a transformers experts module whose experts are split over ``axis``.

    Its forward takes this device's tokens ``[T, D]`` with their routing (global expert ids
    ``[T, K]``, weights ``[T, K]``) and returns ``sum_k weights[t, k] * expert_{ids[t, k]}(x[t])``.
    Each (token, choice) pair goes to the device holding its expert and back (``fpar.ops.moe``'s
    dispatch), where the module's own forward (``module.num_experts`` local experts) runs on the
    received rows, each with its local expert id and weight 1 (empty static slots: weight 0);
    the routing weights are applied here, on the tokens' device.
    """
    from ._moe_dispatch import _dynamic_shapes_ok, _expert_parallel, _expert_parallel_exact, _real_frame

    e_l = int(module.num_experts)  # type: ignore[arg-type]  # an int (checked at the plan)
    ref = hidden_states.new_empty(e_l, 0)  # the dispatch reads the local experts from its dim 0

    def exact(rows: Tensor, counts: list) -> Tensor:  # rows sorted by local expert
        ids = torch.arange(e_l, device=rows.device).repeat_interleave(
            torch.tensor(counts, device=rows.device), output_size=rows.shape[0]
        )
        return forward(rows, ids.unsqueeze(-1), rows.new_ones(rows.shape[0], 1))

    def static(rows: Tensor, expert: Tensor, valid: Tensor) -> Tensor:
        return forward(rows, expert.unsqueeze(-1), valid.to(rows.dtype).unsqueeze(-1))

    frame = _real_frame()
    if frame is not None and _dynamic_shapes_ok(hidden_states):
        y = _expert_parallel_exact(hidden_states, top_k_index, None, ref, ref, axis, n, frame, ffn=exact)
    else:
        y = _expert_parallel(hidden_states, top_k_index, None, ref, ref, axis, n, ffn=static)
    return (top_k_weights.unsqueeze(-1).to(y.dtype) * y).sum(1).to(hidden_states.dtype)
