"""plan="auto" on every Hugging Face family with a parallel plan (and fpar's own GPT-2 / BERT tables).

Independent reference everywhere: the same HF model run whole (``functional_call`` on the
module's own parameters), float64, tiny random-init configs (no downloads).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fpar
from fpar import P

pytest.importorskip("transformers", reason="the hf extra (pip install fpar[hf]) is not installed")

import hf_models  # noqa: E402  (needs transformers)

MESH = fpar.make_mesh((2, 2), ("data", "tensor"))


# Every family: loss and every gradient equal to the unsharded model's -------------------------------


@pytest.mark.parametrize("family", list(hf_models.FAMILIES))
def test_family_equals_unsharded_at_data_x_tensor(family):
    model = hf_models.FAMILIES[family]()
    ids = hf_models.batch()
    want_loss, want_grads = hf_models.unsharded(model, ids)
    loss, grads, _, _ = hf_models.sharded(model, MESH, ids)
    tol = hf_models.tolerances(family)
    torch.testing.assert_close(loss, want_loss, **tol)
    hf_models.compare(grads, want_grads, f"{family} grads", **tol)


def test_tied_embedding_and_head_stay_tied():
    model = hf_models.gemma3(tie_word_embeddings=True)  # Gemma ties them by default
    ids = hf_models.batch()
    want_loss, want_grads = hf_models.unsharded(model, ids)
    loss, grads, _, apply_fn = hf_models.sharded(model, MESH, ids)
    assert apply_fn.plan["lm_head"] == "vocab" and "lm_head.weight" not in grads
    torch.testing.assert_close(loss, want_loss, **hf_models.tolerances("gemma3"))
    hf_models.compare(grads, want_grads, "tied gemma3 grads", **hf_models.tolerances("gemma3"))


def test_auto_reads_the_model_plan():
    _, _, specs = fpar.ops.tensor_parallel(hf_models.qwen3(meta=True), MESH)
    layer = "model.layers.0."
    assert specs[layer + "self_attn.q_proj.weight"] == P("tensor", None)
    assert specs[layer + "self_attn.o_proj.weight"] == P(None, "tensor")
    assert specs[layer + "self_attn.q_norm.weight"] == P()  # replicated_with_grad_allreduce
    assert specs["model.embed_tokens.weight"] == P("tensor", None)  # embedding_rowwise
    assert specs["lm_head.weight"] == P("tensor", None)  # colwise_gather_output: logits kept split
    fn, _, specs = fpar.ops.tensor_parallel(hf_models.olmo2(meta=True), MESH)
    assert specs[layer + "self_attn.q_norm.weight"] == P("tensor")  # split with the heads
    assert fn.plan[layer + "self_attn.q_proj"] == "colwise"  # not gathered
    assert fn.plan[layer + "self_attn.o_proj"] == "rowwise"
    mixtral = hf_models.mixtral(meta=True)
    fn, _, specs = fpar.ops.tensor_parallel(mixtral, MESH)
    assert specs[layer + "mlp.gate.weight"] == P()
    if "model.layers.*.mlp.experts" in mixtral.tp_plan:  # transformers < 5.25: the experts split too
        assert fn.plan[layer + "mlp.experts"] == "moe_experts"
        assert specs[layer + "mlp.experts.gate_up_proj"] == P(None, "tensor", None)
    else:  # 5.25 took the experts out of the tensor-parallel plan (its expert plan's): replicated
        assert layer + "mlp.experts" not in fn.plan
        assert specs[layer + "mlp.experts.gate_up_proj"] == P() == specs[layer + "mlp.experts.down_proj"]
    # the strings transformers < 5.25 planned them with, given in plan=: fpar's expert tensor parallelism
    experts = "model.layers.*.mlp.experts"
    moe_tp = {
        experts + ".gate_up_proj": "packed_colwise",
        experts + ".down_proj": "rowwise",
        experts: "moe_tp_experts",
    }
    fn, _, specs = fpar.ops.tensor_parallel(mixtral, MESH, plan={**mixtral.tp_plan, **moe_tp})
    assert specs[layer + "mlp.experts.gate_up_proj"] == P(None, "tensor", None)
    assert specs[layer + "mlp.experts.down_proj"] == P(None, None, "tensor")
    assert specs[layer + "mlp.gate.weight"] == P()
    assert fn.plan[layer + "mlp.experts"] == "moe_experts"
    _, _, specs = fpar.ops.tensor_parallel(hf_models.gpt_neox(meta=True), MESH)
    assert specs["gpt_neox.embed_in.weight"] == P("tensor", None)
    assert specs["gpt_neox.layers.0.attention.query_key_value.weight"] == P("tensor", None)


def _local_elements(params: dict, specs: dict, mesh) -> int:
    """Elements one device holds: each split dim divided by its axis size."""
    total = 0
    for name, p in params.items():
        parts = math.prod(mesh.shape[a] for a in specs[name] if a is not None)
        total += p.numel() // parts
    return total


@pytest.mark.parametrize(
    ("family", "kv", "n"), [("llama", 2, 2), ("llama", 1, 2), ("llama", 2, 4), ("mixtral", 2, 2)]
)
def test_each_device_holds_its_share(family, kv, n):
    mesh = fpar.make_mesh((n,), ("tensor",))
    model = hf_models.FAMILIES[family](meta=True, num_key_value_heads=kv)
    _, params, specs = fpar.ops.tensor_parallel(model, mesh)
    d, h, hd, inter, v, layers = 32, 4, 8, 48, hf_models.V, 1
    kv_local = max(kv // n, 1)  # one replicated kv head when there are fewer than devices
    attn = (h // n) * hd * d * 2 + kv_local * hd * d * 2  # q, o; k, v
    if family == "mixtral":  # the router replicated; the experts split where the model's plan splits them
        experts, split = 4, "model.layers.*.mlp.experts" in model.tp_plan  # (not since transformers 5.25)
        mlp = experts * 3 * inter * d // (n if split else 1) + experts * d
    else:
        mlp = 3 * inter * d // n
    want = layers * (attn + mlp + 2 * d) + 2 * v * d // n + d  # norms, embedding, head, final norm
    assert _local_elements(params, specs, mesh) == want


# Fewer kv heads than tensor devices ------------------------------------------------------------------


@settings(max_examples=5, deadline=None)
@given(
    heads=st.sampled_from([2, 4, 8]),
    kv_choice=st.integers(0, 3),
    n=st.sampled_from([1, 2, 4, 8]),
    family=st.sampled_from(["llama", "qwen2", "phi3"]),
)
def test_kv_heads_replicated_or_split_equal_unsharded(heads, kv_choice, n, family):
    kvs = [k for k in range(1, heads + 1) if heads % k == 0]
    kv = kvs[kv_choice % len(kvs)]
    kw = dict(num_hidden_layers=1, hidden_size=4 * heads, num_attention_heads=heads, num_key_value_heads=kv)
    kw["head_dim"] = 4
    model = hf_models.FAMILIES[family](intermediate_size=8 * n, **kw)
    mesh = fpar.make_mesh((n,), ("tensor",))
    works = heads % n == 0 and (kv % n == 0 or n % kv == 0)
    if not works:
        sizes = [s for s in range(1, heads + 1) if heads % s == 0 and (kv % s == 0 or s % kv == 0)]
        with pytest.raises(ValueError, match=rf"Tensor sizes that work: \[{', '.join(map(str, sizes))}\]"):
            fpar.ops.tensor_parallel(model, mesh)
        return
    ids = hf_models.batch(rows=2)
    want_loss, want_grads = hf_models.unsharded(model, ids)
    loss, grads, raw, apply_fn = hf_models.sharded(model, mesh, ids)
    torch.testing.assert_close(loss, want_loss, rtol=1e-9, atol=1e-10)
    hf_models.compare(grads, want_grads, f"{family} H={heads} kv={kv} n={n}", rtol=1e-9, atol=1e-10)
    assert bool(apply_fn.replicated) == (kv < n)
    for name in apply_fn.replicated:  # every replica carries the same (summed) gradient
        dim, index = apply_fn.source(name)
        g = raw[name]
        for row in index.unique():
            copies = g.index_select(dim, (index == row).nonzero().flatten())
            assert (copies == copies.narrow(dim, 0, 1)).all(), name


@pytest.mark.parametrize("kv, n", [(1, 2), (2, 4), (4, 2)])
def test_unit_colwise_kv_projections_are_split_by_heads_replicated_if_fewer_than_devices(kv, n):
    """transformers' 'unit_colwise' (5.25, MiniCPM5-MoE's k_proj/v_proj): whole heads a device, a kv
    head repeated on the devices whose query heads use it: the same blocks as fpar's colwise there."""
    model = hf_models.llama(num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=kv)
    mesh = fpar.make_mesh((n,), ("tensor",))
    unit = {
        **model.tp_plan,
        **dict.fromkeys(
            ("model.layers.*.self_attn.k_proj", "model.layers.*.self_attn.v_proj"), "unit_colwise"
        ),
    }
    apply_u, params_u, specs_u = fpar.ops.tensor_parallel(model, mesh, plan=unit)
    apply_c, params_c, specs_c = fpar.ops.tensor_parallel(model, mesh)
    assert model.tp_plan["model.layers.*.self_attn.k_proj"] == "colwise"
    assert specs_u == specs_c and set(apply_u.replicated) == set(apply_c.replicated)
    assert bool(apply_u.replicated) == (kv < n)
    assert all(torch.equal(params_u[k], params_c[k]) for k in params_c)
    ids = hf_models.batch(rows=2)
    want_loss, want_grads = hf_models.unsharded(model, ids)
    loss, grads, _, _ = hf_models.sharded(model, mesh, ids, plan=unit)
    torch.testing.assert_close(loss, want_loss, rtol=1e-9, atol=1e-10)
    hf_models.compare(grads, want_grads, f"unit_colwise kv={kv} n={n}", rtol=1e-9, atol=1e-10)


