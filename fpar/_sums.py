"""How sums over devices of fp16/bf16 values accumulate: ``fpar.low_precision_sums``.

fpar's rule (the default, ``"float32"``): a ``psum``, ``pmean`` or ``psum_scatter`` of fp16/bf16
blocks (and every transpose or gradient all-reduce that sums them) accumulates in float32 and
rounds once to the blocks' dtype, on both meshes; a real mesh sends such sums as float32, twice
the bytes of the blocks.  ``"native"`` sums in the blocks' own dtype, as Megatron-LM's
tensor-parallel all-reduces and DDP's gradient all-reduce do: half the bytes, and a partial sum
rounded at each step of the collective.  Over 2 devices the two agree bit for bit (one sum of two
values, rounded once either way); over more, a native sum's rounding depends on the order the
collective adds in, which NCCL and gloo do not promise: the in-process mesh adds the devices'
blocks in rank order, each step rounded, so the two meshes agree to the dtype's rounding there,
not bit for bit.  A native ``pmean`` divides each block by the device count first, then sums (as
DDP's and Megatron-LM's gradient averaging do): it does not overflow fp16 where the mean fits.  A
native ``psum`` whose result fp16 cannot hold gives ``inf``, as in those libraries (under
``fpar.optim.mixed_precision`` with fp16, the loss scale's overflow check skips such a step).
"""

from __future__ import annotations

import torch

__all__ = ["low_precision_sums", "widened", "wire_itemsize"]

MODES = ("float32", "native")
LOW_PRECISION = (torch.float16, torch.bfloat16)
SUM_KINDS = frozenset({"psum", "pmean", "psum_scatter", "pvary"})  # pvary: its transpose's sum

_MODE = ["float32"]


class low_precision_sums:  # noqa: N801  (a function-like context manager, as torch.set_grad_enabled)
    """Set how sums over devices of fp16/bf16 values accumulate, for every mesh and call.

    ``"float32"`` (the default, fpar's rule): accumulate in float32, round once to the dtype.
    ``"native"``: in the values' own dtype (Megatron-LM's and DDP's choice), half the bytes on the
    wire; over more than 2 devices its rounding depends on the collective's order of additions.
    Takes effect when called (as ``torch.set_grad_enabled``); as a context manager, the previous
    setting comes back at the ``with`` block's end.  A compiled call follows it too (Dynamo
    guards on the setting: a change traces the call again).  Every process of a real mesh must use the same setting, as it runs the same
    collectives.  ``fpar.plan.estimate`` costs the messages of the setting active while it runs.

    Args:
      mode: ``"float32"`` or ``"native"``.

    Example:
      >>> with fpar.low_precision_sums("native"):  # tensor-parallel all-reduces in bf16
      ...     loss, grads = step(params, batch)
    """

    def __init__(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(
                f"fpar.low_precision_sums: mode {mode!r}; use 'float32' (accumulate fp16/bf16 sums in "
                f"float32, rounded once: fpar's default) or 'native' (in the values' own dtype)."
            )
        self.previous, _MODE[0] = _MODE[0], mode

    def __enter__(self) -> low_precision_sums:
        return self

    def __exit__(self, *exc: object) -> None:
        _MODE[0] = self.previous

    def __repr__(self) -> str:
        return f"fpar.low_precision_sums({_MODE[0]!r})"


def widened(dtype: torch.dtype) -> bool:
    """Whether a sum of blocks of ``dtype`` accumulates in float32 (fp16/bf16 under fpar's rule)."""
    return dtype in LOW_PRECISION and _MODE[0] == "float32"


def wire_itemsize(kind: str, dtype: torch.dtype) -> int:
    """Bytes an element of a ``kind`` collective of ``dtype`` blocks takes on the wire."""
    if kind in SUM_KINDS and widened(dtype):
        return 4
    return dtype.itemsize
