"""Hypothesis strategies for sharded layouts: in-process meshes, valid specs, arrays.

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

__all__ = ["arrays", "meshes", "specs"]

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