def test_source_of_replicated_kv_and_regrouped_fused_weights():
    model = hf_models.phi3(meta=True, num_key_value_heads=1)
    apply_fn, params, _ = fpar.ops.tensor_parallel(model, fpar.make_mesh((2,), ("tensor",)))
    name = "model.layers.0.self_attn.qkv_proj.weight"  # [q (32) | k (8) | v (8)], 1 kv head, 2 devices
    dim, index = apply_fn.source(name)
    q, k, v = list(range(32)), list(range(32, 40)), list(range(40, 48))
    assert dim == 0 and index.tolist() == q[:16] + k + v + q[16:] + k + v
    assert params[name].shape == (64, 32) and model.get_parameter(name).shape == (48, 32)
    assert apply_fn.export({name: params[name]})[name].shape == (48, 32)
    dim, index = apply_fn.source("model.layers.0.mlp.gate_up_proj.weight")  # [gate | up], 48 each
    assert index.tolist() == [*range(0, 24), *range(48, 72), *range(24, 48), *range(72, 96)]


@pytest.mark.parametrize("family", ["llama", "phi3", "olmo2", "mixtral"])
def test_source_export_round_trip(family):
    model = hf_models.FAMILIES[family](num_key_value_heads=1)
    apply_fn, params, _ = fpar.ops.tensor_parallel(model, MESH)
    own = {k: p.detach() for k, p in model.named_parameters()}
    for name, value in params.items():
        found = apply_fn.source(name)
        want = own[name] if found is None else own[name].index_select(*found)
        assert torch.equal(value, want), name
        assert torch.equal(apply_fn.export({name: value})[name], own[name]), name
    assert all(torch.equal(t, own[k]) for k, t in apply_fn.export(params).items())


