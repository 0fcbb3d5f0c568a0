"""Meshes on paper: ``abstract_mesh`` and the simulation of one of its devices.

An abstract mesh is a real mesh (``backend="dist"``) whose process groups exist only while
``fpar.plan`` simulates one of its devices.  The simulation is torch's own fake process group
(``init_process_group("fake")``: every collective returns at once, sending nothing) with this
device's rank, and every tensor on the ``meta`` device.  So the user's step runs through fpar's
real-mesh engine unchanged (plans, implicit pvaries, gradient buckets, ZeRO, the pipeline
executor), on the blocks one device would hold, and counts what it would send
(``fpar.comm_stats``), with no memory and no peers.

Outside a simulation an abstract mesh answers what needs no peers: its shape, and device 0's
coordinates (``fpar.device_put`` and ``fpar.init`` give meta blocks of the right shapes, which
are the same on every device).  Anything that would communicate raises.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from .._dist import groups
from .._dist import shard as _dist_shard
from .._mesh import Mesh, _check_names
from ._repeat import kept_microbatches

__all__ = ["abstract_mesh"]

_MAX_DEVICES = 1 << 20


def abstract_mesh(shape: Sequence[int], names: Sequence[str]) -> Mesh:
    """A mesh of any size that exists only on paper: no processes, no memory.

    ``fpar.shard``, ``fpar.ops``, ``fpar.optim`` (ZeRO 1/2/3, accumulation, remat) and
    ``fpar.pipeline`` accept it as they accept a real mesh; ``fpar.device_put`` and ``fpar.init``
    on it give each device's block as a ``meta`` tensor.  Run a step over it with
    :func:`fpar.plan.estimate`.

    Args:
      shape: the size of every axis, in mesh order (the last axes are the ones inside a node).
      names: a distinct name per axis.

    Raises:
      ValueError: sizes not positive integers, names not distinct, or lengths that differ.

    Example:
      >>> mesh = fpar.plan.abstract_mesh((4, 32, 8), ("pipe", "data", "tensor"))
      >>> mesh.size
      1024
    """
    _check_names(shape, names)
    for n, s in zip(names, shape):
        if isinstance(s, bool) or not isinstance(s, int) or s <= 0:
            raise ValueError(
                f"fpar.plan.abstract_mesh: axis {n!r} has size {s!r}; sizes must be positive integers."
            )
    if math.prod(shape) > _MAX_DEVICES:
        raise ValueError(
            f"fpar.plan.abstract_mesh: {math.prod(shape)} devices; at most {_MAX_DEVICES} are supported."
        )
    mesh = Mesh(shape, names, backend="dist")
    mesh.abstract = True
    mesh._dist = PaperGroups(mesh, None)
    return mesh


_OUTSIDE = (
    "{mesh} exists only on paper (fpar.plan.abstract_mesh): it has no processes to send to. "
    "Run the step with fpar.plan.estimate(step, *args), which simulates each kind of device; "
    "use fpar.make_mesh under torchrun to run it for real."
)


class PaperGroups:
    """``mesh._dist`` of an abstract mesh: the simulated device's ``MeshGroups`` while one runs."""

    def __init__(self, root: Mesh, names: tuple[str, ...] | None):
        self._root, self._names = root, names

    def _real(self) -> groups.MeshGroups:
        sim = groups.SIMULATION[0]
        if sim is None:
            raise RuntimeError(_OUTSIDE.format(mesh=self._root))
        return sim.groups_for(self._root, self._names)

    @property
    def coords(self) -> dict[str, int]:
        sim = groups.SIMULATION[0]
        if sim is None:  # device 0: every device's blocks have the same shapes
            return {a: 0 for a in self._root.axis_names}
        return self._real().coords

    @property
    def rank(self) -> int:
        sim = groups.SIMULATION[0]
        return 0 if sim is None else self._real().rank

    def view(self, names: tuple[str, ...]) -> PaperGroups:
        return PaperGroups(self._root, tuple(names))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self._real(), name)


