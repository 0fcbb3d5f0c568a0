"""Pytree utilities: the one module that knows optree's options.

fpar treats ``None`` as a leaf everywhere (a ``None`` spec means "static"), and uses optree's
default namespace so that user-registered node types work.  Swapping the pytree library, or
these options, is a change to this file only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree

__all__ = [
    "broadcast_prefix",
    "keystr",
    "tree_flatten",
    "tree_flatten_with_path",
    "tree_leaves",
    "tree_map",
    "tree_unflatten",
]

_OPTS = {"none_is_leaf": True, "namespace": ""}


def tree_flatten(tree: Any) -> tuple[list[Any], optree.PyTreeSpec]:
    """Flatten ``tree`` into leaves and a treedef (``None`` is a leaf)."""
    return optree.tree_flatten(tree, **_OPTS)


def tree_flatten_with_path(tree: Any) -> tuple[list[tuple], list[Any], optree.PyTreeSpec]:
    """Flatten ``tree`` into paths, leaves and a treedef."""
    return optree.tree_flatten_with_path(tree, **_OPTS)


def tree_unflatten(treedef: optree.PyTreeSpec, leaves: list[Any]) -> Any:
    """Rebuild a tree from a treedef and leaves."""
    return optree.tree_unflatten(treedef, leaves)


def tree_leaves(tree: Any) -> list[Any]:
    """Return the leaves of ``tree``."""
    return optree.tree_leaves(tree, **_OPTS)


def tree_map(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    """Map ``fn`` over the leaves of ``tree`` (and matching trees ``rest``)."""
    return optree.tree_map(fn, tree, *rest, **_OPTS)


def broadcast_prefix(prefix: Any, full: Any, *, is_leaf: Callable[[Any], bool]) -> list[Any]:
    """Return one entry of ``prefix`` per leaf of ``full``.

    Raises:
      ValueError: ``prefix`` is not a tree prefix of ``full`` (optree's message says where).
    """
    return optree.broadcast_prefix(prefix, full, is_leaf=is_leaf, **_OPTS)


def keystr(path: tuple) -> str:
    """Render a key path the way Python indexes it: ``[0]['w1']``."""
    return "".join(f"[{k!r}]" for k in path)
