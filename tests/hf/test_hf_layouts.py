"""Every layout for a Hugging Face model: data x tensor with ZeRO 1/2/3, remat, mixed precision.

One optimizer step of the sharded model (``plan="auto"``, kv heads replicated where fewer than the
tensor devices) equals the same step of the unsharded model, float64; bf16 compares with the
unsharded model run under the same bf16 policy.
"""

from __future__ import annotations

import pytest
import torch

import fpar
import fpar.optim as fo
from fpar import P

pytest.importorskip("transformers", reason="the hf extra (pip install fpar[hf]) is not installed")

import hf_models  # noqa: E402  (needs transformers)

MESH = fpar.make_mesh((2, 2), ("data", "tensor"))
# HF's RMSNorms compute in float32: with the batch split over 'data' (and partial sums over
# 'tensor') a float32 rounding moves now and then, so float64 runs agree to float32 precision.
# AdamW's first step divides by |grad|, so a near-zero gradient's move can differ by that much.
TOL = dict(rtol=1e-5, atol=1e-6)


def _hf_loss(apply_fn):
    return lambda p, x: apply_fn(p, x, labels=x, use_cache=False).loss


def _reference_step(model, ids, opt, dtype=None):
    """One step of ``opt`` on the whole model; with ``dtype`` the loss runs in it (fp32 master)."""
    ref = {k: p.detach() for k, p in model.named_parameters()}
    loss = hf_models.reference_loss(model)

    def policy(p, x):
        if dtype is None:
            return loss(p, x)
        return loss({k: v.to(dtype) for k, v in p.items()}, x).float()

    updates, _ = opt.update(torch.func.grad(policy)(ref, ids), opt.init(ref), ref)
    return fo.apply_updates(ref, updates)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_step_equals_unsharded_adamw(stage):
    model = hf_models.qwen3(num_key_value_heads=1)  # kv replicated on both tensor devices
    ids = hf_models.batch()
    apply_fn, params, specs = fpar.ops.tensor_parallel(model, MESH)
    assert apply_fn.replicated
    opt = fo.adamw(1e-2, weight_decay=0.1)
    layout = fo.zero_layout(params, MESH, specs, stage=stage)
    zparams, state = fo.zero_init(opt, params, layout)
    step = fo.zero_step(_hf_loss(apply_fn), opt, layout)
    zparams, state, _ = step(zparams, state, ids)
    got = fo.zero_params(zparams, layout)
    for name in apply_fn.replicated:  # the replicas were updated alike
        dim, index = apply_fn.source(name)
        first = apply_fn.export({name: got[name]})[name].index_select(dim, index)
        assert torch.equal(got[name], first), name
    hf_models.compare(apply_fn.export(got), _reference_step(model, ids, opt), f"ZeRO-{stage} step", **TOL)


@pytest.mark.parametrize("family", ["qwen3", "mixtral"])
def test_remat_equals_unsharded(family):
    model = hf_models.FAMILIES[family](num_key_value_heads=1)
    ids = hf_models.batch()
    apply_fn, params, specs = fpar.ops.tensor_parallel(model, MESH)

    def per_device(p, x):
        return fpar.pmean(fo.remat(_hf_loss(apply_fn))(p, x), "data")

    loss = fpar.shard(per_device, MESH, (specs, P("data")), P())
    want_loss, want_grads = hf_models.unsharded(model, ids)
    torch.testing.assert_close(loss(params, ids), want_loss, **TOL)
    grads = apply_fn.export(torch.func.grad(loss)(params, ids))
    hf_models.compare(grads, want_grads, f"{family} grads through remat", **TOL)


def test_bf16_mixed_precision_zero_step_equals_unsharded_bf16_policy():
    model = hf_models.llama(num_key_value_heads=1).float()  # fp32 master weights
    ids = hf_models.batch()
    apply_fn, params, specs = fpar.ops.tensor_parallel(model, MESH)
    opt = fo.mixed_precision(fo.adamw(1e-2), compute_dtype=torch.bfloat16)
    layout = fo.zero_layout(params, MESH, specs, stage=1)
    zparams, state = fo.zero_init(opt, params, layout)
    zparams, state, _ = fo.zero_step(_hf_loss(apply_fn), opt, layout)(zparams, state, ids)
    got = apply_fn.export(fo.zero_params(zparams, layout))
    want = _reference_step(model, ids, fo.adamw(1e-2), dtype=torch.bfloat16)
    start = {k: p.detach() for k, p in model.named_parameters()}
    # bf16 compute: the two sides round differently (split sums, all-reduce order), so gradients
    # agree to bf16 precision; AdamW's first step moves each weight by ~lr * sign(grad), so compare
    # the moves: equal to 1e-3 (a tenth of the 1e-2 step) except where a gradient is near zero.
    close = sum(((got[k] - start[k]) - (want[k] - start[k])).abs().le(1e-3).sum().item() for k in start)
    total = sum(p.numel() for p in start.values())
    assert close / total > 0.98, f"{close}/{total} of the bf16 step's moves agree to 1e-3"


def _remat_each(layers, calls: list) -> None:
    """Wrap each decoder layer of the private local copy in ``fpar.optim.remat`` (its parameters as
    explicit inputs, so the recomputation in the backward uses this device's blocks)."""
    for layer in layers:
        base = type(layer)

        class Remat(base):
            def __call__(self, *args, **kwargs):
                if self.__dict__.get("_inside"):
                    calls.append(1)
                    return super().__call__(*args, **kwargs)
                names = [n for n, _ in self.named_parameters()]

                def run(ps, *a, **k):
                    self.__dict__["_inside"] = True
                    try:
                        return torch.func.functional_call(self, dict(zip(names, ps)), a, k)
                    finally:
                        self.__dict__["_inside"] = False

                return fo.remat(run)([p for _, p in self.named_parameters()], *args, **kwargs)

        layer.__class__ = Remat


def test_remat_per_decoder_layer_equals_unsharded():
    model = hf_models.qwen3(num_hidden_layers=2, num_key_value_heads=1)
    ids = hf_models.batch()
    apply_fn, params, specs = fpar.ops.tensor_parallel(model, MESH)
    calls: list = []
    _remat_each(apply_fn.module.model.layers, calls)
    loss = hf_models.sharded_loss(apply_fn, MESH, specs, causal=True)
    want_loss, want_grads = hf_models.unsharded(model, ids)
    grads = apply_fn.export(torch.func.grad(loss)(params, ids))
    assert len(calls) == 4  # 2 layers, each run forward and again in the backward
    hf_models.compare(grads, want_grads, "grads with remat per decoder layer", **TOL)
