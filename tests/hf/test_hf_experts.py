"""Expert parallelism from a Hugging Face model's own plan (``expert_axis=``, ``base_model_ep_plan``).

The experts of each MoE layer are split over an ``expert`` mesh axis (``E / n`` a device), the
tokens over ``data`` x ``expert``; every (token, choice) pair travels to its expert's device and
back.  Loss and every gradient equal the unsharded model's (float64), in-process, with tensor
parallelism beside it, and on 2 gloo processes (the exact-count exchange); a checkpoint loads
each process's own experts and saves back for ``from_pretrained``.
"""

from __future__ import annotations

import pytest
import torch

import fpar
from fpar import P

pytest.importorskip("transformers", reason="the hf extra (pip install fpar[hf]) is not installed")

import hf_models  # noqa: E402  (needs transformers)

TOKENS = ("data", "expert")


def ep_loss(apply_fn, mesh, specs):
    """The vocabulary-parallel HF loss, the batch split over data x expert, averaged over both."""

    def per_device(params, ids):
        return fpar.pmean(apply_fn(params, ids, labels=ids, use_cache=False).loss, TOKENS)

    return fpar.shard(per_device, mesh, (specs, P(TOKENS)), P())


@pytest.mark.parametrize(
    "family, shape",
    [("qwen3_moe", (1, 2, 2)), ("qwen3_moe", (2, 2, 1)), ("mixtral", (1, 2, 2)), ("qwen3_moe", (1, 4, 1))],
    ids=["qwen3_moe-e2t2", "qwen3_moe-d2e2", "mixtral-e2t2", "qwen3_moe-e4"],
)
def test_expert_parallel_equals_unsharded(family, shape):
    model = hf_models.FAMILIES[family](num_hidden_layers=2)
    mesh = fpar.make_mesh(shape, ("data", "expert", "tensor"))
    apply_fn, params, specs = fpar.ops.tensor_parallel(model, mesh, expert_axis="expert")
    experts = {k for k in params if ".experts." in k}
    assert experts and set(apply_fn.experts) == experts
    for name in experts:  # split by expert, not by width
        assert specs[name] == P("expert", None, None), name
    assert all("expert" not in specs[k].axes() for k in set(params) - experts)
    check_equal(model, family, mesh, apply_fn, params, specs, f"{family} {shape} expert parallel")


def check_equal(model, family, mesh, apply_fn, params, specs, what):
    """The loss and every gradient of the expert-parallel model equal the unsharded model's."""
    ids = hf_models.batch(rows=4)
    loss = ep_loss(apply_fn, mesh, specs)
    want_loss, want_grads = hf_models.unsharded(model, ids)
    tol = hf_models.tolerances(family)
    torch.testing.assert_close(loss(params, ids), want_loss, **tol)
    grads = apply_fn.export(torch.func.grad(loss)(params, ids))
    hf_models.compare(grads, want_grads, what, **tol)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_expert_parallel_with_sequence_parallelism_equals_unsharded(family):
    """Experts over the expert axis beside Megatron-SP over the tensor axis: the MoE block gathers
    the sequence, routes and exchanges the whole sequence's tokens, and keeps its block."""
    model = hf_models.FAMILIES[family](num_hidden_layers=2, num_key_value_heads=2)
    mesh = fpar.make_mesh((1, 2, 2), ("data", "expert", "tensor"))
    apply_fn, params, specs = fpar.ops.tensor_parallel(
        model, mesh, expert_axis="expert", sequence_parallel=True
    )
    assert "sequence_parallel" in apply_fn.plan.values() and apply_fn.experts
    check_equal(model, family, mesh, apply_fn, params, specs, f"{family} expert parallel + SP")


def test_every_expert_is_used_and_its_gradient_reaches_it():
    # Not a vacuous equality: at these sizes every expert gets tokens, so every expert block of
    # every device has a nonzero gradient, which only the dispatch and its transpose deliver.
    model = hf_models.qwen3_moe(num_hidden_layers=1)
    mesh = fpar.make_mesh((1, 2, 1), ("data", "expert", "tensor"))
    apply_fn, params, specs = fpar.ops.tensor_parallel(model, mesh, expert_axis="expert")
    grads = torch.func.grad(ep_loss(apply_fn, mesh, specs))(params, hf_models.batch(rows=4))
    for name in apply_fn.experts:
        per_expert = grads[name].flatten(1).abs().sum(1)
        assert (per_expert > 0).all(), (name, per_expert)


