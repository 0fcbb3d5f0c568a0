"""fpar.functionalize and fpar.spec_rules: a torch.nn module as a pure function, sharded by name rules.

The main check: a 2-layer transformer written with torch.nn, functionalized, given Megatron specs
by regex rules and run with fpar.shard on a (data=2, tensor=2) in-process mesh, has the module's
loss and the module's gradients (float64). Its forward calls fpar.psum only when told its tensor
axis, so the same module is the unsharded reference. A Hugging Face GPT2Model (when transformers
is installed) is checked the FSDP way: parameters stored with OSLO/Megatron specs, gathered
inside the sharded function.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fpar
from fpar import P

F64 = torch.float64
V, D, H, T, B = 32, 16, 4, 8, 4  # vocab, width, heads, sequence, batch


# A small transformer whose forward is tensor-parallel when given its mesh axis ----------------------


class _TP(nn.Module):
    axis: str | None = None

    def reduce(self, x):
        return fpar.psum(x, self.axis) if self.axis else x


class Attention(_TP):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.register_buffer("mask", torch.ones(T, T, dtype=torch.bool).triu(1), persistent=False)

    def forward(self, x_BTD):
        hd = D // H
        heads = self.q.weight.shape[0] // hd  # the local heads: all of them unsharded

        def split(t):
            return t.view(*t.shape[:2], heads, hd).transpose(1, 2)

        q, k, v = split(self.q(x_BTD)), split(self.k(x_BTD)), split(self.v(x_BTD))
        att = (q @ k.transpose(-1, -2) / math.sqrt(hd)).masked_fill(self.mask, float("-inf"))
        y = (att.softmax(-1) @ v).transpose(1, 2).flatten(2)
        return self.reduce(F.linear(y, self.o.weight)) + self.o.bias  # row-parallel: bias after the sum


class MLP(_TP):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        return self.reduce(F.linear(F.gelu(self.fc1(x)), self.fc2.weight)) + self.fc2.bias


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = nn.LayerNorm(D), Attention(), nn.LayerNorm(D), MLP()

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.pos = nn.Parameter(torch.randn(T, D) * 0.1)
        self.register_buffer("positions", torch.arange(T))  # an integer buffer: never differentiated
        self.blocks = nn.ModuleList([Block(), Block()])
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, ids_BT):
        x = self.emb(ids_BT) + self.pos[self.positions]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))

    def set_axis(self, axis):
        for m in self.modules():
            if isinstance(m, _TP):
                m.axis = axis
        return self


MEGATRON = {
    r"blocks\.\d+\.attn\.[qkv]\.weight": P("tensor", None),  # column-parallel (torch Linear is [out, in])
    r"blocks\.\d+\.attn\.[qkv]\.bias": P("tensor"),
    r"blocks\.\d+\.attn\.o\.weight": P(None, "tensor"),  # row-parallel
    r"blocks\.\d+\.mlp\.fc1\.weight": P("tensor", None),
    r"blocks\.\d+\.mlp\.fc1\.bias": P("tensor"),
    r"blocks\.\d+\.mlp\.fc2\.weight": P(None, "tensor"),
}


def make_model():
    torch.manual_seed(0)
    return TinyGPT().to(F64).eval()


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)


def xent(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def module_loss_and_grads(model):
    ids, tgt = batch()
    model.zero_grad()
    loss = xent(model.set_axis(None)(ids), tgt)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


# functionalize --------------------------------------------------------------------------------------


def test_functionalize_gives_module_output_and_grads():
    model = make_model()
    ref_loss, ref_grads = module_loss_and_grads(model)
    apply_fn, params = fpar.functionalize(model)
    assert set(params) == {n for n, _ in model.named_parameters()}
    assert "head.weight" not in params and "positions" not in params  # tied once; buffers apart
    ids, tgt = batch()
    loss, grads = torch.func.grad_and_value(lambda p: xent(apply_fn(p, ids), tgt))(params)[::-1]
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-12)
    for n in params:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-10, atol=1e-12, msg=n)


def test_apply_fn_is_pure_in_params():
    model = make_model()
    apply_fn, params = fpar.functionalize(model)
    ids, _ = batch()
    doubled = {n: 2 * p for n, p in params.items()}
    out2 = apply_fn(doubled, ids)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2)
        expect = model(ids)
    torch.testing.assert_close(out2, expect)
    torch.testing.assert_close(apply_fn(params, ids), expect)  # params share the module's memory


def test_functionalize_rejects_wrong_param_names():
    apply_fn, params = fpar.functionalize(make_model())
    ids, _ = batch()
    bad = dict(params)
    bad["extra.weight"] = bad.pop("ln_f.weight")
    with pytest.raises(ValueError, match=r"missing \['ln_f.weight'\], unexpected \['extra.weight'\]"):
        apply_fn(bad, ids)
    with pytest.raises(TypeError, match="dict of dotted names"):
        apply_fn(list(params.values()), ids)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        fpar.functionalize(lambda x: x)


def test_buffers_separate_thread_batchnorm_statistics():
    torch.manual_seed(0)
    bn = nn.Sequential(nn.Linear(3, 5), nn.BatchNorm1d(5)).train()
    apply_fn, params, buffers = fpar.functionalize(bn, buffers=True)
    assert set(buffers) == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    before = {n: b.clone() for n, b in buffers.items()}
    x = torch.randn(8, 3)
    out, new = apply_fn(params, buffers, x)
    for n, b in buffers.items():  # the caller's buffers are not modified
        torch.testing.assert_close(b, before[n], rtol=0, atol=0)
    expect = bn(x)  # the module updates its own statistics
    torch.testing.assert_close(out, expect)
    for n, b in bn.named_buffers():
        torch.testing.assert_close(new[n], b, rtol=0, atol=0, msg=n)


def test_stateless_apply_refuses_a_forward_that_updates_buffers():
    bn = nn.BatchNorm1d(5).train()
    apply_fn, params = fpar.functionalize(bn)
    with pytest.raises(RuntimeError, match=r"updated its buffers \[.*'num_batches_tracked'.*buffers=True"):
        apply_fn(params, torch.randn(8, 5))
    torch.testing.assert_close(bn.running_mean, torch.zeros(5), rtol=0, atol=0)  # the constants are intact
    assert int(bn.num_batches_tracked) == 0
    apply_fn, params = fpar.functionalize(bn.eval())  # eval: running statistics are constants
    apply_fn(params, torch.randn(8, 5))


# spec_rules --------------------------------------------------------------------------------------------


def test_spec_rules_megatron_regex_first_match_wins():
    _, params = fpar.functionalize(make_model())
    rules = {r".*\.fc1\.weight": P(("tensor",), None), **MEGATRON}  # shadows the later fc1 rule
    specs = fpar.spec_rules(params, rules, default=P())
    assert specs["blocks.0.mlp.fc1.weight"] == P(("tensor",), None)
    assert specs["blocks.1.attn.k.weight"] == P("tensor", None)
    assert specs["blocks.1.attn.o.weight"] == P(None, "tensor")
    assert specs["blocks.0.attn.o.bias"] == P() and specs["emb.weight"] == P()
    assert set(specs) == set(params)


def test_spec_rules_glob_and_pairs_and_nested_trees():
    tree = {"params": {"w1": torch.zeros(4, 8), "w2": torch.zeros(8, 4)}, "step": torch.zeros(())}
    specs = fpar.spec_rules(
        tree, [("params.w1", P(None, "tensor")), ("params.*", P("tensor")), ("*", P())], syntax="glob"
    )
    assert specs == {"params": {"w1": P(None, "tensor"), "w2": P("tensor")}, "step": P()}


def test_spec_rules_lists_every_unmatched_name():
    _, params = fpar.functionalize(make_model())
    with pytest.raises(ValueError, match="no rule matches") as e:
        fpar.spec_rules(params, MEGATRON)
    msg = str(e.value)
    for name in ("'emb.weight'", "'pos'", "'ln_f.bias'", "'blocks.0.ln1.weight'", "'blocks.1.mlp.fc2.bias'"):
        assert name in msg
    assert "'blocks.0.attn.q.weight'" not in msg and "default=P()" in msg


def test_spec_rules_errors():
    params = {"h.0.w": torch.zeros(4), "h.0.b": torch.zeros(4, 6)}
    with pytest.raises(
        ValueError, match=r"rule '.\*w' gives 'h.0.w' \(shape \(4,\)\) the spec P\(None, 'tensor'\)"
    ):
        fpar.spec_rules(params, {".*w": P(None, "tensor")}, default=P())
    with pytest.raises(TypeError, match="must be a fpar.P"):
        fpar.spec_rules(params, {".*": ("tensor",)})
    with pytest.raises(TypeError, match="default must be a fpar.P"):
        fpar.spec_rules(params, {}, default=None)
    with pytest.raises(ValueError, match="not a valid regex"):
        fpar.spec_rules(params, {"*.w": P()})
    with pytest.raises(ValueError, match="unknown syntax"):
        fpar.spec_rules(params, {}, syntax="re")
    mesh = fpar.make_mesh((4,), ("tensor",))
    with pytest.raises(
        fpar.SpecError, match=re.escape("'h.0.b' (rule 'default'): dim 1 of size 6 is not evenly divisible")
    ):
        fpar.spec_rules(params, {r"h\.0\.w": P("tensor")}, default=P(None, "tensor"), mesh=mesh)
    with pytest.raises(fpar.SpecError, match="not an axis of the mesh"):
        fpar.spec_rules(params, {".*": P("data")}, mesh=mesh)


# Sharded == module --------------------------------------------------------------------------------


def test_megatron_sharded_module_equals_module():
    """Tensor-parallel by name rules on (data=2, tensor=2): the module's loss and gradients."""
    model = make_model()
    ref_loss, ref_grads = module_loss_and_grads(model)
    apply_fn, params = fpar.functionalize(model.set_axis("tensor"))
    mesh = fpar.make_mesh((2, 2), ("data", "tensor"))
    specs = fpar.spec_rules(params, MEGATRON, default=P(), mesh=mesh)

    def loss(p, ids, tgt):
        return fpar.pmean(xent(apply_fn(p, ids), tgt), "data")

    sharded = fpar.shard(loss, mesh, in_specs=(specs, P("data"), P("data")), out_specs=P())
    ids, tgt = batch()
    grads, value = torch.func.grad_and_value(sharded)(params, ids, tgt)
    torch.testing.assert_close(value, ref_loss, rtol=0, atol=1e-12)
    for n in params:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-9, atol=1e-12, msg=n)


