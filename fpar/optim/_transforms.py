"""The transformations optimizers are chained from, the optimizers, and global-norm clipping.

Shapes: every transformation maps a pytree of updates to a pytree of the same structure and
shapes; per-parameter state (``mu``, ``nu``, ``trace``) has the shapes of the parameters, counts
are int64 0-d tensors.  Inside ``fpar.shard`` the same code runs on each device's blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from .._collectives import psum
from .._spec import P
from .._tree import tree_flatten, tree_leaves, tree_unflatten
from . import _ops as ops
from ._base import EmptyState, GradientTransformation, chain
from ._internal import check_same_tree, current_frame, is_plain, varying_axes

__all__ = [
    "ScaleByAdamState",
    "ScaleByScheduleState",
    "TraceState",
    "adam",
    "adamw",
    "add_decayed_weights",
    "clip_by_global_norm",
    "global_norm",
    "scale",
    "scale_by_adam",
    "scale_by_learning_rate",
    "scale_by_schedule",
    "sgd",
    "trace",
]

Tensor = torch.Tensor
ScalarOrSchedule = float | Callable[[Any], Tensor]


_STATE_FIX = (
    "The grads must have one leaf per parameter, and the state must come from this optimizer's "
    "init(params) for the same params."
)


def _count_like(leaves: list) -> Tensor:
    device = leaves[0].device if leaves else None
    return torch.zeros((), dtype=torch.int64, device=device)


# Scaling ------------------------------------------------------------------------------------


def scale(factor: float) -> GradientTransformation:
    """Multiply updates by a constant ``factor``."""

    def update(updates, state, params=None):
        u, treedef = tree_flatten(updates)
        return tree_unflatten(treedef, ops.mul(u, factor, inplace=ops.writable(u))), state

    return GradientTransformation(lambda params: EmptyState(), update)


class ScaleByScheduleState(NamedTuple):
    """The number of updates made so far (int64 0-d)."""

    count: Tensor


def scale_by_schedule(schedule: Callable[[Any], Tensor]) -> GradientTransformation:
    """Multiply updates by ``schedule(count)``, count = 0 for the first update."""

    def init(params):
        return ScaleByScheduleState(_count_like(tree_leaves(params)))

    def update(updates, state, params=None):
        u, treedef = tree_flatten(updates)
        factor = torch.as_tensor(schedule(state.count))
        return tree_unflatten(treedef, ops.mul(u, factor, inplace=ops.writable(u))), ScaleByScheduleState(
            state.count + 1
        )

    return GradientTransformation(init, update)


def scale_by_learning_rate(lr: ScalarOrSchedule) -> GradientTransformation:
    """Multiply updates by ``-lr`` (a float or a schedule ``step -> lr``): descent."""
    if callable(lr):
        return scale_by_schedule(lambda count: -torch.as_tensor(lr(count)))
    return scale(-float(lr))


# Adam, momentum, weight decay ----------------------------------------------------------------


class ScaleByAdamState(NamedTuple):
    """Adam's moments (shapes of the parameters) and the update count (int64 0-d)."""

    count: Tensor
    mu: Any
    nu: Any


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    """Rescale updates by Adam's bias-corrected moments (Kingma & Ba 2014, arXiv:1412.6980).

    ``mu <- b1 mu + (1-b1) g``; ``nu <- b2 nu + (1-b2) g^2``;
    ``update = (mu / (1-b1^t)) / (sqrt(nu) / sqrt(1-b2^t) + eps)``, with the arithmetic of
    ``torch.optim.AdamW``.
    """

    def init(params):
        p = tree_leaves(params)
        return ScaleByAdamState(
            _count_like(p),
            tree_unflatten(tree_flatten(params)[1], [torch.zeros_like(x) for x in p]),
            tree_unflatten(tree_flatten(params)[1], [torch.zeros_like(x) for x in p]),
        )

    def update(updates, state, params=None):
        check_same_tree("scale_by_adam", "updates", updates, "state.mu", state.mu, fix=_STATE_FIX)
        g, treedef = tree_flatten(updates)
        mu, nu = tree_leaves(state.mu), tree_leaves(state.nu)
        inplace = ops.writable(mu + nu)
        into = g if ops.writable(g + mu + nu) else None  # donated: the direction overwrites g
        mu = ops.lerp(mu, g, 1.0 - b1, inplace=inplace)
        nu = ops.addcmul(ops.mul(nu, b2, inplace=inplace), g, g, 1.0 - b2, inplace=inplace)
        count = state.count + 1
        t = count.to(torch.float64)
        bc1, bc2 = 1.0 - b1**t, 1.0 - b2**t
        out = ops.adam_direction(mu, nu, bc1, bc2, eps, into=into)
        new = ScaleByAdamState(count, tree_unflatten(treedef, mu), tree_unflatten(treedef, nu))
        return tree_unflatten(treedef, out), new

    return GradientTransformation(init, update)


def add_decayed_weights(weight_decay: float = 0.0) -> GradientTransformation:
    """Add ``weight_decay * params`` to the updates (decoupled when chained after Adam: AdamW)."""

    def update(updates, state, params=None):
        if weight_decay == 0.0:
            return updates, state
        if params is None:
            raise ValueError("fpar.optim.add_decayed_weights: update needs params (pass them to update).")
        check_same_tree(
            "add_decayed_weights",
            "updates",
            updates,
            "params",
            params,
            fix="Pass the params the grads are of.",
        )
        u, treedef = tree_flatten(updates)
        decayed = ops.add(u, tree_leaves(params), alpha=weight_decay, inplace=ops.writable(u))
        return tree_unflatten(treedef, decayed), state

    return GradientTransformation(lambda params: EmptyState(), update)


