"""From a plan (``"auto"`` or a user's dict) to how every layer and parameter of a model is split.

``resolve`` returns ``{module name: Layer}`` (and ``{parameter name: Layer}`` for bare parameters
such as MoE experts' 3-D weights); ``layouts`` then gives every parameter its ``fpar.P`` and, for
column-parallel parameters, the row layout of its output dim (``_tp_index``).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Any

from torch import nn

from .._spec import PartitionSpec as P
from . import _hf_plan as hf
from ._tp_index import segment_size

_API = "fpar.ops.tensor_parallel"
COLUMN = ("colwise", "colwise_gather", "packed_colwise", "vocab", "split_norm")
SPLIT_OUT = ("colwise", "packed_colwise")  # column-parallel layers whose output stays split
LINEAR_KINDS = (
    "colwise",
    "rowwise",
    "colwise_gather",
    "rowwise_split",
    "rowwise_heads",
    "packed_colwise",
    "vocab",
)
# Module attributes counting query heads, kv heads, or fused widths (set to per-device values).
QUERY_ATTRS = ("num_heads", "n_heads", "n_head", "num_attention_heads", "split_size", "all_head_size")
KV_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads")
_ATTENTION_HINTS = (
    "head_dim",
    "head_size",
    "num_heads",
    "num_key_value_groups",
    "split_size",
    "attention_head_size",
)


class Layer:
    """How one module (or bare parameter) is split."""

    def __init__(self, kind: str, pattern: str = "auto", segments: list | None = None):
        self.kind, self.pattern, self.segments = kind, pattern, segments
        self.repeats = 1  # split_norm: how many times the psum counts each row


def is_conv1d(module: nn.Module) -> bool:
    """HF's ``Conv1D`` (``[in, out]`` weight, global ``nf``), without importing transformers."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def is_attention(module: nn.Module) -> bool:
    return any(hasattr(module, attr) for attr in _ATTENTION_HINTS)


# Matching ---------------------------------------------------------------------------------------


def resolve(
    model: nn.Module,
    modules: dict,
    params: dict,
    plan: Any,
    n: int,
    experts: bool = False,
    extra: dict | None = None,
) -> tuple[dict, dict]:
    """``({module: Layer}, {bare parameter: Layer})`` of the model's plan.

    ``experts``: an expert axis is given; ``extra``: rules the plan's own rules override
    (``sequence_parallel=True``'s norms).
    """
    if isinstance(plan, str) and plan == "auto":
        merged = hf.model_plan(model, experts)
        if merged is not None:
            layers, rules = _match_hf(model, {**(extra or {}), **merged}, modules, params)
        else:
            layers, rules = _fpar_auto(model, modules), {}
            if extra:
                layers.update(_match_user(extra, modules, params)[0])
    else:
        layers, rules = _match_user(
            {**(extra or {}), **plan} if isinstance(plan, Mapping) else plan, modules, params
        )
        _fpar_fused(modules, layers)
    if not experts:
        for name, layer in (*layers.items(), *rules.items()):
            if layer.kind in hf.EXPERT_KINDS:
                raise ValueError(
                    f"{_API}: {name!r} is {layer.pattern!r} in the plan as "
                    f"{'ep_dispatch_experts' if layer.kind == 'ep_experts' else 'grouped_gemm'}: expert "
                    f"parallelism, which needs the mesh axis its experts are split over: pass "
                    f"expert_axis= (e.g. expert_axis='expert')."
                )
    _upgrade(modules, layers)
    _per_head_gates(modules, layers, rules, params)
    _packed_experts(modules, layers, rules)
    _heads_and_vocab(model, modules, layers, n)
    return layers, rules


