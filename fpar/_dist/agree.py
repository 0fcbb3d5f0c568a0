"""Every rank calls with the same description, or every rank raises: one small SUM all-reduce.

For drivers whose messages all ranks must post alike but that no ``fpar.shard`` signature check
covers (the pipeline executor's point-to-point schedule): each rank hashes its description of
the step (schedule, shapes, dtypes) into ``_CHUNKS`` chunks of ``_BITS`` bits, and all-reduces
the chunks and their squares over the mesh. The hashes agree on every rank iff
``n * sum(c**2) == sum(c)**2`` for every chunk (the same test as ``shard._Agreement``). On a
mismatch every rank gathers the descriptions and raises the same ``ValueError`` naming what
differs and on which ranks, before any message whose pairing depends on the description. A rank
whose own checks failed first sends its part flagged, so the others raise naming it rather than
wait for it until the process-group timeout.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

__all__ = ["check_same"]

_BITS, _CHUNKS = 8, 7  # as shard._Agreement: a 56-bit hash, sums of squares exact in float64
_MASK_BITS = 48  # group ranks below this are named when they fail (exact in float64)


def check_same(mesh, fields: dict[str, str], device: torch.device, api: str, *, failed: bool = False) -> None:
    """Raise on every rank of ``mesh`` unless all of them passed equal ``fields``.

    ``fields``: name -> this rank's value, as text (what the message names when they differ).
    ``failed``: this rank raised before its first message (its own error is on its way); the
    others raise a ``RuntimeError`` naming it instead of waiting for it until the timeout.
    """
    n = mesh.size
    if n == 1:
        return
    mg = mesh._dist
    group = mg.group(mesh.axis_names)
    me = dist.get_group_rank(group, mg.rank)
    # (not cached: a step's shapes may change every step, e.g. with the sequence length)
    h = int.from_bytes(hashlib.blake2b(repr(sorted(fields.items())).encode(), digest_size=7).digest(), "little")
    chunks = [(h >> (_BITS * i)) & ((1 << _BITS) - 1) for i in range(_CHUNKS)]
    mask = float(2**me) if failed and me < _MASK_BITS else 0.0
    values = [*chunks, *(c * c for c in chunks), float(failed), mask]
    buf = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(buf, group=group)
    sums = [int(v) for v in buf.tolist()]
    n_failed, mask = sums[2 * _CHUNKS :]
    if n_failed:
        if failed:
            return
        ranks = [dist.get_global_rank(group, i) for i in range(min(n, _MASK_BITS)) if mask >> i & 1]
        raise RuntimeError(
            f"{api}: {n_failed} of the {n} ranks raised before the step's first message"
            + (f" (global rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})" if ranks else "")
            + "; see their errors. This rank stops here rather than wait for them."
        )
    if all(n * q == s * s for s, q in zip(sums[:_CHUNKS], sums[_CHUNKS : 2 * _CHUNKS])):
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