# The loader's contract: source() and export() on GPT-2 and a meta model ---------------------------


def test_source_export_round_trip_gpt2():
    model = hf_models.gpt2()
    apply_fn, params, _ = fpar.ops.tensor_parallel(model, MESH)
    own = {k: p.detach() for k, p in model.named_parameters()}
    for name, value in params.items():
        found = apply_fn.source(name)
        assert torch.equal(value, own[name] if found is None else own[name].index_select(*found)), name
        assert list(apply_fn.export({name: value})) == [name]
    dim, index = apply_fn.source("transformer.h.0.attn.c_attn.weight")
    assert dim == 1  # Conv1D: [in, out]; device 0's block is its q, k and v heads
    assert index[:48].tolist() == [*range(0, 16), *range(32, 48), *range(64, 80)]
    assert apply_fn.source("transformer.h.0.attn.c_proj.weight") is None
    with pytest.raises(KeyError, match=r"source\('nope'\): no such parameter"):
        apply_fn.source("nope")


def test_meta_model_gives_meta_params_of_the_global_shapes():
    model = hf_models.llama(meta=True, num_key_value_heads=1)
    apply_fn, params, _ = fpar.ops.tensor_parallel(model, MESH)
    assert all(p.is_meta for p in params.values())
    name = "model.layers.0.self_attn.k_proj.weight"
    assert params[name].shape == (16, 32)  # one 8-row kv head on each of the 2 tensor devices
    dim, index = apply_fn.source(name)
    assert dim == 0 and index.tolist() == [*range(8), *range(8)]
    assert apply_fn.export({name: params[name]})[name].shape == (8, 32)