def _match_hf(model, merged: dict, modules: dict, params: dict) -> tuple[dict, dict]:
    """Transformers' matching: a key equals a name with its layer numbers replaced by ``*``."""
    layers, rules, used = {}, {}, set()
    for key, value in merged.items():
        hf.kind_of(value, f"{type(model).__name__}.tp_plan[{key!r}]")  # every string, used or not
    for name in modules:
        key = hf.generic(name)
        if name and key in merged:
            layers[name] = Layer(hf.kind_of(merged[key], f"plan[{key!r}] (module {name!r})"), key)
            used.add(key)
    for name in params:
        key = hf.generic(name)
        if key in merged:  # a rule naming a parameter (MoE experts' 3-D weights)
            rules[name] = Layer(hf.kind_of(merged[key], f"plan[{key!r}] (parameter {name!r})"), key)
            used.add(key)
    if not used:
        raise ValueError(
            f"{_API}: the tensor-parallel plan of {type(model).__name__} names no module or parameter "
            f"of it ({sorted(merged)[:6]} ...): its config's base_model_tp_plan does not fit this "
            f"model. Pass plan={{pattern: kind}} naming its layers."
        )
    return layers, rules


def _match_user(plan: Any, modules: dict, params: dict) -> tuple[dict, dict]:
    if not isinstance(plan, Mapping):
        raise TypeError(
            f"{_API}: plan must be 'auto' or a dict of module-name patterns to one of {hf.KINDS} (or a "
            f"transformers plan string), e.g. {{'blocks.*.mlp.fc1': 'colwise', 'blocks.*.mlp.fc2': "
            f"'rowwise'}}; got {plan!r}."
        )
    layers: dict[str, Layer] = {}
    rules: dict[str, Layer] = {}
    for pattern, value in plan.items():
        if not isinstance(pattern, str):
            raise TypeError(f"{_API}: plan pattern {pattern!r} must be a string (a module name or glob).")
        kind = hf.kind_of(value, f"plan[{pattern!r}]")
        hits = [name for name in modules if name and fnmatch.fnmatchcase(name, pattern)]
        bare = [
            name
            for name in params
            if fnmatch.fnmatchcase(name, pattern)
            and name.count(".")
            and not isinstance(modules[name.rpartition(".")[0]], (nn.Linear, nn.Embedding))
        ]
        if not hits and not bare:
            names = [name for name in modules if name]
            shown = ", ".join(repr(x) for x in names[:12]) + (" ..." if len(names) > 12 else "")
            raise ValueError(
                f"{_API}: plan pattern {pattern!r} matches no module of {type(modules['']).__name__}. "
                f"Patterns are globs over the dotted names of model.named_modules() ({shown})."
            )
        for name in hits:
            layers.setdefault(name, Layer(kind, pattern))
        for name in bare:
            rules.setdefault(name, Layer(kind, pattern))
    return layers, rules


def _fpar_auto(model: nn.Module, modules: dict) -> dict:
    families = hf.fpar_families()
    if not isinstance(model, tuple(families)):
        raise ValueError(
            f"{_API}: plan='auto' does not recognise {type(model).__name__} (it knows the transformers "
            f"models that carry a tensor-parallel plan, and GPT2LMHeadModel, GPT2Model, BertModel). Pass "
            f"plan={{pattern: 'colwise' | 'rowwise' | 'vocab' | 'replicate'}} naming its layers."
        )
    if getattr(model.config, "add_cross_attention", False):
        raise ValueError(
            f"{_API}: plan='auto' does not split cross-attention ({type(model).__name__} with "
            f"add_cross_attention=True); pass a plan dict."
        )
    layers: dict[str, Layer] = {}
    for name, module in modules.items():
        for child, kind, groups in families.get(hf.family_of(module, families), ()):
            segments = [("split", 0)] * groups if groups > 1 else None
            layers[_join(name, child)] = Layer(kind, segments=segments)
    names = {id(m): name for name, m in modules.items()}
    for m in _vocab_modules(model):
        layers[names[id(m)]] = Layer("vocab")
    return layers


def _fpar_fused(modules: dict, layers: dict) -> None:
    """A user plan's column-parallel fused layers of fpar's families are regrouped, as ``auto`` does.

    GPT-2's ``c_attn``: a contiguous split of ``[q|k|v]`` would be silently wrong.
    """
    families = hf.fpar_families()
    for name, layer in layers.items():
        parent, _, child = name.rpartition(".")
        for fused, _, groups in families.get(hf.family_of(modules[parent], families), ()):
            if fused == child and groups > 1 and layer.kind == "colwise":
                layer.segments = [("split", 0)] * groups


