"""The randomized real-mesh tier: drawn training programs and layouts on gloo processes == in-process.

``fpar.testing.strategies.training_programs`` draws whole programs (mesh shape with axes of size
1, data x tensor x pipeline, ZeRO 0-3, accumulation and ``defer_reduction``, dropout, ``.backward()``
and ``torch.func.grad``, several steps with the optimizer's sharded update and evaluation between
them, GPipe and 1F1B); ``fpar.testing.assert_programs_on_real_mesh`` runs them on gloo processes
and in-process and compares every step's loss, gradients, parameters and optimizer state.

Processes are slow to start (each imports torch; the machine has 2 cores), so the programs of
one device count run in one launch.  Which programs: hypothesis draws a deterministic pool
(``derandomize``) and ``cover`` picks from it, greedily, the ones that add the most features not
yet drawn (cheapest first on ties), so twelve programs per device count cover every feature
``REQUIRED`` lists; ``test_ci_programs_cover_every_feature`` keeps that true.

To hunt for bugs beyond CI's sample, set ``FPAR_RANDOM_MESH_SEED`` (a fresh pool drawn with that
seed) and ``FPAR_RANDOM_MESH_PROGRAMS`` (programs per device count, default 12), e.g.
``FPAR_RANDOM_MESH_SEED=7 FPAR_RANDOM_MESH_PROGRAMS=30 pytest tests/test_random_mesh.py -k drawn``.

The default-tier tests below check the kit itself without processes: that a program's values do
not depend on its layout in-process (so a layout bug in the programs cannot hide), that the
comparison finds what differs, and the arguments' errors.  ``test_kit_reports_what_breaks``
checks, on real processes, that a wrong layout, an error on one rank only and a dead process are
each reported against the right program.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

import fpar
from fpar import P
from fpar.testing import TrainingProgram, assert_programs_on_real_mesh, assert_same_on_real_mesh
from fpar.testing import strategies as fst
from fpar.testing._real_mesh import _compare

EXPLORE_SEED = os.environ.get("FPAR_RANDOM_MESH_SEED")  # None in CI: the derandomized pool
PER_LAUNCH = int(os.environ.get("FPAR_RANDOM_MESH_PROGRAMS", "12"))  # programs per device count
POOL = max(300, 10 * PER_LAUNCH)  # drawn programs to choose them from (drawing is cheap; running is not)
TIMEOUT = 400.0  # seconds one launch may take (a hang: every process is stopped after it)


# Choosing the CI programs ---------------------------------------------------------------------


def features(p: TrainingProgram) -> set[str]:
    """What a program exercises, as tags (the greedy choice covers as many as it can)."""
    size = dict(zip(p.names, p.shape))
    f = {
        f"driver={p.driver}",
        f"model={p.model}",
        f"optimizer={p.optimizer}",
        f"axes={len(p.names)}",
        f"shape={p.shape}",
        f"order={p.names}",
    }
    f |= {f"{a}=1" for a, s in size.items() if s == 1}
    f |= {f"{a}>1" for a, s in size.items() if s > 1}
    if sum(s > 1 for s in p.shape) >= 2:
        f.add("two axes larger than 1")
    if len(p.names) == 3:
        f.add("data x tensor x pipe")
        if 1 in p.shape:
            f.add("3 axes, one of size 1")
    if p.driver == "manual":
        f |= {f"grad_api={p.grad_api}", f"accumulation={p.accumulation}"}
    elif p.driver == "zero":
        f |= {f"zero_stage={p.zero_stage}", f"zero_fused={p.fused}", f"precision={p.precision}"}
        if p.n_micro > 1:
            f.add("zero n_micro>1")
    else:
        f |= {f"schedule={p.schedule}", f"chunks={p.chunks}", f"m={p.n_micro}"}
        if p.schedule in ("zb_h1", "zb_v", "dualpipe_v"):
            f.add("split backward (B, W)")
        if p.schedule in ("interleaved_1f1b", "zb_v", "dualpipe_v"):
            f.add("several chunks per stage, scheduled")
        if p.schedule == "interleaved_1f1b" and p.n_micro % size["pipe"]:
            f.add("interleaved, microbatch groups")  # Megatron's microbatch_group_size_per_vp_stage
        f.add("pipeline, pipe>1" if size["pipe"] > 1 else "pipeline, pipe=1")
        if size["data"] > 1:
            f.add("pipeline x data>1")
            if size["pipe"] > 1:
                f.add("pipe>1 x data>1")
        if size.get("tensor", 1) > 1:
            f.add("pipeline x tensor>1")
            if size["data"] > 1:
                f.add("pipeline x data>1 x tensor>1")
    if p.driver != "pipeline" and size.get("pipe", 1) > 1:
        f.add("unreduced pipe>1")
    f.add("remat" if p.remat else "no remat")
    if p.remat and size["data"] > 1:  # recomputation in the backward beside deferred data sums
        if p.driver == "manual" and p.accumulation in ("defer", "accumulate"):
            f.add("deferred x remat")
        if p.driver == "pipeline" and p.schedule in ("zb_h1", "zb_v", "dualpipe_v"):
            f.add("split backward x remat x data>1")
    f.add("checkpoint" if p.checkpoint else "no checkpoint")
    f.add("dropout" if p.dropout else "no dropout")
    f.add("clip" if p.clip is not None else "no clip")
    f.add("donate" if p.donate else "no donate")
    f.add("several steps" if p.steps > 1 else "one step")
    f.add("eval" if p.evaluate else "no eval")
    if p.steps > 1 and p.evaluate:
        f.add("eval between steps")
    return f


REQUIRED = {
    "driver=manual", "driver=zero", "driver=pipeline",
    "grad_api=func_grad", "grad_api=backward",
    "accumulation=loop", "accumulation=defer", "accumulation=accumulate",
    "zero_stage=0", "zero_stage=1", "zero_stage=2", "zero_stage=3",
    "schedule=gpipe", "schedule=1f1b", "split backward (B, W)", "several chunks per stage, scheduled",
    "pipeline, pipe>1", "pipeline, pipe=1", "unreduced pipe>1",
    "model=mlp", "model=gpt", "model=sp_gpt", "model=moe", "dropout", "clip", "donate", "several steps",
    "eval between steps", "remat", "checkpoint", "precision=bf16", "precision=fp16",
    "data x tensor x pipe", "3 axes, one of size 1", "data=1", "tensor=1", "pipe=1",
    "pipeline x data>1", "pipeline x tensor>1", "deferred x remat",
}  # fmt: skip
REQUIRED_AT = {
    2: REQUIRED | {"interleaved, microbatch groups"},  # on 4 only a costly program draws it
    4: REQUIRED
    | {"two axes larger than 1", "pipeline x data>1 x tensor>1", "pipe>1 x data>1"}
    | {"split backward x remat x data>1"},  # the case that defeated an unmatched-deferral check
}


def cost(p: TrainingProgram) -> float:
    """A rough relative run time (a GPT block is slow to trace; steps and microbatches add up)."""
    per_step = (3.0 if p.model != "mlp" else 1.0) * p.layers * (1 + 0.3 * p.n_micro)
    return per_step * (p.steps + 0.5 * p.evaluate) * (1 + 0.5 * (p.driver == "pipeline"))


def draw_pool(devices: int, count: int = POOL) -> list[TrainingProgram]:
    """``count`` programs drawn by hypothesis without repeats: deterministically, or from
    ``FPAR_RANDOM_MESH_SEED`` when it is set."""
    drawn: list[TrainingProgram] = []

    @seed(int(EXPLORE_SEED or 0))
    @settings(
        max_examples=count,
        derandomize=EXPLORE_SEED is None,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(fst.training_programs(devices=devices, compile=EXPLORE_SEED is not None))
    def collect(program):
        drawn.append(program)

    collect()
    return list(dict.fromkeys(drawn))


def cover(pool: list[TrainingProgram], k: int, required: set[str]) -> list[TrainingProgram]:
    """Greedily pick ``k`` programs, each adding the most ``required`` features not yet covered,
    then the most other features, the cheapest first."""
    chosen: list[TrainingProgram] = []
    covered: set[str] = set()
    rest = list(pool)
    while rest and len(chosen) < k:
        best = max(
            rest,
            key=lambda p: (len((features(p) & required) - covered), len(features(p) - covered), -cost(p)),
        )
        rest.remove(best)
        chosen.append(best)
        covered |= features(best)
    return chosen


@functools.cache
def ci_programs(n: int) -> tuple[TrainingProgram, ...]:
    """The programs CI runs on ``n`` processes (drawn when first asked for, not at import: the
    processes import this module too)."""
    return tuple(cover(draw_pool(n), PER_LAUNCH, REQUIRED_AT.get(n, REQUIRED)))


@pytest.mark.skipif(EXPLORE_SEED is not None, reason="FPAR_RANDOM_MESH_SEED draws another sample")
def test_ci_programs_cover_every_feature():
    """The programs CI runs are not degenerate: on each device count they cover every required
    feature (on 4 devices also two axes larger than 1, and pipelines with data x tensor and with
    pipe x data)."""
    for n in (2, 4):
        programs = ci_programs(n)
        assert len(programs) == PER_LAUNCH and len(set(programs)) == PER_LAUNCH
        got = set().union(*map(features, programs))
        assert not REQUIRED_AT[n] - got, (n, sorted(REQUIRED_AT[n] - got))


# The tier ------------------------------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.parametrize("n", [2, 4])
def test_drawn_programs_match_in_process(n):
    """Every CI program on ``n`` gloo processes == on the in-process mesh of the same shape."""
    t0 = time.monotonic()
    report = assert_programs_on_real_mesh(ci_programs(n), timeout=TIMEOUT)
    assert report["launches"] == 1, report
    assert time.monotonic() - t0 < TIMEOUT


# The kit itself on real processes: what it reports ----------------------------------------------------


def user_loop(mesh: fpar.Mesh, spec_of_x: P) -> dict:
    """A user's two-step training loop, written for any mesh (device_put in, gather out); placing
    the batch with ``spec_of_x = P()`` where the shard says ``P("data")`` is a layout bug that only
    a real mesh shows (in-process ``device_put`` is the identity)."""
    x = torch.arange(8.0, dtype=torch.float64).reshape(4, 2)
    w = torch.ones(2, dtype=torch.float64, requires_grad=True)
    step = fpar.shard(lambda x, w: fpar.psum(((x @ w) ** 2).sum(), "data") / 4, mesh, (P("data"), P()), P())
    out = {}
    for t in range(2):
        loss = step(fpar.device_put(x, mesh, spec_of_x), w)
        (g,) = torch.autograd.grad(loss, w)
        with torch.no_grad():
            w -= 0.01 * g
        out[f"step {t}"] = {"loss": loss.detach(), "w": w.detach().clone()}
    return out


def faulty(mesh: fpar.Mesh, program: TrainingProgram) -> dict:
    """What each process runs in ``test_kit_reports_what_breaks``: by the program's seed, 1 the
    user loop with the wrong layout; 4 with the right one; 5 blocks returned instead of global
    values; 2 an error on rank 1 only, after the training (before it, rank 0 would wait in a
    collective until the timeout); 3 rank 1 dies.  Others: the program itself."""
    rank = torch.distributed.get_rank() if mesh.backend == "dist" else 0
    if program.seed in (1, 4):
        return user_loop(mesh, P() if program.seed == 1 else P("data"))
    if program.seed == 5:
        return {"blocks": fpar.device_put(torch.ones(4), mesh, P("data"))}
    if program.seed == 3 and rank == 1:
        os._exit(3)
    trace = program.run(mesh)
    if program.seed == 2 and rank == 1:
        raise RuntimeError("deliberate failure on rank 1 only")
    return trace


@pytest.mark.multiprocess
def test_kit_reports_what_breaks():
    """A wrong layout, blocks for global values, an error on one rank and a dead rank, each
    reported against its program, on every rank alike; a right user loop passes; the launch goes
    on after a mismatch, and a fresh one runs the programs after an error."""
    data2 = TrainingProgram((2,), ("data",), steps=1)
    programs = [
        TrainingProgram((1, 2), ("pipe", "data"), driver="pipeline", steps=1),
        dataclasses.replace(data2, seed=1),
        dataclasses.replace(data2, seed=4),
        dataclasses.replace(data2, seed=5),
        TrainingProgram((2, 1), ("data", "tensor"), steps=1),
        dataclasses.replace(data2, seed=2),
        dataclasses.replace(data2, seed=3),
    ]
    with pytest.raises(AssertionError) as info:
        assert_programs_on_real_mesh(programs, timeout=TIMEOUT, run=faulty)
    msg = str(info.value)
    assert msg.startswith("4 of 7 programs differ on a real mesh from the in-process mesh (2 launches, "), msg
    sections = {int(s.split(":", 1)[0]): s for s in msg.split("\n--- program ")[1:]}
    assert sorted(sections) == [1, 3, 5, 6], msg
    # the wrong layout: every rank reports the leaves that differ, by path, with the numbers
    wrong = sections[1]
    assert "fpar.testing.assert_same_on_real_mesh(faulty) on the real mesh [data=2]: values differ" in wrong
    assert "ranks 0, 1: 4 value(s) differ" in wrong, wrong
    for leaf in ("['step 0']['loss']", "['step 0']['w']", "['step 1']['loss']", "['step 1']['w']"):
        assert f"{leaf}: max abs error" in wrong, wrong
    assert "reproduce: fpar.testing.assert_programs_on_real_mesh([fpar.testing.TrainingProgram(" in wrong
    # blocks where global values were due: the shape difference says to gather
    assert "['blocks']: shape (2,) on the real mesh, (4,) in-process" in sections[3], sections[3]
    assert "bring blocks back with fpar.gather" in sections[3]
    # the error on rank 1: reported with rank 1's traceback; rank 0 is said to have been fine
    raised = sections[5]
    assert "it raised where the in-process mesh returned" in raised, raised
    assert "rank 0: same as in-process" in raised, raised
    assert "rank 1 raised RuntimeError: deliberate failure on rank 1 only" in raised, raised
    assert "traceback (rank 1)" in raised
    # the dead rank: the fresh launch failed while program 6 ran
    dead = sections[6]
    assert "the launch failed while this program ran" in dead and "rank 1 exited with code 3" in dead, dead


# The kit without processes ------------------------------------------------------------------------


def _layout_free(trace: dict, p: TrainingProgram) -> dict:
    """The values of a trace that do not depend on the layout (ZeRO's chunks and per-rank
    gradients do; a pipeline's optimizer state is in stage-major order)."""
    out = {}
    for k, v in trace.items():
        if not isinstance(v, dict):
            out[k] = v
            continue
        keep = {"loss", "params"}
        if p.driver != "zero" or p.zero_stage == 0:
            keep |= {"grads", "opt_state"}
        if p.driver == "pipeline" and p.chunks > 1:
            keep -= {"opt_state"}
        out[k] = {name: x for name, x in v.items() if name in keep}
    return out


def _on_one_device(p: TrainingProgram) -> TrainingProgram:
    """The same program on a mesh of the same axes, every one of size 1 (a pipeline: one stage
    holding every chunk, GPipe)."""
    kw = dict(shape=(1,) * len(p.names))
    if p.driver == "pipeline":
        kw.update(schedule="gpipe", chunks=p.layers)
    return dataclasses.replace(p, **kw)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fst.training_programs(devices=(2, 4), compile=False))
