"""``torch.compile`` through ``fpar.shard``, on both meshes: values, never a silent local gradient.

pytorch#193279: under ``torch.compile(torch.func.grad(f))`` Dynamo drops an ``autograd.Function``'s
custom backward, so a backward that all-reduces would return each device's *local* gradient.
Every form (see docs/compile.md) is checked against the *unsharded* function's gradient
computed by plain torch autograd; the data-parallel loss's gradient needs the all-reduce, so a
dropped backward would show as a large difference.  Tests use the ``aot_eager`` backend (Dynamo and
AOTAutograd, where the bug lives, without a C++ compile); ``bench/compile.py`` checks inductor's
gradients before timing them.
"""

from __future__ import annotations

import compile_programs as C
import pytest
import torch

import fpar
from fpar import P
from fpar._compile import REASON, WHOLE_STEP

F64 = torch.float64
TOL = 1e-12
# torch's own warnings while Dynamo traces `loss.backward()` and `SGD.step` (not fpar's)
pytestmark = [
    pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]
FORMS = ("a", "b", "c", "c_tp", "d")


def _check_forms(out: dict, *, real: bool) -> None:
    for name in FORMS:
        rec = out[name]
        assert rec[0] == "ok", f"form {name} raised {rec[1]}: {rec[2]}"
        assert rec[1] < TOL, f"form {name}: gradient differs from the unsharded one by {rec[1]}"
    # On both meshes a step around a sharded call whose signature an eager call checked (form a
    # did) is traced whole (test_compile_step.py).  fullgraph=True over what cannot be traced (on
    # a real mesh, a collective in a per-device f compiled on its own) is refused with the reason
    # and the fix; in-process that f runs eagerly.
    if not WHOLE_STEP:  # torch < 2.13: refused, naming the version (and run eagerly without fullgraph)
        assert (
            out["a_fullgraph"][:2] == ("error", "Unsupported") and "needs torch 2.13" in out["a_fullgraph"][2]
        )
    else:
        assert out["a_fullgraph"][0] == "ok", out["a_fullgraph"]
    if real:
        kind, err_type, message = out["c_fullgraph"]
        assert (kind, err_type) == ("error", "Unsupported")
        assert "pytorch#193279" in message and "fpar.shard(torch.compile(f), ...)" in message
    else:  # in-process, f compiled on its own runs eagerly in an eager call (any torch)
        assert out["c_fullgraph"][0] == "ok"
    # the real mesh's planned calls run the compiled per-device function (the tensor-parallel one
    # as two graphs, split at the psum, whose value the function reads: a plain tensor, not the
    # Pending a returned loss is, which Dynamo would not trace); in-process it runs eagerly
    graphs, tp_graphs = out["c"][2], out["c_tp"][2]
    assert (graphs >= 1 and tp_graphs >= 2) if real else (graphs, tp_graphs) == (0, 0)
    # fpar's own frames (hooks, backward, the Pending loss), called back during a compiled step's
    # backward, are never compiled: a hook compiled per tensor slot made the step slower than eager
    assert out["fpar_frames"] == []


def test_every_form_in_process_equals_the_unsharded_gradient():
    _check_forms(C.run_forms(), real=False)


@pytest.mark.multiprocess
def test_every_form_on_a_real_mesh_equals_the_unsharded_gradient():
    for out in fpar.launch(C.run_forms, 2, timeout=120):
        _check_forms(out, real=True)


def test_fullgraph_refusal_names_the_form_and_the_fix():
    assert "fullgraph=True" in REASON and "pytorch#193279" in REASON
    assert "fpar.shard(torch.compile(f), ...)" in REASON


# The in-process mesh's own Functions (fpar/_local/collective.py) under compile + grad --------

MESH = fpar.make_mesh((2,), ("i",))


def _tp(w1, w2, x):  # Megatron MLP: w1 split by columns, w2 by rows
    return fpar.psum((torch.tanh(x @ w1) @ w2).sum(), "i")


def _tp_ref(w1, w2, x):
    return (torch.tanh(x @ w1) @ w2).sum()


def _gather_invariant(x, c, _):  # its transpose is a local slice, not an all-reduce
    return (fpar.all_gather_invariant(x, "i", tiled=True) * c).pow(2).sum()


