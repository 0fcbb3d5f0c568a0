"""fpar.testing: the kit catches real layout bugs, with messages that locate them.

Each bug is a plausible mistake in a user's layout; the kit must fail with an AssertionError that
names value or gradient, the leaf's pytree path and the mesh coordinates of the wrong blocks.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from layout_bugs import check_catches

import fpar
from fpar import P
from fpar.testing import assert_equivalent
from fpar.testing import strategies as fst

MESH = fpar.make_mesh((2,), ("tensor",))
MESH_DT = fpar.make_mesh((2, 2), ("data", "tensor"))


def _rand(*shape, seed=0, dtype=torch.float64):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


X, W = _rand(4, 6, seed=1), _rand(6, 5, seed=2)


def test_catches_the_issues_layout_bugs():
    """A missing psum, pmean for psum, a wrong custom backward, a value bug on one device, a
    gradient bug on one block: each caught, its message pinned (tests/layout_bugs.py; the same
    catalogue runs on a real mesh in test_testing_dist.py)."""
    messages = check_catches(MESH)
    assert "ReplicationError" not in messages["missing psum"]
    assert "copies differ" not in messages["pmean for psum"]  # pmean replicates: wrong everywhere


def test_catches_bug_on_one_device_only():
    def column_parallel(params, x):
        y = x @ params["w"]
        return torch.where(fpar.axis_index("tensor") == 1, y * 1.01, y)  # device tensor=1 is off

    def reference(params, x):
        return x @ params["w"]

    with pytest.raises(AssertionError) as info:
        assert_equivalent(
            reference,
            column_parallel,
            MESH_DT,
            ({"w": P(None, "tensor")}, P("data")),
            P("data", "tensor"),
            {"w": W[:, :4]},
            X,
        )
    msg = str(info.value)
    assert msg.startswith("value out of column_parallel differs from the reference: max abs error ")
    assert "in the devices at data=0, tensor=1; data=1, tensor=1 (2 of 4)" in msg


def test_catches_gradient_bug_on_one_block_and_names_the_leaf():
    class _ScaleBlockOne(torch.autograd.Function):
        """Identity on the stacked blocks whose backward triples device 1's cotangent."""

        @staticmethod
        def forward(w):
            return w.clone()

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, g):
            scale = torch.ones(g.shape[0], dtype=g.dtype)
            scale[1] = 3
            return g * scale.reshape(-1, *[1] * (g.dim() - 1))

    class _WrongOnOne(torch.autograd.Function):
        @staticmethod
        def forward(w):
            return w.clone()

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, g):
            return g

        @staticmethod
        def vmap(info, in_dims, w):  # at the mesh level: every device's block, stacked on dim 0
            return _ScaleBlockOne.apply(w.movedim(in_dims[0], 0)), 0

    def layer(params, x):
        w = _WrongOnOne.apply(params["w"])
        return x @ w

    def reference(params, x):
        return x @ params["w"]

    with pytest.raises(AssertionError) as info:
        assert_equivalent(
            reference, layer, MESH, ({"w": P(None, "tensor")}, P()), P(None, "tensor"), {"w": W[:, :4]}, X
        )
    msg = str(info.value)
    assert msg.startswith("gradient w.r.t. args[0]['w'] of layer differs from the reference")
    assert msg.endswith("in the blocks at tensor=1 (1 of 2).")


def test_gradient_of_replicated_input_is_located_as_whole():
    def layer(w, x):
        return x @ (w * (1 + 0 * fpar.axis_index("tensor")))

    def bad(w, x):
        return x @ w.detach()

    assert_equivalent(lambda w, x: x @ w, layer, MESH, (P(), P("tensor")), P("tensor"), W, X)
    with pytest.raises(
        AssertionError,
        match=r"gradient w.r.t. args\[0\] of bad .*in the whole tensor \(its in_spec P\(\) puts",
    ):
        assert_equivalent(lambda w, x: x @ w, bad, MESH, (P(), P("tensor")), P("tensor"), W, X)


def test_dtype_and_shape_and_tree_mismatch():
    with pytest.raises(
        AssertionError, match=r"value out of <lambda>: dtype torch.float32, the reference gives torch.float64"
    ):
        assert_equivalent(lambda x: x, lambda x: x.float(), MESH, P("tensor"), P("tensor"), X)
    with pytest.raises(AssertionError, match=r"structure"):
        assert_equivalent(lambda x: (x, x), lambda x: x, MESH, P("tensor"), P("tensor"), X)


def test_integer_and_static_outputs():
    n = torch.arange(8)

    def f(n):
        return fpar.psum(n, "tensor"), "tag"

    assert_equivalent(lambda n: (n.reshape(2, 4).sum(0), "tag"), f, MESH, P("tensor"), (P(), None), n)
    with pytest.raises(AssertionError, match=r"value out\[0\] of f differs"):
        assert_equivalent(lambda n: (n.reshape(2, 4).sum(0) + 1, "tag"), f, MESH, P("tensor"), (P(), None), n)


def test_tolerances_by_dtype_and_overrides():
    x = X.float()
    assert_equivalent(lambda x: x * 1.000001, lambda x: x, MESH, P("tensor"), P("tensor"), x)  # fp32 default
    with pytest.raises(AssertionError, match="rtol=0, atol=0"):
        assert_equivalent(
            lambda x: x * 1.000001, lambda x: x, MESH, P("tensor"), P("tensor"), x, rtol=0, atol=0
        )


