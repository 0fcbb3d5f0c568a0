"""fpar.hf.pipeline_stages on every family ``transformers`` ships a pp plan for: never a silently wrong loss.

Each family is built tiny (``pp_families.tiny``: float64, eager attention, random weights) with
every scaling its config has moved off its default (Granite's multipliers, Cohere's logit scale,
soft-caps, routed-expert scales, ...) and its embeddings tied or not as the family's config ties
them by default (15 tie them; 10 of those run here: Cohere 1/2, Gemma 1-3, VaultGemma, ERNIE 4.5,
SmolLM3, StarCoder2, Cohere2-MoE), cut into 2 stages and run by GPipe over 2 microbatches.
Two layers each, or as few more as the family's layers need to cut into 2 stages
(``pp_families.pipeline_layers``: 3 where a dense layer comes before the MoE layers, 4 where
linear and full attention layers alternate).
The pipeline's loss and every gradient must equal the unsharded model's own forward; or fpar
refuses the model by name when it is built (``tensor_parallel`` / ``pipeline_stages``), before any
step runs, or at its first forward where only running the layers tells (GLM-DSA's layers return
their top-k indices for the next layer, which a stage cannot pass on).  A family whose tiny model ``transformers`` itself cannot build or run from the shared
small sizes is skipped with the reason (a limit of this test's config, not of fpar).

The tensor axis is 1 here, so that what is tested is the cut; tensor=2 x pipe=2 for the families
the issue reported (Cohere, Granite) is in ``test_hf_pipeline.py``.  Tolerances: the loss to
1e-7 relative, each gradient to 1e-6 of its largest entry.  Many families compute norms, routers
or linear attention in float32 inside a float64 model, whose rounding moves with the batch layout
(1e-7 relative); a dropped scaling moves the loss by 1e-4 to 1e-1.
"""

from __future__ import annotations

import pytest
import torch

import fpar
import fpar.pipeline as pp

transformers = pytest.importorskip(
    "transformers", reason="the hf extra (pip install fpar[hf]) is not installed"
)

import pp_families  # noqa: E402  (needs transformers)

M, B, T, V = 2, 2, 4, 64
MESH = fpar.make_mesh((2, 1), ("pipe", "tensor"))


def _batch():
    ids = torch.randint(0, V, (M, B, T + 1), generator=torch.Generator().manual_seed(1))
    return ids[..., :-1], ids[..., 1:]


@pytest.fixture(autouse=True)
def _quiet():
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # tiny configs trip token-id range warnings
    yield
    transformers.logging.set_verbosity(level)


@pytest.mark.parametrize("family", list(pp_families.families()))
def test_every_pp_plan_family_equals_its_own_forward_or_is_refused(family):
    try:
        layers = pp_families.pipeline_layers(family)
        structure, _ = pp_families.tiny(family, meta=True, layers=layers)
    except Exception as e:  # noqa: BLE001 (transformers' own failure on this test's tiny sizes)
        pytest.skip(f"the tiny {family} model does not build in transformers: {type(e).__name__}: {e}")
    cls = type(structure).__name__
    try:  # the structure decides a refusal: checked on the meta model first (fast), then for real
        apply_fn, _, specs = fpar.ops.tensor_parallel(structure, MESH)
        fpar.hf.pipeline_stages(apply_fn, specs, MESH)
    except (ValueError, TypeError) as e:  # a refusal by name, before any step runs
        assert str(e).startswith(("fpar.hf.pipeline_stages", "fpar.ops.tensor_parallel")), e
        assert cls in str(e), f"the refusal does not name {cls}: {e}"
        return
    try:
        model, moved = pp_families.tiny(family, layers=layers)
        xs, ys = _batch()
        want_loss, want_grads = pp_families.reference(model, xs, ys)
    except Exception as e:  # noqa: BLE001 (transformers' own failure on this test's tiny sizes)
        pytest.skip(f"the tiny {family} model does not run in transformers: {type(e).__name__}: {e}")
    apply_fn, params, specs = fpar.ops.tensor_parallel(model, MESH)
    stages = fpar.hf.pipeline_stages(apply_fn, specs, MESH)
    step = pp.pipeline(stages.stage, pp.gpipe(2, M), MESH, loss=stages.loss, first=stages.first)
    try:
        result = step(stages.split(params), xs, ys)
    except ValueError as e:  # refused by name at the first forward (layers passing state on: GLM-DSA)
        assert str(e).startswith("fpar.hf.pipeline_stages") and cls in str(e), e
        return
    rtol = 1e-7 if want_loss.dtype == torch.float64 else 1e-6  # Beam's loss is float32: a few ulps
    torch.testing.assert_close(
        result.loss, want_loss, rtol=rtol, atol=0, msg=lambda m: f"{family} {moved}: {m}"
    )
    grads = apply_fn.export(stages.merge(result.grads))
    assert set(grads) == set(want_grads)
    for k, g in want_grads.items():
        atol = 1e-6 * float(g.abs().max()) + 1e-12
        torch.testing.assert_close(grads[k], g, rtol=1e-5, atol=atol, msg=lambda m, k=k: f"{family} {k}: {m}")


def test_the_sweep_moves_the_scalings_the_reported_families_have():
    """The families reported silently wrong are in the sweep, with their scalings moved."""
    _, granite = pp_families.tiny("granite")
    _, cohere = pp_families.tiny("cohere")
    assert {"embedding_multiplier", "logits_scaling", "residual_multiplier", "attention_multiplier"} <= set(
        granite
    )
    assert "logit_scale" in cohere
    _, gemma2 = pp_families.tiny("gemma2")
    assert {"final_logit_softcapping", "attn_logit_softcapping"} <= set(gemma2)


@pytest.mark.parametrize("call_site_check", [True, False], ids=["call-site", "step-backstop"])
def test_layers_passing_state_on_are_refused_not_unpacked_along_the_batch(monkeypatch, call_site_check):
    """HY-V4's layers return (hidden, top-k indices) and its forward unpacks them: a stage's first slot
    gives a tensor, which with 2 rows a microbatch would unpack along the batch without an error.  The
    call site is read first; a layer returning a tuple is refused by the step slots in any case."""
    import fpar.hf._shell as shell

    if not call_site_check:
        monkeypatch.setattr(shell, "_taken_apart", lambda frame: False)
    model, _ = pp_families.tiny("hy_v4", layers=2, mlp_layer_types=["sparse", "sparse"])
    xs, ys = _batch()
    assert xs.shape[1] == 2  # rows a microbatch: a [2, T, ...] tensor unpacks into two
    apply_fn, params, specs = fpar.ops.tensor_parallel(model, MESH)
    stages = fpar.hf.pipeline_stages(apply_fn, specs, MESH)
    step = pp.pipeline(stages.stage, pp.gpipe(2, M), MESH, loss=stages.loss, first=stages.first)
    with pytest.raises(
        ValueError,
        match=r"fpar.hf.pipeline_stages: HYV4ForCausalLM's decoder layers "
        r"\(HYV4DecoderLayer\) return more than the hidden state",
    ):
        step(stages.split(params), xs, ys)
