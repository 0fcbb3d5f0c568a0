"""Tiny random-init Hugging Face models and per-device losses for the tensor_parallel tests.

Module-level so that the real-mesh worker (``tp_workers``) builds exactly the same models.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import fpar
from fpar import P

V, T = 64, 8  # vocabulary, sequence


def gpt2(**kw):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = dict(n_layer=2, n_embd=32, n_head=4, vocab_size=V, n_positions=16, bos_token_id=0, eos_token_id=0)
    return _ready(GPT2LMHeadModel(GPT2Config(**{**cfg, **kw})))


def llama(**kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    return _ready(LlamaForCausalLM(LlamaConfig(**{**_decoder(), **kw})))


def mistral(**kw):
    from transformers import MistralConfig, MistralForCausalLM

    return _ready(MistralForCausalLM(MistralConfig(**{**_decoder(), **kw})))


def bert(**kw):
    from transformers import BertConfig, BertModel

    cfg = dict(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        intermediate_size=64,
        vocab_size=V,
        max_position_embeddings=16,
    )
    return _ready(BertModel(BertConfig(**{**cfg, **kw})))


FAMILIES = {"gpt2": gpt2, "llama": llama, "mistral": mistral, "bert": bert}


def _decoder() -> dict:
    return dict(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=V,
        max_position_embeddings=16,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )


def _ready(model):
    """float64, eager attention (sdpa differs from eager by ~1e-8 even in float64), no dropout."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():  # random LayerNorm/RMSNorm weights and biases too
            p.normal_(0.0, 0.3)
    model.set_attn_implementation("eager")
    return model.double().eval()


def batch(rows: int = 4, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (rows, T), generator=torch.Generator().manual_seed(seed))


def reference_loss(model):
    """The unsharded loss: next-token cross-entropy in float64 (HF's own loss upcasts only to fp32)."""

    def loss(params, ids):
        out = torch.func.functional_call(model, params, (ids,), {"use_cache": False}, tie_weights=True)
        if hasattr(out, "logits"):
            logits = out.logits[:, :-1]
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        return out.last_hidden_state.tanh().square().mean()

    return loss


def sharded_loss(apply_fn, mesh, specs, causal: bool):
    """The same loss through tensor_parallel's apply_fn: HF's labels= path (vocab-parallel) or a
    mean over the hidden states; rows split over 'data' when the mesh has it."""
    data = "data" in mesh.axis_names

    def per_device(params, ids):
        if causal:
            loss = apply_fn(params, ids, labels=ids, use_cache=False).loss
        else:
            loss = apply_fn(params, ids).last_hidden_state.tanh().square().mean()
        return fpar.pmean(loss, "data") if data else loss

    return fpar.shard(per_device, mesh, (specs, P("data") if data else P()), P())
