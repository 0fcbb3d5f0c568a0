"""Process groups of a real mesh: rank <-> mesh coordinates, groups per set of axes, p2p.

Groups: a collective over a set of axes runs in the group of ranks that share this rank's
coordinates on the other axes.  Ranks map to mesh coordinates row-major (as
``init_device_mesh``).  Within a group, *members* are ordered by the combined index of the axes
in the order the user wrote them; process groups order ranks by global rank, so every call
translates between the two.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import itertools
import logging
import math
import os
import sys
import threading
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist

from .. import _stats as stats
from . import pending

Tensor = torch.Tensor


# The simulated mesh ``fpar.plan`` runs on (``fpar/plan/_simulate.py``), or None: a fake process
# group whose collectives send nothing, and meta tensors for what would be received.
SIMULATION: list = [None]


# fpar.plan's device-0 simulation, for a call on an abstract mesh outside ``estimate`` (set-up
# code such as ``fpar.optim.zero_init``): a context factory, installed by ``fpar/plan/_paper.py``.
ON_PAPER: list = [None]


def on_paper(mesh):
    """A context in which ``mesh``'s collectives can run.

    A simulation of device 0 for an abstract mesh outside ``fpar.plan.estimate``, else nothing
    to do.
    """
    import contextlib

    if getattr(mesh, "abstract", False) and SIMULATION[0] is None and ON_PAPER[0] is not None:
        return ON_PAPER[0]()
    return contextlib.nullcontext()


def simulation():
    """The simulation of ``fpar.plan`` running now, or None."""
    return SIMULATION[0]


def simulated() -> bool:
    """Whether this process is simulating one device of a mesh for ``fpar.plan`` (no real peers)."""
    return SIMULATION[0] is not None


def is_initialized() -> bool:
    """Whether a default process group is up."""
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    """The number of processes in the default group."""
    return dist.get_world_size()


def rank() -> int:
    """This process's rank in the default group."""
    return dist.get_rank()


def device_type() -> str:
    """``"cuda"`` when the default group runs NCCL, else ``"cpu"``."""
    if SIMULATION[0] is not None:  # fpar.plan: meta tensors, the CPU paths
        return "cpu"
    return "cuda" if "nccl" in str(dist.get_backend()) else "cpu"


