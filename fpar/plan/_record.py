"""What one simulated device does in a step: live bytes over time, and every op and message.

A ``TorchDispatchMode`` sees every op the step runs on this device (forward, the autograd
engine's backward, the optimizer), on meta tensors.  Memory is the bytes of the storages alive
at each moment: a storage counts from the op that makes it until Python and autograd let go of
it (a weak reference's callback); one that existed before the step and that the step touches
(parameters, optimizer state, buffers fpar keeps between calls) counts for the whole step.
Views share their base's storage and count once.  Each op's FLOPs come from torch's own
``flop_counter`` formulas; its bytes are what it reads and writes.  Messages arrive from
``fpar.comm_stats``' listener with their bytes, axes and whether they overlap compute.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from .. import _stats
from ..optim import _remat

__all__ = ["Comm", "Op", "Recorder"]

Tensor = torch.Tensor
_RESIZE = torch.ops.inductor.resize_storage_bytes_.default
CATEGORIES = ("params", "grads", "optimizer", "activations", "comm_buffers", "other")
_VIEWS_FREE = {
    "aten.view",
    "aten._unsafe_view",
    "aten.alias",
    "aten.detach",
    "aten.t",
    "aten.expand",
    "aten.permute",
    "aten.transpose",
    "aten.unsqueeze",
    "aten.squeeze",
    "aten.select",
    "aten.slice",
    "aten.as_strided",
    "aten.split",
    "aten.split_with_sizes",
    "aten.unbind",
    "aten.narrow",
    "aten.chunk",
    "aten.reshape",
    "aten.unflatten",
    "aten.flatten",
    "aten.lift_fresh",
    "aten._reshape_alias",
    "aten.view_as",
    "aten.diagonal",
    "aten.movedim",
    "aten.empty",
    "aten.empty_like",
    "aten.empty_strided",
    "aten.new_empty",
    "aten.new_empty_strided",
    "aten.zeros_like",
    "aten.zeros",
    "aten.new_zeros",
    "aten.set_",
    "aten._to_copy",
    "aten.copy_",
    "aten.clone",
    "aten.contiguous",
}
# the last few move bytes but are costed as memory traffic below, not skipped
_MOVES = {
    "aten._to_copy",
    "aten.copy_",
    "aten.clone",
    "aten.contiguous",
    "aten.zeros_like",
    "aten.zeros",
    "aten.new_zeros",
}


@dataclasses.dataclass
class Op:
    """One op on the device: its FLOPs, the bytes it moves, its dtype, and the step's phase."""

    name: str
    flops: float
    nbytes: int
    dtype: torch.dtype
    phase: str  # "forward", "backward" or "update"
    mark: Any = None  # the pipeline action it belongs to (pipelines only)
    seconds: float | None = None  # its kernel timed on this machine (hardware "this"), if it was
    origin: Any = None  # the pipeline action whose work it is (``_repeat``: what it repeats for)
    recompute: bool = False  # run by a backward to recompute a remat body's forward
    # a matmul's (batch, m, k, n): its GEMM shape (the time model's efficiency); ("causal",) for a
    # causal attention kernel, which computes half the s x s scores its FLOPs count
    dims: tuple | None = None


@dataclasses.dataclass
class Comm:
    """One message: the collective, its axes, the bytes this device sends, the axis size."""

    kind: str
    axes: tuple[str, ...]
    nbytes: int
    n: int
    overlap: bool  # issued asynchronously (gradient buckets, ZeRO's prefetch and reduce-scatter)
    phase: str
    mark: Any = None
    origin: Any = None  # the pipeline action it belongs to (a send or receive: its own action)


