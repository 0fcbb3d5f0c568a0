"""The real-mesh side of test_hf_families: several families on 2 gloo processes (module-level: spawned)."""

from __future__ import annotations

import hf_models
import torch

import fpar

# One launch covers the collectives fpar adds to Megatron's: kv heads replicated and tied through a
# psum (Llama, kv=1), fused weights regrouped with a replicated kv head (Phi-3), experts (Mixtral),
# sequence parallelism (Llama with its norms 'sequence_parallel': gathers and reduce-scatters; Mixtral's
# experts beside it),
# DeepSeek's latent attention, Aria's transposed experts, Doge's per-head gates.
# OLMo 2's split norms and Gemma 3 are checked in-process only (CI time).
CASES = {
    "llama_kv1": ("llama", dict(num_key_value_heads=1)),
    "phi3_kv1": ("phi3", dict(num_key_value_heads=1)),
    "mixtral": ("mixtral", {}),
    "llama_sp": ("llama", dict(num_key_value_heads=1)),
    "mixtral_sp": ("mixtral", {}),  # its experts on the gathered sequence, all-reduced, then its block
    "deepseek_v2": ("deepseek_v2", {}),  # latent attention: kv_a_proj replicated, its rope part summed
    "aria": ("aria", {}),  # experts [experts, in, out] in their own loop: packed_rowwise / colwise
    "doge": ("doge", {}),  # dt_proj all-reduced, then this device's kv heads' gates
}


def worker():
    torch.set_num_threads(1)
    mesh = fpar.make_mesh((2,), ("tensor",))
    return run(mesh), kept_bytes(mesh)


def kept_bytes(mesh: fpar.Mesh) -> dict:
    """The bytes this process keeps for the backward of a 4-layer Llama's loss, without and with SP."""
    model = hf_models.llama(num_hidden_layers=4)
    out = {}
    for name, plan in (("tp", "auto"), ("sp", hf_models.sp_plan(model))):
        apply_fn, params, specs = fpar.ops.tensor_parallel(model, mesh, plan=plan)
        params = {k: v.requires_grad_() for k, v in fpar.device_put(params, mesh, specs).items()}
        loss = hf_models.sharded_loss(apply_fn, mesh, specs, causal=True)
        own = {p.untyped_storage().data_ptr() for p in params.values()}
        seen: dict = {}

        def pack(t, seen=seen, own=own):
            if t.untyped_storage().data_ptr() not in own:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss(params, hf_models.batch())
        out[name] = sum(seen.values())
    return out


def run(mesh: fpar.Mesh) -> dict:
    """``{case: (loss, gradients in the model's layout, the raw replicated kv gradient rows)}``."""
    out = {}
    for case, (family, kw) in CASES.items():
        model = hf_models.FAMILIES[family](num_hidden_layers=1, **kw)
        plan = hf_models.sp_plan(model) if case.endswith("_sp") else "auto"
        apply_fn, params, specs = fpar.ops.tensor_parallel(model, mesh, plan=plan)
        params = fpar.device_put(params, mesh, specs)
        loss = hf_models.sharded_loss(apply_fn, mesh, specs, causal=True)
        ids = hf_models.batch()
        value = loss(params, ids)
        grads = fpar.gather(torch.func.grad(loss)(params, ids), mesh, specs)
        replicas = {name: grads[name] for name in apply_fn.replicated}
        out[case] = (value.detach(), apply_fn.export(grads), replicas)
    return out


def expert_worker(grouped: bool = False):
    """Qwen3-MoE with its experts split over 2 processes (the exact-count exchange): loss, whole gradients.

    ``grouped``: the model in float32 with transformers' ``grouped_mm`` experts (its default; no
    float64 kernel), which the real mesh keeps (in-process they run ``batched_mm``).
    """
    torch.set_num_threads(1)
    mesh = fpar.make_mesh((2, 1), ("expert", "tensor"))
    model = hf_models.qwen3_moe(num_hidden_layers=2)
    if grouped:
        model = model.float()
        model.set_experts_implementation("grouped_mm")
    apply_fn, params, specs = fpar.ops.tensor_parallel(model, mesh, expert_axis="expert")
    if grouped:
        assert apply_fn.module.config._experts_implementation == "grouped_mm"
    params = fpar.device_put(params, mesh, specs)

    def per_device(p, ids):
        return fpar.pmean(apply_fn(p, ids, labels=ids, use_cache=False).loss, "expert")

    loss = fpar.shard(per_device, mesh, (specs, fpar.P("expert")), fpar.P())
    ids = hf_models.batch(rows=4)
    grads = fpar.gather(torch.func.grad(loss)(params, ids), mesh, specs)
    return loss(params, ids).detach(), apply_fn.export(grads)


# Sequence parallelism where a decoder layer's module is not an attention or MLP region: Qwen3-Next's
# linear attention (its projections all 'colwise_gather_output', no row-parallel exit) and HY-V4's
# hyper-connections (replicated modules returning two per-token tensors).
SP_FAMILIES = {
    "qwen3_next": dict(layer_types=["linear_attention", "full_attention"]),
    "hy_v4": {},
}


def sp_families_worker():
    """``{family: (loss, whole gradients)}`` with sequence parallelism on a 2-process tensor axis."""
    import pp_families

    torch.set_num_threads(1)
    mesh = fpar.make_mesh((2,), ("tensor",))
    out = {}
    for family, fields in SP_FAMILIES.items():
        model, _ = pp_families.tiny(family, **fields)
        apply_fn, params, specs = fpar.ops.tensor_parallel(model, mesh, plan=hf_models.sp_plan(model))
        params = fpar.device_put(params, mesh, specs)
        loss = hf_models.sharded_loss(apply_fn, mesh, specs, causal=True)
        ids = hf_models.batch()
        grads = fpar.gather(torch.func.grad(loss)(params, ids), mesh, specs)
        out[family] = (loss(params, ids).detach(), apply_fn.export(grads))
    return out