class MeshGroups:
    """The process groups of one real mesh, built on ``DeviceMesh``, plus combined-axis groups.

    A submesh (``view``) shares its parent's groups: a group over some of the submesh's axes is
    the parent's group over them, which already fixes this rank's coordinates on the others.
    """

    def __init__(self, mesh, parent: MeshGroups | None = None):
        self.mesh = mesh
        self.rank = dist.get_rank()
        if parent is None:
            from torch.distributed.device_mesh import init_device_mesh

            self.device_mesh = init_device_mesh(
                device_type(), mesh.axis_sizes, mesh_dim_names=mesh.axis_names
            )
            self.coords = dict(zip(mesh.axis_names, _unravel(self.rank, mesh.axis_sizes)))
            self._groups: dict[frozenset, Any] = {}
            self.root = self
            # The size of every call's first message over each set of axes (shard._Wire): the
            # same on every rank, changed only by an agreed verdict.
            self.wires: dict[frozenset, Any] = {}
            # Create the groups over every set of two or more axes now, while every rank is
            # here: creating one later is a collective over *all* ranks, which would hang when
            # only some ranks run (one pipeline stage's shard calls).
            for k in range(2, len(mesh.axis_names) + 1):
                for axes in itertools.combinations(mesh.axis_names, k):
                    self.group(axes)
            if device_type() == "cuda":
                self._connect_axes()
        else:
            self.device_mesh = parent.device_mesh
            self.coords = parent.coords  # the parent's coordinates: members() needs all of them
            self._groups = parent._groups
        self.root = self if parent is None else parent.root
        self._members: dict[tuple, list[int]] = {}
        _LIVE.add(self)  # its groups are let go of at exit (``close``)
        if not _CLOSING_AT_EXIT[0]:
            _CLOSING_AT_EXIT[0] = True
            atexit.register(close)

    def _connect_axes(self) -> None:
        """NCCL: start every axis group's communicator now, with every rank of it taking part.

        NCCL creates a group's communicator at its first use, a collective over all of the
        group's ranks.  A batch of point-to-point ops (``batch_isend_irecv``, how ``p2p`` posts
        on NCCL) runs on that communicator, so as a group's first use it would involve only the
        two neighbours, which torch documents as undefined (a hang): a pipeline's first message
        goes from stage 0 to stage 1 alone.  Every rank builds the mesh, so a tiny all-reduce
        per axis here starts them all together.
        """
        one = torch.zeros(1, device=_device([]))
        for axis in self.mesh.axis_names:
            dist.all_reduce(one, group=self.group((axis,)))

    def view(self, names: tuple[str, ...]) -> MeshGroups:
        """The groups of the submesh over ``names`` that contains this rank."""
        view = MeshGroups(self.root.mesh, parent=self)  # groups and members use the full mesh
        view.device_mesh = self.root.device_mesh[names] if names else None
        return view

    def group(self, axes: tuple[str, ...], *, settle: bool = True):
        """The process group over ``axes`` that contains this rank (created on first use).

        Every collective fpar issues asks for its group here, so this first settles any call's
        first message still in flight (``pending.py``): its signature check comes before any
        message whose size depends on the signature, and held bucket all-reduces go before it.
        ``settle=False`` only for a call's first message itself, sent with its first bucket.
        """
        if settle and (pending._UNSETTLED or pending._HELD):
            pending.settle(collective=True)
        key = frozenset(axes)
        if key not in self._groups:
            if len(axes) == 1:
                self._groups[key] = self.root.device_mesh.get_group(axes[0])
            elif key == frozenset(self.root.mesh.axis_names):
                self._groups[key] = dist.group.WORLD
            else:
                # Every rank calls this for the same axes at the same point (SPMD), as
                # new_group requires.
                mine, _ = dist.new_subgroups_by_enumeration(self._partition(key))
                self._groups[key] = mine
        return self._groups[key]

    def _partition(self, key: frozenset) -> list[list[int]]:
        names, sizes = self.mesh.axis_names, self.mesh.axis_sizes
        others = [i for i, a in enumerate(names) if a not in key]
        inside = [i for i, a in enumerate(names) if a in key]
        parts = []
        for fixed in itertools.product(*(range(sizes[i]) for i in others)):
            ranks = []
            for free in itertools.product(*(range(sizes[i]) for i in inside)):
                coords = [0] * len(names)
                for i, c in zip(others, fixed):
                    coords[i] = c
                for i, c in zip(inside, free):
                    coords[i] = c
                ranks.append(_ravel(coords, sizes))
            parts.append(sorted(ranks))
        return parts

    def members(self, axes: tuple[str, ...]) -> list[int]:
        """Global ranks of this rank's group over ``axes``, by combined index in written order.

        Computed once per ``axes`` (every collective asks); callers do not modify the list.
        """
        got = self._members.get(axes)
        if got is None:
            got = self._members[axes] = self._members_of(axes)
        return got

    def _members_of(self, axes: tuple[str, ...]) -> list[int]:
        sizes = [self.mesh.shape[a] for a in axes]
        out = []
        for m in range(math.prod(sizes)):
            coords = dict(self.coords)
            coords.update(zip(axes, _unravel(m, sizes)))
            out.append(_ravel([coords[a] for a in self.mesh.axis_names], self.mesh.axis_sizes))
        return out

    def me(self, axes: tuple[str, ...]) -> int:
        """This rank's combined index along ``axes`` (written order)."""
        return self.members(axes).index(self.rank)


_LIVE: weakref.WeakSet = weakref.WeakSet()  # every MeshGroups (meshes and their views), for ``close``
_CLOSING_AT_EXIT = [False]  # ``close`` is registered with atexit (once, at the first mesh's groups)


