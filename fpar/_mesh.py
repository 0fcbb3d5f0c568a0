"""Named device meshes.

A mesh is an n-d grid of devices with a name per axis.  On the in-process backend
(``backend="local"``) the devices are virtual: one process computes every device's block at
once.  On the real backend (``backend="dist"``) each process of a ``torch.distributed`` job is
one device.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from types import MappingProxyType

__all__ = ["Mesh", "make_mesh"]

BACKENDS = ("local", "dist")


class Mesh:
    """An n-d grid of devices with named axes.

    Attributes:
      shape: ordered, read-only mapping of axis name to size (mesh order).
      axis_names: the axis names in mesh order.
      axis_sizes: the axis sizes in mesh order.
      size: the number of devices.
      backend: ``"local"`` (in-process) or ``"dist"`` (one process per device).
    """

    def __init__(self, axis_sizes: Sequence[int], axis_names: Sequence[str], *, backend: str = "local"):
        _check_names(axis_sizes, axis_names)
        if backend not in BACKENDS:
            raise ValueError(f"fpar.Mesh: unknown backend {backend!r}; choose one of {BACKENDS}.")
        self.axis_names: tuple[str, ...] = tuple(axis_names)
        self.axis_sizes: tuple[int, ...] = tuple(int(s) for s in axis_sizes)
        for name, s in zip(self.axis_names, self.axis_sizes):
            if s <= 0:
                raise ValueError(f"fpar.Mesh: axis {name!r} has size {s}; sizes must be positive.")
        self.shape: Mapping[str, int] = MappingProxyType(dict(zip(self.axis_names, self.axis_sizes)))
        self.size: int = math.prod(self.axis_sizes)
        self.backend: str = backend
        self._dist = None  # the real-mesh state (process groups), set by fpar._dist
        self.abstract = False  # a mesh on paper (fpar.plan.abstract_mesh): runs only under fpar.plan

    def __reduce__(self):
        """Pickled as its shape, names, backend and abstractness (its process groups stay behind)."""
        return (_rebuild, (self.axis_sizes, self.axis_names, self.backend, self.abstract))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mesh):
            return NotImplemented
        return (self.axis_names, self.axis_sizes, self.backend) == (
            other.axis_names,
            other.axis_sizes,
            other.backend,
        )

    def __hash__(self) -> int:
        return hash((self.axis_names, self.axis_sizes, self.backend))

    def __repr__(self) -> str:
        axes = ", ".join(f"{n!r}: {s}" for n, s in self.shape.items())
        if self.abstract:
            return f"Mesh({{{axes}}}, abstract)"
        return f"Mesh({{{axes}}}, backend={self.backend!r})"

    def submesh(self, axis_names: Sequence[str]) -> Mesh:
        """The mesh over a subset of the axes, for the devices that share this one's other coordinates.

        In-process that is simply a smaller mesh.  On a real mesh it is this process's slice:
        e.g. ``mesh.submesh(("data", "tensor"))`` of a (pipe, data, tensor) mesh is the 2-d mesh
        of the ranks in this rank's pipeline stage, reusing the parent's process groups.
        A pipeline runs each stage as a ``shard`` over such a submesh.

        Raises:
          ValueError: a name that is not an axis of this mesh, or named twice.
        """
        names = tuple(axis_names)
        unknown = [a for a in names if a not in self.shape]
        if unknown or len(set(names)) != len(names):
            raise ValueError(
                f"{self}.submesh({names}): axis names must be distinct axes of the mesh "
                f"{self.axis_names}; got {names}."
            )
        names = tuple(a for a in self.axis_names if a in names)  # keep mesh order
        sub = Mesh([self.shape[a] for a in names], names, backend=self.backend)
        sub.abstract = self.abstract
        if self._dist is not None:
            sub._dist = self._dist.view(names)
        return sub

    def axis_size(self, axis_name: str | tuple[str, ...]) -> int:
        """Size of one axis, or the product of the sizes of a tuple of axes."""
        names = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
        return math.prod([self.shape[a] for a in names])  # a list: Dynamo traces it (compiled steps)


def _rebuild(axis_sizes, axis_names, backend, abstract) -> Mesh:
    mesh = Mesh(axis_sizes, axis_names, backend=backend)
    mesh.abstract = abstract
    return mesh


def make_mesh(
    axis_shapes: Sequence[int],
    axis_names: Sequence[str],
    *,
    devices: int | None = None,
    backend: str | None = None,
) -> Mesh:
    """Build a named device mesh.

    With no ``backend``, the mesh is ``"dist"`` (one process per device) when
    ``torch.distributed`` is initialised and ``"local"`` (in-process) otherwise.

    Args:
      axis_shapes: size of each axis; one entry may be ``-1``, inferred from ``devices`` (or from
        the world size on a real mesh), the way Colossal-AI infers the data-parallel size.
      axis_names: a distinct name per axis.
      devices: number of devices; defaults to the product of ``axis_shapes`` in-process and to the
        world size on a real mesh.
      backend: ``"local"``, ``"dist"`` or ``None`` (choose as above).

    Returns:
      The mesh.

    Raises:
      ValueError: sizes not positive, more than one ``-1``, a ``-1`` with no device count, sizes
        whose product does not divide or match the device count, names and shapes of different
        lengths, duplicate names, or an unknown backend.

    Example:
      >>> make_mesh((-1, 2), ("data", "tensor"), devices=8).shape["data"]
      4
    """
    _check_names(axis_shapes, axis_names)
    if backend is None:
        backend = "dist" if _dist_initialized() else "local"
    if backend not in BACKENDS:
        raise ValueError(f"fpar.make_mesh: unknown backend {backend!r}; choose one of {BACKENDS}.")
    if backend == "dist":
        from . import _dist

        world = _dist.world_size()
        if devices is not None and devices != world:
            raise ValueError(
                f"fpar.make_mesh: devices={devices} does not match the world size {world} of the "
                f"initialised process group; leave devices out on a real mesh."
            )
        devices = world
    sizes = _infer_sizes(tuple(axis_shapes), tuple(axis_names), devices)
    mesh = Mesh(sizes, axis_names, backend=backend)
    if backend == "dist":
        from . import _dist

        _dist.attach(mesh)
    return mesh


# Error checking and messages ---------------------------------------------------------------


def _dist_initialized() -> bool:
    from . import _dist

    return _dist.is_initialized()


def _check_names(axis_shapes, axis_names) -> None:
    if isinstance(axis_names, str):
        raise TypeError(
            f"fpar.make_mesh: axis_names must be a sequence of names, got the string "
            f"{axis_names!r}; write ({axis_names!r},) for a single axis."
        )
    if len(axis_shapes) != len(axis_names):
        raise ValueError(
            f"fpar.make_mesh: axis_shapes {tuple(axis_shapes)} and axis_names {tuple(axis_names)} "
            f"must have the same length."
        )
    for n in axis_names:
        if not isinstance(n, str):
            raise TypeError(f"fpar.make_mesh: axis name {n!r} must be a str.")
    dup = sorted({n for n in axis_names if list(axis_names).count(n) > 1})
    if dup:
        raise ValueError(
            f"fpar.make_mesh: duplicate axis names {dup} in {tuple(axis_names)}; each axis needs its own name."
        )


def _infer_sizes(shapes: tuple, names: tuple, devices: int | None) -> tuple[int, ...]:
    for n, s in zip(names, shapes):
        if isinstance(s, bool) or not isinstance(s, int):
            raise TypeError(f"fpar.make_mesh: size of axis {n!r} must be an int, got {s!r}.")
        if s <= 0 and s != -1:
            raise ValueError(
                f"fpar.make_mesh: size of axis {n!r} is {s}; sizes must be positive (or -1 for one "
                f"axis inferred from the device count)."
            )
    if shapes.count(-1) > 1:
        raise ValueError(
            f"fpar.make_mesh: axis_shapes {shapes} has more than one -1; at most one -1 axis can "
            f"be inferred from the device count."
        )
    known = math.prod(s for s in shapes if s != -1)
    if -1 in shapes:
        if devices is None:
            raise ValueError(
                f"fpar.make_mesh: axis_shapes {shapes} has a -1, which needs devices=N to infer "
                f"from, e.g. make_mesh({shapes}, {names}, devices=8)."
            )
        if devices % known:
            raise ValueError(
                f"fpar.make_mesh: the product {known} of the known axis sizes does not divide the "
                f"device count {devices}, so the -1 axis {names[shapes.index(-1)]!r} cannot be inferred."
            )
        return tuple(devices // known if s == -1 else s for s in shapes)
    if devices is not None and devices != known:
        raise ValueError(
            f"fpar.make_mesh: axis_shapes {shapes} has {known} devices, which does not match "
            f"devices={devices}; use -1 for one axis to infer it."
        )
    return shapes
