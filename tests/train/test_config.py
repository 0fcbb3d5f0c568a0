"""fpar.mesh_from_config: Colossal-AI style parallel configs to named meshes, and every rule."""

from __future__ import annotations

import pytest

import fpar


def shape(mesh):
    return dict(mesh.shape)


@pytest.mark.parametrize(
    ("parallel", "devices", "expected"),
    [
        (None, 8, {"data": 8}),
        (None, None, {"data": 1}),
        (dict(pipeline=2, tensor=dict(size=4, mode="1d")), 16, {"pipeline": 2, "data": 2, "tensor": 4}),
        (
            dict(pipeline=dict(size=2), tensor=dict(size=2, mode="1d")),
            None,
            {"pipeline": 2, "data": 1, "tensor": 2},
        ),
        (dict(tensor=dict(size=4, mode="2d")), 8, {"data": 2, "tensor_row": 2, "tensor_col": 2}),
        (
            dict(tensor=dict(size=8, mode="2.5d", depth=2)),
            16,
            {"data": 2, "tensor_dep": 2, "tensor_row": 2, "tensor_col": 2},
        ),
        (dict(tensor=dict(size=8, mode="3d")), 8, {"data": 1, "tensor_x": 2, "tensor_y": 2, "tensor_z": 2}),
        (dict(tensor=dict(size=4, mode="sequence")), 8, {"data": 2, "sequence": 4}),
        (dict(tensor=dict(size=2, mode="1d", sequence_parallel=True)), 4, {"data": 2, "tensor": 2}),
        (dict(pipeline=1, tensor=1), 3, {"data": 3}),
        (dict(tensor=dict(size=1, mode="2d")), 2, {"data": 2, "tensor_row": 1, "tensor_col": 1}),
        (dict(pipeline=2, data=2), 4, {"pipeline": 2, "data": 2}),
    ],
    ids=[
        "none",
        "none-1-device",
        "pp2-1d4",
        "pp-dict",
        "2d",
        "2.5d",
        "3d",
        "sequence",
        "megatron-sp",
        "ints",
        "2d-1",
        "data-given",
    ],
)
def test_mesh_shapes(parallel, devices, expected):
    mesh = fpar.mesh_from_config(parallel, devices=devices)
    assert shape(mesh) == expected  # dict equality ignores order; check the order too:
    assert mesh.axis_names == tuple(expected) and mesh.backend == "local"


def test_same_mesh_as_fpar_ops_tensor_layout():
    import fpar.ops as ops

    for parallel in (
        dict(pipeline=2, tensor=dict(size=4, mode="2d")),
        dict(tensor=dict(size=8, mode="2.5d", depth=2)),
    ):
        assert fpar.mesh_from_config(parallel, devices=16) == ops.tensor_layout(parallel=parallel).make_mesh(
            devices=16
        )


@pytest.mark.parametrize(
    ("parallel", "devices", "error", "phrase"),
    [
        (dict(tensor=dict(size=6, mode="2d")), 6, ValueError, "mode '2d' needs a square tensor size"),
        (dict(tensor=dict(size=8, mode="2.5d")), 8, ValueError, "mode '2.5d' needs depth"),
        (
            dict(tensor=dict(size=8, mode="2.5d", depth=3)),
            8,
            ValueError,
            "size = depth \\* q\\^2, got size 8 with depth 3",
        ),
        (
            dict(tensor=dict(size=12, mode="2.5d", depth=2)),
            12,
            ValueError,
            "size / depth = 6 is not a square",
        ),
        (dict(tensor=dict(size=4, mode="3d")), 4, ValueError, "mode '3d' needs a cube tensor size"),
        (dict(tensor=dict(size=4)), 4, ValueError, "tensor size 4 > 1 needs a mode"),
        (dict(tensor=4), 4, ValueError, "tensor size 4 > 1 needs a mode"),
        (
            dict(pipeline=2, tensor=dict(size=2, mode="1d")),
            6,
            ValueError,
            "6 devices are not divisible by pipeline \\* tensor = 2 \\* 2 = 4",
        ),
        (dict(pipline=2), 4, ValueError, "unknown keys \\['pipline'\\] in parallel"),
        (
            dict(tensor=dict(size=2, mode="1d", kind="x")),
            4,
            ValueError,
            "unknown keys \\['kind'\\] in parallel\\['tensor'\\]",
        ),
        (
            dict(pipeline=dict(size=2, chunks=4)),
            4,
            ValueError,
            "unknown keys \\['chunks'\\] in parallel\\['pipeline'\\]",
        ),
        (dict(tensor=dict(size=2, mode="4d")), 4, ValueError, "unknown tensor mode '4d'"),
        (
            dict(tensor=dict(size=4, mode="2d", sequence_parallel=True)),
            4,
            ValueError,
            "sequence_parallel=True .* needs mode '1d'",
        ),
        (
            dict(tensor=dict(size=1, mode="1d", sequence_parallel=True)),
            4,
            ValueError,
            "needs mode '1d' with size > 1",
        ),
        (
            dict(tensor=dict(size=4, mode="sequence", sequence_parallel=True)),
            4,
            ValueError,
            "needs mode '1d'",
        ),
        (
            dict(tensor=dict(size=4, mode="2d", depth=1)),
            4,
            ValueError,
            "depth is only meaningful with mode '2.5d'",
        ),
        (dict(pipeline=0), 4, ValueError, "parallel\\['pipeline'\\] must be at least 1"),
        (dict(tensor=dict(size=-2, mode="1d")), 4, ValueError, "must be at least 1"),
        (dict(pipeline=2, data=3), 4, ValueError, "parallel\\['data'\\] = 3 does not match the 2 inferred"),
        (dict(pipeline=2.0), 4, TypeError, "must be an int"),
        (dict(tensor=dict(size=True, mode="1d")), 4, TypeError, "must be an int"),
        (dict(tensor="1d"), 4, TypeError, "parallel\\['tensor'\\] must be an int or dict"),
        (
            dict(tensor=dict(size=2, mode="1d", sequence_parallel="yes")),
            4,
            TypeError,
            "must be True or False",
        ),
        ([("pipeline", 2)], 4, TypeError, "parallel must be a dict"),
        (None, 0, ValueError, "devices must be at least 1"),
    ],
    ids=[
        "2d-not-square",
        "2.5d-no-depth",
        "2.5d-depth-mismatch",
        "2.5d-not-square",
        "3d-not-cube",
        "size-without-mode",
        "int-size-without-mode",
        "devices-not-divisible",
        "unknown-top-key",
        "unknown-tensor-key",
        "unknown-pipeline-key",
        "unknown-mode",
        "sp-with-2d",
        "sp-with-size-1",
        "sp-with-sequence-mode",
        "depth-outside-2.5d",
        "pipeline-0",
        "negative-size",
        "data-mismatch",
        "float-size",
        "bool-size",
        "tensor-str",
        "sp-not-bool",
        "parallel-not-dict",
        "zero-devices",
    ],
)
def test_rules(parallel, devices, error, phrase):
    with pytest.raises(error, match=phrase):
        fpar.mesh_from_config(parallel, devices=devices)


def test_backend():
    mesh = fpar.mesh_from_config(dict(tensor=dict(size=2, mode="1d")), devices=4, backend="local")
    assert shape(mesh) == {"data": 2, "tensor": 2}
    with pytest.raises(ValueError, match="unknown backend 'mpi'"):
        fpar.mesh_from_config(None, devices=2, backend="mpi")
    with pytest.raises(ValueError, match="backend='dist' needs a process group"):
        fpar.mesh_from_config(None, backend="dist")
