"""Hypothesis strategies for sharded layouts: in-process meshes, valid specs, arrays, programs.

``training_programs`` draws whole training programs with their layouts, for the real mesh.
Needs hypothesis (``pip install fpar[test]``).

Example:
  >>> from hypothesis import given, strategies as st
  >>> from fpar.testing import strategies as fst
  >>> @given(st.data())
  ... def test_layout(data):
  ...     mesh = data.draw(fst.meshes(max_devices=4))
  ...     spec = data.draw(fst.specs(mesh, (8, 6)))
  ...     x = data.draw(fst.arrays((8, 6)))
  ...     fpar.testing.assert_equivalent(torch.sin, torch.sin, mesh, spec, spec, x)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

try:
    from hypothesis import strategies as st
except ImportError as e:  # pragma: no cover - exercised by a subprocess test
    raise ImportError(
        "fpar.testing.strategies needs hypothesis, which is a test extra: pip install fpar[test] "
        "(or pip install hypothesis). fpar.testing.assert_equivalent works without it."
    ) from e

from .._mesh import Mesh, make_mesh
from .._spec import PartitionSpec
from ._program import CHUNKS, DRIVERS, MODELS, SCHEDULES, TrainingProgram

__all__ = ["arrays", "meshes", "specs", "training_programs"]

_SIZES = (2, 1, 3, 4)  # axis sizes drawn, simplest first (hypothesis shrinks towards the front)


def meshes(
    max_devices: int = 8, axis_names: Sequence[str] = ("data", "tensor", "pipe")
) -> st.SearchStrategy[Mesh]:
    """In-process meshes of 1 to ``len(axis_names)`` axes and at most ``max_devices`` devices.

    The axes are a random selection of ``axis_names`` in random order, of sizes 1, 2, 3 or 4
    (size-1 axes included: a layout must also work when an axis is trivial).

    Args:
      max_devices: the largest device count (product of the axis sizes).
      axis_names: the names to draw axes from.
    """
    names = tuple(axis_names)
    if not names or len(set(names)) != len(names) or not all(isinstance(n, str) for n in names):
        raise ValueError(
            f"fpar.testing.strategies.meshes: axis_names must be distinct strings, got {axis_names!r}."
        )
    if max_devices < 1:
        raise ValueError(
            f"fpar.testing.strategies.meshes: max_devices must be at least 1, got {max_devices}."
        )

    @st.composite
    def draw_mesh(draw) -> Mesh:
        order = draw(st.permutations(names))[: draw(st.integers(1, len(names)))]
        sizes, remaining = [], max_devices
        for _ in order:
            size = draw(st.sampled_from([s for s in _SIZES if s <= remaining]))
            sizes.append(size)
            remaining //= size
        return make_mesh(tuple(sizes), tuple(order))

    return draw_mesh()


def specs(mesh: Mesh | Mapping[str, int], shape: Sequence[int]) -> st.SearchStrategy[PartitionSpec]:
    """Valid ``fpar.P`` for a global tensor of ``shape`` on ``mesh``.

    Each mesh axis is used at most once, every split dim is divisible by the product of its axes;
    replicated (``P()``), single-axis (``P("tensor")`` or ``P(("tensor",))``) and tuple-axis
    (``P(("data", "tensor"))``, either order) specs all appear; trailing ``None`` entries are
    sometimes dropped.

    Args:
      mesh: a ``fpar.Mesh`` (or an ordered ``{name: size}`` mapping).
      shape: the global shape.
    """
    sizes = dict(mesh.shape) if isinstance(mesh, Mesh) else dict(mesh)
    shape = tuple(int(s) for s in shape)
    return spec_entries(sizes, len(shape), shape=shape).map(lambda entries: PartitionSpec(*entries))


def arrays(shape: Sequence[int], dtype: torch.dtype = torch.float64) -> st.SearchStrategy[torch.Tensor]:
    """Tensors of ``shape`` and ``dtype``.

    Seeded standard-normal draws at a drawn scale (0.1, 1, 10) for floating and complex dtypes,
    small integers for integer dtypes, coin flips for bool.

    Args:
      shape: the shape.
      dtype: the dtype.
    """
    shape = tuple(int(s) for s in shape)

    @st.composite
    def draw_array(draw) -> torch.Tensor:
        gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
        if dtype == torch.bool:
            return torch.randint(0, 2, shape, generator=gen).bool()
        if dtype.is_floating_point or dtype.is_complex:
            scale = draw(st.sampled_from([1.0, 0.1, 10.0]))
            real = torch.float64 if dtype.is_floating_point else torch.complex128
            return (torch.randn(shape, generator=gen, dtype=real) * scale).to(dtype)
        return torch.randint(-8, 9, shape, generator=gen).to(dtype)

    return draw_array()


def training_programs(
    devices: int | Sequence[int] = (2, 4),
    *,
    drivers: Sequence[str] = DRIVERS,
    models: Sequence[str] = MODELS,
    max_steps: int = 3,
    compile: bool = True,
) -> st.SearchStrategy[TrainingProgram]:
    """Whole training programs and their layouts (``fpar.testing.TrainingProgram``), for a real mesh.

    Drawn per program: the device count (from ``devices``); the mesh: ``"data"`` plus any of
    ``"tensor"`` and ``"pipe"``, in random order, sizes 1, 2 or 4 (axes of size 1 included:
    ``(1, 2, 1)``, ``(2, 1, 2)``, ...; a pipe axis larger than 1 without a pipeline is an axis
    the program never reduces); the model (Megatron MLP blocks, or where there is a tensor axis
    ``fpar.ops.gpt_block``, its sequence-parallel form or a MoE block) and its depth, every
    block under ``fpar.optim.remat`` or not; the driver: a hand-written step
    (``torch.func.grad`` or ``.backward()``, microbatches summed by a loop, a loop under
    ``fpar.defer_reduction()`` or ``fpar.optim.accumulate``), ZeRO stage 0-3 (``zero_step``, or
    ``zero_grads`` + ``zero_update``; ``zero_step`` possibly in bf16 or fp16 with loss scaling by
    ``fpar.optim.mixed_precision``, and compiled whole with ``fullgraph=True`` after its first
    step) or a pipeline (every schedule of ``fpar.pipeline``; always when the pipe axis is larger
    than 1 and the drivers allow it); dropout (``fpar.random`` keys) or none; SGD or AdamW,
    behind ``clip_by_global_norm`` or not, its update donated (in place on a real mesh) or not;
    1 to ``max_steps`` steps (so a second step after the optimizer's sharded update, and the
    sharded functions' cached calls); a checkpoint saved after the first step and loaded onto
    another layout or not; evaluation under ``torch.no_grad()`` between steps or not.  A drawn
    program never holds a pair that is refused (``remat`` inside a compiled step).
    Hypothesis shrinks towards a 1-axis data-parallel MLP step.

    Draw on the parent and pass the programs to the processes (they are frozen, picklable
    dataclasses): every rank must run the same example.  Run them with
    ``fpar.testing.assert_programs_on_real_mesh``.

    Args:
      devices: the device counts (powers of two) to draw from.
      drivers: the step drivers to draw from (``"manual"``, ``"zero"``, ``"pipeline"``).
      models: the models to draw from (``"mlp"``, ``"gpt"``).
      max_steps: the most training steps.
      compile: draw compiled steps too (a compile takes tens of seconds: leave them out of a
        quick tier).

    Example:
      >>> from hypothesis import given, settings, strategies as st
      >>> @settings(max_examples=3, deadline=None)
      ... @given(st.lists(fst.training_programs(devices=(2, 4)), min_size=4, max_size=4))
      ... def test_real_mesh(programs):
      ...     fpar.testing.assert_programs_on_real_mesh(programs)   # one launch per device count
    """
    counts = (devices,) if isinstance(devices, int) else tuple(devices)
    if not counts or any(
        isinstance(n, bool) or not isinstance(n, int) or n < 1 or n & (n - 1) for n in counts
    ):
        raise ValueError(
            f"fpar.testing.strategies.training_programs: devices must be powers of two (1, 2, 4, ...), "
            f"got {devices!r}."
        )
    drivers, models = tuple(drivers), tuple(models)
    if not drivers or not set(drivers) <= set(DRIVERS):
        raise ValueError(
            f"fpar.testing.strategies.training_programs: drivers must be among {DRIVERS}, got {drivers!r}."
        )
    if "mlp" not in models or not set(models) <= set(MODELS):
        raise ValueError(
            f"fpar.testing.strategies.training_programs: models must include 'mlp' (meshes without a tensor "
            f"axis need it) and be among {MODELS}, got {models!r}."
        )
    if max_steps < 1:
        raise ValueError(
            f"fpar.testing.strategies.training_programs: max_steps must be >= 1, got {max_steps}."
        )

    cache: dict[Any, st.SearchStrategy] = {}  # strategies built once (hypothesis validates each)

    def pick(*options: Any) -> st.SearchStrategy:
        if options not in cache:
            cache[options] = st.sampled_from(options)
        return cache[options]

    if drivers == ("pipeline",):
        extra_axes = st.lists(st.just("tensor"), max_size=1).map(lambda t: ["pipe", *t])
    else:  # a pipe axis without a pipeline driver has size 1 (an unused axis)
        extra_axes = st.lists(pick("tensor", "pipe"), unique=True, max_size=2)
    orders = {
        k: st.permutations(["data", *k])
        for k in [(), ("tensor",), ("pipe",), ("tensor", "pipe"), ("pipe", "tensor")]
    }
    seeds, steps = st.integers(0, 2**16), st.integers(1, max_steps)

    @st.composite
    def draw_program(draw) -> TrainingProgram:
        n = draw(pick(*counts))
        names = draw(orders[tuple(draw(extra_axes))])
        size = dict.fromkeys(names, 1)
        for _ in range(n.bit_length() - 1):  # hand out the factors of 2
            room = [
                a for a in names if size[a] < 4 and (a != "pipe" or size[a] < 2 or "pipeline" in drivers)
            ] or ["data"]
            size[draw(pick(*room))] *= 2
        shape = tuple(size[a] for a in names)
        feasible = [d for d in drivers if d != "pipeline" or "pipe" in size]
        if size.get("pipe", 1) > 1 and "pipeline" in feasible and draw(pick(True, True, False)):
            feasible = ["pipeline"]  # else the pipe axis is one the program never reduces
        if not feasible:  # a pipe axis the drivers cannot pipeline: unreduced
            feasible = list(drivers)
        driver = draw(pick(*feasible))
        model = draw(pick(*[m for m in models if m == "mlp" or "tensor" in size]))
        kw: dict[str, Any] = {}
        if driver == "manual":
            kw["grad_api"] = draw(pick("func_grad", "backward"))
            kw["accumulation"] = draw(pick("none", "loop", "defer", "accumulate"))
            kw["n_micro"] = 1 if kw["accumulation"] == "none" else draw(pick(2, 3))
            kw["layers"] = draw(pick(1, 2))
        elif driver == "zero":
            kw["zero_stage"] = draw(pick(0, 1, 2, 3))
            kw["fused"] = draw(pick(True, False))
            kw["n_micro"] = draw(pick(1, 2))
            kw["layers"] = draw(pick(1, 2))
            if kw["fused"]:
                kw["precision"] = draw(pick("fp64", "bf16", "fp16"))
                kw["compile"] = compile and draw(pick(False, True))
        else:
            p = size["pipe"]
            kw["schedule"] = draw(pick(*SCHEDULES))
            kw["chunks"] = draw(pick(*CHUNKS[kw["schedule"]]))
            kw["layers"] = p * kw["chunks"]
            kw["n_micro"] = draw(pick(2, 1, 4))
            if kw["schedule"] == "interleaved_1f1b":
                # p + 1 and 2p + 1: Megatron's groups of microbatches (smallest_group), uneven at 2p + 1
                kw["n_micro"] = p * draw(pick(1, 2)) + draw(pick(0, 1))
            elif kw["schedule"] == "dualpipe_v":
                kw["n_micro"] = max(kw["n_micro"], 2 * p)
        steps_drawn = draw(steps)
        kw["remat"] = draw(pick(False, True)) and not kw.get("compile")
        kw["checkpoint"] = steps_drawn > 1 and draw(pick(False, True))
        if kw.get("compile") and steps_drawn < 2:
            kw["compile"] = False
        return TrainingProgram(
            shape=shape,
            names=tuple(names),
            model=model,
            driver=driver,
            dropout=draw(pick(0.0, 0.25)),
            optimizer=draw(pick("sgd", "adamw")),
            clip=draw(pick(None, 0.05, 1.0)),
            donate=draw(pick(False, True)),
            steps=steps_drawn,
            evaluate=draw(pick(False, True)),
            seed=draw(seeds),
            **kw,
        )

    return draw_program()


@st.composite
def spec_entries(
    draw,
    mesh: Mapping[str, int],
    rank: int,
    *,
    shape: Sequence[int] | None = None,
    require: frozenset = frozenset(),
    allow_trim: bool = True,
) -> tuple[Any, ...]:
    """Spec entries for a value of ``rank``: each mesh axis on at most one dim, or unmentioned.

    The building block of :func:`specs` (and of fpar's own generators of random programs).
    With ``shape`` only dims the axes divide are chosen; axes in ``require`` are always
    mentioned (needs ``rank >= 1`` and, with ``shape``, a dim they divide).  Tuple entries get a
    random order; trailing ``None`` entries are dropped at random when ``allow_trim``.
    """
    per_dim: list[list[str]] = [[] for _ in range(rank)]
    for axis in draw(st.permutations(list(mesh))):
        dims = list(range(rank))
        if shape is not None:
            dims = [d for d in dims if shape[d] % (math.prod(mesh[a] for a in per_dim[d]) * mesh[axis]) == 0]
        choices = dims if axis in require and dims else [-1, *dims]
        d = draw(st.sampled_from(choices))
        if d >= 0:
            per_dim[d].append(axis)
    entries = [_entry(names, draw(st.booleans()) if len(names) == 1 else True) for names in per_dim]
    if allow_trim:
        trailing = 0
        for e in reversed(entries):
            if e is not None:
                break
            trailing += 1
        entries = entries[: len(entries) - draw(st.integers(0, trailing))]
    return tuple(entries)


def _entry(names: list[str], as_tuple: bool):
    if not names:
        return None
    if len(names) == 1 and not as_tuple:
        return names[0]
    return tuple(names)
