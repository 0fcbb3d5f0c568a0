"""The real mesh: one process per device over ``torch.distributed`` (the only importer of it).

The sharded function runs with the same engine as in-process (``_shard.py``), with every mesh
level of batch size 1: each process holds its own block, vmap still tracks which axes a value
varies over, and a collective's vmap rule peels all mesh levels and hands the plain local
tensor to an exchange here.  An exchange is an ``autograd.Function`` around process-group
calls; its backward is the transpose (DESIGN §3), itself an exchange, so grad-of-grad works.

Groups: a collective over a set of axes runs in the group of ranks that share this rank's
coordinates on the other axes.  Ranks map to mesh coordinates row-major (as
``init_device_mesh``).  Within a group, *members* are ordered by the combined index of the axes
in the order the user wrote them; process groups order ranks by global rank, so every call
translates between the two.
"""

from __future__ import annotations

import datetime
import hashlib
import io
import itertools
import math
import os
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ._registry import internal
from ._spec import PartitionSpec, check_spec

__all__ = ["DistBackend", "attach", "init_distributed", "is_initialized", "launch", "world_size"]

Tensor = torch.Tensor


# Process groups ------------------------------------------------------------------------------


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
            # Create the groups over every set of two or more axes now, while every rank is
            # here: creating one later is a collective over *all* ranks, which would hang when
            # only some ranks run (one pipeline stage's shard calls).
            for k in range(2, len(mesh.axis_names) + 1):
                for axes in itertools.combinations(mesh.axis_names, k):
                    self.group(axes)
        else:
            self.device_mesh = parent.device_mesh
            self.coords = parent.coords  # the parent's coordinates: members() needs all of them
            self._groups = parent._groups
        self.root = self if parent is None else parent.root

    def view(self, names: tuple[str, ...]) -> MeshGroups:
        """The groups of the submesh over ``names`` that contains this rank."""
        from ._mesh import Mesh

        sub = Mesh([self.mesh.shape[a] for a in names], names, backend="dist")
        view = MeshGroups(sub, parent=self)
        view.mesh = self.root.mesh  # groups and members are computed on the full mesh
        view.device_mesh = self.root.device_mesh[names] if names else None
        return view

    def group(self, axes: tuple[str, ...]):
        """The process group over ``axes`` that contains this rank (created on first use)."""
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
        """Global ranks of this rank's group over ``axes``, by combined index in written order."""
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
    differentiable: a pipeline executor moves activations and cotangents explicitly.

    Returns:
      With ``wait=True``, the received tensors, in the order of ``recvs``.  With ``wait=False``,
      ``(pending_sends, incoming)``: the sends' ``(work, tensor)`` pairs (keep them until they
      complete) and one ``Incoming`` per receive, whose ``wait()`` returns the tensor.
    """
    mg = mesh._dist
    members = mg.members((axis,))
    group = mg.group((axis,))
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
    pending = []
    for t, index in sends:
        t = t.contiguous()
        pending.append((dist.isend(t, members[index], group=group), t))
    incoming = []
    for shape, dtype, index in recvs:
        buf = torch.empty(shape, dtype=dtype, device=_device([]))
        incoming.append(Incoming(dist.irecv(buf, members[index], group=group), buf))
    return pending, incoming


class Incoming:
    """A posted receive: ``wait()`` returns the tensor once it has arrived."""

    def __init__(self, work, buf: Tensor):
        self.work, self.buf = work, buf

    def wait(self) -> Tensor:
        """Block until the tensor has arrived, and return it."""
        self.work.wait()
        return self.buf


def attach(mesh) -> None:
    """Give ``mesh`` its process groups (every rank must call this, as ``make_mesh`` does)."""
    mesh._dist = MeshGroups(mesh)


# Exchanges: the collectives on local blocks ----------------------------------------------------


def _in_group_order(blocks: list[Tensor], members: list[int], group) -> list[Tensor]:
    """Reorder per-member blocks into the group's rank order."""
    out: list[Tensor] = [None] * len(blocks)  # type: ignore[list-item]
    for m, r in enumerate(members):
        out[dist.get_group_rank(group, r)] = blocks[m]
    return out


