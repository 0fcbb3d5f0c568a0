"""Randomness whose values do not depend on the mesh layout: explicit keys, global draws.

As in ``jax.random``, a *key* is a value: ``fpar.random.key(seed)`` makes one, ``split`` and
``fold_in`` derive new ones, and a draw is a pure function of the key and the **global** shape.
The generator is counter-based (Philox-4x32-10, written with integer tensor ops), so element
``i`` of a draw is a function of the key and ``i`` alone: the same key gives the same bits on CPU
and CUDA, in one process and on many, at any layout.

Inside ``fpar.shard``, ``spec=`` says how the global array is laid out; each device computes
only its own block, from its block's global element indices (cost proportional to the block;
the global array is never built).  With ``spec=None`` (or ``P()``) the whole array is drawn on
every device and is replicated (it passes the replication check).  Outside ``fpar.shard`` the
draws return the whole array.  torch's stateful random ops (``torch.rand``, ``F.dropout`` ...)
raise inside ``fpar.shard`` and name the function here to use.  ``set_compiled(True)`` draws
the same bits with ``torch.compile``d kernels (faster than ``torch.rand`` on CPU).

Keys are int64 tensors of shape ``(2,)`` holding two 32-bit words (``split`` returns a stack of
them, shape ``(num, 2)``); they are ordinary tensors, so they go through ``fpar.shard`` (with
in_spec ``P()``), pytrees and ``fpar.checkpoint`` like any other state.

Example:
  >>> key = fpar.random.key(0)
  >>> k_init, k_drop = fpar.random.split(key)
  >>> def f(x, key):                        # x: P("data", None), global shape (8, 16)
  ...     noise = fpar.random.normal(key, (8, 16), spec=P("data", None))
  ...     return x + noise                  # == x + fpar.random.normal(key, (8, 16)) unsharded
  >>> fpar.shard(f, mesh, (P("data", None), P()), P("data", None))(x, k_drop)
"""

from __future__ import annotations

import math
import operator

import torch

from .._collectives import axis_index, frames
from .._spec import PartitionSpec, check_spec
from ._guard import check_random_op as check_random_op
from ._philox import MASK, TAG_FOLD, TAG_SPLIT, block_words, compiled_ok, fused, philox
from ._philox import set_compiled as set_compiled

__all__ = [
    "bernoulli",
    "bits",
    "check_random_op",
    "fold_in",
    "key",
    "normal",
    "set_compiled",
    "split",
    "uniform",
]

Tensor = torch.Tensor

_MANTISSA = {torch.float16: 11, torch.bfloat16: 8, torch.float32: 24, torch.float64: 53}


# API ----------------------------------------------------------------------------------------


