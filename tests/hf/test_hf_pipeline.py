"""fpar.hf.pipeline_stages: an HF decoder cut by its base_model_pp_plan, run by fpar.pipeline's schedules.

The reference is the unsharded ``transformers`` model itself (``functional_call`` on its own
parameters, eager attention, float64): the mean over microbatches of its next-token
cross-entropy, and that loss's gradient.  The pipeline's loss and every gradient (merged back
to the model's names and layout) must equal it, in-process (pipe x tensor, pipe x data x
tensor; 1F1B, GPipe, interleaved 1F1B) and on 2 gloo processes (pipe=2).
"""

from __future__ import annotations

import hypothesis
import hypothesis.strategies as st
import pytest
import torch

import fpar
import fpar.pipeline as pp

transformers = pytest.importorskip(
    "transformers", reason="the hf extra (pip install fpar[hf]) is not installed"
)

import pp_families  # noqa: E402  (needs transformers)

V, M, B, T = 64, 2, 2, 4


def _model(config_cls: str, model_cls: str, randomize: bool = True, **kw):
    """A tiny float64 causal LM of 4 layers; ``randomize``: random weights, norms included (ones
    would hide a dropped or doubled scale)."""
    cfg = dict(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
    )
    cfg.update(kw)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**cfg))
    if randomize:
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.3)
    return model.double().eval()


def qwen3(tied: bool = False):
    return _model("Qwen3Config", "Qwen3ForCausalLM", randomize=False, tie_word_embeddings=tied)


def batch():
    ids = torch.randint(0, V, (M, B, T + 1), generator=torch.Generator().manual_seed(1))
    return ids[..., :-1], ids[..., 1:]


def reference(model, xs, ys):
    """The unsharded model's mean loss over the microbatches and its gradient, by parameter name."""
    model.set_attn_implementation("eager")
    return pp_families.reference(model, xs, ys)


def check(result, stages, apply_fn, want_loss, want_grads, rel: float = 0.0):
    """Equal to 1e-12; ``rel``: the loss to ``rel`` relative and each gradient to ``rel`` of its
    largest entry (for families that route or normalise in float32 inside a float64 model)."""
    grads = apply_fn.export(stages.merge(result.grads))
    torch.testing.assert_close(result.loss, want_loss, rtol=rel, atol=1e-12)
    assert set(grads) == set(want_grads)
    for k, g in want_grads.items():
        atol = max(1e-12, 10 * rel * float(g.abs().max()))
        torch.testing.assert_close(grads[k], g, rtol=0, atol=atol, msg=k)


@pytest.mark.parametrize(
    "shape,schedule,chunks,remat",
    [
        ((2, 1, 2), "1f1b", 1, False),
        ((2, 2, 2), "gpipe", 1, False),
        ((2, 1, 2), "interleaved", 2, False),
        ((2, 2, 2), "1f1b", 1, True),
    ],
    ids=[
        "pipe2-tensor2-1f1b",
        "pipe2-data2-tensor2-gpipe",
        "pipe2-tensor2-interleaved",
        "pipe2-data2-tensor2-remat",
    ],
)
def test_pipeline_equals_the_unsharded_model(tmp_path, shape, schedule, chunks, remat):
    model = qwen3()
    model.save_pretrained(tmp_path)
    mesh = fpar.make_mesh(shape, ("pipe", "data", "tensor"))
    apply_fn, params, specs = fpar.hf.from_pretrained(tmp_path, mesh)
    stages = fpar.hf.pipeline_stages(apply_fn, specs, mesh, chunks=chunks)
    calls: list = []
    if remat:  # after the stages are cut: their chunks run the same layer modules
        fpar.hf.remat(apply_fn)
        for layer in apply_fn.module.model.layers:
            layer.register_forward_pre_hook(lambda *_: calls.append(1))
    sched = {
        "1f1b": pp.one_f_one_b(2, M),
        "gpipe": pp.gpipe(2, M),
        "interleaved": pp.interleaved_1f1b(2, M, 2),
    }
    step = pp.pipeline(stages.stage, sched[schedule], mesh, loss=stages.loss, first=stages.first)
    xs, ys = batch()
    result = step(stages.split(params), xs, ys)
    check(result, stages, apply_fn, *reference(model, xs, ys))
    # each of the M microbatches through every layer, forward and recomputed in the backward
    assert len(calls) == (2 * M * model.config.num_hidden_layers if remat else 0)
    assert {k: torch.equal(v, params[k]) for k, v in stages.merge(stages.split(params)).items()} == {
        k: True for k in params
    }


