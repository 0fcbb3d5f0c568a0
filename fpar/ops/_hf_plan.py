"""Plans for ``tensor_parallel``: Hugging Face's own plan strings, fpar's kinds, and family knowledge.

A plan maps module (or parameter) names to a *style*.  Two vocabularies are accepted, in
``plan="auto"`` (read from the model) and in a user's dict alike:

* fpar's kinds: ``colwise``, ``rowwise``, ``vocab``, ``replicate``;
* ``transformers``' strings (the names of 5.x and the older ones), each mapped to the fpar kind
  that computes what it means (``STYLES``).  A string fpar does not implement is an error naming
  the module and the string (``UNSUPPORTED``), never skipped.

``plan="auto"`` reads ``model.tp_plan``: ``transformers`` builds it when the model is constructed
from the config's ``base_model_tp_plan``, the head class's ``_tp_plan`` and the children's plans,
with the base-model prefix (``model.``) and a vocabulary-parallel ``embed_tokens``.  Its keys
match names whose layer numbers are replaced by ``*`` (``model.layers.*.mlp.up_proj``), as
``transformers`` matches them.  fpar keeps its own table only for families without a plan (GPT-2,
BERT), and knows two places where doing better than the plan needs the model's layout: fused
weights that the plan gathers (Phi-3's ``qkv_proj``/``gate_up_proj``: regrouped per device
instead) and norms over a split width (OLMo 2's ``q_norm``/``k_norm``: statistics summed with
``psum`` instead of gathering q/k/v).
"""

from __future__ import annotations

import re
import sys
from typing import Any

from torch import nn

_API = "fpar.ops.tensor_parallel"
KINDS = ("colwise", "rowwise", "vocab", "replicate")

# transformers' plan strings -> the fpar kind computing the same function (5.x names, then old ones).
STYLES = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    # transformers 5.25's style for key/value projections (MiniCPM5-MoE's): split by whole heads,
    # each head replicated on the devices whose query heads use it when there are fewer kv heads
    # than devices: what fpar's colwise does on an attention's key/value projections already
    "unit_colwise": "colwise",
    "colwise_gather_output": "colwise_gather",
    "rowwise_split_input": "rowwise_split",
    "embedding_rowwise": "vocab",
    "embedding_colwise": "embedding_colwise",
    "packed_colwise": "packed_colwise",
    # a 3-D expert weight stored [experts, in, out] (Aria's): its fused [gate | up] output, the last
    # dim, split as packed_colwise splits dim 1 of [experts, out, in]
    "packed_rowwise": "packed_rowwise",
    "replicated_with_grad_allreduce": "replicate",
    "replicate": "replicate",
    "all_reduce": "all_reduce",
    "moe_tp_experts": "moe_experts",
    # base_model_ep_plan's (with expert_axis=): experts split by expert, tokens sent by all_to_all
    "ep_dispatch_experts": "ep_experts",
    "grouped_gemm": "expert_rows",
    # the module runs on this device's sequence block: Megatron-SP for the whole model (see
    # fpar.ops.tensor_parallel: column-parallel inputs all-gathered, row-parallel outputs
    # reduce-scattered along the sequence)
    "sequence_parallel": "sequence_parallel",
    # DeepSeek's latent attention: kv_a_proj_with_mqa replicated, the rotary part of its output
    # (used by every device's heads, not through kv_b_proj) gradient-summed: what fpar.shard's
    # transpose of a replicated value gives
    "mla_kv_a_proj": "replicate",
    "colwise_rep": "colwise_gather",
    "rowwise_rep": "rowwise_split",
    # an attention whose bare parameters (sinks, a gate's bias: one a query head) have plan entries of
    # their own: its forward runs on its local blocks as every module of fpar's local copy does
    "local_params": "replicate",
}
UNSUPPORTED = {
    "moe_identity_expert": "longcat's identity experts",
    "local": "transformers 4.x: a module left on local shards, reduced by a parent 'gather' rule",
    "gather": "transformers 4.x: the reduction of 'local_*' children",
    "local_colwise": "transformers 4.x: colwise on local tensors, reduced by a parent 'gather' rule",
    "local_rowwise": "transformers 4.x: rowwise without its reduction, left to a parent 'gather' rule",
    "local_packed_rowwise": "transformers 4.x: a packed split on local tensors",
    "ep_router": "removed from transformers",
}


def kind_of(value: Any, where: str) -> str:
    """The internal kind of a plan value: an fpar kind, or a transformers string mapped by STYLES."""
    if value in KINDS:
        return value
    if isinstance(value, str) and value in STYLES:
        return STYLES[value]
    if isinstance(value, str) and value in UNSUPPORTED:
        raise ValueError(
            f"{_API}: {where} is {value!r} ({UNSUPPORTED[value]}), a transformers plan string fpar does "
            f"not implement. Give that module one of {KINDS} (or a supported transformers string: "
            f"{sorted(STYLES)}) in plan=."
        )
    raise TypeError(
        f"{_API}: {where} is {value!r}; it must be one of {KINDS} or a transformers plan string "
        f"({sorted(STYLES)})."
    )


EXPERT_KINDS = ("ep_experts", "expert_rows")