def _from_group_order(blocks: list[Tensor], members: list[int], group) -> list[Tensor]:
    return [blocks[dist.get_group_rank(group, r)] for r in members]


_REDUCE = {
    "psum": dist.ReduceOp.SUM,
    "pmean": dist.ReduceOp.SUM,
    "pmax": dist.ReduceOp.MAX,
    "pmin": dist.ReduceOp.MIN,
}


def _run(kind: str, params: tuple, x: Tensor, nb: int, axes, mg: MeshGroups) -> Tensor:
    """One collective on this process's local ``x`` (``nb`` batch dims, then the block)."""
    group, members = mg.group(axes), mg.members(axes)
    n = len(members)
    if kind in _REDUCE:
        y = x.detach().clone(memory_format=torch.contiguous_format)
        dist.all_reduce(y, op=_REDUCE[kind], group=group)
        return y / n if kind == "pmean" else y
    if kind in ("all_gather", "all_gather_invariant"):
        axis, tiled = params
        bufs = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(n)]
        dist.all_gather(bufs, x.contiguous(), group=group)
        blocks = _from_group_order(bufs, members, group)
        return torch.cat(blocks, nb + axis) if tiled else torch.stack(blocks, nb + axis)
    if kind == "psum_scatter":
        dim, tiled = params
        chunks = [c.contiguous() for c in x.chunk(n, nb + dim)]
        out = torch.empty_like(chunks[0])
        dist.reduce_scatter(out, _in_group_order(chunks, members, group), group=group)
        return out if tiled else out.squeeze(nb + dim)
    if kind == "ppermute":
        return _ppermute(x, params[0], members, mg.rank, group)
    if kind == "all_to_all":
        return _all_to_all(x, nb, *params, members, group)
    raise AssertionError(kind)  # unreachable: pvary never reaches _run


def _ppermute(x: Tensor, perm, members: list[int], me_rank: int, group) -> Tensor:
    me = members.index(me_rank)
    send_to = [dst for src, dst in perm if src == me]
    recv_from = [src for src, dst in perm if dst == me]
    out = torch.zeros_like(x, memory_format=torch.contiguous_format)
    ops = []
    if send_to and send_to[0] != me:
        ops.append(dist.P2POp(dist.isend, x.contiguous(), members[send_to[0]], group))
    if recv_from and recv_from[0] != me:
        ops.append(dist.P2POp(dist.irecv, out, members[recv_from[0]], group))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    if recv_from and recv_from[0] == me:
        out.copy_(x)
    return out


