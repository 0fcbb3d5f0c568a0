"""fpar.ops.tensor_parallel: unmodified modules and HF models, Megatron-split, equal the unsharded model.

Independent reference everywhere: the same HF model run whole (``functional_call`` on the global
parameters), float64.  Tiny random-init configs (no downloads), eager attention on both sides.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from opstest import assert_tree_close
from torch import nn

import fpar
import fpar.optim as fo
from fpar import P

transformers = pytest.importorskip(
    "transformers", reason="the hf extra (pip install fpar[hf]) is not installed"
)

import tp_models  # noqa: E402  (needs transformers)
import tp_workers  # noqa: E402

MESH = fpar.make_mesh((2, 2), ("data", "tensor"))


def _unsharded_grads(model, ids):
    params = {k: p.detach() for k, p in model.named_parameters()}
    loss = tp_models.reference_loss(model)
    return loss(params, ids), torch.func.grad(loss)(params, ids)


# Values and gradients -------------------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(tp_models.FAMILIES))
def test_values_and_grads_equal_unsharded_data_x_tensor(family):
    model = tp_models.FAMILIES[family]()
    ids = tp_models.batch()
    want_loss, want_grads = _unsharded_grads(model, ids)
    apply_fn, params, specs = fpar.ops.tensor_parallel(model, MESH)
    loss = tp_models.sharded_loss(apply_fn, MESH, specs, causal=family != "bert")
    got_loss, grads = loss(params, ids), torch.func.grad(loss)(params, ids)
    assert_tree_close(got_loss, want_loss, what=f"{family} loss")
    assert_tree_close(apply_fn.export(grads), want_grads, what=f"{family} grads")


def test_auto_plan_splits_heads_and_mlp_and_vocab():
    model = tp_models.llama()
    apply_fn, params, specs = fpar.ops.tensor_parallel(model, MESH)
    layer = "model.layers.0."
    assert specs[layer + "self_attn.q_proj.weight"] == P("tensor", None)
    assert specs[layer + "self_attn.k_proj.weight"] == P("tensor", None)
    assert specs[layer + "self_attn.o_proj.weight"] == P(None, "tensor")
    assert specs[layer + "mlp.up_proj.weight"] == P("tensor", None)
    assert specs[layer + "mlp.down_proj.weight"] == P(None, "tensor")
    assert specs["model.embed_tokens.weight"] == P("tensor", None)
    assert specs["lm_head.weight"] == P("tensor", None)
    assert specs["model.norm.weight"] == P()
    assert {k: tuple(v.shape) for k, v in params.items()} == {
        k: tuple(p.shape) for k, p in model.named_parameters()
    }
    assert apply_fn.regrouped == {}


def test_gpt2_layout_and_tied_embedding():
    model = tp_models.gpt2()
    apply_fn, params, specs = fpar.ops.tensor_parallel(model, MESH)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert "lm_head.weight" not in params  # tied: once, under the embedding's name
    assert specs["transformer.wte.weight"] == P("tensor", None)
    assert specs["transformer.h.0.attn.c_attn.weight"] == P(None, "tensor")  # Conv1D: [in, out]
    assert specs["transformer.h.0.attn.c_proj.weight"] == P("tensor", None)
    assert specs["transformer.h.0.attn.c_proj.bias"] == P()
    assert specs["transformer.wpe.weight"] == P()
    assert apply_fn.plan["lm_head"] == "vocab"


def test_gpt2_c_attn_regrouped_per_device_and_export_undoes_it():
    model = tp_models.gpt2()
    apply_fn, params, _ = fpar.ops.tensor_parallel(model, MESH)
    name = "transformer.h.1.attn.c_attn.weight"
    w = model.transformer.h[1].attn.c_attn.weight.detach()  # [D, 3D] = [q | k | v]
    q, k, v = w.split(32, dim=1)
    want = torch.cat([q[:, :16], k[:, :16], v[:, :16], q[:, 16:], k[:, 16:], v[:, 16:]], dim=1)
    assert torch.equal(params[name], want)  # device 0's block holds its heads of q, k AND v
    assert set(apply_fn.regrouped) == {
        f"transformer.h.{i}.attn.c_attn.{p}" for i in (0, 1) for p in ("weight", "bias")
    }
    exported = apply_fn.export(params)
    assert all(torch.equal(exported[k], p) for k, p in model.named_parameters() if k in exported)
    assert model.transformer.h[1].attn.c_attn.weight.data_ptr() == w.data_ptr()  # the model is untouched


def test_vocab_not_divisible_replicates_embedding_and_head():
    model = tp_models.gpt2(vocab_size=63)
    ids = tp_models.batch() % 63
    apply_fn, params, specs = fpar.ops.tensor_parallel(model, MESH)
    assert specs["transformer.wte.weight"] == P()

    def per_device(p, x):  # replicated logits: HF's own loss would run in fp32; take it in float64
        logits = apply_fn(p, x, use_cache=False).logits[:, :-1]
        return fpar.pmean(F.cross_entropy(logits.reshape(-1, 63), x[:, 1:].reshape(-1)), "data")

    loss = fpar.shard(per_device, MESH, (specs, P("data")), P())
    want_loss, want_grads = _unsharded_grads(model, ids)
    assert_tree_close(loss(params, ids), want_loss, what="loss")
    assert_tree_close(apply_fn.export(torch.func.grad(loss)(params, ids)), want_grads, what="grads")


def test_logits_stay_vocab_split_and_padding_row_gets_no_gradient():
    model = tp_models.bert()  # word_embeddings has padding_idx=0
    ids = tp_models.batch()
    ids[:, -2:] = 0
    apply_fn, params, specs = fpar.ops.tensor_parallel(model, MESH)
    f = fpar.shard(
        lambda p, x: fpar.psum(apply_fn(p, x).last_hidden_state.sum(), "data"), MESH, (specs, P("data")), P()
    )
    with torch.no_grad():
        want = model(ids).last_hidden_state.sum()
    assert_tree_close(f(params, ids), want, what="value")
    grads = torch.func.grad(lambda p: f(p, ids).sum())(params)
    assert torch.count_nonzero(grads["embeddings.word_embeddings.weight"][0]) == 0


class _NormedEmbedding(nn.Embedding):
    """A lookup, then a weighted norm (Inkling's ``InklingNormedEmbedding``): padding rows still train the norm."""

    def __init__(self):
        super().__init__(16, 8, padding_idx=0)
        self.norm = nn.LayerNorm(8)

    def forward(self, ids):
        return self.norm(super().forward(ids))


def test_a_norm_after_a_split_embedding_trains_on_padding_tokens_as_unsharded():
    torch.manual_seed(0)
    model = nn.ModuleDict({"emb": _NormedEmbedding(), "head": nn.Linear(8, 1)}).double()
    with torch.no_grad():
        model["emb"].norm.weight.normal_()
    ids = torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(1))
    ids[:, -2:] = 0  # padding tokens

    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, x):
            return self.m["head"](self.m["emb"](x)).square().mean()

    whole = Wrap()
    apply_fn, params, specs = fpar.ops.tensor_parallel(whole, MESH, plan={"m.emb": "vocab"})
    assert specs["m.emb.weight"] == P("tensor", None)
    loss = fpar.shard(lambda p, x: fpar.pmean(apply_fn(p, x), "data"), MESH, (specs, P("data")), P())
    own = {k: v.detach() for k, v in whole.named_parameters()}

    def want(p):
        return sum(torch.func.functional_call(whole, p, (ids[i : i + 2],)) for i in (0, 2)) / 2

    grads = torch.func.grad(loss)(params, ids)
    ref = torch.func.grad(want)(own)
    assert_tree_close(grads, ref, what="grads")
    assert torch.count_nonzero(grads["m.emb.weight"][0]) == 0  # the table's padding row: none
    assert torch.count_nonzero(grads["m.emb.norm.weight"]) > 0


