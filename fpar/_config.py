"""A Colossal-AI style parallel config to a named mesh: ``mesh_from_config``.

Colossal-AI describes hybrid parallelism as ``parallel = dict(pipeline=2, tensor=dict(size=4,
mode="2d"))`` and infers the data-parallel size from the number of devices.  In fpar that choice
is a mesh; the tensor axis is one axis for Megatron 1D and a grid of axes for the
multi-dimensional modes, named as ``fpar.ops`` layers expect them:

| ``mode`` | tensor axes (mesh order) | shape |
|---|---|---|
| ``None`` (size 1) | none | |
| ``"1d"`` | ``("tensor",)`` | ``(P,)`` |
| ``"2d"`` | ``("tensor_row", "tensor_col")`` | ``(q, q)``, ``P = q^2`` |
| ``"2.5d"`` | ``("tensor_dep", "tensor_row", "tensor_col")`` | ``(d, q, q)``, ``P = d q^2`` |
| ``"3d"`` | ``("tensor_x", "tensor_y", "tensor_z")`` | ``(q, q, q)``, ``P = q^3`` |
| ``"sequence"`` | ``("sequence",)`` | ``(P,)`` |

The mesh is ``("pipeline",)`` (when there is more than one stage) + ``("data",)`` + the tensor
axes: tensor ranks are adjacent and pipeline stages outermost, as in Colossal-AI's process
groups.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from ._mesh import Mesh, make_mesh

__all__ = ["ParallelLayout", "mesh_from_config", "parse_parallel"]

MODES = (None, "1d", "2d", "2.5d", "3d", "sequence")
TENSOR_AXES = {
    None: (),
    "1d": ("tensor",),
    "2d": ("tensor_row", "tensor_col"),
    "2.5d": ("tensor_dep", "tensor_row", "tensor_col"),
    "3d": ("tensor_x", "tensor_y", "tensor_z"),
    "sequence": ("sequence",),
}
_TOP_KEYS = ("pipeline", "tensor", "data")
_TENSOR_KEYS = ("size", "mode", "depth", "sequence_parallel")
_API = "fpar.mesh_from_config"


# API ----------------------------------------------------------------------------------------


def mesh_from_config(
    parallel: Mapping[str, Any] | None = None,
    *,
    devices: int | None = None,
    backend: str | None = None,
) -> Mesh:
    """Build the mesh a Colossal-AI style ``parallel`` config describes.

    Args:
      parallel: ``dict(pipeline=..., tensor=dict(size=..., mode=..., depth=...,
        sequence_parallel=...))``; every key is optional.  ``pipeline`` (and ``data``) may be an
        int or ``dict(size=...)``; ``tensor`` may be an int (its size, then no mode is allowed
        above 1).  ``data`` is normally left out and inferred; if given it must match.
        ``sequence_parallel=True`` is Megatron sequence parallelism, which runs over the 1D
        tensor axis.  ``None`` means no model parallelism (a pure data-parallel mesh).
      devices: the number of devices.  Default: the world size on a real mesh (a process
        group is up), otherwise ``pipeline * tensor`` (data size 1).
      backend: passed to ``fpar.make_mesh``.

    Returns:
      The mesh, axes ``[pipeline,] data, *tensor axes`` (see the module docstring).

    Raises:
      TypeError: ``parallel`` or a section of it of the wrong type, or a size that is not an int.
      ValueError: an unknown key, mode or backend (or ``"dist"`` with no process group); a size below 1; a tensor size above 1 with no mode;
        ``"2d"`` with a size that is not a square; ``"2.5d"`` without ``depth`` or with a size
        that is not ``depth * q^2``; ``"3d"`` with a size that is not a cube; ``depth`` outside
        ``"2.5d"``; ``sequence_parallel`` outside ``"1d"``; a device count that
        ``pipeline * tensor`` does not divide; a ``data`` size that does not match.

    Example:
      >>> mesh = fpar.mesh_from_config(dict(pipeline=2, tensor=dict(size=4, mode="2d")), devices=16)
      >>> mesh.shape
      mappingproxy({'pipeline': 2, 'data': 2, 'tensor_row': 2, 'tensor_col': 2})
    """
    _check_backend(backend)
    layout = parse_parallel(parallel, api=_API)
    data = _data_size(devices, layout.pipeline, layout.size, layout.data, backend)
    shape = ((layout.pipeline,) if layout.pipeline > 1 else ()) + (data,) + layout.tensor_shape
    names = (("pipeline",) if layout.pipeline > 1 else ()) + ("data",) + layout.tensor_axes
    return make_mesh(shape, names, devices=math.prod(shape) if _local(backend) else None, backend=backend)


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """A checked Colossal-AI style config: sizes, the tensor mode and its mesh axes."""

    pipeline: int
    data: int | None  # None: inferred from the device count
    size: int  # devices per tensor-parallel group
    mode: str | None
    depth: int  # the 2.5D depth (1 otherwise)
    sequence_parallel: bool
    tensor_axes: tuple[str, ...]
    tensor_shape: tuple[int, ...]


def parse_parallel(parallel: Mapping[str, Any] | None, *, api: str = _API) -> ParallelLayout:
    """Check a ``parallel`` config against Colossal-AI's rules (the one place they live).

    ``fpar.mesh_from_config`` and ``fpar.ops.tensor_layout`` both use it; ``api`` names the
    caller in error messages.
    """
    parallel = {} if parallel is None else parallel
    if not isinstance(parallel, Mapping):
        raise TypeError(
            f"{api}: parallel must be a dict such as dict(pipeline=2, tensor=dict(size=4, mode='1d')), got {type(parallel).__name__}."
        )
    _check_keys(api, "parallel", parallel, _TOP_KEYS)
    pipeline = _size(api, "parallel['pipeline']", parallel.get("pipeline", 1))
    tensor = _tensor_section(api, parallel.get("tensor", {}))
    size, mode = _size(api, "parallel['tensor']['size']", tensor.get("size", 1)), tensor.get("mode")
    tensor_shape = _tensor_shape(api, size, mode, tensor.get("depth"))
    sp = tensor.get("sequence_parallel", False)
    _check_sequence_parallel(api, sp, size, mode)
    data = parallel.get("data")
    data = None if data is None else _size(api, "parallel['data']", data)
    depth = tensor_shape[0] if mode == "2.5d" else 1
    return ParallelLayout(pipeline, data, size, mode, depth, sp, TENSOR_AXES[mode], tensor_shape)


# Rules ---------------------------------------------------------------------------------------


def _tensor_section(api: str, tensor: Any) -> Mapping[str, Any]:
    if isinstance(tensor, int) and not isinstance(tensor, bool):
        return {"size": tensor}
    if not isinstance(tensor, Mapping):
        raise TypeError(
            f"{api}: parallel['tensor'] must be an int or dict(size=..., mode=...), got {tensor!r}."
        )
    _check_keys(api, "parallel['tensor']", tensor, _TENSOR_KEYS)
    return tensor


def _tensor_shape(api: str, size: int, mode: Any, depth: Any) -> tuple[int, ...]:
    if mode not in MODES:
        raise ValueError(f"{api}: unknown tensor mode {mode!r}; choose one of {MODES}.")
    if depth is not None and mode != "2.5d":
        raise ValueError(
            f"{api}: depth is only meaningful with mode '2.5d' (size = depth * q^2), not with mode {mode!r}."
        )
    if mode is None:
        if size > 1:
            raise ValueError(
                f"{api}: tensor size {size} > 1 needs a mode: tensor=dict(size={size}, mode='1d') for "
                f"Megatron 1D, or one of {MODES[2:]}."
            )
        return ()
    if mode in ("1d", "sequence"):
        return (size,)
    if mode == "2d":
        return _square(api, size)
    if mode == "2.5d":
        return _tesseract(api, size, depth)
    return _cube(api, size)


def _square(api: str, size: int) -> tuple[int, int]:
    q = math.isqrt(size)
    if q * q != size:
        raise ValueError(
            f"{api}: mode '2d' needs a square tensor size (q x q grid), got {size}; use {q * q} or "
            f"{(q + 1) ** 2}, or mode '2.5d' with depth = size / q^2."
        )
    return (q, q)


def _tesseract(api: str, size: int, depth: Any) -> tuple[int, int, int]:
    if depth is None:
        raise ValueError(
            f"{api}: mode '2.5d' needs depth, with size = depth * q^2: e.g. tensor=dict(size=8, "
            f"mode='2.5d', depth=2)."
        )
    depth = _size(api, "parallel['tensor']['depth']", depth)
    q = math.isqrt(size // depth)
    if depth * q * q != size:
        raise ValueError(
            f"{api}: mode '2.5d' needs size = depth * q^2, got size {size} with depth {depth} "
            f"(size / depth = {size / depth:g} is not a square); e.g. size 8 with depth 2."
        )
    return (depth, q, q)


def _cube(api: str, size: int) -> tuple[int, int, int]:
    q = round(size ** (1 / 3))
    if q**3 != size:
        raise ValueError(
            f"{api}: mode '3d' needs a cube tensor size (q x q x q), got {size}; use e.g. 8 or 27."
        )
    return (q, q, q)


def _check_sequence_parallel(api: str, sp: Any, size: int, mode: Any) -> None:
    if not isinstance(sp, bool):
        raise TypeError(f"{api}: parallel['tensor']['sequence_parallel'] must be True or False, got {sp!r}.")
    if sp and (mode != "1d" or size < 2):
        raise ValueError(
            f"{api}: sequence_parallel=True (Megatron sequence parallelism) splits the sequence over "
            f"the 1D tensor-parallel axis, so it needs mode '1d' with size > 1; got mode {mode!r}, "
            f"size {size}. For Ulysses or ring attention use mode 'sequence'."
        )


def _data_size(devices: Any, pipeline: int, tensor: int, data: Any, backend: str | None) -> int:
    model = pipeline * tensor
    if devices is None:
        devices = model if _local(backend) else _world_size()
    devices = _size(_API, "devices", devices)
    if devices % model:
        raise ValueError(
            f"{_API}: {devices} devices are not divisible by pipeline * tensor = {pipeline} * {tensor} "
            f"= {model}, so the data-parallel size cannot be inferred; use a multiple of {model} devices "
            f"or smaller pipeline/tensor sizes."
        )
    inferred = devices // model
    if data is not None and data != inferred:
        raise ValueError(
            f"{_API}: parallel['data'] = {data} does not match the {inferred} inferred from {devices} "
            f"devices / (pipeline {pipeline} * tensor {tensor}); leave 'data' out to infer it."
        )
    return inferred


# Error checking ------------------------------------------------------------------------------


def _check_keys(api: str, where: str, section: Mapping, allowed: tuple[str, ...]) -> None:
    unknown = sorted(str(k) for k in set(section) - set(allowed))
    if unknown:
        raise ValueError(f"{api}: unknown keys {unknown} in {where}; allowed keys are {list(allowed)}.")


def _size(api: str, where: str, value: Any) -> int:
    if isinstance(value, Mapping):
        _check_keys(api, where, value, ("size",))
        value = value.get("size", 1)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{api}: {where} must be an int (or dict(size=int)), got {value!r}.")
    if value < 1:
        raise ValueError(f"{api}: {where} must be at least 1, got {value}.")
    return value


def _check_backend(backend: str | None) -> None:
    from . import _dist

    if backend not in (None, "local", "dist"):
        raise ValueError(f"{_API}: unknown backend {backend!r}; choose 'local', 'dist' or None (automatic).")
    if backend == "dist" and not _dist.is_initialized():
        raise ValueError(
            f"{_API}: backend='dist' needs a process group; call fpar.init_distributed() under torchrun, "
            f"or run inside fpar.launch."
        )


def _local(backend: str | None) -> bool:
    from . import _dist

    return backend == "local" or (backend is None and not _dist.is_initialized())


def _world_size() -> int:
    from . import _dist

    return _dist.world_size()
