"""Every error in the contract table, with its key phrase pinned (CONTRACT.md)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from harness import mesh_of

import fpar
from fpar import P

IJ = {"i": 2, "j": 2}


def _ident(x):
    return x


def test_exception_hierarchy():
    assert issubclass(fpar.SpecError, ValueError)
    assert issubclass(fpar.ReplicationError, ValueError)
    assert issubclass(fpar.UnboundAxisError, NameError)


# ----------------------------------------------------------------------------------------------
# Spec errors (checked at the call boundary, before the function runs)


def _calls_nothing(fn, in_specs, out_specs, *args, mesh=IJ, **kw):
    """Build and call a sharded function whose body must never run."""
    calls = []

    def loss(*blocks):
        calls.append(1)
        return fn(*blocks)

    try:
        fpar.shard(loss, mesh_of(mesh), in_specs, out_specs)(*args, **kw)
    finally:
        assert not calls, "the per-device function ran before the input was rejected"


@pytest.mark.parametrize(
    ("in_specs", "shape", "phrase"),
    [
        pytest.param(P("k"), (4,), "not an axis of the mesh", id="unknown-axis"),
        pytest.param(P(None, ("i", "k")), (2, 4), "not an axis of the mesh", id="unknown-axis-in-tuple"),
        pytest.param(P("i", "i"), (2, 2), "more than once", id="dup-two-entries"),
        pytest.param(P(("i", "i")), (4,), "more than once", id="dup-in-tuple"),
        pytest.param(P("j", ("i", "j")), (2, 4), "more than once", id="dup-entry-and-tuple"),
        pytest.param(P("i", None), (4,), "longer than the rank", id="too-long-rank1"),
        pytest.param(P("i"), (), "longer than the rank", id="too-long-scalar"),
    ],
)
def test_in_spec_errors(in_specs, shape, phrase):
    with pytest.raises(fpar.SpecError, match=phrase):
        _calls_nothing(_ident, in_specs, P(), torch.zeros(shape))


def test_in_spec_error_names_function_and_path():
    def loss(params, x):
        return x

    mesh = mesh_of(IJ)
    # The contract asks for the argument's path; naming the spec's path (in_specs[0]['w1']) is as clear.
    with pytest.raises(fpar.SpecError, match=r"fpar\.shard\(loss\).*(args|in_specs)\[0\]\['w1'\]"):
        fpar.shard(loss, mesh, ({"w1": P(None, "k"), "w2": P()}, P()), P())(
            {"w1": torch.zeros(2, 2), "w2": torch.zeros(2)}, torch.zeros(2)
        )


@pytest.mark.parametrize(
    ("mesh", "spec"),
    [
        pytest.param({"i": 2, "j": 2}, P(("i", "j")), id="tuple-i-j"),
        pytest.param({"i": 4, "j": 2}, P("i"), id="single-i4"),
        pytest.param({"a": 1, "i": 4}, P(("a", "i")), id="tuple-with-size-1"),
    ],
)
def test_not_divisible(mesh, spec):
    with pytest.raises(fpar.SpecError, match="not evenly divisible") as info:
        _calls_nothing(_ident, spec, spec, torch.zeros(6), mesh=mesh)
    msg = str(info.value)
    assert "dim 0 of size 6" in msg
    assert "total size 4" in msg
    assert "args[0]" in msg


def test_not_divisible_second_dim_names_path():
    def loss(params, x):
        return x

    with pytest.raises(fpar.SpecError, match="not evenly divisible") as info:
        fpar.shard(loss, mesh_of({"i": 2, "j": 3}), ({"w1": P(None, "j")}, P()), P())(
            {"w1": torch.zeros(2, 4)}, torch.zeros(1)
        )
    msg = str(info.value)
    assert "dim 1 of size 4" in msg and "total size 3" in msg
    assert "fpar.shard(loss)" in msg and "args[0]['w1']" in msg


@pytest.mark.parametrize(
    ("out_specs", "phrase"),
    [
        pytest.param(P("k"), "not an axis of the mesh", id="unknown-axis"),
        pytest.param(P(("i", "k")), "not an axis of the mesh", id="unknown-axis-in-tuple"),
        pytest.param(P("i", "i"), "more than once", id="dup"),
        pytest.param(P("i", None, None), "longer than the rank", id="too-long"),
    ],
)
def test_out_spec_errors(out_specs, phrase):
    def loss(x):
        return x

    with pytest.raises(fpar.SpecError, match=phrase):
        fpar.shard(loss, mesh_of(IJ), P("i"), out_specs)(torch.zeros(4, 2))


def test_out_spec_longer_than_scalar_rank_names_path():
    def loss(x):
        return x.sum(), x

    with pytest.raises(fpar.SpecError, match=r"longer than the rank") as info:
        fpar.shard(loss, mesh_of(IJ), P(), (P("i"), P()))(torch.zeros(4))
    assert "fpar.shard(loss)" in str(info.value) and "out[0]" in str(info.value)


@pytest.mark.parametrize(
    ("in_specs", "args", "phrase"),
    [
        pytest.param(
            (P(), P()),
            (torch.zeros(2),),
            "in_specs has 2 entries, but loss was called with 1 positional argument (a tensor float32[2])",
            id="two-specs-one-arg",
        ),
        pytest.param(
            (P(),),
            (torch.zeros(2), torch.zeros(2, 3)),
            "in_specs has 1 entries, but loss was called with 2 positional arguments (a tensor "
            "float32[2], a tensor float32[2, 3])",
            id="one-spec-two-args",
        ),
        pytest.param(
            ({"a": P()},),
            ({"b": torch.zeros(2)},),
            "in_specs is not a pytree prefix of the arguments: at [0] the dict keys differ: the prefix "
            "lacks ['b'], and has ['a'] that the tree does not.",
            id="dict-keys-differ",
        ),
        pytest.param(
            ([P(), P()],),
            ([torch.zeros(2)],),
            "at [0] the prefix has 2 entries, the tree 1 (a tensor float32[2])",
            id="list-lengths-differ",
        ),
        pytest.param(
            ((P(),),),
            ([torch.zeros(2)],),
            "at [0] the prefix has a tuple, the tree a list of 1 leaf",
            id="tuple-vs-list",
        ),
    ],
)
def test_in_specs_not_a_prefix(in_specs, args, phrase):
    with pytest.raises(fpar.SpecError) as info:
        _calls_nothing(lambda *a: torch.zeros(2), in_specs, P(), *args)
    assert phrase in str(info.value)
    assert "tensor(" not in str(info.value)


@pytest.mark.parametrize(
    ("out_specs", "out", "phrase"),
    [
        pytest.param(
            (P(), P()),
            lambda x: x,
            "at the top level the prefix has a tuple where the tree has a tensor float32[2]",
            id="two-specs-one-output",
        ),
        pytest.param(
            {"loss": P()},
            lambda x: {"los": x},
            "the prefix lacks ['los'], and has ['loss']",
            id="dict-keys-differ",
        ),
        pytest.param(
            [P(), P(), P()],
            lambda x: [x, x],
            "the prefix has 3 entries, the tree 2 (a tensor float32[2], a tensor float32[2])",
            id="list-lengths-differ",
        ),
    ],
)
def test_out_specs_not_a_prefix(out_specs, out, phrase):
    """Inside shard the outputs are functorch BatchedTensors: described by logical shape, never dumped."""
    with pytest.raises(fpar.SpecError) as info:
        fpar.shard(out, mesh_of(IJ), P(), out_specs)(torch.zeros(2))
    msg = str(info.value)
    assert msg.startswith("fpar.shard(<lambda>): out_specs is not a pytree prefix of the outputs: ")
    assert phrase in msg
    assert "BatchedTensor" not in msg and "tensor(" not in msg


def test_big_tree_mismatch_is_short():
    """The issue's case: a 64x64 tensor used to dump its values (19 lines); a model, hundreds."""
    params = {f"layer{i}": {"w": torch.randn(64, 64), "b": torch.randn(64)} for i in range(20)}
    specs = {f"layer{i}": {"w": P()} for i in range(20)}
    with pytest.raises(fpar.SpecError) as info:
        fpar.shard(lambda p: p, mesh_of(IJ), (specs,), P())(params)
    msg = str(info.value)
    assert "\n" not in msg and len(msg) < 400, msg
    assert "at [0]['layer0'] the dict keys differ: the prefix lacks ['b']" in msg
    with pytest.raises(fpar.SpecError) as info:
        fpar.device_put(params, mesh_of(IJ), specs)
    assert str(info.value).startswith(
        "fpar.device_put: spec is not a pytree prefix of the values: at ['layer0'] the dict keys differ"
    )
    with pytest.raises(ValueError, match=r"^at \['layer0'\] the dict keys differ: the prefix lacks \['b'\]"):
        fpar.optim.zero_layout(params, fpar.make_mesh((2,), ("data",)), specs, data_axis="data", stage=1)


