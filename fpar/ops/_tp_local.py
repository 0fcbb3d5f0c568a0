"""The local copy of a model that ``fpar.ops.tensor_parallel`` runs: each layer made tensor parallel.

``_local_copy`` deep-copies the model (sharing its parameters and buffers), sets each attention's
per-device head counts and replaces each planned layer's forward with its tensor-parallel form
(``fpar.ops._tp_layers``); a plan that names ``sequence_parallel`` modules gets Megatron-SP for the
whole model (``_sequence_parallel``).
"""

from __future__ import annotations

import copy
import functools
from typing import Any

from torch import nn

from . import _tp_layers as tl
from ._hf_plan import EXPERT_KINDS
from ._tp_resolve import KV_ATTRS, QUERY_ATTRS, Layer, attention_counts, is_conv1d

_API = "fpar.ops.tensor_parallel"


# The local copy ---------------------------------------------------------------------------------


def _local_copy(
    model: nn.Module,
    modules: dict,
    layers: dict,
    rules: dict,
    n: int,
    axis: str,
    expert: tuple[str, int] | None = None,
    own_experts: bool = False,
) -> Any:
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    local: Any = copy.deepcopy(model, shared)
    config = getattr(local, "config", None)
    if getattr(config, "_attn_implementation", None) not in (None, "eager"):
        local.set_attn_implementation("eager")
    local_modules = dict(local.named_modules())
    if not own_experts:  # in one process the devices are a vmap: experts the plan leaves whole too
        for module in local_modules.values():
            if _is_experts(module):
                _batched_experts(module)
    counts = attention_counts(modules, layers)
    for name, (heads, kv, _) in counts.items():
        _local_heads(local_modules[name], name, heads, kv, n)
    parents = {
        name.rpartition(".")[0] for name, layer in layers.items() if layer.kind in ("colwise", "vocab")
    }
    for name in parents - set(counts):  # a plain module's head counts: divided by n
        if not isinstance(modules[name], nn.Embedding):
            _divide_attrs(local_modules[name], name, QUERY_ATTRS + KV_ATTRS, n)
    if any(layer.kind == "sequence_parallel" for layer in layers.values()):
        _sequence_parallel(local, modules, local_modules, layers, rules, axis, n, expert, own_experts)
        return local
    for name, layer in layers.items():
        _plain(local_modules[name], name, layer.kind, modules, layers, rules, axis, n, expert, own_experts)
    head = local.get_output_embeddings() if hasattr(local, "get_output_embeddings") else None
    names = {id(m): name for name, m in local_modules.items()}
    if head is not None and layers.get(names.get(id(head)), Layer("replicate")).kind == "vocab":
        local.loss_function = functools.partial(tl.vocab_loss, axis, getattr(local, "loss_type", None))
    return local


def _plain(
    module: Any,
    name: str,
    kind: str,
    modules: dict,
    layers: dict,
    rules: dict,
    axis: str,
    n: int,
    expert: tuple[str, int] | None,
    own_experts: bool,
) -> None:
    """A layer of the local copy made tensor parallel as the plan says (no sequence parallelism)."""
    if kind in ("colwise", "colwise_gather", "vocab") and is_conv1d(module):
        module.nf = module.weight.shape[1] // n if name + ".weight" not in rules else module.nf
    forward = module.forward
    if kind in ("replicate", "colwise", "packed_colwise") or (kind == "vocab" and not _is_embedding(module)):
        return
    if kind == "vocab":
        pad, module.padding_idx = module.padding_idx, None
        module.forward = functools.partial(tl.vocab_embedding, module, forward, axis, pad)
    elif kind == "rowwise_heads":
        module.forward = functools.partial(tl.row_linear_heads, module, axis, n)
    elif kind in ("rowwise", "rowwise_split"):
        row = functools.partial(tl.row_conv1d if is_conv1d(module) else tl.row_linear, module, axis)
        module.forward = functools.partial(tl.split_input, row, n, axis) if kind == "rowwise_split" else row
    elif kind in ("colwise_gather", "embedding_colwise"):
        module.forward = functools.partial(tl.gather_output, forward, axis)
    elif kind in ("all_reduce", "moe_experts"):
        module.forward = functools.partial(tl.all_reduce_output, forward, axis)
        if kind == "moe_experts":
            _local_experts(module, n, own_experts)
    elif kind == "ep_experts":
        assert expert is not None  # resolve() gives 'ep_experts' only with an expert axis
        e_axis, e_n = expert
        module.num_experts //= e_n  # its forward runs on local expert ids
        if not own_experts:
            _batched_experts(module)
        module.forward = functools.partial(tl.expert_parallel, module, forward, e_axis, e_n)
    elif kind == "split_norm":
        _split_norm(module, name, modules, layers, axis, n)


