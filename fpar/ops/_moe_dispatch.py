"""Where the routed rows go: ``fpar.ops.moe``'s dispatch to the experts, their FFN, and the combine.

**Exact shapes where shapes may depend on data.**  Unsharded (outside ``vmap``) and on a real
mesh the per-device function runs on plain tensors, so the kept pairs are sorted by expert
(stable: token order within an expert) and each expert computes exactly its rows: one
``torch._grouped_mm`` per weight where the build has it and the operands fit (fp32/bf16/fp16,
rows of a multiple of 16 bytes; measured faster than per-expert matmuls on this CPU build, fwd+bwd
30 vs 41 ms at 2048 rows D=256 H=512 E=8), else one matmul per expert segment (a loop over
experts, never over tokens).  One host read of the counts per layer (``.tolist()``) sizes them.

**Expert parallelism on a real mesh: exact counts** (``axis="expert"``; tokens split over the
axis, experts too, ``E / n`` per device, ``w_in``/``w_out`` split on dim 0, the router
replicated).  Megatron-Core / torchtitan / MegaBlocks style:

1. the kept pairs sorted by global expert, so by destination device, then local expert;
2. one small ``all_to_all`` of the per-expert counts ``[n, E/n]`` (int64): each device learns
   how many rows of each of its experts every source sends;
3. an ``all_to_all`` of exactly those rows with those split sizes (``all_to_all_v`` of
   ``fpar/_dist/exchange.py``; the sizes are data, not part of the plan's signature, so ranks
   whose routing differs, as they always do, agree), regrouped source-major -> expert-major,
   the grouped FFN on exactly the rows received, the inverse regrouping, and the same exchange
   back with the split sizes swapped.  The backward is the transpose: the two exchanges again,
   splits reversed.

Per-device bytes (``fpar.comm_stats()``, the bytes that actually leave the process), ``s`` the
element size, ``out`` the rows this device sends to other devices' experts and ``in`` the rows
it receives from other devices::

    forward   (out + in) D s              dispatch + combine
              + (n - 1)/n * E * 8         the counts
    backward  (out + in) D s              the two transposes

Under balanced routing ``out = in = (n-1)/n * T_local * top_k``: ``(n-1)/n * T_local * top_k *
D * s`` per exchange, four exchanges per step.  Under a skewed router the bytes are the rows
routed, and the memory the routed rows (every token on one expert at T = 8192 runs dropless).

**The in-process mesh: static slots.**  There every per-device function runs under
``torch.func.vmap``, which forbids data-dependent shapes, so each (source -> destination) slot is
padded to its static worst case: a token picks ``top_k`` distinct experts, at most ``min(E/n,
top_k)`` of them on one device, so a slot holds ``C = T_local * min(E/n, top_k)`` rows, sent with
two ``all_to_all`` of the payload plus one of the slots' local expert ids.  The compute does not
pay for the padding: the received slots are sorted by expert with the empty ones last, outside
every group, and ``_DevicesFFN``'s vmap rule folds the devices of a mesh level into the rows and
the groups of one pair of grouped matmuls, which compute only the valid rows (without
``torch._grouped_mm``, or in float64, tiles of one expert each, every expert's group padded to a
tile multiple, one batched matmul: at most ``1.5 R`` rows; megablocks' block-sparse layout, Gale
et al. 2022, arXiv:2211.15841).  The static slots' bytes, as the in-process mesh counts them::

    2 * (n - 1) * C * D * s        the dispatch and the combine  (n * C * D elements each)
    + (n - 1) * C * 8              the local expert id of every slot (int64)

and ``2 (n-1) C D s`` again backward: ``n`` times the balanced exact count when ``E/n >= top_k``.
(A ``vmap`` inside a real-mesh call, jacrev or per-example gradients, also takes the static slots.)

Shape suffixes as in ``_moe.py``: ``T`` tokens, ``D`` model dim, ``E`` experts, ``K`` = top_k, ``R`` rows.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch._C import _functorch
from torch._subclasses.fake_tensor import is_fake

from .._collectives import all_to_all, frames

Tensor = torch.Tensor

# Tiles per expert that the rows would fill if spread evenly: tile rows b = ceil(R / (2 E)).
_TILES_PER_EXPERT = 2


def _axes(axis) -> tuple:
    return () if axis is None else (axis,) if isinstance(axis, str) else tuple(axis)


def _dynamic_shapes_ok(x: Tensor) -> bool:
    """Whether shapes may depend on the routing.

    No vmap (the in-process mesh, jacrev), no forward AD, and real values to read, or
    ``fpar.plan``'s simulated device (meta tensors, where the routing is taken to be balanced:
    ``_counts``).  Not under ``torch.compile``: a compiled graph has static shapes (no host read
    of the counts), so a traced call takes the fixed-shape path.
    """
    if torch.compiler.is_compiling():
        return False
    if x.is_meta or is_fake(x):
        from .. import _dist

        if not (x.is_meta and _dist.simulated()):
            return False
    if any(i.key() != _functorch.TransformType.Grad for i in _functorch.get_interpreter_stack() or ()):
        return False
    return torch.autograd.forward_ad._current_level < 0


def _real_frame():
    """The running real-mesh ``fpar.shard`` frame (its ``direct`` issues process-group calls), or None."""
    stack = frames()
    return stack[-1] if stack and stack[-1].direct is not None else None


def _sorted_pairs(idx_TK: Tensor, keep_TK: Tensor | None, e: int) -> tuple[Tensor, Tensor]:
    """The kept pairs sorted by expert (stable: token order within an expert), and counts ``[E]``."""
    expert = idx_TK.reshape(-1)
    if keep_TK is not None:
        expert = torch.where(keep_TK.reshape(-1), expert, e)  # dropped pairs sort last, uncounted
    order = torch.argsort(expert, stable=True)
    if expert.is_meta:  # fpar.plan: bincount has no meta kernel; the counts are taken balanced (_counts)
        return order, expert.new_empty((e,))
    return order, torch.bincount(expert, minlength=e + 1)[:e]


def _local_exact(x_TD: Tensor, idx_TK: Tensor, keep_TK: Tensor | None, w_in: Tensor, w_out: Tensor) -> Tensor:
    """Every expert local, exact shapes: rows sorted by expert, one grouped FFN, back in place."""
    t, d = x_TD.shape
    k, e = idx_TK.shape[1], w_in.shape[0]
    order, counts_E = _sorted_pairs(idx_TK, keep_TK, e)
    counts = _counts(counts_E, t * k)
    sel = order[: sum(counts)]  # the kept pairs, by expert
    out = _ffn_exact(x_TD.index_select(0, sel // k), counts, w_in, w_out)
    return out.new_zeros(t * k, d).index_copy(0, sel, out).view(t, k, d)


def _expert_parallel_exact(
    x_TD: Tensor,
    idx_TK: Tensor,
    keep_TK: Tensor | None,
    w_in: Tensor,
    w_out: Tensor,
    axis,
    n: int,
    frame,
    ffn: Callable[[Tensor, list], Tensor] | None = None,
) -> Tensor:
    """The real mesh's exact-count dispatch: ``[T, K, D]``, each pair's expert output (0 if dropped).

    ``ffn(rows, counts)``: the local experts on rows sorted by local expert, ``counts[e]`` rows
    each (default: ``gelu(rows @ w_in[e]) @ w_out[e]``, ``_ffn_exact``); ``w_in.shape[0]`` is
    the number of local experts either way.

    1. the pairs sorted by global expert (so by destination device, then local expert);
    2. one small all_to_all of the per-expert counts ``[n, E/n]``: each device learns how many
       rows of each of its experts every source sends;
    3. an all_to_all of exactly those rows (split sizes as data), regrouped from source-major
       to expert-major, one grouped FFN on exactly the rows received, the inverse regrouping,
       and the same all_to_all back with the split sizes swapped.
    """
    t, d = x_TD.shape
    k, e_l = idx_TK.shape[1], w_in.shape[0]
    axes = _axes(axis)
    order, counts_E = _sorted_pairs(idx_TK, keep_TK, e_l * n)
    recv_NE = all_to_all(counts_E.view(n, e_l), axes, 0, 0)  # [source, local expert]
    if counts_E.is_meta:  # fpar.plan's simulated device: every device routes the same, balanced counts
        flat = _counts(counts_E, t * k)
        sent_NE = [flat[s * e_l : (s + 1) * e_l] for s in range(n)]
        got_NE = [list(sent_NE[0]) for _ in range(n)] if keep_TK is None else sent_NE
    else:
        sent_NE, got_NE = torch.stack([counts_E.view(n, e_l), recv_NE]).tolist()  # one host read
    send = tuple(sum(r) for r in sent_NE)
    recv = tuple(sum(r) for r in got_NE)
    sel = order[: sum(send)]  # the kept pairs, by destination then local expert
    rows = frame.direct("all_to_all_v", axes, (send, recv), x_TD.index_select(0, sel // k))
    per_expert = [sum(got_NE[s][j] for s in range(n)) for j in range(e_l)]
    run = ffn or (lambda r, counts: _ffn_exact(r, counts, w_in, w_out))
    if n > 1 and e_l > 1:  # source-major -> expert-major
        segs = torch.arange(rows.shape[0], device=rows.device).split([c for r in got_NE for c in r])
        perm = torch.cat([segs[s * e_l + j] for j in range(e_l) for s in range(n)])
        out = run(rows.index_select(0, perm), per_expert)
        out = out.new_zeros(out.shape).index_copy(0, perm, out)
    else:
        out = run(rows, per_expert)
    back = frame.direct("all_to_all_v", axes, (recv, send), out)
    return back.new_zeros(t * k, d).index_copy(0, sel, back).view(t, k, d)


def _counts(counts_E: Tensor, pairs: int) -> list:
    """Pairs per expert.

    Read from ``counts_E``, or on ``fpar.plan``'s meta tensors (no values to route by) balanced:
    ``pairs`` spread evenly over the experts, the first ones one more.
    """
    if not counts_E.is_meta:
        return counts_E.tolist()
    e = counts_E.shape[0]
    return [pairs // e + (1 if j < pairs % e else 0) for j in range(e)]


def _ffn_exact(rows_RD: Tensor, counts: list, w_in: Tensor, w_out: Tensor) -> Tensor:
    """``gelu(rows @ w_in[e]) @ w_out[e]`` for rows sorted by expert, ``counts[e]`` rows each.

    One ``torch._grouped_mm`` per weight where the build has it and the operands fit its
    constraints (fp32/bf16/fp16, rows of a multiple of 16 bytes); otherwise one matmul per
    expert on its segment (a loop over experts, never over tokens).
    """
    if _grouped_mm_fits(rows_RD, w_in, w_out):
        offs = torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32)
        if offs.device != rows_RD.device:  # made on the host, then moved (meta: inside torch.func.grad too)
            offs = offs.to(rows_RD.device)
        out = _gmm_ffn(rows_RD, offs, w_in, w_out)
        if out is not None:
            return out
    outs = [
        F.gelu(seg @ wi) @ wo for seg, wi, wo in zip(rows_RD.split(counts), w_in.unbind(0), w_out.unbind(0))
    ]
    return torch.cat(outs)


def _grouped_mm_fits(rows: Tensor, w_in: Tensor, w_out: Tensor) -> bool:
    if not _GROUPED_MM or rows.shape[0] == 0 or rows.dtype not in _GROUPED_DTYPES:
        return False
    if torch.compiler.is_compiling():
        # Dynamo cannot trace the functorch interpreter stack (``_top_is_vmap``) nor the sorted
        # path's data-dependent group sizes: a compiled MoE runs the static tiles (the same values)
        return False
    s = rows.element_size()
    if (w_in.shape[1] * s) % 16 or (w_in.shape[2] * s) % 16:  # its stride rule
        return False
    return all(t.dtype == rows.dtype for t in (w_in, w_out))


def _top_is_vmap() -> bool:
    stack = _functorch.get_interpreter_stack() or ()
    return bool(stack) and stack[-1].key() == _functorch.TransformType.Vmap


def _sorted_ffn(
    rows: Tensor, key: Tensor, groups: int, w_in: Tensor, w_out: Tensor, strict: bool = False
) -> Tensor | None:
    """Row ``r`` through group ``key[r]``'s expert (``w_*[key[r]]``), zero where ``key[r] < 0``.

    Fixed shapes: the rows are sorted by group, invalid ones last (outside every group, so never
    computed), two grouped matmuls, and the inverse permutation.
    """
    last = torch.where(key < 0, groups, key)
    order = torch.argsort(last, stable=True)
    counts = torch.zeros(groups + 1, dtype=torch.long, device=rows.device).scatter_add(
        0, last, torch.ones_like(last)
    )
    offs = counts[:groups].cumsum(0).to(torch.int32)
    out = _gmm_ffn(rows.index_select(0, order), offs, w_in, w_out, strict)
    if out is None:
        return None
    out = out.new_zeros(out.shape).index_copy(0, order, out)  # row r back at r
    return torch.where((key >= 0).unsqueeze(1), out, 0.0)


class _DevicesFFN(torch.autograd.Function):  # not fpar-internal: the mesh's implicit pvary sees its operands
    """``_sorted_ffn`` over the devices of one mesh level at once (the in-process mesh).

    Under ``vmap`` torch has no batching rule for ``torch._grouped_mm`` and would loop over the
    devices, each slice's backward a full-size copy.  This Function's vmap rule sees the level's
    device dim: it folds the devices into the rows and the groups (device ``b``'s expert ``e`` is
    group ``b E + e`` when the weights vary over the level; ``e`` when they are shared), so one
    pair of grouped matmuls does every device's valid rows.  The rule runs plain ops, which
    the outer levels (a grad transform, other mesh axes) see as usual; the Function's own forward
    is never reached (it is applied only when the top transform is a vmap).
    """

    generate_vmap_rule = False

    @staticmethod
    def forward(rows, key, w_in, w_out):
        return _sorted_ffn(rows, key, w_in.shape[0], w_in, w_out)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, ct):
        raise NotImplementedError("fpar.ops.moe: _DevicesFFN is applied under vmap only")

    @staticmethod
    def vmap(info, in_dims, rows, key, w_in, w_out):
        b = info.batch_size
        rd, kd, wid, wod = in_dims

        def batched(t, d):
            return t.movedim(d, 0) if d is not None else t.expand(b, *t.shape)

        rows, key = batched(rows, rd), batched(key, kd)
        if wid is None and wod is None:
            groups, wi, wo = w_in.shape[0], w_in, w_out
            key_flat = key
        else:
            wi, wo = batched(w_in, wid), batched(w_out, wod)
            e = wi.shape[1]
            wi, wo = wi.flatten(0, 1), wo.flatten(0, 1)
            groups = b * e
            dev = torch.arange(b, device=key.device).unsqueeze(1) * e
            key_flat = torch.where(key < 0, key, key + dev)
        out = _sorted_ffn(rows.flatten(0, 1), key_flat.flatten(), groups, wi, wo, strict=True)
        return out.view(rows.shape), 0


def _gmm_ffn(rows: Tensor, offs: Tensor, w_in: Tensor, w_out: Tensor, strict: bool = False) -> Tensor | None:
    """Two ``torch._grouped_mm`` (rows ``offs[e-1]:offs[e]`` use expert ``e``), or None if it refuses.

    Under vmap (the in-process mesh) torch has no batching rule for it and loops over the
    devices (its warning is silenced: a handful of devices, each a grouped matmul).
    """
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*batching rule for aten::_grouped_mm")
            h = F.gelu(torch._grouped_mm(rows, w_in.contiguous(), offs=offs))
            return torch._grouped_mm(h, w_out.contiguous(), offs=offs)
    except RuntimeError:  # an operand it cannot take (alignment, layout): the exact fallback
        if strict:
            raise
        return None


_GROUPED_MM = hasattr(torch, "_grouped_mm")
_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _expert_parallel(
    x_TD: Tensor,
    idx_TK: Tensor,
    keep_TK: Tensor | None,
    w_in: Tensor,
    w_out: Tensor,
    axis,
    n: int,
    ffn: Callable[[Tensor, Tensor, Tensor], Tensor] | None = None,
) -> Tensor:
    """Fixed-shape dispatch (vmap, the in-process mesh): each pair to its expert's device and back.

    ``ffn(rows, expert, valid)``: the local experts on every received slot, ``expert`` its local
    expert (0 where not ``valid``), each row's output (0 where not ``valid``; default:
    ``_grouped_ffn``'s gelu FFN of ``w_in``, ``w_out``).
    """
    t, d = x_TD.shape
    k = idx_TK.shape[1]
    e_local = w_in.shape[0]
    cap = t * min(e_local, k)  # static worst case of one (source -> destination) slot
    expert = idx_TK.reshape(-1)
    dest, local = expert // e_local, expert % e_local
    pos = dest * cap + _rank_in_group(dest, n)  # this pair's row in the [n, cap] send buffer
    if keep_TK is not None:
        pos = torch.where(keep_TK.reshape(-1), pos, n * cap)  # a dropped pair: the dump slot
    device = x_TD.device
    token = torch.arange(t * k, device=device) // k
    slot_token = torch.full((n * cap + 1,), t, dtype=torch.long, device=device).scatter(0, pos, token)
    slot_expert = torch.full((n * cap + 1,), -1, dtype=torch.long, device=device).scatter(0, pos, local)
    slot_token, slot_expert = slot_token[: n * cap], slot_expert[: n * cap]
    x_pad = torch.cat([x_TD, x_TD.new_zeros(1, d)])  # row t: the zeros of an empty slot
    send = x_pad[slot_token].view(n, cap, d)
    recv = all_to_all(send, axis, 0, 0).reshape(n * cap, d)  # rows from every source device
    recv_expert = all_to_all(slot_expert.view(n, cap), axis, 0, 0).reshape(n * cap)
    if ffn is None:
        rows = torch.arange(n * cap, device=device)
        out = _grouped_ffn(recv, rows, recv_expert.clamp(min=0), recv_expert >= 0, w_in, w_out)
    else:
        out = ffn(recv, recv_expert.clamp(min=0), recv_expert >= 0)
    back = all_to_all(out.view(n, cap, d), axis, 0, 0).reshape(n * cap, d)
    if keep_TK is not None:
        back = torch.cat([back, back.new_zeros(1, d)])
    return back[pos].view(t, k, d)


def _rank_in_group(group: Tensor, n: int) -> Tensor:
    """For each row, how many earlier rows share its group (``group`` in ``[0, n)``)."""
    onehot = F.one_hot(group, n)
    return ((onehot.cumsum(0) - onehot) * onehot).sum(1)


def _grouped_ffn(
    x: Tensor, src: Tensor, expert: Tensor, valid: Tensor | None, w_in: Tensor, w_out: Tensor
) -> Tensor:
    """``gelu(x[src[r]] @ w_in[expert[r]]) @ w_out[expert[r]]`` for every row ``r`` (0 where not ``valid``).

    Rows are grouped by expert into tiles of ``b`` rows of one expert (each group padded to a
    multiple of ``b``), then every tile is multiplied by its expert's weights in one batched
    matmul.  All shapes depend only on the number of rows and experts, never on the routing.
    """
    r, e, d = src.shape[0], w_in.shape[0], x.shape[1]
    if _grouped_mm_fits(x, w_in, w_out):
        # Rows sorted by expert (invalid ones last, outside every group): torch._grouped_mm computes
        # only the rows inside the groups, so the cost is the valid rows', not the static bound's.
        key = expert if valid is None else torch.where(valid, expert, -1)
        rows = x.index_select(0, src)
        if _top_is_vmap():  # the mesh's level: one grouped matmul over every device's rows
            out = _DevicesFFN.apply(rows, key, w_in, w_out)
        else:
            out = _sorted_ffn(rows, key, e, w_in, w_out)
        if out is not None:
            return out
    b = max(1, math.ceil(r / (_TILES_PER_EXPERT * e)))
    tiles = math.ceil(r / b) + e
    slots = tiles * b
    onehot = F.one_hot(expert, e)
    if valid is not None:
        onehot = onehot * valid.unsqueeze(1)
    padded = (onehot.sum(0) + b - 1) // b * b
    end = padded.cumsum(0)
    pos = (end - padded)[expert] + ((onehot.cumsum(0) - onehot) * onehot).sum(1)
    if valid is not None:
        pos = torch.where(valid, pos, slots)  # the dump slot
    slot_src = torch.full((slots + 1,), x.shape[0], dtype=torch.long, device=x.device).scatter(0, pos, src)
    x_pad = torch.cat([x, x.new_zeros(1, d)])
    tiles_BD = x_pad[slot_src[:slots]].view(tiles, b, d)
    starts = torch.arange(tiles, device=x.device) * b
    tile_expert = (end.unsqueeze(0) <= starts.unsqueeze(1)).sum(1).clamp(max=e - 1)
    h = F.gelu(tiles_BD @ w_in[tile_expert])
    out = (h @ w_out[tile_expert]).reshape(slots, d)
    return torch.cat([out, out.new_zeros(1, d)])[pos]