class Recorder(TorchDispatchMode):
    """Live bytes per category over the step, and the timeline of ops and messages.

    ``known``: the category of storages made before the step (the caller knows which arguments
    are parameters and which optimizer state); others made before count as ``"other"``.
    """

    def __init__(self, known: dict[int, str], timer: Any = None):
        super().__init__()
        self.timer = timer  # an _optime.OpTimer: time each op's kernel here (hardware "this")
        self.known = known  # _cdata of a storage made before -> its category
        self.live: dict[int, tuple[int, str]] = {}  # _cdata -> (bytes, category), made in the step
        self.base: Counter = Counter()  # category -> bytes made before the step and touched by it
        self.base_keys: set[int] = set()
        self.base_info: dict[int, tuple] = {}  # key -> (bytes, category, weak reference)
        self.dyn: Counter = Counter()
        self.total = 0  # bytes of the storages made in the step and alive now
        self.peak_dyn = 0
        self.peak_dyn_by_cat: dict[str, int] = {}
        # (shape, dtype) of parameters and optimizer state: what a tensor made by the update is
        self.update_kinds: dict[tuple, str] = {}
        self.events: list = []
        self.mark: Any = None
        self.origins: list = []  # the actions of the sends and receives about to be counted, in order
        self.backward_done = False
        self._pending: list = []  # events labelled "update" since the last backward (a forward if one follows)
        self._pending_made: list = []  # the storages they made
        self.at_backward: dict = {}  # bytes per category alive at the first backward op (made in the step)
        self.unknown_ops: Counter = Counter()  # ops with FLOPs we have no formula for
        self._refs: dict[int, Any] = {}
        # Meta kernels of elementwise ops run in Python (torch's prims: ~0.3 ms a call); a step
        # repeats the same ops on the same shapes (layers, microbatches), so each op's output
        # layout and FLOPs are computed once per signature of its inputs.
        self._info: dict = {}
        self._cache: dict = {}
        self._single: dict = {}

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Not torch's default (True: every op's __torch_dispatch__ wrapped in torch._dynamo.disable,
        # two eval-frame swaps and three Python frames an op, ~2 % of an estimate): a simulated step
        # runs with Dynamo disabled once around it (_estimate._call).
        return False

    # -- messages -------------------------------------------------------------------------------

    def __enter__(self):
        _stats.LISTENERS.append(self._comm)
        return super().__enter__()

    def __exit__(self, *exc):
        _stats.LISTENERS.remove(self._comm)
        return super().__exit__(*exc)

    def _comm(self, kind: str, axes: tuple, nbytes: int, n: int | None, overlap: bool) -> None:
        origin = self.origins.pop(0) if kind in ("send", "recv") and self.origins else self.mark
        phase = self._phase()
        if phase == "update":
            self._pending.append(len(self.events))
        self.events.append(Comm(kind, axes, nbytes, n or 2, overlap, phase, self.mark, origin))

    # -- ops ------------------------------------------------------------------------------------

    def _phase(self) -> str:
        if torch._C._current_graph_task_id() != -1:
            if not self.backward_done:  # the first backward op: what the forward left for it
                self.at_backward = dict(self.dyn)
            self.backward_done = True
            if self._pending:
                self._forward_after_all()
            return "backward"
        kind = getattr(self.mark, "kind", None)  # a pipeline's action: its own phase (1F1B's steady state)
        if kind is not None:
            return "forward" if kind in ("F", "SEND_F", "RECV_F") else "backward"
        return "update" if self.backward_done else "forward"

    def _forward_after_all(self) -> None:
        """What ran between two backwards was a later microbatch's forward, not the update."""
        for i in self._pending:
            self.events[i].phase = "forward"
        for key in self._pending_made:
            if key in self.live and self.live[key][1] != "comm_buffers":
                nbytes, old = self.live[key]
                self.dyn[old] -= nbytes
                self.dyn["activations"] += nbytes
                self.live[key] = (nbytes, "activations")
        self._pending, self._pending_made = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _RESIZE:  # a storage given or relieved of its bytes (ZeRO-3's lazy gathers)
            func(*args, **kwargs)
            self._resized(args[0])
            return None
        ins = _tensors(args)
        if kwargs:
            ins += _tensors(kwargs)
        for t in ins:
            self._touch(t)
        info = self._info.get(func)
        if info is None:
            info = self._info[func] = _op_info(func)
        name, c10d, cacheable, costed = info
        key = _key(func, args, kwargs) if cacheable else None
        hit = None
        if key is not None:
            try:
                hit = self._cache.get(key)
            except TypeError:  # an argument that cannot be hashed: not cached
                key = None
        if hit is not None:  # the same op on the same shapes: its outputs' shapes and FLOPs are known
            metas, flops = hit
            outs = [torch.empty_strided(sh, st, dtype=dt, device="meta") for sh, st, dt in metas]
            out = outs[0] if self._single[key] else outs
        else:
            out = func(*args, **kwargs)
            outs = _tensors(out) if isinstance(out, (Tensor, list, tuple)) else []
            flops = 0.0
            if costed:
                try:
                    flops = float(flop_registry[func._overloadpacket](*args, **kwargs, out_val=out))
                except Exception:  # noqa: BLE001 - a formula that does not take this call's form
                    self.unknown_ops[name] += 1
            if key is not None and outs and all(t.device.type == "meta" for t in outs) and _fresh(outs, ins):
                self._cache[key] = ([(tuple(t.shape), tuple(t.stride()), t.dtype) for t in outs], flops)
                self._single[key] = isinstance(out, Tensor)
        phase = self._phase()
        for t in outs:
            self._made(t, "comm_buffers" if c10d else _CATEGORY[phase])
            if phase == "update" and (st := _storage(t)) is not None:
                self._pending_made.append(st._cdata)
        if c10d:
            self._sent(ins)
            return out
        nbytes = 0
        if name not in _VIEWS_FREE or name in _MOVES:
            nbytes = sum([t.nbytes for t in outs])
            if name not in ("aten.zeros_like", "aten.zeros", "aten.new_zeros"):
                nbytes += sum([t.nbytes for t in ins])
        dtype = next(
            (t.dtype for t in ins if t.is_floating_point()), outs[0].dtype if outs else torch.float32
        )
        seconds = None
        if self.timer is not None and (name not in _VIEWS_FREE or name in _MOVES):
            sig = key if key is not None or cacheable else _hashable(_key(func, args, kwargs))
            seconds = self.timer.seconds(func, args, kwargs, sig, sum([t.nbytes for t in (*ins, *outs)]))
        # every op: a view or an empty tensor moves nothing, but costs its dispatch on a CPU
        if phase == "update":
            self._pending.append(len(self.events))
        self.events.append(
            Op(
                name,
                flops,
                nbytes,
                dtype,
                phase,
                self.mark,
                seconds,
                self.mark,
                _remat.RECOMPUTING[0] > 0,
                _dims(func, name, args, kwargs) if flops else None,
            )
        )
        return out

    def collective(self, tensors: tuple) -> None:
        """A collective on paper (``Simulation.collective``), accounted as a process group's op.

        ``tensors``: its output first (written in place), then its input: buffers sent, not
        activations, as ``__torch_dispatch__`` counts a ``c10d`` op's arguments.
        """
        for t in tensors:
            self._touch(t)
        if self._phase() == "update":
            self._pending_made.append(tensors[0].untyped_storage()._cdata)
        self._sent(tensors)

    def _sent(self, tensors) -> None:
        for t in tensors:  # a buffer made to be sent (a gradient bucket, a gather's output) ...
            self._retag(t, "comm_buffers", keep="activations")  # ... not an activation also sent

    # -- storages -------------------------------------------------------------------------------

    def _touch(self, t: Tensor) -> None:
        st = _storage(t)
        if st is None or st._cdata in self.live or st._cdata in self.base_keys:
            return
        # made before the step: alive for all of it (an argument, or a buffer kept between calls);
        # if it dies during the step its bytes stay counted, but its address may be reused
        key = st._cdata
        self._base_add(key, st.nbytes(), self.known.get(key, "other"), st)

    def _made(self, t: Tensor, category: str) -> None:
        st = _storage(t)
        if st is None or st._cdata in self.live or st._cdata in self.base_keys:
            return
        if category == "optimizer":  # made by the update: a new parameter, new state, or temporary
            category = self.update_kinds.get((tuple(t.shape), t.dtype), "other")
        self._add(st, category)

    def _retag(self, t: Tensor, category: str, keep: str | None = None) -> None:
        st = _storage(t)
        if st is None or st._cdata not in self.live:
            return
        nbytes, old = self.live[st._cdata]
        if old == keep:  # a forward's value sent (sequence parallelism's all-gathered block) stays one
            return
        self.dyn[old] -= nbytes
        self.dyn[category] += nbytes
        self.live[st._cdata] = (nbytes, category)

    def _add(self, st, category: str) -> None:
        key, nbytes = st._cdata, st.nbytes()
        self.live[key] = (nbytes, category)
        self.dyn[category] += nbytes
        self.total += nbytes
        self._refs[key] = weakref.ref(st, lambda _, key=key: self._free(key))
        if self.total > self.peak_dyn:
            self.peak_dyn = self.total
            self.peak_dyn_by_cat = dict(self.dyn)

    def _resized(self, t: Tensor) -> None:
        st = _storage(t)
        got = self.live.get(st._cdata) if st is not None else None
        if got is None:  # made before the step: counted at its size when first touched
            return
        nbytes, category = got
        delta = st.nbytes() - nbytes
        self.live[st._cdata] = (st.nbytes(), category)
        self.dyn[category] += delta
        self.total += delta
        if self.total > self.peak_dyn:
            self.peak_dyn = self.total
            self.peak_dyn_by_cat = dict(self.dyn)

    def _free(self, key: int) -> None:
        got = self.live.pop(key, None)
        self._refs.pop(key, None)
        if got is not None:
            nbytes, category = got
            self.dyn[category] -= nbytes
            self.total -= nbytes

    def start(self) -> None:
        """Measure from now on: what is alive now (kept between calls) is part of the floor."""
        alive = {k: v for k, v in self.base_info.items() if k in self.base_keys}
        self.base, self.base_keys, self.base_info = Counter(), set(), {}
        for key, (nbytes, category, ref) in alive.items():
            if ref() is not None:
                self._base_add(key, nbytes, category, ref())
        for key, (nbytes, category) in list(self.live.items()):
            ref = self._refs.get(key)
            if ref is not None and ref() is not None:
                self._base_add(key, nbytes, category, ref())
        self.live.clear()
        self.dyn = Counter()
        self.total = self.peak_dyn = 0
        self.peak_dyn_by_cat = {}
        self.events = []
        self.backward_done = False
        self._pending, self._pending_made = [], []
        self.at_backward: dict = {}

    def _base_add(self, key: int, nbytes: int, category: str, st) -> None:
        """A storage made before the measured step: counted for all of it while it lives."""
        self.base_keys.add(key)
        self.base[category] += nbytes
        ref = weakref.ref(st, lambda _, key=key: self.base_keys.discard(key))
        self._refs[key] = ref
        self.base_info[key] = (nbytes, category, ref)

    @property
    def peak(self) -> int:
        """Bytes at the step's peak: everything it touched that was made before, plus its own peak."""
        return sum(self.base.values()) + self.peak_dyn

    def breakdown(self) -> dict[str, int]:
        """Bytes per category at the peak."""
        return {c: self.base.get(c, 0) + self.peak_dyn_by_cat.get(c, 0) for c in CATEGORIES}