def key(seed: int, *, device=None) -> Tensor:
    """Make a key from an integer seed.

    Args:
      seed: a Python int in [-2**63, 2**64); its 64 bits are the key.
      device: where the key lives (draws happen on the key's device, or ``x``'s for dropout).

    Returns:
      An int64 tensor of shape ``(2,)``: the seed's low and high 32-bit words.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        if isinstance(seed, Tensor) and seed.dim() == 0 and not seed.is_floating_point():
            seed = int(seed)
        else:
            raise TypeError(f"fpar.random.key: seed must be a Python int, got {seed!r}.")
    if not -(2**63) <= seed < 2**64:
        raise ValueError(
            f"fpar.random.key: seed={seed} does not fit in 64 bits; use a seed in [-2**63, 2**64)."
        )
    seed &= 2**64 - 1
    return torch.tensor([seed & MASK, seed >> 32], dtype=torch.int64, device=device)


def split(key: Tensor, num: int = 2) -> Tensor:
    """Derive ``num`` new independent keys from ``key``.

    Returns:
      An int64 tensor of shape ``(num, 2)``; ``split(key, n)[i]`` is a key.
    """
    _check_key("split", key)
    if isinstance(num, bool) or not isinstance(num, int) or num < 1:
        raise ValueError(f"fpar.random.split: num must be a positive int, got {num!r}.")
    i = torch.arange(num, dtype=torch.int64, device=key.device)
    out = philox(i, 0, 0, TAG_SPLIT, key[0], key[1])
    return torch.stack(out[:2], -1)


def fold_in(key: Tensor, data) -> Tensor:
    """Derive a new key from ``key`` and an integer (a step, a microbatch or layer index).

    Args:
      key: the key.
      data: a Python int in [0, 2**64) or an integer tensor (e.g. ``fpar.axis_index("data")``
        inside ``fpar.shard`` for a per-device stream); a tensor of shape ``S`` gives keys of
        shape ``(*S, 2)``.

    Returns:
      The new key(s).
    """
    _check_key("fold_in", key)
    if isinstance(data, Tensor):
        if data.is_floating_point() or data.is_complex() or data.dtype == torch.bool:
            raise TypeError(
                f"fpar.random.fold_in: data must be an int or an integer tensor, got dtype {data.dtype}."
            )
        data = data.to(device=key.device, dtype=torch.int64)
        lo, hi = data & MASK, (data >> 32) & MASK
    elif isinstance(data, int) and not isinstance(data, bool):
        if not 0 <= data < 2**64:
            raise ValueError(f"fpar.random.fold_in: data={data} must be in [0, 2**64).")
        lo, hi = data & MASK, data >> 32
        lo = torch.tensor(lo, dtype=torch.int64, device=key.device)
    else:
        raise TypeError(f"fpar.random.fold_in: data must be an int or an integer tensor, got {data!r}.")
    out = philox(lo, hi, 0, TAG_FOLD, key[0], key[1])
    return torch.stack(out[:2], -1)


def bits(key: Tensor, shape, *, spec: PartitionSpec | None = None) -> Tensor:
    """Uniform random 32-bit words of global ``shape``, as int64 in [0, 2**32).

    ``spec`` as in ``uniform``.
    """
    return _words("bits", key, shape, 1, spec)[0]


def uniform(
    key: Tensor, shape, dtype: torch.dtype = torch.float32, *, spec: PartitionSpec | None = None
) -> Tensor:
    """Uniform floats in [0, 1) of global ``shape``.

    Each element has the full precision of ``dtype`` (24 random bits for float32, 53 for float64
    from two words, 11 / 8 for float16 / bfloat16) and is never 1.0.

    Args:
      key: the key.
      shape: the global shape.
      dtype: a floating dtype.
      spec: inside ``fpar.shard``, how the global array is laid out over the mesh: each device
        gets its block.  ``None`` or ``P()``: the whole array, replicated.  Ignored outside shard.

    Returns:
      The block (inside shard with a spec) or the whole array.
    """
    _float_bits("uniform", dtype)  # checks the dtype before any words are drawn
    w = _words("uniform", key, shape, 2 if dtype == torch.float64 else 1, spec)
    if dtype == torch.float64:
        return ((w[0] >> 5) * 2**26 + (w[1] >> 6)).to(torch.float64) * 2.0**-53
    if compiled_ok(w[0]):
        return fused(_UNIT[dtype], w[0])
    return _UNIT[dtype](w[0])


def _unit(m: int, dtype: torch.dtype):
    def unit(w: Tensor) -> Tensor:
        """The top ``m`` bits of 32-bit words as floats in [0, 1)."""
        return ((w >> (32 - m)).to(torch.float32) * 2.0**-m).to(dtype)

    return unit


_UNIT = {d: _unit(m, d) for d, m in _MANTISSA.items() if d != torch.float64}


def normal(
    key: Tensor, shape, dtype: torch.dtype = torch.float32, *, spec: PartitionSpec | None = None
) -> Tensor:
    """Standard normal floats of global ``shape`` (``spec`` as in ``uniform``).

    By inversion: ``ndtri(u)`` of a uniform ``u`` in the open interval (0, 1), computed in float64
    and rounded to ``dtype`` (32 random bits per element for float32 and below, tails reach 6.2
    sigma; 53 for float64).  The underlying bits are identical on every device type; the result
    of ``ndtri`` is identical at every layout on one device type and agrees to float64 rounding
    between CPU and CUDA.
    """
    _float_bits("normal", dtype)
    w = _words("normal", key, shape, 2 if dtype == torch.float64 else 1, spec)
    if dtype == torch.float64:
        u = ((w[0] >> 5) * 2**26 + (w[1] >> 6)).to(torch.float64) * 2.0**-53 + 2.0**-54
    else:
        u = (w[0].to(torch.float64) + 0.5) * 2.0**-32
    return torch.special.ndtri(u).to(dtype)


def bernoulli(key: Tensor, p, shape, *, spec: PartitionSpec | None = None) -> Tensor:
    """Bools of global ``shape``, each True with probability ``p`` (``spec`` as in ``uniform``).

    Element ``i`` is ``bits[i] < ceil(p * 2**32)``: exactly ``uniform32 < p`` at 32-bit resolution.

    Args:
      key: the key.
      p: the probability, a Python number in [0, 1] or a 0-d float tensor.
      shape: the global shape.
      spec: the layout inside ``fpar.shard``.
    """
    threshold = _threshold("bernoulli", p)
    w = _words("bernoulli", key, shape, 1, spec)
    if isinstance(threshold, Tensor):
        threshold = threshold.to(w[0].device)
    return w[0] < threshold


# The block of a draw -------------------------------------------------------------------------


def _words(api: str, key: Tensor, shape, words: int, spec) -> list[Tensor]:
    _check_key(api, key)
    shape = _check_shape(api, shape)
    start, local = _block(api, shape, spec)
    return block_words(key[0], key[1], shape, start, local, words, key.device)


def _block(api: str, shape: list[int], spec) -> tuple[list, list[int]]:
    """Per dim: the first global index of this device's block (int or 0-d tensor) and its size."""
    if spec is not None and not isinstance(spec, PartitionSpec):
        raise TypeError(f"fpar.random.{api}: spec must be a fpar.P or None, got {spec!r}.")
    start, local = [0] * len(shape), list(shape)
    stack = frames()
    if spec is None or not stack or stack[-1].token is None:
        return start, local
    mesh = stack[-1].mesh
    check_spec(spec, tuple(shape), mesh.shape, where=f"fpar.random.{api}: shape {tuple(shape)} with spec")
    for d, entry in enumerate(spec.normalized()):
        if entry:
            local[d] = shape[d] // math.prod([mesh.shape[a] for a in entry])
            start[d] = axis_index(entry) * local[d]
    return start, local


