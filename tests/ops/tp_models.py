"""Tiny random-init Hugging Face models and per-device losses for the tensor_parallel tests.

Module-level so that the real-mesh worker (``tp_workers``) builds exactly the same models.
"""

from __future__ import annotations

import torch
from tp_losses import T, V, batch, reference_loss, sharded_loss  # noqa: F401 (used by the tests)


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