def test_the_tensor_parallel_plan_is_kept_for_the_rest():
    model = hf_models.qwen3_moe(num_hidden_layers=1)
    mesh = fpar.make_mesh((1, 2, 2), ("data", "expert", "tensor"))
    apply_fn, _, specs = fpar.ops.tensor_parallel(model, mesh, expert_axis="expert")
    assert apply_fn.plan["model.layers.0.mlp.experts"] == "ep_experts"
    assert specs["model.layers.0.self_attn.q_proj.weight"] == P("tensor", None)
    assert specs["model.layers.0.mlp.gate.weight"] == P()  # the router: replicated
    _, _, tp_specs = fpar.ops.tensor_parallel(model, mesh)  # without it: as the tensor plan says
    down = "model.layers.0.mlp.experts.down_proj"
    if "model.layers.*.mlp.experts" in model.tp_plan:  # transformers < 5.25: experts split by width
        assert "tensor" in tp_specs[down].axes()
    else:  # 5.25 plans experts in its expert plan only: without expert_axis they are replicated
        assert tp_specs[down] == P()


@pytest.mark.parametrize("stage", [1, 3])
def test_zero_step_with_expert_parallelism_equals_unsharded_adamw(stage):
    # ZeRO over data beside the expert axis: every device keeps 1/2 of its experts' AdamW state
    # (stage 3: of the experts too), the batch split over data x expert.
    import fpar.optim as fo

    model = hf_models.qwen3_moe(num_hidden_layers=1)
    mesh = fpar.make_mesh((2, 2, 1), ("data", "expert", "tensor"))
    apply_fn, params, specs = fpar.ops.tensor_parallel(model, mesh, expert_axis="expert")
    ids = hf_models.batch(rows=4)
    opt = fo.adamw(1e-2, weight_decay=0.1)
    layout = fo.zero_layout(params, mesh, specs, stage=stage)
    zparams, state = fo.zero_init(opt, params, layout)

    def per_device(p, x):  # this device's mean; zero_step averages over data, this over expert
        return fpar.pmean(apply_fn(p, x, labels=x, use_cache=False).loss, "expert")

    step = fo.zero_step(per_device, opt, layout, batch_specs=P(TOKENS))
    zparams, state, _ = step(zparams, state, ids)
    got = apply_fn.export(fo.zero_params(zparams, layout))
    own = {k: p.detach() for k, p in model.named_parameters()}
    ref = hf_models.reference_loss(model)

    def want(p):
        return sum(ref(p, ids[i : i + 1]) for i in range(4)) / 4

    updates, _ = opt.update(torch.func.grad(want)(own), opt.init(own), own)
    hf_models.compare(got, fo.apply_updates(own, updates), f"ZeRO-{stage} x expert", rtol=1e-5, atol=1e-6)


def test_errors_name_the_fix():
    model = hf_models.qwen3_moe(num_hidden_layers=1)
    mesh = fpar.make_mesh((1, 2, 2), ("data", "expert", "tensor"))
    with pytest.raises(ValueError, match=r"expert_axis 'nope' must be an axis of .* other than the tensor"):
        fpar.ops.tensor_parallel(model, mesh, expert_axis="nope")
    with pytest.raises(ValueError, match=r"expert_axis 'tensor' must be an axis of .* other than the tensor"):
        fpar.ops.tensor_parallel(model, mesh, expert_axis="tensor")
    wide = fpar.make_mesh((1, 8, 1), ("data", "expert", "tensor"))
    with pytest.raises(ValueError, match=r"its 4 experts are not divisible by the expert axis size 8"):
        fpar.ops.tensor_parallel(model, wide, expert_axis="expert")
    with pytest.raises(
        ValueError, match=r"LlamaForCausalLM has none \(its config has no base_model_ep_plan\)"
    ):
        fpar.ops.tensor_parallel(hf_models.llama(), mesh, expert_axis="expert")
    plan = {
        "model.layers.*.mlp.experts": "ep_dispatch_experts",
        "model.layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
        "model.layers.*.mlp.experts.down_proj": "grouped_gemm",
    }
    with pytest.raises(
        ValueError, match=r"expert parallelism, which needs the mesh axis .* pass expert_axis="
    ):
        fpar.ops.tensor_parallel(model, mesh, plan=plan)
    # a user plan with the strings and the axis: the same layout as the model's own plan
    _, _, specs = fpar.ops.tensor_parallel(model, mesh, plan=plan, expert_axis="expert")
    assert specs["model.layers.0.mlp.experts.down_proj"] == P("expert", None, None)
    with pytest.raises(TypeError, match=r"'ep_dispatch_experts' applies to a transformers experts module"):
        fpar.ops.tensor_parallel(
            model, mesh, plan={"model.layers.*.mlp.gate": "ep_dispatch_experts"}, expert_axis="expert"
        )


