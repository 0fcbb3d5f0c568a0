"""Mixed precision: low-precision compute, fp32 master weights, dynamic loss scaling.

``mixed_precision(optimizer, compute_dtype=..., loss_scale=...)`` wraps an optimizer.  The
parameters stay in their own dtype (fp32: the master weights) and so does the optimizer state;
the step builders (``zero_step``) run the loss in ``compute_dtype`` (floating parameters and
batch leaves are cast on the way in, the loss is cast back to fp32) and multiply it by the
current loss scale.  The wrapper's ``update`` divides the gradients by the scale, checks them
for inf/nan *across every device of the mesh* (a ``psum`` of a flag over all mesh axes, so all
ranks agree), and on overflow skips the step: updates are zero and the inner optimizer state is
kept, so the parameters are unchanged.  The dynamic scale halves on overflow and doubles after
``growth_interval`` good steps in a row (Micikevicius et al. 2017, arXiv:1710.03740; the
defaults of ``torch.amp.GradScaler``).

The global loss is the mean over the data ranks, so each device's backward starts from
``loss_scale / N``; the dynamic scale settles wherever that fits.

bf16 has fp32's exponent range and needs no scaling (``loss_scale=None``); fp16 does
(``loss_scale="dynamic"``, or a fixed float).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from .._collectives import psum
from .._tree import tree_flatten, tree_leaves, tree_map, tree_unflatten
from . import _ops as ops
from ._base import GradientTransformation
from ._internal import mesh_axes

__all__ = ["MixedPrecision", "MixedPrecisionState", "all_finite", "cast_floating", "mixed_precision"]

Tensor = torch.Tensor


class MixedPrecisionState(NamedTuple):
    """The inner optimizer's state, the loss scale (fp32 0-d) and the good steps in a row (int64 0-d)."""

    inner: Any
    loss_scale: Tensor
    good_steps: Tensor


class MixedPrecision(NamedTuple):
    """A ``GradientTransformation`` (``init``, ``update``) plus the forward policy step builders apply."""

    init: Callable
    update: Callable
    compute_dtype: torch.dtype
    scaled: bool


def mixed_precision(
    optimizer: GradientTransformation,
    *,
    compute_dtype: torch.dtype = torch.bfloat16,
    loss_scale: str | float | None = None,
    init_scale: float = 2.0**16,
    growth_interval: int = 2000,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
) -> MixedPrecision:
    """Wrap ``optimizer`` for ``compute_dtype`` compute with fp32 master weights.

    Args:
      optimizer: the optimizer of the master weights.
      compute_dtype: the dtype the loss runs in (``torch.bfloat16`` or ``torch.float16``).
      loss_scale: ``None`` (no scaling, no overflow checks), ``"dynamic"``, or a fixed float.
      init_scale: the first dynamic scale.
      growth_interval: good steps in a row after which the dynamic scale grows.
      growth_factor: what it grows by.
      backoff_factor: what it is multiplied by on overflow.

    Returns:
      A ``MixedPrecision``: use it as the optimizer of ``fpar.optim.zero_step``.

    Example:
      >>> opt = fpar.optim.mixed_precision(fpar.optim.adamw(1e-3), compute_dtype=torch.float16,
      ...                                  loss_scale="dynamic")
    """
    if loss_scale not in (None, "dynamic") and not isinstance(loss_scale, (int, float)):
        raise ValueError(
            f"fpar.optim.mixed_precision: loss_scale must be None, 'dynamic' or a number, got {loss_scale!r}."
        )
    dynamic = loss_scale == "dynamic"
    first = float(init_scale if dynamic else (loss_scale or 1.0))

    def init(params):
        leaves = tree_leaves(params)
        device = leaves[0].device if leaves else None
        return MixedPrecisionState(
            optimizer.init(params),
            torch.tensor(first, dtype=torch.float32, device=device),
            torch.zeros((), dtype=torch.int64, device=device),
        )

    def update(grads, state, params=None):
        if loss_scale is None:
            updates, inner = optimizer.update(grads, state.inner, params)
            return updates, state._replace(inner=inner)
        g, treedef = tree_flatten(grads)
        g = ops.mul(g, 1.0 / state.loss_scale)
        finite = all_finite(g)
        with ops.donation(False):  # the old inner state is kept on overflow: not in place
            updates, inner = optimizer.update(tree_unflatten(treedef, g), state.inner, params)
        u, udef = tree_flatten(updates)
        updates = tree_unflatten(udef, [torch.where(finite, x, torch.zeros_like(x)) for x in u])
        inner = tree_map(lambda new, old: torch.where(finite, new, old), inner, state.inner)
        scale, good = state.loss_scale, state.good_steps
        if dynamic:
            good = torch.where(finite, good + 1, torch.zeros_like(good))
            grow = good >= growth_interval
            scale = torch.where(
                finite, torch.where(grow, scale * growth_factor, scale), scale * backoff_factor
            )
            good = torch.where(grow, torch.zeros_like(good), good)
        return updates, MixedPrecisionState(inner, scale, good)

    return MixedPrecision(init, update, compute_dtype, loss_scale is not None)


def all_finite(tree: Any) -> Tensor:
    """Whether every element of every leaf is finite, on every device (a replicated 0-d bool).

    Inside ``fpar.shard`` the local flag is combined over all mesh axes with one ``psum``, so
    every device (and every process on a real mesh) gets the same answer and skips together.
    """
    leaves = tree_leaves(tree)
    bad = torch.zeros((), dtype=torch.int32, device=leaves[0].device if leaves else None)
    for x in leaves:
        bad = bad + (~torch.isfinite(x)).any().to(torch.int32)
    axes = mesh_axes()
    if axes:
        bad = psum(bad, axes)
    return bad == 0


def cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    """Cast the floating-point leaves of ``tree`` to ``dtype`` (others unchanged)."""
    return tree_map(lambda x: x.to(dtype) if isinstance(x, Tensor) and x.is_floating_point() else x, tree)
