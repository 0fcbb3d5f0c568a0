"""Refuse torch's stateful random ops inside ``fpar.shard``.

``torch.rand`` inside a per-device function would draw from one process-wide generator: in one
process every device would get a different slice of one stream (in-process) or the same draw
(one generator per process, same seed), so the result would depend on the layout.  fpar raises
instead and points to ``fpar.random``.  The check is a plain function of the called function, so
any backend's ``TorchFunctionMode`` can call it: fpar's ``ShardMode`` (every in-process
``fpar.shard`` call) and the real mesh's tracker (the traced call of each signature) do.  The
real mesh's later calls run without a mode; they compare torch's generator state before and
after instead (``fpar/_dist/shard.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["RANDOM_OPS", "check_random_op"]

Tensor = torch.Tensor

_DROPOUTS = {
    F.dropout: "fpar.ops.dropout(key, x, rate, spec=...)",
    F.dropout1d: "fpar.ops.dropout(key, x, rate, spec=...)",
    F.dropout2d: "fpar.ops.dropout(key, x, rate, spec=...)",
    F.dropout3d: "fpar.ops.dropout(key, x, rate, spec=...)",
    F.alpha_dropout: "fpar.ops.dropout(key, x, rate, spec=...)",
    F.feature_alpha_dropout: "fpar.ops.dropout(key, x, rate, spec=...)",
    torch.dropout: "fpar.ops.dropout(key, x, rate, spec=...)",
    torch.alpha_dropout: "fpar.ops.dropout(key, x, rate, spec=...)",
    torch.feature_dropout: "fpar.ops.dropout(key, x, rate, spec=...)",
    torch.feature_alpha_dropout: "fpar.ops.dropout(key, x, rate, spec=...)",
}

_UNIFORM = "fpar.random.uniform(key, shape, spec=...)"
_NORMAL = "fpar.random.normal(key, shape, spec=...)"
_BERNOULLI = "fpar.random.bernoulli(key, p, shape, spec=...)"

RANDOM_OPS = {
    torch.rand: _UNIFORM,
    torch.rand_like: _UNIFORM,
    torch.randn: _NORMAL,
    torch.randn_like: _NORMAL,
    torch.normal: _NORMAL,
    torch.randint: "fpar.random.bits",
    torch.randint_like: "fpar.random.bits",
    torch.randperm: "a permutation drawn outside fpar.shard and passed in",
    torch.bernoulli: _BERNOULLI,
    torch.multinomial: "a sample drawn outside fpar.shard and passed in",
    torch.poisson: "a sample drawn outside fpar.shard and passed in",
    torch.rrelu: "a deterministic activation",
    F.rrelu: "a deterministic activation",
    F.gumbel_softmax: "fpar.random.uniform to build the Gumbel noise",
    Tensor.uniform_: _UNIFORM,
    Tensor.normal_: _NORMAL,
    Tensor.bernoulli: _BERNOULLI,
    Tensor.bernoulli_: _BERNOULLI,
    Tensor.random_: "fpar.random.bits",
    Tensor.exponential_: "a transform of fpar.random.uniform",
    Tensor.geometric_: "a transform of fpar.random.uniform",
    Tensor.cauchy_: "a transform of fpar.random.uniform",
    Tensor.log_normal_: "a transform of fpar.random.normal",
    **_DROPOUTS,
}
"""torch's stateful random functions -> the fpar.random replacement named in the error."""


def check_random_op(func, args: tuple, kwargs: dict, fname: str) -> None:
    """Raise if ``func`` is a stateful torch random op that would draw inside ``fpar.shard``.

    Dropout that does nothing (``training=False`` or ``p=0``) is allowed: it is deterministic.

    Args:
      func: the function a ``TorchFunctionMode`` intercepted.
      args: its positional arguments.
      kwargs: its keyword arguments.
      fname: the name of the sharded function, for the message.

    Raises:
      RuntimeError: naming the op and the ``fpar.random`` function to use instead.
    """
    use = RANDOM_OPS.get(func)
    if use is None:
        return
    if func in _DROPOUTS and _inactive_dropout(func, args, kwargs):
        return
    raise RuntimeError(
        f"fpar.shard({fname}): {_display(func)} was called inside the sharded function. torch's "
        f"random ops draw from a per-process generator, so the result would depend on the mesh "
        f"layout (or repeat on every device). Use fpar.random with an explicit key instead: "
        f"{use} (pass the key in with in_spec P(); the draw is the block of one global array, the "
        f"same at any layout), or draw outside fpar.shard and pass the tensor in with a spec."
    )


def _display(func) -> str:
    """``torch.rand``, ``torch.nn.functional.dropout``, ``torch.Tensor.uniform_``."""
    name = func.__name__
    if getattr(func, "__module__", None) == "torch.nn.functional":
        return f"torch.nn.functional.{name}"
    if getattr(func, "__objclass__", None) is not None or getattr(Tensor, name, None) is func:
        return f"torch.Tensor.{name}"
    return f"torch.{name}"


def _inactive_dropout(func, args: tuple, kwargs: dict) -> bool:
    if func in (torch.dropout, torch.alpha_dropout, torch.feature_dropout, torch.feature_alpha_dropout):
        p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
        train = args[2] if len(args) > 2 else kwargs.get("train", True)
    else:
        p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
        train = args[2] if len(args) > 2 else kwargs.get("training", True)
    return not train or p == 0
