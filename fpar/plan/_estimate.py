"""``fpar.plan.estimate``: run the user's own step on a mesh on paper, one device per class."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import math
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from .. import _stats
from .._dist import shard as _dist_shard
from ..pipeline._stage import last_stage
from ..pipeline._timeline import replay
from . import _cost, _optime, _repeat
from ._hardware import Hardware
from ._hardware import hardware as _hardware
from ._paper import Simulation, Upstream
from ._record import Recorder

__all__ = ["DeviceClass", "Estimate", "PlanError", "estimate"]

Tensor = torch.Tensor

# What the estimate cannot see, with the margin a user should keep for it.
LIMITS = (
    "allocator caching and fragmentation: PyTorch's caching allocator reserves more than is live "
    "(typically 5-15% on a long run; set expandable_segments to keep it low)",
    "NCCL's own buffers and the CUDA context: about 0.5-1.5 GB per GPU outside PyTorch's count",
    "kernel-level effects beyond a GEMM's tile and wave quantization and fused attention's one "
    "efficiency: other kernels are costed by their FLOPs and bytes at peak",
    "network contention between jobs and NCCL's other algorithms (NVLS, CollNet)",
)


class PlanError(ValueError):
    """A step that cannot be planned (it reads values, or uses no abstract mesh)."""


@dataclasses.dataclass
class DeviceClass:
    """Devices that hold the same shapes (e.g. one pipeline stage): one simulated for all.

    Attributes:
      coords: a mesh coordinate of one device of the class (axes not named are 0).
      count: how many devices are in the class.
      peak_bytes: the most bytes alive at once on such a device during the step.
      breakdown: bytes at that peak by kind: ``params``, ``grads``, ``optimizer``,
        ``activations``, ``comm_buffers``, ``other``.
      comm: bytes sent per device per step, as ``fpar.comm_stats()``.
      flops: FLOPs one such device runs per step (recomputation included).
      step_time: predicted seconds of its step, with ``time_breakdown`` (``compute``,
        ``exposed_comm``, ``bubble``).
      state_bytes: bytes of the step's arguments each such device holds, by kind: ``params``
        (floating tensors outside optimizer state), ``optimizer`` (fpar.optim states), ``other``.
      saved_activations: bytes the forward left alive for the backward, when the backward began
        (what activation-memory formulas count; for a pipeline, at the first backward).
    """

    coords: dict
    count: int
    peak_bytes: int
    breakdown: dict
    comm: dict
    flops: float
    step_time: float = 0.0
    time_breakdown: dict = dataclasses.field(default_factory=dict)
    unknown_ops: dict = dataclasses.field(default_factory=dict)
    state_bytes: dict = dataclasses.field(default_factory=dict)
    saved_activations: int = 0
    _timing: Any = None
    _replay: Any = None  # CPU pipelines: (events, inter-node axes) to time again with a new core share
    _events: Any = None  # (events, each message axes' group ranks): what ``retime`` costs again


@dataclasses.dataclass
class Estimate:
    """What each device of a mesh on paper would hold and send, and how long its step would take.

    Attributes:
      peak_bytes: the largest per-device peak over the device classes.
      devices: one ``DeviceClass`` per class of devices holding the same shapes.
      comm: bytes per device per step in ``fpar.comm_stats()``'s structure, for the class that
        sends the most (each class's own is ``devices[i].comm``).
      step_time: predicted seconds per step (the slowest class), split in ``time_breakdown``
        (``compute``, ``exposed_comm``, ``bubble``).
      mfu: model FLOPs per second over the devices' peak (recomputation not counted: the MFU
        papers publish); ``hfu`` counts every FLOP executed.  ``flops``, ``model_flops``: per step,
        over every device.
      losses: where the step's time goes besides the model's FLOPs at peak, as fractions of the
        step (``mfu`` plus these is 1): ``matmul_efficiency`` (matmuls slower than peak),
        ``recompute`` (the recomputed forwards), ``optimizer``, ``exposed_comm:<axes>`` per
        message axes, ``bubble``, ``other`` (the other ops, and devices waiting for slower ones).
      hardware: the ``Hardware`` used; ``mesh``: the mesh simulated.
      assumptions: every assumption of the estimate, printed with it; ``limits``: what it cannot
        see; ``not_costed``: ops it had no FLOP formula for (costed by their bytes).
    """

    mesh: Any
    hardware: Hardware
    devices: list
    peak_bytes: int
    comm: dict
    step_time: float
    time_breakdown: dict
    mfu: float
    assumptions: list
    limits: tuple = LIMITS
    not_costed: dict = dataclasses.field(default_factory=dict)
    hfu: float = 0.0
    flops: float = 0.0
    model_flops: float = 0.0
    losses: dict = dataclasses.field(default_factory=dict)
    _schedules: Any = None  # (pipeline schedules, pipeline axis or None): for ``retime``

    @property
    def fits(self) -> bool:
        """Whether every device's peak fits the hardware's memory."""
        return self.peak_bytes <= self.hardware.memory_bytes

    def __str__(self) -> str:
        from ._report import table

        return table(self)

    def plot(self, path: str) -> str:
        """Draw memory per device class (stacked by kind) and the step's time split; save to ``path``."""
        from ._report import plot

        return plot(self, path)


