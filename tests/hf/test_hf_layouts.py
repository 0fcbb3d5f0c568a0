"""Every layout for a Hugging Face model: data x tensor with ZeRO 1/2/3, remat, mixed precision.

One optimizer step of the sharded model (``plan="auto"``, kv heads replicated where fewer than the
tensor devices) equals the same step of the unsharded model, float64; bf16 compares with the
unsharded model run under the same bf16 policy.
"""

from __future__ import annotations

import pytest
import torch

import fpar
import fpar.optim as fo
from fpar import P

pytest.importorskip("transformers", reason="the hf extra (pip install fpar[hf]) is not installed")

import hf_models  # noqa: E402  (needs transformers)

MESH = fpar.make_mesh((2, 2), ("data", "tensor"))
# HF's RMSNorms compute in float32: with the batch split over 'data' (and partial sums over
# 'tensor') a float32 rounding moves now and then, so float64 runs agree to float32 precision.
# AdamW's first step divides by |grad|, so a near-zero gradient's move can differ by that much.
TOL = dict(rtol=1e-5, atol=1e-6)


def _hf_loss(apply_fn):
    return lambda p, x: apply_fn(p, x, labels=x, use_cache=False).loss


def _reference_step(model, ids, opt, dtype=None):
    """One step of ``opt`` on the whole model; with ``dtype`` the loss runs in it (fp32 master)."""
    ref = {k: p.detach() for k, p in model.named_parameters()}
    loss = hf_models.reference_loss(model)

    def policy(p, x):
        if dtype is None:
            return loss(p, x)
        return loss({k: v.to(dtype) for k, v in p.items()}, x).float()

    updates, _ = opt.update(torch.func.grad(policy)(ref, ids), opt.init(ref), ref)
    return fo.apply_updates(ref, updates)


@pytest.mark.parametrize("stage, remat", [(1, False), (2, False), (3, False), (1, True), (3, True)])
def test_zero_step_equals_unsharded_adamw(stage, remat):
    model = hf_models.qwen3(num_key_value_heads=1)  # kv replicated on both tensor devices
    ids = hf_models.batch()
    apply_fn, params, specs = fpar.ops.tensor_parallel(model, MESH)
    assert apply_fn.replicated
    if remat:  # each decoder layer recomputed in the backward (ZeRO-3: its blocks gathered again)
        fpar.hf.remat(apply_fn)
    opt = fo.adamw(1e-2, weight_decay=0.1)
    layout = fo.zero_layout(params, MESH, specs, stage=stage)
    zparams, state = fo.zero_init(opt, params, layout)
    step = fo.zero_step(_hf_loss(apply_fn), opt, layout)
    zparams, state, _ = step(zparams, state, ids)
    got = fo.zero_params(zparams, layout)
    for name in apply_fn.replicated:  # the replicas were updated alike
        dim, index = apply_fn.source(name)
        first = apply_fn.export({name: got[name]})[name].index_select(dim, index)
        assert torch.equal(got[name], first), name
    hf_models.compare(apply_fn.export(got), _reference_step(model, ids, opt), f"ZeRO-{stage} step", **TOL)


@pytest.mark.parametrize("family", ["qwen3", "mixtral"])
def test_remat_equals_unsharded(family):
    model = hf_models.FAMILIES[family](num_key_value_heads=1)
    ids = hf_models.batch()
    apply_fn, params, specs = fpar.ops.tensor_parallel(model, MESH)

    def per_device(p, x):
        return fpar.pmean(fo.remat(_hf_loss(apply_fn))(p, x), "data")

    loss = fpar.shard(per_device, MESH, (specs, P("data")), P())
    want_loss, want_grads = hf_models.unsharded(model, ids)
    torch.testing.assert_close(loss(params, ids), want_loss, **TOL)
    grads = apply_fn.export(torch.func.grad(loss)(params, ids))
    hf_models.compare(grads, want_grads, f"{family} grads through remat", **TOL)