# The combinations reported silently wrong (pipe=2 x tensor=2, 1F1B): what the model's own forward
# does between the pp plan's pieces (Granite's embedding multiplier and logit divisor, Cohere's logit
# scale) must run in the stages; and Gemma's soft-capped logits and alternating sliding/full layers,
# which pipeline_stages used to refuse.
GEMMA3 = dict(
    layer_types=["sliding_attention", "full_attention"] * 2,
    sliding_window=2,
    final_logit_softcapping=3.0,
    query_pre_attn_scalar=8,
)
SCALED = {
    "granite": lambda: _model(
        "GraniteConfig",
        "GraniteForCausalLM",
        embedding_multiplier=12.0,
        logits_scaling=8.0,
        residual_multiplier=0.22,
        attention_multiplier=0.0078125,
    ),
    "cohere": lambda: _model("CohereConfig", "CohereForCausalLM", logit_scale=0.0625),
    "gemma2-softcap": lambda: _model(
        "Gemma2Config",
        "Gemma2ForCausalLM",
        final_logit_softcapping=3.0,
        attn_logit_softcapping=5.0,
        sliding_window=2,
    ),
    "gemma3-mixed-layers": lambda: _model("Gemma3TextConfig", "Gemma3ForCausalLM", **GEMMA3),
}


@pytest.mark.parametrize("chunks", [1, 2], ids=["1f1b", "interleaved"])
@pytest.mark.parametrize("family", list(SCALED))
def test_scaled_families_equal_their_own_forward(tmp_path, family, chunks):
    model = SCALED[family]()
    model.save_pretrained(tmp_path)
    mesh = fpar.make_mesh((2, 2), ("pipe", "tensor"))
    apply_fn, params, specs = fpar.hf.from_pretrained(tmp_path, mesh)
    stages = fpar.hf.pipeline_stages(apply_fn, specs, mesh, chunks=chunks)
    assert len(stages.stage) == 2 * chunks  # one function a chunk, each with its own layers
    sched = pp.one_f_one_b(2, M) if chunks == 1 else pp.interleaved_1f1b(2, M, 2)
    step = pp.pipeline(stages.stage, sched, mesh, loss=stages.loss, first=stages.first)
    xs, ys = batch()
    result = step(stages.split(params), xs, ys)
    check_family(family, result, stages, apply_fn, *reference(model, xs, ys))


def check_family(family, result, stages, apply_fn, want_loss, want_grads):
    # Gemma's RMSNorm runs in float32 inside the float64 model: its sums' order moves with the split
    tol = dict(rtol=1e-5, atol=1e-7) if family.startswith("gemma") else dict(rtol=0, atol=1e-12)
    grads = apply_fn.export(stages.merge(result.grads))
    torch.testing.assert_close(result.loss, want_loss, **tol)
    assert set(grads) == set(want_grads)
    for k, g in want_grads.items():
        torch.testing.assert_close(grads[k], g, **tol, msg=k)


# Tied input and output embeddings (Llama 3.2, small Qwen3, Gemma): held once, in first, used by the
# embedding and the head; against the unsharded tied model (one weight, both uses' gradient).
TIED = {
    "qwen3": lambda: _model("Qwen3Config", "Qwen3ForCausalLM", tie_word_embeddings=True),
    "gemma3-mixed-layers": lambda: _model(
        "Gemma3TextConfig", "Gemma3ForCausalLM", **GEMMA3, tie_word_embeddings=True
    ),
}


def tied_model(family: str):
    model = TIED[family]()
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    return model


@pytest.mark.parametrize("chunks", [1, 2], ids=["1f1b", "interleaved"])
@pytest.mark.parametrize("family", list(TIED))
def test_tied_embeddings_across_stages_equal_the_tied_model(tmp_path, family, chunks):
    model = tied_model(family)
    model.save_pretrained(tmp_path)
    mesh = fpar.make_mesh((2, 2), ("pipe", "tensor"))
    apply_fn, params, specs = fpar.hf.from_pretrained(tmp_path, mesh)
    stages = fpar.hf.pipeline_stages(apply_fn, specs, mesh, chunks=chunks)
    key = "model.embed_tokens.weight"
    assert stages.tied == ((key, key),) and stages.loss.tied == stages.tied
    # held once, in first: one weight, one gradient, one optimizer state
    assert key in stages.specs["first"] and key not in stages.specs["last"]
    sched = pp.one_f_one_b(2, M) if chunks == 1 else pp.interleaved_1f1b(2, M, 2)
    step = pp.pipeline(stages.stage, sched, mesh, loss=stages.loss, first=stages.first)
    xs, ys = batch()
    pipelined = stages.split(params)
    assert key not in pipelined["last"]
    result = step(pipelined, xs, ys)
    assert key not in result.grads["last"]
    check_family(family, result, stages, apply_fn, *reference(model, xs, ys))
    merged = stages.merge(pipelined)
    assert set(merged) == set(params) and all(torch.equal(merged[k], params[k]) for k in params)