# Family knowledge: heads, vocabulary, fused weights, split norms ----------------------------------


def _vocab_modules(model: nn.Module) -> list[nn.Module]:
    out = []
    if hasattr(model, "get_input_embeddings") and model.get_input_embeddings() is not None:
        out.append(model.get_input_embeddings())
    if hasattr(model, "get_output_embeddings") and model.get_output_embeddings() is not None:
        out.append(model.get_output_embeddings())
    return out


def _heads_and_vocab(model, modules: dict, layers: dict, n: int) -> None:
    """Whole heads per device, and the vocabulary split only where ``n`` divides it.

    Else the embedding and head are replicated; ``colwise_gather_output`` on the output embedding
    keeps the logits split (the vocabulary-parallel loss never gathers them).
    """
    vocab = _vocab_modules(model)
    names = {id(m): name for name, m in modules.items()}
    vocab_names = [names[id(m)] for m in vocab if id(m) in names]
    planned = [name for name in vocab_names if name in layers and layers[name].kind != "replicate"]
    if planned:
        even = all(modules[name].weight.shape[0] % n == 0 for name in vocab_names)
        for name in vocab_names:
            layer = layers.get(name)
            if (
                layer is not None
                and layer.kind in ("vocab", "colwise_gather", "colwise")
                and isinstance(modules[name], (nn.Linear, nn.Embedding))
                and (layer.kind == "vocab" or isinstance(modules[name], nn.Linear))
            ):
                layer.kind = "vocab" if even else "replicate"
    seen = set()
    for name, layer in layers.items():
        parent = name.rpartition(".")[0]
        if layer.kind in SPLIT_OUT and parent not in seen and is_attention(modules.get(parent)):
            seen.add(parent)
            counts = hf.head_counts(modules[parent])
            if counts is not None:
                hf.check_heads(type(model).__name__, counts[0], counts[1], n)


def attention_counts(modules: dict, layers: dict) -> dict[str, tuple[int, int, int]]:
    """``{attention module: (heads, kv heads, head dim)}`` for the parents of split-output layers."""
    out = {}
    for name, layer in layers.items():
        parent = name.rpartition(".")[0]
        if layer.kind in SPLIT_OUT and parent not in out and is_attention(modules.get(parent)):
            counts = hf.head_counts(modules[parent])
            if counts is not None:
                out[parent] = counts
    return out


def _upgrade(modules: dict, layers: dict) -> None:
    """Where the plan gathers for a fused weight or a whole-width norm, do what Megatron does."""
    for name, module in modules.items():
        for fused, (consumer, layout) in hf.fused_layouts(module).items():
            f, c = layers.get(_join(name, fused)), layers.get(_join(name, consumer))
            if f is not None and f.kind in ("colwise", "colwise_gather", "packed_colwise"):
                f.kind, f.segments = "colwise", [layout]
                if c is not None and c.kind == "rowwise_split":
                    c.kind = "rowwise"
        norms = hf.split_norms(module)
        projs = [_join(name, p) for p in ("q_proj", "k_proj", "v_proj")]
        if norms and all(p in layers and layers[p].kind == "colwise_gather" for p in projs):
            for p in projs:
                layers[p].kind = "colwise"
            out = layers.get(_join(name, "o_proj"))
            if out is not None and out.kind == "rowwise_split":
                out.kind = "rowwise"
            for norm, proj in norms.items():
                layers[_join(name, norm)] = Layer("split_norm", layers[_join(name, proj)].pattern)
                layers[_join(name, norm)].segments = [("of", _join(name, proj))]


