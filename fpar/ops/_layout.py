"""From a tensor-parallel configuration to mesh axes: ``tensor_layout``.

Colossal-AI describes hybrid parallelism with a config such as
``parallel = dict(pipeline=2, tensor=dict(size=4, mode="2d"))``; Megatron with a tensor-parallel
size.  In fpar the same choice is a mesh shape with named axes plus the family of layers that
uses them.  ``tensor_layout`` checks the combination and names the axes, so the layer families
agree on them:

| mode | tensor axes (mesh order) | shape | layers |
|---|---|---|---|
| ``"1d"`` | ``("tensor",)`` | ``(P,)`` | Megatron 1D (+ ``sequence_parallel=True``), this package |
| ``"2d"`` | ``("tensor_row", "tensor_col")`` | ``(q, q)``, ``P = q^2`` | SUMMA (``fpar/ops/_summa.py``) |
| ``"2.5d"`` | ``("tensor_dep", "tensor_row", "tensor_col")`` | ``(d, q, q)``, ``P = d q^2`` | Tesseract (``_summa.py``) |
| ``"3d"`` | ``("tensor_x", "tensor_y", "tensor_z")`` | ``(q, q, q)``, ``P = q^3`` | 3D (``_summa.py``) |
| ``"sequence"`` | ``("sequence",)`` | ``(P,)`` | Ulysses / ring attention, this package |

The full mesh is ``("pipeline",)`` (if its size is above 1) + ``("data",)`` + the tensor axes,
the same axes and shapes as ``fpar.mesh_from_config`` builds from the same config.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from fpar._config import TENSOR_AXES, parse_parallel

from .._mesh import Mesh
from .._mesh import make_mesh as _make_mesh

__all__ = ["TensorLayout", "tensor_layout"]

MODES = ("1d", "2d", "2.5d", "3d", "sequence")
AXES = {m: TENSOR_AXES[m] for m in MODES}
LAYERS = {
    None: "no tensor parallelism: data (and pipeline) parallel only",
    "1d": "Megatron 1D: fpar.ops.column_linear/row_linear/mlp/attention/gpt "
    "(sequence_parallel=True or sp_* for Megatron-SP)",
    "2d": "2D SUMMA (Optimus): fpar/ops/_summa.py",
    "2.5d": "2.5D (Tesseract): fpar/ops/_summa.py",
    "3d": "3D: fpar/ops/_summa.py",
    "sequence": "sequence parallel: fpar.ops.ulysses_attention / ring_self_attention / ring_attention",
}


@dataclasses.dataclass(frozen=True)
class TensorLayout:
    """A checked tensor-parallel configuration and the mesh axes it maps to.

    Attributes:
      mode: ``"1d"``, ``"2d"``, ``"2.5d"``, ``"3d"``, ``"sequence"``, or ``None`` (no tensor parallelism).
      size: the number of devices in one tensor-parallel group.
      depth: the 2.5D depth ``d`` (1 for the other modes).
      pipeline: the number of pipeline stages.
      axis_names: the tensor axes, in mesh order (``()`` without tensor parallelism).
      axis_shape: their sizes.
      layers: where the layers for this mode live.
      sequence_parallel: Megatron-SP over the 1D tensor axis (``sequence_parallel=True`` layers).
      data: the data-parallel size if the config gave one, else -1 (inferred from the devices).
    """

    mode: str | None
    size: int
    depth: int
    pipeline: int
    axis_names: tuple[str, ...]
    axis_shape: tuple[int, ...]
    layers: str
    sequence_parallel: bool = False
    data: int = -1

    @property
    def axis(self):
        """The value for a layer's ``axis=``: the single axis name, or the tuple of tensor axes."""
        return self.axis_names[0] if len(self.axis_names) == 1 else self.axis_names

    def mesh_axes(self, data: int | None = None) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """Return ``(shape, names)`` of the whole mesh: [pipeline,] data, tensor axes (-1: inferred)."""
        data = self.data if data is None else data
        shape, names = (data, *self.axis_shape), ("data", *self.axis_names)
        if self.pipeline > 1:
            shape, names = (self.pipeline, *shape), ("pipeline", *names)
        return shape, names

    def make_mesh(
        self, *, data: int | None = None, devices: int | None = None, backend: str | None = None
    ) -> Mesh:
        """Build the mesh ``fpar.make_mesh(*self.mesh_axes(data), devices=devices, backend=backend)``."""
        return _make_mesh(*self.mesh_axes(data), devices=devices, backend=backend)


def tensor_layout(
    size: int = 1,
    mode: str | None = None,
    *,
    depth: int | None = None,
    pipeline: int = 1,
    sequence_parallel: bool = False,
    parallel: Mapping | None = None,
) -> TensorLayout:
    """Check a tensor-parallel configuration and map it onto named mesh axes.

    Args:
      size: devices per tensor-parallel group.
      mode: ``"1d"``, ``"2d"``, ``"2.5d"``, ``"3d"`` or ``"sequence"``; required when ``size > 1``.
      depth: the 2.5D depth (``size = depth * q * q``); only for ``"2.5d"``.
      pipeline: pipeline stages.
      sequence_parallel: Megatron sequence parallelism; needs mode ``"1d"`` and ``size > 1``.
      parallel: instead of the above, a Colossal-AI style config,
        ``dict(pipeline=2, tensor=dict(size=8, mode="2.5d", depth=2))`` (``pipeline`` and
        ``data`` may also be ``dict(size=2)``; ``data`` is normally left out and inferred;
        ``tensor`` may hold ``sequence_parallel``; leaving it out means no tensor parallelism).

    Returns:
      A ``TensorLayout``; ``layout.make_mesh(devices=16)`` builds the mesh.

    Raises:
      TypeError: a size that is not an int, or ``parallel`` that is not a dict.
      ValueError: an impossible combination (a non-square 2D size, ``size != depth*q^2``, a
        non-cube 3D size, ``size > 1`` without a mode, an unknown mode or key,
        ``sequence_parallel`` outside 1D).

    Example:
      >>> layout = fpar.ops.tensor_layout(parallel=dict(pipeline=1, tensor=dict(size=4, mode="2d")))
      >>> layout.axis_names, layout.axis_shape
      (('tensor_row', 'tensor_col'), (2, 2))
    """
    if parallel is not None:
        if (size, mode, depth, pipeline, sequence_parallel) != (1, None, None, 1, False):
            raise ValueError(
                "fpar.ops.tensor_layout: pass either parallel=dict(...) or size/mode/depth/pipeline, not both."
            )
    else:
        tensor = {"size": size, "mode": mode, "sequence_parallel": sequence_parallel}
        if depth is not None:
            tensor["depth"] = depth
        parallel = {"pipeline": pipeline, "tensor": tensor}
    # The rules live in one place, the core's config parser; this names the layers to use.
    cfg = parse_parallel(parallel, api="fpar.ops.tensor_layout")
    return TensorLayout(
        cfg.mode,
        cfg.size,
        cfg.depth,
        cfg.pipeline,
        cfg.tensor_axes,
        cfg.tensor_shape,
        LAYERS[cfg.mode],
        cfg.sequence_parallel,
        -1 if cfg.data is None else cfg.data,
    )