def _gather_full(params, specs):
    """Inside fpar.shard: every parameter's full value from its stored block (ZeRO-3 / FSDP).

    all_gather_invariant: the gathered parameter is the same on every device (typed replicated).
    """

    def full(t, spec):
        for d, entry in enumerate(spec):
            if entry is not None:
                t = fpar.all_gather_invariant(t, entry, axis=d, tiled=True)
        return t

    return {n: full(t, specs[n]) for n, t in params.items()}


GPT2_MEGATRON = {  # OSLO-style rules; HF Conv1D weights are [in, out]
    r"h\.\d+\.attn\.c_attn\.weight": P(None, "tensor"),
    r"h\.\d+\.attn\.c_attn\.bias": P("tensor"),
    r"h\.\d+\.attn\.c_proj\.weight": P("tensor", None),
    r"h\.\d+\.mlp\.c_fc\.weight": P(None, "tensor"),
    r"h\.\d+\.mlp\.c_fc\.bias": P("tensor"),
    r"h\.\d+\.mlp\.c_proj\.weight": P("tensor", None),
    r"h\.\d+\.(attn|mlp)\.c_proj\.bias": P(),
    r"wte\.weight": P("tensor", None),  # vocab-parallel embedding
    r"wpe\.weight|.*ln_(1|2|f)\.(weight|bias)": P(),
}