def _per_head_gates(modules: dict, layers: dict, rules: dict, params: dict) -> None:
    """Doge's dynamic mask: ``dt_proj`` and ``A`` give each device its own kv heads' gates.

    ``dt_proj`` maps every kv head's values to one gate a kv head.  The plan's 'rowwise' all-reduces
    it to every head's gate, which the device's local heads' mask cannot take: fpar keeps the
    device's block of the sum ('rowwise_heads') and splits ``A`` with the heads.
    """
    for name, module in modules.items():
        if name and hf.per_head_gate(module):
            dt, a = _join(name, "dt_proj"), _join(name, "A")
            if dt in layers and layers[dt].kind == "rowwise" and a in params and a not in rules:
                layers[dt].kind = "rowwise_heads"
                rules[a] = Layer("colwise", f"fpar: {type(module).__name__}.A, one a kv head")


def _packed_experts(modules: dict, layers: dict, rules: dict) -> None:
    """A ``moe_tp_experts`` module's fused ``gate_up_proj`` is ``[gate | up]``: split each half.

    Its forward chunks the weight's rows in two (``is_concatenated``), so a contiguous ``colwise``
    split would give one device the gates and the other the ups: Inkling's plan says ``colwise``
    where every other family's says ``packed_colwise``.
    """
    for name, layer in layers.items():
        if layer.kind != "moe_experts" or not getattr(modules[name], "is_concatenated", True):
            continue
        rule = rules.get(_join(name, "gate_up_proj"))
        if rule is not None and rule.kind == "colwise":
            rule.kind = "packed_colwise"


def check_layer(name: str, module: nn.Module, layer: Layer, rules: dict) -> None:
    """The module type fits the kind (before anything is built)."""
    kind, where = layer.kind, f"{_API}: {name!r} ({type(module).__name__}, plan {layer.pattern!r})"
    if kind in ("replicate", "all_reduce", "split_norm", "sequence_parallel"):
        return
    if isinstance(module, nn.Embedding):
        if kind == "rowwise":  # transformers' old name for a vocabulary-split embedding
            layer.kind = kind = "vocab"
        if kind not in ("vocab", "embedding_colwise"):
            raise TypeError(f"{where}: an nn.Embedding can only be split over the vocabulary: use 'vocab'.")
        if module.max_norm is not None or module.sparse or module.scale_grad_by_freq:
            raise TypeError(
                f"{where}: a split embedding cannot use max_norm, sparse or scale_grad_by_freq (they "
                f"need the whole table); mark it 'replicate'."
            )
        return
    if kind == "ep_experts":
        own = [_join(name, p) for p, t in module.named_parameters(recurse=False)]
        ruled = all(p in rules and rules[p].kind == "expert_rows" for p in own)
        if not own or not ruled or not isinstance(getattr(module, "num_experts", None), int):
            raise TypeError(
                f"{where}: 'ep_dispatch_experts' applies to a transformers experts module (its forward "
                f"takes (hidden_states, top_k_index, top_k_weights), its num_experts an int) whose every "
                f"weight is named 'grouped_gemm' in the plan; mark it 'replicate' instead."
            )
        return
    if kind == "moe_experts":
        own = [_join(name, p) for p, _ in module.named_parameters(recurse=False)]
        bad = [
            f"{attr}={getattr(module, attr)}"
            for attr, ok in (("has_bias", False), ("is_concatenated", True))
            if getattr(module, attr, ok) != ok
        ]
        # [experts, out, in] (is_transposed False): gate_up packed_colwise, down rowwise; Aria's
        # [experts, in, out]: gate_up packed_rowwise, down colwise (each the same split in its layout)
        transposed = bool(getattr(module, "is_transposed", False))
        want = (
            {"gate_up_proj": "packed_rowwise", "down_proj": "colwise"}
            if transposed
            else {"gate_up_proj": "packed_colwise", "down_proj": "rowwise"}
        )
        for p in own:
            leaf = p.rpartition(".")[2]
            if p in rules and leaf in want and rules[p].kind != want[leaf]:
                bad.append(
                    f"is_transposed={transposed} with {leaf} {rules[p].kind!r} (its layout needs {want[leaf]!r})"
                )
        if not own or not all(p in rules for p in own) or bad:
            raise TypeError(
                f"{where}: 'moe_tp_experts' applies to an experts module of 3-D weights [gate | up] and "
                f"down, each named by its own rule (packed_colwise / rowwise for [experts, out, in], "
                f"packed_rowwise / colwise for [experts, in, out])"
                + (f"; this one has {', '.join(bad)}" if bad else "")
                + ". Mark it 'replicate' instead."
            )
        return
    if kind == "packed_rowwise":
        raise TypeError(
            f"{where}: 'packed_rowwise' applies to a 3-D expert weight stored [experts, in, out] (its "
            f"fused [gate | up] output split on dim 2), named by its parameter; for a module's fused "
            f"input use 'rowwise' on a Linear whose input is not fused, or mark it 'replicate'."
        )
    if kind in LINEAR_KINDS and (isinstance(module, nn.Linear) or is_conv1d(module)):
        return
    raise TypeError(
        f"{where}: cannot split a {type(module).__name__}; {kind!r} applies to nn.Linear, nn.Embedding "
        f"('vocab') and HF Conv1D. Name its Linear layers in the plan instead, or mark it 'replicate'."
    )


