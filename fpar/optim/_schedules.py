"""Learning-rate schedules: functions ``step -> value``, where step counts the updates made so far.

Anywhere a learning rate is taken, a float or such a callable is accepted.  ``step`` is 0 for
the first update (an int or an int64 0-d tensor, as the optimizer state keeps it); the value is
a float64 0-d tensor, computed with tensor ops so that it runs inside ``fpar.shard`` too.
Conventions follow optax (``warmup_cosine_decay_schedule``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

__all__ = ["Schedule", "constant", "linear_warmup", "warmup_cosine"]

Schedule = Callable[[object], torch.Tensor]


def _step(step) -> torch.Tensor:
    return torch.as_tensor(step).to(torch.float64)


def constant(value: float) -> Schedule:
    """``value`` at every step."""

    def schedule(step):
        return torch.full_like(_step(step), float(value))

    return schedule


def linear_warmup(peak: float, warmup_steps: int, *, init: float = 0.0) -> Schedule:
    """Rise linearly from ``init`` (step 0) to ``peak`` (step ``warmup_steps``), then hold ``peak``."""
    if warmup_steps < 0:
        raise ValueError(f"fpar.optim.linear_warmup: warmup_steps must be >= 0, got {warmup_steps}.")

    def schedule(step):
        t = _step(step)
        if warmup_steps == 0:
            return torch.full_like(t, float(peak))
        frac = torch.clamp(t / warmup_steps, max=1.0)
        return init + (peak - init) * frac

    return schedule


def warmup_cosine(peak: float, warmup_steps: int, total_steps: int, end: float = 0.0) -> Schedule:
    """Linear warmup from 0 to ``peak`` over ``warmup_steps``, then cosine decay to ``end`` at ``total_steps``.

    ``lr(t) = peak * t / warmup`` for ``t < warmup``; then
    ``end + (peak - end) * (1 + cos(pi * min(t - warmup, T) / T)) / 2`` with
    ``T = total_steps - warmup_steps``; ``end`` after ``total_steps``.
    """
    if not 0 <= warmup_steps <= total_steps:
        raise ValueError(
            f"fpar.optim.warmup_cosine: need 0 <= warmup_steps <= total_steps, got warmup_steps="
            f"{warmup_steps}, total_steps={total_steps}."
        )
    decay = total_steps - warmup_steps

    def schedule(step):
        t = _step(step)
        warm = peak * t / max(warmup_steps, 1)
        if decay == 0:
            cos = torch.full_like(t, float(end))
        else:
            frac = torch.clamp(t - warmup_steps, min=0.0, max=float(decay)) / decay
            cos = end + (peak - end) * 0.5 * (1.0 + torch.cos(math.pi * frac))
        return torch.where(t < warmup_steps, warm, cos)

    return schedule
