"""How fpar meets ``torch.compile``: where Dynamo may trace, and where it must not.

fpar's collectives, implicit pvaries and gradient all-reduces are custom ``autograd.Function``\\ s
(in-process also with custom ``vmap`` rules), run under a ``TorchFunctionMode``.  Dynamo cannot
trace the in-process machinery at all (functorch levels, custom vmap rules), and where it does
trace a custom Function it can drop its backward: under ``torch.compile(torch.func.grad(f))`` a
Function whose backward all-reduces then returns the *local* gradient, silently (pytorch#193279,
reproduced on torch 2.13 with gloo).  So fpar never lets Dynamo trace its own machinery:

* a sharded function and every collective are ``torch.compiler.disable``\\ d: under
  ``torch.compile`` they are graph breaks that run eagerly, exactly as without compile, with
  their backward intact (``fullgraph=True`` raises Dynamo's error carrying :data:`REASON`);
* per-device code *between* collectives compiles: ``fpar.shard(torch.compile(f), ...)`` on a real
  mesh runs ``f``'s compiled graphs on the plain local tensors of a planned (fast) call, split at
  each collective;
* where fpar intercepts every op (the in-process mesh, and a real-mesh call that plans a
  signature or stays traced), a compiled per-device function runs eagerly
  (:func:`eager`): Dynamo would otherwise try to trace fpar's interception itself.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["REASON", "eager", "opaque"]

REASON = (
    "fpar.shard: a sharded function and fpar's collectives are graph breaks under torch.compile "
    "(they run eagerly, with their custom backward: Dynamo can drop an autograd.Function's backward, "
    "pytorch#193279), so fullgraph=True cannot cover them. Compile the per-device code instead: "
    "fpar.shard(torch.compile(f), ...) (split at each collective), or torch.compile(g, fullgraph=True) "
    "on a part of f without collectives; or drop fullgraph=True (see README, 'torch.compile')."
)


def opaque(fn: Callable) -> Callable:
    """``fn`` as an eager call Dynamo never traces (a graph break; an error under ``fullgraph``)."""
    return torch.compiler.disable(fn, reason=REASON)


def eager():
    """A context in which compiled functions run eagerly (fpar intercepts every op there)."""
    return torch.compiler.set_stance("force_eager")