def _gather_invariant_ref(x, c, _):
    return (x * c).pow(2).sum()


def _gather_then_mean(x, c, _):
    return fpar.pmean((fpar.all_gather(x, "i", tiled=True) * c).pow(2).sum(), "i")


def _permute_and_max(x, c, _):
    y = fpar.ppermute(x, "i", [(0, 1), (1, 0)])
    return fpar.psum((y * c).sum(), "i") + fpar.pmax(x.max(), "i")


def _permute_and_max_ref(x, c, _):
    y = torch.cat(x.chunk(2)[::-1])
    return (y * torch.cat([c, c])).sum() + x.max()


def _scatter(x, c, _):  # x replicated: psum_scatter's transpose is an all_gather
    return fpar.psum((fpar.psum_scatter(x * c, "i", tiled=True) ** 2).sum(), "i")


def _scatter_ref(x, c, _):
    return ((2 * x * c) ** 2).sum()


CASES = {
    "psum (tensor parallel)": (_tp, _tp_ref, (P(None, "i"), P("i"), P()), ((4, 6), (6, 3), (5, 4))),
    "all_gather_invariant": (
        _gather_invariant,
        _gather_invariant_ref,
        (P("i"), P(), P()),
        ((6, 3), (3,), (1,)),
    ),
    "all_gather + pmean": (
        _gather_then_mean,
        _gather_invariant_ref,
        (P("i"), P(), P()),
        ((6, 3), (3,), (1,)),
    ),
    "ppermute + pmax": (_permute_and_max, _permute_and_max_ref, (P("i"), P(), P()), ((6, 3), (3, 3), (1,))),
    "psum_scatter": (_scatter, _scatter_ref, (P(), P(), P()), ((6, 3), (3,), (1,))),
}


@pytest.mark.parametrize("case", list(CASES))
def test_in_process_collectives_under_compile_and_grad(case):
    f, ref, specs, shapes = CASES[case]
    g = torch.Generator().manual_seed(1)
    args = [torch.randn(s, dtype=F64, generator=g) for s in shapes]
    want = torch.func.grad(ref, argnums=(0, 1))(*args)
    sharded = fpar.shard(f, MESH, specs, P())
    got_grad = torch.compile(torch.func.grad(sharded, argnums=(0, 1)), backend="aot_eager")(*args)

    def step(a, b, c):
        sharded(a, b, c).backward()

    leaves = [a.clone().requires_grad_() for a in args[:2]]
    torch.compile(step, backend="aot_eager")(*leaves, args[2])
    for got in (got_grad, [p.grad for p in leaves]):
        for gt, w in zip(got, want):
            torch.testing.assert_close(gt, w, rtol=1e-12, atol=1e-12)


@pytest.mark.multiprocess
@pytest.mark.parametrize("n", [1, 2], ids=["in-process", "real"])
def test_a_function_compiled_inside_the_per_device_function_before_dynamo_loads(n, tmp_path):
    """fpar runs compiled functions eagerly inside a sharded call, but sets no stance while Dynamo
    is not loaded (setting it would load Dynamo, ~2 s of every process that never compiles).  A
    helper compiled inside ``f`` on its first call, in fresh processes, gives the unsharded values
    and gradients: in one process (data=2) and under torchrun on 2 gloo processes."""
    import os
    import sys
    from pathlib import Path

    from torchrun_util import run, torchrun

    program = Path(__file__).resolve().parent / "torchrun_programs" / "compiled_inside.py"
    if n > 1:
        res = torchrun(n, [program], timeout=300, cwd=tmp_path)
    else:
        res = run(
            [sys.executable, str(program)],
            timeout=300,
            cwd=tmp_path,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    said = f"--- stdout ---\n{res.stdout[-3000:]}\n--- stderr ---\n{res.stderr[-3000:]}"
    assert res.returncode == 0, said
    results = [line.split()[1:] for line in res.stdout.splitlines() if line.startswith("RESULT")]
    assert len(results) == n, said
    for loaded_before, worst in results:
        assert loaded_before == "False", "the fresh process had loaded Dynamo: the case is not tested"
        assert float(worst) < TOL, said
