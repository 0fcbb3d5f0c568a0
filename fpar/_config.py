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

import math
from collections.abc import Mapping
from typing import Any

from ._mesh import Mesh, make_mesh

__all__ = ["mesh_from_config"]

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
    parallel = {} if parallel is None else parallel
    if not isinstance(parallel, Mapping):
        raise TypeError(
            f"{_API}: parallel must be a dict such as dict(pipeline=2, tensor=dict(size=4, mode='1d')), got {type(parallel).__name__}."
        )
    _check_keys("parallel", parallel, _TOP_KEYS)
    pipeline = _size("parallel['pipeline']", parallel.get("pipeline", 1))
    tensor = _tensor_section(parallel.get("tensor", {}))
    size, mode = _size("parallel['tensor']['size']", tensor.get("size", 1)), tensor.get("mode")
    tensor_shape = _tensor_shape(size, mode, tensor.get("depth"))
    _check_sequence_parallel(tensor.get("sequence_parallel", False), size, mode)
    data = _data_size(devices, pipeline, size, parallel.get("data"), backend)
    shape = ((pipeline,) if pipeline > 1 else ()) + (data,) + tensor_shape
    names = (("pipeline",) if pipeline > 1 else ()) + ("data",) + TENSOR_AXES[mode]
    return make_mesh(shape, names, devices=math.prod(shape) if _local(backend) else None, backend=backend)


# Rules ---------------------------------------------------------------------------------------


def _tensor_section(tensor: Any) -> Mapping[str, Any]:
    if isinstance(tensor, int) and not isinstance(tensor, bool):
        return {"size": tensor}
    if not isinstance(tensor, Mapping):
        raise TypeError(
            f"{_API}: parallel['tensor'] must be an int or dict(size=..., mode=...), got {tensor!r}."
        )
    _check_keys("parallel['tensor']", tensor, _TENSOR_KEYS)
    return tensor


def _tensor_shape(size: int, mode: Any, depth: Any) -> tuple[int, ...]:
    if mode not in MODES:
        raise ValueError(f"{_API}: unknown tensor mode {mode!r}; choose one of {MODES}.")
    if depth is not None and mode != "2.5d":
        raise ValueError(
            f"{_API}: depth is only meaningful with mode '2.5d' (size = depth * q^2), not with mode {mode!r}."
        )
    if mode is None:
        if size > 1:
            raise ValueError(
                f"{_API}: tensor size {size} > 1 needs a mode: tensor=dict(size={size}, mode='1d') for "
                f"Megatron 1D, or one of {MODES[2:]}."
            )
        return ()
    if mode in ("1d", "sequence"):
        return (size,)
    if mode == "2d":
        return _square(size)
    if mode == "2.5d":
        return _tesseract(size, depth)
    return _cube(size)


def _square(size: int) -> tuple[int, int]:
    q = math.isqrt(size)
    if q * q != size:
        raise ValueError(
            f"{_API}: mode '2d' needs a square tensor size (q x q grid), got {size}; use {q * q} or "
            f"{(q + 1) ** 2}, or mode '2.5d' with depth = size / q^2."
        )
    return (q, q)


def _tesseract(size: int, depth: Any) -> tuple[int, int, int]:
    if depth is None:
        raise ValueError(
            f"{_API}: mode '2.5d' needs depth, with size = depth * q^2: e.g. tensor=dict(size=8, "
            f"mode='2.5d', depth=2)."
        )
    depth = _size("parallel['tensor']['depth']", depth)
    q = math.isqrt(size // depth)
    if depth * q * q != size:
        raise ValueError(
            f"{_API}: mode '2.5d' needs size = depth * q^2, got size {size} with depth {depth} "
            f"(size / depth = {size / depth:g} is not a square); e.g. size 8 with depth 2."
        )
    return (depth, q, q)


def _cube(size: int) -> tuple[int, int, int]:
    q = round(size ** (1 / 3))
    if q**3 != size:
        raise ValueError(
            f"{_API}: mode '3d' needs a cube tensor size (q x q x q), got {size}; use e.g. 8 or 27."
        )
    return (q, q, q)


def _check_sequence_parallel(sp: Any, size: int, mode: Any) -> None:
    if not isinstance(sp, bool):
        raise TypeError(f"{_API}: parallel['tensor']['sequence_parallel'] must be True or False, got {sp!r}.")
    if sp and (mode != "1d" or size < 2):
        raise ValueError(
            f"{_API}: sequence_parallel=True (Megatron sequence parallelism) splits the sequence over "
            f"the 1D tensor-parallel axis, so it needs mode '1d' with size > 1; got mode {mode!r}, "
            f"size {size}. For Ulysses or ring attention use mode 'sequence'."
        )


def _data_size(devices: Any, pipeline: int, tensor: int, data: Any, backend: str | None) -> int:
    model = pipeline * tensor
    if devices is None:
        devices = model if _local(backend) else _world_size()
    devices = _size("devices", devices)
    if devices % model:
        raise ValueError(
            f"{_API}: {devices} devices are not divisible by pipeline * tensor = {pipeline} * {tensor} "
            f"= {model}, so the data-parallel size cannot be inferred; use a multiple of {model} devices "
            f"or smaller pipeline/tensor sizes."
        )
    inferred = devices // model
    if data is not None and _size("parallel['data']", data) != inferred:
        raise ValueError(
            f"{_API}: parallel['data'] = {data} does not match the {inferred} inferred from {devices} "
            f"devices / (pipeline {pipeline} * tensor {tensor}); leave 'data' out to infer it."
        )
    return inferred


# Error checking ------------------------------------------------------------------------------


def _check_keys(where: str, section: Mapping, allowed: tuple[str, ...]) -> None:
    unknown = sorted(str(k) for k in set(section) - set(allowed))
    if unknown:
        raise ValueError(f"{_API}: unknown keys {unknown} in {where}; allowed keys are {list(allowed)}.")


def _size(where: str, value: Any) -> int:
    if isinstance(value, Mapping):
        _check_keys(where, value, ("size",))
        value = value.get("size", 1)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{_API}: {where} must be an int (or dict(size=int)), got {value!r}.")
    if value < 1:
        raise ValueError(f"{_API}: {where} must be at least 1, got {value}.")
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