def _sequence_norms(model: nn.Module) -> dict[str, str]:
    """``{"<layers>.*.<norm>": "sequence_parallel"}`` for the norm children of the decoder layers."""
    from ..hf._pipeline import decoder_layers  # fpar.hf imports fpar.ops

    base, attr = decoder_layers(model, _API)
    prefix = _name_of(dict(model.named_modules()), getattr(base, attr))
    norms = {
        f"{prefix}.*.{child}": "sequence_parallel"
        for layer in getattr(base, attr)
        for child, module in layer.named_children()
        if "norm" in type(module).__name__.lower()
    }
    if not norms:
        raise ValueError(
            f"{_API}: sequence_parallel=True, but the decoder layers of {type(model).__name__} "
            f"({prefix}) have no norm module (a child whose class name has 'Norm') to run on "
            f"sequence blocks; name the modules that may run on them 'sequence_parallel' in plan=."
        )
    return norms


# Kinds a sequence-parallel model takes (its residual stream split along the sequence) and what
# their modules do on the sequence block.
_SP_KINDS = (
    "sequence_parallel",
    "replicate",
    "colwise",
    "packed_colwise",
    "colwise_gather",
    "rowwise",
    "rowwise_split",
    "rowwise_heads",
    "split_norm",
)


def _sequence_parallel(
    local: Any,
    modules: dict,
    local_modules: dict,
    layers: dict,
    rules: dict,
    axis: str,
    n: int,
    expert: tuple[str, int] | None,
    own_experts: bool,
) -> None:
    """Megatron-SP for a model whose plan names ``sequence_parallel`` modules (HF's style for norms).

    From the first decoder layer on, the residual stream is this device's sequence block: the
    norms (and everything else replicated) run on it; a module holding column-parallel layers (an
    attention, an MLP: a tensor-parallel region) all-gathers its input along the sequence, as
    torchtitan's ``PrepareModuleInput`` does, and a row-parallel layer reduce-scatters its partial
    product along the sequence instead of all-reducing it.  Every other module of a decoder layer
    (not named ``sequence_parallel``; it may mix along the sequence, as a linear attention does)
    runs on the gathered sequence and gives back its block.  A mixture of experts (a decoder
    layer's module holding 'moe_experts', or experts over an expert axis) is such a module too: its
    router picks experts per token of the whole sequence, and its experts and shared experts run
    tensor parallel as without sequence parallelism (their sums all-reduced) before it gives back
    its block.  The embedding before the layers runs on the whole sequence; the head gathers its
    input.  Checked before anything runs: a kind or a module this cannot split so is an error
    naming it.
    """
    from ..hf._pipeline import decoder_layers  # fpar.hf imports fpar.ops

    cls = type(local).__name__
    base, attr = decoder_layers(local, _API)
    decoders = {id(m) for m in getattr(base, attr)}
    head = local.get_output_embeddings() if hasattr(local, "get_output_embeddings") else None
    regions: dict[str, nn.Module] = {}
    moe = _moe_regions(layers, local_modules, decoders)
    for name, layer in layers.items():
        module, kind = local_modules[name], layer.kind
        if any(name == r or name.startswith(r + ".") for r in moe):  # in a mixture of experts: as without SP
            _plain(module, name, kind, modules, layers, rules, axis, n, expert, own_experts)
            continue
        embedding = kind == "vocab" and isinstance(module, nn.Embedding) and module is not head
        if not embedding and (kind not in (*_SP_KINDS, "vocab") or is_conv1d(module)):
            raise ValueError(
                f"{_API}: {cls}'s plan names 'sequence_parallel' modules, so its residual stream is "
                f"split along the sequence; {name!r} ({type(module).__name__}) is {layer.kind!r}, "
                f"which sequence parallelism does not take here (it takes nn.Linear 'colwise', "
                f"'packed_colwise', 'colwise_gather_output', 'rowwise' and 'rowwise_split_input' "
                f"layers, a vocabulary-split embedding and head, and replicated modules). Leave "
                f"'sequence_parallel' out of the plan for this model."
            )
        is_head = head is not None and module is head
        if is_head:  # the whole sequence's logits: the head gathers its input
            if kind == "rowwise_split":  # Inkling's: a slice of the gathered input, then psum
                module.forward = functools.partial(
                    tl.split_input, functools.partial(tl.row_linear, module, axis), n, axis
                )
            elif kind == "colwise_gather":
                module.forward = functools.partial(tl.gather_output, module.forward, axis)
        elif kind == "rowwise":
            module.forward = functools.partial(tl.sp_row, module, axis)
        elif kind == "rowwise_heads":  # inside an attention, on its gathered sequence
            module.forward = functools.partial(tl.row_linear_heads, module, axis, n)
        elif kind == "rowwise_split":  # after a gathered column-parallel output (GLM's MLP)
            module.forward = functools.partial(
                tl.split_input, functools.partial(tl.sp_row, module, axis), n, axis
            )
        elif kind == "split_norm":  # OLMo 2's q/k norms: inside attention, on the whole sequence
            _split_norm(module, name, modules, layers, axis, n)
        elif embedding:
            pad, module.padding_idx = module.padding_idx, None
            module.forward = functools.partial(tl.vocab_embedding, module, module.forward, axis, pad)
        elif kind in ("colwise", "packed_colwise", "colwise_gather"):
            parent = name.rpartition(".")[0]
            if id(local_modules[parent]) in decoders or parent == "":
                raise ValueError(
                    f"{_API}: {cls}'s plan names 'sequence_parallel' modules, but the column-parallel "
                    f"{name!r} sits directly in {parent or 'the model'!r}, not in an attention or MLP "
                    f"module whose input can be gathered along the sequence. Leave "
                    f"'sequence_parallel' out of the plan for this model."
                )
            if id(local_modules[parent.rpartition(".")[0]]) not in decoders:
                raise ValueError(
                    f"{_API}: {cls}'s plan names 'sequence_parallel' modules, but the column-parallel "
                    f"{name!r} is not in a module of a decoder layer's own (an attention or MLP) whose "
                    f"input can be gathered along the sequence. Leave 'sequence_parallel' out of the "
                    f"plan for this model."
                )
            regions[parent] = local_modules[parent]
            if kind == "colwise_gather":
                module.forward = functools.partial(tl.gather_output, module.forward, axis)
    # Every other module of a decoder layer (a linear attention, anything not named
    # 'sequence_parallel') may mix along the sequence: it runs on the whole sequence, its output cut
    # back to this device's block.
    marked = {id(local_modules[k]) for k, layer in layers.items() if layer.kind == "sequence_parallel"}
    regioned = {id(m) for m in regions.values()}
    for layer_module in getattr(base, attr):
        for child in layer_module.children():
            if id(child) in marked or id(child) in regioned:
                continue
            where = f"{_name_of(local_modules, child)!r} ({type(child).__name__})"
            child.register_forward_pre_hook(
                functools.partial(tl.gather_sequence, axis, where), with_kwargs=True
            )
            child.register_forward_hook(functools.partial(tl.own_block, axis, n))
    head_name = _name_of(local_modules, head) if head is not None else None
    if head_name is not None and head is not None:
        regions[head_name] = head
    for name, region in regions.items():
        where = f"{name!r} ({type(region).__name__})"
        region.register_forward_pre_hook(functools.partial(tl.gather_sequence, axis, where), with_kwargs=True)
        inside = [layer.kind for k, layer in layers.items() if k.startswith(name + ".")]
        if (
            region is not head
            and "colwise_gather" in inside
            and not {"rowwise", "rowwise_split"} & set(inside)
        ):
            # no row-parallel exit to reduce-scatter: its output is gathered (a linear attention
            # whose projections are all 'colwise_gather_output'): the whole sequence, cut to the block
            region.register_forward_hook(functools.partial(tl.own_block, axis, n))
    getattr(base, attr)[0].register_forward_pre_hook(
        functools.partial(tl.sequence_block, axis, n, f"{cls}'s first decoder layer"), with_kwargs=True
    )
    if head_name is not None and layers.get(head_name, Layer("replicate")).kind == "vocab":
        local.loss_function = functools.partial(tl.vocab_loss, axis, getattr(local, "loss_type", None))


