"""Megatron tensor parallelism of an unmodified ``nn.Module`` or Hugging Face model.

``tensor_parallel(model, mesh, axis="tensor", plan="auto")`` returns ``(apply_fn, params,
specs)``: ``params`` are the module's parameters by dotted name with their global shapes (as
``fpar.functionalize``), ``specs`` their ``fpar.P``, and ``apply_fn(params, *args, **kwargs)``
the per-device function to give ``fpar.shard``.  Inside it each device holds ``1/n`` of every
split layer and runs the module's own forward code on its blocks.

How the module's own code is made to run on blocks, without touching the user's module:

* A *local copy* of the module is built once (``copy.deepcopy`` that shares every parameter and
  buffer, so it costs no tensor memory).  Its split layers are adjusted to per-device sizes:
  HF ``Conv1D.nf`` of a column-parallel layer, and head-count attributes of the module that owns
  column-parallel layers (GPT-2 attention's ``split_size``/``num_heads``; see ``_HEAD_ATTRS``).
  Llama, Mistral and BERT reshape with ``-1`` heads and need nothing.
* Row-parallel layers of the copy get a forward that all-reduces (``fpar.psum``) the partial
  product *before* adding the bias (``addmm``/``F.linear`` would add it on every device);
  vocabulary-parallel embeddings a forward that looks up the owned rows and psums them.
* The copy uses ``eager`` attention: ``fpar.shard`` runs the per-device function under vmap
  levels (on a real mesh too), where ``sdpa`` has no batching rule (a slow per-example fallback)
  and fails on an ``attention_mask`` split over a data axis.  The math is the same.
* With a vocabulary-parallel ``lm_head`` the logits stay split (``[..., V/n]``); the copy's HF
  causal-LM loss (``labels=``) is replaced by one on ``fpar.ops.vocab_cross_entropy``, which
  never gathers them.

The copy is private, so ``apply_fn`` is reentrant and thread-safe, and works inside ``remat``
recomputation.  A row-parallel layer's input varies over the axis and its output is replicated,
so a transformer block does two all-reduces forward (attention and MLP), as in Megatron.
"""

from __future__ import annotations

import copy
import fnmatch
import functools
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .._collectives import psum
from .._functional import _stateless
from .._mesh import Mesh
from .._spec import PartitionSpec as P
from ._megatron import _local_ids, vocab_cross_entropy

__all__ = ["TensorParallelFn", "tensor_parallel"]

Tensor = torch.Tensor
KINDS = ("colwise", "rowwise", "vocab", "replicate")
# Integer attributes of a module owning column-parallel layers that count heads or fused widths:
# divided by n in the local copy (GPT-2's attention reads ``split_size`` to split ``c_attn``).
_HEAD_ATTRS = (
    "num_heads",
    "n_heads",
    "n_head",
    "num_attention_heads",
    "num_key_value_heads",
    "num_kv_heads",
    "n_kv_heads",
    "split_size",
    "all_head_size",
)
_API = "fpar.ops.tensor_parallel"
# Words of torch's shape-mismatch errors (view/reshape/matmul/broadcast) that local sizes cause.
_SHAPE_WORDS = ("shape", "size", "mat1", "dimension")


# API ----------------------------------------------------------------------------------------