def test_bf16_mixed_precision_zero_step_equals_unsharded_bf16_policy():
    model = hf_models.llama(num_key_value_heads=1).float()  # fp32 master weights
    ids = hf_models.batch()
    apply_fn, params, specs = fpar.ops.tensor_parallel(model, MESH)
    opt = fo.mixed_precision(fo.adamw(1e-2), compute_dtype=torch.bfloat16)
    layout = fo.zero_layout(params, MESH, specs, stage=1)
    zparams, state = fo.zero_init(opt, params, layout)
    zparams, state, _ = fo.zero_step(_hf_loss(apply_fn), opt, layout)(zparams, state, ids)
    got = apply_fn.export(fo.zero_params(zparams, layout))
    want = _reference_step(model, ids, fo.adamw(1e-2), dtype=torch.bfloat16)
    start = {k: p.detach() for k, p in model.named_parameters()}
    # bf16 compute: the two sides round differently (split sums, all-reduce order), so gradients
    # agree to bf16 precision; AdamW's first step moves each weight by ~lr * sign(grad), so compare
    # the moves: equal to 1e-3 (a tenth of the 1e-2 step) except where a gradient is near zero.
    close = sum(((got[k] - start[k]) - (want[k] - start[k])).abs().le(1e-3).sum().item() for k in start)
    total = sum(p.numel() for p in start.values())
    assert close / total > 0.98, f"{close}/{total} of the bf16 step's moves agree to 1e-3"


def _count_layer_calls(apply_fn) -> list:
    """Append to the returned list each time a decoder layer's own forward runs."""
    calls: list = []
    for layer in apply_fn.module.model.layers:
        layer.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


def _saved_bytes(fn, params, *args) -> int:
    """The bytes autograd keeps for the backward of ``fn(params, *args)``, each storage once, less
    the parameters themselves."""
    seen: dict = {}
    own = {p.untyped_storage().data_ptr() for p in params.values()}

    def pack(t):
        if t.untyped_storage().data_ptr() not in own:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(params, *args)
    return sum(seen.values())


@pytest.mark.parametrize("family, policy", [("qwen3", None), ("llama", fo.save_dots), ("mixtral", None)])
def test_hf_remat_recomputes_each_decoder_layer_and_equals_unsharded(family, policy):
    """``fpar.hf.remat(apply_fn)``: each layer runs again in the backward on this device's blocks
    (data x tensor, kv heads replicated), the values and gradients the unsharded model's."""
    model = hf_models.FAMILIES[family](num_hidden_layers=2, num_key_value_heads=1)
    ids = hf_models.batch()
    apply_fn, params, specs = fpar.ops.tensor_parallel(model, MESH)
    assert fpar.hf.remat(apply_fn, policy) is apply_fn
    calls = _count_layer_calls(apply_fn)
    loss = hf_models.sharded_loss(apply_fn, MESH, specs, causal=True)
    want_loss, want_grads = hf_models.unsharded(model, ids)
    grads, value = torch.func.grad_and_value(loss)(params, ids)
    # 2 layers, each run forward and again in the backward
    assert len(calls) == 2 * 2, len(calls)
    torch.testing.assert_close(value, want_loss, **TOL)
    hf_models.compare(apply_fn.export(grads), want_grads, f"{family} grads, fpar.hf.remat", **TOL)


def test_hf_remat_keeps_a_layers_input_not_its_activations():
    """Full recomputation keeps each layer's input for the backward (and the embedding's and the
    head's own), a fraction of what the layers keep without it; ``policy=False`` undoes it."""
    model = hf_models.qwen3(num_hidden_layers=4)
    ids = hf_models.batch()
    mesh = fpar.make_mesh((1,), ("tensor",))
    apply_fn, params, specs = fpar.ops.tensor_parallel(model, mesh)
    loss = fpar.shard(_hf_loss(apply_fn), mesh, (specs, P()), P())
    params = {k: v.detach().requires_grad_() for k, v in params.items()}
    plain = _saved_bytes(loss, params, ids)
    fpar.hf.remat(apply_fn)
    kept = _saved_bytes(loss, params, ids)
    assert kept < plain / 3, (kept, plain)
    fpar.hf.remat(apply_fn, False)
    assert type(apply_fn.module.model.layers[0]).__call__ is torch.nn.Module.__call__
    assert _saved_bytes(loss, params, ids) == plain