def close() -> None:
    """Before the interpreter finalizes: settle fpar's messages, then tear the process groups down.

    Run at exit (``atexit``, registered when the first real mesh gets its groups, so after
    ``init_process_group`` and before anything the script registers later).  It exists because a
    gloo worker thread must never need the GIL once the interpreter is finalizing:

    * A gloo collective is run by one of its process group's worker threads, which holds the
      work (and its tensors) until just after it completes.  When Python has dropped its last
      reference to such a tensor meanwhile, torch keeps the tensor's Python object alive for
      C++ (PyObject preservation), and the worker's release of the work then takes the GIL to
      free it.
    * If the interpreter is finalizing by then, taking the GIL ends the thread (CPython's
      ``PyThread_exit_thread``); its forced unwinding through the work's ``noexcept``
      destructor calls ``std::terminate``: "terminate called without an active exception",
      SIGABRT, and torchrun reports the job failed although every value was right.

    fpar leaves exactly that behind: a planned call's first message is an async all-reduce
    whose verdict waits for its first use (``pending.py``), so a script's last call may exit
    with it still in flight; and fpar's meshes keep their process groups alive past
    ``destroy_process_group()``, so they were only destroyed (and their workers joined) during
    finalization.  Here, while the interpreter is whole: (1) every deferred first message is
    waited for (its verdict run, when the default group is still up); (2) fpar lets go of its process
    groups (every mesh's groups and ``DeviceMesh``); (3) a gloo default group still up is
    destroyed, as torch asks every script to do before exit, and the garbage is collected, so
    each group's destructor waits for its queued work and joins its worker threads now, with
    the GIL released (torch's holder of a process group releases it), not during
    finalization; that also finishes a bucket's all-reduce that no backward waited for (its
    graph was cut short).  ``destroy_process_group`` runs only for gloo here (NCCL's teardown
    may be collective in some versions).

    A script that uses ``torch.distributed`` itself from an exit handler it registered *before*
    making its first mesh finds the group destroyed; one registered after runs before this.

    An uncaught exception ending the process (``pending.ending_on_error``) changes one thing:
    its peers may be waiting for it in some other collective and never answer, so nothing is
    sent or waited for (the verdicts and held messages are dropped), and the teardown, whose
    destructor waits for a gloo worker still in a collective, gets ``TEARDOWN_ON_ERROR_S``
    seconds; past them the process ends at once (``os._exit(1)``, the exit code of an uncaught
    exception, streams flushed) instead of staying up until the collective's timeout while
    torchrun waits for it to exit before it stops the job (seen: a lost node's peer that failed
    mid-step held the elastic restart until the test's timeout).
    """
    ending = pending.ending_on_error()
    pending._settle_at_exit()  # every deferred message has arrived (or failed); dropped if ending
    held = []
    for mg in list(_LIVE):
        held.extend(weakref.ref(g) for g in mg._groups.values() if g is not None)
        mg._groups.clear()  # shared by a mesh's views
        device_mesh, mg.device_mesh = mg.device_mesh, None
        registry = getattr(device_mesh, "_pg_registry", None)  # torch's DeviceMesh keeps its groups
        if isinstance(registry, dict):
            held.extend(weakref.ref(g) for g in registry.values() if g is not None)
            registry.clear()
    _LIVE.clear()
    if not ending:
        _tear_down(held)
        return
    # The printed traceback's frames hold the failed step's tensors, and through them its
    # messages and their groups: let go of them, so that the groups go now, not in finalization.
    for name in ("last_exc", "last_type", "last_value", "last_traceback"):
        if hasattr(sys, name):
            delattr(sys, name)
    worker = threading.Thread(target=_tear_down, args=(held,), name="fpar-teardown", daemon=True)
    worker.start()
    worker.join(TEARDOWN_ON_ERROR_S)
    stuck = worker.is_alive()
    if stuck or any(r() is not None for r in held):
        # A group left for finalization would wait there for a worker that may be in a
        # collective no peer joins: end here, streams and logs flushed.
        if stuck:
            print(
                "fpar: ending the process on the error above without waiting for a collective "
                "still in flight (a peer that never joins it would hold it until its timeout)",
                file=sys.stderr,
            )
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(1)


TEARDOWN_ON_ERROR_S = 5.0  # how long a process ending on an uncaught exception waits for its teardown


def _tear_down(held: list) -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - nothing to raise to at exit; finalization tears it down
            pass
    gc.collect()  # groups that a reference cycle still held (a call's message keeps its group)
    if any(r() is not None for r in held):
        # Someone else still holds a group: its destructor (and the join) comes during
        # finalization.  Its workers are idle (everything fpar sent has been waited for); let one
        # that is just releasing a finished work take the GIL while the interpreter is whole.
        time.sleep(0.05)


def _ravel(coords, sizes) -> int:
    r = 0
    for c, s in zip(coords, sizes):
        r = r * s + c
    return r


def _unravel(index: int, sizes) -> list[int]:
    out = []
    for s in reversed(list(sizes)):
        out.append(index % s)
        index //= s
    return out[::-1]