# Every plan string ------------------------------------------------------------------------------------

ATTENTION = [
    ("colwise", "rowwise"),
    ("colwise_gather_output", "rowwise_split_input"),
    ("colwise_rep", "rowwise_rep"),
    ("colwise_gather_output", "replicate"),
    ("replicate", "replicate"),
]
MLP = [
    ("colwise", "rowwise"),
    ("colwise_gather_output", "rowwise_split_input"),
    ("replicate", "replicate"),
]
EMBED = ["embedding_rowwise", "embedding_colwise", "replicate", "vocab"]
HEAD = ["colwise_gather_output", "colwise_rep", "vocab", "replicate"]
NORM = ["replicated_with_grad_allreduce", "replicate"]


@settings(max_examples=4, deadline=None)
@given(
    attn=st.sampled_from(ATTENTION),
    mlp=st.sampled_from(MLP),
    embed=st.sampled_from(EMBED),
    head=st.sampled_from(HEAD),
    norm=st.sampled_from(NORM),
)
def test_plan_strings_in_a_user_plan_equal_unsharded(attn, mlp, embed, head, norm):
    model = hf_models.qwen3(num_hidden_layers=1)
    plan = {
        "model.layers.*.self_attn.[qkv]_proj": attn[0],
        "model.layers.*.self_attn.o_proj": attn[1],
        "model.layers.*.self_attn.[qk]_norm": norm,
        "model.layers.*.mlp.gate_proj": mlp[0],
        "model.layers.*.mlp.up_proj": mlp[0],
        "model.layers.*.mlp.down_proj": mlp[1],
        "model.embed_tokens": embed,
        "lm_head": head,
    }
    ids = hf_models.batch()
    want_loss, want_grads = hf_models.unsharded(model, ids)
    mesh = fpar.make_mesh((2,), ("tensor",))
    apply_fn, params, specs = fpar.ops.tensor_parallel(model, mesh, plan=plan)
    split_logits = apply_fn.plan.get("lm_head") == "vocab"

    def per_device(p, x):
        if split_logits:
            return apply_fn(p, x, labels=x, use_cache=False).loss
        logits = apply_fn(p, x, use_cache=False).logits[:, :-1]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, hf_models.V), x[:, 1:].reshape(-1))

    loss = fpar.shard(per_device, mesh, (specs, P()), P())
    torch.testing.assert_close(loss(params, ids), want_loss, rtol=1e-9, atol=1e-10)
    grads = apply_fn.export(torch.func.grad(loss)(params, ids))
    hf_models.compare(grads, want_grads, f"plan {plan}", rtol=1e-9, atol=1e-10)


def test_packed_colwise_and_moe_strings_in_a_user_plan():
    model = hf_models.phi3(num_hidden_layers=1)
    plan = {"*.qkv_proj": "colwise_gather_output", "*.o_proj": "rowwise_split_input"}
    plan |= {"*.gate_up_proj": "packed_colwise", "*.down_proj": "rowwise"}
    plan |= {"model.embed_tokens": "embedding_rowwise", "lm_head": "colwise_gather_output"}
    ids = hf_models.batch()
    want_loss, want_grads = hf_models.unsharded(model, ids)
    loss, grads, _, apply_fn = hf_models.sharded(model, MESH, ids, plan=plan)
    assert apply_fn.plan["model.layers.0.mlp.gate_up_proj"] == "colwise"  # regrouped [gate_r | up_r]
    torch.testing.assert_close(loss, want_loss, rtol=1e-9, atol=1e-10)
    hf_models.compare(grads, want_grads, "phi3 user plan", rtol=1e-9, atol=1e-10)


# Bad input: clear errors before any communication ---------------------------------------------------


def test_error_unknown_plan_string():
    with pytest.raises(TypeError, match=r"plan\['lm_head'\] is 'colwise_gathered'; it must be one of"):
        fpar.ops.tensor_parallel(hf_models.llama(meta=True), MESH, plan={"lm_head": "colwise_gathered"})


