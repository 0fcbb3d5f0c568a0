"""Tiny random-init Hugging Face models of every planned family, and the losses the tests compare.

Module-level so that the real-mesh workers build exactly the same models.  float64, eager
attention, random norm weights (HF initialises them to ones, which would hide a wrong split).
"""

from __future__ import annotations

import torch
from tp_losses import T, V, batch, reference_loss, sharded_loss  # noqa: F401 (used by the tests)

import fpar


def _decoder(**kw) -> dict:
    cfg = dict(
        num_hidden_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=48,
        vocab_size=V,
        max_position_embeddings=32,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    cfg.update(kw)
    return cfg


def _build(config_cls: str, model_cls: str, meta: bool = False, **cfg):
    import transformers

    config = getattr(transformers, config_cls)(**cfg)
    if meta:
        with torch.device("meta"):
            model = getattr(transformers, model_cls)(config)
        model.set_attn_implementation("eager")
        return model.eval()
    return _ready(getattr(transformers, model_cls)(config))


def llama(meta=False, **kw):
    return _build("LlamaConfig", "LlamaForCausalLM", meta, **_decoder(**kw))


def qwen2(meta=False, **kw):
    return _build("Qwen2Config", "Qwen2ForCausalLM", meta, **_decoder(**kw))


def qwen3(meta=False, **kw):
    return _build("Qwen3Config", "Qwen3ForCausalLM", meta, **_decoder(head_dim=8, **kw))


def gemma3(meta=False, **kw):
    cfg = _decoder(head_dim=8, sliding_window=4, query_pre_attn_scalar=8, **kw)
    cfg.setdefault("layer_types", ["sliding_attention", "full_attention"] * cfg["num_hidden_layers"])
    cfg["layer_types"] = cfg["layer_types"][: cfg["num_hidden_layers"]]
    return _build("Gemma3TextConfig", "Gemma3ForCausalLM", meta, **cfg)


def phi3(meta=False, **kw):
    return _build("Phi3Config", "Phi3ForCausalLM", meta, **_decoder(**kw))


def gpt_neox(meta=False, **kw):
    cfg = _decoder(**kw)
    cfg.pop("num_key_value_heads")
    return _build("GPTNeoXConfig", "GPTNeoXForCausalLM", meta, **cfg)


def olmo2(meta=False, **kw):
    return _build("Olmo2Config", "Olmo2ForCausalLM", meta, **_decoder(**kw))


def mixtral(meta=False, **kw):
    cfg = _decoder(num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0, **kw)
    return _build("MixtralConfig", "MixtralForCausalLM", meta, **cfg)


def qwen3_moe(meta=False, **kw):
    cfg = _decoder(head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, **kw)
    cfg.setdefault("decoder_sparse_step", 1)
    cfg.setdefault("norm_topk_prob", True)
    return _build("Qwen3MoeConfig", "Qwen3MoeForCausalLM", meta, **cfg)


def deepseek_v2(meta=False, **kw):
    """Multi-head latent attention (``mla_kv_a_proj``, heads split over q_b/kv_b) and routed + shared
    experts; kv heads as many as heads and the rotary width as ``head_dim``, as DeepSeek's configs."""
    cfg = _decoder(num_key_value_heads=4, head_dim=4, q_lora_rank=16, kv_lora_rank=16, **kw)
    cfg.update(qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, n_routed_experts=4)
    cfg.update(num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1, first_k_dense_replace=0)
    cfg.update(n_group=1, topk_group=1)
    return _build("DeepseekV2Config", "DeepseekV2ForCausalLM", meta, **cfg)


def aria(meta=False, **kw):
    """Experts stored [experts, in, out] (``is_transposed``): 'packed_rowwise' [gate | up], 'colwise' down."""
    cfg = _decoder(moe_num_experts=4, moe_topk=2, moe_num_shared_experts=1, **kw)
    return _build("AriaTextConfig", "AriaTextForCausalLM", meta, **cfg)


def doge(meta=False, **kw):
    """A dynamic mask from the values: ``dt_proj`` (every kv head -> a gate a kv head) and ``A``."""
    return _build("DogeConfig", "DogeForCausalLM", meta, **_decoder(**kw))


def gpt2(meta=False, **kw):
    cfg = dict(n_layer=1, n_embd=32, n_head=4, vocab_size=V, n_positions=16, bos_token_id=0, eos_token_id=0)
    return _build("GPT2Config", "GPT2LMHeadModel", meta, **{**cfg, **kw})


def bert(meta=False, **kw):
    cfg = dict(
        num_hidden_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        intermediate_size=64,
        vocab_size=V,
        max_position_embeddings=16,
    )
    return _build("BertConfig", "BertModel", meta, **{**cfg, **kw})


FAMILIES = {
    "llama": llama,
    "qwen2": qwen2,
    "qwen3": qwen3,
    "gemma3": gemma3,
    "phi3": phi3,
    "gpt_neox": gpt_neox,
    "olmo2": olmo2,
    "mixtral": mixtral,
    "qwen3_moe": qwen3_moe,
    "deepseek_v2": deepseek_v2,
    "aria": aria,
    "doge": doge,
    "gpt2": gpt2,
    "bert": bert,
}


def sp_plan(model) -> dict:
    """The model's own plan with its decoder layers' norms in HF's ``sequence_parallel`` style.

    Keys of the model's plan that name nothing are dropped (``plan="auto"`` skips them; a user's
    ``plan=`` dict may not hold them).
    """
    import re

    names = [n for n, _ in model.named_modules()] + [n for n, _ in model.named_parameters()]

    def used(key: str) -> bool:
        return any(re.fullmatch(re.escape(key).replace(r"\*", r"\d+"), n) for n in names)

    plan = {k: v for k, v in model.tp_plan.items() if used(k)}
    for name, module in model.named_modules():
        if "norm" in type(module).__name__.lower() and re.fullmatch(r"(.*\.)?\d+\.\w+", name):
            plan[re.sub(r"\.\d+\.", ".*.", name)] = "sequence_parallel"
    return plan


def _ready(model):
    """float64, eager attention (sdpa differs from eager by ~1e-8 even in float64), no dropout."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():  # random norm weights and biases too
            p.normal_(0.0, 0.3)
    model.set_attn_implementation("eager")
    if getattr(model.config, "_experts_implementation", "none") != "none":
        model.set_experts_implementation("batched_mm")  # grouped_mm has no float64 kernel
    return model.double().eval()


# Tolerances: float64 throughout, except where the HF modules themselves compute in float32 (Gemma 3's
# RMSNorm runs in float32, so its weight gradient is a float32 sum whose order the split changes;
# OLMo 2's q/k norms are float32 statistics, which fpar sums per device and then over the axis;
# DeepSeek's router scores in float32).
FLOAT32_INSIDE = {"gemma3", "olmo2", "deepseek_v2"}


def tolerances(family: str) -> dict:
    return dict(rtol=1e-5, atol=1e-7) if family in FLOAT32_INSIDE else dict(rtol=1e-9, atol=1e-10)


def compare(got: dict, want: dict, what: str, **tol) -> None:
    assert set(got) == set(want), what
    for k in want:
        assert got[k].shape == want[k].shape, f"{what} {k}: {tuple(got[k].shape)} != {tuple(want[k].shape)}"
        torch.testing.assert_close(got[k], want[k], **tol, msg=lambda m, k=k: f"{what} {k}: {m}")


def unsharded(model, ids):
    """Loss and gradients of the whole model on its own parameters (the reference)."""
    params = {k: p.detach() for k, p in model.named_parameters()}
    loss = reference_loss(model)
    return loss(params, ids), torch.func.grad(loss)(params, ids)


def sharded(model, mesh, ids, plan="auto"):
    """fpar's loss and gradients (exported to the model's layout), and the raw gradients."""
    apply_fn, params, specs = fpar.ops.tensor_parallel(model, mesh, plan=plan)
    causal = hasattr(model, "lm_head") or hasattr(model, "embed_out")
    loss = sharded_loss(apply_fn, mesh, specs, causal=causal)
    grads = torch.func.grad(loss)(params, ids)
    return loss(params, ids), apply_fn.export(grads), grads, apply_fn