def model_plan(model: nn.Module, experts: bool = False) -> dict[str, str] | None:
    """The merged transformers plan of ``model`` (prefixed names, ``*`` for layer numbers), or None.

    ``experts``: the model's expert-parallel plan (``model.ep_plan``, from the config's
    ``base_model_ep_plan``) over its tensor-parallel one, as ``transformers`` applies both: the
    experts split by expert instead of by their hidden width.
    """
    plan = getattr(model, "tp_plan", None) if hasattr(model, "config") else None
    plan = dict(plan) if isinstance(plan, dict) else {}
    if experts:
        ep = getattr(model, "ep_plan", None) if hasattr(model, "config") else None
        if not isinstance(ep, dict) or not ep:
            raise ValueError(
                f"{_API}: expert_axis= needs the model's expert-parallel plan, and "
                f"{type(model).__name__} has none (its config has no base_model_ep_plan). Pass "
                f"plan={{'...experts': 'ep_dispatch_experts', '...experts.<weight>': 'grouped_gemm'}} "
                f"naming its experts, or leave expert_axis=None."
            )
        plan.update(ep)
    return plan or None


def generic(name: str) -> str:
    """Transformers' matching: layer numbers between dots become ``*``."""
    return re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), name)


# Families without a transformers plan, and the fused layouts fpar regroups ------------------------


def fpar_families() -> dict[type, tuple]:
    """``{module class: ((child, kind, groups), ...)}`` for families that carry no plan (GPT-2, BERT)."""
    if "transformers" not in sys.modules:
        try:
            import transformers  # noqa: F401
        except ImportError:
            return {}
    from transformers.models.bert import modeling_bert as bert
    from transformers.models.gpt2 import modeling_gpt2 as gpt2

    out: dict[type, tuple] = {
        gpt2.GPT2Attention: (("c_attn", "colwise", 3), ("c_proj", "rowwise", 1)),
        gpt2.GPT2MLP: (("c_fc", "colwise", 1), ("c_proj", "rowwise", 1)),
        bert.BertSelfAttention: (("query", "colwise", 1), ("key", "colwise", 1), ("value", "colwise", 1)),
        bert.BertSelfOutput: (("dense", "rowwise", 1),),
        bert.BertIntermediate: (("dense", "colwise", 1),),
        bert.BertOutput: (("dense", "rowwise", 1),),
    }
    for model in (gpt2.GPT2LMHeadModel, gpt2.GPT2Model, bert.BertModel):
        out.setdefault(model, ())
    return out


def family_of(module: nn.Module, families: dict) -> type | None:
    """A recognised class that ``module`` subclasses (HF attention classes are subclassed)."""
    return next((cls for cls in families if isinstance(module, cls)), None)


def _classes(module_path: str, *names: str) -> tuple[type, ...]:
    mod = sys.modules.get(module_path)
    return tuple(getattr(mod, name) for name in names if mod is not None and hasattr(mod, name))


def fused_layouts(module: nn.Module) -> dict[str, tuple[str, str]]:
    """``{fused child: (consumer child, layout)}`` where fpar regroups instead of the plan's gather.

    ``layout`` is ``"qkv"`` (``[q | k | v]`` rows: q heads, then kv heads twice) or ``"pair"``
    (``[gate | up]``).  Only classes whose forward fpar has checked: Phi-3's attention and MLP.
    """
    attn = _classes("transformers.models.phi3.modeling_phi3", "Phi3Attention")
    mlp = _classes("transformers.models.phi3.modeling_phi3", "Phi3MLP")
    if attn and isinstance(module, attn):
        return {"qkv_proj": ("o_proj", "qkv")}
    if mlp and isinstance(module, mlp):
        return {"gate_up_proj": ("down_proj", "pair")}
    return {}


def per_head_gate(module: nn.Module) -> bool:
    """Doge's attention: a dynamic mask from ``dt_proj`` (kv heads' values -> one gate a kv head) and ``A``."""
    attn = _classes("transformers.models.doge.modeling_doge", "DogeAttention")
    return bool(attn) and isinstance(module, attn)


def split_norms(module: nn.Module) -> dict[str, str]:
    """``{norm child: projection child}`` of norms over a whole projection's width (OLMo 2's q/k norms).

    The plan gathers q, k and v to apply them; fpar splits the norm weight with the heads and sums
    the statistics with ``psum``.
    """
    attn = _classes("transformers.models.olmo2.modeling_olmo2", "Olmo2Attention")
    if attn and isinstance(module, attn):
        return {"q_norm": "q_proj", "k_norm": "k_proj"}
    return {}


def head_counts(module: nn.Module) -> tuple[int, int, int] | None:
    """``(heads, kv heads, head dim)`` of an attention module, from its config and attributes."""
    config = getattr(module, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int) or isinstance(heads, bool):
        return None
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(module, "head_dim", None) or getattr(module, "head_size", None)
    if not isinstance(head_dim, int):
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    k_proj = getattr(module, "k_proj", None)  # a layer's own count (MiMo-V2-Flash's sliding layers: 2x)
    if isinstance(k_proj, nn.Linear) and k_proj.out_features % head_dim == 0:
        kv = k_proj.out_features // head_dim
    return heads, kv, head_dim


def working_sizes(heads: int, kv: int) -> list[int]:
    """Tensor sizes that split ``heads`` query heads with ``kv`` kv heads (kv replicated if fewer)."""
    return [s for s in range(1, heads + 1) if heads % s == 0 and (kv % s == 0 or s % kv == 0)]


def check_heads(owner: str, heads: int, kv: int, n: int) -> None:
    """Each device must hold whole query heads, and its kv heads whole (or one replicated kv head)."""
    if heads % n == 0 and (kv % n == 0 or n % kv == 0):
        return
    why = (
        f"{heads} attention heads, not divisible by the size {n} of the tensor axis"
        if heads % n
        else f"{kv} key/value heads, and the size {n} of the tensor axis neither divides {kv} nor is a "
        f"multiple of it"
    )
    raise ValueError(
        f"{_API}: {owner} has {why}: each device must hold whole query heads and whole key/value heads "
        f"(replicated when there are fewer kv heads than devices). Tensor sizes that work: "
        f"{working_sizes(heads, kv)}."
    )
