"""plan="auto" on every Hugging Face family with a parallel plan (and fpar's own GPT-2 / BERT tables).

Independent reference everywhere: the same HF model run whole (``functional_call`` on the
module's own parameters), float64, tiny random-init configs (no downloads).
"""

from __future__ import annotations

import pytest
import torch

import fpar

pytest.importorskip("transformers", reason="the hf extra (pip install fpar[hf]) is not installed")

import hf_models  # noqa: E402  (needs transformers)

MESH = fpar.make_mesh((2, 2), ("data", "tensor"))


# The loader's contract: source() and export() --------------------------------------------------


def _check_source_export(model, mesh):
    """``params[k] == own[k].index_select(*source(k))``; ``export`` inverts it on any subset."""
    apply_fn, params, _ = fpar.ops.tensor_parallel(model, mesh)
    own = {k: p.detach() for k, p in model.named_parameters()}
    assert set(params) == set(own)
    for name, value in params.items():
        found = apply_fn.source(name)
        if found is None:
            assert value is own[name] or torch.equal(value, own[name]), name
        else:
            dim, index = found
            assert index.dtype == torch.long and index.dim() == 1, name
            assert torch.equal(value, own[name].index_select(dim, index)), name
        single = apply_fn.export({name: value})  # a dict holding one tensor
        assert list(single) == [name] and torch.equal(single[name], own[name]), name
    exported = apply_fn.export(params)
    assert all(torch.equal(exported[k], own[k]) for k in own)
    return apply_fn, params


def test_source_export_round_trip_gpt2():
    apply_fn, params = _check_source_export(hf_models.gpt2(), MESH)
    dim, index = apply_fn.source("transformer.h.0.attn.c_attn.weight")
    assert dim == 1  # Conv1D: [in, out]; device 0's block is its q, k and v heads
    assert index[:48].tolist() == [*range(0, 16), *range(32, 48), *range(64, 80)]
    assert apply_fn.source("transformer.h.0.attn.c_proj.weight") is None
    with pytest.raises(KeyError, match=r"source\('nope'\): no such parameter"):
        apply_fn.source("nope")


def test_meta_model_gives_meta_params_of_the_global_shapes():
    model = hf_models.gpt2(meta=True)
    apply_fn, params, specs = fpar.ops.tensor_parallel(model, MESH)
    assert all(p.is_meta for p in params.values())
    assert {k: p.shape for k, p in params.items()} == {k: p.shape for k, p in model.named_parameters()}
    dim, index = apply_fn.source("transformer.h.1.attn.c_attn.bias")
    assert dim == 0 and sorted(index.tolist()) == list(range(96))
    exported = apply_fn.export(
        {"transformer.h.1.attn.c_attn.bias": params["transformer.h.1.attn.c_attn.bias"]}
    )
    assert exported["transformer.h.1.attn.c_attn.bias"].is_meta