@settings(max_examples=10)
@given(st.data())
def test_strategies_draw_valid_layouts(data):
    mesh = data.draw(fst.meshes(max_devices=4), label="mesh")
    assert isinstance(mesh, fpar.Mesh) and mesh.size <= 4
    assert set(mesh.axis_names) <= {"data", "tensor", "pipe"}
    spec = data.draw(fst.specs(mesh, (12, 4)), label="spec")
    x = data.draw(fst.arrays((12, 4)), label="x")
    assert x.dtype == torch.float64 and x.shape == (12, 4)
    assert_equivalent(torch.sin, torch.sin, mesh, spec, spec, x)


def test_specs_cover_replicated_single_and_tuple_axes():
    seen = set()
    mesh = fpar.make_mesh((2, 2), ("data", "tensor"))

    @settings(max_examples=60, derandomize=True, database=None)
    @given(fst.specs(mesh, (4, 6)))
    def collect(spec):
        for d, entry in enumerate(spec.normalized()):
            n = 1
            for a in entry:
                n *= mesh.shape[a]
            assert (4, 6)[d] % n == 0
        kinds = {len(e) for e in spec.normalized()}
        seen.add("replicated" if not spec.axes() else "tuple" if 2 in kinds else "single")

    collect()
    assert seen == {"replicated", "single", "tuple"}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int32, torch.bool, torch.complex64])
@settings(max_examples=3, database=None)
@given(data=st.data())
def test_arrays_dtypes(dtype, data):
    x = data.draw(fst.arrays((3, 2), dtype))
    assert x.dtype == dtype and x.shape == (3, 2)


def test_kit_without_hypothesis():
    """`import fpar` and assert_equivalent work without hypothesis; the strategies say what to install."""
    code = (
        "import sys; sys.modules['hypothesis'] = None\n"
        "import fpar, torch\n"
        "fpar.testing.assert_equivalent(torch.sin, torch.sin, fpar.make_mesh((2,), ('t',)), fpar.P('t'), fpar.P('t'), torch.ones(4))\n"
        "try:\n    import fpar.testing.strategies\nexcept ImportError as e:\n    print(e)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert "pip install fpar[test]" in out.stdout


@pytest.mark.parametrize("grad", [True, False])
def test_unprovable_replication_is_a_value_error_with_or_without_grad(grad):
    """Every copy equals the reference, but fpar.shard would raise ReplicationError: the kit fails too."""

    def gathered(x):
        return fpar.all_gather(x, "tensor", tiled=True)

    with pytest.raises(AssertionError) as info:
        assert_equivalent(lambda x: x, gathered, MESH, P("tensor"), P(), X, grad=grad)
    msg = str(info.value)
    assert msg.startswith(
        "value of gathered: every device's copy equals the reference, but fpar cannot prove the "
        "replication its out_specs promise, so fpar.shard raises: fpar.shard(gathered): out varies "
        "over mesh axis 'tensor'"
    )


def test_complex_parameter_gradients():
    """A replicated complex weight meeting a split batch: its gradient is summed over the devices."""
    w = torch.complex(_rand(6, seed=3), _rand(6, seed=4))

    def loss(w, x):
        return fpar.psum(((x.to(w.dtype) @ w).abs() ** 2).sum(), "tensor")

    def reference(w, x):
        return ((x.to(w.dtype) @ w).abs() ** 2).sum()

    assert_equivalent(reference, loss, MESH, (P(), P("tensor")), P(), w, X)

    def forgot_psum(w, x):
        return ((x.to(w.dtype) @ w).abs() ** 2).sum()

    with pytest.raises(AssertionError, match=r"^value out of forgot_psum differs"):
        assert_equivalent(reference, forgot_psum, MESH, (P(), P("tensor")), P(), w, X)


def test_public_names_and_signatures():
    """Other code checks these names, parameters and defaults; keep them exactly."""
    import inspect

    def params(fn):
        return [
            (p.name, p.kind.name, None if p.default is inspect.Parameter.empty else p.default)
            for p in inspect.signature(fn).parameters.values()
        ]

    assert fpar.testing.__all__ == [
        "RealMeshMismatch",
        "TrainingProgram",
        "assert_equivalent",
        "assert_programs_on_real_mesh",
        "assert_same_on_real_mesh",
        "default_tolerance",
        "distributed",
    ]
    pos, var, kw = "POSITIONAL_OR_KEYWORD", "VAR_POSITIONAL", "KEYWORD_ONLY"
    assert params(assert_equivalent) == [
        *[(n, pos, None) for n in ("reference", "fn", "mesh", "in_specs", "out_specs")],
        ("args", var, None),
        ("grad", kw, True),
        ("rtol", kw, None),
        ("atol", kw, None),
        ("seed", kw, 0),
    ]
    assert params(fpar.testing.distributed) == [("nprocs", pos, None), ("timeout", pos, 120)]
    assert params(fst.meshes) == [("max_devices", pos, 8), ("axis_names", pos, ("data", "tensor", "pipe"))]
    assert params(fst.specs) == [("mesh", pos, None), ("shape", pos, None)]
    assert params(fst.arrays)[:2] == [("shape", pos, None), ("dtype", pos, torch.float64)]
