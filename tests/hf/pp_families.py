"""Every causal-LM family ``transformers`` ships a ``base_model_pp_plan`` for, tiny, with its scalings off default.

``tiny(name)`` builds a random-init float64 model of 2 layers from the family's own config class,
sizes shrunk where the config has them, and every scaling the config has (an attribute named
``*multiplier*``, ``*scal*`` or ``*softcap*`` holding a number, or a soft-cap left off) set to a
value that is not its default, so that a pipeline cut that drops one gives another loss.
"""

from __future__ import annotations

import re

import torch

SIZES = dict(
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    vocab_size=64,
    max_position_embeddings=64,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=0,
    router_jitter_noise=0.0,
    sliding_window=3,
    # multi-head latent attention (DeepSeek V2/V3 and their kin)
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_rope_head_dim=4,
    qk_nope_head_dim=4,
    v_head_dim=8,
    # linear attention (Kimi-Linear, Qwen3-Next / 3.5, Lara): the defaults' 128-wide heads made one
    # tiny model's gradient take 20 s of torch's per-example vmap fallback
    linear_head_dim=8,
    linear_num_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    # tie_word_embeddings: the family's own default (most small decoders tie)
    pad_token_id=0,
    bos_token_id=0,
    eos_token_id=0,
    # GPT-style spellings
    n_embd=32,
    n_layer=2,
    n_head=4,
    n_positions=64,
    rotary_dim=4,
    n_inner=48,
)
SCALING = re.compile(r"multiplier|scal|softcap")


def families() -> dict[str, tuple[type, str]]:
    """``{config name: (config class, causal LM class name)}`` for every family with a pp plan."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = {}
    for name in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            config_cls = CONFIG_MAPPING[name]
        except (KeyError, ImportError):
            continue
        if getattr(config_cls, "base_model_pp_plan", None):
            out[name] = (config_cls, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[name])
    return out


def scalings(config) -> dict[str, float]:
    """The config's scalings, each moved off its default (numbers only; ``rope_scaling`` is a dict)."""
    out = {}
    for k, v in vars(config).items():
        if not SCALING.search(k) or isinstance(v, bool):
            continue
        if isinstance(v, float):
            out[k] = v * 1.75 + 0.25
        elif isinstance(v, int):
            out[k] = v * 2 + 3
        elif v is None and "softcap" in k:
            out[k] = 2.5
    return out


def tiny(name: str, meta: bool = False, layers: int = 2, **fields):
    """The family's causal LM, tiny, float64, eager attention, eval mode, scalings moved; and them.

    ``meta=True``: on the meta device (no values), for what needs only the structure.
    ``layers``: how many decoder layers; ``fields``: more of the config's fields (``layer_types``).
    """
    import transformers

    config_cls, model_cls = families()[name]
    defaults = config_cls()
    sizes = {**SIZES, "num_hidden_layers": layers, "n_layer": layers}
    kw = {k: v for k, v in sizes.items() if hasattr(defaults, k)}
    if hasattr(defaults, "layer_types") and defaults.layer_types is not None:
        kw["layer_types"] = None
    if "qk_rope_head_dim" in kw:  # multi-head latent attention: as DeepSeek's configs set them
        kw.update(head_dim=kw["qk_rope_head_dim"], num_key_value_heads=kw.get("num_attention_heads", 4))
    config = config_cls(**{**kw, **fields})
    for sub in vars(config).values():  # a multimodal family's encoders (Phi-4's 870M): tiny too
        if isinstance(sub, transformers.PretrainedConfig):
            for k, v in SIZES.items():
                if isinstance(getattr(sub, k, None), int) and k not in ("vocab_size", "pad_token_id"):
                    setattr(sub, k, v)
    moved = scalings(config)
    for k, v in moved.items():
        setattr(config, k, v)
    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        model = getattr(transformers, model_cls)(config)
    if not meta:
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.3)
    model.set_attn_implementation("eager")
    if getattr(model.config, "_experts_implementation", "none") not in ("none", None):
        model.set_experts_implementation("batched_mm")
    return model.double().eval(), moved


def pipeline_layers(name: str, p: int = 2, most: int = 12) -> int:
    """The fewest decoder layers (2 or more) with which the family's layers cut into ``p`` stages.

    Two layers for a family whose layers are all alike; a family whose first layers differ (dense
    before MoE) or whose layers repeat a unit of kinds (linear and full attention) needs as many
    as make whole units per stage (``fpar.hf.pipeline_stages`` cuts them by their pattern).  ``2``
    when no count up to ``most`` cuts (the pipeline then refuses the model by name).
    """
    from fpar.hf._pipeline import _cut, decoder_layers, layer_kinds

    for n in range(2, most + 1):
        structure, _ = tiny(name, meta=True, layers=n)
        try:
            base, attr = decoder_layers(structure, "pp_families")
            _cut(layer_kinds(getattr(base, attr)), p, 1, name, attr)
        except ValueError:  # no layer list (refused by pipeline_stages), or no cut with n layers
            continue
        return n
    return 2


def reference(model, xs, ys):
    """The unsharded model's mean next-token loss over microbatches ``xs`` and its gradient."""
    own = {k: p.detach() for k, p in model.named_parameters()}

    def loss(p):
        total = 0.0
        for x, y in zip(xs, ys):
            logits = torch.func.functional_call(model, p, (x,), {"use_cache": False}).logits
            total = total + torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        return total / len(xs)

    return loss(own), torch.func.grad(loss)(own)