def _moe_regions(layers: dict, local_modules: dict, decoders: set[int]) -> set[str]:
    """The names of the decoder layers' modules (their direct children) that hold experts.

    Experts the plan splits ('moe_experts', or over an expert axis), and experts it leaves whole:
    transformers 5.25 plans experts only in its expert plan, so under tensor parallelism alone its
    mixtures of experts keep whole experts beside tensor-parallel shared experts, a region all the same.
    """
    planned = [name for name, layer in layers.items() if layer.kind in ("moe_experts", *EXPERT_KINDS)]
    whole = [name for name, module in local_modules.items() if _is_experts(module)]
    out = set()
    for name in (*planned, *whole):
        parts = name.split(".")
        for i in range(2, len(parts) + 1):
            if id(local_modules[".".join(parts[: i - 1])]) in decoders:
                out.add(".".join(parts[:i]))
                break
    return out


def _is_experts(module: nn.Module) -> bool:
    """A transformers experts module (``@use_experts_implementation``: its forward picks a kernel)."""
    return all(hasattr(module, a) for a in ("config", "has_gate", "is_concatenated", "_is_expert_parallel"))


def _split_norm(module: nn.Module, name: str, modules: dict, layers: dict, axis: str, n: int) -> None:
    source = modules[layers[name].segments[0][1]].weight.shape[0]
    counts = attention_counts(modules, layers).get(name.rpartition(".")[0])
    repeats = n // counts[1] if counts and source == counts[1] * counts[2] and counts[1] < n else 1
    module.forward = functools.partial(tl.split_rms_norm, module, axis, source, repeats)


