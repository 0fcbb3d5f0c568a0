"""The per-call signature agreement of a real-mesh ``fpar.shard`` call.

**Agreement.**  Every rank must call with the same signature (shapes, dtypes, specs).  No
message is sent just to check it: every rank's first message of a call is the same SUM
all-reduce over the mesh's own ranks (``_Agreement``), of the mesh's current *wire* (a dtype and
a length every rank holds alike, sized by earlier verdicts: ``_Wire``), carrying the signature's
56-bit hash in a form whose sums show whether all ranks agree, and, when they fit, the block of
the call's first collective if it is a float psum/pmean over every mesh axis (a data-parallel
loss) and the call's first gradient bucket (``buckets.py``): such a call's first message waits
for that bucket's launch in the backward, so a small data-parallel step makes one round trip.
Otherwise it goes alone just before the first collective or before returning.  On a planned
call a carried block's message is sent without waiting: the result is a ``Pending`` tensor,
whose sum and check are read at its first use or before the next collective fpar issues
(``pending.py``), so a data-parallel step synchronises once, at its gradients.  Because every
rank's first message has the same form, a rank whose cache hits pairs with one that misses and
ranks that disagree never meet in different collectives.  On mismatch every rank gathers the
signatures and raises naming the argument, ranks and what differs; a rank whose function raises
before its first collective sends its part flagged, and the others raise naming it.  The plan
itself holds no state a rank could disagree on; the wire's size changes only in a verdict, from
the sums every rank reads.
"""

from __future__ import annotations

import collections

import torch
import torch.distributed as dist

from .. import _defer
from .._buffers import block, kept_or_new
from .._compile import untraced
from .._sums import widened
from . import pending
from .agree import _CHUNKS, agreed, failed_bit, failed_error, hash_values
from .groups import _device, simulated
from .pending import Pending, defer

__all__ = ["_Agreement", "_differences"]

Tensor = torch.Tensor


def _may_wait_later() -> bool:
    """Whether a carried sum may be a ``Pending`` value: no transform but ``torch.func.grad``."""
    from torch._C import _functorch

    if torch.autograd.forward_ad._current_level >= 0:
        return False
    stack = _functorch.get_interpreter_stack() or ()
    return all(i.key() == _functorch.TransformType.Grad for i in stack)