def p2p(
    mesh,
    axis: str,
    sends: list[tuple[Tensor, int]],
    recvs: list[tuple[tuple, torch.dtype, int]],
    *,
    wait: bool = True,
):
    """Point-to-point exchange along one axis: send blocks to, and receive blocks from, neighbours.

    ``sends`` are ``(tensor, index along axis)``; ``recvs`` are ``(shape, dtype, index)``.  All
    are posted together, so neighbours that both send and receive cannot deadlock.  Not
    differentiable: a pipeline executor moves activations and cotangents explicitly.  Each send
    and receive is counted in ``fpar.comm_stats`` under ``axis`` as ``"send"`` / ``"recv"``.

    Returns:
      With ``wait=True``, the received tensors, in the order of ``recvs``.  With ``wait=False``,
      ``(pending_sends, incoming)``: the sends' ``(work, tensor)`` pairs (keep them until they
      complete) and one ``Incoming`` per receive, whose ``wait()`` returns the tensor.
    """
    mg = mesh._dist
    members = mg.members((axis,))
    group = mg.group((axis,))
    for t, _ in sends:
        stats.record_p2p(axis, "send", t.nbytes)
    for shape, dtype, _ in recvs:
        stats.record_p2p(axis, "recv", math.prod(shape) * dtype.itemsize)
    if SIMULATION[0] is not None:  # fpar.plan: nothing is sent; what arrives has its shape only
        bufs = [torch.empty(shape, dtype=dtype, device="meta") for shape, dtype, _ in recvs]
        if wait:
            return bufs
        # the sends' tensors stay alive until the step waits for them, as a real send's do
        return [(_Done(), t.contiguous()) for t, _ in sends], [Incoming(_Done(), b) for b in bufs]
    if wait:
        ops, out = [], []
        for t, index in sends:
            ops.append(dist.P2POp(dist.isend, t.contiguous(), members[index], group))
        for shape, dtype, index in recvs:
            buf = torch.empty(shape, dtype=dtype, device=_device([]))
            out.append(buf)
            ops.append(dist.P2POp(dist.irecv, buf, members[index], group))
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        return out
    if sends or recvs:
        device = sends[0][0].device if sends else _device([])
        if _coalesces(group, device):
            return _batched(sends, recvs, members, group, device)
    pending = []
    for t, index in sends:
        t = t.contiguous()
        pending.append((dist.isend(t, members[index], group=group), t))
    incoming = []
    for shape, dtype, index in recvs:
        buf = torch.empty(shape, dtype=dtype, device=_device([]))
        incoming.append(Incoming(dist.irecv(buf, members[index], group=group), buf))
    return pending, incoming


def _coalesces(group, device: torch.device) -> bool:
    """Whether ``group``'s backend on ``device`` runs a batch of p2p ops as one group call (NCCL)."""
    return bool(group._get_backend(device).supports_coalescing)


def _batched(sends: list, recvs: list, members: list[int], group, device: torch.device) -> tuple:
    """``p2p(wait=False)`` on a backend that coalesces (NCCL): one ``batch_isend_irecv``.

    NCCL runs a pair's point-to-point kernels in order on one stream, and a send larger than its
    buffers completes only once the peer's matching receive runs.  Posted one by one, two
    neighbours that each send before they receive (stage ``i``'s activation forward, stage
    ``i + 1``'s gradient back, in one tick) would each wait on the other's send: a deadlock.
    One group call (``ncclGroupStart``/``End``) runs the batch's sends and receives together,
    in any order, as Megatron-LM and ``torch.distributed.pipelining`` post theirs.  The batch
    returns one handle for all of it, so each receive waits on the batch.
    """
    ops, keep, bufs = [], [], []
    for t, index in sends:
        t = t.contiguous()
        keep.append(t)
        ops.append(dist.P2POp(dist.isend, t, members[index], group))
    for shape, dtype, index in recvs:
        buf = torch.empty(shape, dtype=dtype, device=device)
        bufs.append(buf)
        ops.append(dist.P2POp(dist.irecv, buf, members[index], group))
    batch = _Batch(dist.batch_isend_irecv(ops), keep)
    return [(batch, batch.keep)] if sends else [], [Incoming(batch, buf) for buf in bufs]


class _Batch:
    """A batch's handles, waited on once however many of its receives and sends ask.

    Waiting twice is not harmless on every backend: a gloo send handle counts completions, and a
    second wait waits for a send that never comes.
    """

    def __init__(self, works: list, keep: list[Tensor]):
        self.works, self.keep = works, tuple(keep)  # the sends' tensors: alive until it completes

    def wait(self) -> None:
        works, self.works = self.works, []
        for w in works:
            w.wait()


class _Done:
    """The handle of a simulated message (``fpar.plan``): already complete."""

    def wait(self) -> None:
        return None


class Incoming:
    """A posted receive: ``wait()`` returns the tensor once it has arrived.

    ``work`` is the receive's handle, or its batch's (``_batched``).
    """

    def __init__(self, work, buf: Tensor):
        self.work, self.buf = work, buf

    def wait(self) -> Tensor:
        """Block until the tensor has arrived, and return it."""
        self.work.wait()
        return self.buf


def attach(mesh) -> None:
    """Give ``mesh`` its process groups (every rank must call this, as ``make_mesh`` does)."""
    mesh._dist = MeshGroups(mesh)


def _device(checked) -> torch.device:
    if checked:
        return checked[0][2].device
    if SIMULATION[0] is not None:
        return torch.device("meta")
    return (
        torch.device("cuda", torch.cuda.current_device()) if device_type() == "cuda" else torch.device("cpu")
    )
