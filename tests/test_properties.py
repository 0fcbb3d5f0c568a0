"""Property tests: random meshes, shapes, specs and collective programs against the reference.

Values and float64 gradients (torch.func.grad w.r.t. the split input and a replicated parameter)
must equal the reference's (reference.py, a per-device loop over mesh coordinates).
"""

from __future__ import annotations

import pytest
import strategies as S
import torch
from harness import assert_tree_close, both, fpar_fn, rand, scalar_loss
from hypothesis import assume, given, note, settings
from hypothesis import strategies as st

import fpar


def _spec(entries) -> fpar.P:
    return fpar.P(*entries)


def _inputs(mesh, prog, seed=0):
    x = rand(*prog.in_shape, seed=seed)
    counts = S.split_counts(mesh, prog.in_entries, len(prog.in_shape))
    w = rand(*(s // c for s, c in zip(prog.in_shape, counts)), seed=seed + 1)
    return x, w


def _describe(mesh, prog, out_entries, check_rep):
    note(f"mesh={mesh}")
    note(f"in: shape={prog.in_shape} spec={_spec(prog.in_entries)!r} use_w={prog.use_w}")
    note(f"steps={prog.steps}")
    note(f"out: spec={_spec(out_entries)!r} varying={sorted(prog.varying)} check_rep={check_rep}")


def _check(mesh, prog, out_entries, *, check_rep, jvp=False):
    _describe(mesh, prog, out_entries, check_rep)
    in_specs = (_spec(prog.in_entries), fpar.P())
    f, r = both(prog, mesh, in_specs, _spec(out_entries), check_rep=check_rep)
    x, w = _inputs(mesh, prog)
    expected = r(x, w)
    assert_tree_close(f(x, w), expected, what="value")
    gf = torch.func.grad(scalar_loss(f), argnums=(0, 1))(x, w)
    gr = torch.func.grad(scalar_loss(r), argnums=(0, 1))(x, w)
    assert_tree_close(gf, gr, what="grad")
    if jvp:
        tx, tw = rand(*x.shape, seed=11), rand(*w.shape, seed=12)
        assert_tree_close(
            torch.func.jvp(f, (x, w), (tx, tw)), torch.func.jvp(r, (x, w), (tx, tw)), what="jvp"
        )


@given(st.data())
def test_random_program_matches_reference(data):
    mesh = data.draw(S.meshes(), label="mesh")
    prog = data.draw(S.programs(mesh), label="program")
    out = data.draw(S.out_entries(mesh, prog), label="out_entries")
    _check(mesh, prog, out, check_rep=True)


@settings(max_examples=max(10, settings().max_examples // 2))
@given(st.data())
def test_random_program_check_rep_false(data):
    """Any out_spec; unmentioned axes return the coordinate-0 block (values, grads, jvp)."""
    mesh = data.draw(S.meshes(), label="mesh")
    prog = data.draw(S.programs(mesh), label="program")
    out = data.draw(S.spec_entries(mesh, len(prog.out_local_shape)), label="out_entries")
    _check(mesh, prog, out, check_rep=False, jvp=True)


@settings(max_examples=max(10, settings().max_examples // 2))
@given(st.data())
def test_random_program_replication_error(data):
    """An out_spec leaving out an axis the result varies over is rejected, naming that axis."""
    mesh = data.draw(S.meshes(), label="mesh")
    prog = data.draw(S.programs(mesh), label="program")
    assume(prog.varying)
    out = data.draw(S.out_entries(mesh, prog, valid=False), label="out_entries")
    _describe(mesh, prog, out, True)
    mentioned = {n for e in out for n in S.names_of(e)}
    left_out = sorted(prog.varying - mentioned)
    f = fpar_fn(prog, mesh, (_spec(prog.in_entries), fpar.P()), _spec(out))
    x, w = _inputs(mesh, prog)
    with pytest.raises(fpar.ReplicationError) as info:
        f(x, w)
    msg = str(info.value)
    assert any(f"varies over mesh axis '{a}'" in msg for a in left_out), msg


@given(st.data())
def test_random_layouts_identity(data):
    """Identity program: in_spec -> out_spec (mentioning at least the input's axes) re-lays blocks."""
    mesh = data.draw(S.meshes(), label="mesh")
    shape, entries = data.draw(S.sharded_shapes(mesh, min_rank=1, max_rank=3), label="in")
    varying = frozenset(n for e in entries for n in S.names_of(e))
    out = data.draw(S.spec_entries(mesh, len(shape), require=varying), label="out_entries")
    note(f"mesh={mesh} shape={shape} in={_spec(entries)!r} out={_spec(out)!r}")
    x = rand(*shape)
    f, r = both(lambda c, a: a, mesh, _spec(entries), _spec(out))
    assert_tree_close(f(x), r(x))
    same = fpar_fn(lambda c, a: a, mesh, _spec(entries), _spec(entries))(x)
    assert torch.equal(same, x)


@settings(max_examples=max(10, settings().max_examples // 2))
@given(st.data())
def test_random_pytree_specs_grads(data):
    """Several leaves with independent specs; a replicated scalar loss; grads w.r.t. every leaf."""
    mesh = data.draw(S.meshes(), label="mesh")
    n_leaves = data.draw(st.integers(1, 3))
    leaves = [
        data.draw(S.sharded_shapes(mesh, min_rank=0, max_rank=2), label=f"leaf{i}") for i in range(n_leaves)
    ]
    keys = [f"p{i}" for i in range(n_leaves)]
    note(f"mesh={mesh} leaves={leaves}")
    all_axes = tuple(mesh)

    def prog(c, tree, scale):
        total = 0
        for k, (_, entries) in zip(keys, leaves):
            axes = tuple(n for e in entries for n in S.names_of(e))
            v = torch.sin(tree[k]).sum() * scale
            # reduce over the axes it is split on, then over everything (replicated result)
            v = c.psum(v, axes) if axes else v
            total = total + v * v
        return c.pmean(total, all_axes)

    tree = {k: rand(*shape, seed=i) for i, (k, (shape, _)) in enumerate(zip(keys, leaves))}
    specs = {k: _spec(entries) for k, (_, entries) in zip(keys, leaves)}
    f, r = both(prog, mesh, (specs, None), fpar.P())
    assert_tree_close(f(tree, 0.5), r(tree, 0.5))
    assert_tree_close(torch.func.grad(f)(tree, 0.5), torch.func.grad(r)(tree, 0.5), what="grad")
    # the global function is known in closed form: sum_k (0.5 * sum(sin(leaf_k)))^2
    closed = sum((0.5 * torch.sin(tree[k]).sum()) ** 2 for k in keys)
    torch.testing.assert_close(f(tree, 0.5), closed)


def test_strategies_cover_every_step_kind():
    """Guard against a generator that silently stops producing some step kinds."""
    seen = set()

    @settings(max_examples=150, derandomize=True, database=None, deadline=None)
    @given(st.data())
    def collect(data):
        mesh = data.draw(S.meshes())
        prog = data.draw(S.programs(mesh))
        for step in prog.steps:
            seen.add(
                step[0]
                if step[0] not in ("all_gather", "psum_scatter", "all_to_all")
                else (step[0], step[-1])
            )
        if any(isinstance(s[1], tuple) and len(s[1]) > 1 for s in prog.steps if len(s) > 1):
            seen.add("tuple-axis")

    collect()
    expected = {
        "psum",
        "pmean",
        "pmax",
        "pmin",
        "ppermute",
        "axis_index_mul",
        "tuple-axis",
        ("all_gather", True),
        ("all_gather", False),
        ("psum_scatter", True),
        ("psum_scatter", False),
        ("all_to_all", True),
        ("all_to_all", False),
    }
    assert expected <= seen, expected - seen
