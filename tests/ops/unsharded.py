"""Unsharded references for the fpar.ops layers: plain torch on global tensors, written independently.

Attention uses torch's ``scaled_dot_product_attention``, the loss ``F.cross_entropy`` and the
embedding ``F.embedding`` on the whole table, so the references share no code with the layers.
Parameters are the *global* tensors of the same dicts the sharded layers take.
"""

from __future__ import annotations

import torch.nn.functional as F


def linear(x, w, b=None):
    return F.linear(x, w.t(), b)


def mlp(p, x):
    h = F.gelu(linear(x, p["w_in"], p.get("b_in")))
    return linear(h, p["w_out"], p.get("b_out"))


def attention(p, x, n_heads, causal=True):
    b, t, d = x.shape
    w = p["w_qkv"].reshape(d, 3 * d)
    bias = p["b_qkv"].reshape(3 * d) if "b_qkv" in p else None
    qkv = linear(x, w, bias).reshape(b, t, 3, n_heads, d // n_heads)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # B,H,T,K
    o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return linear(o.transpose(1, 2).reshape(b, t, d), p["w_o"], p.get("b_o"))


def sdpa(q, k, v, causal=True):
    """q, k, v [B, T, H, K] -> [B, T, H, K]."""
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal
    )
    return o.transpose(1, 2)


def embedding(ids, w):
    return F.embedding(ids, w)


def cross_entropy(logits, targets):
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none"
    ).reshape(targets.shape)


def layer_norm(p, x):
    return F.layer_norm(x, x.shape[-1:], p["w"], p["b"], eps=1e-5)


def gpt_block(p, x, n_heads):
    x = x + attention(p["attn"], layer_norm(p["ln1"], x), n_heads)
    return x + mlp(p["mlp"], layer_norm(p["ln2"], x))


def gpt(p, ids, n_heads):
    x = embedding(ids, p["w_emb"]) + p["w_pos"][: ids.shape[1]]
    for block in p["blocks"]:
        x = gpt_block(block, x, n_heads)
    x = layer_norm(p["ln_f"], x)
    return x @ (p["w_head"] if "w_head" in p else p["w_emb"].t())


def gpt_loss(p, ids, targets, n_heads):
    return cross_entropy(gpt(p, ids, n_heads), targets)
