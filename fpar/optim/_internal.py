"""The one module of ``fpar.optim`` that reaches into fpar's private core.

``fpar.optim`` is built from public ``fpar`` pieces except for three questions the public API
cannot answer yet (each a candidate for a small public core function):

* *Am I inside ``fpar.shard``, and over which mesh?*  (global finiteness checks, global norms)
* *Which mesh axes does this value vary over?*  (JAX's ``jax.typeof(x).vma``; global norms
  without specs)
* *How do I re-enter the mesh levels of a running shard?*  (``remat`` under transforms applied
  outside ``fpar.shard``)

(plus ``block_shape``, the shape of one device's block of a spec'd value).  Keeping them here
makes a change to the core a change to this file only; pytrees go through ``fpar._tree``, the
package's one pytree module, as everywhere in fpar.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from .._collectives import Frame, frames
from .._local.collective import varying_of
from .._local.mode import ShardMode
from .._registry import internal as internal
from .._spec import block_shape as block_shape
from .._torch_api import is_functorch_wrapped_tensor
from .._tree import describe, keystr, tree_flatten_with_path

__all__ = [
    "Frame",
    "ShardMode",
    "block_shape",
    "check_same_tree",
    "current_frame",
    "enter_frame",
    "internal",
    "is_plain",
    "mesh_axes",
    "shard_mode_active",
    "varying_axes",
]

Tensor = torch.Tensor


def current_frame() -> Frame | None:
    """The innermost running ``fpar.shard`` frame of this thread, or ``None`` outside shard."""
    stack = frames()
    return stack[-1] if stack and stack[-1].token is not None else None


def mesh_axes() -> tuple[str, ...] | None:
    """The axis names of the mesh of the running ``fpar.shard``, or ``None`` outside shard."""
    frame = current_frame()
    return None if frame is None else tuple(frame.mesh.axis_names)


def varying_axes(t: Tensor) -> tuple[str, ...]:
    """The mesh axes ``t`` varies over inside the running shard (mesh order); ``()`` outside."""
    frame = current_frame()
    if frame is None:
        return ()
    if frame.levels:  # in-process: the mesh vmap levels t is batched at
        axes = varying_of(frame, t)
        return tuple(a for a in frame.mesh.axis_names if a in axes)
    if frame.varying is not None:  # a real mesh (or a compiled in-process call): the plan's record
        axes = frame.varying(t)
        return tuple(a for a in frame.mesh.axis_names if a in axes)
    return ()


def is_plain(tensors: list[Any]) -> bool:
    """Whether every tensor is a plain one (no functorch wrapper, no autograd): foreach-safe."""
    if torch.compiler.is_compiling():  # Dynamo traces no functorch wrapper check; it tracks transforms itself
        stack = frames()
        if stack and stack[-1].backend == "local":  # an in-process call traced whole: vmap levels
            return False
        return all(isinstance(t, Tensor) and not t.requires_grad for t in tensors)
    return all(
        isinstance(t, Tensor) and not is_functorch_wrapped_tensor(t) and not t.requires_grad for t in tensors
    )


def shard_mode_active() -> bool:
    """Whether fpar's torch-function mode is on the mode stack now."""
    from torch.overrides import _get_current_function_mode_stack

    return any(isinstance(m, ShardMode) for m in _get_current_function_mode_stack())


@contextlib.contextmanager
def enter_frame(frame: Frame):
    """Rebind ``frame`` to vmap levels about to be created again (see ``_remat.py``).

    Inside, ``frame.levels`` starts empty: the caller records each level it creates and sets
    ``frame.token`` / ``frame.index`` to the re-batched ones.  The previous bindings are restored
    on exit, so this works during the shard call (forward) and after it (backward).
    """
    saved = (frame.levels, frame.token, frame.index, getattr(frame, "pvaried", None))
    pushed = current_frame() is not frame
    frame.levels = {}
    if saved[3] is not None:
        frame.pvaried = {}  # per-call caches of the shard hold values of the old levels
    if pushed:
        frames().append(frame)
    mode = contextlib.nullcontext() if shard_mode_active() else ShardMode(frame)
    try:
        with mode:
            yield
    finally:
        if pushed:
            frames().pop()
        frame.levels, frame.token, frame.index = saved[:3]
        if saved[3] is not None:
            frame.pvaried = saved[3]


def check_same_tree(api: str, a_name: str, a: Any, b_name: str, b: Any, *, fix: str) -> None:
    """Raise ``ValueError`` naming both trees and the first leaf where ``a`` and ``b`` differ.

    Two trees match when they have the same leaf paths and, leaf by leaf, the same shape.

    Args:
      api: the public function, e.g. ``"apply_updates"``.
      a_name: how the message names ``a`` (``"updates"``).
      a: the first tree.
      b_name: how the message names ``b`` (``"state.mu"``).
      b: the second tree.
      fix: the sentence telling the user what to do.
    """
    a_paths, a_leaves, a_def = tree_flatten_with_path(a)
    b_paths, b_leaves, b_def = tree_flatten_with_path(b)
    if a_def == b_def and all(_shape(x) == _shape(y) for x, y in zip(a_leaves, b_leaves)):
        return
    a_set, b_set = set(a_paths), set(b_paths)
    only_a = [keystr(p) for p in a_paths if p not in b_set]
    only_b = [keystr(p) for p in b_paths if p not in a_set]
    if only_a or only_b:
        parts = []
        if only_a:
            parts.append(f"{a_name} has {_few(only_a)} that {b_name} lacks")
        if only_b:
            parts.append(f"{b_name} has {_few(only_b)} that {a_name} lacks")
        detail = "; ".join(parts)
    else:
        where = {p: i for i, p in enumerate(b_paths)}
        detail = f"the leaves are in a different structure ({a_def} vs {b_def})"
        for p, x in zip(a_paths, a_leaves):
            y = b_leaves[where[p]]
            if _shape(x) != _shape(y):
                detail = f"at {keystr(p) or 'the root'} {a_name} is {describe(x)}, {b_name} {describe(y)}"
                break
    raise ValueError(f"fpar.optim.{api}: {a_name} and {b_name} are not the same tree: {detail}. {fix}")


def _shape(x: Any):
    return tuple(x.shape) if isinstance(x, Tensor) else type(x)


def _few(paths: list[str]) -> str:
    return ", ".join(paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")