def estimate(fn: Callable, *args: Any, hardware: str | Hardware = "h100-sxm", **kwargs: Any) -> Estimate:
    """Run ``fn(*args, **kwargs)`` on a mesh on paper; report each device's memory, traffic, time.

    ``fn`` is the user's own step (the forward, the backward, the optimizer update), built on an
    ``fpar.plan.abstract_mesh`` exactly as it is built on a real mesh, and called with what it is
    called with there: each device's blocks, from ``fpar.device_put`` / ``fpar.init`` /
    ``fpar.optim.zero_init`` on the abstract mesh (meta tensors: no memory), or real tensors
    (turned into meta ones).  Each class of devices that hold the same shapes (every device, or
    each pipeline stage) is simulated once: the step runs twice (the first call plans, as on a
    real mesh; the second is measured) on a fake process group with that device's rank.

    Args:
      fn: the step.
      *args: its positional arguments.
      **kwargs: its keyword arguments.
      hardware: a preset name (``"h100-sxm"``, ``"a100-80g"``, ``"b200"``), ``"this"`` (measured
        here), or a ``fpar.plan.Hardware``.

    Returns:
      An ``Estimate``; ``print(est)`` shows its table, assumptions and limits.

    Raises:
      ValueError: an unknown hardware, or a mesh larger than the hardware's nodes hold.
      PlanError: the step reads a tensor's value (``.item()``, ``bool(t)``, printing): values do
        not exist on paper; or it runs nothing on an abstract mesh.
    """
    if not callable(fn):
        raise TypeError(f"fpar.plan.estimate: fn must be callable, got {fn!r}.")
    hw = _hardware(hardware, estimate=estimate)
    args, kwargs = _on_meta((args, kwargs))
    known = _categories((args, kwargs))
    shapes = _update_kinds((args, kwargs))
    saved = _stats.comm_stats()
    threshold = gc.get_threshold()
    # A simulation makes a few hundred thousand small objects (its events); at Python's default
    # threshold the young collections that walk them cost a tenth of an estimate.  Fewer of them
    # change no result: the meta storages are freed by their reference counts, as they are made.
    gc.set_threshold(max(threshold[0], 50_000), *threshold[1:])
    try:
        return _estimate(fn, args, kwargs, hw, known, shapes)
    finally:
        gc.set_threshold(*threshold)
        _stats.reset_comm_stats()
        _restore(saved)


def _estimate(fn, args, kwargs, hw, known, shapes) -> Estimate:
    untimed = Counter(_optime.timer().untimed) if hw.timed_ops else None
    mesh, sim, cls0 = _simulate(fn, args, kwargs, hw, known, shapes, {}, first=True)
    classes = [cls0]
    if sim.pipeline_axes:
        if len(sim.pipeline_axes) > 1:
            raise PlanError(f"fpar.plan.estimate: pipelines over several axes {sorted(sim.pipeline_axes)}.")
        axis = next(iter(sim.pipeline_axes))
        p = mesh.shape[axis]
        cls0.coords[axis] = 0
        headers = dict(sim.headers)
        todo = list(range(1, p))
        classes = [cls0]
        # the stage holding the loss plans its calls (the head's) in its first run: only plans
        heads = {last_stage(schedule) for schedule, on in sim.schedules if on == axis}
        for _ in range(p + 1):  # stages whose upstream was not simulated yet go again
            waiting = []
            for s in todo:
                try:
                    _, got_sim, cls = _simulate(
                        fn, args, kwargs, hw, known, shapes, {axis: s}, headers, first=s in heads
                    )
                except Upstream:
                    waiting.append(s)
                    continue
                headers.update(got_sim.headers)
                classes.append(cls)
            todo = waiting
            if not todo:
                break
        if todo:
            raise PlanError(f"fpar.plan.estimate: stages {todo} receive shapes no simulated stage sends.")
        classes.sort(key=lambda c: c.coords[axis])
        for c in classes:
            c.count = mesh.size // p
    else:
        axis = None
        cls0.count = mesh.size
    return _finish(mesh, classes, hw, sim.schedules, axis, untimed)