def tensor_parallel(model: nn.Module, mesh: Mesh, *, axis: str = "tensor", plan: Any = "auto") -> tuple:
    r"""Make an unmodified module tensor parallel (Megatron 1D) over the mesh axis ``axis``.

    Column-parallel layers split their output features (attention heads: each device runs
    ``heads/n`` heads), row-parallel layers their input features and all-reduce the result before
    the bias, vocabulary-parallel embeddings and heads split the vocabulary.  Everything else
    (norms, position embeddings, biases of row-parallel layers) is replicated.

    ``plan="auto"`` recognises Hugging Face ``GPT2LMHeadModel``/``GPT2Model``,
    ``LlamaForCausalLM``/``LlamaModel``, ``MistralForCausalLM``/``MistralModel`` and
    ``BertModel``: q/k/v (GPT-2's fused ``c_attn``) and the MLP's first layers column-parallel,
    the attention output and the MLP's last layer row-parallel, the token embedding and
    ``lm_head`` vocabulary-parallel when ``n`` divides the vocabulary (replicated otherwise, e.g.
    GPT-2's 50257; padding it would change the model's shapes).  Tied embeddings stay tied.

    **GPT-2's c_attn is regrouped.**  Its ``[q|k|v]`` output columns are permuted in ``params``
    so that device ``r``'s contiguous block is ``[q_r|k_r|v_r]`` (its own heads of q, k and v; a
    contiguous third of the fused dim would be silently wrong).  Names and shapes are unchanged
    but the values are not the module's: ``apply_fn.export(params)`` undoes it, and
    ``fpar.checkpoint.merge(..., transform=apply_fn.export)`` writes a file that
    ``transformers``' ``from_pretrained`` loads into the original class.  ``apply_fn.regrouped``
    names the regrouped parameters.  A user plan's column-parallel ``c_attn`` is regrouped too.

    Args:
      model: the module (not modified; its parameters are shared, not copied).  Call
        ``model.eval()`` first to turn dropout off.
      mesh: the mesh, from ``fpar.make_mesh``; it may have other axes (e.g. ``data``).
      axis: the tensor-parallel mesh axis.
      plan: ``"auto"``, or a dict of module-name patterns (glob, ``*`` also crosses dots, matched
        against the whole dotted name from ``named_modules``) to ``"colwise"`` | ``"rowwise"`` |
        ``"vocab"`` | ``"replicate"``, over ``nn.Linear``, ``nn.Embedding`` (``"vocab"``) and HF
        ``Conv1D``.  The first matching pattern wins; modules no pattern names are replicated.
        ``"vocab"`` on a Linear is column-parallel over the vocabulary (``lm_head``).

    Returns:
      ``(apply_fn, params, specs)``: ``apply_fn(params, *args, **kwargs)`` is the per-device
      function (a ``TensorParallelFn``) returning what the module returns, with column- and
      vocab-parallel outputs left split; ``params`` is ``{name: global tensor}``; ``specs`` is
      ``{name: fpar.P}``.  Pass ``use_cache=False`` to HF decoders when training (else the
      forward builds a KV cache the out_specs must cover).  A padding mask goes in 4-D additive
      form (HF's helpers for a 2-D mask test its values, which vmap cannot).

    Raises:
      TypeError: ``model`` is not a module, ``mesh`` not a ``fpar.Mesh``, a bad plan value, or a
        plan splitting a module type it cannot split.
      ValueError: an unknown axis, an unrecognised model with ``plan="auto"``, a pattern naming no
        module, or head/feature/vocabulary sizes the axis size does not divide.

    Example:
      >>> model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64)).eval()
      >>> mesh = fpar.make_mesh((2, 2), ("data", "tensor"))
      >>> apply_fn, params, specs = fpar.ops.tensor_parallel(model, mesh)
      >>> def loss(p, ids):
      ...     return fpar.pmean(apply_fn(p, ids, labels=ids, use_cache=False).loss, "data")
      >>> fpar.shard(loss, mesh, (specs, P("data")), P())(params, ids)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"{_API}: model must be a torch.nn.Module, got {type(model).__name__}.")
    if not isinstance(mesh, Mesh):
        raise TypeError(f"{_API}: mesh must be a fpar.Mesh (from fpar.make_mesh), got {mesh!r}.")
    if not isinstance(axis, str) or axis not in mesh.axis_names:
        raise ValueError(f"{_API}: axis {axis!r} is not an axis of {mesh}; name one of {mesh.axis_names}.")
    n = mesh.shape[axis]
    modules = dict(model.named_modules())
    if isinstance(plan, str) and plan == "auto":
        layers = _auto_plan(model, modules, n)
    else:
        layers = _fused_groups(_user_plan(plan, modules), modules)
    for name, layer in layers.items():
        _check_layer(name, modules[name], layer, n)
    params = {name: p.detach() for name, p in model.named_parameters()}
    specs = _specs(model, modules, layers, params, axis)
    regrouped, sources = {}, {}
    for name, layer in layers.items():
        if layer.groups > 1:
            for pname, dim in _out_dims(modules[name]).items():
                full = f"{name}.{pname}" if name else pname
                index = _regroup(torch.arange(params[full].shape[dim]), layer.groups, n, 0)
                params[full] = params[full].index_select(dim, index)
                regrouped[full] = (layer.groups, dim)
                sources[full] = (dim, index)
    local = _local_copy(model, modules, layers, n, axis)
    buffers = {name: b.detach() for name, b in local.named_buffers()}
    run = _stateless(local, frozenset(params), buffers)
    return TensorParallelFn(run, local, axis, n, layers, regrouped, sources, frozenset(params)), params, specs


class TensorParallelFn:
    """The per-device function of ``tensor_parallel``: ``apply_fn(params, *args, **kwargs)``.

    Attributes:
      module: the private local copy whose forward runs on this device's blocks.
      axis: the tensor-parallel mesh axis; ``n`` its size.
      plan: ``{module name: kind}`` of every non-replicated layer.
      regrouped: ``{parameter name: (groups, dim)}`` of the fused weights whose output columns
        ``params`` holds regrouped per device (GPT-2's ``c_attn``: groups 3).
    """

    def __init__(
        self,
        run: Callable,
        module: nn.Module,
        axis: str,
        n: int,
        layers: dict,
        regrouped: dict,
        sources: dict,
        names: frozenset,
    ):
        self._run, self.module, self.axis, self.n = run, module, axis, n
        self.plan = {name: layer.kind for name, layer in layers.items() if layer.kind != "replicate"}
        self.regrouped = regrouped
        self._sources = sources
        self._names_of_params = frozenset(names)
        self._names = {id(m): name for name, m in module.named_modules()}
        self.__name__ = f"{type(module).__name__}_tensor_parallel"

    def __call__(self, params: Mapping[str, Tensor], *args: Any, **kwargs: Any) -> Any:
        try:
            return self._run(params, *args, **kwargs)
        except RuntimeError as e:
            where = _failing_module(e, self._names)
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            if where is None:
                raise
            name, module = where
            head = f"{_API}: the forward of {name or '<root>'!r} ({type(module).__name__})"
            if "data-dependent control flow" in first:
                raise ValueError(
                    f"{head} tests a tensor's values in Python, which fpar.shard's vmap levels cannot: "
                    f"{first} Hugging Face's attention-mask helpers do this with a 2-D padding mask: "
                    f"pass the mask already in 4-D additive form [B, 1, T or 1, S] (0 where attended, "
                    f"torch.finfo(dtype).min elsewhere; add the causal triangle for a decoder)."
                ) from e
            if not any(word in first for word in _SHAPE_WORDS):
                raise
            raise ValueError(
                f"{head} failed on this device's blocks ({self.n}-way split over {self.axis!r}): {first} "
                f"Its forward probably reshapes with a global size: use -1 for the head count in "
                f"view/reshape, or keep the count in an attribute named one of {list(_HEAD_ATTRS)} (which "
                f"tensor_parallel divides by {self.n}), or mark its layers 'replicate' in the plan."
            ) from e

    def source(self, name: str) -> tuple[int, Tensor] | None:
        """Where the global tensor ``params[name]`` comes from in the module's own tensor.

        Args:
          name: a parameter name, as in ``params``.

        Returns:
          ``None`` when ``params[name]`` is the module's own tensor (same shape and values), else
          ``(dim, index)`` with ``index`` a 1-D ``LongTensor`` such that ``params[name] ==
          module_tensor.index_select(dim, index)``: a fused weight regrouped per device (a
          permutation), or a key/value weight whose heads are replicated over the tensor devices
          that use them (``index`` repeats rows; ``params[name]`` is then larger).  A loader reads
          only the rows of its own block: ``index`` sliced by the spec.

        Raises:
          KeyError: ``name`` is not a parameter of the model.
        """
        if name not in self._names_of_params:
            raise KeyError(
                f"{_API}: source({name!r}): no such parameter; the names are those of params "
                f"(model.named_parameters(), tied ones once)."
            )
        found = self._sources.get(name)
        return None if found is None else (found[0], found[1].clone())

    def export(self, tensors: Mapping[str, Tensor], *, prefix: str = "") -> dict[str, Tensor]:
        """Undo ``source``: tensors in the module's own layout, e.g. to save for ``from_pretrained``.

        Regrouped rows go back to the module's order; replicated key/value heads collapse to one
        copy (the first: replicas are equal, and their gradients too, see the docs).

        Args:
          tensors: ``{name: global tensor}`` over any subset of the parameter names, e.g.
            ``params`` (after training), their gradients, or the flat dict of a merged checkpoint.
          prefix: what precedes the module's parameter names in ``tensors`` (``"params."`` for a
            checkpoint of ``{"params": params, ...}``).

        Returns:
          A new dict with the same names, each tensor in the module's own layout (and shape); the
          other tensors are passed through.
        """
        out = dict(tensors)
        for name, (dim, index) in self._sources.items():
            if prefix + name in out:
                out[prefix + name] = out[prefix + name].index_select(
                    dim, _inverse(index).to(out[prefix + name].device)
                )
        return out


# Plans --------------------------------------------------------------------------------------


class _Layer:
    """How one leaf layer is split: ``kind`` and, for a fused column-parallel layer, ``groups``."""

    def __init__(self, kind: str, groups: int = 1, pattern: str = "auto"):
        self.kind, self.groups, self.pattern = kind, groups, pattern


def _user_plan(plan: Any, modules: dict[str, nn.Module]) -> dict[str, _Layer]:
    if not isinstance(plan, Mapping):
        raise TypeError(
            f"{_API}: plan must be 'auto' or a dict of module-name patterns to one of {KINDS}, e.g. "
            f"{{'blocks.*.mlp.fc1': 'colwise', 'blocks.*.mlp.fc2': 'rowwise'}}; got {plan!r}."
        )
    layers: dict[str, _Layer] = {}
    for pattern, kind in plan.items():
        if not isinstance(pattern, str):
            raise TypeError(f"{_API}: plan pattern {pattern!r} must be a string (a module name or glob).")
        if kind not in KINDS:
            raise TypeError(f"{_API}: plan[{pattern!r}] is {kind!r}; it must be one of {KINDS}.")
        hits = [name for name in modules if name and fnmatch.fnmatchcase(name, pattern)]
        if not hits:
            names = [name for name in modules if name]
            shown = ", ".join(repr(x) for x in names[:12]) + (" ..." if len(names) > 12 else "")
            raise ValueError(
                f"{_API}: plan pattern {pattern!r} matches no module of {type(modules['']).__name__}. "
                f"Patterns are globs over the dotted names of model.named_modules() ({shown})."
            )
        for name in hits:
            layers.setdefault(name, _Layer(kind, pattern=pattern))
    return layers


def _fused_groups(layers: dict[str, _Layer], modules: dict[str, nn.Module]) -> dict[str, _Layer]:
    """Regroup a user plan's column-parallel fused layers of recognised families, as ``auto`` does.

    GPT-2's ``c_attn``: a contiguous split of ``[q|k|v]`` would be silently wrong.
    """
    families = _families()
    for name, layer in layers.items():
        parent, _, child = name.rpartition(".")
        for fused, _, groups in families.get(_family_of(modules[parent], families), ()):
            if fused == child and groups > 1 and layer.kind == "colwise":
                layer.groups = groups
    return layers


def _auto_plan(model: nn.Module, modules: dict[str, nn.Module], n: int) -> dict[str, _Layer]:
    families = _families()
    if not isinstance(model, tuple(families)):
        known = "GPT2LMHeadModel, GPT2Model, LlamaForCausalLM, LlamaModel, MistralForCausalLM, MistralModel, BertModel"
        raise ValueError(
            f"{_API}: plan='auto' does not recognise {type(model).__name__} (it knows {known}). Pass "
            f"plan={{pattern: 'colwise' | 'rowwise' | 'vocab' | 'replicate'}} naming its layers."
        )
    config = model.config
    if getattr(config, "add_cross_attention", False):
        raise ValueError(
            f"{_API}: plan='auto' does not split cross-attention ({type(model).__name__} with "
            f"add_cross_attention=True); pass a plan dict."
        )
    heads = config.num_attention_heads
    if heads % n:
        raise ValueError(
            f"{_API}: {type(model).__name__} has {heads} attention heads, not divisible by the size "
            f"{n} of the tensor axis: each device must hold whole heads. Use a tensor axis whose size "
            f"divides {heads}."
        )
    kv = getattr(config, "num_key_value_heads", None) or heads
    if kv % n:
        raise ValueError(
            f"{_API}: {type(model).__name__} has {kv} key/value heads (grouped-query attention), not "
            f"divisible by the size {n} of the tensor axis: each device must hold whole kv heads with "
            f"their query heads. Use a tensor axis whose size divides {kv}."
        )
    layers: dict[str, _Layer] = {}
    for name, module in modules.items():
        for child, kind, groups in families.get(_family_of(module, families), ()):
            layers[_join(name, child)] = _Layer(kind, groups)
    vocab = [model.get_input_embeddings()]
    if hasattr(model, "get_output_embeddings") and model.get_output_embeddings() is not None:
        vocab.append(model.get_output_embeddings())
    names = {id(m): name for name, m in modules.items()}
    kind = "vocab" if all(_vocab_size(m) % n == 0 for m in vocab) else "replicate"
    for m in vocab:
        layers[names[id(m)]] = _Layer(kind)
    return layers


def _families() -> dict[type, tuple]:
    """``{module class: ((child, kind, groups), ...)}`` for the recognised HF families (and models)."""
    if "transformers" not in sys.modules:
        try:
            import transformers  # noqa: F401
        except ImportError:
            return {}
    from transformers.models.bert import modeling_bert as bert
    from transformers.models.gpt2 import modeling_gpt2 as gpt2
    from transformers.models.llama import modeling_llama as llama
    from transformers.models.mistral import modeling_mistral as mistral

    qkvo = (
        ("q_proj", "colwise", 1),
        ("k_proj", "colwise", 1),
        ("v_proj", "colwise", 1),
        ("o_proj", "rowwise", 1),
    )
    gud = (("gate_proj", "colwise", 1), ("up_proj", "colwise", 1), ("down_proj", "rowwise", 1))
    out: dict[type, tuple] = {
        gpt2.GPT2Attention: (("c_attn", "colwise", 3), ("c_proj", "rowwise", 1)),
        gpt2.GPT2MLP: (("c_fc", "colwise", 1), ("c_proj", "rowwise", 1)),
        llama.LlamaAttention: qkvo,
        llama.LlamaMLP: gud,
        mistral.MistralAttention: qkvo,
        mistral.MistralMLP: gud,
        bert.BertSelfAttention: (("query", "colwise", 1), ("key", "colwise", 1), ("value", "colwise", 1)),
        bert.BertSelfOutput: (("dense", "rowwise", 1),),
        bert.BertIntermediate: (("dense", "colwise", 1),),
        bert.BertOutput: (("dense", "rowwise", 1),),
    }
    for model in (
        gpt2.GPT2LMHeadModel,
        gpt2.GPT2Model,
        llama.LlamaForCausalLM,
        llama.LlamaModel,
        mistral.MistralForCausalLM,
        mistral.MistralModel,
        bert.BertModel,
    ):
        out.setdefault(model, ())
    return out


def _family_of(module: nn.Module, families: dict) -> type | None:
    """A recognised class that ``module`` subclasses (HF attention classes are subclassed)."""
    return next((cls for cls in families if isinstance(module, cls)), None)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _vocab_size(module: nn.Module) -> int:
    return module.weight.shape[0]


# Checks and specs ---------------------------------------------------------------------------


def _is_conv1d(module: nn.Module) -> bool:
    """HF's ``Conv1D`` (``[in, out]`` weight, global ``nf``), without importing transformers."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def _check_layer(name: str, module: nn.Module, layer: _Layer, n: int) -> None:
    kind, where = layer.kind, f"{_API}: {name!r} ({type(module).__name__}, plan {layer.pattern!r})"
    if kind == "replicate":
        return
    if isinstance(module, nn.Embedding):
        if kind not in ("vocab", "rowwise"):
            raise TypeError(f"{where}: an nn.Embedding can only be split over the vocabulary: use 'vocab'.")
        if module.max_norm is not None or module.sparse or module.scale_grad_by_freq:
            raise TypeError(
                f"{where}: a vocabulary-parallel embedding cannot use max_norm, sparse or "
                f"scale_grad_by_freq (they need the whole table); mark it 'replicate'."
            )
        _divides(
            where, "vocabulary size", module.num_embeddings, n, "mark it 'replicate', or pad the vocabulary"
        )
        return
    if not (isinstance(module, nn.Linear) or _is_conv1d(module)):
        raise TypeError(
            f"{where}: cannot split a {type(module).__name__}; {kind!r} applies to nn.Linear, "
            f"nn.Embedding ('vocab') and HF Conv1D. Name its Linear layers in the plan instead, or "
            f"mark it 'replicate'."
        )
    d_in, d_out = (module.nx, module.nf) if _is_conv1d(module) else (module.in_features, module.out_features)
    if kind == "rowwise":
        _divides(where, "input features", d_in, n, "choose a tensor axis size dividing it")
    else:
        _divides(where, "output features", d_out // layer.groups, n, "choose a tensor axis size dividing it")


def _divides(where: str, what: str, size: int, n: int, fix: str) -> None:
    if size % n:
        raise ValueError(
            f"{where}: its {what} ({size}) are not divisible by the tensor axis size {n}; {fix}."
        )


def _layer_specs(module: nn.Module, kind: str, axis: str) -> dict[str, P]:
    """Specs of a layer's own parameters (``weight``/``bias``) under ``kind``."""
    if kind == "replicate":
        return {}
    if isinstance(module, nn.Embedding):
        return {"weight": P(axis, None)}
    conv = _is_conv1d(module)
    if kind == "rowwise":
        return {"weight": P(axis, None) if conv else P(None, axis), "bias": P()}
    return {"weight": P(None, axis) if conv else P(axis, None), "bias": P(axis)}


def _out_dims(module: nn.Module) -> dict[str, int]:
    """The output-feature dim of a column-parallel layer's parameters."""
    out = {"weight": 1 if _is_conv1d(module) else 0}
    if getattr(module, "bias", None) is not None:
        out["bias"] = 0
    return out


def _specs(model, modules, layers, params, axis) -> dict[str, P]:
    """Every parameter's spec, from the layer that owns it; a tied parameter's layers must agree."""
    owner = {id(p): name for name, p in model.named_parameters()}  # tied parameters appear once
    specs: dict[str, P] = {}
    given: dict[str, str] = {}
    for name, module in modules.items():
        layer = layers.get(name)
        own = _layer_specs(module, layer.kind, axis) if layer is not None else {}
        for pname, p in module.named_parameters(recurse=False):
            key, spec = owner[id(p)], own.get(pname, P())
            if key in specs and specs[key] != spec:
                raise ValueError(
                    f"{_API}: {key!r} is tied between {given[key]!r} and {name!r}, whose plans give it "
                    f"different layouts ({specs[key]} and {spec}). Give tied layers the same kind "
                    f"(e.g. 'vocab' for a tied embedding and lm_head)."
                )
            specs.setdefault(key, spec)
            given.setdefault(key, name)
    return {name: specs[name] for name in params}


# Regrouping fused weights ---------------------------------------------------------------------


def _regroup(t: Tensor, groups: int, n: int, dim: int) -> Tensor:
    """``[g0 | g1 | g2]`` columns (each split n ways) -> ``[g0_0 g1_0 g2_0 | g0_1 g1_1 g2_1 | ...]``."""
    shape = t.shape
    v = t.unflatten(dim, (groups, n, shape[dim] // (groups * n)))
    return v.transpose(dim, dim + 1).reshape(shape).contiguous()


def _inverse(index: Tensor) -> Tensor:
    """The first position of each value ``0..max`` in ``index`` (undoes ``index_select(d, index)``)."""
    size = int(index.max()) + 1
    first = torch.full((size,), index.numel(), dtype=torch.long)
    return first.scatter_reduce(0, index, torch.arange(index.numel()), reduce="amin")


# The local copy ---------------------------------------------------------------------------------


def _local_copy(model, modules, layers, n: int, axis: str) -> nn.Module:
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    local = copy.deepcopy(model, shared)
    local_modules = dict(local.named_modules())
    parents = set()
    for name, layer in layers.items():
        module = local_modules[name]
        if layer.kind == "replicate":
            continue
        if layer.kind in ("colwise", "vocab") and not isinstance(module, nn.Embedding):
            parents.add(name.rpartition(".")[0])
            if _is_conv1d(module):
                module.nf //= n
        elif isinstance(module, nn.Embedding):
            module.forward = functools.partial(_vocab_embedding, module, axis)
        else:
            module.forward = functools.partial(
                _row_conv1d if _is_conv1d(module) else _row_linear, module, axis
            )
    for name in parents:
        parent = local_modules[name]
        for attr in _HEAD_ATTRS:
            value = getattr(parent, attr, None)
            if isinstance(value, int) and not isinstance(value, bool):
                if value % n:
                    raise ValueError(
                        f"{_API}: {name!r} ({type(parent).__name__}) has {attr}={value}, not divisible by "
                        f"the tensor axis size {n}; choose an axis size dividing it."
                    )
                setattr(parent, attr, value // n)
    config = getattr(local, "config", None)
    if getattr(config, "_attn_implementation", None) not in (None, "eager"):
        local.set_attn_implementation("eager")
    head = local.get_output_embeddings() if hasattr(local, "get_output_embeddings") else None
    names = {id(m): name for name, m in local_modules.items()}
    if head is not None and layers.get(names.get(id(head)), _Layer("replicate")).kind == "vocab":
        local.loss_function = functools.partial(_vocab_loss, axis, getattr(local, "loss_type", None))
    return local


def _row_linear(module: nn.Linear, axis: str, x: Tensor) -> Tensor:
    """A row-parallel ``nn.Linear``: all-reduce the partial product, then add the bias once."""
    y = psum(F.linear(x, module.weight), axis)
    return y if module.bias is None else y + module.bias


def _row_conv1d(module: nn.Module, axis: str, x: Tensor) -> Tensor:
    """A row-parallel HF ``Conv1D`` (``[in/n, out]`` block): psum, then the bias."""
    y = psum(x @ module.weight, axis)
    return y if module.bias is None else y + module.bias


def _vocab_embedding(module: nn.Embedding, axis: str, ids: Tensor) -> Tensor:
    """A vocabulary-parallel ``nn.Embedding``: owned rows, zeros elsewhere, one psum."""
    w = module.weight
    local, outside = _local_ids(ids, w.shape[0], axis)
    x = F.embedding(local, w)
    if module.padding_idx is not None:  # like padding_idx: that row gets no gradient
        pad = ids == module.padding_idx  # global (the copy's attributes keep global sizes)
        x = torch.where(pad.unsqueeze(-1), F.embedding(local, w.detach()), x)
    return psum(x.masked_fill(outside.unsqueeze(-1), 0.0), axis)


def _vocab_loss(axis: str, loss_type, logits: Tensor, labels: Tensor, vocab_size: int, **kwargs) -> Tensor:
    """HF's ``ForCausalLMLoss`` on vocabulary-split logits (``fpar.ops.vocab_cross_entropy``)."""
    if loss_type not in (None, "ForCausalLM"):
        raise ValueError(
            f"{_API}: with a vocabulary-parallel lm_head the logits are split; the {loss_type} loss "
            f"cannot use them. Compute it from the logits with fpar.ops.vocab_cross_entropy(logits, "
            f"targets, axis={axis!r}), or mark the head 'replicate'."
        )
    ignore = kwargs.get("ignore_index", -100)
    shift = kwargs.get("shift_labels")
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()  # HF upcasts the loss computation
    if shift is None:
        shift = F.pad(labels, (0, 1), value=ignore)[..., 1:]
    valid = shift != ignore
    tok = vocab_cross_entropy(logits, shift.masked_fill(~valid, 0), axis=axis)
    total = tok.masked_fill(~valid, 0.0).sum()
    count = kwargs.get("num_items_in_batch")
    return total / (valid.sum() if count is None else count)


def _failing_module(error: BaseException, names: dict[int, str]) -> tuple[str, nn.Module] | None:
    """The innermost module of the local copy whose forward is on the error's traceback."""
    found, tb = None, error.__traceback__
    while tb is not None:
        obj = tb.tb_frame.f_locals.get("self")
        if isinstance(obj, nn.Module) and id(obj) in names:
            found = (names[id(obj)], obj)
        tb = tb.tb_next
    return found