def _name_of(modules: dict, module: nn.Module) -> str | None:
    return next((name for name, m in modules.items() if m is module), None)


def _is_embedding(module: nn.Module) -> bool:
    return isinstance(module, nn.Embedding)


def _local_heads(module: Any, name: str, heads: int, kv: int, n: int) -> None:
    """Per-device head counts on an attention module of the copy (and on its own config copy)."""
    q_local, kv_local = heads // n, (kv // n if kv % n == 0 else 1)
    _divide_attrs(module, name, QUERY_ATTRS, n)
    for attr in KV_ATTRS:
        if isinstance(getattr(module, attr, None), int):
            setattr(module, attr, kv_local)
    if isinstance(getattr(module, "num_key_value_groups", None), int):
        module.num_key_value_groups = q_local // kv_local
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "num_attention_heads"):
        config = copy.copy(config)
        config.num_attention_heads = q_local
        if getattr(config, "num_key_value_heads", None) is not None:
            config.num_key_value_heads = kv_local
        module.config = config


def _divide_attrs(module: nn.Module, name: str, attrs: tuple, n: int) -> None:
    for attr in attrs:
        value = getattr(module, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            if value % n:
                raise ValueError(
                    f"{_API}: {name!r} ({type(module).__name__}) has {attr}={value}, not divisible by "
                    f"the tensor axis size {n}; choose an axis size dividing it."
                )
            setattr(module, attr, value // n)


def _local_experts(module: Any, n: int, own: bool) -> None:
    """A split experts module: per-device intermediate size; the vmap-able batched experts unless ``own``."""
    if isinstance(getattr(module, "intermediate_dim", None), int):
        module.intermediate_dim //= n
    if not own:
        _batched_experts(module)


def _batched_experts(module: nn.Module) -> None:
    """Run ``module``'s experts with transformers' ``batched_mm`` (no data-dependent loop: vmap-able).

    It gathers each (token, choice) row's expert weights, so its memory and time grow with the
    rows: 59x DDP's step with every expert local (``grouped_mm``) on 2 processes
    (``bench/hf_tp.py --family qwen3_moe --ep``), which is why a real mesh keeps the model's own.
    """
    config = getattr(module, "config", None)
    if config is not None and getattr(config, "_experts_implementation", None) not in (None, "batched_mm"):
        config._experts_implementation = "batched_mm"
    elif config is not None and getattr(config, "_experts_implementation", "missing") is None:
        config._experts_implementation = "batched_mm"
