"""fpar.make_mesh / fpar.Mesh: shape inference, ordering, equality, errors."""

from __future__ import annotations

import pytest

import fpar


@pytest.mark.parametrize(
    ("shapes", "names", "devices", "expected"),
    [
        pytest.param((2, 4), ("data", "tensor"), None, (2, 4), id="explicit-2x4"),
        pytest.param((2, 4), ("data", "tensor"), 8, (2, 4), id="explicit-devices-equal"),
        pytest.param((-1, 2), ("data", "tensor"), 8, (4, 2), id="infer-leading"),
        pytest.param((2, -1), ("data", "tensor"), 6, (2, 3), id="infer-trailing"),
        pytest.param((-1,), ("i",), 5, (5,), id="infer-only-axis"),
        pytest.param((2, -1, 2), ("a", "b", "c"), 8, (2, 2, 2), id="infer-middle"),
        pytest.param((3,), ("i",), None, (3,), id="1d"),
        pytest.param((1, 1), ("a", "b"), None, (1, 1), id="size-1-axes"),
    ],
)
def test_make_mesh_sizes(shapes, names, devices, expected):
    kw = {} if devices is None else {"devices": devices}
    mesh = fpar.make_mesh(shapes, names, **kw)
    assert isinstance(mesh, fpar.Mesh)
    assert mesh.axis_names == names
    assert mesh.axis_sizes == expected
    assert mesh.size == _prod(expected)
    assert list(mesh.shape.items()) == list(zip(names, expected))
    assert mesh.backend == "local"


def _prod(xs):
    out = 1
    for x in xs:
        out *= x
    return out


@pytest.mark.parametrize(
    "names", [("data", "tensor"), ("tensor", "data"), ("z", "a", "m")], ids=lambda n: "-".join(n)
)
def test_shape_keeps_mesh_order(names):
    sizes = tuple(range(2, 2 + len(names)))
    mesh = fpar.make_mesh(sizes, names)
    assert tuple(mesh.shape) == names  # insertion order, not sorted
    assert tuple(mesh.shape.values()) == sizes
    assert tuple(mesh.axis_names) == names
    for n, s in zip(names, sizes):
        assert mesh.shape[n] == s


def test_shape_and_names_are_tuples_even_from_lists():
    mesh = fpar.make_mesh([2, 3], ["i", "j"])
    assert mesh.axis_names == ("i", "j")
    assert mesh.axis_sizes == (2, 3)


def test_mesh_equality():
    a = fpar.make_mesh((2, 4), ("data", "tensor"))
    b = fpar.make_mesh((-1, 4), ("data", "tensor"), devices=8)
    assert a == b
    assert hash(a) == hash(b)
    assert a != fpar.make_mesh((4, 2), ("data", "tensor"))
    assert a != fpar.make_mesh((2, 4), ("tensor", "data"))
    assert a != fpar.make_mesh((2, 4), ("data", "model"))
    assert a != fpar.make_mesh((8,), ("data",))


@pytest.mark.parametrize(
    ("shapes", "names", "kw", "phrase"),
    [
        pytest.param((0, 2), ("a", "b"), {}, "must be positive", id="size-zero"),
        pytest.param((2, -2), ("a", "b"), {}, "must be positive", id="size-negative"),
        pytest.param((-3,), ("a",), {"devices": 3}, "must be positive", id="size-minus-3"),
        pytest.param((-1, -1), ("a", "b"), {"devices": 4}, "at most one -1", id="two-minus-one"),
        pytest.param((-1, 2), ("a", "b"), {}, "needs devices", id="infer-without-devices"),
        pytest.param((-1, 3), ("a", "b"), {"devices": 8}, "does not divide", id="infer-not-dividing"),
        pytest.param((2, 4), ("a", "b"), {"devices": 6}, "does not match", id="devices-mismatch"),
        pytest.param((2, 4), ("a",), {}, "same length", id="names-shorter"),
        pytest.param((2,), ("a", "b"), {}, "same length", id="names-longer"),
        pytest.param((2, 2), ("a", "a"), {}, "duplicate", id="duplicate-names"),
    ],
)
def test_make_mesh_errors(shapes, names, kw, phrase):
    with pytest.raises(ValueError, match=phrase):
        fpar.make_mesh(shapes, names, **kw)


def test_a_mesh_pickles_as_its_shape_names_and_backend():
    import pickle

    mesh = fpar.make_mesh((2, 4), ("data", "tensor"))
    back = pickle.loads(pickle.dumps(mesh))
    assert back == mesh and back.shape == mesh.shape and not back.abstract
    paper = fpar.plan.abstract_mesh((64, 16), ("data", "tensor"))
    back = pickle.loads(pickle.dumps(paper))
    assert back.abstract and back.axis_sizes == (64, 16) and back._dist is None