class TraceState(NamedTuple):
    """The momentum buffer (shapes of the parameters)."""

    trace: Any


def trace(momentum: float, nesterov: bool = False) -> GradientTransformation:
    """Heavy-ball momentum as ``torch.optim.SGD`` (dampening 0): ``t <- momentum t + g``.

    The update is ``t``, or ``g + momentum t`` with ``nesterov``.
    """

    def init(params):
        p, treedef = tree_flatten(params)
        return TraceState(tree_unflatten(treedef, [torch.zeros_like(x) for x in p]))

    def update(updates, state, params=None):
        check_same_tree("trace", "updates", updates, "state.trace", state.trace, fix=_STATE_FIX)
        g, treedef = tree_flatten(updates)
        old = tree_leaves(state.trace)
        if ops.writable(g + old) and is_plain(g + old):
            # Donated: the new trace into the old one's buffers, the update into g's (the same
            # kernels as below, so the same values).
            for gi, ti in zip(g, old):
                torch.add(gi, ti, alpha=momentum, out=ti)
                if nesterov:
                    gi.add_(ti, alpha=momentum)
                else:
                    gi.copy_(ti)
            return tree_unflatten(treedef, g), TraceState(tree_unflatten(treedef, old))
        t = ops.add(g, old, alpha=momentum)
        out = ops.add(g, t, alpha=momentum) if nesterov else t
        return tree_unflatten(treedef, out), TraceState(tree_unflatten(treedef, t))

    return GradientTransformation(init, update)


# Optimizers -----------------------------------------------------------------------------------


def sgd(
    lr: ScalarOrSchedule, momentum: float = 0.0, nesterov: bool = False, weight_decay: float = 0.0
) -> GradientTransformation:
    """Stochastic gradient descent, step for step ``torch.optim.SGD`` (L2 ``weight_decay``).

    ``chain(add_decayed_weights(weight_decay), trace(momentum, nesterov), scale_by_learning_rate(lr))``.
    """
    if nesterov and momentum <= 0:
        raise ValueError("fpar.optim.sgd: nesterov=True needs momentum > 0.")
    parts = [add_decayed_weights(weight_decay)] if weight_decay else []
    if momentum:
        parts.append(trace(momentum, nesterov))
    return chain(*parts, scale_by_learning_rate(lr))


def adamw(
    lr: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
) -> GradientTransformation:
    """AdamW (Loshchilov & Hutter 2017, arXiv:1711.05101), step for step ``torch.optim.AdamW``.

    ``chain(scale_by_adam(b1, b2, eps), add_decayed_weights(weight_decay), scale_by_learning_rate(lr))``.
    State: two moments of the parameters' shapes (8 bytes per fp32 parameter) and two counts.
    """
    return chain(scale_by_adam(b1, b2, eps), add_decayed_weights(weight_decay), scale_by_learning_rate(lr))


def adam(
    lr: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8
) -> GradientTransformation:
    """Adam: ``chain(scale_by_adam(b1, b2, eps), scale_by_learning_rate(lr))``."""
    return chain(scale_by_adam(b1, b2, eps), scale_by_learning_rate(lr))


# Global-norm clipping ---------------------------------------------------------------------------


def global_norm(tree: Any, specs: Any = None) -> Tensor:
    """The 2-norm of all of ``tree``'s leaves together, correct for sharded trees.

    Outside ``fpar.shard`` the tree holds whole tensors and this is ``sqrt(sum(x**2))``.  Inside,
    each device holds blocks: a leaf's squares are summed over the devices of the axes it is
    *split* over (``psum``), and counted once along axes it is replicated over, so
    ``norm^2 = sum over leaves of psum(sum(block^2), split axes)``.  The split axes come from
    ``specs`` (a pytree prefix of ``tree`` of ``fpar.P``: the leaves' layout) or, if ``specs`` is
    None, from the axes each leaf varies over (fpar's replication typing: right for blocks of
    split tensors and for replicated values, e.g. ZeRO's gradient shards, but not for per-device
    partial values that have not been reduced yet).

    Returns:
      A 0-d tensor, replicated (the same on every device).
    """
    leaves = tree_leaves(tree)
    if current_frame() is None:
        sq = ops.sum_squares(leaves)
        return torch.sqrt(sum(sq)) if sq else torch.zeros(())
    if specs is None:
        axes = [varying_axes(x) for x in leaves]
    else:
        from .._tree import broadcast_prefix

        leaf_specs = broadcast_prefix(specs, tree, is_leaf=lambda s: s is None or isinstance(s, P))
        axes = [tuple(s.axes()) if s is not None else () for s in leaf_specs]
    groups: dict[tuple[str, ...], list[Tensor]] = {}
    for x, a in zip(leaves, axes):
        groups.setdefault(a, []).append(x)
    total = None
    for a, xs in groups.items():
        s = sum(ops.sum_squares(xs))
        s = psum(s, a) if a else s
        total = s if total is None else total + s
    return torch.sqrt(total) if total is not None else torch.zeros(())


def clip_by_global_norm(max_norm: float, *, specs: Any = None) -> GradientTransformation:
    """Scale updates by ``min(1, max_norm / (norm + 1e-6))``, ``norm`` = their global norm.

    The coefficient is ``torch.nn.utils.clip_grad_norm_``'s.  Inside ``fpar.shard`` the norm is
    that of the whole (global) tree across every device (see ``global_norm``; ``specs`` is how
    the updates are split, default: inferred), so every device scales by the same factor.
    """

    def update(updates, state, params=None):
        u, treedef = tree_flatten(updates)
        norm = global_norm(updates, specs)
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        return tree_unflatten(treedef, ops.mul(u, coef)), state

    return GradientTransformation(lambda params: EmptyState(), update)