def _finish(mesh, classes: list, hw: Hardware, schedules: list, axis, untimed=None) -> Estimate:
    """The estimate from each class's timed events: the pipeline's replay, MFU, the losses."""
    if axis is not None:
        _pipeline_times(classes, schedules, axis)
        if hw.cores:
            _share_idle_cores(classes, schedules, axis, hw, mesh)
    worst = max(classes, key=lambda c: c.step_time)
    flops = sum(c.flops * c.count for c in classes)
    model_flops = flops - sum(c._timing.recompute_flops * c.count for c in classes)
    dtype = _main_dtype(classes)
    ideal = worst.step_time * hw.peak(dtype) * mesh.size
    mfu = model_flops / ideal if worst.step_time > 0 else 0.0
    busiest = max(classes, key=lambda c: _total_bytes(c.comm))
    not_costed: dict = {}
    for c in classes:
        for k, v in c.unknown_ops.items():
            not_costed[k] = not_costed.get(k, 0) + v
    est = Estimate(
        mesh=mesh,
        hardware=hw,
        devices=classes,
        peak_bytes=max(c.peak_bytes for c in classes),
        comm=busiest.comm,
        step_time=worst.step_time,
        time_breakdown=dict(worst.time_breakdown),
        mfu=mfu,
        hfu=flops / ideal if worst.step_time > 0 else 0.0,
        flops=flops,
        model_flops=model_flops,
        losses=_losses(worst, mfu),
        assumptions=_assumptions(
            hw, mesh, dtype, _optime.timer().untimed - untimed if untimed is not None else None
        ),
        not_costed=not_costed,
    )
    est._schedules = (schedules, axis)
    return est


def retime(est: Estimate, hardware: str | Hardware) -> Estimate:
    """``est`` timed again on other hardware from its recorded ops and messages (no new simulation).

    Memory and traffic do not depend on the hardware; the step time, MFU and losses do.  Not for
    ``"this"``: its ops' kernels are timed when the step runs.
    """
    hw = _hardware(hardware)
    if hw.timed_ops or est.hardware.timed_ops:
        raise ValueError("fpar.plan: retime takes datasheet hardware; estimate again for hardware 'this'.")
    share = _core_share(hw, est.mesh)
    classes = []
    for c in est.devices:
        events, groups = c._events
        inter = _spans(groups, hw)
        timing = _cost.time_events(events, hw, inter, share, _link_share(hw, share))
        classes.append(
            dataclasses.replace(
                c,
                step_time=timing.total,
                time_breakdown={
                    "compute": timing.compute,
                    "exposed_comm": timing.total - timing.compute,
                    "bubble": 0.0,
                },
                flops=timing.flops,
                _timing=timing,
                _replay=(events, inter) if hw.cores and est._schedules[1] is not None else None,
            )
        )
    schedules, axis = est._schedules
    return _finish(est.mesh, classes, hw, schedules, axis)