@pytest.mark.parametrize(
    ("in_specs", "out_specs", "arg"),
    [
        pytest.param("i", P(), torch.zeros(2), id="in-str"),
        pytest.param(("i",), P(), torch.zeros(2), id="in-tuple-of-str"),
        pytest.param((3,), P(), torch.zeros(2), id="in-int"),
        pytest.param(({"w": ("i", None)},), P(), {"w": torch.zeros(2)}, id="in-raw-tuple-under-dict"),
        pytest.param(P(), "i", torch.zeros(2), id="out-str"),
        pytest.param(P(), 0, torch.zeros(2), id="out-int"),
    ],
)
def test_spec_leaf_not_a_p(in_specs, out_specs, arg):
    with pytest.raises(TypeError, match=re.escape("must be a fpar.P")):
        fpar.shard(lambda x: torch.zeros(2), mesh_of(IJ), in_specs, out_specs)(arg)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: P(1), id="int"),
        pytest.param(lambda: P("i", 2.5), id="float"),
        pytest.param(lambda: P(("i", 3)), id="tuple-with-int"),
        pytest.param(lambda: P(None, b"i"), id="bytes"),
    ],
)
def test_bad_partitionspec_entry(make):
    with pytest.raises(TypeError, match="PartitionSpec entry"):
        fpar.shard(_ident, mesh_of(IJ), in_specs=make(), out_specs=P())(torch.zeros(2, 2))


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(3.0, id="float"),
        pytest.param("abc", id="str"),
        pytest.param(np.zeros(4), id="numpy"),
        pytest.param(object(), id="object"),
    ],
)
def test_tensor_spec_on_non_tensor(value):
    def loss(x, y):
        return y

    with pytest.raises(TypeError, match="not a tensor") as info:
        _calls_nothing(loss, (P(), P("i")), P(), torch.zeros(2), value)
    assert "args[1]" in str(info.value)


