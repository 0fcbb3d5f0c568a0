"""Per-layer recomputation of a Hugging Face model: each decoder layer under ``fpar.optim.remat``.

``remat(apply_fn)`` changes the class of each decoder layer of ``apply_fn``'s private local copy
(the model ``fpar.hf.from_pretrained`` / ``fpar.ops.tensor_parallel`` made for this device) to a
subclass whose call runs the layer's own forward under ``fpar.optim.remat``, with the layer's
parameters as explicit inputs: the forward keeps each layer's inputs and the backward runs the
layer again on this device's blocks (or keeps what a ``policy`` names and recomputes the rest).
Every layout that runs the model runs it so: data x tensor with ZeRO, sequence parallelism, and
``fpar.hf.pipeline_stages``, whose chunks call the same layer modules.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..optim._remat import remat as _remat
from ._pipeline import decoder_layers

__all__ = ["remat"]

_API = "fpar.hf.remat"


def remat(apply_fn: Any, policy: Callable[[str, int], bool] | bool | None = None) -> Any:
    """Recompute each decoder layer of a Hugging Face model in the backward; returns ``apply_fn``.

    Hugging Face's ``gradient_checkpointing_enable()`` for fpar: the layers are those of the
    model's ``base_model_pp_plan`` (or its base model's one ``ModuleList``).  Values and gradients
    are the model's own (the layer runs again with the same inputs).  Call it again to change the
    policy; ``policy=False`` undoes it.

    Args:
      apply_fn: what ``fpar.hf.from_pretrained`` or ``fpar.ops.tensor_parallel`` returned.  Its
        local model is changed in place (``pipeline_stages`` made from it before or after
        recomputes too).
      policy: ``None``: keep each layer's inputs only (full recomputation, Megatron-LM's
        ``--recompute-granularity full``); ``fpar.optim.save_dots`` / ``save_alternate_dots`` or
        any ``(op name, index) -> bool``: keep those ops' outputs too (selective, as
        ``fpar.optim.remat``'s ``policy``); ``False``: no recomputation.

    Returns:
      ``apply_fn`` itself, so that ``apply_fn = fpar.hf.remat(fpar.hf.from_pretrained(...))`` reads.

    Raises:
      TypeError: ``apply_fn`` is not a model's per-device function, or ``policy`` not callable.
      ValueError: which module list holds the decoder layers cannot be told.
    """
    module = getattr(apply_fn, "module", None)
    if not isinstance(module, torch.nn.Module):
        raise TypeError(
            f"{_API}: apply_fn must be what fpar.hf.from_pretrained or fpar.ops.tensor_parallel returned "
            f"(it has the model as .module), got {type(apply_fn).__name__}."
        )
    if policy is True or (policy is not None and policy is not False and not callable(policy)):
        raise TypeError(
            f"{_API}: policy must be None (full recomputation), a callable (op name, index) -> bool such "
            f"as fpar.optim.save_dots, or False (none), got {policy!r}."
        )
    base, name = decoder_layers(module, _API)
    for layer in getattr(base, name):
        plain = layer.__dict__.get("_fpar_plain_class", type(layer))
        if policy is False:
            layer.__class__ = plain
            layer.__dict__.pop("_fpar_plain_class", None)
            continue
        layer.__dict__["_fpar_plain_class"] = plain
        layer.__dict__["_fpar_remat"] = _remat(_call_plain, policy if callable(policy) else None)
        layer.__class__ = _remat_class(plain)
    return apply_fn


_CLASSES: dict[type, type] = {}


def _remat_class(plain: type) -> type:
    """``plain``'s subclass whose call runs the layer under the layer's ``fpar.optim.remat``."""
    if plain not in _CLASSES:

        def __call__(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:  # noqa: N807
            if self.__dict__.get("_fpar_inside"):  # the remat body's own call: the plain layer
                return plain.__call__(self, *args, **kwargs)
            # buffers too (xIELU's beta, a rotary table): the model's call put this device's
            # tensors in, which the recompute must take as inputs, not as captured constants
            named = [*self.named_parameters(), *self.named_buffers()]
            return self.__dict__["_fpar_remat"](
                self, [n for n, _ in named], [p for _, p in named], args, kwargs
            )

        _CLASSES[plain] = type(
            plain.__name__, (plain,), {"__call__": __call__, "__module__": plain.__module__}
        )
    return _CLASSES[plain]


def _call_plain(layer: torch.nn.Module, names: list[str], params: list, args: tuple, kwargs: dict) -> Any:
    """The layer's own forward on ``params``: this device's blocks, or in the backward the recompute's.

    (By then the model's own functional call, which put the blocks in the module, has returned.)
    """
    layer.__dict__["_fpar_inside"] = True
    try:
        return torch.func.functional_call(layer, dict(zip(names, params)), args, kwargs)
    finally:
        layer.__dict__["_fpar_inside"] = False
