"""Gradient transformations: optax's ``init``/``update`` pairs over pytrees of tensors.

A ``GradientTransformation`` is a pair of pure functions.  ``init(params) -> state`` builds the
state, a pytree of tensors (so it can be sharded with ``fpar.shard`` specs, saved and loaded);
``update(updates, state, params=None) -> (updates, state)`` turns gradients into updates.
Optimizers are chains of small transformations, e.g. ``adamw`` is
``chain(scale_by_adam(...), add_decayed_weights(...), scale_by_learning_rate(lr))``; the
updates are *added* to the parameters by ``apply_updates``.  Nothing mutates its inputs, except
under an explicit donation (``zero_update(..., donate=True)`` on a real mesh, see ``_ops``), where
the built-in transformations may write their results into the tensors they were given.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from .._tree import describe, tree_flatten, tree_unflatten
from . import _ops as ops
from ._internal import check_same_tree

__all__ = ["EmptyState", "GradientTransformation", "apply_updates", "chain", "identity"]

Params = Any
Updates = Any
State = Any


class GradientTransformation(NamedTuple):
    """An optimizer, or a piece of one: ``init(params) -> state``, ``update(updates, state, params)``."""

    init: Callable[[Params], State]
    update: Callable[..., tuple[Updates, State]]


class EmptyState(NamedTuple):
    """The state of a stateless transformation (no leaves)."""


def identity() -> GradientTransformation:
    """Return updates unchanged."""
    return GradientTransformation(lambda params: EmptyState(), lambda u, s, params=None: (u, s))


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply ``transforms`` in order; the state is the tuple of their states.

    Example:
      >>> opt = chain(clip_by_global_norm(1.0), scale_by_adam(), scale_by_learning_rate(1e-3))
    """

    def init(params):
        return tuple(t.init(params) for t in transforms)

    def update(updates, state, params=None):
        if not isinstance(state, tuple) or len(state) != len(transforms):
            got = f"a {type(state).__name__} of {len(state)}" if isinstance(state, tuple) else describe(state)
            raise ValueError(
                f"fpar.optim.chain: state is {got} entries, but this chain has {len(transforms)} "
                f"transformations: the state comes from another optimizer. Build it with this "
                f"optimizer's init(params)."
            )
        new_state = []
        for t, s in zip(transforms, state):
            updates, s = t.update(updates, s, params)
            new_state.append(s)
        return updates, tuple(new_state)

    return GradientTransformation(init, update)


def apply_updates(params: Params, updates: Updates) -> Params:
    """Return ``params + updates`` leaf by leaf (each result in its parameter's dtype).

    Under ``fpar.optim._ops.donation`` (``zero_update(..., donate=True)``) the sums go into the
    parameters' own buffers, which are returned.
    """
    check_same_tree(
        "apply_updates",
        "params",
        params,
        "updates",
        updates,
        fix="Pass the updates that update() returned for these params (one per parameter, same shapes).",
    )
    p, treedef = tree_flatten(params)
    u, _ = tree_flatten(updates)
    inplace = ops.writable(p)
    return tree_unflatten(treedef, ops.add(p, [x.to(y.dtype) for x, y in zip(u, p)], inplace=inplace))