def test_hf_remat_refuses_what_it_cannot_wrap():
    with pytest.raises(TypeError, match=r"fpar.hf.remat: apply_fn must be what fpar.hf.from_pretrained"):
        fpar.hf.remat(lambda p, x: x)
    model = hf_models.qwen3(num_hidden_layers=1)
    apply_fn, _, _ = fpar.ops.tensor_parallel(model, fpar.make_mesh((1,), ("tensor",)))
    with pytest.raises(TypeError, match=r"fpar.hf.remat: policy must be None \(full recomputation\)"):
        fpar.hf.remat(apply_fn, "dots")


@pytest.mark.parametrize(
    "family, norms, mlps",
    [("qwen3", 9, 2), ("llama", 5, 2), ("mixtral", 5, 0), ("gemma3", 0, 0)],
)
def test_hf_lean_norms_and_mlps_keep_their_inputs_and_give_the_models_values(family, norms, mlps):
    """``fpar.hf.lean``: the norms that compute Llama's RMSNorm (Qwen3's per-head q/k norms too) and
    the SwiGLU MLPs run ``fpar.ops.rms_norm`` / ``swiglu``; Gemma's ``1 + weight`` norms and GeLU
    MLP and Mixtral's experts keep their own forwards (each module is run both ways first).  The
    loss is the model's own bit for bit, the gradients the unsharded model's (HF's norms compute
    in float32: to float32 rounding), and the layers keep fewer bytes."""
    model = hf_models.FAMILIES[family](num_hidden_layers=2, num_key_value_heads=1)
    ids = hf_models.batch()
    apply_fn, params, specs = fpar.ops.tensor_parallel(model, MESH)
    loss = hf_models.sharded_loss(apply_fn, MESH, specs, causal=True)
    plain_value = loss(params, ids)
    plain_bytes = _saved_bytes(loss, {k: v.detach().requires_grad_() for k, v in params.items()}, ids)
    assert fpar.hf.lean(apply_fn) == {"rms_norm": norms, "swiglu": mlps}
    assert fpar.hf.lean(apply_fn) == {"rms_norm": norms, "swiglu": mlps}  # again: the same modules
    grads, value = torch.func.grad_and_value(loss)(params, ids)
    assert torch.equal(value, plain_value)
    want_loss, want_grads = hf_models.unsharded(model, ids)
    hf_models.compare(apply_fn.export(grads), want_grads, f"{family} grads, fpar.hf.lean", **TOL)
    lean_bytes = _saved_bytes(loss, {k: v.detach().requires_grad_() for k, v in params.items()}, ids)
    assert (lean_bytes < plain_bytes) == bool(norms + mlps), (lean_bytes, plain_bytes)


def test_hf_lean_with_remat_and_zero3():
    model = hf_models.qwen3(num_key_value_heads=1)
    ids = hf_models.batch()
    apply_fn, params, specs = fpar.ops.tensor_parallel(model, MESH)
    fpar.hf.lean(apply_fn)
    fpar.hf.remat(apply_fn)
    opt = fo.adamw(1e-2, weight_decay=0.1)
    layout = fo.zero_layout(params, MESH, specs, stage=3)
    zparams, state = fo.zero_init(opt, params, layout)
    zparams, state, _ = fo.zero_step(_hf_loss(apply_fn), opt, layout)(zparams, state, ids)
    got = apply_fn.export(fo.zero_params(zparams, layout))
    hf_models.compare(got, _reference_step(model, ids, opt), "lean + remat ZeRO-3 step", **TOL)


def test_hf_lean_refuses_what_is_no_model():
    with pytest.raises(TypeError, match=r"fpar.hf.lean: apply_fn must be what fpar.hf.from_pretrained"):
        fpar.hf.lean(torch.nn.Linear(2, 2))


# Sequence parallelism: HF's 'sequence_parallel' style on the layers' norms -------------------------


