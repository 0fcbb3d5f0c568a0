"""Row layouts of column-parallel parameters: which of the module's rows each device's block holds.

A column-parallel parameter's output dim is a list of *segments*: ``("split", size)`` is split
contiguously over the ``n`` devices; ``("kv", kv_heads, head_dim)`` holds key/value heads, split
when ``n`` divides ``kv_heads``, else each head replicated on the ``n / kv_heads`` consecutive
devices whose query heads use it (Megatron's rule).  Device ``r``'s block is its rows of every
segment in order (a fused ``[q | k | v]`` weight: its q heads, then its k and v heads), so the fpar
global tensor is ``module_tensor.index_select(dim, index)`` and, with replicated heads, larger.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def segment_size(segment: tuple) -> int:
    return segment[1] if segment[0] == "split" else segment[1] * segment[2]


def layout_index(segments: list[tuple], n: int) -> tuple[Tensor | None, Tensor | None, int]:
    """``(index, tied rows, group)`` of a layout on an ``n``-way axis.

    ``index``: the module rows of the fpar global tensor, ``None`` when that is the identity.
    ``tied rows``: positions inside a device's block that hold replicated kv rows (``None`` when
    no head is replicated); ``group``: how many consecutive devices hold each replica.
    """
    blocks, tied, group = [], [], 1
    for r in range(n):
        rows, offset, local = [], 0, 0
        for seg in segments:
            size = segment_size(seg)
            if seg[0] == "split" or seg[1] % n == 0:
                part = size // n
                rows.append(torch.arange(offset + r * part, offset + (r + 1) * part))
            else:
                kv, head_dim = seg[1], seg[2]
                group = n // kv
                head = r // group
                rows.append(torch.arange(offset + head * head_dim, offset + (head + 1) * head_dim))
                if r == 0:
                    tied.append(torch.arange(local, local + head_dim))
            offset += size
            local += rows[-1].numel()
        blocks.append(torch.cat(rows))
    index = torch.cat(blocks)
    if index.numel() == offset and torch.equal(index, torch.arange(offset)):
        index = None
    return index, (torch.cat(tied) if tied else None), group


def inverse(index: Tensor) -> Tensor:
    """The first position of each value ``0..max`` in ``index`` (undoes ``index_select(d, index)``)."""
    size = int(index.max()) + 1
    first = torch.full((size,), index.numel(), dtype=torch.long)
    return first.scatter_reduce(0, index, torch.arange(index.numel()), reduce="amin")