# Communication ----------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_two_all_reduces_per_block_forward(family):
    model = tp_models.FAMILIES[family]()
    mesh = fpar.make_mesh((2,), ("tensor",))
    apply_fn, params, specs = fpar.ops.tensor_parallel(model, mesh)
    logits = fpar.shard(
        lambda p, x: apply_fn(p, x, use_cache=False).logits, mesh, (specs, P()), P(None, None, "tensor")
    )
    ids = tp_models.batch()
    fpar.reset_comm_stats()
    logits(params, ids)
    stats = fpar.comm_stats()["tensor"]
    b, t, d, layers = 4, tp_models.T, 32, 2
    # 2 per block (attention output, MLP output) + 1 for the vocab-parallel embedding, each b*t*d.
    assert stats == {"psum": {"calls": 2 * layers + 1, "bytes": (2 * layers + 1) * b * t * d * 8}}


# Composition ------------------------------------------------------------------------------------


def test_adamw_steps_match_unsharded():
    model = tp_models.gpt2()
    ids = tp_models.batch()
    apply_fn, params, specs = fpar.ops.tensor_parallel(model, MESH)
    loss = tp_models.sharded_loss(apply_fn, MESH, specs, causal=True)
    ref_loss = tp_models.reference_loss(model)
    opt = fo.adamw(1e-2, weight_decay=0.1)
    ref = {k: p.detach() for k, p in model.named_parameters()}
    state, ref_state = opt.init(params), opt.init(ref)
    for _ in range(2):
        updates, state = opt.update(torch.func.grad(loss)(params, ids), state, params)
        params = fo.apply_updates(params, updates)
        ref_updates, ref_state = opt.update(torch.func.grad(ref_loss)(ref, ids), ref_state, ref)
        ref = fo.apply_updates(ref, ref_updates)
    assert_tree_close(apply_fn.export(params), ref, what="params after 2 AdamW steps")