@untraced
class _Agreement:
    """The per-call signature check, carried by the call's first message (see the module doc).

    Every rank's first message of a call is the same *wire message*: a SUM all-reduce over the
    mesh's ranks of the *wire* (a dtype and a length, ``MeshGroups.wires``, the same on every
    rank: it changes only in an agreed verdict), the header below, then room.  Two things may
    ride in the room, so that no message is sent just to check the signature:

    * the *block* of the call's first collective, when it is a float psum/pmean over every mesh
      axis (a data-parallel loss; a tensor-parallel activation sum), right after the header;
    * the call's *first gradient bucket* (``buckets._State``), at the end of the wire, when its
      all-reduce is over the same ranks.  A planned call whose bucket 0 fits then does not send
      its first message in the forward at all: the message waits (``_First``) and goes with the
      bucket's all-reduce, so a small data-parallel step makes one round trip, as DDP's.

    Otherwise the header goes alone, just before the first collective (or before returning, for
    a call with none).  Either way the ranks' messages pair up, so a rank whose plan cache hits
    cannot be paired with one that misses.

    Header (exact in float32 for meshes of fewer than ``_F32_RANKS`` ranks): the signature hash
    as ``agree._CHUNKS`` chunks of ``agree._BITS`` bits and their squares (all the same on every rank iff
    ``n * sum(c**2) == sum(c)**2`` per chunk), how many ranks' blocks and buckets ride along,
    how many ranks' functions raised before their first collective (and a bitmask of the
    first ``_MASK_BITS`` group ranks), and the room each rank would want (elements, and whether
    in float32 or float64).  Every rank reads the same sums, so every rank reaches the same
    verdict: go on; raise naming what differs (after gathering the signatures); raise naming
    the ranks that failed; or, where only some ranks' blocks or buckets rode along (a rank read
    its loss before the backward, or traced this signature while another had it planned),
    discard those sums and send them again as usual, in the same place on every rank.  The
    verdict also sizes the wire for the next calls on these axes from the room the ranks want
    (``_Wire``, up to ``_CAP_BYTES``): every rank computes the same size from the same sums.
    """

    def __init__(self, owner, plan, *, lazy: bool = False):  # a shard.DistShard, its shard._Plan
        self.owner, self.plan = owner, plan
        # no check on a simulated mesh (fpar.plan): every rank there runs this very program
        self.pending = bool(owner.axes) and owner.mesh.size > 1 and not simulated()
        self.lazy = lazy  # a planned call: a carried sum may be waited on at its first use
        self.bucket = None  # bucket 0 (buckets._State) when it may ride in the first message
        self.first: _First | None = None  # the first message while it waits for bucket 0
        # what this call's backward sends for its replicated inputs (a planned call's from
        # buckets.reduce_inputs): "reduced" (all-reduces), "deferred" (fpar.defer_reduction:
        # none, sums kept) or "none" (no gradient flows: torch.no_grad(), no input requires
        # grad).  The ranks must agree on it as on the signature, or their next messages would
        # not pair: it salts the hash
        self.grads = "reduced" if torch.is_grad_enabled() else "none"

    def carry(self, kind: str, axes: tuple, x: Tensor, params: tuple) -> tuple:
        """Before a communicating collective: the params to run it with (the check done or carried).

        Returns ``(self,)`` when ``x`` may ride in the first message: ``exchange._run`` then calls
        :meth:`reduce`.  Otherwise the header goes alone first, and ``params`` are returned.
        """
        if not self.pending:
            return params
        if (
            kind in ("psum", "pmean")
            and set(axes) == set(self.owner.axes)
            and x.is_floating_point()
            and x.numel() <= _cap(torch.float32)
        ):
            return (self,)
        self._exchange(None, failed=False)
        return params

    def reduce(self, x: Tensor, kind: str, n: int) -> Tensor | None:
        """The carried psum/pmean of ``x`` (as ``x.dtype``), or ``None``: run the collective as usual.

        On a planned call the message goes without waiting (``pending.py``): the result is a
        ``Pending`` tensor, and the check and the sum are read at its first use or before the
        next collective.  The first call of a signature waits, as under a transform that could
        look inside the value (vmap, forward-mode AD).
        """
        if self.lazy and not self.plan.read_inside and _may_wait_later():
            return self._send_async(x, kind, n)
        y = self._exchange(x, failed=False)
        return None if y is None else (y / n if kind == "pmean" else y)

    def finish(self) -> None:
        """Before returning: the check, if no collective carried it (waiting for bucket 0 if it may)."""
        if not self.pending:
            return
        if self.lazy and self.bucket is not None and _may_wait_later():
            self._send_async(None, "psum", 1)
        else:
            self._exchange(None, failed=False)

    def settle(self) -> None:
        """The function raised: send this rank's part, flagged failed, so no rank waits on it."""
        if self.pending:
            self._exchange(None, failed=True)

    def join(self, bucket) -> bool:
        """Bucket 0's launch: send the waiting first message with it.  Whether the bucket rode."""
        first, self.first = self.first, None
        if first is None or first.work is not None:
            return False  # sent already (read early, or another collective came first)
        return first.send(bucket)

    def _exchange(self, x: Tensor | None, *, failed: bool) -> Tensor | None:
        buf, group, members, layout = self._message(x, failed)
        dist.all_reduce(buf, group=group)
        return self._verdict(buf, x, failed, group, members, layout)

    def _send_async(self, x: Tensor | None, kind: str, n: int) -> Tensor | None:
        """The first message without waiting: now, or, when bucket 0 may ride, at its launch."""
        self.pending = False
        self.owner.mg.group(self.owner.axes)  # settles earlier calls' messages first
        out = None
        if x is not None:
            with torch._C.DisableTorchFunction():
                x = x.detach().clone()
                out = Pending(torch.empty_like(x))
        first = _First(self, x, kind, n, out)
        if self.bucket is not None and self._fits(x, self.bucket):
            self.first = first  # sent by bucket 0's launch, or by the next settling
        else:
            first.send(None)
        defer(first.verdict, first)
        return out

    def wire_for(self, bucket) -> Tensor | None:
        """A buffer for the first message whose tail ``bucket`` may use as its flat buffer.

        When bucket 0 will ride in the waiting first message in the wire's own dtype, its
        cotangents are written straight into the message and summed there: no copy in or out.
        Kept by the plan and reused once nothing holds it (its gradients were dropped).
        """
        first = self.first
        dtype, size = self._wire()
        if (
            first is None
            or first.work is not None
            or bucket.layout.dtype != dtype
            or not self._fits(first.x, bucket)
        ):
            return None
        flats = self.plan.flats
        flats["wire"] = kept_or_new(flats.get("wire"), (size,), dtype, bucket.layout.device)
        return flats["wire"]

    def _fits(self, x: Tensor | None, bucket) -> bool:
        """Whether ``bucket`` rides with ``x`` in the wire as it is now."""
        dtype, size = self._wire()
        k = 0 if x is None else x.numel()
        return _HEAD + k + bucket.layout.numel <= size and _rides(bucket.layout.dtype, dtype)

    def _wire(self) -> tuple:
        wire = self.owner.mg.root.wires.get(self.owner.wire_key)
        return _WIRE0 if wire is None else wire.now

    def _message(self, x: Tensor | None, failed: bool, bucket=None, *, settle: bool = True) -> tuple:
        """This rank's first message: the header, ``x``'s block and ``bucket``'s gradients if they ride."""
        self.pending = False
        mg = self.owner.mg
        group = mg.group(self.owner.axes, settle=settle)  # settles earlier calls' messages first
        members = mg.members(self.owner.axes)
        dtype, size = self._wire()
        k = 0 if x is None else x.numel()
        rides = x is not None and _rides(x.dtype, dtype) and _HEAD + k <= size
        m = 0 if bucket is None else bucket.layout.numel
        joins = bucket is not None and _rides(bucket.layout.dtype, dtype) and _HEAD + k + m <= size
        mask = failed_bit(group, mg.rank, _MASK_BITS) if failed else 0.0
        want = self._want(x)
        if self.bucket is not None:  # this call's first message goes now: bucket 0 rides or it does not
            self.bucket.rider = self.bucket = None  # (and no reference cycle keeps its buffer)
        with torch._C.DisableTorchFunction(), torch._C._DisableFuncTorch():  # plain buffers, also in a hook
            dev = x.device if x is not None else _device([])
            head = self._head(dtype, dev, rides, joins, failed, mask, want)
            if (
                joins
                and bucket.wire is not None
                and bucket.wire.shape == (size,)
                and bucket.wire.dtype == dtype
            ):
                buf = bucket.wire  # its tail holds the bucket already
                buf.narrow(0, 0, size - m).zero_()
            else:
                buf = torch.zeros(size, dtype=dtype, device=dev)
            buf.narrow(0, 0, _HEAD).copy_(head)
            if rides:
                buf.narrow(0, _HEAD, k).copy_(x.detach().reshape(-1))
            if joins:
                bucket.pack(buf.narrow(0, size - m, m))
        return buf, group, members, (rides, bucket if joins else None, m)

    def _head(self, dtype, dev, rides: bool, joins: bool, failed: bool, mask: float, want: tuple) -> Tensor:
        """The header's values as a tensor (kept per plan: the same few recur every call)."""
        key = (dtype, dev, rides, joins, failed, mask, self.grads, *want)
        head = self.plan.heads.get(key)
        if head is None:
            h = self.plan.digest ^ _GRAD_SALTS[self.grads]
            values = [*hash_values(h), float(rides), float(joins), float(failed), mask, *want]
            head = self.plan.heads[key] = torch.tensor(values, dtype=dtype, device=dev)
        return head

    def _want(self, x: Tensor | None) -> tuple:
        """The wire this call would fill: (elements, wants float32, wants float64) for the header."""
        parts = [] if x is None else [(x.numel(), x.dtype)]
        b = self.bucket
        if b is not None and _HEAD + sum(k for k, _ in parts) + b.layout.numel <= _cap(b.layout.dtype):
            parts.append((b.layout.numel, b.layout.dtype))
        if not parts:
            return 0.0, 0.0, 0.0  # nothing to carry: no say in the wire's size
        wide = any(d == torch.float64 for _, d in parts)
        return float(_HEAD + sum(k for k, _ in parts)), float(not wide), float(wide)

    def _verdict(self, buf: Tensor, x: Tensor | None, failed: bool, group, members, layout) -> Tensor | None:
        """Read the summed first message: go on (with the carried sums), or raise on every rank."""
        owner = self.owner
        n = len(members)
        rides, bucket, m = layout
        with torch._C.DisableTorchFunction():
            sums = [int(v) for v in buf.narrow(0, 0, _HEAD).tolist()]
        carried, joined, n_failed, mask, want, in32, in64 = sums[2 * _CHUNKS :]
        if n_failed:
            if failed:
                return None  # this rank's own error is on its way
            _defer.drop_all()  # every rank raises: no rank keeps sums of the failed step
            raise failed_error(
                f"fpar.shard({owner.fname})",
                "this call's first collective",
                n_failed,
                n,
                mask,
                group,
                _MASK_BITS,
            )
        if not agreed(sums, n):
            _defer.drop_all()
            self._raise(group, members)  # every rank (a failed one too) gathers, then raises
        self._resize(n, want, in32, in64)
        if bucket is not None:  # every rank's bucket rode, or it goes again at its own place
            with torch._C.DisableTorchFunction():
                bucket.rode(buf.narrow(0, buf.numel() - m, m) if joined == n else None)
        if failed or not rides or carried != n:
            return None
        with torch._C.DisableTorchFunction():
            return block(buf, _HEAD, x.shape).to(x.dtype)

    def _resize(self, n: int, want: int, in32: int, in64: int) -> None:
        """Size the wire to the room the ranks want (the same sums, so the same size everywhere)."""
        if in32 == n and n < _F32_RANKS:
            dtype = torch.float32
        elif in64 == n:
            dtype = torch.float64
        elif in32 == in64 == 0:
            dtype = None  # no rank wants room
        else:
            return  # rooms of different dtypes: keep the wire
        wires = self.owner.mg.root.wires
        key = self.owner.wire_key
        wire = wires.get(key) or wires.setdefault(key, _Wire())
        wire.add(dtype, 0 if dtype is None else min(-(-want // n), _cap(dtype)))

    def _raise(self, group, members) -> None:
        owner = self.owner
        sigs: list = [None] * len(members)
        mine = (owner.fname, owner.static_text, self.plan.sig, self.grads, owner.bucket_mb)
        dist.all_gather_object(sigs, mine, group=group)
        by_rank = dict(zip(sorted(members), sigs))  # all_gather_object orders by group rank
        raise ValueError(f"fpar.shard({owner.fname}): " + _differences(by_rank))


class _Wire:
    """The size of every first message over some axes.

    The most room any of the last ``_WINDOW`` calls wanted, in the dtype the latest one that
    wanted room asked for (``_WIRE0`` if none).  A window, not a high-water mark, so that a mesh
    whose calls stop carrying buckets (a pipeline's stage calls, ``_First.verdict``) stops
    padding every call's first message.
    """

    __slots__ = ("recent", "now")

    def __init__(self):
        self.recent: collections.deque = collections.deque(maxlen=_WINDOW)
        self.now = _WIRE0

    def add(self, dtype: torch.dtype | None, size: int) -> None:
        self.recent.append((dtype, size))
        if (dtype, size) == self.now:
            return  # the latest dtype, and the most room it wants: the size stays
        dtype = next((d for d, _ in reversed(self.recent) if d is not None), None)
        if dtype is None:
            self.now = _WIRE0
        else:
            self.now = (dtype, max([_WIRE0[1], *(k for d, k in self.recent if d == dtype)]))


@untraced
class _First:
    """A planned call's first message, sent without waiting; its verdict runs at the next settling.

    ``send`` builds and posts it (with bucket 0 when that rides); until then it counts as in
    flight (``pending.in_flight``), so other buckets are held behind it, and a settling sends
    it alone.
    """

    __slots__ = ("agree", "x", "kind", "n", "out", "work", "buf", "group", "members", "layout")

    def __init__(self, agree: _Agreement, x: Tensor | None, kind: str, n: int, out: Pending | None):
        self.agree, self.x, self.kind, self.n, self.out = agree, x, kind, n, out
        self.work = None

    def send(self, bucket) -> bool:
        """Post the message (``bucket``'s gradients in it if they fit); whether they rode."""
        self.buf, self.group, self.members, self.layout = self.agree._message(
            self.x, False, bucket, settle=False
        )
        with torch._C._DisableFuncTorch():  # from a hook under torch.func.grad: ~3x the cost otherwise
            self.work = dist.all_reduce(self.buf, group=self.group, async_op=True)
        return self.layout[1] is not None

    def is_completed(self) -> bool:
        return self.work is not None and self.work.is_completed()

    def verdict(self) -> None:
        if self.work is None:  # bucket 0 never came: the check goes alone
            self.agree.first = None
            if pending.for_collective():
                # Another collective came between the forward and bucket 0 (a pipeline's next
                # microbatch, a second sharded call): waiting for bucket 0 costs this plan a
                # round trip each call, so its later calls send their first message at once.
                self.agree.plan.lone = True
            self.send(None)
        self.work.wait()
        x = self.x
        y = self.agree._verdict(self.buf, x, False, self.group, self.members, self.layout)
        if x is None:
            return
        with torch._C.DisableTorchFunction():
            if y is None:  # only some ranks' blocks rode along: the sum as usual, in order
                y = x.clone()
                dist.all_reduce(y, group=self.group)
            if self.kind == "pmean":
                torch.div(y, self.n, out=self.out.elem)  # one op, not a division then a copy
            else:
                self.out.elem.copy_(y)


def _rides(dtype: torch.dtype, wire: torch.dtype) -> bool:
    """Whether a float block of ``dtype`` may be summed in a wire of dtype ``wire``.

    fp16/bf16 in float32 or wider, rounded once, as fpar's sums over devices; float64 only in float64;
    fp16/bf16 never under ``fpar.low_precision_sums("native")`` (summed in their own dtype).
    """
    if dtype in (torch.float16, torch.bfloat16) and not widened(dtype):
        return False
    return dtype.is_floating_point and (wire == torch.float64 or dtype != torch.float64)


def _cap(dtype: torch.dtype) -> int:
    """The most elements a wire of (blocks of) ``dtype`` grows to."""
    return _CAP_BYTES // (8 if dtype == torch.float64 else 4)


# the hash of a call per what its backward sends (_Agreement.grads): the salts differ in every chunk
_GRAD_SALTS = {"reduced": 0, "deferred": 0x5A5A_A5A5_5A5A_A5, "none": 0x3C3C_C3C3_3C3C_C3}
_HEAD = 2 * _CHUNKS + 7  # chunks, squares, carried, joined, failed count and mask, wanted room
_MASK_BITS = 24  # group ranks below this are named in the failed mask (exact in float32)
_F32_RANKS = 128  # a float32 wire keeps every header sum exact below this many ranks
_WIRE0 = (torch.float64, 64)  # a mesh's first wire: 512 bytes
_WINDOW = 16  # calls a wire's size looks back over
_CAP_BYTES = 2**19  # the wire grows to at most 512 KiB (a first message padded to it costs ~0.2 ms here)


_GRAD_MODES = {
    "reduced": "all-reduced (gradients enabled, outside fpar.defer_reduction())",
    "deferred": "deferred (inside fpar.defer_reduction())",
    "none": "not computed (under torch.no_grad(), or no such input requires grad)",
}


def _differences(by_rank: dict) -> str:
    """Say which argument differs between ranks, and how (shape, dtype, spec)."""
    ranks = sorted(by_rank)
    lines = []
    statics = {r: by_rank[r][1] for r in ranks}
    if len(set(statics.values())) > 1:
        lines.append(
            "in_specs/out_specs/check_rep differ: " + "; ".join(f"rank {r}: {statics[r]}" for r in ranks)
        )
    buckets = {r: by_rank[r][4] for r in ranks}
    if len(set(buckets.values())) > 1:  # the gradient buckets, so their all-reduces, would differ
        lines.append("bucket_mb differs: " + ", ".join(f"rank {r}: {buckets[r]:g}" for r in ranks))
    sigs = {r: by_rank[r][2] for r in ranks}
    lengths = {r: len(s) for r, s in sigs.items()}
    if len(set(lengths.values())) > 1:
        lines.append(
            "the number of tensor arguments differs: "
            + ", ".join(f"rank {r}: {n}" for r, n in lengths.items())
        )
    else:
        fields = ("spec", "shape", "dtype", "requires_grad")
        for i in range(min(lengths.values())):
            entries = {r: sigs[r][i] for r in ranks if isinstance(sigs[r][i], tuple)}
            if len(entries) < len(ranks):
                continue
            for f, name in enumerate(fields, start=1):
                values = {r: e[f] for r, e in entries.items()}
                if len(set(values.values())) > 1:
                    arg = entries[ranks[0]][0]
                    lines.append(
                        f"{arg} has a different {name} on different ranks ("
                        + ", ".join(f"rank {r}: {v}" for r, v in values.items())
                        + ")"
                    )
    if not lines:
        grads = {r: by_rank[r][3] for r in ranks}
        if len(set(grads.values())) > 1:
            said = []
            for mode, what in _GRAD_MODES.items():
                these = [r for r in ranks if grads[r] == mode]
                if these:
                    said.append(f"{what} on rank{'s' if len(these) > 1 else ''} {', '.join(map(str, these))}")
            return (
                "the ranks differ in what this call's backward does with the replicated inputs' "
                "gradients, so their next messages would not pair up: they are "
                + "; ".join(said)
                + ". Every "
                "process must run the same microbatches inside fpar.defer_reduction() (the same number "
                "per step, the last one outside it), with gradients enabled alike."
            )
        lines.append("the ranks called with different signatures")
    return (
        "the ranks passed blocks of different shapes, dtypes or specs; every process must pass its "
        "block of the same global values with the same specs: " + "; ".join(lines) + "."
    )
