"""Where each model chunk lives: Megatron's interleaved layout on a stacked leading dim.

A model cut into ``L = p * v`` chunks puts chunk ``k`` (its *virtual stage*) on pipeline stage
``k % p`` as that stage's chunk ``k // p`` (arXiv:2104.04473 §2.2), so a microbatch visits
stages 0, 1, .., p-1, 0, 1, .. .  Stacked in *model order* the chunks are indexed by ``k``;
``P("pipe")`` on the stacked dim gives stage ``s`` the contiguous rows ``s v .. s v + v - 1``,
so the stacked dim must be in *stage-major* order, row ``s v + c`` holding chunk ``c p + s``.
With ``v = 1`` the two orders are the same.
"""

from __future__ import annotations

from typing import Any

import torch

from .._tree import tree_map
from ._schedule import check_layout, locate, virtual

__all__ = ["model_major", "stage_major"]


def stage_major(tree: Any, p: int, v: int = 1, *, layout: str = "interleaved") -> Any:
    """Reorder leaves stacked in model order (chunk ``k`` at row ``k``) into stage-major order.

    Row ``s * v + c`` of the result is model chunk ``virtual(s, c)``: ``c * p + s`` in the
    interleaved layout, ``s`` and ``2 p - 1 - s`` in the V layout (ZB-V, DualPipeV), so that
    the in-spec ``P("pipe", ...)`` hands stage ``s`` its ``v`` chunks in chunk order.
    """
    check_layout("stage_major", layout, v)
    index = torch.tensor([virtual(s, c, p, v, layout) for s in range(p) for c in range(v)])
    return tree_map(lambda t: _take(t, index, p * v, "stage_major"), tree)


def model_major(tree: Any, p: int, v: int = 1, *, layout: str = "interleaved") -> Any:
    """The inverse of ``stage_major``: back to model order (e.g. for gradients)."""
    check_layout("model_major", layout, v)
    index = torch.tensor([s * v + c for s, c in (locate(k, p, v, layout) for k in range(p * v))])
    return tree_map(lambda t: _take(t, index, p * v, "model_major"), tree)


def _take(t: torch.Tensor, index: torch.Tensor, n: int, api: str) -> torch.Tensor:
    if t.dim() == 0 or t.shape[0] != n:
        raise ValueError(
            f"fpar.pipeline.{api}: a leaf of shape {tuple(t.shape)} is not stacked over p * v = {n} "
            f"chunks on dim 0."
        )
    return t.index_select(0, index.to(t.device))