# Error checking and messages ---------------------------------------------------------------


def _check_key(api: str, key) -> None:
    if not isinstance(key, Tensor):
        raise TypeError(
            f"fpar.random.{api}: key must be a key tensor from fpar.random.key(seed), got "
            f"{type(key).__name__}. Make one with key = fpar.random.key(0)."
        )
    if key.dtype != torch.int64 or tuple(key.shape) != (2,):
        fix = (
            " (a stack of keys from split: index one, e.g. keys[0])"
            if key.dim() == 2 and key.shape[-1] == 2
            else ""
        )
        raise ValueError(
            f"fpar.random.{api}: key must be an int64 tensor of shape (2,) from fpar.random.key / "
            f"split / fold_in, got dtype {key.dtype} and shape {tuple(key.shape)}{fix}."
        )


def _check_shape(api: str, shape) -> list[int]:
    if isinstance(shape, int) and not isinstance(shape, bool):
        shape = (shape,)
    try:
        out = [operator.index(n) for n in shape]
    except TypeError:
        raise TypeError(
            f"fpar.random.{api}: shape must be a tuple of ints (the global shape), got {shape!r}."
        ) from None
    if any(n < 0 for n in out):
        raise ValueError(f"fpar.random.{api}: shape {tuple(out)} has a negative size.")
    return out


def _float_bits(api: str, dtype) -> int:
    if dtype not in _MANTISSA:
        raise TypeError(
            f"fpar.random.{api}: dtype must be one of float16, bfloat16, float32, float64, got {dtype!r}."
        )
    return _MANTISSA[dtype]


def _threshold(api: str, p):
    if isinstance(p, Tensor):
        if not p.is_floating_point() or p.dim() != 0:
            raise TypeError(
                f"fpar.random.{api}: p must be a number or a 0-d float tensor, got {p.dtype} of shape {tuple(p.shape)}."
            )
        return torch.ceil(p.to(torch.float64) * 2.0**32).to(torch.int64)
    if isinstance(p, bool) or not isinstance(p, (int, float)):
        raise TypeError(f"fpar.random.{api}: p must be a number in [0, 1], got {p!r}.")
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"fpar.random.{api}: p={p} is not a probability; use 0 <= p <= 1.")
    return math.ceil(float(p) * 2.0**32)