class Simulation:
    """One device of an abstract mesh, simulated: a fake process group with its rank.

    ``coords``: the device's coordinate on the axes it names (others 0).  While it is entered,
    ``fpar._dist.groups.SIMULATION`` holds it, so the real-mesh engine makes meta buffers and
    skips the checks that compare ranks (every rank here runs this very program).
    """

    def __init__(self, coords: dict[str, int] | None = None):
        self.coords = dict(coords or {})
        self.root: Mesh | None = None
        self.real: dict[Any, groups.MeshGroups] = {}
        self.headers: dict[tuple, tuple] = {}  # (stage, chunk) -> (shape, dtype) it receives
        self.sent: dict[int, tuple] = {}  # chunk -> (shape, dtype) this device's chunk sends on
        self.pipeline_axes: set[str] = set()
        self.schedules: list = []  # (schedule, axis) of every pipeline step run
        self.recorder = None  # the _record.Recorder of the run, for the pipeline's action marks
        self.hardware = None  # checked against the mesh when it starts
        self.repeated: list = []  # (schedule, stage, microbatches simulated) of each pipeline run
        self.planning = False  # a run that only plans the step's calls: measured by the next one
        self.watch: int | None = None  # fpar._dist.shard.PLANNED when a run that may measure began

    # -- what the pipeline executor tells the simulation (fpar/pipeline/_run_dist.py) ---------------

    def pipeline(self, schedule, axis: str) -> None:
        """A pipeline step runs over ``axis``: each of its stages is a device class of its own."""
        self.pipeline_axes.add(axis)
        if all(s is not schedule for s, _ in self.schedules):
            self.schedules.append((schedule, axis))

    def mark(self, action) -> None:
        """The ops from here on belong to ``action`` (None: to no action)."""
        if self.recorder is not None:
            self.recorder.mark = action

    def kept(self, schedule, stage: int, every: bool = False):
        """The microbatches this stage simulates (None: all); the others repeat a steady one's events.

        ``every``: a measured run simulates every microbatch (a step whose buffers outlive an
        action, as ``zero_pipeline(..., reduce_once=False)``'s reductions in flight until the next
        backward: a steady microbatch's events would not stand for the others').
        """
        if self.planning:
            return _planning(schedule)
        if every:
            return None
        keep = kept_microbatches(schedule, stage)
        if keep is not None:
            self.repeated.append((schedule, stage, keep))
        return keep

    def narrowed(self, schedule, keep, begun: set):
        """``keep`` from this tick on: fewer microbatches once this run has planned a call.

        A run that plans is run again to be measured (``fpar.plan.estimate``), so the rest of
        it only has to plan: a microbatch that has not begun is skipped unless it is one that
        plans (``_planning``); one that has begun runs to its end (its forward's deferred
        gradients wait for its backward).
        """
        if self.watch is None or self.planning or _dist_shard.PLANNED[0] == self.watch:
            return keep
        self.planning = True
        fewest = _planning(schedule)
        return None if fewest is None else fewest | begun

    def held(self, sends: list) -> list:
        """Sends of microbatches not simulated: their buffers, held until the next tick waits for them."""
        out = []
        for sent in sends:
            if sent is None:
                continue
            shape, dtype, kind = sent
            t = torch.empty(shape, dtype=dtype, device="meta")
            if self.recorder is not None:
                self.recorder._retag(t, kind)
            out.append((groups._Done(), t))
        return out

    def collective(self, tensors: tuple, async_op: bool):
        """A collective of the real-mesh engine on paper: nothing sent, its buffers accounted."""
        if self.recorder is not None:
            self.recorder.collective(tensors)
        return groups._Done() if async_op else None

    def origins(self, actions: list) -> None:
        """The sends and receives counted next belong to ``actions``, in order."""
        if self.recorder is not None:
            self.recorder.origins = list(actions)

    def header(self, key: tuple) -> tuple:
        """The (shape, dtype) stage ``key[0]``'s chunk ``key[1]`` receives, sent by a stage simulated before."""
        got = self.headers.get(key)
        if got is None and key[1] > 0:
            # interleaved: chunk c receives from the last stage's chunk c - 1, which runs the same
            # stage function on the same shapes as this stage's chunk c - 1 (whose send is known)
            got = self.sent.get(key[1] - 1)
        if got is None:
            raise Upstream(key)
        return got

    def __enter__(self) -> Simulation:
        if groups.SIMULATION[0] is not None:
            raise RuntimeError("fpar.plan: a simulation is already running (estimate does not nest).")
        if dist.is_available() and dist.is_initialized():
            raise RuntimeError(
                "fpar.plan.estimate runs in a process without torch.distributed (it simulates the "
                "devices with a fake process group of its own); call it before init_process_group "
                "or in a separate process."
            )
        groups.SIMULATION[0] = self
        self._excepthook = sys.excepthook  # init_process_group prefixes tracebacks with the rank
        return self

    def __exit__(self, *exc) -> None:
        groups.SIMULATION[0] = None
        for mg in self.real.values():
            groups._LIVE.discard(mg)
        self.real.clear()
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.excepthook = self._excepthook

    def groups_for(self, root: Mesh, names: tuple[str, ...] | None) -> groups.MeshGroups:
        if self.root is None:
            self._start(root)
        elif root is not self.root and (root.axis_names, root.axis_sizes) != (
            self.root.axis_names,
            self.root.axis_sizes,
        ):
            raise ValueError(
                f"fpar.plan: one step uses two abstract meshes, {self.root} and {root}; a step "
                f"runs on one mesh (and its submeshes)."
            )
        key = names
        if key not in self.real:
            base = self.real[None]
            self.real[key] = base if names is None else base.view(names)
        return self.real[key]

    def _start(self, root: Mesh) -> None:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        unknown = set(self.coords) - set(root.axis_names)
        if unknown:
            raise ValueError(f"fpar.plan: coordinates {self.coords} name axes not in {root}.")
        hw = self.hardware
        if hw is not None and hw.nodes is not None and root.size > hw.nodes * hw.devices_per_node:
            raise ValueError(
                f"fpar.plan.estimate: {root} has {root.size} devices, but hardware {hw.name!r} has "
                f"{hw.nodes} node(s) of {hw.devices_per_node} devices ({hw.nodes * hw.devices_per_node} "
                f"in all); use a smaller mesh or a Hardware with more nodes."
            )
        self.root = root
        if hw is not None and hw.timed_ops:  # time the ops with the threads the job's processes get
            from ._optime import timer

            timer().threads = hw.threads or (1 if root.size > 1 else None)
        coords = [self.coords.get(a, 0) for a in root.axis_names]
        dist.init_process_group(
            "fake", store=FakeStore(), rank=groups._ravel(coords, root.axis_sizes), world_size=root.size
        )
        self.real[None] = groups.MeshGroups(root)


def _planning(schedule):
    """The microbatches a run that only plans runs (None: all of them).

    Every microbatch runs the same calls: the first two and the last plan them (the last one's
    backward reduces the gradients).
    """
    return None if schedule.m <= 3 else frozenset((0, 1, schedule.m - 1))


class Upstream(Exception):
    """A pipeline stage's simulation needs the shape a stage not yet simulated sends it."""


groups.ON_PAPER[0] = lambda: Simulation({})