def _all_to_all(x: Tensor, nb: int, split: int, concat: int, tiled: bool, members, group) -> Tensor:
    n = len(members)
    s = nb + split
    t = x.movedim(s, 0)  # (L_split, *rest)
    chunks = list(t.unflatten(0, (n, t.shape[0] // n)).unbind(0))  # chunk j goes to member j
    send = torch.stack(_in_group_order(chunks, members, group)).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    got = torch.stack(_from_group_order(list(recv.unbind(0)), members, group))  # (n_src, c, *rest)
    got = got.movedim(1, 1 + s)  # each source's chunk back in place: (n_src, *x.shape with c)
    if not tiled:
        got = got.squeeze(1 + s)
    got = got.movedim(0, nb + concat)
    return got.flatten(nb + concat, nb + concat + 1) if tiled else got


@internal
class _Exchange(torch.autograd.Function):
    """A collective on local blocks; differentiable, with the transposes of DESIGN §3."""

    @staticmethod
    def forward(x: Tensor, kind: str, params: tuple, nb: int, axes: tuple, mg: MeshGroups) -> Tensor:
        if kind == "pvary":
            return x.view_as(x)
        return _run(kind, params, x, nb, axes, mg)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, ctx.kind, ctx.params, ctx.nb, ctx.axes, ctx.mg = inputs
        if ctx.kind in ("pmax", "pmin"):
            ctx.save_for_backward(x, output)
            ctx.save_for_forward(x, output)

    @staticmethod
    def jvp(ctx, x_t: Tensor, *_):
        """Forward mode: every collective is linear in its input, except pmax/pmin's choice."""
        if ctx.kind in ("pmax", "pmin"):
            x, y = ctx.saved_tensors
            mask = (x == y).to(x_t.dtype)
            total = _Exchange.apply(x_t * mask, "psum", (), ctx.nb, ctx.axes, ctx.mg)
            return total / _Exchange.apply(mask, "psum", (), ctx.nb, ctx.axes, ctx.mg)
        return _Exchange.apply(x_t, ctx.kind, ctx.params, ctx.nb, ctx.axes, ctx.mg)

    @staticmethod
    def backward(ctx, ct: Tensor):
        kind, p, nb, axes, mg = ctx.kind, ctx.params, ctx.nb, ctx.axes, ctx.mg
        n = len(mg.members(axes))
        if kind == "psum":
            # The replicated cotangent: psum transposes to pvary, whose own transpose (a second
            # derivative) is the psum again.
            g = _Exchange.apply(ct, "pvary", (), nb, axes, mg)
        elif kind == "pmean":
            g = _Exchange.apply(ct, "pvary", (), nb, axes, mg) / n
        elif kind in ("pmax", "pmin"):
            x, y = ctx.saved_tensors
            mask = (x == y).to(ct.dtype)
            g = ct * mask / _Exchange.apply(mask, "psum", (), nb, axes, mg)
        elif kind == "pvary":
            g = _Exchange.apply(ct, "psum", (), nb, axes, mg)
        elif kind == "all_gather":
            g = _Exchange.apply(ct, "psum_scatter", p, nb, axes, mg)
        elif kind == "all_gather_invariant":
            g = _own_chunk(ct, nb + p[0], p[1], mg.me(axes), n)
        elif kind == "psum_scatter":
            g = _Exchange.apply(ct, "all_gather", p, nb, axes, mg)
        elif kind == "ppermute":
            g = _Exchange.apply(ct, kind, (tuple((d, s) for s, d in p[0]),), nb, axes, mg)
        else:  # all_to_all
            split, concat, tiled = p
            g = _Exchange.apply(ct, kind, (concat, split, tiled), nb, axes, mg)
        return g, None, None, None, None, None


def _own_chunk(ct: Tensor, dim: int, tiled: bool, me: int, n: int) -> Tensor:
    """This rank's block of a replicated cotangent of a gathered value (no communication)."""
    return ct.chunk(n, dim)[me] if tiled else ct.select(dim, me)


@internal
class _TakeFirst(torch.autograd.Function):
    """The block of coordinate 0 along ``axes`` on every process (``check_rep=False`` outputs)."""

    @staticmethod
    def forward(x: Tensor, axes: tuple, mg: MeshGroups) -> Tensor:
        y = x.detach().clone(memory_format=torch.contiguous_format)
        dist.broadcast(y, mg.members(axes)[0], group=mg.group(axes))
        return y

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.axes, ctx.mg = inputs

    @staticmethod
    def jvp(ctx, x_t: Tensor, *_):
        return _TakeFirst.apply(x_t, ctx.axes, ctx.mg)

    @staticmethod
    def backward(ctx, ct: Tensor):
        # As in-process: only coordinate 0's block is the output, so only it gets a gradient.
        first = ctx.mg.me(ctx.axes) == 0
        return (ct if first else torch.zeros_like(ct)), None, None


# The backend ----------------------------------------------------------------------------------


class DistBackend:
    """The real mesh: each process passes its own blocks in and gets its own blocks out."""

    name = "dist"

    def __init__(self, mesh):
        self.mesh = mesh
        self.mg: MeshGroups = mesh._dist

    def check_input(self, spec: PartitionSpec, x: Tensor, where: str) -> None:
        check_spec(spec, tuple(x.shape), self.mesh.shape, where=where, blocks=True)

    def split(self, x: Tensor, spec: PartitionSpec) -> tuple[Tensor, list]:
        named = [a for a in self.mesh.axis_names if a in spec.axes()]
        return x.reshape((1,) * len(named) + tuple(x.shape)), named + [None] * x.dim()

    def before(self, call, checked) -> None:
        """Agree across this mesh's ranks on every input's spec, shape and dtype, before any exchange.

        One 16-byte max-reduction over the mesh's own ranks (a submesh's, e.g. one pipeline
        stage's, not the whole world's: other stages may be running other shard calls).
        """
        axes = self.mesh.axis_names
        if not axes:
            return
        group = self.mg.group(axes)
        sig = repr([(w, str(s), tuple(x.shape), str(x.dtype)) for w, s, x in checked])
        h = int.from_bytes(hashlib.blake2b(sig.encode(), digest_size=7).digest(), "little")
        t = torch.tensor([h, -h], dtype=torch.int64, device=_device(checked))
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        if t[0].item() == -t[1].item():
            return
        members = self.mg.members(axes)
        sigs: list = [None] * len(members)
        dist.all_gather_object(sigs, [(w, str(s), tuple(x.shape)) for w, s, x in checked], group=group)
        by_rank = dict(zip(sorted(members), sigs))  # all_gather_object orders by group rank
        raise ValueError(
            f"fpar.shard({call.fname}): the ranks passed blocks of different shapes or specs; every "
            f"process must pass its block of the same global values. Per rank: "
            + "; ".join(f"rank {r}: {by_rank[r]}" for r in sorted(by_rank))
        )

    def token_and_index(self, device=None) -> tuple[Tensor, list[Tensor]]:
        """The mesh token (size 1 per level) and this rank's coordinates, on the inputs' device."""
        names = self.mesh.axis_names
        token = torch.zeros((1,) * len(names), device=device)
        return token, [torch.tensor([self.mg.coords[a]], device=device) for a in names]

    def exchange(self, op, x: Tensor) -> Tensor:
        k = len(op.explicit)
        local = x.reshape(x.shape[k:])  # the explicit axis dims all have size 1 here
        if op.replicated:
            # The input was replicated over these axes (in-process: the same block expanded to
            # every device, whose backward sums): this block is the only copy, so its cotangent
            # must be all-reduced over them.
            local = _Exchange.apply(local, "pvary", (), op.nbatch, op.replicated, self.mg)
        y = _Exchange.apply(local, op.kind, op.params, op.nbatch, op.axes, self.mg)
        varying = op.kind in ("all_gather", "psum_scatter", "ppermute", "all_to_all", "pvary")
        return y.reshape((1,) * k + tuple(y.shape)) if varying else y

    def sum_cotangent(self, x: Tensor, axes: tuple[str, ...]) -> Tensor:
        """Identity on the local tensor; its backward all-reduces the cotangent over ``axes``."""
        return _Exchange.apply(x, "pvary", (), 0, axes, self.mg)

    def output(
        self, t: Tensor, spec: PartitionSpec, present: list[str], replicated: tuple[str, ...] = ()
    ) -> Tensor:
        t = t.reshape(t.shape[len(present) :])
        if replicated:
            # An out_spec names these axes but the value is replicated over them: the global
            # output holds one copy per device (in-process: an expand, whose backward sums), and
            # this block is the only copy here, so its cotangent is all-reduced over them.
            t = _Exchange.apply(t, "pvary", (), 0, replicated, self.mg)
        broken = tuple(a for a in present if a not in spec.axes())
        return _TakeFirst.apply(t, broken, self.mg) if broken else t


def _device(checked) -> torch.device:
    if checked:
        return checked[0][2].device
    return (
        torch.device("cuda", torch.cuda.current_device()) if device_type() == "cuda" else torch.device("cpu")
    )


# Starting processes ---------------------------------------------------------------------------


def init_distributed(*, backend: str | None = None, timeout: float = 600.0) -> None:
    """Initialise the default process group from torchrun's environment, if not already up.

    Args:
      backend: ``"gloo"`` or ``"nccl"``; default NCCL when CUDA is available, else gloo.
      timeout: seconds a collective may wait for the other ranks before raising, instead of
        hanging when one of them has failed.
    """
    if is_initialized():
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))


class LaunchError(RuntimeError):
    """A process started by ``fpar.launch`` failed; the others were stopped."""


def launch(fn: Callable, nprocs: int, *args: Any, timeout: float = 60.0, backend: str = "gloo") -> list:
    """Run ``fn(*args)`` on ``nprocs`` local processes forming a real mesh; return their results.

    For notebooks and tests: no torchrun needed.  Each process joins a process group on
    127.0.0.1 (gloo by default), so ``fpar.make_mesh`` inside ``fn`` builds a real mesh.  If any
    process raises or dies, the others are stopped and ``LaunchError`` names the rank and shows
    its traceback; a collective that waits longer than ``timeout`` seconds raises instead of
    hanging.

    Args:
      fn: a picklable (module-level) function.
      nprocs: number of processes.
      *args: picklable arguments for ``fn``.
      timeout: seconds before a stuck collective (or the whole run, plus a margin) fails.
      backend: the process-group backend.

    Returns:
      ``[fn's result on rank 0, on rank 1, ...]``.

    Raises:
      LaunchError: a process raised or exited without a result.
    """
    import multiprocessing as mp
    import queue as queue_mod
    import tempfile
    import time

    if nprocs < 1:
        raise ValueError(f"fpar.launch: nprocs must be at least 1, got {nprocs}.")
    _check_launchable(fn)
    ctx = mp.get_context("spawn")
    results: dict[int, Any] = {}
    with tempfile.TemporaryDirectory(prefix="fpar-launch-") as tmp:
        q = ctx.Queue()
        procs = [
            ctx.Process(
                target=_worker,
                args=(fn, args, r, nprocs, os.path.join(tmp, "store"), timeout, backend, q),
                daemon=True,
            )
            for r in range(nprocs)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout + 60.0
        try:
            while len(results) < nprocs:
                try:
                    r, ok, payload = q.get(timeout=0.2)
                except queue_mod.Empty:
                    dead = [
                        i for i, p in enumerate(procs) if i not in results and p.exitcode not in (None, 0)
                    ]
                    if dead:
                        raise LaunchError(
                            f"fpar.launch: rank {dead[0]} exited with code {procs[dead[0]].exitcode} "
                            f"without a result; the other ranks were stopped."
                        ) from None
                    if time.monotonic() > deadline:
                        raise LaunchError(
                            f"fpar.launch: no result after {timeout + 60:.0f}s from ranks "
                            f"{sorted(set(range(nprocs)) - set(results))}; stopped all ranks."
                        ) from None
                    continue
                if not ok:
                    raise LaunchError(_blame(procs, results, r, payload))
                results[r] = torch.load(io.BytesIO(payload), weights_only=False)
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
                    p.join()
            q.close()
    return [results[r] for r in range(nprocs)]


def _check_launchable(fn: Callable) -> None:
    """Refuse, with the fix, what a spawned process could not run (before starting any)."""
    import multiprocessing as mp
    import sys

    if mp.parent_process() is not None:
        raise RuntimeError(
            "fpar.launch was called while a process it started was importing your script: the "
            "script calls fpar.launch at import time. Put the call under "
            '`if __name__ == "__main__":` (each process re-imports the script to find fn).'
        )
    name = getattr(fn, "__qualname__", "")
    if not callable(fn):
        raise TypeError(f"fpar.launch: fn must be a function, got {fn!r}.")
    if "<lambda>" in name or "<locals>" in name:
        raise TypeError(
            f"fpar.launch: fn {name!r} is a lambda or a function defined inside another function; the "
            f"processes are spawned and must import fn by name. Define it at the top level of a "
            f"module (or of the script, under an `if __name__ == \"__main__\":` guard) and pass "
            f"its arguments through *args."
        )
    if getattr(fn, "__module__", None) == "__main__":
        main = sys.modules.get("__main__")
        path = getattr(main, "__file__", None)
        if path is None:
            raise TypeError(
                f"fpar.launch: fn {name!r} is defined in an interactive session (__main__ has no "
                f"file), which spawned processes cannot import. Put it in a module file and import it."
            )
        try:
            with open(path, encoding="utf-8") as fh:
                source = fh.read()
        except OSError:
            return
        if "__main__" not in source:
            raise RuntimeError(
                f"fpar.launch: {path} calls fpar.launch without an `if __name__ == \"__main__\":` "
                f"guard. Each spawned process re-imports the script to find {name!r}, and would "
                f"launch again. Put the script's top-level code under that guard."
            )


def _blame(procs, results: dict, r: int, payload: str) -> str:
    """The message for a failed launch, naming the rank that failed first.

    When a rank dies without a result (killed, ``os._exit``), its neighbours then fail in a
    collective ("connection reset") and may report first; wait a moment for the dead rank's exit
    code, and blame it.
    """
    import time

    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        dead = [i for i, p in enumerate(procs) if i not in results and i != r and p.exitcode not in (None, 0)]
        if dead:
            return (
                f"fpar.launch: rank {dead[0]} exited with code {procs[dead[0]].exitcode} without a "
                f"result; the other ranks were stopped. Rank {r} then raised:\n{payload}"
            )
        time.sleep(0.05)
    return f"fpar.launch: rank {r} raised; the other ranks were stopped.\n{payload}"


def _worker(fn, args, rank_: int, world: int, store_path: str, timeout: float, backend: str, q) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only
    os.environ.update(RANK=str(rank_), WORLD_SIZE=str(world), LOCAL_RANK=str(rank_))
    torch.set_num_threads(1)  # several processes share the cores
    try:
        store = dist.FileStore(store_path, world)
        dist.init_process_group(
            backend, store=store, rank=rank_, world_size=world, timeout=datetime.timedelta(seconds=timeout)
        )
        result = fn(*args)
        buf = io.BytesIO()
        torch.save(result, buf)
        q.put((rank_, True, buf.getvalue()))
    except BaseException:  # report everything, including KeyboardInterrupt, to the parent
        q.put((rank_, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# Global and local values ----------------------------------------------------------------------


def block(x: Tensor, spec: PartitionSpec, mesh) -> Tensor:
    """This rank's block of the global ``x`` (a copy, so the global tensor can be freed)."""
    coords = mesh._dist.coords
    for d, entry in enumerate(spec.normalized()):
        index, n = 0, 1
        for a in entry:
            index = index * mesh.shape[a] + coords[a]
            n *= mesh.shape[a]
        if n > 1:
            x = x.narrow(d, index * (x.shape[d] // n), x.shape[d] // n)
    return x.clone()


def gather(x: Tensor, spec: PartitionSpec, mesh) -> Tensor:
    """The global tensor on every rank, from each rank's block ``x`` (differentiable).

    The result is one replicated value, so the transpose keeps each rank's own block of the
    cotangent (``all_gather_invariant``), as in-process, where ``gather`` is the identity.
    """
    for d, entry in enumerate(spec.normalized()):
        if entry:
            x = _Exchange.apply(x, "all_gather_invariant", (d, True), 0, entry, mesh._dist)
    return x


def _placements(spec: PartitionSpec, mesh, api: str):
    from torch.distributed.tensor import Replicate, Shard

    where = {a: d for d, entry in enumerate(spec.normalized()) for a in entry}
    for d, entry in enumerate(spec.normalized()):
        order = [mesh.axis_names.index(a) for a in entry]
        if order != sorted(order):
            raise ValueError(
                f"fpar.{api}: spec {spec} splits dim {d} over {entry}, not in mesh order "
                f"{mesh.axis_names}; DTensor nests shards in mesh order only."
            )
    return [Shard(where[a]) if a in where else Replicate() for a in mesh.axis_names]


def to_dtensor(x: Tensor, spec: PartitionSpec, mesh):
    """Wrap this rank's block as a DTensor on the mesh's DeviceMesh."""
    from torch.distributed.tensor import DTensor

    from ._spec import global_shape

    check_spec(spec, tuple(x.shape), mesh.shape, where="fpar.to_dtensor", blocks=True)
    shape = global_shape(spec, tuple(x.shape), mesh.shape)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(
        x,
        mesh._dist.device_mesh,
        _placements(spec, mesh, "to_dtensor"),
        run_check=False,
        shape=shape,
        stride=stride,
    )


def from_dtensor(dt, spec: PartitionSpec, mesh) -> Tensor:
    """This rank's block of ``dt`` laid out as ``spec``."""
    placements = _placements(spec, mesh, "from_dtensor")
    return dt.redistribute(mesh._dist.device_mesh, placements).to_local()
