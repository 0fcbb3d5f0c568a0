"""tensor_layout: a Colossal-AI style tensor-parallel config mapped onto mesh axes, and its errors."""

from __future__ import annotations

import pytest

import fpar
import fpar.ops as ops


@pytest.mark.parametrize(
    ("args", "names", "shape"),
    [
        ((4, "1d"), ("tensor",), (4,)),
        ((9, "2d"), ("tensor_row", "tensor_col"), (3, 3)),
        ((8, "3d"), ("tensor_x", "tensor_y", "tensor_z"), (2, 2, 2)),
        ((4, "sequence"), ("sequence",), (4,)),
        ((1,), (), ()),
    ],
    ids=["1d", "2d", "3d", "sequence", "none"],
)
def test_modes(args, names, shape):
    layout = ops.tensor_layout(*args)
    assert (layout.axis_names, layout.axis_shape) == (names, shape)
    assert layout.mesh_axes(2) == ((2, *shape), ("data", *names))


def test_2p5d_and_colossal_config():
    layout = ops.tensor_layout(parallel=dict(pipeline=2, tensor=dict(size=8, mode="2.5d", depth=2)))
    assert (layout.mode, layout.depth, layout.pipeline) == ("2.5d", 2, 2)
    assert layout.axis_names == ("tensor_dep", "tensor_row", "tensor_col")
    assert layout.axis_shape == (2, 2, 2)
    assert layout.axis == layout.axis_names
    assert layout.mesh_axes() == (
        (2, -1, 2, 2, 2),
        ("pipeline", "data", "tensor_dep", "tensor_row", "tensor_col"),
    )
    mesh = layout.make_mesh(devices=32)
    assert dict(mesh.shape) == {"pipeline": 2, "data": 2, "tensor_dep": 2, "tensor_row": 2, "tensor_col": 2}
    one_d = ops.tensor_layout(parallel=dict(pipeline=dict(size=1), tensor=dict(size=4, mode="1d")))
    assert one_d.axis == "tensor" and "column_linear" in one_d.layers
    assert one_d.make_mesh(devices=8) == fpar.make_mesh((2, 4), ("data", "tensor"))
    assert ops.tensor_layout(parallel=dict(pipeline=4)).axis_names == ()
    assert ops.tensor_layout(12, "2.5d", depth=3).axis_shape == (3, 2, 2)
    sp = ops.tensor_layout(
        parallel=dict(data=dict(size=2), tensor=dict(size=4, mode="1d", sequence_parallel=True))
    )
    assert sp.sequence_parallel and sp.mesh_axes() == ((2, 4), ("data", "tensor"))


def test_agrees_with_mesh_from_config():
    """fpar.mesh_from_config (the core's config reader) builds the mesh this layout names."""
    for cfg in (
        dict(pipeline=2, tensor=dict(size=8, mode="2.5d", depth=2)),
        dict(tensor=dict(size=4, mode="1d", sequence_parallel=True)),
        dict(tensor=dict(size=8, mode="3d")),
        dict(tensor=dict(size=4, mode="2d")),
        dict(pipeline=4),
    ):
        assert ops.tensor_layout(parallel=cfg).make_mesh(devices=16) == fpar.mesh_from_config(cfg, devices=16)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(size=8, mode="2d"), ValueError, "needs a square tensor size"),
        (dict(size=8, mode="2.5d", depth=3), ValueError, r"size = depth \* q\^2"),
        (dict(size=18, mode="2.5d", depth=3), ValueError, r"size = depth \* q\^2"),
        (dict(size=8, mode="2.5d"), ValueError, "needs depth"),
        (dict(size=9, mode="3d"), ValueError, "needs a cube tensor size"),
        (dict(size=4), ValueError, "needs a mode"),
        (dict(size=4, mode="4d"), ValueError, "unknown tensor mode"),
        (dict(size=4, mode="1d", depth=2), ValueError, "depth is only meaningful"),
        (dict(size=0, mode="1d"), ValueError, "must be at least 1"),
        (dict(size=2.0, mode="1d"), TypeError, "must be an int"),
        (dict(parallel=dict(tensor=dict(size=4, mode="2d", dept=1))), ValueError, r"unknown keys \['dept'\]"),
        (dict(parallel=dict(model=2)), ValueError, r"unknown keys \['model'\]"),
        (dict(size=4, mode="2d", sequence_parallel=True), ValueError, "needs mode '1d' with size > 1"),
        (dict(parallel=dict(tensor=dict(size=1, mode="1d", sequence_parallel=True))), ValueError, "size > 1"),
        (dict(size=4, mode="1d", sequence_parallel=1), TypeError, "must be True or False"),
        (dict(size=4, mode="1d", parallel=dict(pipeline=2)), ValueError, "not both"),
        (dict(parallel=[("pipeline", 2)]), TypeError, "must be a dict"),
    ],
)
def test_impossible_combinations(kwargs, error, match):
    with pytest.raises(error, match=match):
        ops.tensor_layout(**kwargs)
