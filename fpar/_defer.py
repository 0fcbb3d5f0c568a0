"""``fpar.defer_reduction()``: data-parallel gradients reduced once per step, not per microbatch.

With gradient accumulation every microbatch's backward would all-reduce the gradients of the
replicated parameters: ``n_micro`` messages per bucket where one is needed.  Under this context
manager a real mesh's sharded function does not communicate at its *input-source* sums (the
cotangent of a replicated input, the data-parallel gradient all-reduce): the backward adds the
local cotangent into a buffer held per (sharded function, signature, input tensors) and gives
the input no gradient.  The next call of the same function on the same input tensors *outside*
the context (the step's last microbatch) all-reduces its own cotangent plus the buffer, in the
usual buckets (``_dist/buckets.py``).  All-reduce is linear, so the sum of the microbatches'
gradients is the same as without deferral: ``sum_i allreduce(g_i) = allreduce(sum_i g_i)``.

What is *not* deferred (reduced at once, as without the context, which is always right):

* sums that are not at inputs: a signature whose plan stays traced (see ``_dist/shard.py``) and
  sums at collective outputs, whose cotangent flows on through per-microbatch values (a fast
  plan's first, traced, call defers its input sums like the later calls:
  ``_dist/traced_sums.py``);
* inputs computed in the graph (non-leaf tensors: an activation, a pipeline stage's input): their
  cotangent flows on within the call's own backward, and each microbatch passes a new one; only
  leaves (parameters) are deferred;
* inputs under more than one ``torch.func`` level (a ``vmap`` of a ``grad``, a ``grad`` of a
  ``grad``);
* the in-process mesh, which sends no messages: the context changes nothing there.

Failure modes are errors, never a wrong gradient: an input modified in place between the
deferred calls and the final one (``ValueError``); a deferred call whose backward runs after the
final call's reduction, or not at all before it (``RuntimeError``, in the backward); a final
call outside the context whose input tensors or shapes differ from the deferred calls' (it would
reduce only its own gradient: ``RuntimeError`` at the end of its backward, ``watch_unclaimed``);
deferred sums that no final call reduced, reported when the next step enters a new
``defer_reduction()`` (``RuntimeError``; the stale buffers are dropped) and, in
``fpar.optim.accumulate`` and the pipeline executor, at the end of the step itself.

Example:
  >>> with fpar.defer_reduction():
  ...     for mb in microbatches[:-1]:
  ...         loss_fn(params, mb).backward()   # no gradient communication
  >>> loss_fn(params, microbatches[-1]).backward()  # one all-reduce per bucket, of the sum
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch.autograd import Variable

from ._buffers import block
from ._torch_api import get_unwrapped, is_functorch_wrapped_tensor, is_gradtrackingtensor

__all__ = ["defer_reduction"]

Tensor = torch.Tensor

_ACTIVE: list[defer_reduction] = []  # entered scopes, outermost first
_PENDING: dict[tuple, Deferred] = {}  # (sharded function, plan, input identities) -> open buffers
_LIVE: list[Deferred] = []  # every Deferred not yet fully reduced, in creation order


# API ----------------------------------------------------------------------------------------


class defer_reduction:
    """Defer the data-parallel gradient all-reduces of real-mesh ``fpar.shard`` calls.

    Calls made inside the context add their replicated inputs' local gradients into buffers
    and give those inputs no gradient; the next call of the same sharded function on the same
    input tensors outside the context reduces its gradient plus the buffers, once per bucket.
    The sum of all calls' gradients is exactly the sum without deferral, so use it for all
    microbatches but the last of a step (``fpar.optim.accumulate`` and the pipeline executor do).
    See the module docstring for what is not deferred and the errors it raises.  On the
    in-process mesh (no messages) it changes nothing.

    One object is one step: re-entering the same object continues the step; entering a new one
    while deferred sums of an earlier one were never reduced raises ``RuntimeError``.  If the
    body raises, its pending sums are dropped.

    Example:
      >>> with fpar.defer_reduction():
      ...     g0 = torch.func.grad(loss)(params, mb0)   # zeros for the replicated params
      >>> g1 = torch.func.grad(loss)(params, mb1)       # reduced sum of both microbatches
      >>> grads = g0 + g1                                # = the sum without deferral
    """

    # Set by ``fpar.optim.accumulate``, which adds the microbatches' gradients itself: under
    # ``torch.func`` a deferred input's gradient is then ``deferred_zeros`` (an expanded zero,
    # no memory written) instead of the zeros functorch would fill, and skipped in the sum.
    _expanded_zeros = False
    # Set by ``fpar.optim.accumulate`` and the pipeline executor, which check at their step's end
    # that every deferred sum was reduced (``_check_reduced``); a scope entered by hand is checked
    # at the end of each final call's backward (``watch_unclaimed``).
    _checks_itself = False
    # Set by ``fpar.optim.zero_pipeline`` (its sums taken with ``_take_local``): a dtype the sums
    # of lower-precision cotangents are kept in (the buffers are this dtype; each microbatch's
    # cotangent is added into it exactly), as FSDP2 reduces bfloat16 parameters' gradients in
    # float32.  ``None``: the cotangents' own dtype.
    _accumulate_dtype: torch.dtype | None = None
    # Set by ``fpar.optim.zero_pipeline`` too: each step's sums in buffers of their own, not the
    # plan's kept ones, so that they are freed once reduce-scattered (a kept buffer, the size of
    # the stage's gradients, would stay through the update: 4 bytes a parameter in float32).
    _fresh_buffers = False
    # Set by the pipeline for ``zero_pipeline``'s once-a-step sums: each tensor of a bucket sums into
    # a buffer of its own, not a slot of the bucket's flat one, so the step's end can stack a
    # stacked parameter's chunks leaf by leaf, freeing each chunk's sum as its leaf is stacked (a
    # flat holding several leaves stays until its last is: the stage's gradient held twice).
    _own_buffers = False

    def __enter__(self) -> defer_reduction:
        if not _ACTIVE:
            stale = [d for d in _LIVE if d.scope is not self]
            if stale:
                for d in stale:
                    d.drop()
                raise RuntimeError(_stale_message(stale))
        _ACTIVE.append(self)
        return self

    def __exit__(self, kind, value, tb) -> bool:
        _ACTIVE.pop()
        if kind is not None and not _ACTIVE:
            self._discard()  # the step failed: its deferred sums belong to no step
        return False

    def _discard(self) -> None:
        """Drop this scope's pending sums (a step that failed after its deferred calls)."""
        for d in [d for d in _LIVE if d.scope is self]:
            d.drop()

    def _take_local(self) -> list[tuple[Tensor, Tensor, tuple[str, ...]]]:
        """Every sum deferred under this scope, unreduced: ``(input tensor, its local sum, axes)``.

        For a caller that reduces the sums itself (``fpar.optim.zero_pipeline``: a reduce-scatter
        over the data axis, not an all-reduce).  ``axes``: the mesh axes the input is replicated
        over, which its sum is over.  Each sum is a view of its bucket's buffer; the scope's sums
        are forgotten (no final call may claim them).  Raises like a final call when a deferred
        call's backward has not run.
        """
        out = []
        for d in [d for d in _LIVE if d.scope is self]:
            for b, (axes, members) in enumerate(d.parts):
                split = d.split[b]
                flat = d.take(b)
                if flat is None:
                    continue
                for k, (base, at, shape) in enumerate(members):
                    out.append((base, block(flat, at, shape) if split is None else split[k], axes))
            d.drop()
        return out

    def _take_done(self) -> list[tuple[Tensor, Tensor, tuple[str, ...]]]:
        """The sums the backwards so far have added, unreduced, as ``_take_local``'s; the step goes on.

        For a caller that reduces each microbatch's gradient as its backward ends
        (``fpar.optim.zero_pipeline(..., reduce_once=False)``).  Each bucket's buffer is handed
        over (the next backward's add starts a new one); every deferred call still owes its
        backward, and ``_take_local`` at the step's end checks that each ran.  Call it only
        between backwards (a backward half added would be split between two takes).
        """
        out = []
        for d in [d for d in _LIVE if d.scope is self]:
            for b in range(len(d.parts)):
                out += d.hand_over_sums(b)
        return out

    def _check_reduced(self, where: str) -> None:
        """Raise if sums deferred under this scope were not reduced (end of a step)."""
        stale = [d for d in _LIVE if d.scope is self]
        if stale:
            for d in stale:
                d.drop()
            raise RuntimeError(f"{where}: " + _stale_message(stale))


