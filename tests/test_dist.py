"""The multi-process tier: a real mesh (gloo on 127.0.0.1, 2, 4 and 8 processes) == the in-process mesh.

Spawning processes is the slow part (each imports torch; the machine has 2 cores), so every
``fpar.launch`` runs a whole batch of cases (``dist_programs.run_jobs``) and the tests below
compare its per-rank results with the same jobs run in this process on the in-process mesh:
values and float64 gradients of every collective (single axes, tuple axes in both orders),
a sample of random programs drawn with ``strategies.py``, whole data x tensor training steps,
``fpar.comm_stats`` byte counts, layouts (device_put / gather / init / DTensor), mesh building,
and errors. A handful of small launches check failure behaviour (a rank raising, stalling or
dying must end the run with a clear error, quickly).

Time bounds: every launch has a process-group timeout (a stuck collective raises) and
``fpar.launch`` gives up ``timeout + 60`` s after starting; it always terminates its processes.
"""

from __future__ import annotations

import copy
import math
import os
import random
import re
import subprocess
import sys
import time

import dist_programs as D
import pytest
import strategies as S
import torch
from harness import without_gradient_sums
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import fpar
from fpar import P

pytestmark = pytest.mark.multiprocess

TIMEOUT = 60.0  # process-group timeout of the batch launches (a stuck collective raises after this)
F64 = torch.float64


# ----------------------------------------------------------------------------------------------
# Blocks: which part of a global value rank r holds (row-major ranks over the mesh, as fpar does)


def coords(axes: dict[str, int], r: int) -> dict[str, int]:
    out = {}
    for name, size in reversed(list(axes.items())):
        out[name] = r % size
        r //= size
    return out


