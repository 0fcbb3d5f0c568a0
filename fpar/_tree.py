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
    "describe",
    "keystr",
    "tree_flatten",
    "tree_flatten_with_path",
    "tree_leaves",
    "tree_map",
    "tree_unflatten",
]

_OPTS: dict[str, Any] = {"none_is_leaf": True, "namespace": ""}


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
      ValueError: ``prefix`` is not a tree prefix of ``full``; the message names the first path
        where they differ and describes the values there by type and shape, never by contents.
    """
    try:
        return optree.broadcast_prefix(prefix, full, is_leaf=is_leaf, **_OPTS)
    except ValueError:
        raise ValueError(_mismatch(prefix, full, is_leaf, ()) or "the structures differ") from None


def describe(x: Any) -> str:
    """A short description of a value for error messages: type and shape, never tensor contents."""
    shape = getattr(x, "shape", None)
    dtype = getattr(x, "dtype", None)
    if shape is not None and dtype is not None:
        return f"a tensor {str(dtype).removeprefix('torch.')}[{', '.join(map(str, shape))}]"
    if _is_leaf(x):
        text = repr(x)
        return text if len(text) <= 40 else f"a {type(x).__name__}"
    n = len(tree_leaves(x))
    return f"a {type(x).__name__} of {n} " + ("leaf" if n == 1 else "leaves")


def _is_leaf(x: Any) -> bool:
    return optree.tree_is_leaf(x, **_OPTS)


def _mismatch(prefix: Any, full: Any, is_leaf: Callable[[Any], bool], path: tuple) -> str | None:
    """Where and how ``prefix`` fails to be a prefix of ``full`` (``None``: it is one)."""
    where = f"at {keystr(path)}" if path else "at the top level"
    if is_leaf(prefix) or _is_leaf(prefix):
        return None
    kind = type(prefix).__name__
    if _is_leaf(full):
        return f"{where} the prefix has a {kind} where the tree has {describe(full)}"
    p_children, _, p_entries, _ = optree.tree_flatten_one_level(prefix, **_OPTS)
    f_children, _, f_entries, _ = optree.tree_flatten_one_level(full, **_OPTS)
    if type(prefix) is not type(full):
        return f"{where} the prefix has a {kind}, the tree {describe(full)}"
    if list(p_entries) != list(f_entries):
        if isinstance(prefix, dict):
            missing = [k for k in f_entries if k not in p_entries]
            extra = [k for k in p_entries if k not in f_entries]
            return (
                f"{where} the dict keys differ: the prefix lacks {missing}, and has {extra} that the "
                f"tree does not"
            )
        entries = ", ".join(describe(c) for c in f_children[:8]) + (", ..." if len(f_children) > 8 else "")
        return f"{where} the prefix has {len(p_children)} entries, the tree {len(f_children)} ({entries})"
    for entry, p, f in zip(p_entries, p_children, f_children):
        found = _mismatch(p, f, is_leaf, (*path, entry))
        if found:
            return found
    return None


def keystr(path: tuple) -> str:
    """Render a key path the way Python indexes it: ``[0]['w1']``."""
    return "".join(f"[{k!r}]" for k in path)