def test_program_values_do_not_depend_on_the_layout(program):
    """In-process, each drawn program computes what it computes on one device: its layouts are
    right (so a real mesh that differs from the in-process mesh is the real mesh's fault, and a
    program cannot hide a bug behind a layout of its own).  Accumulation with dropout takes each
    device's piece of the batch per microbatch, so its microbatches (and masks) follow the layout:
    left out."""
    if program.dropout and (
        program.accumulation == "accumulate" or (program.driver == "zero" and program.n_micro > 1)
    ):
        program = dataclasses.replace(program, dropout=0.0)
    mesh = fpar.make_mesh(program.shape, program.names, backend="local")
    one = _on_one_device(program)
    got = program.run(mesh)
    want = one.run(fpar.make_mesh(one.shape, one.names, backend="local"))
    rtol, atol = (1e-9, 1e-11) if program.precision == "fp64" else program.tolerance
    problems = _compare(_layout_free(got, program), _layout_free(want, program), rtol, atol)
    assert not problems, f"{program.describe()}:\n" + "\n".join(problems)


def test_compare_names_each_leaf_that_differs():
    want = {
        "a": torch.zeros(3, dtype=torch.float64),
        "b": [torch.ones(2, 2, dtype=torch.float64), 3],
        "i": torch.arange(3),
    }
    same = {
        "a": torch.full((3,), 1e-13, dtype=torch.float64),
        "b": [torch.ones(2, 2, dtype=torch.float64), 3],
        "i": torch.arange(3),
    }
    assert _compare(same, want, None, None) == []
    bad_b = torch.ones(2, 2, dtype=torch.float64)
    bad_b[1, 0] += 1e-6
    got = {
        "a": torch.tensor([0.0, math.nan, 0.0], dtype=torch.float64),
        "b": [bad_b, 4],
        "i": torch.tensor([0, 1, 3]),
    }
    problems = _compare(got, want, None, None)
    assert len(problems) == 4, problems
    assert (
        problems[0].startswith("['a']: max abs error inf") and "1 of 3 elements; worst at [1]" in problems[0]
    )
    assert problems[1].startswith("['b'][0]: max abs error 1e-06") and "worst at [1, 0]" in problems[1]
    assert problems[2] == "['b'][1]: real mesh 4, in-process 3"
    assert problems[3] == "['i']: 1 of 3 elements differ (exact dtype torch.int64)"
    # a looser tolerance passes the float difference; NaN where both have NaN is equal
    assert _compare({"x": bad_b}, {"x": torch.ones(2, 2, dtype=torch.float64)}, 1e-5, 0) == []
    nan = torch.tensor([math.nan], dtype=torch.float64)
    assert _compare(nan, nan.clone(), None, None) == []
    assert _compare(torch.ones(2), torch.ones(4), None, None)[0].startswith(
        "the result: shape (2,) on the real mesh, (4,)"
    )
    assert "structure differs" in _compare([torch.ones(1)], (torch.ones(1),), None, None)[0]
    assert _compare(torch.ones(2), torch.ones(2, dtype=torch.float64), None, None) == [
        "the result: dtype torch.float32 on the real mesh, torch.float64 in-process"
    ]