def test_zero2_step_matches_unsharded_adamw():
    model = tp_models.gpt2()
    ids = tp_models.batch()
    apply_fn, params, specs = fpar.ops.tensor_parallel(model, MESH)
    opt = fo.adamw(1e-2, weight_decay=0.1)
    layout = fo.zero_layout(params, MESH, specs, stage=2)
    zparams, state = fo.zero_init(opt, params, layout)
    step = fo.zero_step(lambda p, x: apply_fn(p, x, labels=x, use_cache=False).loss, opt, layout)
    zparams, state, _ = step(zparams, state, ids)
    ref = {k: p.detach() for k, p in model.named_parameters()}
    updates, _ = opt.update(torch.func.grad(tp_models.reference_loss(model))(ref, ids), opt.init(ref), ref)
    assert_tree_close(
        apply_fn.export(fo.zero_params(zparams, layout)), fo.apply_updates(ref, updates), what="ZeRO-2 step"
    )


def test_remat_of_the_whole_forward():
    model = tp_models.llama()
    ids = tp_models.batch()
    apply_fn, params, specs = fpar.ops.tensor_parallel(model, MESH)

    def per_device(p, x):
        loss = fo.remat(lambda p, x: apply_fn(p, x, labels=x, use_cache=False).loss)(p, x)
        return fpar.pmean(loss, "data")

    loss = fpar.shard(per_device, MESH, (specs, P("data")), P())
    want_loss, want_grads = _unsharded_grads(model, ids)
    assert_tree_close(torch.func.grad(loss)(params, ids), want_grads, what="grads through remat")


@pytest.mark.parametrize("family", ["gpt2", "llama_kv1"])
def test_checkpoint_merge_loads_with_from_pretrained(tmp_path, family):
    """The merged file of a run, exported to the model's layout, loads with ``from_pretrained``:
    GPT-2's regrouped ``c_attn``, and Llama's one kv head replicated on both tensor devices (its
    rows twice in fpar's params, once in the file)."""
    model = tp_models.gpt2() if family == "gpt2" else tp_models.llama(num_key_value_heads=1)
    ids = tp_models.batch()
    apply_fn, params, specs = fpar.ops.tensor_parallel(model, MESH)
    assert bool(apply_fn.replicated) == (family == "llama_kv1")
    trained = {k: v + 0.01 * torch.randn_like(v) for k, v in params.items()}  # "after training"
    for name in apply_fn.replicated:  # replicas stay equal in training (their gradients are summed)
        dim, index = apply_fn.source(name)
        trained[name] = apply_fn.export({name: trained[name]})[name].index_select(dim, index)
    fpar.checkpoint.save(tmp_path / "run", trained, MESH, specs, step=1)
    out = tmp_path / "export"
    out.mkdir()
    fpar.checkpoint.merge(tmp_path / "run", out / "model.safetensors", transform=apply_fn.export)
    model.config.save_pretrained(out)
    loaded = type(model).from_pretrained(out, attn_implementation="eager", dtype=torch.float64).eval()
    f = fpar.shard(
        lambda p, x: apply_fn(p, x, use_cache=False).logits,
        MESH,
        (specs, P("data")),
        P("data", None, "tensor"),
    )
    with torch.no_grad():
        assert_tree_close(loaded(ids, use_cache=False).logits, f(trained, ids), what="from_pretrained logits")
    back = fpar.checkpoint.load(out / "model.safetensors", MESH, P())  # the file's own shapes
    assert {k: tuple(v.shape) for k, v in back.items()} == {
        k: tuple(v.shape) for k, v in apply_fn.export(trained).items()
    }


