"""Philox-4x32-10 as integer tensor ops, and the element -> counter map of fpar's draws.

Philox (Salmon, Moraes, Dror, Shaw, "Parallel Random Numbers: As Easy as 1, 2, 3", SC'11;
the Random123 library) maps a 128-bit counter and a 64-bit key to 128 random bits with ten
rounds of 32x32->64-bit multiplies and xors.  torch has no general uint32 arithmetic, so every
word is an int64 tensor holding a value in [0, 2**32): a product of two such values is below
2**64, so the int64 product wraps to exactly its 64 bits and ``(p >> 32) & M`` / ``p & M`` are
its high and low words.  Integer ops are exact, so the bits are the same on every device type,
under ``vmap`` and on every process.

Element ``i`` (row-major index into the *global* shape) of a draw that needs ``w`` words per
element (1 for 32-bit outputs, 2 for float64) uses words ``(i % e) * w ...`` of the Philox block
at counter ``(i // e, tag)`` where ``e = 4 // w``.  A device computes only the counters of its
own block, from its block's global indices.
"""

from __future__ import annotations

import os
import warnings

import torch

from .._torch_api import is_functorch_wrapped_tensor

__all__ = [
    "MASK",
    "TAG_DRAW",
    "TAG_FOLD",
    "TAG_SPLIT",
    "block_words",
    "compiled_ok",
    "fused",
    "philox",
    "set_compiled",
]

Tensor = torch.Tensor

MASK = 0xFFFFFFFF
_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # Philox-4x32 multipliers (Random123 philox.h)
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # key bumps (the golden ratio and sqrt(3) - 1)
ROUNDS = 10

TAG_DRAW, TAG_SPLIT, TAG_FOLD = 0, 1, 2
"""Counter word 3 separates the streams: draws, ``split`` and ``fold_in`` never share a block."""


def philox(c0, c1, c2, c3, k0, k1) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Philox-4x32-10 of counter words ``c0..c3`` under key words ``k0, k1``.

    Every argument is an int64 tensor (any broadcastable shapes, batched under ``vmap`` or not)
    or a Python int, holding a 32-bit value.  Returns the four output words, int64 in [0, 2**32).
    """
    for r in range(ROUNDS):
        if r:
            k0 = (k0 + _W0) & MASK
            k1 = (k1 + _W1) & MASK
        p0 = c0 * _M0
        p1 = c2 * _M1
        c0, c1, c2, c3 = ((p1 >> 32) & MASK) ^ c1 ^ k0, p1 & MASK, ((p0 >> 32) & MASK) ^ c3 ^ k1, p0 & MASK
    return c0, c1, c2, c3


def block_words(k0, k1, shape, start, local, words: int, device) -> list[Tensor]:
    """The ``words`` random words of each element of one block of a draw of global ``shape``.

    Args:
      k0: the first key word (an int64 0-d tensor, possibly batched).
      k1: the second key word (as ``k0``).
      shape: the global shape (Python ints).
      start: per dim, the block's first global index (a Python int or an int64 0-d tensor,
        batched under ``vmap`` for a dim split over a mesh axis).
      local: per dim, the block's size.
      words: 32-bit words per element (1 or 2).
      device: where to compute.

    Returns:
      ``words`` int64 tensors of shape ``local``, values in [0, 2**32).
    """
    e = 4 // words
    if local and local[-1] % e == 0:
        # Fast path: the block's rows are whole Philox blocks, so each counter serves e elements.
        counter = _linear(
            shape[:-1] + [shape[-1] // e],
            start[:-1] + [start[-1] // e],
            local[:-1] + [local[-1] // e],
            device,
        )
        w4 = words4(counter, k0, k1)  # (..., L/e, 4): the e elements of each counter, in order
        if words == 1:
            return [w4.reshape(local)]
        return [w4[..., j::2].reshape(local) for j in range(2)]
    index = _linear(shape, start, local, device)
    w4 = words4(index // e, k0, k1)  # (*local, 4), the counter of each element
    sub = (index % e) * words
    return [torch.gather(w4, -1, (sub + j).unsqueeze(-1)).squeeze(-1) for j in range(words)]


CHUNK = 1 << 16
"""Counters per Philox evaluation.  Its ~120 elementwise ops each allocate a temporary of the
evaluated size, so evaluating a large block in pieces bounds that memory (a few MB here) instead
of allocating int64 temporaries of 2x the block's size per op."""


_COMPILED: dict = {"on": os.environ.get("FPAR_RANDOM_COMPILE", "0") == "1", "fns": {}}