def test_float32_uses_the_default_tolerance():
    want = torch.ones(4)
    assert _compare(want + 1e-7, want, None, None) == []
    assert _compare(want + 1e-3, want, None, None)


def test_training_program_rejects_what_it_cannot_run():
    two_chunks = dict(shape=(2, 1), names=("pipe", "data"), driver="pipeline", layers=4, chunks=2)
    cases = [
        (dict(shape=(2,), names=("tensor",)), "including 'data'"),
        (dict(shape=(2, 2), names=("data",)), "as long as each other"),
        (dict(shape=(2,), names=("data",), model="gpt"), "needs a 'tensor' axis"),
        (dict(shape=(2,), names=("data",), schedule="zb_v"), "schedule and chunks are for driver='pipeline'"),
        (
            dict(shape=(2,), names=("data",), precision="bf16"),
            "precision is for driver='zero' with fused=True",
        ),
        (dict(shape=(2,), names=("data",), driver="zero", compile=True, steps=1), "need steps >= 2"),
        (dict(shape=(2,), names=("data",), driver="zero", grad_api="backward"), "are for driver='manual'"),
        (dict(two_chunks, schedule="dualpipe_v"), "needs n_micro >= 2 x the pipe size"),
        (
            dict(two_chunks, schedule="interleaved_1f1b"),
            "schedule='interleaved_1f1b' needs n_micro >= the pipe size",
        ),
        (dict(shape=(2,), names=("data",), driver="pipeline"), "needs a 'pipe' axis"),
        (
            dict(shape=(1, 2), names=("pipe", "data"), driver="pipeline", layers=2),
            "layers = pipe size x chunks = 1",
        ),
        (dict(shape=(2,), names=("data",), n_micro=2), "n_micro > 1 needs an accumulation"),
        (dict(shape=(2,), names=("data",), zero_stage=2), "0, 2 or 3 with driver='pipeline'"),
        (dict(shape=(2,), names=("data",), optimizer="lamb"), "optimizer='lamb' must be one of"),
        (
            dict(
                shape=(2, 2), names=("pipe", "data"), driver="pipeline", layers=4, chunks=2, schedule="1f1b"
            ),
            "schedule='1f1b' runs chunks in (1,) per stage, not 2",
        ),
        (dict(shape=(2,), names=("data",), dropout=1.0), "dropout=1.0 must be in [0, 1)"),
    ]
    for kw, phrase in cases:
        with pytest.raises(ValueError, match="fpar.testing.TrainingProgram: ") as info:
            TrainingProgram(**kw)
        assert phrase in str(info.value), (kw, str(info.value))
    p = TrainingProgram([2, 1], ["data", "tensor"], driver="zero", zero_stage=3, dropout=0.25, evaluate=True)
    assert p.shape == (2, 1) and p.devices == 2 and hash(p) == hash(eval("fpar.testing." + repr(p)))
    assert p.describe() == "[data=2xtensor=1] mlp x1, ZeRO-3 zero_step, sgd, dropout 0.25, 2 steps, eval"
    with pytest.raises(ValueError, match="is not the program's"):
        p.run(fpar.make_mesh((1, 2), ("data", "tensor"), backend="local"))