# Specs and row layouts -------------------------------------------------------------------------


def segments_of(name: str, module: nn.Module, layer: Layer, size: int, attn: dict) -> list[tuple]:
    """The output-dim layout of a column-parallel parameter of ``size`` rows."""
    parent = name.rpartition(".")[0]
    counts = attn.get(parent)
    if layer.segments and layer.segments[0] == "qkv":
        heads, kv, hd = counts
        return [("split", heads * hd), ("kv", kv, hd), ("kv", kv, hd)]
    if layer.segments and layer.segments[0] == "pair":
        return [("split", size // 2)] * 2
    if layer.segments and layer.segments[0][0] == "split":
        return [("split", size // len(layer.segments))] * len(layer.segments)
    if layer.kind == "packed_colwise":
        return [("split", size // 2)] * 2
    if counts is not None and layer.kind == "colwise":
        heads, kv, hd = counts
        if kv != heads and size == kv * hd:
            return [("kv", kv, hd)]
    return [("split", size)]


def layouts(
    model, modules: dict, layers: dict, rules: dict, axis: str, n: int, expert: tuple | None = None
) -> dict[str, tuple]:
    """``{parameter name: (spec, out dim or None, segments or None)}``; tied parameters agree.

    ``expert``: ``(axis, size)`` of the expert axis ('grouped_gemm' weights split on dim 0 over it).
    """
    attn = attention_counts(modules, layers)
    owner = {id(p): name for name, p in model.named_parameters()}
    out: dict[str, tuple] = {}
    given: dict[str, str] = {}
    for name, module in modules.items():
        layer = layers.get(name)
        for pname, p in module.named_parameters(recurse=False):
            full = _join(name, pname)
            rule = rules.get(full)
            if rule is not None and rule.kind == "expert_rows":
                found = _expert_layout(full, p, rule, *expert)  # resolve refuses the kind without an axis
            elif rule is not None:
                found = _bare_layout(full, p, rule, axis, n)
            elif layer is not None:
                found = _module_layout(name, module, pname, p, layer, axis, n, attn, layers)
            else:
                found = (P(), None, None)
            key = owner[id(p)]
            if key in out and out[key][0] != found[0]:
                raise ValueError(
                    f"{_API}: {key!r} is tied between {given[key]!r} and {name!r}, whose plans give it "
                    f"different layouts ({out[key][0]} and {found[0]}). Give tied layers the same kind "
                    f"(e.g. 'vocab' for a tied embedding and lm_head)."
                )
            out.setdefault(key, found)
            given.setdefault(key, name)
    return out


def _module_layout(name, module, pname, p, layer, axis, n, attn, layers) -> tuple:
    kind, conv, where = (
        layer.kind,
        is_conv1d(module),
        f"{_API}: {name!r} ({type(module).__name__}, plan {layer.pattern!r})",
    )
    if kind in ("replicate", "all_reduce", "moe_experts", "ep_experts", "sequence_parallel"):
        return P(), None, None
    if isinstance(module, nn.Embedding):
        dim = 0 if kind == "vocab" else 1
        _divides(where, "vocabulary size" if dim == 0 else "embedding dim", p.shape[dim], n)
        return (P(axis, None) if dim == 0 else P(None, axis)), None, None
    if kind == "split_norm":
        source = layers[layer.segments[0][1]]
        proj_name = layer.segments[0][1]
        segs = segments_of(proj_name, None, source, p.shape[0], attn)
        return P(axis), 0, segs
    if kind == "rowwise_heads" and pname == "bias":  # its output is this device's heads' block
        _divides(where, "output features (one a head)", p.shape[0], n)
        return P(axis), None, None
    if kind in ("rowwise", "rowwise_split", "rowwise_heads"):
        if pname == "bias":
            return P(), None, None
        _divides(where, "input features", p.shape[0 if conv else 1], n)
        return (P(axis, None) if conv else P(None, axis)), None, None
    dim = 1 if conv and pname == "weight" else 0
    segs = segments_of(name, module, layer, p.shape[dim], attn)
    for seg in segs:
        if seg[0] == "split":
            _divides(where, "output features", seg[1], n)
    spec = [None] * p.dim()
    spec[dim] = axis
    return P(*spec), dim, segs


def _bare_layout(name: str, p, rule: Layer, axis: str, n: int) -> tuple:
    where = f"{_API}: parameter {name!r} ({tuple(p.shape)}, plan {rule.pattern!r})"
    if rule.kind == "replicate":
        return P(), None, None
    if rule.kind == "colwise" and p.dim() in (1, 2):  # one row a query head (attention sinks): dim 0
        _divides(where, "rows", p.shape[0], n)
        return P(axis, *([None] * (p.dim() - 1))), 0, [("split", p.shape[0])]
    if p.dim() != 3 or rule.kind not in ("colwise", "packed_colwise", "rowwise", "packed_rowwise"):
        raise TypeError(
            f"{where}: a rule naming a parameter applies to 3-D expert weights with 'colwise' (dim 1), "
            f"'rowwise' (dim 2), 'packed_colwise' (dim 1 a fused [gate | up]: [experts, out, in]) or "
            f"'packed_rowwise' (dim 2 a fused [gate | up]: [experts, in, out]), or to a 1-D or 2-D "
            f"parameter of one row a head (attention sinks) with 'colwise'; got {rule.kind!r} on a "
            f"{p.dim()}-D tensor. Name its module instead."
        )
    dim = 1 if rule.kind in ("colwise", "packed_colwise") else 2
    packed = rule.kind.startswith("packed")
    segs = [("split", p.shape[dim] // 2)] * 2 if packed else [("split", p.shape[dim])]
    for seg in segs:
        _divides(where, "split dim", segment_size(seg), n)
    spec = [None, None, None]
    spec[dim] = axis
    # rows of a split (and packed) dim are regrouped so each device's block is [gate_r | up_r]
    regrouped = rule.kind != "rowwise"
    return P(*spec), (dim if regrouped else None), (segs if regrouped else None)


def _expert_layout(name: str, p, rule: Layer, axis: str, n: int) -> tuple:
    """A 'grouped_gemm' weight: its experts (dim 0) split over the expert axis."""
    where = f"{_API}: parameter {name!r} ({tuple(p.shape)}, plan {rule.pattern!r})"
    if p.dim() < 1 or p.shape[0] % n:
        raise ValueError(
            f"{where}: its {p.shape[0] if p.dim() else 0} experts are not divisible by the expert axis "
            f"size {n}; choose an expert axis size dividing the number of experts."
        )
    return P(axis, *([None] * (p.dim() - 1))), None, None


def _divides(where: str, what: str, size: int, n: int) -> None:
    if size % n:
        raise ValueError(
            f"{where}: its {what} ({size}) are not divisible by the tensor axis size {n}; choose a tensor "
            f"axis size dividing it."
        )


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