def _names(entry) -> tuple:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def block_of(t: torch.Tensor, entries, axes: dict[str, int], r: int) -> torch.Tensor:
    c = coords(axes, r)
    for d, entry in enumerate(entries):
        index, n = 0, 1
        for a in _names(entry):
            index = index * axes[a] + c[a]
            n *= axes[a]
        if n > 1:
            t = t.narrow(d, index * (t.shape[d] // n), t.shape[d] // n)
    return t


def assert_matches(got, expected, axes, r: int, path: str = "result") -> None:
    """Rank r's result ``got`` against the in-process result ``expected`` (Blk: sliced to rank r)."""
    if isinstance(expected, dict) and path.endswith("['stats']"):
        # the meshes count gradient sums differently by design (harness.without_gradient_sums);
        # psums are checked against formulas below and in tests/test_defer.py
        got, expected = without_gradient_sums(got), without_gradient_sums(expected)
        path += "(without gradient sums)"
    if isinstance(expected, D.Blk):
        assert isinstance(got, D.Blk), f"{path}: {type(got)}"
        assert got.entries == expected.entries, path
        assert_matches(got.t, block_of(expected.t, expected.entries, axes, r), axes, r, path)
    elif isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{path}: {type(got)} is not a tensor"
        assert got.shape == expected.shape, f"{path}: shape {tuple(got.shape)} != {tuple(expected.shape)}"
        assert got.dtype == expected.dtype, f"{path}: dtype {got.dtype} != {expected.dtype}"
        torch.testing.assert_close(got, expected, msg=lambda m: f"{path} (rank {r}): {m}")
    elif isinstance(expected, dict):
        assert isinstance(got, dict) and set(got) == set(expected), (
            f"{path}: keys {set(got)} != {set(expected)}"
        )
        for k in expected:
            assert_matches(got[k], expected[k], axes, r, f"{path}[{k!r}]")
    elif isinstance(expected, (list, tuple)):
        assert type(got) is type(expected) and len(got) == len(expected), f"{path}: {got!r} != {expected!r}"
        for i, (g, e) in enumerate(zip(got, expected)):
            assert_matches(g, e, axes, r, f"{path}[{i}]")
    else:
        assert got == expected, f"{path} (rank {r}): {got!r} != {expected!r}"


# ----------------------------------------------------------------------------------------------
# The cases


def _axis_id(ax) -> str:
    return ax if isinstance(ax, str) else "(" + ",".join(ax) + ")"


def collective_variants(ax, n: int):
    """``(name, steps, block shape, output still varies over ax)`` for every collective on ``ax``."""
    perm = list(range(n))
    random.Random(17 * n + len(_names(ax))).shuffle(perm)
    return [
        ("psum", [("psum", ax)], (2, 3), False),
        ("pmean", [("pmean", ax)], (2, 3), False),
        ("pmax", [("pmax", ax)], (2, 3), False),
        ("pmin", [("pmin", ax)], (2, 3), False),
        ("all_gather-axis0", [("all_gather", ax, 0, False)], (2, 3), True),
        ("all_gather-axis0-tiled", [("all_gather", ax, 0, True)], (2, 3), True),
        ("all_gather-axis1-tiled", [("all_gather", ax, 1, True)], (2, 3), True),
        ("all_gather-axis2", [("all_gather", ax, 2, False)], (2, 3), True),
        ("psum_scatter-dim0", [("psum_scatter", ax, 0, False)], (n, 3), True),
        ("psum_scatter-dim1-tiled", [("psum_scatter", ax, 1, True)], (2, 2 * n), True),
        ("ppermute-shift1", [("ppermute", ax, tuple((i, (i + 1) % n) for i in range(n)))], (2, 3), True),
        ("ppermute-random", [("ppermute", ax, tuple(enumerate(perm)))], (2, 3), True),
        ("ppermute-partial", [("ppermute", ax, ((0, n - 1),))], (2, 3), True),
        ("all_to_all-s0c1", [("all_to_all", ax, 0, 1, False)], (n, 3), True),
        ("all_to_all-s1c0", [("all_to_all", ax, 1, 0, False)], (2, n), True),
        ("all_to_all-s1c0-tiled", [("all_to_all", ax, 1, 0, True)], (2, 2 * n), True),
        ("all_to_all-s0c1-tiled", [("all_to_all", ax, 0, 1, True)], (2 * n, 3), True),
        ("axis_index", [("axis_index_mul", ax)], (2, 3), True),
        ("axis_size", [("axis_size_mul", ax), ("psum_const", ax), ("pmax", ax)], (2, 3), False),
    ]


def collective_cases(
    tag: str, axes: dict[str, int], ax_list, *, only=None, replicated_every=0, out_names_all=False
):
    """Jobs: each collective on each axis_name; input split over every mesh axis on dim 0.

    With ``out_names_all``, reductions are repeated with an out_spec naming every axis. With
    ``replicated_every=k``, every k-th case is repeated twice with the input replicated (P()):
    once made to differ per device by axis_index first, once fed straight to the collective. Either
    way its gradient is the sum of every device's share.
    """
    all_axes = tuple(axes)
    size = math.prod(axes.values())
    cases = []
    for ax in ax_list:
        n = math.prod(axes[a] for a in _names(ax))
        for i, (name, steps, block, varies) in enumerate(collective_variants(ax, n)):
            if only is not None and name not in only:
                continue
            kept = all_axes if varies else tuple(a for a in all_axes if a not in _names(ax))
            out_entries = (kept,) if kept else ()
            seed = len(cases)
            x = D.randn((block[0] * size,) + block[1:], seed)
            kw = dict(
                axes=axes,
                steps=tuple(steps),
                use_w=False,
                in_entries=(all_axes,),
                out_entries=out_entries,
                x=x,
            )
            cases.append((f"{tag}-{name}-{_axis_id(ax)}", "program", kw))
            if out_names_all and not varies:
                # the out_spec may name axes the value is invariant over: every copy is an output
                kw = dict(kw, out_entries=(all_axes,), x=D.randn(kw["x"].shape, seed + 3000))
                cases.append((f"{tag}-out-names-all-{name}-{_axis_id(ax)}", "program", kw))
            if replicated_every and i % replicated_every == 0:
                # made to vary by axis_index first, then the collective
                kw = dict(
                    axes=axes,
                    steps=(("axis_index_mul", all_axes), *steps),
                    use_w=False,
                    in_entries=(),
                    out_entries=out_entries,
                    x=D.randn(block, seed + 1000),
                )
                cases.append((f"{tag}-replicated-varied-{name}-{_axis_id(ax)}", "program", kw))
                # straight into the collective: the implicit pvary's transpose must sum over ax
                kw = dict(kw, steps=tuple(steps), x=D.randn(block, seed + 2000))
                cases.append((f"{tag}-replicated-direct-{name}-{_axis_id(ax)}", "program", kw))
    return cases


DRAWN_MESHES = {
    2: [{"a": 2}, {"x": 2, "y": 1}, {"z": 1, "x": 2}],
    4: [{"a": 2, "b": 2}, {"b": 4}, {"x": 2, "y": 1, "z": 2}, {"z": 2, "x": 2}],
    8: [{"a": 2, "b": 2, "c": 2}, {"y": 4, "x": 2}],
}


def drawn_cases(n: int, count: int):
    """Random programs from ``strategies.programs`` on ``n``-device meshes (deterministic draws)."""
    drawn = []

    @settings(
        max_examples=count,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(st.data())
    def collect(data):
        mesh = data.draw(st.sampled_from(DRAWN_MESHES[n]))
        prog = data.draw(S.programs(mesh))
        check_rep = data.draw(st.sampled_from([True, True, True, False]))
        if check_rep:
            out = data.draw(S.out_entries(mesh, prog))
        else:
            out = data.draw(S.spec_entries(mesh, len(prog.out_local_shape)))
        drawn.append((mesh, prog, out, check_rep))

    collect()
    cases, seen = [], set()
    for i, (mesh, prog, out, check_rep) in enumerate(drawn):
        key = repr((mesh, prog, out, check_rep))
        if key in seen:
            continue
        seen.add(key)
        counts = S.split_counts(mesh, prog.in_entries, len(prog.in_shape))
        kw = dict(
            axes=mesh,
            steps=prog.steps,
            use_w=prog.use_w,
            in_entries=tuple(prog.in_entries),
            out_entries=tuple(out),
            x=D.randn(prog.in_shape, 100 + i),
            w=D.randn(tuple(s // c for s, c in zip(prog.in_shape, counts)), 200 + i) if prog.use_w else None,
            check_rep=check_rep,
        )
        cases.append((f"drawn{n}-{len(cases)}", "program", kw))
    return cases


X2Y2 = {"x": 2, "y": 2}
A2B2C2 = {"a": 2, "b": 2, "c": 2}

COLLECTIVES = {
    2: collective_cases("i2", {"i": 2}, ["i", ("i",)], replicated_every=3),
    4: collective_cases(
        "x2y2", X2Y2, ["x", "y", ("x", "y"), ("y", "x")], replicated_every=4, out_names_all=True
    ),
    8: collective_cases(
        "a2b2c2",
        A2B2C2,
        ["b", ("c", "a"), ("a", "b", "c"), ("c", "b", "a")],
        only={
            "psum",
            "pmax",
            "all_gather-axis1-tiled",
            "psum_scatter-dim0",
            "ppermute-random",
            "all_to_all-s0c1",
        },
    ),
}
DRAWN = {2: drawn_cases(2, 16), 4: drawn_cases(4, 30), 8: drawn_cases(8, 6)}

BACKWARD = {
    4: [
        (
            f"backward-{name}",
            "program_backward",
            dict(
                axes=X2Y2,
                steps=steps,
                in_entries=(("x", "y"),),
                out_entries=(("x", "y"),),
                x=D.randn(shape, 9),
            ),
        )
        for name, steps, shape in [
            ("all_gather", (("all_gather", ("y", "x"), 1, True),), (8, 3)),
            ("psum_scatter", (("psum_scatter", "x", 1, True), ("sin",)), (8, 4)),
            ("ppermute", (("ppermute", ("y", "x"), ((0, 2), (2, 3), (3, 0))),), (8, 3)),
            ("all_to_all", (("all_to_all", ("x", "y"), 0, 1, True), ("square",)), (16, 2)),
            ("pmax", (("pmax", "y"), ("tanh",)), (8, 3)),
        ]
    ]
}

# check_rep=False: an output left unnamed on an axis it varies over is the block at coordinate 0
# of that axis, on every rank; only that block's device gets its gradient.
UNCHECKED = {
    4: [
        (
            f"unchecked-{name}",
            "program",
            dict(
                axes=X2Y2,
                steps=steps,
                use_w=True,
                in_entries=(("x", "y"),),
                out_entries=out,
                x=D.randn((8, 3), 13),
                w=D.randn((2, 3), 14),
                check_rep=False,
            ),
        )
        for name, steps, out in [
            ("sin-out-P()", (("sin",),), ()),
            ("sin-out-y", (("sin",),), (None, "y")),
            ("ppermute-out-x", (("ppermute", "y", ((0, 1), (1, 0))), ("square",)), ("x",)),
        ]
    ]
}

_TRANSFORM_PROGRAMS = [
    ("psum", (("psum", ("y", "x")), ("sin",)), (4, 3), ()),
    ("all_gather", (("all_gather", ("y", "x"), 1, True), ("square",)), (8, 3), (("x", "y"),)),
    ("psum_scatter", (("square",), ("psum_scatter", "x", 1, True)), (8, 4), (("x", "y"),)),
    ("ppermute", (("ppermute", ("y", "x"), ((0, 2), (2, 3), (3, 0))), ("square",)), (8, 3), (("x", "y"),)),
    ("all_to_all", (("all_to_all", ("x", "y"), 0, 1, True), ("sin",)), (16, 2), (("x", "y"),)),
    ("pmean", (("square",), ("pmean", "y")), (8, 3), ("x",)),
]
TRANSFORMS = {
    4: [
        (
            f"{job}-{name}",
            job,
            dict(axes=X2Y2, steps=steps, in_entries=(("x", "y"),), out_entries=out, x=D.randn(shape, 12)),
        )
        for job in ("program_jvp", "grad_of_grad")
        for name, steps, shape, out in _TRANSFORM_PROGRAMS
    ]
    + [
        ("axis_info", "axis_info", dict(axes=X2Y2, ax_list=["x", "y", ("x", "y"), ("y", "x")])),
    ],
    8: [
        (
            "axis_info",
            "axis_info",
            dict(axes=A2B2C2, ax_list=["b", ("c", "a"), ("a", "b", "c"), ("c", "b", "a")]),
        )
    ],
}

MLP = {
    2: [
        ("mlp-data2", "train_mlp", dict(axes={"data": 2, "tensor": 1})),
        ("mlp-tensor2", "train_mlp", dict(axes={"data": 1, "tensor": 2})),
    ],
    4: [("mlp-data2-tensor2", "train_mlp", dict(axes={"data": 2, "tensor": 2}, steps=4))],
    8: [("mlp-data2-tensor4", "train_mlp", dict(axes={"data": 2, "tensor": 4}, steps=2, mesh_shape=(-1, 4)))],
}

MISC = {
    2: [
        ("dp", "dp_step", dict(n=2)),
        ("replicated-output", "replicated_output_grad", dict(axes={"i": 2})),
        ("layouts", "layouts", dict(axes={"a": 2, "b": 1})),
        ("init", "init_values", dict(axes={"a": 1, "b": 2})),
        ("dtensors", "dtensors", dict(axes={"a": 2, "b": 1})),
        ("errors", "errors", dict(axes={"i": 2})),
        ("mismatch", "mismatch", dict(axes={"i": 2})),
        ("fast", "fast_paths", dict(axes={"data": 2})),
        ("meshes", "meshes", dict(world=2)),
    ],
    4: [
        ("dp", "dp_step", dict(n=4)),
        ("replicated-output", "replicated_output_grad", dict(axes=X2Y2)),
        ("layouts", "layouts", dict(axes={"a": 2, "b": 2})),
        ("init", "init_values", dict(axes={"a": 2, "b": 2})),
        ("dtensors", "dtensors", dict(axes={"a": 2, "b": 2})),
        ("errors", "errors", dict(axes=X2Y2)),
        ("mismatch", "mismatch", dict(axes=X2Y2)),
        ("fast", "fast_paths", dict(axes={"data": 2, "tensor": 2})),
        ("meshes", "meshes", dict(world=4)),
    ],
    8: [
        ("replicated-output", "replicated_output_grad", dict(axes=A2B2C2)),
        ("init", "init_values", dict(axes={"a": 4, "b": 2})),
        ("mismatch", "mismatch", dict(axes=A2B2C2)),
        ("meshes", "meshes", dict(world=8)),
    ],
}

JOBS = {
    n: COLLECTIVES[n]
    + DRAWN[n]
    + BACKWARD.get(n, [])
    + UNCHECKED.get(n, [])
    + TRANSFORMS.get(n, [])
    + MLP[n]
    + MISC[n]
    for n in (2, 4, 8)
}
KWARGS = {n: {case_id: kw for case_id, _, kw in JOBS[n]} for n in JOBS}


# ----------------------------------------------------------------------------------------------
# One launch per process count, shared by the tests that read its results


_RUNS: dict[int, object] = {}


def launched(n: int) -> dict:
    """The per-rank results of ``JOBS[n]`` on ``n`` processes (launched once, on first use)."""
    if n not in _RUNS:
        t0 = time.monotonic()
        try:
            _RUNS[n] = fpar.launch(D.run_jobs, n, JOBS[n], timeout=TIMEOUT)
        except fpar.LaunchError as e:
            _RUNS[n] = e
        _RUNS[f"time{n}"] = time.monotonic() - t0
    run = _RUNS[n]
    if isinstance(run, Exception):
        pytest.fail(f"the {n}-process launch failed: {run}")
    return run


def dist_result(n: int, case_id: str) -> list:
    """The case's result on every rank (fails with the worker's traceback if it raised)."""
    out = []
    for r, per_rank in enumerate(launched(n)):
        rec = per_rank[case_id]
        if rec[0] != "ok":
            pytest.fail(f"{case_id} raised on rank {r}: {rec[1]}: {rec[2]}\n{rec[3]}")
        out.append(rec[1])
    return out


def local_result(n: int, case_id: str):
    """The case run in-process, on a copy of its arguments: a program that changed them (a
    ``requires_grad_`` on its input) must not change what the launch pickles for the real mesh."""
    name = next(job for cid, job, _ in JOBS[n] if cid == case_id)
    return D.JOBS[name](**copy.deepcopy(KWARGS[n][case_id]))


def check_same_as_local(n: int, case_id: str, axes=None) -> tuple[list, object]:
    expected = local_result(n, case_id)
    got = dist_result(n, case_id)
    axes = axes if axes is not None else KWARGS[n][case_id]["axes"]
    for r, g in enumerate(got):
        assert_matches(g, expected, axes, r, case_id)
    return got, expected


def _ids(n, cases):
    return [pytest.param(n, cid, id=cid) for cid, _, _ in cases]


# ----------------------------------------------------------------------------------------------
# 1. Every collective: values, gradients and comm_stats equal the in-process mesh


@pytest.mark.parametrize(
    ("n", "case_id"), _ids(2, COLLECTIVES[2]) + _ids(4, COLLECTIVES[4]) + _ids(8, COLLECTIVES[8])
)
def test_collective_matches_in_process(n, case_id):
    check_same_as_local(n, case_id)


@pytest.mark.parametrize(("n", "case_id"), _ids(4, BACKWARD[4]))
def test_backward_and_vjp_match_in_process(n, case_id):
    check_same_as_local(n, case_id)


@pytest.mark.parametrize(("n", "case_id"), _ids(4, UNCHECKED[4]))
def test_check_rep_false_matches_in_process(n, case_id):
    check_same_as_local(n, case_id)


@pytest.mark.parametrize(
    ("n", "case_id"), [pytest.param(n, cid, id=cid) for n in TRANSFORMS for cid, _, _ in TRANSFORMS[n]]
)
def test_jvp_grad_of_grad_and_axis_info_match_in_process(n, case_id):
    got, _ = check_same_as_local(n, case_id)
    if case_id == "axis_info":
        assert got[0]["index"].t.dtype == torch.int64 and got[0]["size_type"] == "int"


# ----------------------------------------------------------------------------------------------
# 2. Random programs drawn with strategies.py


@pytest.mark.parametrize(("n", "case_id"), _ids(2, DRAWN[2]) + _ids(4, DRAWN[4]) + _ids(8, DRAWN[8]))
def test_drawn_program_matches_in_process(n, case_id):
    kw = KWARGS[n][case_id]
    note = (
        f"mesh={kw['axes']} in={P(*kw['in_entries'])!r} shape={tuple(kw['x'].shape)} use_w={kw['use_w']} "
        f"steps={kw['steps']} out={P(*kw['out_entries'])!r} check_rep={kw['check_rep']}"
    )
    try:
        check_same_as_local(n, case_id)
    except AssertionError as e:
        raise AssertionError(f"{note}\n{e}") from None


def test_drawn_programs_cover_collectives():
    """The sample is not degenerate: it exercises most collectives and tuple axes on real meshes."""
    kinds = {s[0] for n in DRAWN for _, _, kw in DRAWN[n] for s in kw["steps"]}
    assert {"all_gather", "ppermute", "all_to_all", "psum_scatter", "axis_index_mul"} <= kinds, kinds
    assert {"psum", "pmean", "pmax", "pmin"} & kinds, kinds
    assert any(
        isinstance(s[1], tuple) and len(s[1]) > 1
        for n in DRAWN
        for _, _, kw in DRAWN[n]
        for s in kw["steps"]
        if len(s) > 1
    )
    assert any(not kw["check_rep"] for n in DRAWN for _, _, kw in DRAWN[n])


# ----------------------------------------------------------------------------------------------
# 3. Whole training steps, 4. comm_stats


@pytest.mark.parametrize(
    ("n", "case_id"), [pytest.param(n, cid, id=cid) for n in MLP for cid, _, _ in MLP[n]]
)
def test_training_steps_match_in_process(n, case_id):
    got, expected = check_same_as_local(n, case_id)
    kw = KWARGS[n][case_id]
    assert got[0]["mesh"] == kw["axes"]
    # and the in-process run is plain SGD on the unsharded model
    d, h, c, batch, lr = 6, 8, 3, 8, 0.2
    params = fpar.init(D.mlp_inits(d, h, c), fpar.make_mesh((1,), ("one",)), P())
    xs, ys = D.mlp_data(kw.get("steps", 3), batch, d, c, 1)
    for s in range(len(expected["losses"])):
        grads, loss = torch.func.grad_and_value(D.mlp_loss_unsharded)(params, xs[s], ys[s])
        params = {k: params[k] - lr * grads[k] for k in params}
        torch.testing.assert_close(expected["losses"][s], loss)
        for k in params:
            torch.testing.assert_close(expected["params"][s][k], params[k])
    # stats match the in-process ones but for the gradient sums (checked above); data carries traffic
    stats = got[0]["stats"]
    if kw["axes"]["data"] > 1:
        assert stats["data"]["psum"]["bytes"] > 0, stats
    if kw["axes"]["tensor"] > 1:
        assert stats["tensor"]["psum"]["calls"] >= 1, stats


@pytest.mark.parametrize("n", [2, 4])
def test_data_parallel_gradient_is_one_all_reduce(n):
    """A P() parameter gets the sum of every device's gradient, from one all-reduce of its size."""
    got, expected = check_same_as_local(n, "dp", axes={"data": n})
    w = D.randn((5, 3), 3)
    x, y = D.randn((2 * n, 5), 4), D.randn((2 * n, 3), 5)
    g = torch.func.grad(lambda w: ((x @ w - y) ** 2).mean())(w)
    for r in range(n):
        torch.testing.assert_close(got[r]["grad"].t, g)  # not n * g, not one device's share
        psum = got[r]["stats"]["data"]["psum"]
        assert psum == {"calls": 1, "bytes": 2 * (n - 1) * got[r]["w_bytes"] // n}, got[r]["stats"]
    assert expected["stats"] == got[0]["stats"]


def test_low_precision_gradient_buckets_sum_in_float32():
    """fp16/bf16 gradient buckets follow fpar's rule for sums: float32, rounded once (4 processes)."""
    got = fpar.launch(D.low_precision_buckets, 4, timeout=TIMEOUT)
    for dtype, small in ((torch.bfloat16, 2.0**-9), (torch.float16, 2.0**-12)):
        want = torch.tensor(1.0 + 3 * small, dtype=torch.float32).to(dtype)  # the sum, rounded once
        assert want > 1
        for r, g in enumerate(got):
            for call, grad in enumerate(g[str(dtype)]):
                assert grad.dtype == dtype
                torch.testing.assert_close(
                    grad,
                    torch.full((8,), float(want), dtype=dtype),
                    rtol=0,
                    atol=0,
                    msg=f"rank {r} call {call}",
                )


def test_jacrev_and_hessian_through_the_real_mesh_equal_in_process():
    """vmap over the backward (jacrev), forward mode over it (hessian; a Hessian-vector product
    by jvp of grad), traced and cached calls.

    (Before the collectives had vmap rules these raised; a bucketed all-reduce done with raw
    process-group calls under the hessian's forward mode summed the primal only, giving each
    rank its local Hessian.)
    """
    got = fpar.launch(D.jacobians, 2, timeout=TIMEOUT)
    want = D.jacobians()
    for r, res in enumerate(got):
        assert set(res) == set(want)
        for k in want:
            torch.testing.assert_close(res[k], want[k], rtol=1e-9, atol=1e-12, msg=f"rank {r} {k}")


def test_gradient_buckets_start_while_the_backward_runs():
    """The last layer's bucket is all-reduced before the backward reaches the first layer.

    (Autograd runs the ready node created last first; the bucket's launch node is created before
    the function's ops, so unless it is given AccumulateGrad's priority it ran after the whole
    backward: no overlap.)
    """
    got = fpar.launch(D.bucket_order, 2, False, timeout=TIMEOUT)
    for r, res in enumerate(got):
        for how, o in res.items():
            seq = o["events"]
            big = seq.index(512 * 512)  # the bucket holding w2 (w1 is in the other one)
            if how == "func_grad":
                _lowered_order(seq)
            else:
                assert big < seq.index("first layer") < seq.index(512 * 8), (r, how, seq)
            assert o["close"], (r, how)


def _lowered_order(seq: list) -> None:
    """Under torch.func.grad the call is lowered (``fpar/_dist/lowered.py``): its whole backward, the
    buckets' all-reduces included, runs inside the call's one op at the transform's level, before
    the hook on the input outside it; inside, it is the ``.backward()`` step checked beside it."""
    assert seq.index(512 * 512) < seq.index(512 * 8) < seq.index("first layer"), seq


def test_a_rank_behind_holds_buckets_instead_of_stopping_the_backward():
    """While the check the loss carries is on its way (rank 1 is behind), rank 0's ready bucket
    is held and its backward goes on to the first layer; the bucket goes after, in order, and
    the gradients are the full batch's, under ``.backward()`` and ``torch.func.grad``."""
    got = fpar.launch(D.bucket_order, 2, True, timeout=TIMEOUT)
    for r, res in enumerate(got):
        for how, o in res.items():
            assert o["close"], (r, how)
    for how, o in got[0].items():
        seq = o["events"]
        if how == "func_grad":
            _lowered_order(seq)
        else:
            assert seq.index("first layer") < seq.index(512 * 512) < seq.index(512 * 8), (how, seq)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_replicated_output_is_not_counted_per_process(n):
    got, _ = check_same_as_local(n, "replicated-output")
    for r in range(n):
        assert torch.equal(got[r]["grad"].t, torch.ones_like(got[r]["grad"].t))
        assert torch.equal(got[r]["backward"].t, torch.ones_like(got[r]["backward"].t))


# ----------------------------------------------------------------------------------------------
# 5. Errors and failure behaviour


ERROR_PHRASES = {
    "in_unknown_axis": ("SpecError", "not an axis of the mesh"),
    "out_unknown_axis": ("SpecError", "not an axis of the mesh"),
    "in_axis_twice": ("SpecError", "more than once"),
    "in_too_long": ("SpecError", "longer than the rank"),
    "not_a_tensor": ("TypeError", "not a tensor"),
    "out_too_long": ("SpecError", "longer than the rank"),
    "replication": ("ReplicationError", "varies over mesh axis"),
    "unbound_axis": ("UnboundAxisError", "not an axis of the mesh"),
    "outside_shard": ("UnboundAxisError", "outside fpar.shard"),
    "psum_scatter_divisible": ("ValueError", "must be divisible by"),
    "psum_scatter_untiled": ("ValueError", "must equal the axis size"),
    "all_to_all_divisible": ("ValueError", "must be divisible by"),
    "all_gather_out_of_range": ("ValueError", "out of range"),
    "ppermute_unique": ("ValueError", "must be unique"),
    "ppermute_range": ("ValueError", "out of range"),
    "prefix": ("SpecError", "in_specs has 2 entries"),
    "all_to_all_untiled": ("ValueError", "must equal the axis size"),
    "unbound_tuple_axis": ("UnboundAxisError", "not an axis of the mesh"),
}


@pytest.mark.parametrize("n", [2, 4])
def test_errors_identical_on_every_rank(n):
    got = dist_result(n, "errors")
    expected = local_result(n, "errors")
    assert set(got[0]["all"]) == set(ERROR_PHRASES)
    for name, (type_name, phrase) in ERROR_PHRASES.items():
        per_rank = [g["all"][name] for g in got]
        assert per_rank[0] is not None, f"{name}: no error on the real mesh"
        assert all(p == per_rank[0] for p in per_rank), f"{name}: ranks disagree: {per_rank}"
        assert per_rank[0][0] == type_name == expected["all"][name][0], (
            name,
            per_rank[0],
            expected["all"][name],
        )
        assert phrase in per_rank[0][1], (name, per_rank[0][1])
    # the boundary errors, raised by rank 0 alone, did not communicate: the ranks stayed in step
    assert got[0]["rank0_alone"] == {k: got[0]["all"][k] for k in D.PRE_COMMUNICATION}
    for g in got:
        torch.testing.assert_close(g["sync1"], torch.full((2,), float(n), dtype=F64))
        torch.testing.assert_close(g["sync2"], torch.full((2,), float(n), dtype=F64))


@pytest.mark.parametrize("n", [2, 4, 8])
def test_mismatched_blocks_raise_on_every_rank(n):
    got = dist_result(n, "mismatch")
    for what in ("shape", "rank", "dtype", "spec", "out_spec", "warm"):
        per_rank = [g[what] for g in got]
        for r, p in enumerate(per_rank):
            assert p is not None, f"{what}: rank {r} raised nothing"
            assert p[0] in ("ValueError", "SpecError") and "different shapes" in p[1], (what, r, p)
    # every rank names the argument, the ranks and what differs
    for g in got:
        assert "args[0] has a different dtype" in g["dtype"][1], g["dtype"]
        assert "rank 1: torch.float32" in g["dtype"][1] and "rank 0: torch.float64" in g["dtype"][1]
        assert "args[0] has a different shape" in g["warm"][1], g["warm"]
        assert "rank 1: (3, 3)" in g["warm"][1] and "rank 0: (2, 3)" in g["warm"][1], g["warm"]
        assert "out_specs/check_rep differ" in g["out_spec"][1], g["out_spec"]
        # before, rank 1's planned call under torch.no_grad() crashed in the bucket hooks; with
        # that mended, the ranks' backwards would send different messages (a gloo abort)
        assert g["grad_mode"][0] == "ValueError", g["grad_mode"]
        assert "gradients, so their next messages would not pair up" in g["grad_mode"][1], g["grad_mode"]
        assert "all-reduced (gradients enabled, outside fpar.defer_reduction()) on rank" in g["grad_mode"][1]
        assert (
            "not computed (under torch.no_grad(), or no such input requires grad) on rank 1"
            in g["grad_mode"][1]
        )
        assert g["requires_grad"][0] == "ValueError", g["requires_grad"]
        assert (
            "args[0] has a different requires_grad on different ranks (rank 0: True, rank 1: False"
            in g["requires_grad"][1]
        )
        assert g["bucket_mb"][0] == "ValueError", g["bucket_mb"]
        assert "bucket_mb differs: rank 0: 1, rank 1: 2" in g["bucket_mb"][1], g["bucket_mb"]
    for g in got:
        torch.testing.assert_close(g["sync"], torch.full((2,), float(n), dtype=F64))


@pytest.mark.parametrize("n", [2, 4])
def test_fast_paths_match_in_process_and_the_unsharded_gradient(n):
    """Steady-state calls (plan cached, bucketed all-reduces) under every gradient API."""
    got, expected = check_same_as_local(n, "fast")
    axes = KWARGS[n]["fast"]["axes"]
    d, h, c, rows = 4, 6, 3, 2 * axes["data"]
    inits = {"w1": D.randn((d, h), 1), "b1": D.randn((h,), 2), "w2": D.randn((h, c), 3)}
    x, y = D.randn((rows, d), 4), D.randn((rows, c), 5)

    def unsharded(p):
        return ((torch.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] - y) ** 2).mean()

    def squared(p):  # the loss read inside the sharded function
        return unsharded(p) ** 2

    g = torch.func.grad(unsharded)(inits)
    gg = torch.func.grad(lambda p: sum((t * t).sum() for t in torch.func.grad(unsharded)(p).values()))(inits)
    g_sq = torch.func.grad(squared)(inits)
    gg_sq = torch.func.grad(lambda p: sum((t * t).sum() for t in torch.func.grad(squared)(p).values()))(inits)
    for r in range(n):
        for k in g:
            torch.testing.assert_close(got[r]["read_inside_grad"][k], g_sq[k])
            torch.testing.assert_close(got[r]["read_inside_func_grad"][k], g_sq[k])
            torch.testing.assert_close(got[r]["read_inside_double_backward"][k], gg_sq[k])
        for name in ("one_bucket", "buckets"):
            for how, scale in (("func_grad", 1), ("autograd_grad", 1), ("backward", 3)):
                for k in g:
                    torch.testing.assert_close(got[r][f"{name}_{how}"][k], scale * g[k])
        for k in g:
            torch.testing.assert_close(got[r]["backward_seeded"][k], 3 * g[k])
        sub = got[r]["backward_inputs"]
        torch.testing.assert_close(sub["w1"], g["w1"])
        assert sub["b1"] is None and sub["w2"] is None  # only what inputs= names
        for k in gg:
            torch.testing.assert_close(got[r]["grad_of_grad"][k], gg[k])
        w = D.randn((d,), 9)
        torch.testing.assert_close(got[r]["mixed"], torch.func.grad(lambda w: (x * w).sum() + w.sum())(w))
        wc = torch.complex(D.randn((d,), 10), D.randn((d,), 11))
        ref = torch.func.grad(lambda w: ((x.to(w.dtype) @ w).abs() ** 2).mean())(wc)
        torch.testing.assert_close(got[r]["complex"], ref)
        torch.testing.assert_close(got[r]["captured"], x.sum(0) / axes["data"])
        for value in (*got[r]["no_grad"], got[r]["inference_mode"]):
            torch.testing.assert_close(value, unsharded(inits))
        for k in g:
            torch.testing.assert_close(got[r]["after_no_grad"][k], g[k])
    if "tensor" in axes:  # w_out used after the psum only: its gradient is not summed over 'tensor'
        t = axes["tensor"]
        w_in, w_out, v = D.randn((d, 2 * t), 6), D.randn((c, 2), 7), D.randn((2 * t, c), 8)
        ref = torch.func.grad(
            lambda a, b, e: (
                ((torch.tanh(x @ a) @ e @ b).sum(dim=(-1, -2)) / axes["data"]).sum() * 0
                + (torch.tanh(x @ a) @ e @ b).sum() / axes["data"]
            ),
            argnums=(0, 1, 2),
        )(w_in, w_out, v)
        torch.testing.assert_close(expected["megatron"][1], ref[1])
        torch.testing.assert_close(expected["megatron"][0].t, ref[0])


def test_launch_refuses_what_spawned_processes_cannot_run(tmp_path):
    with pytest.raises(TypeError, match="lambda or a function defined inside another function"):
        fpar.launch(lambda: 1, 2)

    def local():
        return 1

    with pytest.raises(TypeError, match="Define it at the top level of a module"):
        fpar.launch(local, 2)
    script = tmp_path / "no_guard.py"
    script.write_text("import fpar\n\ndef f():\n    return 1\n\nfpar.launch(f, 2)\n")
    import subprocess
    import sys

    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert 'without an `if __name__ == "__main__":` guard' in run.stderr, run.stderr


def test_rank_raising_stops_the_launch_quickly():
    t0 = time.monotonic()
    with pytest.raises(fpar.LaunchError, match="rank 1 raised") as info:
        fpar.launch(D.raise_on_rank, 2, 1, timeout=20.0)
    elapsed = time.monotonic() - t0
    assert "deliberate failure on rank 1" in str(info.value)
    assert "ValueError" in str(info.value)  # the traceback text comes along
    assert elapsed < 30.0, f"took {elapsed:.1f}s"  # a bound (no hang), not a performance check


def test_stalled_rank_makes_the_others_time_out():
    """A rank stuck outside any collective: the others' collective raises after ``timeout`` s."""
    t0 = time.monotonic()
    with pytest.raises(fpar.LaunchError, match="rank 0 raised") as info:
        fpar.launch(D.hang_on_rank, 2, 1, 120.0, timeout=5.0)
    elapsed = time.monotonic() - t0
    msg = str(info.value)
    waited = re.search(r"collective gave up after ([0-9.]+)s", msg)
    assert waited and 3.0 < float(waited.group(1)) < 30.0, msg  # the configured 5 s, not a hang
    assert "Timed out" in msg, msg
    assert elapsed < 45.0, f"took {elapsed:.1f}s"


def test_dead_rank_stops_the_launch():
    """A rank that dies (os._exit: a segfault, an OOM kill) is the one the error names.

    The survivors' collectives then fail with gloo's "Connection reset by peer"; the error must
    still point at the rank that died, not at a survivor.
    """
    t0 = time.monotonic()
    with pytest.raises(fpar.LaunchError, match="rank 1 exited with code 3"):
        fpar.launch(D.exit_on_rank, 2, 1, 3, timeout=20.0)
    assert time.monotonic() - t0 < 30.0


def test_launched_processes_see_the_callers_environment_path_and_directory(tmp_path, monkeypatch):
    # The processes fork from a server that started with the session's first launch: what the
    # caller changed since (sys.path, the environment, the directory) must still reach them.
    (tmp_path / "late_module.py").write_text(
        "import os\n\n\ndef where():\n    return os.environ.get('FPAR_LATE_VAR'), os.getcwd()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))  # a module the server's sys.path does not have
    import late_module

    fpar.launch(late_module.where, 2)  # the server is up (if it was not already)
    monkeypatch.setenv("FPAR_LATE_VAR", "set after the server started")
    monkeypatch.chdir(tmp_path)
    assert fpar.launch(late_module.where, 2) == [("set after the server started", str(tmp_path))] * 2


def test_launched_processes_hash_with_the_callers_hash_seed(tmp_path, monkeypatch):
    # Python fixes its string-hash seed when it starts, so a process forked from the server keeps
    # the server's: after the caller sets another PYTHONHASHSEED, the launch spawns its processes.
    (tmp_path / "hash_module.py").write_text("def hash_of():\n    return hash('fpar')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import hash_module

    fpar.launch(hash_module.hash_of, 2)  # the server is up (if it was not already)
    seed = "12345" if os.environ.get("PYTHONHASHSEED") != "12345" else "54321"
    monkeypatch.setenv("PYTHONHASHSEED", seed)
    want = subprocess.run(
        [sys.executable, "-c", "print(hash('fpar'))"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert fpar.launch(hash_module.hash_of, 2) == [int(want)] * 2


def test_launch_rejects_zero_processes():
    with pytest.raises(ValueError, match="at least 1"):
        fpar.launch(D.raise_on_rank, 0, 0)


# ----------------------------------------------------------------------------------------------
# 6. make_mesh on a real mesh


@pytest.mark.parametrize("n", [2, 4, 8])
def test_make_mesh_on_a_real_mesh(n):
    every = dist_result(n, "meshes")
    got = every[0]
    for r, g in enumerate(every):
        assert_matches(g, got, {}, r, "meshes (same on every rank)")
    assert got["infer"] == ({"data": n // 2, "tensor": 2}, "dist", n)
    assert got["infer_first"] == {"a": 2, "b": n // 2}
    for what in ("too_big", "too_small", "devices"):
        assert got[what][0] == "ValueError" and "does not match" in got[what][1], (what, got[what])
    assert got["not_divide"][0] == "ValueError" and "does not divide" in got["not_divide"][1]
    # backend="local" inside a process group is the in-process mesh: same values, grads and stats
    expected = D.local_mesh_program()
    assert got["local"]["backend"] == expected["backend"] == "local"
    assert got["local"]["eq"] is True
    for k in ("value", "grad", "stats", "to_dtensor"):
        assert_matches(got["local"][k], expected[k], {}, 0, k)
    assert expected["to_dtensor"][0] == "ValueError"


# ----------------------------------------------------------------------------------------------
# 7. device_put / gather / init / DTensor


@pytest.mark.parametrize("n", [2, 4])
def test_device_put_gather_round_trip(n):
    got, _ = check_same_as_local(n, "layouts")
    x = D.randn((8, 12), 21)
    for g in got:
        for entries in D.LAYOUTS:
            torch.testing.assert_close(g[entries]["gathered"], x)
        torch.testing.assert_close(g["tree_gathered"], {"u": x, "v": [x[:4], x[:, :4]]})


@pytest.mark.parametrize("n", [2, 4, 8])
def test_init_same_global_values_everywhere(n):
    """fpar.init: same global values in-process, on 2/4/8 processes, under every layout."""
    got, expected = check_same_as_local(n, "init")
    reference = expected[0]["gathered"]  # in-process, replicated layout
    for layout in expected[1:]:
        assert_matches(layout["gathered"], reference, {}, 0, "in-process layouts")
    for g in got:
        for layout in g:
            assert_matches(layout["gathered"], reference, {}, 0, f"{n} processes")
    w = reference["w"]
    assert w.dtype == F64 and reference["m"].dtype == torch.float32
    assert abs(w.mean().item() - 1.0) < 0.1 and 0.4 < w.std().item() < 0.6
    assert reference["m"].min() >= -2.0 and reference["m"].max() < 3.0
    assert torch.equal(reference["b"], torch.full((8,), 0.25, dtype=F64))


@pytest.mark.parametrize("n", [2, 4])
def test_dtensor_round_trip(n):
    axes = KWARGS[n]["dtensors"]["axes"]
    x = D.randn((8, 12), 31)
    for r, g in enumerate(dist_result(n, "dtensors")):
        for entries in [("a", "b"), (), (("a", "b"),)]:
            d = g[entries]
            assert d["is_dtensor"] and d["shape"] == (8, 12)
            torch.testing.assert_close(d["full"], x)
            for k in ("back", "other"):
                torch.testing.assert_close(d[k].t, block_of(x, d[k].entries, axes, r))
        assert g["not_mesh_order"][0] == "ValueError" and "mesh order" in g["not_mesh_order"][1]
    with pytest.raises(ValueError, match="in-process"):
        fpar.to_dtensor(x, fpar.make_mesh((2,), ("a",)), P())
