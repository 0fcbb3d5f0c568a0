"""Dropout whose mask is the block of one global mask: the same model at every layout.

``dropout(key, x, rate, spec=...)`` keeps each element of the *global* array with probability
``1 - rate`` (``fpar.random.bernoulli`` on the global shape), and a device applies its block of
that mask to its block ``x``.  So a GPT trained on 8 devices drops exactly the activations it
drops on 1, and the equivalence property (sharded == unsharded) covers dropout too.
"""

from __future__ import annotations

import numbers

import torch

from .. import random as _random
from .._collectives import frames
from .._errors import SpecError
from .._local.collective import varying_of
from .._spec import PartitionSpec, check_spec, global_shape

__all__ = ["dropout"]

Tensor = torch.Tensor


def dropout(key: Tensor, x: Tensor, rate: float, *, spec: PartitionSpec | None = None) -> Tensor:
    """Zero each element of the global array with probability ``rate``; scale the rest by 1/(1-rate).

    Args:
      key: a ``fpar.random`` key (use a fresh one per call site and step: ``fold_in``/``split``).
      x: outside ``fpar.shard``, the global array; inside, this device's block of it, laid out by
        ``spec``.
      rate: the drop probability, a Python number in [0, 1).  ``rate=0`` returns ``x`` itself.
      spec: inside ``fpar.shard``, the layout of ``x`` (``None``/``P()``: replicated, the whole
        array on every device).  It must name every mesh axis ``x`` varies over, or the mask
        would repeat along it.

    Returns:
      ``x * mask / (1 - rate)``; its gradient is ``mask / (1 - rate)``.
    """
    if isinstance(rate, bool) or not isinstance(rate, numbers.Real):
        raise TypeError(f"fpar.ops.dropout: rate must be a Python number in [0, 1), got {rate!r}.")
    if not 0.0 <= rate < 1.0:
        raise ValueError(
            f"fpar.ops.dropout: rate={rate} must be in [0, 1) (the probability of dropping an element; "
            f"rate=1 would drop everything)."
        )
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise TypeError(f"fpar.ops.dropout: x must be a floating tensor, got {getattr(x, 'dtype', type(x))}.")
    _random._check_key("dropout", key)
    if rate == 0:
        return x
    shape = _global_shape(x, spec)
    keep = _random.bernoulli(key.to(x.device), 1.0 - float(rate), shape, spec=spec)
    return x * (keep.to(x.dtype) * (1.0 / (1.0 - float(rate))))


def varying_axes(frame, x: Tensor) -> set[str]:
    """The mesh axes ``x`` varies over in the running shard call ``frame``.

    In-process: the mesh vmap levels ``x`` is batched at.  On a real mesh (plain local tensors):
    the frame's ``varying`` query, answered by the traced call's tracker and by its plan later;
    in a compiled in-process call, by the eager call's answer to the same query.
    """
    if frame.levels:
        return set(varying_of(frame, x))
    if frame.varying is not None:
        return set(frame.varying(x))
    return set()


def _global_shape(x: Tensor, spec) -> tuple[int, ...]:
    """The global shape of ``x`` (its block shape inside shard), after checking ``spec`` against it."""
    if spec is not None and not isinstance(spec, PartitionSpec):
        raise TypeError(f"fpar.ops.dropout: spec must be a fpar.P or None, got {spec!r}.")
    stack = frames()
    if not stack or stack[-1].token is None:
        return tuple(x.shape)
    frame = stack[-1]
    spec = PartitionSpec() if spec is None else spec
    where = f"fpar.ops.dropout: x of block shape {tuple(x.shape)} with spec"
    check_spec(spec, tuple(x.shape), frame.mesh.shape, where=where, blocks=True)
    named = set(spec.axes())
    varying = varying_axes(frame, x)
    missing = [a for a in frame.mesh.axis_names if a in varying and a not in named]
    if missing:
        raise SpecError(
            f"{where} {spec}: x varies over mesh axis {missing[0]!r}, which the spec does not name, so "
            f"every device along it would get the same mask. Pass the layout of x as spec= (e.g. "
            f"P({missing[0]!r}, ...) for a batch split over {missing[0]!r})."
        )
    return global_shape(spec, tuple(x.shape), frame.mesh.shape)


# Dropout sites inside the parallel layers --------------------------------------------------


def check_dropout(api: str, rate, key) -> None:
    """Validate a layer's ``dropout=`` / ``key=`` pair at its boundary, before any communication."""
    if isinstance(rate, bool) or not isinstance(rate, numbers.Real) or not 0.0 <= rate < 1.0:
        raise ValueError(
            f"fpar.ops.{api}: dropout={rate!r} must be a number in [0, 1) (the drop probability)."
        )
    if rate and key is None:
        raise ValueError(
            f"fpar.ops.{api}: dropout={rate} needs key= (a fpar.random key, e.g. "
            f"fpar.random.fold_in(fpar.random.key(seed), step), passed into fpar.shard with in_spec P())."
        )
    if rate:
        _random._check_key(api, key)


def site_dropout(
    key, x: Tensor, rate: float, *, axis, split_dim: int | None = None, batch_axes=None
) -> Tensor:
    """Dropout at one site of a layer: dim 0 is the batch, ``split_dim`` (if any) is split over ``axis``.

    The batch dim is split over ``batch_axes`` (major first); ``None`` infers them: the mesh axes
    ``x`` varies over other than the layer's own ``axis``, in mesh order (``P("data")`` or
    ``P(("data", "fsdp"))`` in mesh order; pass ``batch_axes`` for another order).
    """
    if not rate:
        return x
    batch = batch_axes_of(x, axis, batch_axes)
    entries = [None] * x.dim()
    entries[0] = batch or None
    if split_dim is not None:
        entries[split_dim] = axis
    return dropout(key, x, rate, spec=PartitionSpec(*entries))


def batch_axes_of(x: Tensor, axis, batch_axes=None) -> tuple:
    """The mesh axes a layer's batch dim is split over.

    ``batch_axes`` as given, or (``None``) the axes ``x`` varies over other than the layer's own
    ``axis``, in mesh order.
    """
    if batch_axes is not None:
        return (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes)
    layer = (axis,) if isinstance(axis, str) else tuple(axis)
    stack = frames()
    frame = stack[-1] if stack and stack[-1].token is not None else None
    if frame is None:
        return ()
    varying = varying_axes(frame, x)
    return tuple(a for a in frame.mesh.axis_names if a in varying and a not in layer)


def block_keep(key: Tensor, rate: float, shape: list, start: list, local: list, device) -> Tensor:
    """The keep-mask (bool) of one block of a global ``shape``, as ``dropout(key, x, rate)`` draws it.

    ``start`` per dim is the block's first global index (an int, or a 0-d int64 tensor that may
    depend on the device, as ``fpar.axis_index`` gives); ``local`` its size.  The mask is the block
    of the one ``dropout`` would draw on the global array, for any block: layers whose blocks are
    not a spec's layout (ring attention's rotating key blocks) use it.  Kept values are to be
    scaled by ``1 / (1 - rate)``.
    """
    from ..random._philox import block_words

    key = key.to(device)
    threshold = _random._threshold("dropout", 1.0 - float(rate))
    (w,) = block_words(key[0], key[1], list(shape), list(start), list(local), 1, device)
    return w < threshold
