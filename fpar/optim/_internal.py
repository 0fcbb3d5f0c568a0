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
from torch._C._functorch import is_functorch_wrapped_tensor

from .._collectives import Frame, frames
from .._mode import ShardMode, batched_levels
from .._registry import internal as internal
from .._spec import block_shape as block_shape

__all__ = [
    "Frame",
    "ShardMode",
    "block_shape",
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
    if frame is None or not frame.levels:
        return ()
    levels = batched_levels(t, frame.levels)
    return tuple(a for a in frame.mesh.axis_names if any(frame.levels[lv] == a for lv in levels))


def is_plain(tensors: list[Any]) -> bool:
    """Whether every tensor is a plain one (no functorch wrapper, no autograd): foreach-safe."""
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