def _new_buffer(b: int, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.empty(numel, dtype=dtype, device=device)


_ZERO: dict = {}  # (dtype, device) -> a one-element zero that deferred_zeros expands


def deferred_zeros(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A zero gradient of ``shape`` that writes no memory: one shared zero, expanded.

    Only for shapes of two or more elements, where the expansion overlaps itself, so an in-place
    write into it raises instead of changing the shared zero; smaller ones are fresh zeros.
    """
    with torch._C._DisableFuncTorch():  # plain tensors, also from a backward under functorch
        if shape.numel() < 2:
            return torch.zeros(shape, dtype=dtype, device=device)
        zero = _ZERO.get((dtype, device))
        if zero is None:
            zero = _ZERO[(dtype, device)] = torch.zeros((), dtype=dtype, device=device)
        return zero.expand(shape)


def is_deferred_zero(t: Tensor) -> bool:
    """Whether ``t`` is a ``deferred_zeros`` gradient (skipped when summing microbatches)."""
    if type(t) is not Tensor or t.numel() < 2 or any(t.stride()) or is_functorch_wrapped_tensor(t):
        return False
    zero = _ZERO.get((t.dtype, t.device))
    return zero is not None and t.data_ptr() == zero.data_ptr()


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Calls inside reduce at once, as outside any ``defer_reduction()``.

    For inputs that are new tensors every microbatch, whose deferred sums no later call could
    claim: ZeRO-3's parameters, gathered afresh for each microbatch's forward.
    """
    saved = _ACTIVE[:]
    _ACTIVE.clear()
    try:
        yield
    finally:
        _ACTIVE[:] = saved


def current() -> defer_reduction | None:
    """The outermost active scope, or None outside ``defer_reduction()``."""
    return _ACTIVE[0] if _ACTIVE else None


# The buffers ----------------------------------------------------------------------------------


class Deferred:
    """One sharded function's deferred gradient sums for one set of replicated input tensors.

    One flat buffer per bucket (the buckets of ``_dist/buckets.py``, the same for every call of
    one signature); ``calls`` deferred calls expect a backward each, ``adds[b]`` of them have
    added into bucket ``b``.  The final call takes each bucket's buffer once.
    """

    def __init__(
        self, scope: defer_reduction, fname: str, key: tuple, bases: list, n_buckets: int, buffer=None
    ):
        self.scope, self.fname, self.key = scope, fname, key
        # ``buffer(b, numel, dtype, device)``: an uninitialised flat buffer for bucket ``b`` (the
        # plan's kept one when nothing holds it: no fresh pages touched every step), or a new one.
        self.buffer = buffer or _new_buffer
        self.bases = bases  # (argument slot, base tensor, version): held, so identities stay unique
        self.flats: list[Tensor | None] = [None] * n_buckets
        # a bucket whose tensors each have a buffer of their own (``defer_reduction._own_buffers``);
        # its ``flats`` entry is then the first of them, a marker that the sums have begun
        self.split: list[list[Tensor] | None] = [None] * n_buckets
        self.filled: list[list[bool] | None] = [None] * n_buckets  # per slot, by add_one
        self.sizes: list[list[int] | None] = [None] * n_buckets  # its slots' sizes
        self.adds = [0] * n_buckets
        self.taken = [False] * n_buckets
        self.calls = 0
        # per bucket: (the axes its sums are over, [(input tensor, offset, shape)]): set by the
        # first call, for ``defer_reduction._take_local``
        self.parts: list[tuple[tuple[str, ...], list[tuple[Tensor, int, torch.Size]]]] = []
        self.final = False  # a final call has claimed the buffers
        _LIVE.append(self)

    def check_unchanged(self) -> None:
        """Raise if an input tensor was modified in place since the first deferred call."""
        for slot, base, version in self.bases:
            if base._version != version:
                self.drop()
                raise ValueError(
                    f"fpar.shard({self.fname}) under fpar.defer_reduction(): the replicated input "
                    f"(tensor argument #{slot}) was modified in place between the deferred "
                    f"microbatches and this call, so their deferred gradients belong to other "
                    f"values; update parameters only after the step's last microbatch (run outside "
                    f"the context) has run its backward."
                )

    def add(self, b: int, cts: list, metas: list) -> None:
        """A deferred call's backward: add its local cotangents into bucket ``b``'s buffer."""
        if self.taken[b]:
            raise self._too_late()
        cts = [None if ct is None else self._plain(ct) for ct in cts]
        with torch._C._DisableFuncTorch():  # the buffer is outside any transform
            self._add(b, cts, metas)
        self.adds[b] += 1

    def add_one(self, b: int, i: int, ct: Tensor, metas: list, first: bool) -> None:
        """A deferred call's backward, one tensor at a time (``buckets._defer_hooked``).

        Adds the cotangent of the bucket's tensor ``i`` into its slot; ``first``: the call's
        first one in this bucket (counted as that call's add).
        """
        if self.taken[b]:
            raise self._too_late()
        ct = self._plain(ct)
        with torch._C._DisableFuncTorch():
            slot = self._slot(b, i, metas)
            filled = self.filled[b]
            if filled is not None and not filled[i]:
                slot.copy_(ct)  # the buffer is uninitialised there: no zero fill first
                filled[i] = True
            else:
                slot.add_(ct)
        self.adds[b] += first

    def row_slot(self, b: int, i: int, metas: list) -> tuple[Tensor, bool]:
        """Tensor ``i``'s slot of bucket ``b``, for a cotangent written into it row by row before ``add``.

        (A stacked parameter's layers, each as its backward ends: ``fpar/pipeline/_unstack.py``.)
        Returns the slot and whether it holds a sum already (else it is uninitialised: the first
        write of a row copies); ``mark_summed`` once every row is in.
        """
        if self.taken[b]:
            raise self._too_late()
        slot = self._slot(b, i, metas)
        filled = self.filled[b]  # None: every slot initialised (``_add``'s buffer)
        return slot, filled is None or filled[i]

    def mark_summed(self, b: int, i: int) -> None:
        """Tensor ``i``'s slot of bucket ``b`` holds its sum: the call's ``add`` adds into it."""
        if self.filled[b] is not None:
            self.filled[b][i] = True

    def _slot(self, b: int, i: int, metas: list) -> Tensor:
        """Tensor ``i``'s slot of bucket ``b``'s buffer, made (uninitialised, as ``add_one``'s) if need be."""
        if self.flats[b] is None:
            self.sizes[b] = [m[0].numel() for m in metas]
            self._allocate(b, metas)
            self.filled[b] = [False] * len(metas)
        return self._slot_at(b, i, sum(m[0].numel() for m in metas[:i]), metas[i][0])

    def _slot_at(self, b: int, i: int, at: int, shape: torch.Size) -> Tensor:
        split = self.split[b]
        return block(self.flats[b], at, shape) if split is None else split[i]

    def _allocate(self, b: int, metas: list) -> None:
        """Bucket ``b``'s uninitialised buffer: one flat (``buffer``'s), or one a tensor (``_own_buffers``)."""
        _, dtype, device = metas[0]
        dtype = self._dtype(dtype)
        if self.scope._own_buffers and len(metas) > 1:
            self.split[b] = [torch.empty(m[0], dtype=dtype, device=device) for m in metas]
            self.flats[b] = self.split[b][0]
            return
        self.flats[b] = self.buffer(b, sum(m[0].numel() for m in metas), dtype, device)

    def _add(self, b: int, cts: list, metas: list) -> None:
        if self.filled[b] is not None:  # add_one's buffer: every slot initialised before adding
            self._zero_unfilled(b)
        first = self.flats[b] is None
        if first:
            self._allocate(b, metas)
        at = 0
        for i, (ct, (shape, _, _)) in enumerate(zip(cts, metas)):
            n = shape.numel()
            slot = self._slot_at(b, i, at, shape)
            if ct is None:
                if first:  # no cotangent reached it: its gradient so far is zero
                    slot.zero_()
            elif first:
                slot.copy_(ct.detach())  # the buffer is uninitialised: no zero fill first
            else:
                slot.add_(ct.detach())
            at += n

    def _dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype of a bucket's buffer for cotangents of ``dtype`` (the scope's accumulate dtype)."""
        wide = self.scope._accumulate_dtype
        if wide is not None and dtype.is_floating_point and dtype.itemsize < wide.itemsize:
            return wide
        return dtype

    def _too_late(self) -> RuntimeError:
        return RuntimeError(
            f"fpar.shard({self.fname}): the backward of a call made under "
            f"fpar.defer_reduction() ran after the final call (outside the context) had "
            f"already reduced the deferred gradients; its gradient would be lost. Run every "
            f"deferred microbatch's backward before the last microbatch's backward."
        )

    def _zero_unfilled(self, b: int) -> None:
        """Zero the slots of ``add_one``'s buffer that no cotangent reached; it is then plain."""
        filled, self.filled[b] = self.filled[b], None
        flat, sizes, split = self.flats[b], self.sizes[b], self.split[b]
        at = 0
        with torch._C._DisableFuncTorch():
            for i, (n, got) in enumerate(zip(sizes, filled)):
                if not got:
                    (flat[at : at + n] if split is None else split[i]).zero_()
                at += n

    def _plain(self, ct: Tensor) -> Tensor:
        """The cotangent's value under ``torch.func.grad``'s wrapper (its backward runs wrapped)."""
        while is_gradtrackingtensor(ct):
            ct = get_unwrapped(ct)
        if is_functorch_wrapped_tensor(ct):
            raise NotImplementedError(
                f"fpar.shard({self.fname}): fpar.defer_reduction() under a vmap of the gradient is "
                f"not supported; differentiate without an outer vmap, or reduce without deferral."
            )
        return ct

    def take(self, b: int) -> Tensor | None:
        """The final call's backward: bucket ``b``'s summed buffer (``None`` if already taken).

        A bucket of buffers a tensor (``split``) gives its first: ``_take_local`` reads them all.
        """
        if self.taken[b]:
            return None
        if self.adds[b] != self.calls:
            missing = self.calls - self.adds[b]
            self.drop()
            raise RuntimeError(
                f"fpar.shard({self.fname}): the final call (outside fpar.defer_reduction()) is "
                f"reducing the deferred gradients, but {missing} of the {self.calls} deferred "
                f"calls have not run their backward yet, so their gradients would be lost. Run "
                f"each microbatch's backward before the next microbatch (the last one outside the "
                f"context), or one backward over all of them with the last microbatch's forward "
                f"also inside the context and a final call after it."
            )
        self.taken[b] = True
        if self.filled[b] is not None:
            self._zero_unfilled(b)
        flat, self.flats[b] = self.flats[b], None
        self.split[b] = None
        if all(self.taken):
            self._forget()
        return flat

    def hand_over(self, b: int) -> Tensor | None:
        """Bucket ``b``'s buffer as it is now (``None`` if no backward added since the last), made plain.

        The sums so far leave with it; the next add starts a new buffer.  The deferred calls'
        count is kept, so ``take`` still checks that each ran its backward.
        """
        if self.taken[b] or self.flats[b] is None:
            return None
        if self.split[b] is not None:  # the scope's sums are taken once, at its end (``_take_local``)
            raise RuntimeError(
                "fpar: a deferred bucket of buffers a tensor cannot be handed over before the step ends"
            )
        if self.filled[b] is not None:
            self._zero_unfilled(b)
        flat, self.flats[b] = self.flats[b], None
        return flat

    def hand_over_sums(self, b: int) -> list[tuple[Tensor, Tensor, tuple[str, ...]]]:
        """``hand_over`` as ``(input tensor, its sum: a view of the buffer, axes)`` per member."""
        flat = self.hand_over(b)
        if flat is None:
            return []
        axes, members = self.parts[b]
        return [(base, block(flat, at, shape), axes) for base, at, shape in members]

    def drop(self) -> None:
        """Forget this state (its sums are reported lost by the caller)."""
        self.taken = [True] * len(self.taken)
        self.flats = [None] * len(self.flats)
        self.split = [None] * len(self.split)
        self._forget()

    def _forget(self) -> None:
        if _PENDING.get(self.key) is self:
            del _PENDING[self.key]
        if self in _LIVE:
            _LIVE.remove(self)


def drop_all() -> None:
    """Drop every open deferred sum: a sharded call's signature check failed on every rank.

    The step those sums belong to is lost on every rank alike; dropping them everywhere keeps
    the ranks' states the same, so the next step starts clean on all of them (a rank left
    holding sums would raise on its own when it enters the next ``defer_reduction()``).
    """
    for d in list(_LIVE):
        d.drop()


def base_of(t: Tensor) -> Tensor | None:
    """The plain tensor under at most one ``torch.func.grad`` level, or None (not deferrable)."""
    if is_functorch_wrapped_tensor(t):
        if not is_gradtrackingtensor(t):
            return None
        t = get_unwrapped(t)
        if is_functorch_wrapped_tensor(t):
            return None
    return t


def identity(t: Tensor) -> tuple:
    """What makes two calls' input "the same tensor": its storage, view and dtype.

    The storage by its object, not its data's address: a parameter buffer freed and gathered
    again between microbatches (``zero_pipeline(..., reshard_after_forward=True)``, FSDP's
    ``resize_``) is the same tensor at another address.
    """
    return (t.untyped_storage()._cdata, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device)


def open_deferred(
    scope: defer_reduction, fname: str, key: tuple, bases: list, n_buckets: int, buffer=None
) -> Deferred:
    """The open buffers for ``key`` in ``scope``, created on first use (``buffer``: see ``Deferred``)."""
    d = _PENDING.get(key)
    if d is not None and d.scope is not scope:
        stale = [d]
        d.drop()
        raise RuntimeError(_stale_message(stale))
    if d is None:
        d = _PENDING[key] = Deferred(
            scope, fname, key, bases, n_buckets, None if scope._fresh_buffers else buffer
        )
    d.check_unchanged()
    return d


def claim(key: tuple) -> Deferred | None:
    """A final call on ``key``: take the open buffers (later deferred calls open new ones)."""
    d = _PENDING.pop(key, None)
    if d is not None:
        d.check_unchanged()
        d.final = True
    return d


def watch_unclaimed(fn, fname: str, plan, inputs: list) -> Callable[[], None] | None:
    """For a call of ``fn`` outside the context that takes a gradient but claims no deferred sums.

    Such a call is a step's final call by position (after the deferred microbatches, outside the
    context) while ``fn`` still has unclaimed sums deferred under a scope entered by hand: either
    a later call of ``fn`` on other tensors claims them (one sharded function over several
    parameter sets, the layers of a stack), or this call passes other input tensors or shapes than
    the deferred calls did (a cast made inside the loop, a short last microbatch) and the step's
    gradient would miss theirs, with no error if no other scope is ever entered.  Every final
    call's forward precedes the backward that reduces it, so at the end of this call's backward
    the sums still unclaimed are never reduced: the returned function, called from that backward,
    queues the check that raises then (on every rank alike: every rank runs the same calls).
    The error names both calls: how this one (``plan``, its replicated ``inputs`` as ``(slot,
    tensor)``) differs from the deferred ones, in argument shapes or in tensors.  ``None``:
    nothing to watch.
    """
    watched = [d for d in _LIVE if d.key[0] is fn and not d.final and not d.scope._checks_itself]
    if not watched:
        return None
    queued = [False]

    def check() -> None:
        left = [d for d in watched if d in _LIVE and not d.final]
        if not left:
            return
        for d in left:
            d.drop()
        raise RuntimeError(
            f"fpar.shard({fname}): this backward reduced the gradient of a call outside "
            f"fpar.defer_reduction(), but {sum(d.calls for d in left)} earlier deferred call(s) of the "
            f"same sharded function were never reduced: no call outside the context passed their "
            f"input tensors with their argument shapes, so the step's gradient would miss theirs "
            f"(they have been dropped). {_difference(left[0], plan, inputs)}The step's last "
            f"microbatch must pass the same parameter tensors with the same shapes as the deferred "
            f"ones (cast or copy parameters once, before the loop; pad a short last microbatch to the "
            f"others' shape)."
        )

    def queue() -> None:
        if not queued[0]:
            queued[0] = True
            Variable._execution_engine.queue_callback(check)

    return queue


def _difference(d: Deferred, plan, inputs: list) -> str:
    """How a final call differs from ``d``'s deferred calls, as a sentence (``""``: unknown).

    The arguments whose shape, dtype or spec differ between ``plan`` and theirs, else the
    replicated ``inputs`` (``(slot, tensor)``) that are other tensors than theirs.
    """
    theirs, mine = getattr(d.key[1], "sig", None), getattr(plan, "sig", None)
    if theirs is not None and mine is not None and theirs != mine:
        them = {path: rest for path, *rest in theirs}
        here = {path: rest for path, *rest in mine}

        def show(entry) -> str:
            if entry is None:
                return "nothing"
            spec, shape, dtype, _ = entry
            return f"{dtype.removeprefix('torch.')}{list(shape)} {spec}"

        diffs = [
            f"{path}: {show(them.get(path))} in the deferred call(s), {show(here.get(path))} in this one"
            for path in dict.fromkeys([*them, *here])
            if them.get(path) != here.get(path)
        ]
        return f"This call's arguments differ from the deferred calls': {'; '.join(diffs[:4])}. "
    ids = {slot: identity(b) for slot, t in inputs if (b := base_of(t)) is not None}
    other = [slot for slot, ident in d.key[2] if slot in ids and ids[slot] != ident]
    if other:
        where = ", ".join(f"#{slot}" for slot in other)
        return (
            f"This call passed the same argument shapes but other tensors than the deferred calls "
            f"at replicated tensor argument(s) {where} (a copy or cast made for each microbatch?). "
        )
    return ""


def _stale_message(stale: list[Deferred]) -> str:
    names = ", ".join(sorted({f"fpar.shard({d.fname})" for d in stale}))
    return (
        f"gradients deferred under fpar.defer_reduction() by {names} were never reduced (they have "
        f"been dropped): the step's last microbatch must call the same sharded function on the same "
        f"input tensors, with the same argument shapes, outside the context, after the deferred "
        f"calls. If each microbatch passed new tensors (e.g. parameters cast inside the loop), cast "
        f"them once before the loop."
    )
