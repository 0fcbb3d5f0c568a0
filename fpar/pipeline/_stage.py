"""One pipeline stage during one step: its parameters as leaves, its stash, its compute actions.

Forward actions record the autograd graph (the *stash*).  Forwards run under ``_split.capture``,
so the backward of the stage's linear layers computes only input gradients and leaves their
weight gradients to ``W``, which computes them as their own matmuls (accumulated in place, fused
into the matmul): ``B`` is that backward (freeing the graph), ``W`` runs later, and ``BW`` is
``B`` then ``W``.  A chunk's low-precision casts of its parameters are shared by its
microbatches in flight (``_casts``).  Both drivers (``_run_local``, ``_run_dist``)
run their stages through this.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch.autograd.graph import _engine_run_backward

from .. import _dist
from .. import random as _random
from .._tree import tree_flatten, tree_unflatten
from ._casts import Casts
from ._schedule import Action, Schedule, locate, prev_stage, virtual
from ._split import capture, weight_grads
from ._timeline import Timeline

Tensor = torch.Tensor


class StepResult(NamedTuple):
    """What one pipelined step returns.

    Attributes:
      loss: the mean over microbatches of ``loss``'s value (on a real mesh: on every rank).
      grads: the gradient of ``loss`` w.r.t. ``params``, the same structure (on a real mesh:
        this rank's blocks; ``first``/``last``, replicated over the pipe axis, on every rank).
      stats: what the executor ran, per stage (on a real mesh: gathered from every stage).
    """

    loss: Tensor
    grads: dict
    stats: Timeline


@dataclasses.dataclass(frozen=True)
class Fns:
    """The model's functions, called by ``Stage.forward`` once per microbatch and chunk.

    With a step key (``step(..., key=key)``), microbatch ``j`` has the key
    ``key_j = fold_in(key, j)``: ``first`` is called with ``key_j`` and chunk ``k`` (the virtual
    stage, in model order) with ``fold_in(key_j, k)`` as a last argument (``loss`` gets none).
    """

    stage: Callable | Sequence[Callable]  # one function for every chunk, or chunk k's at k
    loss: Callable
    first: Callable | None

    def chunk(self, k: int) -> Callable:
        """The function of chunk ``k`` (the virtual stage, in model order)."""
        return self.stage if callable(self.stage) else self.stage[k]


@dataclasses.dataclass
class Stashed:
    """What a forward keeps for its backward: the graph (via ``out``) and what to differentiate."""

    x: Tensor | None  # the received activation, a leaf (None on virtual stage 0)
    out: Tensor  # the activation sent on, or the loss on the last virtual stage
    leaves: list[Tensor]  # the parameter leaves it differentiates (gradients accumulate in .grad)
    records: list | None = None  # split backward: the weight gradients B leaves to W (``_split``)


class Stage:
    """One pipeline stage during one step: its parameters as leaves, its stash, its gradients."""

    def __init__(self, s: int, schedule: Schedule, fns: Fns, chunks: list, first: Any, last: Any, key=None):
        self.s, self.p, self.v, self.m, self.layout = s, schedule.p, schedule.v, schedule.m, schedule.layout
        self.last_k = self.p * self.v - 1  # the last virtual stage
        self.fns = fns
        self.key = key  # the step's fpar.random key, or None (the model's functions draw nothing)
        self.groups: dict[str, list] = {}  # group -> per chunk: (leaves, treedef)
        self.groups["stages"] = [_leaves(c) for c in chunks]
        self.groups["first"] = [_leaves(first)] if s == 0 else [([], None)]
        self.groups["last"] = [_leaves(last)] if s == last_stage(schedule) else [([], None)]
        self.stash: dict[tuple[int, int], Stashed] = {}
        self.inbox: dict[tuple[str, int, int], Tensor] = {}  # received, not yet used
        self.outbox: dict[tuple[str, int, int], Tensor] = {}  # computed, not yet sent
        self.out_shapes: dict[int, tuple] = {}  # chunk -> (shape, dtype) of what F sends on
        self.deferred: dict[int, Tensor] = {}  # id(leaf) -> weight gradient accumulated by W
        self.wide: dict[int, Tensor] = {}  # id(leaf) -> its .grad summed in a wider dtype (_unreduced._widen)
        self.slots: Any = {}  # id(leaf) -> where W writes its first gradient (see _split, _run_dist._Rows)
        self.loss_sum: Tensor | None = None
        # chunk -> its parameters' low-precision casts, one per step (``_casts``; None: not shared,
        # the chunk has one microbatch in flight at most), dropped as its last backward starts;
        # chunk -> the microbatch of that backward
        self.casts: dict[int, Casts | None] = {
            c: None for c, n in _most_in_flight(schedule, s).items() if n < 2
        }
        self.last_backward = {
            a.chunk: a.microbatch for a in schedule.actions if a.stage == s and a.kind in ("B", "BW")
        }
        self.busy, self.peak, self.peak_inbox, self.seconds, self.waited = 0, 0, 0, 0.0, 0.0
        # Real mesh: forwards other than ``finals`` (per chunk, the microbatch whose backward
        # runs last) run under this fpar.defer_reduction() scope: one DP all-reduce per step.
        self.deferral: Any = None
        self.finals: set[tuple[int, int]] = set()
        # Real mesh: ``send_early(j, c, dx)`` posts a BW's input gradient before its W runs (the
        # upstream stage's backward waits on it, not on this stage's weight gradients); True if sent.
        self.send_early: Any = None

    # -- compute ------------------------------------------------------------------------------

    def run(self, a: Action, xs: Tensor, targets: Any) -> None:
        """Run one compute action; what it sends on waits in the outbox for its SEND.

        An exception from the model's functions gets a note naming the stage, the action and
        the microbatch (on a real mesh ``fpar.launch`` then stops the other ranks).
        """
        start, waited = time.perf_counter(), self.waited
        out = None
        try:
            if a.kind == "F":
                defer = self.deferral is not None and (a.microbatch, a.chunk) not in self.finals
                with self.deferral if defer else contextlib.nullcontext():
                    out = self.forward(a.microbatch, a.chunk, xs, targets)
            elif a.kind == "W":
                weight_grads(self.stash.pop((a.microbatch, a.chunk)).records, self.deferred, self.slots)
            else:
                out = self.backward(a.microbatch, a.chunk, split=a.kind == "B")
        except Exception as e:
            e.add_note(
                f"fpar.pipeline: raised on pipeline stage {self.s} running {a.kind} of microbatch "
                f"{a.microbatch}, chunk {a.chunk} (virtual stage "
                f"{virtual(self.s, a.chunk, self.p, self.v, self.layout)}) at tick {a.tick}."
            )
            raise
        self.seconds += time.perf_counter() - start - (self.waited - waited)  # compute, not waiting
        self.busy += 1
        if out is not None:
            self.outbox[("F" if a.kind == "F" else "B", a.microbatch, a.chunk)] = out

    def take(self, key: tuple) -> Tensor:
        """A received value, waiting for it if it is still arriving (real mesh)."""
        value = self.inbox.pop(key)
        if isinstance(value, _dist.Incoming):
            start = time.perf_counter()
            value = value.wait()
            self.waited += time.perf_counter() - start
        return value

    def to_send(self, a: Action) -> Tensor:
        """The value a SEND action sends (computed at this tick or earlier)."""
        return self.outbox.pop((a.kind[-1], a.microbatch, a.chunk))

    def forward(self, j: int, c: int, xs: Tensor, targets: Any) -> Tensor | None:
        """F: run chunk ``c`` on microbatch ``j``, stash its graph; return what it sends on."""
        k = virtual(self.s, c, self.p, self.v, self.layout)
        leaves = self._params(c, first=k == 0, last=k == self.last_k)
        args = self._trees(c, k)
        records: list = []
        key_j = None if self.key is None else (_random.fold_in(self.key, j),)
        if c in self.casts:
            casts = self.casts[c]
        else:
            casts = self.casts[c] = Casts(leaves)
        with torch.enable_grad(), capture(leaves, records, casts):
            if k == 0:
                x = None
                h = xs[j] if self.fns.first is None else self.fns.first(args["first"], xs[j], *(key_j or ()))
            else:
                x = self.take(("F", j, c)).detach().requires_grad_()
                # a non-leaf, as an activation is: fpar.defer_reduction() defers the gradient
                # sums of leaves (parameters) only, never those of a value that flows on
                h = x.view_as(x)
            y = self.fns.chunk(k)(
                args["stages"], h, *(() if key_j is None else (_random.fold_in(key_j[0], k),))
            )
            last = k == self.last_k
            out = self.fns.loss(args["last"], y, None if targets is None else targets[j]) if last else y
        self.stash[(j, c)] = Stashed(x, out, leaves, records)
        self.peak = max(self.peak, len(self.stash))
        if last:
            value = out.detach()
            self.loss_sum = value if self.loss_sum is None else self.loss_sum + value
            return None
        self.out_shapes[c] = (tuple(y.shape), y.dtype)
        sent = y.detach()
        _release(y)
        return sent

    def backward(self, j: int, c: int, *, split: bool) -> Tensor | None:
        """BW (or B, with ``split``): the input gradient it sends back, if any."""
        st = self.stash[(j, c)]
        if virtual(self.s, c, self.p, self.v, self.layout) == self.last_k:
            dy = torch.full_like(st.out, 1.0 / self.m)  # d(mean over microbatches)/d(loss_j)
        else:
            dy = self.take(("B", j, c))
        # The captured linear layers leave their weight gradients to W (``_split``); the other
        # parameter gradients accumulate in .grad (AccumulateGrad), like torch's.  BW is B then W.
        casts = self.casts.get(c)
        if self.last_backward.get(c) == j and casts is not None:
            casts.clear()  # the chunk's last backward: only its graph holds them now
        _backward(st.out, dy, ([st.x] if st.x is not None else []) + st.leaves)
        dx = st.x.grad if st.x is not None else None
        if prev_stage(self.s, c, self.p, self.v, self.layout) is None:
            dx = None  # virtual stage 0: nothing to send back
        if split:
            st.out = st.x = None  # the graph is freed; W needs only st.records
            return dx
        if dx is not None and self.send_early is not None and self.send_early(j, c, dx):
            dx = None  # on its way already
        weight_grads(self.stash.pop((j, c)).records, self.deferred, self.slots)
        return dx

    # -- parameters and gradients ---------------------------------------------------------------

    def _trees(self, c: int, k: int) -> dict[str, Any]:
        """The parameter trees chunk ``c`` (virtual stage ``k``) computes with."""
        pairs = {"stages": self.groups["stages"][c], "first": ([], None), "last": ([], None)}
        if k == 0:
            pairs["first"] = self.groups["first"][0]
        if k == self.last_k:
            pairs["last"] = self.groups["last"][0]
        return {g: None if td is None else tree_unflatten(td, lv) for g, (lv, td) in pairs.items()}

    def _params(self, c: int, *, first: bool, last: bool) -> list[Tensor]:
        """The parameter leaves chunk ``c`` differentiates (with first/last on those virtual stages)."""
        leaves = []
        for g, cc, on in (("stages", c, True), ("first", 0, first), ("last", 0, last)):
            if on:
                leaves += [t for t in self.groups[g][cc][0] if isinstance(t, Tensor) and t.requires_grad]
        return leaves

    def grads(self, group: str) -> list:
        """Per chunk, the gradient tree of ``group`` (zeros where nothing flowed)."""
        out = []
        for leaves, td in self.groups[group]:
            if td is None:
                out.append(None)
                continue
            out.append(tree_unflatten(td, [self._grad(t) for t in leaves]))
        return out

    def _grad(self, t: Any) -> Any:
        """A leaf's gradient: what autograd accumulated plus what W computed (zeros if neither)."""
        if not isinstance(t, Tensor):
            return t
        g, w = t.grad, self.deferred.get(id(t))
        if g is None and w is None:
            return torch.zeros_like(t)
        return w if g is None else (g if w is None else g + w)

    def note_inbox(self) -> None:
        self.peak_inbox = max(self.peak_inbox, len(self.inbox))


def _most_in_flight(schedule: Schedule, s: int) -> dict[int, int]:
    """Per chunk of stage ``s``: the most microbatches forwarded and not yet backwarded at once."""
    now: dict[int, int] = {}
    most: dict[int, int] = {}
    for a in schedule.actions:
        if a.stage != s or a.kind not in ("F", "B", "BW"):
            continue
        now[a.chunk] = now.get(a.chunk, 0) + (1 if a.kind == "F" else -1)
        most[a.chunk] = max(most.get(a.chunk, 0), now[a.chunk])
    return most


def _leaves(tree: Any) -> tuple[list, Any]:
    if tree is None:
        return [], None
    leaves, td = tree_flatten(tree)
    return [_leaf(t) for t in leaves], td


def _leaf(t: Any) -> Any:
    if isinstance(t, Tensor) and t.is_floating_point():
        return t.detach().requires_grad_()
    return t


def _release(y: Tensor) -> None:
    """Let the stash hold ``y``'s graph but not its values (Megatron-LM's ``deallocate_output_tensor``).

    The backward needs the chunk's output only as the root of its graph; its values live on in
    what is sent (until it is) and in the graph if an op saved them, and no longer than that.
    A view or a leaf shares its storage with something the step keeps anyway.
    """
    if y.requires_grad and y.grad_fn is not None and y._base is None:
        y.data = torch.empty(0, dtype=y.dtype, device=y.device)


def _backward(out: Tensor, dy: Tensor, inputs: list) -> None:
    """Accumulate the gradients of ``out`` (cotangent ``dy``) into ``inputs``' ``.grad``; frees the graph."""
    if inputs and out.requires_grad:
        # the engine itself: ``torch.autograd.backward`` compares dy's shape with a released output's
        _engine_run_backward(
            (out,), (dy,), False, False, tuple(inputs), allow_unreachable=True, accumulate_grad=True
        )


def last_stage(sch: Schedule) -> int:
    """The stage that holds the last virtual stage (and so the loss)."""
    return locate(sch.p * sch.v - 1, sch.p, sch.v, sch.layout)[0]


def stack(col) -> Tensor:
    """``torch.stack``, without a copy for one chunk."""
    return col[0].unsqueeze(0) if len(col) == 1 else torch.stack(col)