def set_compiled(enabled: bool = True) -> None:
    """Draw with a ``torch.compile``d Philox kernel (one fused loop) instead of eager tensor ops.

    The bits are identical (integer arithmetic; tested against the eager path and the Random123
    vectors).  On CPU the fused kernel is ~10x faster than the eager rounds and faster than
    ``torch.rand``; the first draw in a process compiles it (a few seconds, then cached on disk
    by inductor).  Off by default (the environment variable ``FPAR_RANDOM_COMPILE=1`` turns it
    on).  Used for plain tensors only: draws under ``vmap`` (the in-process mesh), under
    ``torch.func`` transforms or inside a ``TorchFunctionMode`` run eagerly.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"fpar.random.set_compiled: enabled must be a bool, got {enabled!r}.")
    _COMPILED["on"] = enabled


def words4(counter: Tensor, k0, k1) -> Tensor:
    """The four Philox words of each counter (int64 >= 0), stacked last: ``(*counter.shape, 4)``."""
    if torch.compiler.is_compiling():  # a step traced whole (Dynamo reads no functorch wrapper)
        return _functional_words4(counter, k0, k1)
    if compiled_ok(counter, k0, k1):
        flat = counter.reshape(-1)
        if flat._base is not None:  # a view: its base's rank would be a guard (a compile per rank)
            flat = flat.clone()
        return fused(_words4_fused, flat, k0, k1).reshape(*counter.shape, 4)
    if not any(is_functorch_wrapped_tensor(t) for t in (counter, k0, k1)):
        return _words4_in_place(counter.reshape(-1), int(k0), int(k1)).t().reshape(*counter.shape, 4)
    return _functional_words4(counter, k0, k1)


def _functional_words4(counter: Tensor, k0, k1) -> Tensor:
    """``words4`` by the functional rounds (any tensors: batched, tracked, traced), in chunks."""
    flat = counter.reshape(-1)
    parts = [torch.stack(_draw_words(c, k0, k1), -1) for c in flat.split(CHUNK)] if flat.numel() else []
    out = torch.cat(parts) if len(parts) > 1 else parts[0] if parts else flat.new_zeros((0, 4))
    return out.reshape(*counter.shape, 4)


def _words4_in_place(flat: Tensor, k0: int, k1: int) -> Tensor:
    """``philox`` of plain tensors without a temporary per op: ``(4, n)``, the rounds in place.

    (The functional rounds allocate ~120 block-sized int64 tensors; on CPU the allocations and
    their first-touch page faults were a third of the time in a torch.profiler trace.)
    """
    out = torch.empty((4, flat.numel()), dtype=torch.int64, device=flat.device)
    p0, p1 = (torch.empty(min(CHUNK, flat.numel()), dtype=torch.int64, device=flat.device) for _ in range(2))
    for lo in range(0, flat.numel(), CHUNK):
        c = flat[lo : lo + CHUNK]
        n = c.numel()
        a0, a1, a2, a3 = out[:, lo : lo + n]
        q0, q1 = p0[:n], p1[:n]
        torch.bitwise_and(c, MASK, out=a0)
        torch.bitwise_right_shift(c, 32, out=a1)
        a2.zero_()
        a3.fill_(TAG_DRAW)
        r0, r1 = k0, k1
        for r in range(ROUNDS):
            if r:
                r0, r1 = (r0 + _W0) & MASK, (r1 + _W1) & MASK
            torch.mul(a0, _M0, out=q0)
            torch.mul(a2, _M1, out=q1)
            torch.bitwise_right_shift(q1, 32, out=a0).bitwise_and_(MASK).bitwise_xor_(a1).bitwise_xor_(r0)
            torch.bitwise_and(q1, MASK, out=a1)
            torch.bitwise_right_shift(q0, 32, out=a2).bitwise_and_(MASK).bitwise_xor_(a3).bitwise_xor_(r1)
            torch.bitwise_and(q0, MASK, out=a3)
    return out


def compiled_ok(*tensors) -> bool:
    """Whether to run the compiled kernels: on, plain tensors (no vmap/grad wrappers), no mode."""
    return (
        _COMPILED["on"]
        and not torch._C._is_torch_function_mode_enabled()
        and not any(isinstance(t, Tensor) and is_functorch_wrapped_tensor(t) for t in tensors)
    )


def fused(fn, *args):
    """``torch.compile(fn)(*args)``, compiled at the first call in the process."""
    compiled = _COMPILED["fns"].get(fn)
    if compiled is not None:
        return compiled(*args)
    with warnings.catch_warnings():  # the compiler's first use imports a deprecated torch.jit name
        warnings.filterwarnings("ignore", message=r".*torch\.jit\.script_method", category=DeprecationWarning)
        compiled = torch.compile(fn, dynamic=True)
        out = compiled(*args)
    _COMPILED["fns"][fn] = compiled
    return out


def _words4_fused(counter: Tensor, k0: Tensor, k1: Tensor) -> Tensor:
    """``philox`` of the draw counters, ``(n, 4)``: the function ``torch.compile`` fuses."""
    k0, k1 = k0.to(counter.device), k1.to(counter.device)
    return torch.stack(philox(counter & MASK, counter >> 32, torch.zeros_like(counter), TAG_DRAW, k0, k1), -1)


def _draw_words(counter: Tensor, k0, k1) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return philox(counter & MASK, counter >> 32, 0, TAG_DRAW, k0, k1)


def _linear(shape, start, local, device) -> Tensor:
    """Row-major global index of every element of the block (int64, shape ``local``)."""
    index = torch.zeros((), dtype=torch.int64, device=device)
    for n, s, size in zip(shape, start, local):
        index = index.unsqueeze(-1) * n + (torch.arange(size, dtype=torch.int64, device=device) + s)
    return index
