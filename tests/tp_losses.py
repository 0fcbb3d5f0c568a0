"""The losses the tensor-parallel tests compare (``tests/ops/tp_models.py``, ``tests/hf/hf_models.py``).

An HF model's unsharded float64 loss and the same loss through ``tensor_parallel``'s ``apply_fn``;
``batch`` draws token ids of the models' vocabulary ``V`` and length ``T``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import fpar
from fpar import P

V, T = 64, 8  # vocabulary, sequence


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