# ----------------------------------------------------------------------------------------------
# Collective errors


def _collective_factories():
    """name -> (axis_name -> per-device function calling that collective over axis_name)."""
    return {
        "psum": lambda ax: lambda x: fpar.psum(x, ax),
        "pmean": lambda ax: lambda x: fpar.pmean(x, ax),
        "pmax": lambda ax: lambda x: fpar.pmax(x, ax),
        "pmin": lambda ax: lambda x: fpar.pmin(x, ax),
        "all_gather": lambda ax: lambda x: fpar.all_gather(x, ax),
        "psum_scatter": lambda ax: lambda x: fpar.psum_scatter(x, ax, tiled=True),
        "ppermute": lambda ax: lambda x: fpar.ppermute(x, ax, [(0, 1), (1, 0)]),
        "all_to_all": lambda ax: lambda x: fpar.all_to_all(x, ax, 0, 0, tiled=True),
        "axis_index": lambda ax: lambda x: fpar.axis_index(ax) + x,
        "axis_size": lambda ax: lambda x: fpar.axis_size(ax) + x,
    }


COLLECTIVES = sorted(_collective_factories())


@pytest.mark.parametrize("name", COLLECTIVES)
def test_collective_outside_shard(name):
    call = _collective_factories()[name]("i")
    with pytest.raises(fpar.UnboundAxisError, match="outside fpar.shard"):
        call(torch.zeros(4))


def test_collective_outside_shard_is_a_name_error():
    with pytest.raises(NameError):
        fpar.psum(torch.ones(2), "i")


@pytest.mark.parametrize("name", COLLECTIVES)
@pytest.mark.parametrize("axis_name", ["k", ("j", "k")], ids=["k", "(j,k)"])
def test_collective_over_unknown_axis(name, axis_name):
    body = _collective_factories()[name](axis_name)
    with pytest.raises(fpar.UnboundAxisError, match="not an axis of the mesh"):
        fpar.shard(body, mesh_of({"i": 2, "j": 2}), P(), P(), check_rep=False)(torch.zeros(4))