_CATEGORY = {"forward": "activations", "backward": "grads", "update": "optimizer"}


def _op_info(func) -> tuple:
    """(name, is a c10d op, its outputs may be cached by input signature, has a FLOP formula)."""
    name = str(func.overloadpacket)
    c10d = name.startswith("c10d.") or name.startswith("_c10d_functional.")
    schema = func._schema
    cacheable = not (
        c10d
        or schema.is_mutable
        or func.is_view
        or any(r.alias_info is not None for r in schema.returns)
        or torch.Tag.nondeterministic_seeded in func.tags
        or torch.Tag.data_dependent_output in func.tags
        or name in ("aten._local_scalar_dense", "aten.item")
    )
    return name, c10d, cacheable, func._overloadpacket in flop_registry


_GEMM_ARGS = {"aten.mm": 0, "aten.bmm": 0, "aten.addmm": 1, "aten.baddbmm": 1}


def _dims(func, name: str, args, kwargs) -> tuple | None:
    """A matmul's ``(batch, m, k, n)``, a causal attention kernel's ``("causal",)``, else None.

    A causal kernel computes half the ``s x s`` scores torch's FLOP formula counts.
    """
    at = _GEMM_ARGS.get(name)
    if at is None:
        for i, arg in enumerate(func._schema.arguments):
            if arg.name == "is_causal":
                causal = kwargs.get("is_causal", args[i] if i < len(args) else arg.default_value)
                return ("causal",) if causal else None
        return None
    a, b = args[at], args[at + 1]
    if a.dim() == 2:
        return (1, a.shape[0], a.shape[1], b.shape[-1])
    return (a.shape[0], a.shape[1], a.shape[2], b.shape[-1])