def _losses(c: DeviceClass, mfu: float) -> dict:
    """Fractions of the slowest class's step that are not the model's FLOPs at peak, by cause."""
    t, total = c._timing, c.step_time
    if total <= 0:
        return {}
    out = {
        "matmul_efficiency": (t.matmul - t.matmul_at_peak) / total,
        "recompute": t.recompute / total,
        "optimizer": t.update / total,
    }
    exposed = c.time_breakdown.get("exposed_comm", 0.0)
    charged = sum(t.exposed.values())
    for axes, sec in sorted(t.exposed.items()):  # the class's exposed time, split as its messages were
        out[f"exposed_comm:{axes}"] = exposed * sec / charged / total if charged else 0.0
    out["bubble"] = c.time_breakdown.get("bubble", 0.0) / total
    out["other"] = 1.0 - mfu - sum(out.values())
    return out


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic collector paused while a step is simulated, scanning only what it made.

    A simulated step makes a few hundred thousand tracked objects (each op's event, its autograd
    nodes) beside as many kept from before (the device classes simulated earlier), and full
    collections rescanned them all: 6-8 % of an estimate.  Here the objects made before are
    frozen (``gc.freeze``), the collector does not run by itself, and what the step leaves in
    cycles is collected after the planning run (``_simulate``) and at the end; reference
    counting frees the tensors as in a real step.  Left as it is when something froze objects
    already (``fpar.launch``'s processes): unfreezing would thaw theirs.
    """
    was = gc.isenabled()
    frozen = gc.get_freeze_count() == 0
    if frozen:
        gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        if frozen:
            gc.collect()
            gc.unfreeze()
        if was:
            gc.enable()


def _simulate(fn, args, kwargs, hw, known, shapes, coords, headers=None, *, first=False):
    sim = Simulation(coords)
    sim.hardware = hw
    if headers:
        sim.headers.update(headers)
    rec = Recorder(known, _optime.timer() if hw.timed_ops else None)
    rec.update_kinds = shapes
    sim.recorder = rec
    with sim, _collector_paused():
        with rec:
            # The first call of a signature plans it (a traced call); the step is measured once
            # every call in it is planned: the second run, or the first if it planned nothing
            # (a pipeline stage whose functions an earlier stage's simulation planned).  With
            # ``first`` (the first stage, the loss's) the first run only plans, so a pipeline runs
            # the fewest microbatches in it (``Simulation.kept``); another stage's run narrows to
            # them once it plans a call (``Simulation.narrowed``); should the next run still plan
            # something, a third measures.
            for run in range(3):
                planned = _dist_shard.PLANNED[0]
                sim.planning = first and run == 0
                sim.watch = None if sim.planning or run == 2 else planned  # the last run runs all
                rec.start()
                sim.repeated.clear()
                _stats.reset_comm_stats()
                out = _call(fn, args, kwargs)
                del out
                if (_dist_shard.PLANNED[0] == planned and (run > 0 or not first)) or run == 2:
                    break  # measured (what is left of it is freed as it goes: no collection)
                gc.collect()  # the planning run's cycles, before the measured run counts what lives
        for schedule, stage, keep in sim.repeated:  # the microbatches not simulated repeat a steady one
            for c in _repeat.expand(rec.events, schedule, stage, keep):
                _stats._add(c.kind, c.axes, c.nbytes, overlap=c.overlap, n=c.n)
        comm = _stats.comm_stats()
        mesh = sim.root
        if mesh is None:
            raise PlanError(
                "fpar.plan.estimate: the step ran nothing on an abstract mesh (no fpar.shard, "
                "pipeline or ZeRO call over one); build it over fpar.plan.abstract_mesh(...)."
            )
        groups = _groups(mesh, rec.events, sim.real[None])
        inter = _spans(groups, hw)
    share = _core_share(hw, mesh)
    timing = _cost.time_events(rec.events, hw, inter, share, _link_share(hw, share))
    cls = DeviceClass(
        coords={a: c for a, c in coords.items()},
        count=0,
        peak_bytes=rec.peak,
        breakdown=rec.breakdown(),
        comm=comm,
        flops=timing.flops,
        step_time=timing.total,
        time_breakdown={
            "compute": timing.compute,
            "exposed_comm": timing.total - timing.compute,
            "bubble": 0.0,
        },
        unknown_ops=dict(rec.unknown_ops),
        state_bytes=_state_bytes((args, kwargs), known),
        saved_activations=rec.at_backward.get("activations", 0),
        _timing=timing,
        _replay=(rec.events, inter) if hw.cores and sim.pipeline_axes else None,
        _events=(rec.events, groups),
    )
    return mesh, sim, cls


def _call(fn, args, kwargs):
    """The step, with Dynamo disabled once around it, not around every op (``Recorder._should_skip_dynamo``).

    Dynamo compiles no frame under a dispatch mode (the recorder) anyway: a compiled function in the
    step ran eagerly before this too.  (Dynamo is imported here, at the first estimate, as torch's
    own wrapping of a mode's op handler did at its first op.)
    """
    return _eager_step()(fn, args, kwargs)


@functools.cache
def _eager_step() -> Callable:
    return torch.compiler.disable(_call_step)


def _call_step(fn, args, kwargs):
    try:
        return fn(*args, **kwargs)
    except Upstream:
        raise
    except (RuntimeError, NotImplementedError) as e:
        text = str(e)
        if (
            "_local_scalar_dense" in text
            or "meta" in text
            and ("item" in text or "data" in text or "copy" in text)
        ):
            raise PlanError(
                "fpar.plan.estimate: the step reads a tensor's value (.item(), .tolist(), bool(t), "
                "printing, or control flow on a tensor); a step on paper has shapes but no values, "
                "so data-dependent control flow cannot be planned. Move the read out of the step "
                f"(log the loss outside it), or make the branch depend on shapes. ({text.splitlines()[0]})"
            ) from e
        raise


def _pipeline_times(classes: list, schedules: list, axis: str) -> None:
    """Each stage's step: the schedule replayed with every action's simulated seconds."""
    durations: dict = {}
    for c in classes:
        durations.update(c._timing.by_mark)
    for schedule, sch_axis in schedules:
        if sch_axis != axis:
            continue
        starts = replay(schedule, lambda a: durations.get(a, 0.0))
        makespan = max((t + durations.get(a, 0.0) for a, t in starts.items()), default=0.0)
        for c in classes:
            t = c._timing
            busy = sum(v for a, v in t.by_mark.items() if a.stage == c.coords[axis])
            c.step_time = makespan + t.unmarked
            c.time_breakdown = {
                "compute": t.compute,
                "exposed_comm": max(c.step_time - t.compute - (makespan - busy), 0.0),
                "bubble": makespan - busy,
            }


def _share_idle_cores(classes: list, schedules: list, axis: str, hw: Hardware, mesh) -> None:
    """CPU pipelines: a stage idle in the bubble leaves its cores to the busy ones.

    The devices of a node share its cores (``Hardware.cores``) only while they compute, so each
    device's share is the cores over the devices busy on average (a processor-sharing
    approximation): time the stages again with that share until it settles.
    """
    per_node = min(mesh.size, hw.devices_per_node)
    for _ in range(4):
        busy = sum((1.0 - c.time_breakdown["bubble"] / c.step_time) if c.step_time else 1.0 for c in classes)
        share = min(1.0, hw.cores / (per_node * busy / len(classes)))
        for c in classes:
            events, inter = c._replay
            c._timing = _cost.time_events(events, hw, inter, share, _link_share(hw, share))
        _pipeline_times(classes, schedules, axis)
    for c in classes:
        c._replay = None


def _groups(mesh, events, mg) -> dict[tuple, tuple]:
    """Per message axes tuple: the ranks of this device's group."""
    out = {}
    for e in events:
        if hasattr(e, "axes") and e.axes not in out:
            axes = tuple(a for a in e.axes if a in mesh.shape)
            out[e.axes] = tuple(mg.members(axes)) if axes else (mg.rank,)
    return out


def _spans(groups: dict, hw: Hardware) -> dict[tuple, tuple[int, int]]:
    """Per message axes: how its group lies on ``hw``'s nodes, (nodes, most members on one node)."""
    out = {}
    for axes, members in groups.items():
        per = Counter(r // hw.devices_per_node for r in members)
        out[axes] = (len(per), max(per.values()))
    return out


def _core_share(hw: Hardware, mesh) -> float:
    """The fraction of a core each device (process) gets on CPU hardware; 1 elsewhere."""
    if not hw.cores:
        return 1.0
    per_node = min(mesh.size, hw.devices_per_node)
    return min(1.0, hw.cores / per_node)


def _link_share(hw: Hardware, share: float) -> float:
    """CPU: the speed of messages against when α and β were measured (devices per core then and now)."""
    if not (hw.cores and hw.link_devices):
        return 1.0
    return min(1.0, share / min(1.0, hw.cores / hw.link_devices))


def _main_dtype(classes) -> torch.dtype:
    """The dtype most of the step's FLOPs run in (MFU is against its peak)."""
    counts: dict = {}
    for c in classes:
        for dtype, f in c._timing.flops_by_dtype.items():
            counts[dtype] = counts.get(dtype, 0.0) + f * c.count
    return max(counts, key=counts.get) if counts else torch.float32


def _total_bytes(comm: dict) -> int:
    return sum(v["bytes"] for kinds in comm.values() for v in kinds.values())


def _assumptions(hw: Hardware, mesh, dtype, untimed: Counter | None = None) -> list[str]:
    nodes = math.ceil(mesh.size / hw.devices_per_node)
    lines = hw.describe()
    if untimed:
        lines.append(
            "  op calls costed by the roofline, not timed here (too large for this machine, or failed on its "
            "CPU): " + ", ".join(f"{k} x{v}" for k, v in untimed.most_common())
        )
    lines += [
        f"mesh {mesh}: row-major ranks, {min(mesh.size, hw.devices_per_node)} devices per node, "
        f"{nodes} node(s); an axis group inside one node uses the node's links, else the network's",
        "collectives inside a node are rings: all-reduce 2(n-1) steps, all-gather/reduce-scatter/all-to-all "
        "n-1; time = steps x alpha + bytes / beta (bytes as fpar.comm_stats counts them); a group over "
        "nodes crosses them on its members' NICs (g per node: min(NVLink, g x NIC)), NCCL's tree latency",
        "compute and messages on two streams: blocking collectives wait, gradient buckets and "
        "ZeRO's reduce-scatters overlap the compute that follows, ZeRO-3's gathers are prefetched one ahead"
        if not hw.cores
        else "on a CPU nothing overlaps: every message's copies, sums and TCP stack use the cores the compute needs",
        "an op takes max(FLOPs / (peak x efficiency), bytes / memory bandwidth) + per-op overhead; "
        "FLOPs as executed (recomputation included), from torch.utils.flop_counter",
        f"MFU against {str(dtype).replace('torch.', '')} peak, model FLOPs only (a recomputed forward "
        "counts in HFU, not in MFU)",
        "memory: live tensor bytes over the measured (second) step, storages counted once; what "
        "the step touched that existed before it (parameters, optimizer state, kept buffers) counts "
        "for the whole step",
    ]
    return lines


# -- arguments ------------------------------------------------------------------------------------


def _on_meta(tree: Any) -> Any:
    """Real tensors as meta tensors of the same shape, dtype and requires_grad (values unused)."""

    def meta(t):
        if isinstance(t, Tensor) and t.device.type != "meta":
            m = torch.empty(t.shape, dtype=t.dtype, device="meta")
            return m.requires_grad_(t.requires_grad) if t.is_leaf or not t.requires_grad else m
        return t

    return _map(meta, tree)


def _map(fn, tree):
    if isinstance(tree, Tensor):
        return fn(tree)
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(_map(fn, x) for x in tree))
    if isinstance(tree, (tuple, list)):
        return type(tree)(_map(fn, x) for x in tree)
    if isinstance(tree, dict):
        return type(tree)((k, _map(fn, v)) for k, v in tree.items())
    return tree


def _walk(tree, inside_optim: bool = False):
    """(tensor, is optimizer state) for every tensor of ``tree``."""
    if isinstance(tree, Tensor):
        yield tree, inside_optim
        return
    optim = inside_optim or type(tree).__module__.startswith("fpar.optim")
    if isinstance(tree, (tuple, list)):
        for x in tree:
            yield from _walk(x, optim)
    elif isinstance(tree, dict):
        for x in tree.values():
            yield from _walk(x, optim)


def _categories(tree) -> dict[int, str]:
    out = {}
    for t, optim in _walk(tree):
        kind = "optimizer" if optim else "params" if t.is_floating_point() else "other"
        out[t.untyped_storage()._cdata] = kind
    return out


def _state_bytes(tree, known: dict[int, str]) -> dict[str, int]:
    """Bytes of the arguments' storages (each counted once) by kind."""
    out = {"params": 0, "optimizer": 0, "other": 0}
    seen = set()
    for t, _ in _walk(tree):
        st = t.untyped_storage()
        if st._cdata not in seen:
            seen.add(st._cdata)
            out[known.get(st._cdata, "other")] += st.nbytes()
    return out


def _update_kinds(tree) -> dict[tuple, str]:
    out = {}
    for t, optim in _walk(tree):
        if t.is_floating_point():
            out.setdefault((tuple(t.shape), t.dtype), "optimizer" if optim else "params")
    return out


def _restore(saved: dict) -> None:
    with _stats._LOCK:
        _stats._STATS.clear()
        for axes, kinds in saved.items():
            for kind, v in kinds.items():
                _stats._STATS[axes][kind].update(v)