def test_a_checkpoint_loads_each_experts_block_and_saves_back(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = hf_models.qwen3_moe(num_hidden_layers=1)
    model.save_pretrained(tmp_path / "ckpt")
    mesh = fpar.make_mesh((1, 2, 1), ("data", "expert", "tensor"))
    apply_fn, params, specs = fpar.hf.from_pretrained(tmp_path / "ckpt", mesh, expert_axis="expert")
    assert specs["model.layers.0.mlp.experts.gate_up_proj"] == P("expert", None, None)
    for name, p in model.named_parameters():
        torch.testing.assert_close(params[name], p.detach().to(params[name].dtype), rtol=0, atol=0)
    fpar.hf.save_pretrained(tmp_path / "out", apply_fn, params, mesh)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float64)
    for name, p in back.named_parameters():
        assert torch.equal(p, model.get_parameter(name)), name


@pytest.mark.multiprocess
@pytest.mark.parametrize("grouped", [False, True], ids=["batched_mm-float64", "grouped_mm-float32"])
def test_real_mesh_equals_unsharded(grouped):
    # grouped: the experts' own grouped_mm (transformers' default), which a real mesh keeps; its
    # rows regrouped per expert, so float32 sums in another order: 1e-5
    import hf_workers

    results = fpar.launch(hf_workers.expert_worker, 2, grouped, timeout=240.0)
    model = hf_models.qwen3_moe(num_hidden_layers=2)
    if grouped:
        model = model.float()
        model.set_experts_implementation("grouped_mm")
    ids = hf_models.batch(rows=4)
    want_loss, want_grads = hf_models.unsharded(model, ids)
    tol = dict(rtol=1e-5, atol=1e-5) if grouped else hf_models.tolerances("qwen3_moe")
    for rank, (value, grads) in enumerate(results):
        torch.testing.assert_close(value, want_loss, **tol)
        hf_models.compare(grads, want_grads, f"rank {rank}: expert parallel on 2 processes", **tol)


def _ep_families() -> list[str]:
    import pp_families

    return [
        name for name, (cfg, _) in pp_families.families().items() if getattr(cfg, "base_model_ep_plan", None)
    ]


@pytest.fixture
def _quiet():
    import transformers

    level, threads = transformers.logging.get_verbosity(), torch.get_num_threads()
    transformers.logging.set_verbosity_error()  # tiny configs trip token-id range warnings
    # One thread: the linear-attention families run torch's per-example vmap fallback (thousands
    # of tiny ops), which two pytest workers with two threads each slow down many times over.
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    transformers.logging.set_verbosity(level)


@pytest.mark.usefixtures("_quiet")
@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
@pytest.mark.parametrize("family", _ep_families())
def test_every_ep_plan_family_equals_unsharded_or_is_refused(family):
    """Every causal LM ``transformers`` ships an expert-parallel plan for, at expert=2 x tensor=2.

    Tiny (``pp_families.tiny``: float64, eager attention, random weights, scalings moved), the
    batch split over the expert axis.  Equal to the unsharded model (loss to 1e-7 relative, each
    gradient to 1e-6 of its largest entry: several families route or normalise in float32), or
    refused by name before any step (Flint's tiny config has no MoE layer: ``mlp_only_layers``).
    """
    import pp_families

    mesh = fpar.make_mesh((1, 2, 2), ("data", "expert", "tensor"))
    try:
        model, _ = pp_families.tiny(family)
        ids = hf_models.batch(rows=4)
        halves = (ids[:2], ids[2:])
        own = {k: p.detach() for k, p in model.named_parameters()}
        ref = hf_models.reference_loss(model)

        def want(p):
            return sum(ref(p, h) for h in halves) / 2

        want_loss, want_grads = want(own), torch.func.grad(want)(own)
    except Exception as e:  # noqa: BLE001 (transformers' own failure on this test's tiny sizes)
        pytest.skip(f"the tiny {family} model does not build or run in transformers: {type(e).__name__}: {e}")
    cls = type(model).__name__
    try:
        apply_fn, params, specs = fpar.ops.tensor_parallel(model, mesh, expert_axis="expert")
        loss = ep_loss(apply_fn, mesh, specs)
        value = loss(params, ids)
    except ValueError as e:  # a refusal by name, before any step: never a wrong value
        assert str(e).startswith("fpar.ops.tensor_parallel"), e
        assert cls in str(e) or "failed on this device's blocks" in str(e), e
        return
    assert apply_fn.experts, f"{family}: no expert weight split over the expert axis"
    # HF's own loss (in float32) where the head is not vocabulary-split (Inkling's): 1e-6 there
    rtol = 1e-7 if value.dtype == torch.float64 else 1e-6
    torch.testing.assert_close(value.double(), want_loss, rtol=rtol, atol=0)
    grads = apply_fn.export(torch.func.grad(loss)(params, ids))
    for k, g in want_grads.items():
        atol = 1e-6 * float(g.abs().max()) + 1e-12
        torch.testing.assert_close(grads[k], g, rtol=1e-5, atol=atol, msg=lambda m, k=k: f"{family} {k}: {m}")