def test_error_unsupported_plan_string_names_the_module():
    model = hf_models.llama(meta=True)
    model._tp_plan = {
        **model.tp_plan,
        "model.layers.*.mlp": "moe_identity_expert",
    }  # as a config would give
    with pytest.raises(
        ValueError,
        match=r"LlamaForCausalLM.tp_plan\['model.layers.\*.mlp'\] is 'moe_identity_expert' \(longcat's "
        r"identity experts\), a transformers plan string fpar does not implement",
    ):
        fpar.ops.tensor_parallel(model, MESH)
    with pytest.raises(ValueError, match=r"plan\['\*.mlp'\] is 'local_rowwise' \(transformers 4.x"):
        fpar.ops.tensor_parallel(model, MESH, plan={"*.mlp": "local_rowwise"})


def test_packed_rowwise_is_for_experts_stored_in_by_out():
    # Aria's [experts, in, out] experts: 'packed_rowwise' splits their fused output (dim 2); on a
    # Linear (a fused input dim) it is refused by name, and a plan whose experts' strings do not
    # match their layout is refused before anything is built.
    model = hf_models.llama(meta=True)
    with pytest.raises(
        TypeError,
        match=r"'model.layers.0.mlp.down_proj' \(Linear, plan '\*.down_proj'\): "
        r"'packed_rowwise' applies to a 3-D expert weight stored \[experts, in, out\]",
    ):
        fpar.ops.tensor_parallel(model, MESH, plan={"*.down_proj": "packed_rowwise"})
    aria = hf_models.aria(meta=True)
    # Aria's experts as transformers < 5.25 planned them (5.25 leaves them to its expert plan)
    experts = "model.layers.*.mlp.experts"
    own = {
        experts + ".gate_up_proj": "packed_rowwise",
        experts + ".down_proj": "colwise",
        experts: "moe_tp_experts",
    }
    plan = {**aria.tp_plan, **own, experts + ".gate_up_proj": "packed_colwise"}
    plan |= {experts + ".down_proj": "rowwise"}  # the [experts, out, in] strings
    with pytest.raises(
        TypeError,
        match=r"this one has is_transposed=True with gate_up_proj 'packed_colwise' "
        r"\(its layout needs 'packed_rowwise'\), is_transposed=True with down_proj 'rowwise' "
        r"\(its layout needs 'colwise'\)",
    ):
        fpar.ops.tensor_parallel(aria, MESH, plan=plan)
    apply_fn, params, specs = fpar.ops.tensor_parallel(aria, MESH, plan={**aria.tp_plan, **own})
    assert specs["model.layers.0.mlp.experts.gate_up_proj"] == P(None, None, "tensor")
    assert specs["model.layers.0.mlp.experts.down_proj"] == P(None, "tensor", None)
    assert apply_fn.regrouped["model.layers.0.mlp.experts.gate_up_proj"] == 2  # [gate_r | up_r] a device


def test_attention_sinks_split_by_their_own_rule_equal_unsharded():
    """'local_params' on an attention and 'colwise' on its bare sinks (one a query head), as Granite-SWA,
    MiMo-V2-Flash and HY-V4 plan them: each device keeps its heads' sinks."""
    import pp_families

    model, _ = pp_families.tiny("granite_swa")
    apply_fn, params, specs = fpar.ops.tensor_parallel(model, MESH)
    sinks = [k for k in params if k.endswith("self_attn.sinks")]
    assert sinks and model.tp_plan["model.layers.*.self_attn"] == "local_params"
    for k in sinks:
        assert specs[k] == P("tensor"), k
    ids = hf_models.batch()
    loss = hf_models.sharded_loss(apply_fn, MESH, specs, causal=True)
    want_loss, want_grads = hf_models.unsharded(model, ids)
    torch.testing.assert_close(loss(params, ids), want_loss, rtol=1e-9, atol=1e-10)
    grads = apply_fn.export(torch.func.grad(loss)(params, ids))
    hf_models.compare(grads, want_grads, "granite_swa sinks", rtol=1e-9, atol=1e-10)
    plan = {**model.tp_plan, "model.layers.*.self_attn.sinks": "rowwise"}
    with pytest.raises(
        TypeError,
        match=r"parameter 'model.layers.0.self_attn.sinks' \(\(4,\), plan 'model.layers.\*.self_attn.sinks'\): a "
        r"rule naming a parameter applies to 3-D expert weights .* got 'rowwise' on a 1-D tensor",
    ):
        fpar.ops.tensor_parallel(model, MESH, plan=plan)