@pytest.mark.parametrize(
    "family", ["llama", "qwen3", "gemma3", "phi3", "olmo2", "gpt_neox", "mixtral", "qwen3_moe", "deepseek_v2"]
)
def test_sequence_parallel_equals_unsharded(family):
    """The residual stream split along the sequence (norms on blocks, attention and MLP gathering their
    input, row-parallel outputs reduce-scattered), kv heads replicated where fewer than devices; a
    mixture of experts on the gathered sequence, its experts tensor parallel, keeping its block."""
    kw = {} if family in ("gpt_neox", "deepseek_v2") else dict(num_key_value_heads=1)
    model = hf_models.FAMILIES[family](num_hidden_layers=2, **kw)
    ids = hf_models.batch()
    loss, grads, _, apply_fn = hf_models.sharded(model, MESH, ids, plan=hf_models.sp_plan(model))
    assert "sequence_parallel" in apply_fn.plan.values()
    want_loss, want_grads = hf_models.unsharded(model, ids)
    tol = hf_models.tolerances(family) if family == "deepseek_v2" else TOL  # its router scores in float32
    torch.testing.assert_close(loss, want_loss, **tol)
    hf_models.compare(grads, want_grads, f"{family} grads, sequence parallel", **tol)


@pytest.mark.parametrize("stage", [1, 3])
def test_sequence_parallel_with_remat_and_zero_equals_unsharded_adamw(stage):
    model = hf_models.qwen3(num_hidden_layers=2, num_key_value_heads=1)
    ids = hf_models.batch()
    apply_fn, params, specs = fpar.ops.tensor_parallel(model, MESH, plan=hf_models.sp_plan(model))
    fpar.hf.remat(apply_fn)
    opt = fo.adamw(1e-2, weight_decay=0.1)
    layout = fo.zero_layout(params, MESH, specs, stage=stage)
    zparams, state = fo.zero_init(opt, params, layout)
    zparams, state, _ = fo.zero_step(_hf_loss(apply_fn), opt, layout)(zparams, state, ids)
    got = apply_fn.export(fo.zero_params(zparams, layout))
    hf_models.compare(got, _reference_step(model, ids, opt), f"SP + remat ZeRO-{stage} step", **TOL)


def test_sequence_parallel_refusals_name_the_module():
    gpt2 = hf_models.gpt2()  # Conv1D layers: no sequence-parallel form
    plan = {**gpt2.tp_plan, "transformer.h.*.ln_1": "sequence_parallel"} if gpt2.tp_plan else None
    plan = plan or {
        "transformer.h.*.attn.c_attn": "colwise",
        "transformer.h.*.attn.c_proj": "rowwise",
        "transformer.h.*.ln_1": "sequence_parallel",
    }
    with pytest.raises(
        ValueError,
        match=r"GPT2LMHeadModel's plan names 'sequence_parallel' .*'transformer\.h\.0\.attn\.c_attn' \(Conv1D\)",
    ):
        fpar.ops.tensor_parallel(gpt2, MESH, plan=plan)
    model = hf_models.llama(num_hidden_layers=2)
    apply_fn, params, specs = fpar.ops.tensor_parallel(model, MESH, plan=hf_models.sp_plan(model))
    loss = hf_models.sharded_loss(apply_fn, MESH, specs, causal=True)
    odd = torch.randint(0, hf_models.V, (4, 7))
    with pytest.raises(
        ValueError,
        match=r"first decoder layer's hidden states have shape \(2, 7, 32\): the sequence \(dim 1\) must be divisible by 2",
    ):
        loss(params, odd)


def test_sequence_parallel_keyword_names_the_layers_norms():
    model = hf_models.gemma3(num_hidden_layers=2)  # four norms a layer
    apply_fn, params, specs = fpar.ops.tensor_parallel(model, MESH, sequence_parallel=True)
    by_hand, _, _ = fpar.ops.tensor_parallel(model, MESH, plan=hf_models.sp_plan(model))
    assert apply_fn.plan == by_hand.plan and list(apply_fn.plan.values()).count("sequence_parallel") == 8
    ids = hf_models.batch()
    loss = hf_models.sharded_loss(apply_fn, MESH, specs, causal=True)
    torch.testing.assert_close(loss(params, ids), hf_models.unsharded(model, ids)[0], **TOL)
    with pytest.raises(TypeError, match=r"sequence_parallel must be True or False, got 'yes'"):
        fpar.ops.tensor_parallel(model, MESH, sequence_parallel="yes")