def _in_shard(fn, x, mesh=None):
    mesh = mesh or {"i": 4}
    return fpar.shard(fn, mesh_of(mesh), P(), P(), check_rep=False)(x)


@pytest.mark.parametrize(
    "perm",
    [
        pytest.param([(0, 1), (0, 2)], id="repeated-source"),
        pytest.param([(0, 1), (2, 1)], id="repeated-destination"),
        pytest.param([(1, 1), (1, 1)], id="repeated-pair"),
    ],
)
def test_ppermute_not_unique(perm):
    with pytest.raises(ValueError, match="must be unique"):
        _in_shard(lambda x: fpar.ppermute(x, "i", perm), torch.zeros(2))


@pytest.mark.parametrize(
    "perm",
    [pytest.param([(0, 4)], id="dst-equals-size"), pytest.param([(7, 0)], id="src-too-big")],
)
def test_ppermute_out_of_range(perm):
    with pytest.raises(ValueError, match="out of range"):
        _in_shard(lambda x: fpar.ppermute(x, "i", perm), torch.zeros(2))


def test_ppermute_out_of_range_on_tuple_axis():
    with pytest.raises(ValueError, match="out of range"):
        _in_shard(lambda x: fpar.ppermute(x, ("j", "i"), [(0, 4)]), torch.zeros(2), mesh=IJ)


@pytest.mark.parametrize(
    ("fn", "phrase"),
    [
        pytest.param(
            lambda x: fpar.psum_scatter(x, "i", tiled=True), "must be divisible by", id="psum_scatter-tiled"
        ),
        pytest.param(
            lambda x: fpar.psum_scatter(x, "i"), "must equal the axis size", id="psum_scatter-untiled"
        ),
        pytest.param(
            lambda x: fpar.psum_scatter(x, "i", scatter_dimension=1),
            "must equal the axis size",
            id="psum_scatter-dim1",
        ),
        pytest.param(
            lambda x: fpar.all_to_all(x, "i", 0, 1, tiled=True), "must be divisible by", id="all_to_all-tiled"
        ),
        pytest.param(
            lambda x: fpar.all_to_all(x, "i", 0, 1), "must equal the axis size", id="all_to_all-untiled"
        ),
        pytest.param(
            lambda x: fpar.all_to_all(x, "i", 1, 0), "must equal the axis size", id="all_to_all-split1"
        ),
    ],
)
def test_collective_size_mismatch(fn, phrase):
    # block (6, 3) on an axis of size 4
    with pytest.raises(ValueError, match=phrase):
        _in_shard(fn, torch.zeros(6, 3))


@pytest.mark.parametrize(
    "fn",
    [
        pytest.param(lambda x: fpar.all_gather(x, "i", axis=3), id="all_gather-untiled-axis3"),
        pytest.param(lambda x: fpar.all_gather(x, "i", axis=2, tiled=True), id="all_gather-tiled-axis2"),
        pytest.param(
            lambda x: fpar.psum_scatter(x, "i", scatter_dimension=2, tiled=True), id="psum_scatter-dim2"
        ),
        pytest.param(lambda x: fpar.all_to_all(x, "i", 2, 0, tiled=True), id="all_to_all-split2"),
        pytest.param(lambda x: fpar.all_to_all(x, "i", 0, 5, tiled=True), id="all_to_all-concat5"),
    ],
)
def test_collective_dim_out_of_range(fn):
    with pytest.raises(ValueError, match="out of range"):
        _in_shard(fn, torch.zeros(4, 4))


# ----------------------------------------------------------------------------------------------
# check_rep: ReplicationError


