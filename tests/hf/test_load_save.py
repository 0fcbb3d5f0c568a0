"""fpar.hf.from_pretrained / save_pretrained: blocks read shard by shard, directories transformers loads.

References are independent of the loader: ``fpar.ops.tensor_parallel`` of the same model built
whole in memory (what the loaded params must equal, block by block), and ``transformers``' own
``from_pretrained`` of what ``save_pretrained`` wrote (its logits against the model it was
written from).  Tiny random-init configs, float64; the real mesh is 2 gloo processes.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch

import fpar
from fpar import P

transformers = pytest.importorskip(
    "transformers", reason="the hf extra (pip install fpar[hf]) is not installed"
)
pytest.importorskip("safetensors")

V, T = 64, 8


def gpt2():
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=V, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).double().eval()


def llama(kv: int = 2, tied: bool = False):
    config = transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).double().eval()


def phi3():  # fused qkv_proj and gate_up_proj, regrouped per device
    config = transformers.Phi3Config(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.Phi3ForCausalLM(config).double().eval()


def mixtral():  # stored per expert (w1/w2/w3); transformers' conversion stacks them
    config = transformers.MixtralConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(config).double().eval()


MODELS = {
    "gpt2": gpt2,
    "llama": llama,
    "llama-tied": lambda: llama(tied=True),
    "llama-kv1": lambda: llama(kv=1),
    "phi3": phi3,
    "mixtral": mixtral,
}


def saved(tmp_path, name: str, **kwargs) -> str:
    path = str(tmp_path / name)
    MODELS[name]().save_pretrained(path, **kwargs)
    return path


def block_of(t: torch.Tensor, spec: P, coord: int, n: int) -> torch.Tensor:
    """The block at ``coord`` of ``t`` split ``n`` ways over the dim ``spec`` names (one axis)."""
    for d, entry in enumerate(spec):
        if entry is not None:
            size = t.shape[d] // n
            t = t[(slice(None),) * d + (slice(coord * size, (coord + 1) * size),)]
    return t


def logits_of(apply_fn, params, specs, mesh, ids):
    fn = fpar.shard(
        lambda p, x: apply_fn(p, x, use_cache=False).logits, mesh, (specs, P()), P(None, None, "tensor")
    )
    return fn(params, ids)


# In-process ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpt2", "llama-tied", "llama-kv1", "phi3", "mixtral"])
def test_in_process_params_are_tensor_parallels_global_tensors(tmp_path, name):
    path = saved(tmp_path, name)
    mesh = fpar.make_mesh((1, 2), ("data", "tensor"))
    apply_fn, params, specs = fpar.hf.from_pretrained(path, mesh)
    _, want, want_specs = fpar.ops.tensor_parallel(MODELS[name](), mesh)
    assert specs == want_specs and set(params) == set(want)
    for k in want:
        assert params[k].dtype == torch.float64 and torch.equal(params[k], want[k]), k
    # no buffer was left on meta, and each equals the model's own (rotary inv_freq)
    own = dict(MODELS[name]().named_buffers())
    for k, b in apply_fn.module.named_buffers():
        assert not b.is_meta and torch.equal(b, own[k]), k


def test_dtype_casts_each_tensor(tmp_path):
    path = saved(tmp_path, "llama")
    mesh = fpar.make_mesh((2,), ("tensor",))
    _, params, _ = fpar.hf.from_pretrained(path, mesh, dtype=torch.float32)
    own = dict(llama().named_parameters())
    assert all(p.dtype == torch.float32 for p in params.values())
    assert torch.equal(
        params["model.layers.0.mlp.down_proj.weight"], own["model.layers.0.mlp.down_proj.weight"].float()
    )


@pytest.mark.parametrize("name", ["gpt2", "llama-tied", "llama-kv1", "phi3", "mixtral"])
def test_save_then_transformers_from_pretrained_gives_the_same_logits(tmp_path, name):
    mesh = fpar.make_mesh((1, 2), ("data", "tensor"))
    apply_fn, params, specs = fpar.hf.from_pretrained(saved(tmp_path, name), mesh)
    params = {k: v * 1.5 + 0.01 for k, v in params.items()}  # "trained": not the file's values
    out = str(tmp_path / "out")
    fpar.hf.save_pretrained(out, apply_fn, params, mesh, max_shard_size=4096)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and set(index["weight_map"]) == set(params)
    ids = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))
    eager = {"attn_implementation": "eager", "experts_implementation": "eager"}  # float64 kernels
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, **eager).eval()
    assert hf.dtype == torch.float64
    with torch.no_grad():
        torch.testing.assert_close(
            hf(ids).logits, logits_of(apply_fn, params, specs, mesh, ids), rtol=0, atol=1e-12
        )
    # ... and back with fpar: the same params
    _, again, _ = fpar.hf.from_pretrained(out, mesh)
    assert all(torch.equal(again[k], params[k]) for k in params)


def test_a_sharded_index_checkpoint_loads(tmp_path):
    path = saved(tmp_path, "gpt2", max_shard_size="20KB")
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    mesh = fpar.make_mesh((2,), ("tensor",))
    _, params, _ = fpar.hf.from_pretrained(path, mesh)
    _, want, _ = fpar.ops.tensor_parallel(gpt2(), mesh)
    assert all(torch.equal(params[k], want[k]) for k in want)


def test_save_keeps_other_files_and_replaces_an_earlier_save(tmp_path):
    mesh = fpar.make_mesh((2,), ("tensor",))
    apply_fn, params, _ = fpar.hf.from_pretrained(saved(tmp_path, "llama"), mesh)
    out = tmp_path / "out"
    fpar.hf.save_pretrained(out, apply_fn, params, mesh, max_shard_size=2048)
    (out / "tokenizer.json").write_text("{}")
    fpar.hf.save_pretrained(out, apply_fn, params, mesh)  # one file now: the shards and index go
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "tokenizer.json"]


# Bad input -----------------------------------------------------------------------------------------


def test_errors_name_the_file_the_tensor_and_the_fix(tmp_path):
    mesh = fpar.make_mesh((2,), ("tensor",))
    load = fpar.hf.from_pretrained
    with pytest.raises(ValueError, match="does not exist; pass a directory written by save_pretrained"):
        load(tmp_path / "nothing", mesh)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no config.json"):
        load(tmp_path / "empty", mesh)
    path = saved(tmp_path, "gpt2", max_shard_size="20KB")
    shutil.copytree(path, tmp_path / "copy")
    index_file = tmp_path / "copy" / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    first, second = sorted(set(index["weight_map"].values()))[:2]
    os.remove(os.path.join(path, second))
    with pytest.raises(ValueError, match=f"names the shard '{re.escape(second)}' .* which is missing"):
        load(path, mesh)
    moved = next(k for k, f in index["weight_map"].items() if f == first)
    index["weight_map"][moved] = second
    index_file.write_text(json.dumps(index))
    with pytest.raises(
        ValueError, match=f"says '{re.escape(moved)}' is in '{re.escape(second)}', which does not"
    ):
        load(tmp_path / "copy", mesh)
    os.remove(index_file)
    with pytest.raises(ValueError, match="has neither model.safetensors nor model.safetensors.index.json"):
        load(tmp_path / "copy", mesh)

    path = saved(tmp_path, "llama")
    config_file = tmp_path / "llama" / "config.json"
    config = json.loads(config_file.read_text())
    config["intermediate_size"] = 96
    config_file.write_text(json.dumps(config))
    with pytest.raises(
        ValueError, match=r"'model.layers.0.mlp.gate_proj.weight' in 'model.safetensors' has shape"
    ):
        load(path, mesh)
    with pytest.raises(ValueError, match="dtype torch.int64 cannot hold a model's weights"):
        load(path, mesh, dtype=torch.int64)
    with pytest.raises(TypeError, match="dtype must be a torch.dtype"):
        load(path, mesh, dtype="float32")
    with pytest.raises(ValueError, match="axis 'model' is not an axis"):
        load(path, mesh, axis="model")


def test_a_stored_dtype_that_cannot_be_cast_and_a_missing_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    mesh = fpar.make_mesh((2,), ("tensor",))
    path = saved(tmp_path, "llama")
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    tensors["model.norm.weight"] = tensors["model.norm.weight"].long()
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match=r"'model.norm.weight' .* is stored as torch.int64, which cannot be cast"
    ):
        fpar.hf.from_pretrained(path, mesh)
    del tensors["model.norm.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="has no tensor 'model.norm.weight', which LlamaForCausalLM needs"):
        fpar.hf.from_pretrained(path, mesh)


def test_save_refuses_foreign_params_before_writing(tmp_path):
    mesh = fpar.make_mesh((2,), ("tensor",))
    apply_fn, params, _ = fpar.hf.from_pretrained(saved(tmp_path, "llama"), mesh)
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"missing \['lm_head.weight'\]"):
        fpar.hf.save_pretrained(
            out, apply_fn, {k: v for k, v in params.items() if k != "lm_head.weight"}, mesh
        )
    bad = {**params, "model.norm.weight": params["model.norm.weight"][:4]}
    with pytest.raises(ValueError, match=r"params\['model.norm.weight'\] has shape \(4,\), expected \(32,\)"):
        fpar.hf.save_pretrained(out, apply_fn, bad, mesh)
    with pytest.raises(TypeError, match="apply_fn must be the function fpar.hf.from_pretrained"):
        fpar.hf.save_pretrained(out, lambda p: p, params, mesh)
    assert not out.exists()


# Real mesh: 2 gloo processes -----------------------------------------------------------------------


def load_blocks(paths: dict):
    """On each process, per model: its blocks from from_pretrained, then a save of them scaled (a "step")."""
    mesh = fpar.make_mesh((2,), ("tensor",))
    got = {}
    for name, (path, out) in paths.items():
        apply_fn, params, specs = fpar.hf.from_pretrained(path, mesh)
        blocks = {k: v.clone() for k, v in params.items()}
        scaled = {k: v * 1.5 + 0.01 for k, v in params.items()}
        fpar.hf.save_pretrained(out, apply_fn, scaled, mesh, max_shard_size=4096)
        got[name] = (blocks, specs, sorted(os.listdir(out)))
    return torch.distributed.get_rank(), got


@pytest.mark.multiprocess
def test_each_process_reads_its_block_and_the_save_loads_in_transformers(tmp_path):
    names = ("gpt2", "llama-kv1")  # a regrouped fused weight; a kv head replicated over 2 devices
    paths = {name: (saved(tmp_path, name), str(tmp_path / f"{name}-out")) for name in names}
    results = fpar.launch(load_blocks, 2, paths, timeout=120.0)
    mesh = fpar.make_mesh((2,), ("tensor",))
    ids = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))
    for name in names:
        apply_fn, whole, specs = fpar.ops.tensor_parallel(MODELS[name](), mesh)
        for rank, got in results:
            blocks, got_specs, files = got[name]
            assert got_specs == specs and set(blocks) == set(whole)
            for k, t in whole.items():
                want = block_of(t, specs[k], rank, 2)
                assert blocks[k].shape == want.shape and torch.equal(blocks[k], want), (name, rank, k)
                assert blocks[k].is_contiguous()
            assert files == results[0][1][name][2] and "model.safetensors.index.json" in files
        scaled = {k: v * 1.5 + 0.01 for k, v in whole.items()}
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            paths[name][1], attn_implementation="eager"
        ).eval()
        with torch.no_grad():
            want = logits_of(apply_fn, scaled, specs, mesh, ids)
            torch.testing.assert_close(hf(ids).logits, want, rtol=0, atol=1e-12)