def test_merge_transform_must_keep_names_and_dtypes(tmp_path):
    mesh = fpar.make_mesh((2,), ("tensor",))
    fpar.checkpoint.save(tmp_path / "run", {"w": torch.ones(4, 2)}, mesh, {"w": P("tensor")}, step=1)
    with pytest.raises(ValueError, match="transform must return a tensor of the same dtype for each name"):
        fpar.checkpoint.merge(tmp_path / "run", tmp_path / "m.safetensors", transform=lambda t: {"v": t["w"]})
    with pytest.raises(ValueError, match="transform must return a tensor of the same dtype for each name"):
        fpar.checkpoint.merge(
            tmp_path / "run", tmp_path / "m.safetensors", transform=lambda t: {"w": t["w"].double()}
        )
    fpar.checkpoint.merge(tmp_path / "run", tmp_path / "m.safetensors", transform=lambda t: {"w": t["w"][:2]})
    assert torch.equal(fpar.checkpoint.load(tmp_path / "m.safetensors", mesh, P())["w"], torch.ones(2, 2))


# A plain nn.Module with a user plan --------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, d: int = 16, n_heads: int = 4):
        super().__init__()
        self.n_heads, self.q, self.k, self.v = n_heads, nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (m(x).view(b, t, self.n_heads, -1).transpose(1, 2) for m in (self.q, self.k, self.v))
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        att = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(mask, float("-inf")).softmax(-1)
        return self.out((att @ v).transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, d: int = 16):
        super().__init__()
        self.norm, self.attn = nn.LayerNorm(d), Attention(d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        x = x + self.attn(self.norm(x))
        return x + self.fc2(F.gelu(self.fc1(x)))


PLAN = {"attn.[qkv]": "colwise", "attn.out": "rowwise", "fc1": "colwise", "fc2": "rowwise"}


def test_user_plan_on_a_plain_module():
    torch.manual_seed(0)
    model = Block().double()
    x = torch.randn(4, 6, 16, dtype=torch.float64)
    apply_fn, params, specs = fpar.ops.tensor_parallel(model, MESH, plan=PLAN)
    assert specs["fc2.weight"] == P(None, "tensor") and specs["fc2.bias"] == P()
    assert specs["norm.weight"] == P()
    f = fpar.shard(
        lambda p, x: fpar.pmean(apply_fn(p, x).square().mean(), "data"), MESH, (specs, P("data")), P()
    )
    ref = {k: p.detach() for k, p in model.named_parameters()}

    def want(p):
        return torch.func.functional_call(model, p, (x,)).square().mean()

    def got(p):
        return f(p, x)

    assert_tree_close(got(params), want(ref), what="value")
    assert_tree_close(torch.func.grad(got)(params), torch.func.grad(want)(ref), what="grads")


# Errors (before any communication) ---------------------------------------------------------------


def test_error_pattern_naming_no_module():
    with pytest.raises(
        ValueError, match=r"plan pattern 'mlp\.fc9' matches no module of Block\. Patterns are globs"
    ):
        fpar.ops.tensor_parallel(Block(), MESH, plan={"mlp.fc9": "colwise"})


def test_error_unsplittable_module_type():
    with pytest.raises(
        TypeError, match=r"'norm' \(LayerNorm, plan 'norm'\): cannot split a LayerNorm; 'colwise' applies"
    ):
        fpar.ops.tensor_parallel(Block(), MESH, plan={"norm": "colwise"})


def test_error_bad_kind_and_plan_type():
    with pytest.raises(TypeError, match=r"plan\['fc1'\] is 'column'; it must be one of \('colwise'"):
        fpar.ops.tensor_parallel(Block(), MESH, plan={"fc1": "column"})
    with pytest.raises(TypeError, match="plan must be 'auto' or a dict of module-name patterns"):
        fpar.ops.tensor_parallel(Block(), MESH, plan=["fc1"])
    with pytest.raises(
        ValueError,
        match=r"plan='auto' does not recognise Block \(it knows the transformers models that carry",
    ):
        fpar.ops.tensor_parallel(Block(), MESH)
    with pytest.raises(ValueError, match=r"axis 'model' is not an axis of"):
        fpar.ops.tensor_parallel(Block(), MESH, axis="model", plan=PLAN)


def test_error_sizes_not_divisible():
    mesh3 = fpar.make_mesh((3,), ("tensor",))
    with pytest.raises(
        ValueError, match=r"GPT2LMHeadModel has 4 attention heads, not divisible by the size 3"
    ):
        fpar.ops.tensor_parallel(tp_models.gpt2(), mesh3)
    with pytest.raises(
        ValueError, match=r"'fc1' \(Linear, plan 'fc1'\): its output features \(64\) are not divisible"
    ):
        fpar.ops.tensor_parallel(Block(), mesh3, plan={"fc1": "colwise"})


def test_error_gqa_kv_heads_neither_dividing_nor_divided():
    mesh4 = fpar.make_mesh((4,), ("tensor",))
    with pytest.raises(
        ValueError,
        match=r"MistralForCausalLM has 3 key/value heads, and the size 4 of the tensor axis neither divides 3 "
        r"nor is a multiple of it: .* Tensor sizes that work: \[1, 3, 6, 12\]",
    ):
        fpar.ops.tensor_parallel(tp_models.mistral(num_attention_heads=12, num_key_value_heads=3), mesh4)


class GlobalReshape(Attention):
    def __init__(self):
        super().__init__()
        self.heads = self.n_heads  # an attribute tensor_parallel does not know to divide

    def forward(self, x):
        b, t, _ = x.shape
        return self.out(self.q(x).view(b, t, self.heads, 4).flatten(2))


def test_error_forward_that_reshapes_with_global_heads():
    model = GlobalReshape().double()
    apply_fn, params, specs = fpar.ops.tensor_parallel(model, MESH, plan={"q": "colwise", "out": "rowwise"})
    f = fpar.shard(lambda p, x: apply_fn(p, x), MESH, (specs, P("data")), P("data"))
    with pytest.raises(
        ValueError,
        match=r"the forward of '<root>' \(GlobalReshape\) failed on this device's blocks \(2-way split over 'tensor'\)",
    ):
        f(params, torch.zeros(2, 3, 16, dtype=torch.float64))


def test_error_tied_layers_with_different_kinds():
    model = tp_models.gpt2()
    with pytest.raises(
        ValueError, match=r"'transformer.wte.weight' is tied between 'transformer.wte' and 'lm_head'"
    ):
        fpar.ops.tensor_parallel(
            model, MESH, plan={"transformer.wte": "vocab", "lm_head": "replicate", "*c_fc": "colwise"}
        )


# The real mesh ------------------------------------------------------------------------------------


@pytest.mark.multiprocess
def test_real_mesh_equals_in_process():
    results = fpar.launch(tp_workers.worker, 2, timeout=90.0)
    value, grads, stats = tp_workers.run(fpar.make_mesh((2,), ("tensor",)))
    for rank, ((v, g, s), whole) in enumerate(results):
        assert_tree_close(v, value, what=f"rank {rank} loss")
        assert_tree_close(g, grads, what=f"rank {rank} grads")
        assert s == stats, f"rank {rank} traffic"
        # the global tensors without fpar.device_put: refused on every rank, before the forward
        assert whole == (
            "fpar.ops.tensor_parallel: params['0.weight'] has shape (8, 4), the whole tensor: on a real "
            "mesh fpar.shard passes each process the value it is given, so put the global tensors with "
            "fpar.device_put(params, mesh, specs) first (in one process device_put returns them as they are)."
        ), f"rank {rank}: {whole}"


def test_per_device_function_refuses_a_tensor_that_is_not_its_block():
    # Called on this device's blocks only: the whole tensor, or a block split again, is named.
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    mesh = fpar.make_mesh((2,), ("tensor",))
    apply_fn, params, specs = fpar.ops.tensor_parallel(model, mesh, plan={"0": "colwise", "2": "rowwise"})
    with pytest.raises(ValueError, match=r"params\['0.weight'\] has shape \(8, 4\), the whole tensor: "):
        apply_fn(params, torch.ones(3, 4))
    twice = {**params, "2.weight": params["2.weight"][:, :2]}
    blocks = {k: (v[:4] if k.startswith("0.") else v) for k, v in twice.items()}
    with pytest.raises(
        ValueError,
        match=r"params\['2.weight'\] has shape \(4, 2\), neither this device's "
        r"block \(4, 4\) nor the whole tensor \(4, 8\)",
    ):
        apply_fn(blocks, torch.ones(3, 4))
    x = torch.ones(3, 4)  # fpar.shard gives it the blocks: the module's own output
    torch.testing.assert_close(fpar.shard(apply_fn, mesh, (specs, P()), P())(params, x), model(x))


# The example ------------------------------------------------------------------------------------------


def test_hf_gpt2_example_trains_and_exports_for_from_pretrained(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    import hf_gpt2

    argv = [
        "--steps",
        "4",
        "--batch",
        "4",
        "--seq",
        "16",
        "--d-model",
        "32",
        "--max-bytes",
        "20000",
        "--quiet",
    ]
    result = hf_gpt2.main(argv + ["--export", str(tmp_path / "hf")])
    assert len(result.losses) == 4 and all(torch.isfinite(torch.tensor(result.losses)))
    assert result.losses[-1] < result.losses[0]
    assert abs(result.exported_val_loss - result.val_loss) < 1e-5  # from_pretrained on the merged file


BLOCKS_ONLY = {
    "*.attn.c_attn": "colwise",
    "*.attn.c_proj": "rowwise",
    "*.mlp.c_fc": "colwise",
    "*.mlp.c_proj": "rowwise",
}


def test_user_plan_on_gpt2_regroups_c_attn_too():
    model = tp_models.gpt2()
    ids = tp_models.batch()
    apply_fn, params, specs = fpar.ops.tensor_parallel(model, MESH, plan=BLOCKS_ONLY)
    assert "transformer.h.0.attn.c_attn.weight" in apply_fn.regrouped
    assert specs["transformer.wte.weight"] == P() and specs["transformer.h.0.mlp.c_fc.weight"] == P(
        None, "tensor"
    )

    def per_device(p, x):
        logits = apply_fn(p, x, use_cache=False).logits[:, :-1]
        return fpar.pmean(F.cross_entropy(logits.reshape(-1, tp_models.V), x[:, 1:].reshape(-1)), "data")

    loss = fpar.shard(per_device, MESH, (specs, P("data")), P())
    want_loss, want_grads = _unsharded_grads(model, ids)
    assert_tree_close(loss(params, ids), want_loss, what="loss")
    assert_tree_close(apply_fn.export(torch.func.grad(loss)(params, ids)), want_grads, what="grads")


def test_padding_mask_split_over_data_as_4d_additive_mask():
    ids = tp_models.batch()
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    mask[2, -2:] = 0
    additive = (1.0 - mask[:, None, None, :].double()) * torch.finfo(torch.float64).min
    model = tp_models.bert()
    apply_fn, params, specs = fpar.ops.tensor_parallel(model, MESH)

    def hidden(p, x, m):
        return apply_fn(p, x, attention_mask=m).last_hidden_state

    f = fpar.shard(hidden, MESH, (specs, P("data"), P("data")), P("data"))
    with torch.no_grad():
        want = model(ids, attention_mask=mask).last_hidden_state
    assert_tree_close(f(params, ids, additive), want, what="hidden states with padding")
    with pytest.raises(
        ValueError, match=r"the forward of '<root>' \(BertModel\) tests a tensor's values .* 4-D additive"
    ):
        f(params, ids, mask)  # HF's 2-D mask helper calls padding_mask.all()