def test_tied_pairs_are_checked_before_the_step():
    model = tied_model("qwen3")
    mesh = fpar.make_mesh((2, 2), ("pipe", "tensor"))
    apply_fn, params, specs = fpar.ops.tensor_parallel(model, mesh)
    stages = fpar.hf.pipeline_stages(apply_fn, specs, mesh)
    xs, ys = batch()
    pipelined = stages.split(params)
    key = "model.embed_tokens.weight"

    def step(tied):
        return pp.pipeline(
            stages.stage, pp.one_f_one_b(2, M), mesh, loss=stages.loss, first=stages.first, tied=tied
        )

    with pytest.raises(ValueError, match=r"tied weight 'wte' is not a key of params\['first'\]"):
        step([("wte", key)])(pipelined, xs, ys)
    copy = {**pipelined, "last": {**pipelined["last"], key: pipelined["first"][key].clone()}}
    with pytest.raises(
        ValueError, match=r"params\['last'\] holds the tied weight 'model.embed_tokens.weight'"
    ):
        step(None)(copy, xs, ys)
    with pytest.raises(TypeError, match=r"tied must be pairs \(first_key, last_key\)"):
        step([key])(pipelined, xs, ys)


def test_refusals(tmp_path):
    mesh = fpar.make_mesh((2, 2), ("pipe", "tensor"))
    apply_fn, _, specs = fpar.ops.tensor_parallel(qwen3(), mesh)
    with pytest.raises(ValueError, match=r"4 decoder layers do not divide into 2 stages x 3 chunks"):
        fpar.hf.pipeline_stages(apply_fn, specs, mesh, chunks=3)
    with pytest.raises(ValueError, match="the pipe axis 'stage' is not an axis"):
        fpar.hf.pipeline_stages(apply_fn, specs, mesh, pipe="stage")
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=V))
    apply_fn, _, specs = fpar.ops.tensor_parallel(gpt2.eval(), mesh)
    with pytest.raises(ValueError, match="GPT2LMHeadModel has no base_model_pp_plan"):
        fpar.hf.pipeline_stages(apply_fn, specs, mesh)


def run_pipeline(path: str, remat: bool = False):
    """On each of 2 processes: pipe=2, 1F1B; the loss and the gathered, merged gradients (a tied
    model's embedding: both stages' copies' summed gradient).  ``remat``: each decoder layer
    recomputed in the backward (``fpar.hf.remat`` before the stages are cut)."""
    mesh = fpar.make_mesh((2, 1), ("pipe", "tensor"))
    apply_fn, params, specs = fpar.hf.from_pretrained(path, mesh)
    if remat:
        fpar.hf.remat(apply_fn)
    stages = fpar.hf.pipeline_stages(apply_fn, specs, mesh)
    step = pp.pipeline(stages.stage, pp.one_f_one_b(2, M), mesh, loss=stages.loss, first=stages.first)
    result = step(stages.split(params), *batch())
    grads = fpar.gather(stages.merge(result.grads), mesh, specs)  # merged: from_pretrained's layout
    return result.loss, apply_fn.export(grads)


