"""Every rank calls with the same description, or every rank raises: one small SUM all-reduce.

For drivers whose messages all ranks must post alike but that no ``fpar.shard`` signature check
covers (the pipeline executor's point-to-point schedule): each rank hashes its description of
the step (schedule, shapes, dtypes) into ``_CHUNKS`` chunks of ``_BITS`` bits, and all-reduces
the chunks and their squares over the mesh. The hashes agree on every rank iff
``n * sum(c**2) == sum(c)**2`` for every chunk. The primitives here (``digest``,
``hash_values``, ``agreed``, ``failed_bit``, ``failed_error``) are also ``fpar.shard``'s
per-call signature check's (``shard._Agreement``). On a
mismatch every rank gathers the descriptions and raises the same ``ValueError`` naming what
differs and on which ranks, before any message whose pairing depends on the description. A rank
whose own checks failed first sends its part flagged, so the others raise naming it rather than
wait for it until the process-group timeout.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from . import groups

__all__ = ["agreed", "check_same", "digest", "failed_bit", "failed_error", "hash_values"]

_BITS, _CHUNKS = 8, 7  # a 56-bit hash in chunks whose sums of squares stay exact (float32, < 128 ranks)


def digest(text: str) -> int:
    """A 56-bit hash of ``text``, the same in every process."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")


def hash_values(h: int) -> list[int]:
    """``h`` as a header's ``2 * _CHUNKS`` values: its chunks, then their squares."""
    chunks = [(h >> (_BITS * i)) & ((1 << _BITS) - 1) for i in range(_CHUNKS)]
    return [*chunks, *(c * c for c in chunks)]


def agreed(sums: list[int], n: int) -> bool:
    """Whether ``n`` ranks' summed ``hash_values`` came from the same hash on every rank."""
    return all(n * q == s * s for s, q in zip(sums[:_CHUNKS], sums[_CHUNKS : 2 * _CHUNKS]))


def failed_bit(group, rank: int, bits: int) -> float:
    """This rank's bit in a failed-ranks mask (group ranks below ``bits`` are named; 0 above)."""
    me = dist.get_group_rank(group, rank)
    return float(2**me) if me < bits else 0.0


def failed_error(where: str, before: str, n_failed: int, n: int, mask: int, group, bits: int) -> RuntimeError:
    """The error of the ranks that did not fail: how many did, and which (from the summed mask)."""
    ranks = [dist.get_global_rank(group, i) for i in range(min(n, bits)) if mask >> i & 1]
    return RuntimeError(
        f"{where}: {n_failed} of the {n} ranks raised before {before}"
        + (f" (global rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})" if ranks else "")
        + "; see their errors. This rank stops here rather than wait for them."
    )


_MASK_BITS = 48  # check_same names failed group ranks below this (exact in its float64 header)


def check_same(mesh, fields: dict[str, str], device: torch.device, api: str, *, failed: bool = False) -> None:
    """Raise on every rank of ``mesh`` unless all of them passed equal ``fields``.

    ``fields``: name -> this rank's value, as text (what the message names when they differ).
    ``failed``: this rank raised before its first message (its own error is on its way); the
    others raise a ``RuntimeError`` naming it instead of waiting for it until the timeout.
    """
    n = mesh.size
    if n == 1 or groups.simulated():  # a simulated device (fpar.plan): every rank runs this program
        return
    mg = mesh._dist
    group = mg.group(mesh.axis_names)
    # (not cached: a step's shapes may change every step, e.g. with the sequence length)
    mask = failed_bit(group, mg.rank, _MASK_BITS) if failed else 0.0
    values = [*hash_values(digest(repr(sorted(fields.items())))), float(failed), mask]
    buf = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(buf, group=group)
    sums = [int(v) for v in buf.tolist()]
    n_failed, mask = sums[2 * _CHUNKS :]
    if n_failed:
        if failed:
            return
        raise failed_error(api, "the step's first message", n_failed, n, mask, group, _MASK_BITS)
    if agreed(sums, n):
        return
    everyone: list = [None] * n
    dist.all_gather_object(everyone, (mg.rank, fields), group=group)
    by_rank = dict(everyone)
    lines = []
    for name in fields:
        values = {r: f.get(name) for r, f in sorted(by_rank.items())}
        if len(set(values.values())) > 1:
            lines.append(f"{name} (" + "; ".join(f"rank {r}: {v}" for r, v in values.items()) + ")")
    raise ValueError(
        f"{api}: the ranks run different steps, so their messages would not pair up; what differs: "
        + ("; ".join(lines) or "their descriptions")
        + ". Every process must run the same step: the same schedule and the same shapes and dtypes."
    )