def _key(func, args, kwargs):
    """A signature of a call: tensors by layout, everything else by value; None if a tensor has none.

    Not hashed here (a tuple's hash is not cached: the lookup hashes it); one that cannot be
    hashed raises ``TypeError`` at the lookup.
    """
    parts = [func]
    try:
        for x in (*args, *kwargs.items()) if kwargs else args:
            if isinstance(x, Tensor):
                parts.append((x.shape, x.stride(), x.dtype, x.device, x.storage_offset()))
            elif isinstance(x, (list, tuple)):
                parts.append(len(x))
                for y in x:
                    if isinstance(y, Tensor):
                        parts.append((y.shape, y.stride(), y.dtype, y.device, y.storage_offset()))
                    elif isinstance(y, (list, tuple)):
                        parts.append(tuple(y))
                    else:
                        parts.append(y)
            else:
                parts.append(x)
    except RuntimeError:  # a tensor without strides (a sparse or nested one)
        return None
    return tuple(parts)


def _hashable(key):
    """``key``, or None where it cannot be hashed."""
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _fresh(outs, ins) -> bool:
    """Whether every output has storage of its own (not one of the inputs')."""
    mine = {t.untyped_storage()._cdata for t in ins if t.device.type == "meta"}
    return all(t.untyped_storage()._cdata not in mine for t in outs)


def _storage(t: Tensor):
    if not isinstance(t, Tensor):
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # a tensor subclass without storage
        return None


def _tensors(tree: Any) -> list:
    """The tensors of an op's arguments or outputs (aten ops nest them two levels deep at most)."""
    if isinstance(tree, Tensor):
        return [tree]
    out = []
    for x in tree.values() if isinstance(tree, dict) else tree:
        if isinstance(x, Tensor):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            for y in x:
                if isinstance(y, Tensor):
                    out.append(y)
                elif isinstance(y, (list, tuple)):
                    out.extend(z for z in y if isinstance(z, Tensor))
        elif isinstance(x, dict):
            out.extend(_tensors(x))
    return out
