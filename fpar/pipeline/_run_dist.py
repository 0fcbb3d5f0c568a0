"""The real-mesh driver: this rank's stage, its sends and receives posted without waiting.

Every rank runs only its own stage's actions and posts each tick's sends and receives along the
pipe axis (``_dist.p2p``, not waited for: a receive is waited for by the compute that uses it,
sends complete in the background).  Values are this rank's blocks over the other axes.  Receive
shapes: a gradient has the shape of the activation the stage itself sent; the first activation
over each stage boundary in a step is preceded by a small header with its shape and dtype (all
microbatches share shapes, as ``xs`` is stacked).  Every tensor sent lives on the stage's
device (NCCL sends device tensors only).

Data-parallel gradients of the stage functions (``fpar.shard`` over the other axes) are
all-reduced once per step: every forward but the one whose backward runs last on its chunk runs
under ``fpar.defer_reduction()``, so its replicated parameters' gradients are summed locally and
reduced with the last one's, one all-reduce per bucket (``fpar/_defer.py``).
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import torch

from .. import _dist
from .._buffers import kept_or_new
from .._defer import defer_reduction
from .._mesh import Mesh
from .._tree import keystr, tree_flatten, tree_flatten_with_path, tree_map, tree_unflatten
from ._schedule import COMPUTE, Action, Schedule, next_stage, prev_stage
from ._stage import Fns, Stage, StepResult, last_stage, stack
from ._timeline import Timeline
from ._unreduced import _Flush, _unreduced, _widen

Tensor = torch.Tensor


class DistDriver:
    """This rank's stage: per tick, its compute, then its sends and receives, posted without waiting.

    A receive is waited for only by the compute that uses it, and sends complete in the
    background: the stages are coupled by their data alone, not by the tick grid, so a tick
    with a long action (a backward) on one stage does not hold up its neighbour's short one.
    Both ends post a pair's messages in the same order (tick, then ``_wire_order``), so they
    match; and every wait is for a value sent at an earlier tick, so nothing deadlocks.
    """

    def __init__(self, schedule: Schedule, mesh: Mesh, axis: str, fns: Fns):
        self.schedule, self.mesh, self.axis, self.fns = schedule, mesh, axis, fns
        self.others = tuple(a for a in mesh.axis_names if a != axis)
        self._stage(mesh._dist.coords[axis])
        self.header = _first_messages(schedule)
        self.shapes: dict[int, tuple] = {}  # chunk -> (shape, dtype) of the activations it receives
        self.kept_rows: list = []  # the stacked gradient buffers of the last step, reused when free
        digest = hashlib.blake2b(repr(schedule.actions).encode(), digest_size=6).hexdigest()
        self.described = (
            f"{schedule.name} (p={schedule.p}, m={schedule.m}, v={schedule.v}, actions #{digest})"
        )

    def _stage(self, me: int) -> None:
        """Run as stage ``me``: its actions per tick."""
        self.me = me
        self.ticks = [[a for a in acts if a.stage == me] for acts in self.schedule.by_tick()]
        self.finals = _last_backwards(self.ticks)
        # the tick of the compute that takes each receive: (RECV_F or RECV_B, microbatch, chunk) -> tick
        self.taken_at = {
            ("RECV_F" if a.kind == "F" else "RECV_B", a.microbatch, a.chunk): t
            for t, acts in enumerate(self.ticks)
            for a in acts
            if a.kind in ("F", "B", "BW")
        }

    def run(
        self,
        params: dict,
        xs: Tensor,
        targets: Any,
        key: Tensor | None = None,
        unreduced: str | None = None,
        accumulate: torch.dtype | None = None,
        each: Any = None,
        gather: Any = None,
        done: Any = None,
    ) -> Any:
        """The step: a ``StepResult``; with ``unreduced`` (a data axis) an ``Unreduced`` instead.

        ``accumulate``: with ``unreduced``, the dtype the gradients of lower-precision parameters
        are summed in over the microbatches (``fpar.optim.zero_pipeline``'s float32 sums of its
        bfloat16-gathered parameters).  ``each``: with ``unreduced``, called after every backward
        action with the deferred sums it completed, ``[(group, chunk, leaf, sum, axes)]`` (``leaf``
        the index in ``params[group]``'s leaves, of chunk ``chunk`` for ``"stages"``), which are
        then not in the result's ``local``; ``each.ready()`` is called before every backward
        action (``zero_pipeline(..., reduce_once=False)`` ends the reductions in flight there).
        ``gather``: with ``unreduced``, where each chunk's parameters come from
        (``zero_pipeline(..., reshard_after_forward=True)``'s ``Reshard``):
        ``gather.chunks(treedef, order)`` their trees, in place of ``params["stages"]``'s rows
        (``order``: this stage's compute actions as it runs them), ``gather.before(a)`` and
        ``gather.after(a)`` around each compute action, ``gather.close()`` at the end.
        ``done``: with ``unreduced``, called once the stage's last action has ended and its last
        send is out, before its sums are taken (``zero_pipeline``'s ZeRO-3 frees the stage it
        gathered there, so its end does not hold it beside the sums it stacks and reduce-scatters).
        """
        if self.mesh.abstract:  # a mesh on paper: the stage fpar.plan simulates (device 0's outside)
            if not _dist.simulated():
                with _dist.on_paper(self.mesh):
                    return self.run(params, xs, targets, key, unreduced, accumulate, each, gather, done)
            if self.mesh._dist.coords[self.axis] != self.me:  # another stage's process: its own buffers
                self._stage(self.mesh._dist.coords[self.axis])
                self.shapes, self.kept_rows = {}, []
        sch = self.schedule
        stacked = params["stages"]
        self.device = _device_of(stacked)
        # Before any message: every rank runs the same schedule on the same shapes, or every rank
        # raises (a mismatch would pair the wrong sends and receives: a hang, or a gloo abort).
        fields = {"schedule": self.described, "xs": _described(xs), "targets": _described(targets)}
        fields.update(params=_described(params), key=_described(key))
        _dist.check_same(self.mesh, fields, self.device, _API)
        if gather is not None and unreduced is not None:  # each chunk gathered for its own actions
            order = [a for acts in self.ticks for a in acts if a.kind in COMPUTE]
            chunks = gather.chunks(tree_flatten(stacked)[1], order)
        else:
            chunks = [tree_map(lambda t, c=c: t[c], stacked) for c in range(sch.v)]
            gather = None
        st = Stage(self.me, sch, self.fns, chunks, params.get("first"), params.get("last"), key)
        st.deferral, st.finals = defer_reduction(), self.finals  # DP gradients reduced once per step
        st.deferral._checks_itself = True  # _check_reduced at the step's end
        if unreduced is not None:  # every forward deferred; the sums are taken unreduced at the end
            st.finals = set()
            st.deferral._fresh_buffers = True  # freed once reduce-scattered, not kept through the update
            if accumulate is not None:
                st.deferral._accumulate_dtype = accumulate
                _widen(st, accumulate)
            if each is None:  # summed once a step: stacked leaf by leaf at the end (``_unreduced``)
                st.deferral._own_buffers = True
        bufs = _gradient_rows(st, stacked, self.kept_rows) if unreduced is None else None
        flush = None if each is None or unreduced is None else _Flush(st, each)
        start = time.perf_counter()
        sending: list = []  # (work, value) of the sends posted at the previous tick
        early: set = set()
        ahead = _dist.device_type() == "cpu"  # gloo: receives posted before the tick's compute
        sim = _dist.simulation()  # fpar.plan simulating this device, or None
        keep = None  # fpar.plan: the microbatches it runs (the rest repeat them); None: all
        if sim is not None:
            sim.pipeline(sch, self.axis)
            keep = sim.kept(sch, self.me, every=flush is not None or gather is not None)
        begun: set = set()  # fpar.plan: the microbatches that have run an action
        ghosts: list = []  # fpar.plan: receives of microbatches not simulated (``_ghost_receives``)
        for tick, full in enumerate(self.ticks):
            if sim is not None:
                keep = sim.narrowed(sch, keep, begun)  # fewer once this run has planned a call
                begun.update(a.microbatch for a in full if keep is None or a.microbatch in keep)
            actions = full if keep is None else [a for a in full if a.microbatch in keep]
            posting: list = []  # this tick's sends
            st.send_early = self._early_sender(actions, posting, early)
            posted = self._post_receives(actions, st) if ahead else set()
            if ahead and len(full) > len(actions):
                ghosts = self._ghost_receives(tick, full, actions, st, ghosts)
            for a in actions:
                if a.kind in COMPUTE:
                    if sim is not None:  # fpar.plan: the ops that follow are this action's
                        sim.mark(a)
                    if gather is not None:
                        gather.before(a)
                    if flush is not None and a.kind != "F":
                        flush.ready()  # the last backward's sums are reduced before this one makes more
                        st.run(a, xs, targets)
                        flush()
                    else:
                        st.run(a, xs, targets)
                    if gather is not None:
                        gather.after(a)
            if sim is not None:
                sim.mark(None)
            posting += self._exchange(actions, st, _dist, early, posted)
            if len(full) > len(actions):  # fpar.plan: a send not simulated holds its bytes too
                posting += sim.held(
                    [self._sent(a, st) for a in full if a not in actions and a.kind[:4] == "SEND"]
                )
            # A tick's sends had this tick's compute to go out: wait for them now, and let what
            # they sent go (a chunk's output, once sent, is held by nothing else: Stage._release).
            # At a fixed point of the program, so the step's memory does not depend on timing.
            for work, _ in sending:
                work.wait()
            sending = posting
            st.note_inbox()
        for work, _ in sending:
            work.wait()
        if gather is not None:
            gather.close()
        if unreduced is not None:
            if done is not None:
                done()
            sums = st.deferral._take_local()
            wall = time.perf_counter() - start
            loss, stats = self._finish(st, wall, _dist)
            return _unreduced(st, params, sums, loss, stats)
        st.deferral._check_reduced("fpar.pipeline")
        wall = time.perf_counter() - start
        loss, stats = self._finish(st, wall, _dist)
        grads = {"stages": tree_unflatten(tree_flatten(stacked)[1], _stack_local(st.grads("stages"), bufs))}
        owners = {"first": 0, "last": last_stage(sch)}
        for g in ("first", "last"):
            if g in params:
                grads[g] = self._share(_local_group(st, g, params[g]), owners[g])
        return StepResult(loss, grads, stats)

    def failed(self) -> None:
        """This rank's step raised before its first message: tell the others (``_dist.check_same``)."""
        _dist.check_same(self.mesh, {}, _dist._device([]), _API, failed=True)

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

    def _early_sender(self, actions: list, sending: list, early: set):
        """``send_early`` for this tick: post a BW's input gradient as soon as B has computed it.

        The stage upstream waits for it, not for this stage's W, which then overlaps its backward
        (torch's runtime sends after the whole backward).  The send goes out before the tick's
        other messages; since every tick posts its B messages before its F messages (the wire
        order both ends use) the order on each pair of ranks is unchanged.  Not in a tick with
        shape headers, which go first on their pair.
        """
        sch, me = self.schedule, self.me
        if any(a in self.header for a in actions):
            return None
        sends = {(a.microbatch, a.chunk): a for a in actions if a.kind == "SEND_B" and a.stage == me}
        if not sends:
            return None

        def send_early(j: int, c: int, dx: Tensor) -> bool:
            a = sends.get((j, c))
            peer = None if a is None else prev_stage(a.stage, a.chunk, sch.p, sch.v, sch.layout)
            if peer is None or peer[0] == me:
                return False
            if _dist.simulation() is not None:  # fpar.plan: the action the message belongs to
                _dist.simulation().origins([a])
            out, _ = _dist.p2p(self.mesh, self.axis, [(dx, peer[0])], [], wait=False)
            sending.extend(out)
            early.add(a)
            return True

        return send_early

    def _post_receives(self, actions: list, st: Stage) -> set:
        """Post this tick's receives before its compute, when no header goes first; return them.

        The peer sends them at the end of its compute, so the receive is waiting when the data
        comes.  Posted at the end of the tick instead, gloo's receive had to take the pair's lock
        from the thread already reading the peer's messages, which on oversubscribed cores was
        descheduled holding it: 0.9 ms a receive in a profile of interleaved 1F1B (24 ms of a
        200 ms step) against 15 µs uncontended.  Both ends keep the per-pair order: a tick's
        receives are posted in wire order, all before the tick's own sends, and a tick with a
        shape header (which goes first on its pair) posts at its end as before.  Only on gloo:
        on NCCL a tick's sends and receives go together as one batch (``_dist.p2p``), which
        NCCL runs as one group call, so neighbours sending to each other cannot deadlock.
        """
        if any(a in self.header for a in actions):
            return set()
        recvs = []
        for a in sorted(actions, key=_wire_order):
            if a.kind in ("RECV_F", "RECV_B") and self._peer(a) != self.me:
                recvs.append(a)
        if not recvs:
            return set()
        bufs = [(*self._shape(a, st), self._peer(a)) for a in recvs]
        if _dist.simulation() is not None:  # fpar.plan: the actions the messages belong to
            _dist.simulation().origins(recvs)
        _, receiving = _dist.p2p(self.mesh, self.axis, [], bufs, wait=False)
        for a, incoming in zip(recvs, receiving):
            st.inbox[("F" if a.kind == "RECV_F" else "B", a.microbatch, a.chunk)] = incoming
        return set(recvs)

    def _ghost_receives(self, tick: int, full: list, actions: list, st: Stage, ghosts: list) -> list:
        """fpar.plan: the buffers of the receives ``_post_receives`` posts for microbatches not simulated.

        On gloo a tick's receives are posted before its compute, so the one of a microbatch not
        simulated (whose events repeat a steady one's) holds its bytes through a simulated
        action's compute too: a buffer of its shape stands for it, from this tick to the one
        whose compute takes it.  ``ghosts``: ``(tick taken, buffer)`` so far; returns those still held.
        """
        ghosts = [g for g in ghosts if g[0] > tick]
        if any(a in self.header for a in full):
            return ghosts  # posted at the tick's end, after its compute, as the simulated ones
        for a in sorted(full, key=_wire_order):
            if a not in actions and a.kind in ("RECV_F", "RECV_B") and self._peer(a) != self.me:
                shape, dtype = self._shape(a, st)
                ghosts.append(
                    (
                        self.taken_at[(a.kind, a.microbatch, a.chunk)],
                        torch.empty(shape, dtype=dtype, device="meta"),
                    )
                )
        return ghosts

    def _exchange(
        self, actions: list, st: Stage, _dist, early: set = frozenset(), posted: set = frozenset()
    ) -> list:
        """Post this tick's sends and receives (after shape headers, if any); return the sends."""
        p, v, me, layout = self.schedule.p, self.schedule.v, self.me, self.schedule.layout
        sends, recvs, heads_out, heads_in, sent = [], [], [], [], []
        sim = _dist.simulation()
        for a in sorted(actions, key=_wire_order):
            if a in early:
                continue  # sent as soon as B computed it (``_early_sender``)
            if a.kind in ("SEND_F", "SEND_B"):
                value = st.to_send(a)
                peer = (next_stage if a.kind == "SEND_F" else prev_stage)(a.stage, a.chunk, p, v, layout)
                if peer[0] == me:  # a chunk of this stage feeds another of its chunks (p = 1)
                    st.inbox[(a.kind[-1], a.microbatch, peer[1])] = value
                    continue
                if a.kind == "SEND_F" and a in self.header:
                    heads_out.append((_header(value), peer[0]))
                    if sim is not None:  # fpar.plan: what the peer's simulation will receive
                        sim.headers[peer] = sim.sent[a.chunk] = (tuple(value.shape), value.dtype)
                sends.append((value, peer[0]))
                sent.append(a)
            elif a.kind in ("RECV_F", "RECV_B"):
                peer = (prev_stage if a.kind == "RECV_F" else next_stage)(a.stage, a.chunk, p, v, layout)
                if peer[0] == me or a in posted:
                    continue
                recvs.append(a)
                if a.kind == "RECV_F" and a in self.header:
                    heads_in.append(a)
        if heads_out or heads_in:
            got = _dist.p2p(
                self.mesh, self.axis, heads_out, [((_HEADER,), torch.int64, self._peer(a)) for a in heads_in]
            )
            for a, h in zip(heads_in, got):
                self.shapes[a.chunk] = _unheader(h) if sim is None else sim.header((me, a.chunk))
        bufs = [(*self._shape(a, st), self._peer(a)) for a in recvs]
        if sim is not None:  # fpar.plan: the actions the messages belong to
            sim.origins(sent + recvs)
        sending, receiving = _dist.p2p(self.mesh, self.axis, sends, bufs, wait=False)
        for a, incoming in zip(recvs, receiving):
            st.inbox[("F" if a.kind == "RECV_F" else "B", a.microbatch, a.chunk)] = incoming
        return sending

    def _sent(self, a: Action, st: Stage) -> tuple | None:
        """(shape, dtype, kind) of what a SEND action sends to another stage (None: to itself or nowhere)."""
        sch = self.schedule
        peer = (next_stage if a.kind == "SEND_F" else prev_stage)(a.stage, a.chunk, sch.p, sch.v, sch.layout)
        if peer is None or peer[0] == self.me:
            return None
        if a.kind == "SEND_F":
            return (*st.out_shapes[a.chunk], "activations")
        return (*self.shapes[a.chunk], "grads")  # the gradient of what the chunk received

    def _peer(self, a: Action) -> int:
        sch = self.schedule
        return (prev_stage if a.kind == "RECV_F" else next_stage)(a.stage, a.chunk, sch.p, sch.v, sch.layout)[
            0
        ]

    def _shape(self, a: Action, st: Stage) -> tuple:
        if a.kind == "RECV_B":
            return st.out_shapes[a.chunk]  # the gradient of what this chunk sent on
        return self.shapes[a.chunk]

    def _finish(self, st: Stage, wall: float, _dist) -> tuple[Tensor, Timeline]:
        """Share the loss (from the last stage) and every stage's stats along the pipe axis."""
        sch = self.schedule
        p, last = sch.p, last_stage(sch)
        # the loss's dtype goes with it (its code in _DTYPES; -1 where this stage has no loss)
        code = _DTYPES.index(st.loss_sum.dtype) if st.loss_sum is not None else -1
        counts = torch.tensor([code, st.busy, st.peak, st.peak_inbox, st.seconds], dtype=torch.float64)
        loss_row = (st.loss_sum / sch.m).reshape(1) if st.loss_sum is not None else torch.zeros(1)
        # On the stage's device (NCCL sends device tensors only); one message per peer.
        mine = torch.cat([loss_row.to(self.device, torch.float64), counts.to(self.device)])
        peers = [q for q in range(p) if q != self.me]
        got = _dist.p2p(
            self.mesh, self.axis, [(mine, q) for q in peers], [((6,), torch.float64, q) for q in peers]
        )
        if _dist.simulated():  # fpar.plan: no peer's numbers arrive; every stage shows this one's
            own = [0.0, *counts.tolist()]
            own[1] = _DTYPES.index(_float_dtype(st))
            rows = {q: own for q in range(p)}
        else:
            rows = {q: r.tolist() for q, r in zip(peers, got)}  # one host sync per step, at the end
            rows[self.me] = mine.tolist()
        if st.loss_sum is not None:
            loss = st.loss_sum / sch.m
        else:  # sent as float64, which holds every lower precision exactly, in the loss's dtype
            dtype = _DTYPES[int(rows[last][1])]
            loss = torch.tensor(rows[last][0], dtype=torch.float64, device=self.device).to(dtype)
        stats = Timeline(
            sch.name,
            sch.num_ticks,
            tuple(int(rows[q][2]) for q in range(p)),
            tuple(int(rows[q][3]) for q in range(p)),
            tuple(int(rows[q][4]) for q in range(p)),
            tuple(float(rows[q][5]) for q in range(p)),
            wall,
        )
        return loss, stats


_API = "fpar.pipeline.pipeline: step"


def _last_backwards(ticks: list) -> set[tuple[int, int]]:
    """Per chunk, ``(microbatch, chunk)`` of the stage's last B/BW: that forward reduces the DP sums.

    Every other forward runs under ``fpar.defer_reduction()``; the final one's backward comes
    after all of theirs, so it all-reduces the sum of the chunk's microbatches once.
    """
    last: dict[int, int] = {}
    for actions in ticks:
        for a in actions:
            if a.kind in ("B", "BW"):
                last[a.chunk] = a.microbatch
    return {(j, c) for c, j in last.items()}


def _described(tree: Any) -> str:
    """A tree's leaves: path, shape and dtype, as text (``_dist.check_same``)."""
    paths, leaves, _ = tree_flatten_with_path(tree)
    parts = [
        f"{keystr(path)} {tuple(t.shape)} {str(t.dtype).replace('torch.', '')}".lstrip()
        if isinstance(t, Tensor)
        else f"{keystr(path)} {type(t).__name__}".lstrip()
        for path, t in zip(paths, leaves)
    ]
    return ", ".join(parts) or "None"


def _device_of(tree: Any) -> torch.device:
    """The device of the stage's parameters: every tensor the executor sends lives there."""
    for t in tree_flatten(tree)[0]:
        if isinstance(t, Tensor):
            return t.device
    return torch.device("cpu")


def _float_dtype(st: Stage) -> torch.dtype:
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


def _gradient_rows(st: Stage, stacked: Any, kept: list) -> list:
    """The step's stacked gradient buffers, one per leaf; W writes chunk ``c``'s gradient into row ``c``.

    With several chunks per rank this saves stacking them at the end (a copy of every weight's
    gradient: 3–14 ms of a 170 ms interleaved step in a profile).  A leaf whose chunks do not all
    end up in their rows (a gradient from autograd too, or none) is stacked as before.

    ``kept``: the last step's buffers, reused where nothing holds them any more (the caller
    dropped that step's gradients): W's first write into a fresh buffer touched new pages, 3.3
    ms a matmul against 1.7 ms into reused memory (a profile of an interleaved step).  A buffer
    the caller still holds is never written.  So with one chunk per rank too (1F1B, GPipe,
    ZB-H1), where stacking is free: a step's first W took 12-13 ms against 6 ms for the others,
    and reuse took 1F1B and ZB-H1 steps from 185 and 189 ms to 176 and 180 (2 stages, one run).

    A leaf's buffer is made when W first writes into it (``_Rows``): a leaf whose gradients all
    come from autograd (a stage function's sharded parameters, which W never sees) holds none,
    where a buffer made up front was a second copy of the stage's gradients, unused.  The
    returned list has ``None`` for those.
    """
    leaves = tree_flatten(stacked)[0]
    rows = _Rows(leaves, kept)
    for c, (chunk, _) in enumerate(st.groups["stages"]):
        for i, leaf in enumerate(chunk):
            if isinstance(leaves[i], Tensor) and leaves[i].is_floating_point() and isinstance(leaf, Tensor):
                rows.at[id(leaf)] = (i, c)
    st.slots = rows
    return rows.bufs


class _Rows:
    """``id(leaf) -> `` its row of the leaf's stacked gradient buffer, the buffer made on first use."""

    def __init__(self, leaves: list, kept: list):
        self.leaves, self.kept = leaves, kept
        self.bufs: list = [None] * len(leaves)
        self.at: dict[int, tuple[int, int]] = {}  # id(chunk leaf) -> (stacked leaf, chunk)
        kept[len(leaves) :] = []

    def __contains__(self, key: int) -> bool:
        return key in self.at

    def __bool__(self) -> bool:
        return bool(self.at)

    def __getitem__(self, key: int) -> Tensor:
        i, c = self.at[key]
        if self.bufs[i] is None:
            t = self.leaves[i]
            old = self.kept[i] if i < len(self.kept) else None
            self.bufs[i] = kept_or_new(old, t.shape, t.dtype, t.device)
            # Kept as an alias (``detach``: a tensor of its own on the same storage, not a view
            # holding its base), so the caller's reference counts in the storage's use: keeping
            # the very tensor handed out would hide it, and a buffer still held would be written.
            self.kept.extend([None] * (i + 1 - len(self.kept)))
            self.kept[i] = self.bufs[i].detach()
        return self.bufs[i][c]


def _stack_local(per_chunk: list, bufs: list | None = None) -> list:
    flat = [tree_flatten(g)[0] for g in per_chunk]
    out = []
    for i, col in enumerate(zip(*flat)):
        buf = bufs[i] if bufs else None
        if buf is not None and all(
            g is not None and g.data_ptr() == buf[c].data_ptr() for c, g in enumerate(col)
        ):
            out.append(buf)  # every chunk's gradient was written into its row
        else:
            out.append(stack(col))
    return out


def _local_group(st: Stage, group: str, given: Any) -> Any:
    if given is None:
        return None
    got = st.grads(group)[0]
    return got if got is not None else tree_map(torch.zeros_like, given)