def test_error_plan_naming_no_module():
    model = hf_models.llama(meta=True)
    model._tp_plan = {"model.blocks.*.attn.wq": "colwise"}  # a plan written for another module tree
    with pytest.raises(ValueError, match=r"the tensor-parallel plan of LlamaForCausalLM names no module"):
        fpar.ops.tensor_parallel(model, MESH)
    with pytest.raises(ValueError, match=r"plan pattern 'model.layers.\*.attn.wq' matches no module"):
        fpar.ops.tensor_parallel(model, MESH, plan={"model.layers.*.attn.wq": "colwise"})


def test_error_tensor_size_dividing_neither_heads_nor_kv_heads():
    model = hf_models.llama(meta=True, num_attention_heads=8, num_key_value_heads=2, head_dim=4)
    with pytest.raises(
        ValueError,
        match=r"LlamaForCausalLM has 8 attention heads, not divisible by the size 3 of the tensor axis: .* "
        r"Tensor sizes that work: \[1, 2, 4, 8\]",
    ):
        fpar.ops.tensor_parallel(model, fpar.make_mesh((3,), ("tensor",)))


# The real mesh --------------------------------------------------------------------------------------


@pytest.mark.multiprocess
def test_real_mesh_equals_in_process_and_unsharded():
    import hf_workers

    results = fpar.launch(hf_workers.worker, 2, timeout=240.0)
    for rank, (_, kept) in enumerate(results):
        # sequence parallelism: each process keeps its norms' and residuals' sequence block
        assert kept["sp"] < 0.9 * kept["tp"], f"rank {rank}: bytes kept for the backward {kept}"
    results = [got for got, _ in results]
    want = hf_workers.run(fpar.make_mesh((2,), ("tensor",)))
    for case, (family, kw) in hf_workers.CASES.items():
        model = hf_models.FAMILIES[family](num_hidden_layers=1, **kw)
        ref_loss, ref_grads = hf_models.unsharded(model, hf_models.batch())
        # HF's RMSNorms compute in float32: the real mesh's sums in another order move a float32
        # rounding now and then, so real vs in-process agree to float32 precision, not float64.
        tol = hf_models.tolerances("gemma3")
        for rank, got in enumerate(results):
            value, grads, replicas = got[case]
            torch.testing.assert_close(value, want[case][0], **tol)
            hf_models.compare(grads, want[case][1], f"rank {rank} {case} real vs in-process", **tol)
            hf_models.compare(grads, ref_grads, f"rank {rank} {case} real vs unsharded", **tol)
            torch.testing.assert_close(value, ref_loss, **tol)
            for name, g in replicas.items():  # kv rows replicated on both devices: equal gradients
                half = g.shape[0] // 2 if "qkv" not in name else None
                if half is not None:
                    assert torch.equal(g[:half], g[half:]), f"rank {rank} {case} {name}"


@pytest.mark.multiprocess
def test_sequence_parallel_beyond_attention_and_mlp_on_two_processes_equals_unsharded():
    # A region whose projections are all gathered (Qwen3-Next's linear attention: no row-parallel
    # exit to reduce-scatter) and a replicated module returning two per-token tensors (HY-V4's
    # hyper-connections) run on the whole sequence and give back this process's blocks.
    import hf_workers
    import pp_families

    results = fpar.launch(hf_workers.sp_families_worker, 2, timeout=240.0)
    for family, fields in hf_workers.SP_FAMILIES.items():
        model, _ = pp_families.tiny(family, **fields)
        if family == "qwen3_next":
            assert {"linear_attention", "full_attention"} <= set(model.config.layer_types)
        want_loss, want_grads = hf_models.unsharded(model, hf_models.batch())
        # float32 inside (norms, gates, hyper-connections): sums in another order move a float32
        # rounding, so each gradient to 1e-5 of its largest entry
        for rank, got in enumerate(results):
            value, grads = got[family]
            torch.testing.assert_close(value, want_loss, rtol=1e-6, atol=0)
            assert set(grads) == set(want_grads)
            for name, want in want_grads.items():
                atol = 1e-5 * float(want.abs().max()) + 1e-12
                torch.testing.assert_close(
                    grads[name],
                    want,
                    rtol=1e-5,
                    atol=atol,
                    msg=lambda m, r=rank, f=family, k=name: f"rank {r} {f} {k}: {m}",
                )