def test_gpt2_megatron_rules_fsdp_sharded_equals_module():
    tf = pytest.importorskip("transformers", reason="transformers is not installed (optional check)")
    cfg = tf.GPT2Config(
        vocab_size=V,
        n_positions=T,
        n_embd=D,
        n_layer=2,
        n_head=H,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = tf.GPT2Model(cfg).to(F64).eval()
    ids, _ = batch()
    model.zero_grad()
    ref = model(ids).last_hidden_state
    ref.square().mean().backward()
    apply_fn, params = fpar.functionalize(model)
    specs = fpar.spec_rules(params, GPT2_MEGATRON)  # no default: every name is covered
    assert specs["h.1.attn.c_attn.weight"] == P(None, "tensor") and specs["wte.weight"] == P("tensor", None)
    mesh = fpar.make_mesh((2, 2), ("data", "tensor"))

    def hidden(p, ids):
        return apply_fn(_gather_full(p, specs), ids).last_hidden_state

    sharded = fpar.shard(hidden, mesh, in_specs=(specs, P("data")), out_specs=P("data"))
    torch.testing.assert_close(sharded(params, ids), ref.detach(), rtol=1e-10, atol=1e-12)
    grads = torch.func.grad(lambda p: sharded(p, ids).square().mean())(params)
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-9, atol=1e-12, msg=n)


def test_spec_rules_rule_matching_nothing_lists_the_names():
    _, params = fpar.functionalize(nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 2)))
    with pytest.raises(
        ValueError,
        match=r"rule\(s\) \['fc1\\\\.weight'\] match no parameter .* the names are: '0.bias', '0.weight', '1.bias', '1.weight'\.",
    ):
        fpar.spec_rules(params, {r"0\.weight": P(), r"fc1\.weight": P()}, default=P())
    # A rule shadowed by an earlier one still matches names: not an error (first match wins).
    fpar.spec_rules(params, {r".*": P(), r"0\.weight": P()})


def test_functionalize_docstring_example_runs_with_its_names():
    doc = fpar.functionalize.__doc__
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
    apply_fn, params = fpar.functionalize(model.eval())
    assert str(list(params)) in doc
    specs = fpar.spec_rules(params, {r"\d+\.(weight|bias)": P()})
    assert r'{r"\d+\.(weight|bias)": P()}' in doc
    mesh = fpar.make_mesh((4,), ("data",))
    x = torch.randn(16, 8)
    y = fpar.shard(apply_fn, mesh, (specs, P("data")), P("data"))(params, x)
    torch.testing.assert_close(y, model(x))
