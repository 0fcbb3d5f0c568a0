"""fpar's own ``autograd.Function``s.

The mode that runs during a sharded function (``_local/mode.py``) treats every op's tensor operands
as data that may need an implicit pvary.  fpar's own Functions also take a token tensor that is
batched at every mesh level only so that vmap calls their rules; they are registered here so
the mode passes them through.
"""

from __future__ import annotations

import inspect

import torch

from ._compile import untraced

__all__ = ["INTERNAL", "NOT_OPS", "TRANSPARENT", "bound_once", "internal"]

INTERNAL: set[type] = set()
# fpar Functions whose outputs the real mesh's tracker types from the ops of their body, not from
# the union of their operands (``fpar.optim.remat``: a body with a psum returns a replicated value)
TRANSPARENT: set[type] = set()

# torch functions whose tensor arguments both backends' interception (the in-process mode, the
# real mesh's tracker) must pass through as they are: rewriting ``inputs`` of
# ``torch.autograd.grad`` (which ``torch.func.grad`` calls) would ask for the gradient of a tensor
# that is not in the graph.
NOT_OPS = {
    torch.autograd.grad,
    torch.autograd.backward,
    torch.Tensor.backward,
    torch.Tensor.register_hook,
    torch.Tensor.requires_grad_,
}


def internal(cls: type) -> type:
    """Register an fpar autograd.Function (a class decorator); its signature is read once."""
    INTERNAL.add(cls)
    return bound_once(cls)


def bound_once(cls: type) -> type:
    """An fpar autograd.Function: its ``forward`` signature read once, its frames never compiled.

    ``Function.apply`` binds the arguments of a Function with ``setup_context`` to its
    ``forward``'s signature on every call, and ``inspect.signature`` builds that signature anew
    each time (~10 us, a third of an apply); it returns a function's ``__signature__`` as is.
    Its ``backward``, which autograd may call inside a compiled step, runs as it is
    (``_compile.untraced``).
    """
    cls.forward.__signature__ = inspect.signature(cls.forward)
    return untraced(cls)
