"""Run a schedule: a driver outside ``fpar.shard`` that calls each stage's compute per action.

A per-device SPMD program cannot run different actions on different devices in the same tick,
so the executor drives the pipeline from Python.  Each stage's compute is a function of its
chunk's parameters and one microbatch's activation, typically ``fpar.shard(f,
mesh.submesh(other_axes), ...)``, which brings tensor and data parallelism inside the stage for
free.  Forward actions record the autograd graph (the *stash*); ``BW`` runs the whole backward
with ``torch.autograd.backward``.  Forwards run under ``_split.capture``, so the backward of the
stage's linear layers computes only input gradients and leaves their weight gradients to ``W``,
which computes them as their own matmuls (accumulated in place, fused into the matmul): ``B``
is that backward (freeing the graph), ``W`` runs later, and ``BW`` is ``B`` then ``W``.

* In-process (``mesh.backend == "local"``) the driver loops over ticks and, within a tick, over
  stages; a send hands the tensor to the receiving stage's inbox.
* On a real mesh every rank runs only its own stage's actions and moves that tick's sends and
  receives in one batched ``p2p`` exchange along the pipe axis.  Values are this rank's blocks
  over the other axes.  Receive shapes: a gradient has the shape of the activation the stage
  itself sent; the first activation over each stage boundary in a step is preceded by a small
  header with its shape and dtype (all microbatches share shapes, as ``xs`` is stacked).

Both run exactly the schedule's ticks and report what they ran (``Timeline``): compute ticks
per stage, the peak number of stashed microbatch-chunks (counted on the live stash, not taken
from the schedule), the peak inbox, and measured seconds.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from .. import _dist
from .._mesh import Mesh
from .._tree import tree_flatten, tree_map, tree_unflatten
from ._schedule import COMPUTE, Action, Schedule, locate, next_stage, prev_stage, virtual
from ._split import capture, weight_grads
from ._timeline import Timeline
from ._validate import validate

__all__ = ["StepResult", "pipeline"]

Tensor = torch.Tensor
PARAM_KEYS = ("stages", "first", "last")


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


# API ----------------------------------------------------------------------------------------


def pipeline(
    stage: Callable,
    schedule: Schedule,
    mesh: Mesh,
    *,
    loss: Callable,
    first: Callable | None = None,
    axis: str = "pipe",
) -> Callable[..., StepResult]:
    """Build a training step that runs ``schedule`` over the ``axis`` stages of ``mesh``.

    The model is ``first``, then chunks ``0 .. p v - 1`` of ``stage`` (chunk ``k`` on stage
    ``k % p``), then ``loss``; the step returns the mean loss over the microbatches and its
    gradient, equal to the unpipelined model's.  Stages compose with data and tensor
    parallelism over the other mesh axes: make each function a ``fpar.shard`` over
    ``mesh.submesh(other_axes)``.

    Args:
      stage: ``(chunk_params, h) -> h``: one model chunk.
      schedule: from ``gpipe``, ``one_f_one_b``, ``interleaved_1f1b``, ``zb_h1`` or ``place``;
        validated here.
      mesh: the mesh; ``mesh.shape[axis]`` must be ``schedule.p``.
      loss: ``(last_params, h, target) -> scalar`` after the last chunk, on the last stage
        (replicated over the other axes, e.g. a ``pmean`` over ``"data"``).
      first: optional ``(first_params, x) -> h`` before chunk 0, on stage 0 (e.g. an embedding).
      axis: the pipe mesh axis.

    Returns:
      ``step(params, xs, targets) -> StepResult``.  ``params`` is a dict with ``"stages"`` (every
      leaf stacked on dim 0 in stage-major order, see ``stage_major``: ``p v`` rows in-process,
      this rank's ``v`` rows on a real mesh, i.e. in-spec ``P(axis, ...)``), and optionally
      ``"first"`` and ``"last"``.  ``xs`` and ``targets`` are stacked microbatches ``(m, ...)``
      (on a real mesh, this rank's blocks over the other axes).

    Raises:
      ScheduleError: an invalid schedule.
      ValueError: a mesh without ``axis`` or of the wrong size.

    Example:
      >>> sub = mesh.submesh(("tensor",))
      >>> stage = fpar.shard(block, sub, (block_specs, P()), P())
      >>> step = fpar.pipeline.pipeline(stage, fpar.pipeline.one_f_one_b(2, 4), mesh, loss=mse)
      >>> loss, grads, stats = step({"stages": w_stacked}, xs, ys)
    """
    validate(schedule)
    if axis not in mesh.shape:
        raise ValueError(
            f"fpar.pipeline.pipeline: {axis!r} is not an axis of the mesh {mesh.axis_names}; pass "
            f"axis= the name of the pipe axis."
        )
    if mesh.shape[axis] != schedule.p:
        raise ValueError(
            f"fpar.pipeline.pipeline: the schedule has p={schedule.p} stages but mesh axis {axis!r} "
            f"has size {mesh.shape[axis]}; build the schedule for {mesh.shape[axis]} stages."
        )
    fns = _Fns(stage, loss, first)
    driver = _DistDriver(schedule, mesh, axis, fns) if mesh.backend == "dist" else _LocalDriver(schedule, fns)

    def step(params: dict, xs: Tensor, targets: Any = None) -> StepResult:
        _check_params(params, xs, targets, schedule, local=mesh.backend != "dist")
        return driver.run(params, xs, targets)

    return step


@dataclasses.dataclass(frozen=True)
class _Fns:
    stage: Callable
    loss: Callable
    first: Callable | None


# One stage's work -----------------------------------------------------------------------------


@dataclasses.dataclass
class _Stashed:
    """What a forward keeps for its backward: the graph (via ``out``) and what to differentiate."""

    x: Tensor | None  # the received activation, a leaf (None on virtual stage 0)
    out: Tensor  # the activation sent on, or the loss on the last virtual stage
    leaves: list[Tensor]  # the parameter leaves it differentiates (gradients accumulate in .grad)
    records: list | None = None  # split backward: the weight gradients B leaves to W (``_split``)


class _Stage:
    """One pipeline stage during one step: its parameters as leaves, its stash, its gradients."""

    def __init__(self, s: int, schedule: Schedule, fns: _Fns, chunks: list, first: Any, last: Any):
        self.s, self.p, self.v, self.m, self.layout = s, schedule.p, schedule.v, schedule.m, schedule.layout
        self.last_k = self.p * self.v - 1  # the last virtual stage
        self.fns = fns
        self.groups: dict[str, list] = {}  # group -> per chunk: (leaves, treedef)
        self.groups["stages"] = [_leaves(c) for c in chunks]
        self.groups["first"] = [_leaves(first)] if s == 0 else [([], None)]
        self.groups["last"] = [_leaves(last)] if s == last_stage(schedule) else [([], None)]
        self.stash: dict[tuple[int, int], _Stashed] = {}
        self.inbox: dict[tuple[str, int, int], Tensor] = {}  # received, not yet used
        self.outbox: dict[tuple[str, int, int], Tensor] = {}  # computed, not yet sent
        self.out_shapes: dict[int, tuple] = {}  # chunk -> (shape, dtype) of what F sends on
        self.deferred: dict[int, Tensor] = {}  # id(leaf) -> weight gradient accumulated by W
        self.loss_sum: Tensor | None = None
        self.busy, self.peak, self.peak_inbox, self.seconds, self.waited = 0, 0, 0, 0.0, 0.0

    # -- compute ------------------------------------------------------------------------------

    def run(self, a: Action, xs: Tensor, targets: Any) -> None:
        """Run one compute action; what it sends on waits in the outbox for its SEND."""
        start, waited = time.perf_counter(), self.waited
        out = None
        if a.kind == "F":
            out = self.forward(a.microbatch, a.chunk, xs, targets)
        elif a.kind == "W":
            weight_grads(self.stash.pop((a.microbatch, a.chunk)).records, self.deferred)
        else:
            out = self.backward(a.microbatch, a.chunk, split=a.kind == "B")
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
        with torch.enable_grad(), capture(leaves, records):
            if k == 0:
                x = None
                h = xs[j] if self.fns.first is None else self.fns.first(args["first"], xs[j])
            else:
                x = self.take(("F", j, c)).detach().requires_grad_()
                h = x
            y = self.fns.stage(args["stages"], h)
            last = k == self.last_k
            out = self.fns.loss(args["last"], y, None if targets is None else targets[j]) if last else y
        self.stash[(j, c)] = _Stashed(x, out, leaves, records)
        self.peak = max(self.peak, len(self.stash))
        if last:
            value = out.detach()
            self.loss_sum = value if self.loss_sum is None else self.loss_sum + value
            return None
        self.out_shapes[c] = (tuple(y.shape), y.dtype)
        return y.detach()

    def backward(self, j: int, c: int, *, split: bool) -> Tensor | None:
        """BW (or B, with ``split``): the input gradient it sends back, if any."""
        st = self.stash[(j, c)]
        if virtual(self.s, c, self.p, self.v, self.layout) == self.last_k:
            dy = torch.full_like(st.out, 1.0 / self.m)  # d(mean over microbatches)/d(loss_j)
        else:
            dy = self.take(("B", j, c))
        # The captured linear layers leave their weight gradients to W (``_split``); the other
        # parameter gradients accumulate in .grad (AccumulateGrad), like torch's.  BW is B then W.
        _backward(st.out, dy, ([st.x] if st.x is not None else []) + st.leaves)
        dx = st.x.grad if st.x is not None else None
        if split:
            st.out = st.x = None  # the graph is freed; W needs only st.records
        else:
            weight_grads(self.stash.pop((j, c)).records, self.deferred)
        return dx if prev_stage(self.s, c, self.p, self.v, self.layout) is not None else None

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


def _leaves(tree: Any) -> tuple[list, Any]:
    if tree is None:
        return [], None
    leaves, td = tree_flatten(tree)
    return [_leaf(t) for t in leaves], td


def _leaf(t: Any) -> Any:
    if isinstance(t, Tensor) and t.is_floating_point():
        return t.detach().requires_grad_()
    return t


def _backward(out: Tensor, dy: Tensor, inputs: list) -> None:
    """Accumulate the gradients of ``out`` (cotangent ``dy``) into ``inputs``' ``.grad``; frees the graph."""
    if inputs and out.requires_grad:
        torch.autograd.backward(out, dy, inputs=inputs)


# In-process driver ----------------------------------------------------------------------------


class _LocalDriver:
    """All stages in this process: a loop over ticks, then over stages; sends fill inboxes."""

    def __init__(self, schedule: Schedule, fns: _Fns):
        self.schedule, self.fns = schedule, fns
        self.ticks = schedule.by_tick()

    def run(self, params: dict, xs: Tensor, targets: Any) -> StepResult:
        sch = self.schedule
        p, v = sch.p, sch.v
        stacked = params["stages"]
        chunks = [[tree_map(lambda t, r=s * v + c: t[r], stacked) for c in range(v)] for s in range(p)]
        stages = [
            _Stage(s, sch, self.fns, chunks[s], params.get("first"), params.get("last")) for s in range(p)
        ]
        start = time.perf_counter()
        for actions in self.ticks:
            for a in actions:
                if a.kind in COMPUTE:
                    stages[a.stage].run(a, xs, targets)
            for a in actions:
                if a.kind in ("SEND_F", "SEND_B"):
                    self._deliver(a, stages)
            for st in stages:
                st.note_inbox()
        wall = time.perf_counter() - start
        grads = {"stages": _stack_chunks([st.grads("stages") for st in stages], stacked)}
        if "first" in params:
            grads["first"] = stages[0].grads("first")[0] if params["first"] is not None else None
        if "last" in params:
            grads["last"] = stages[last_stage(sch)].grads("last")[0] if params["last"] is not None else None
        loss = stages[last_stage(sch)].loss_sum / sch.m
        stats = _timeline(sch, stages, wall)
        return StepResult(loss, grads, stats)

    def _deliver(self, a: Action, stages: list) -> None:
        """In-process send and receive: the value moves to the peer stage's inbox."""
        sch = self.schedule
        to = (next_stage if a.kind == "SEND_F" else prev_stage)(a.stage, a.chunk, sch.p, sch.v, sch.layout)
        stages[to[0]].inbox[(a.kind[-1], a.microbatch, to[1])] = stages[a.stage].to_send(a)


def _stack_chunks(per_stage: list[list], like: Any) -> Any:
    """Stack per-(stage, chunk) gradient trees in stage-major order: row s * v + c."""
    flat = [tree_flatten(g)[0] for chunks in per_stage for g in chunks]
    _, td = tree_flatten(like)
    return tree_unflatten(td, [_stack(col) for col in zip(*flat)])


def _timeline(sch: Schedule, stages: list, wall: float) -> Timeline:
    return Timeline(
        sch.name,
        sch.num_ticks,
        tuple(st.busy for st in stages),
        tuple(st.peak for st in stages),
        tuple(st.peak_inbox for st in stages),
        tuple(st.seconds for st in stages),
        wall,
    )


# Real-mesh driver ---------------------------------------------------------------------------


class _DistDriver:
    """This rank's stage: per tick, its compute, then its sends and receives, posted without waiting.

    A receive is waited for only by the compute that uses it, and sends complete in the
    background: the stages are coupled by their data alone, not by the tick grid, so a tick
    with a long action (a backward) on one stage does not hold up its neighbour's short one.
    Both ends post a pair's messages in the same order (tick, then ``_wire_order``), so they
    match; and every wait is for a value sent at an earlier tick, so nothing deadlocks.
    """

    def __init__(self, schedule: Schedule, mesh: Mesh, axis: str, fns: _Fns):
        self.schedule, self.mesh, self.axis, self.fns = schedule, mesh, axis, fns
        self.me = mesh._dist.coords[axis]
        self.others = tuple(a for a in mesh.axis_names if a != axis)
        self.ticks = [[a for a in acts if a.stage == self.me] for acts in schedule.by_tick()]
        self.header = _first_messages(schedule)
        self.shapes: dict[int, tuple] = {}  # chunk -> (shape, dtype) of the activations it receives

    def run(self, params: dict, xs: Tensor, targets: Any) -> StepResult:
        sch = self.schedule
        stacked = params["stages"]
        chunks = [tree_map(lambda t, c=c: t[c], stacked) for c in range(sch.v)]
        st = _Stage(self.me, sch, self.fns, chunks, params.get("first"), params.get("last"))
        self.device = _device_of(stacked)
        start = time.perf_counter()
        sending: list = []
        for actions in self.ticks:
            for a in actions:
                if a.kind in COMPUTE:
                    st.run(a, xs, targets)
            sending += self._exchange(actions, st, _dist)
            st.note_inbox()
        for work, _ in sending:
            work.wait()
        wall = time.perf_counter() - start
        loss, stats = self._finish(st, wall, _dist)
        grads = {"stages": tree_unflatten(tree_flatten(stacked)[1], _stack_local(st.grads("stages")))}
        owners = {"first": 0, "last": last_stage(sch)}
        for g in ("first", "last"):
            if g in params:
                grads[g] = self._share(_local_group(st, g, params[g]), owners[g])
        return StepResult(loss, grads, stats)

    def _share(self, tree: Any, owner: int) -> Any:
        """The owning stage's gradient of first/last params on every stage.

        Those parameters are replicated over the pipe axis (only one stage uses them), so, as for
        any replicated value, every rank holds the same, full gradient.
        """
        if tree is None or self.schedule.p == 1:
            return tree
        leaves, treedef = tree_flatten(tree)
        tensors = [i for i, t in enumerate(leaves) if isinstance(t, Tensor)]
        if self.me == owner:
            peers = [q for q in range(self.schedule.p) if q != owner]
            _dist.p2p(self.mesh, self.axis, [(leaves[i], q) for q in peers for i in tensors], [])
            return tree
        got = _dist.p2p(
            self.mesh, self.axis, [], [(tuple(leaves[i].shape), leaves[i].dtype, owner) for i in tensors]
        )
        for i, t in zip(tensors, got):
            leaves[i] = t
        return tree_unflatten(treedef, leaves)

    def _exchange(self, actions: list, st: _Stage, _dist) -> list:
        """Post this tick's sends and receives (after shape headers, if any); return the sends."""
        p, v, me, layout = self.schedule.p, self.schedule.v, self.me, self.schedule.layout
        sends, recvs, heads_out, heads_in = [], [], [], []
        for a in sorted(actions, key=_wire_order):
            if a.kind in ("SEND_F", "SEND_B"):
                value = st.to_send(a)
                peer = (next_stage if a.kind == "SEND_F" else prev_stage)(a.stage, a.chunk, p, v, layout)
                if peer[0] == me:  # a chunk of this stage feeds another of its chunks (p = 1)
                    st.inbox[(a.kind[-1], a.microbatch, peer[1])] = value
                    continue
                if a.kind == "SEND_F" and a in self.header:
                    heads_out.append((_header(value), peer[0]))
                sends.append((value, peer[0]))
            elif a.kind in ("RECV_F", "RECV_B"):
                peer = (prev_stage if a.kind == "RECV_F" else next_stage)(a.stage, a.chunk, p, v, layout)
                if peer[0] == me:
                    continue
                recvs.append(a)
                if a.kind == "RECV_F" and a in self.header:
                    heads_in.append(a)
        if heads_out or heads_in:
            got = _dist.p2p(
                self.mesh, self.axis, heads_out, [((_HEADER,), torch.int64, self._peer(a)) for a in heads_in]
            )
            for a, h in zip(heads_in, got):
                self.shapes[a.chunk] = _unheader(h)
        bufs = [(*self._shape(a, st), self._peer(a)) for a in recvs]
        sending, receiving = _dist.p2p(self.mesh, self.axis, sends, bufs, wait=False)
        for a, incoming in zip(recvs, receiving):
            st.inbox[("F" if a.kind == "RECV_F" else "B", a.microbatch, a.chunk)] = incoming
        return sending

    def _peer(self, a: Action) -> int:
        sch = self.schedule
        return (prev_stage if a.kind == "RECV_F" else next_stage)(a.stage, a.chunk, sch.p, sch.v, sch.layout)[0]

    def _shape(self, a: Action, st: _Stage) -> tuple:
        if a.kind == "RECV_B":
            return st.out_shapes[a.chunk]  # the gradient of what this chunk sent on
        return self.shapes[a.chunk]

    def _finish(self, st: _Stage, wall: float, _dist) -> tuple[Tensor, Timeline]:
        """Share the loss (from the last stage) and every stage's stats along the pipe axis."""
        sch = self.schedule
        p, last = sch.p, last_stage(sch)
        counts = torch.tensor([st.busy, st.peak, st.peak_inbox, st.seconds], dtype=torch.float64)
        loss_row = (st.loss_sum / sch.m).reshape(1) if st.loss_sum is not None else torch.zeros(1)
        # On the stage's device (NCCL sends device tensors only); one message per peer.
        mine = torch.cat([loss_row.to(self.device, torch.float64), counts.to(self.device)])
        peers = [q for q in range(p) if q != self.me]
        got = _dist.p2p(
            self.mesh, self.axis, [(mine, q) for q in peers], [((5,), torch.float64, q) for q in peers]
        )
        rows = {q: r.tolist() for q, r in zip(peers, got)}  # one host sync per step, at the end
        rows[self.me] = mine.tolist()
        if st.loss_sum is not None:
            loss = st.loss_sum / sch.m
        else:  # sent as float64, which holds every lower precision exactly
            loss = torch.tensor(rows[last][0], dtype=torch.float64, device=self.device).to(_float_dtype(st))
        stats = Timeline(
            sch.name,
            sch.num_ticks,
            tuple(int(rows[q][1]) for q in range(p)),
            tuple(int(rows[q][2]) for q in range(p)),
            tuple(int(rows[q][3]) for q in range(p)),
            tuple(float(rows[q][4]) for q in range(p)),
            wall,
        )
        return loss, stats


def last_stage(sch: Schedule) -> int:
    """The stage that holds the last virtual stage (and so the loss)."""
    return locate(sch.p * sch.v - 1, sch.p, sch.v, sch.layout)[0]


def _device_of(tree: Any) -> torch.device:
    """The device of the stage's parameters: every tensor the executor sends lives there."""
    for t in tree_flatten(tree)[0]:
        if isinstance(t, Tensor):
            return t.device
    return torch.device("cpu")


def _float_dtype(st: _Stage) -> torch.dtype:
    for leaves, _ in st.groups["stages"]:
        for t in leaves:
            if isinstance(t, Tensor) and t.is_floating_point():
                return t.dtype
    return torch.get_default_dtype()


def _wire_order(a: Action) -> tuple:
    """Order in which both ends post a tick's messages (they must agree per pair of ranks)."""
    return (a.kind[-1], a.microbatch, a.chunk, a.kind)


def _first_messages(schedule: Schedule) -> set[Action]:
    """The first SEND_F/RECV_F over each stage boundary: they are preceded by a shape header."""
    firsts: dict[tuple, Action] = {}
    for a in schedule.actions:  # sorted by tick
        if a.kind == "SEND_F":
            firsts.setdefault(("S", a.stage, a.chunk), a)
        elif a.kind == "RECV_F":
            firsts.setdefault(("R", a.stage, a.chunk), a)
    return set(firsts.values())


_HEADER = 10  # dtype code, rank, up to 8 dims
_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool]


def _header(t: Tensor) -> Tensor:
    if t.dim() > _HEADER - 2 or t.dtype not in _DTYPES:
        raise ValueError(
            f"fpar.pipeline: cannot send an activation of shape {tuple(t.shape)} and dtype {t.dtype} "
            f"between stages (at most {_HEADER - 2} dims, dtypes {_DTYPES})."
        )
    fields = [_DTYPES.index(t.dtype), t.dim(), *t.shape] + [0] * (_HEADER - 2 - t.dim())
    return torch.tensor(fields, dtype=torch.int64, device=t.device)  # on the stage's device (NCCL)


def _unheader(h: Tensor) -> tuple:
    code, rank = int(h[0]), int(h[1])
    return tuple(int(d) for d in h[2 : 2 + rank]), _DTYPES[code]


def _stack_local(per_chunk: list) -> list:
    flat = [tree_flatten(g)[0] for g in per_chunk]
    return [_stack(col) for col in zip(*flat)]


def _stack(col) -> Tensor:
    """``torch.stack``, without a copy for one chunk."""
    return col[0].unsqueeze(0) if len(col) == 1 else torch.stack(col)


def _local_group(st: _Stage, group: str, given: Any) -> Any:
    if given is None:
        return None
    got = st.grads(group)[0]
    return got if got is not None else tree_map(torch.zeros_like, given)


# Error checking and messages ---------------------------------------------------------------


def _check_params(params: Any, xs: Any, targets: Any, schedule: Schedule, *, local: bool) -> None:
    api = "fpar.pipeline.pipeline: step"
    if not isinstance(params, dict) or "stages" not in params:
        raise TypeError(
            f"{api}(params, xs, targets): params must be a dict with key 'stages' (and optionally "
            f"'first', 'last'), got {type(params).__name__}."
        )
    unknown = sorted(set(params) - set(PARAM_KEYS))
    if unknown:
        raise ValueError(f"{api}: params has unknown keys {unknown}; the keys are {PARAM_KEYS}.")
    rows = schedule.p * schedule.v if local else schedule.v
    where = "p * v" if local else "v (this rank's chunks)"
    for t in tree_flatten(params["stages"])[0]:
        if not isinstance(t, Tensor) or t.dim() == 0 or t.shape[0] != rows:
            shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(
                f"{api}: every leaf of params['stages'] must be stacked on dim 0 over {where} = {rows} "
                f"chunks, got {shape}. Stack the chunks in stage-major order (fpar.pipeline.stage_major) "
                f"and give them the in-spec P(axis, ...)."
            )
    for name, value in (("xs", xs), ("targets", targets)):
        if value is None and name == "targets":
            continue
        if not isinstance(value, Tensor) or value.dim() == 0 or value.shape[0] != schedule.m:
            shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise ValueError(
                f"{api}: {name} must be the {schedule.m} microbatches stacked on dim 0, got {shape}."
            )