@pytest.mark.parametrize(
    ("body", "in_spec"),
    [
        pytest.param(lambda x: x, P("i"), id="split-input"),
        pytest.param(lambda x: x * fpar.axis_index("i"), P(), id="axis_index"),
        pytest.param(lambda x: fpar.all_gather(x, "i", tiled=True), P("i"), id="all_gather"),
        pytest.param(lambda x: fpar.all_gather(x, "i"), P(), id="all_gather-of-replicated"),
        pytest.param(lambda x: fpar.psum_scatter(x, "i", tiled=True), P(), id="psum_scatter"),
        pytest.param(lambda x: fpar.ppermute(x, "i", [(0, 1), (1, 0)]), P(), id="ppermute"),
        pytest.param(lambda x: fpar.all_to_all(x, "i", 0, 0, tiled=True), P(), id="all_to_all"),
        pytest.param(lambda x: fpar.psum(x, "j"), P(("i", "j")), id="psum-over-other-axis"),
        pytest.param(
            lambda x: fpar.pmean(x, "i") * fpar.axis_index(("j", "i")), P("i"), id="tuple-axis_index"
        ),
    ],
)
def test_replication_error(body, in_spec):
    def loss(x):
        return fpar.psum(x.sum(), ("i", "j")), body(x)

    with pytest.raises(fpar.ReplicationError, match=re.escape("varies over mesh axis 'i'")) as info:
        fpar.shard(loss, mesh_of(IJ), in_spec, (P(), P("j")))(torch.zeros(4))
    assert "out[1]" in str(info.value)
    assert "fpar.shard(loss)" in str(info.value)


def test_replication_error_dict_output():
    def step(x):
        return {"loss": fpar.pmean(x, "j"), "aux": fpar.psum(x, ("i", "j"))}

    with pytest.raises(fpar.ReplicationError, match=re.escape("varies over mesh axis 'i'")) as info:
        fpar.shard(step, mesh_of(IJ), P(("i", "j")), P())(torch.zeros(4))
    assert "out['loss']" in str(info.value)


def test_replication_error_over_size_1_axis():
    """The check is static: a value split over an axis of size 1 still 'varies' over it."""
    with pytest.raises(fpar.ReplicationError, match=re.escape("varies over mesh axis 'i'")):
        fpar.shard(lambda x: x, mesh_of({"i": 1, "j": 2}), P("i"), P())(torch.zeros(3))


@pytest.mark.parametrize(
    ("reduce", "expected"),
    [(fpar.psum, 1.0), (fpar.pmean, 0.5), (fpar.pmax, 1.0), (fpar.pmin, 0.0)],
    ids=["psum", "pmean", "pmax", "pmin"],
)
def test_replication_becomes_fine_after_reduction(reduce, expected):
    def f(x):
        return reduce(x * fpar.axis_index("i"), "i")

    out = fpar.shard(f, mesh_of(IJ), P("j"), P("j"))(torch.ones(4))
    assert out.tolist() == [expected] * 4


def test_check_rep_false_disables_the_check():
    out = fpar.shard(lambda x: x, mesh_of(IJ), P("i"), P(), check_rep=False)(torch.arange(4.0))
    assert out.tolist() == [0.0, 1.0]


# ----------------------------------------------------------------------------------------------
# fpar.launch refuses, before starting any process, what spawned processes could not run


def test_launch_of_a_lambda_or_local_function_says_what_to_do():
    fix = (
        "is a lambda or a function defined inside another function; the processes are spawned and "
        "must import fn by name. Define it at the top level of a module (or of the script, under an "
        '`if __name__ == "__main__":` guard) and pass its arguments through *args.'
    )
    anonymous = lambda: 1  # noqa: E731 - the lambda is the case under test
    with pytest.raises(TypeError) as info:
        fpar.launch(anonymous, 2)
    assert str(info.value) == f"fpar.launch: fn '{anonymous.__qualname__}' {fix}"
    assert anonymous.__qualname__.endswith("<locals>.<lambda>")

    def local():
        return 1

    with pytest.raises(TypeError) as info:
        fpar.launch(local, 2)
    assert str(info.value) == f"fpar.launch: fn '{local.__qualname__}' {fix}"


def test_launch_from_a_script_without_a_main_guard_says_what_to_do(tmp_path):
    import os
    import subprocess
    import sys

    script = tmp_path / "no_guard.py"
    script.write_text("import fpar\n\n\ndef f():\n    return 1\n\n\nfpar.launch(f, 2)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 1
    last = run.stderr.strip().splitlines()[-1]
    assert last == (
        f'RuntimeError: fpar.launch: {script} calls fpar.launch without an `if __name__ == "__main__":` '
        f"guard. Each spawned process re-imports the script to find 'f', and would launch again. Put the "
        f"script's top-level code under that guard."
    ), run.stderr