def test_run_returns_every_step_and_evaluation():
    p = TrainingProgram(
        (2, 2),
        ("data", "tensor"),
        model="gpt",
        driver="zero",
        zero_stage=1,
        fused=False,
        steps=2,
        evaluate=True,
    )
    trace = p.run(fpar.make_mesh(p.shape, p.names, backend="local"))
    assert list(trace) == ["step 0", "eval 0", "step 1", "eval 1"]
    assert sorted(trace["step 0"]) == ["grads", "loss", "opt_state", "params"]
    assert trace["step 0"]["params"]["stages"]["attn"]["w_qkv"].shape == (1, 8, 3, 8)
    assert trace["step 0"]["grads"]["first"]["w"].shape == (2, 3, 8)  # ZeRO-1: each data rank's own
    assert not torch.equal(trace["step 0"]["params"]["first"]["w"], trace["step 1"]["params"]["first"]["w"])


def test_helpers_reject_bad_arguments():
    local = fpar.make_mesh((2,), ("data",), backend="local")
    with pytest.raises(ValueError, match="mesh must be a real mesh"):
        assert_same_on_real_mesh(lambda m: {}, local)
    with pytest.raises(TypeError, match=r"programs\[0\] is a dict, not a fpar.testing.TrainingProgram"):
        assert_programs_on_real_mesh([{}])
    for bad, phrase in (
        (dict(devices=3), "powers of two"),
        (dict(drivers=("ddp",)), "drivers must be among"),
        (dict(models=("gpt",)), "models must include 'mlp'"),
        (dict(max_steps=0), "max_steps must be >= 1"),
    ):
        with pytest.raises(ValueError, match=phrase):
            fst.training_programs(**bad)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_strategy_draws_valid_programs_of_the_asked_kinds(data):
    devices = data.draw(st.sampled_from([1, 2, 4, 8]))
    drivers = data.draw(
        st.sampled_from([("manual",), ("zero",), ("pipeline",), ("manual", "zero", "pipeline")])
    )
    p = data.draw(fst.training_programs(devices=devices, drivers=drivers, max_steps=2))
    assert p.devices == devices and p.driver in drivers and 1 <= p.steps <= 2
    assert all(s in (1, 2, 4) for a, s in zip(p.names, p.shape) if a != "data")