def hybrid():
    """OLMo-Hybrid of 5 layers, one linear-attention layer before four full-attention ones: the
    first runs with the embedding on stage 0, the four are stacked two a stage."""
    transformers.logging.set_verbosity_error()
    return pp_families.tiny("olmo_hybrid", layers=5, layer_types=[L_] + [F_] * 4)[0]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "kind, remat",
    [("untied", False), ("tied", False), ("tied", True), ("hybrid", False)],
    ids=["untied", "tied", "tied-remat", "layers-that-differ"],
)
def test_pipeline_on_two_processes_equals_the_unsharded_model(tmp_path, kind, remat):
    model = {"untied": qwen3, "tied": lambda: tied_model("qwen3"), "hybrid": hybrid}[kind]()
    model.save_pretrained(tmp_path)
    # the checkpoint as transformers loads it (OLMo-Hybrid keeps its A_log in float32)
    want_loss, want_grads = reference(transformers.AutoModelForCausalLM.from_pretrained(tmp_path), *batch())
    rel = 1e-7 if kind == "hybrid" else 0.0  # its linear attention computes in float32
    for loss, grads in fpar.launch(run_pipeline, 2, str(tmp_path), remat, timeout=120.0):
        torch.testing.assert_close(loss, want_loss, rtol=rel, atol=1e-12)
        for k, g in want_grads.items():
            atol = max(1e-12, 10 * rel * float(g.abs().max()))
            torch.testing.assert_close(grads[k], g, rtol=0, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


def run_lean_pipeline(path: str, lean: bool):
    """On each of 4 processes: pipe=2 x tensor=2, 1F1B, with ``fpar.hf.lean``'s norms or the model's."""
    mesh = fpar.make_mesh((2, 2), ("pipe", "tensor"))
    apply_fn, params, specs = fpar.hf.from_pretrained(path, mesh)
    if lean:
        assert fpar.hf.lean(apply_fn)["rms_norm"] > 0
    stages = fpar.hf.pipeline_stages(apply_fn, specs, mesh)
    step = pp.pipeline(stages.stage, pp.one_f_one_b(2, M), mesh, loss=stages.loss, first=stages.first)
    result = step(stages.split(params), *batch())
    grads = fpar.gather(stages.merge(result.grads), mesh, specs)
    return result.loss, apply_fn.export(grads)


@pytest.mark.multiprocess
def test_lean_norms_in_a_tensor_parallel_pipeline_on_four_processes_equal_the_model():
    """Qwen3's per-head q/k norms as ``fpar.ops.rms_norm`` (a custom autograd Function) in a pipeline
    stage, whose sharded call stays traced: each norm weight's gradient is summed over the tensor
    axis its heads are split over (it was not: 3.4e-3 off, both tensor ranks' copies diverging),
    as with the model's own norms.  Both against the unsharded model, to the same tolerance: the
    real mesh's gradients differ from it by up to 2e-7 of their largest entry either way (the
    in-process mesh: 1e-12).  The cause: the real mesh sums a replicated value's gradient at its
    source, not at each use, so each device's share passes through the replicated computation
    between them, where HF's norms round to float32 inside the float64 model (docs/real-mesh.md).
    """
    import tempfile

    model = qwen3()
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        want_loss, want_grads = reference(model, *batch())
        for lean in (False, True):
            for loss, grads in fpar.launch(run_lean_pipeline, 4, d, lean, timeout=180.0):
                torch.testing.assert_close(loss, want_loss, rtol=1e-9, atol=1e-12)
                for k, g in want_grads.items():
                    atol = 1e-6 * float(g.abs().max())
                    torch.testing.assert_close(
                        grads[k], g, rtol=0, atol=atol, msg=lambda m, k=k, lean=lean: f"lean={lean} {k}: {m}"
                    )


@pytest.mark.parametrize(
    "shape,chunks",
    [((2, 1, 2), 1), ((2, 1, 2), 2), ((2, 2, 2), 1)],
    ids=["pipe2-tensor2-1f1b", "pipe2-tensor2-interleaved", "pipe2-data2-tensor2-1f1b"],
)
def test_sequence_parallel_pipeline_equals_the_unsharded_model(shape, chunks):
    """The layers' norms 'sequence_parallel': chunk 0 cuts the sequence, every stage sends its block on,
    the last stage's head gathers it; tied embeddings across the stages too."""
    import hf_models

    model = _model("Qwen3Config", "Qwen3ForCausalLM", tie_word_embeddings=True)
    mesh = fpar.make_mesh(shape, ("pipe", "data", "tensor"))
    apply_fn, params, specs = fpar.ops.tensor_parallel(model, mesh, plan=hf_models.sp_plan(model))
    stages = fpar.hf.pipeline_stages(apply_fn, specs, mesh, chunks=chunks)
    assert isinstance(stages.stage, list)  # chunk 0 takes the whole sequence, the others its blocks
    sched = pp.one_f_one_b(2, M) if chunks == 1 else pp.interleaved_1f1b(2, M, 2)
    step = pp.pipeline(stages.stage, sched, mesh, loss=stages.loss, first=stages.first)
    xs, ys = batch()
    result = step(stages.split(params), xs, ys)
    check(result, stages, apply_fn, *reference(model, xs, ys))


# Layers that differ: cut by their pattern ------------------------------------------------------

L_, F_ = "linear_attention", "full_attention"


@pytest.mark.parametrize(
    "family, layers, extra, chunks, sp, cut",
    [
        ("glm4_moe_lite", 5, {}, 2, False, (1, 1, 0)),  # a dense layer, then MoE layers
        ("ernie4_5_moe", 3, {}, 1, False, (1, 1, 0)),
        ("minimax", 8, {}, 2, False, (0, 2, 0)),  # full and linear attention alternate
        ("olmo_hybrid", 8, {}, 1, False, (0, 4, 0)),  # three linear, one full
        ("olmo_hybrid", 5, {"layer_types": [L_, F_, F_, F_, F_]}, 2, True, (1, 1, 0)),
        ("olmo_hybrid", 3, {}, 1, True, (0, 1, 1)),  # a partial unit after the body
    ],
    ids=["dense-first-interleaved", "dense-first-1f1b", "alternating", "unit-of-4", "lead-sp", "trail-sp"],
)
def test_layers_that_differ_are_cut_by_their_pattern(family, layers, extra, chunks, sp, cut):
    """Dense-then-MoE and hybrid-attention models: the body's repeating units stacked, the layers
    before it with the embedding on stage 0, a partial unit after it with the head; equal to the
    unsharded model, loss and every gradient, under 1F1B and interleaved 1F1B, with and without
    sequence parallelism."""
    import hf_models

    transformers.logging.set_verbosity_error()
    model, _ = pp_families.tiny(family, layers=layers, **extra)
    mesh = fpar.make_mesh((2, 2), ("pipe", "tensor"))
    plan = hf_models.sp_plan(model) if sp else "auto"
    apply_fn, params, specs = fpar.ops.tensor_parallel(model, mesh, plan=plan)
    stages = fpar.hf.pipeline_stages(apply_fn, specs, mesh, chunks=chunks)
    assert (stages.lead, stages.unit, stages.trail) == cut
    lead_keys = {k for k in specs if k.startswith(tuple(f"model.layers.{i}." for i in range(stages.lead)))}
    assert lead_keys <= set(stages.specs["first"])  # the layers before the body run on stage 0
    sched = pp.one_f_one_b(2, M) if chunks == 1 else pp.interleaved_1f1b(2, M, 2)
    step = pp.pipeline(stages.stage, sched, mesh, loss=stages.loss, first=stages.first)
    xs, ys = batch()
    result = step(stages.split(params), xs, ys)
    # their routers and linear attention compute in float32 (pp_families' tolerances)
    check(result, stages, apply_fn, *reference(model, xs, ys), rel=1e-7)


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(
    lead=st.lists(st.integers(7, 9), max_size=3),
    unit=st.lists(st.integers(0, 2), min_size=1, max_size=4),
    units=st.integers(1, 6),
    trail=st.integers(0, 3),
    p=st.integers(1, 3),
    v=st.integers(1, 2),
)
def test_the_cut_keeps_every_layer_and_stacks_whole_units(lead, unit, units, trail, p, v):
    """Kinds built as a lead, a unit repeated, a partial unit: the cut found (or refused) is a
    valid one, never leaves out more layers than this construction, and loses no layer."""
    from fpar.hf._pipeline import _cut

    trail = min(trail, len(unit) - 1)  # a partial unit
    kinds = lead + unit * units + unit[:trail]
    fits = units % (p * v) == 0
    try:
        a, u, b = _cut(kinds, p, v, "M", "layers")
    except ValueError as e:
        assert not fits, e  # this construction is a cut: one is found
        if len(set(kinds)) == 1:
            assert f"{len(kinds)} decoder layers do not divide into {p} stages x {v} chunks" in str(e)
        else:
            assert str(e).startswith("fpar.hf.pipeline_stages: M's decoder layers (layers,"), e
        return
    body = kinds[a : len(kinds) - b]
    assert len(body) % u == 0 and (len(body) // u) % (p * v) == 0
    assert body == body[:u] * (len(body) // u)  # whole repeats of one unit
    assert a + b <= len(kinds) - len(body) and a + len(body) + b == len(kinds)
    if fits:
        assert a + b <= len(lead) + trail


def test_layers_that_cannot_be_cut_are_refused_by_name():
    transformers.logging.set_verbosity_error()
    model, _ = pp_families.tiny("glm4_moe_lite", meta=True, layers=4)  # 1 dense + 3 MoE: 3 on 2 stages
    mesh = fpar.make_mesh((2, 1), ("pipe", "tensor"))
    apply_fn, _, specs = fpar.ops.tensor_parallel(model, mesh)
    with pytest.raises(
        ValueError,
        match=r"Glm4MoeLiteForCausalLM's decoder layers \(model.layers, one letter a layer, a letter a "
        r"parameter layout: ABBB\) do not cut into 2 stages x 1 chunks of whole repeating units: at best "
        r"layers 1 to 3 repeat a unit of 1 layer\(s\) 3 times",
    ):
        fpar.hf.pipeline_stages(apply_fn, specs, mesh)
