"""Megatron tensor parallelism of an unmodified ``nn.Module`` or Hugging Face model.

``tensor_parallel(model, mesh, axis="tensor", plan="auto")`` returns ``(apply_fn, params,
specs)``: ``params`` are the module's parameters by dotted name with their global shapes (as
``fpar.functionalize``), ``specs`` their ``fpar.P``, and ``apply_fn(params, *args, **kwargs)``
the per-device function to give ``fpar.shard``.  Inside it each device holds ``1/n`` of every
split layer and runs the module's own forward code on its blocks.

How the module's own code is made to run on blocks, without touching the user's module:

* The plan (``_tp_resolve``): the model's own transformers plan (``_hf_plan``) or a user's dict,
  in fpar's kinds or transformers' strings; every parameter gets a spec and, where a device's
  block is not a contiguous slice of the module's tensor (fused weights regrouped, kv heads
  replicated), a row index (``_tp_index``; ``apply_fn.source`` / ``apply_fn.export``).
* A *local copy* of the module is built once (``copy.deepcopy`` that shares every parameter and
  buffer, so it costs no tensor memory).  Its split layers are adjusted to per-device sizes:
  HF ``Conv1D.nf`` of a column-parallel layer, head-count attributes of attention modules (and a
  copy of their config with the per-device head counts, for forwards that read the config).
* Row-parallel layers of the copy get a forward that all-reduces (``fpar.psum``) the partial
  product *before* adding the bias (``addmm``/``F.linear`` would add it on every device);
  vocabulary-parallel embeddings a forward that looks up the owned rows and psums them; the
  other styles' forwards are in ``_tp_layers``.
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

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from .._functional import _stateless
from .._mesh import Mesh
from .._spec import block_shape
from . import _tp_layers as tl
from ._tp_index import inverse, layout_index
from ._tp_local import _local_copy, _sequence_norms
from ._tp_resolve import (
    KV_ATTRS,
    QUERY_ATTRS,
    check_layer,
    layouts,
    resolve,
)

__all__ = ["TensorParallelFn", "tensor_parallel"]

Tensor = torch.Tensor
_API = "fpar.ops.tensor_parallel"
# Words of torch's shape-mismatch errors (view/reshape/matmul/broadcast) that local sizes cause.
_SHAPE_WORDS = ("shape", "size", "mat1", "dimension")


# API ----------------------------------------------------------------------------------------


def tensor_parallel(
    model: nn.Module,
    mesh: Mesh,
    *,
    axis: str = "tensor",
    plan: Any = "auto",
    expert_axis: str | None = None,
    sequence_parallel: bool = False,
) -> tuple:
    r"""Make an unmodified module tensor parallel (Megatron 1D) over the mesh axis ``axis``.

    Column-parallel layers split their output features (attention heads: each device runs
    ``heads/n`` heads), row-parallel layers their input features and all-reduce the result before
    the bias, vocabulary-parallel embeddings and heads split the vocabulary.  Everything else
    (norms, position embeddings, biases of row-parallel layers) is replicated.

    ``plan="auto"`` reads a Hugging Face model's own tensor-parallel plan (``model.tp_plan``:
    the config's ``base_model_tp_plan``, the head's ``_tp_plan``, ``embed_tokens`` vocabulary
    split), every ``transformers`` string mapped to what it means with fpar's collectives
    (``docs/hf-tensor-parallel.md`` has the table; one fpar does not implement is an error naming
    the module).  Models without a plan: fpar's own table for ``GPT2LMHeadModel``/``GPT2Model``
    and ``BertModel``.  The token embedding and ``lm_head`` are vocabulary-parallel when ``n``
    divides the vocabulary (replicated otherwise, e.g. GPT-2's 50257; padding it would change the
    model's shapes), and the logits stay split.  Tied embeddings stay tied.

    **Where a device's block is not a slice of the module's tensor.**  Fused weights are
    regrouped so device ``r``'s contiguous block holds its own heads (GPT-2's ``c_attn``, Phi-3's
    ``qkv_proj``: ``[q_r|k_r|v_r]``; ``gate_up_proj``: ``[gate_r|up_r]``), where the plan would
    gather; with fewer kv heads than ``n`` each kv head is replicated on the ``n / kv`` devices
    whose query heads use it (``params`` then holds the repeated rows; every replica gets the
    same summed gradient, so an optimizer keeps them equal).  ``apply_fn.source(name)`` says
    where each block comes from, ``apply_fn.export`` gives tensors back in the module's layout
    (``from_pretrained`` loads them).  ``apply_fn.regrouped`` / ``apply_fn.replicated`` name
    those parameters.  A model on the ``meta`` device gives ``meta`` params.

    Args:
      model: the module (not modified; its parameters are shared, not copied).  Call
        ``model.eval()`` first to turn dropout off.
      mesh: the mesh, from ``fpar.make_mesh``; it may have other axes (e.g. ``data``).
      axis: the tensor-parallel mesh axis.
      plan: ``"auto"``, or a dict of module-name patterns (glob, ``*`` also crosses dots, matched
        against the whole dotted name from ``named_modules``) to ``"colwise"`` | ``"rowwise"`` |
        ``"vocab"`` | ``"replicate"`` or a ``transformers`` plan string (``"colwise_gather_output"``,
        ``"embedding_rowwise"``, ...), over ``nn.Linear``, ``nn.Embedding`` and HF ``Conv1D``
        (3-D expert weights by their parameter name).  The first matching pattern wins; modules
        no pattern names are replicated.  ``"vocab"`` on a Linear is column-parallel over the
        vocabulary (``lm_head``).
      expert_axis: expert parallelism for a mixture-of-experts model: the mesh axis its experts are
        split over (dim 0 of each expert weight, ``E / size`` experts a device).  ``plan="auto"``
        then also reads the model's expert-parallel plan (``base_model_ep_plan``:
        ``ep_dispatch_experts`` / ``grouped_gemm``), which replaces the experts' tensor-parallel
        rules.  Each experts module sends every (token, chosen expert) pair to the device holding
        the expert with ``all_to_all`` and the results back (``fpar.ops.moe``'s dispatch: exact
        counts on a real mesh, static slots in-process) and runs the model's own experts code on
        the rows it receives; the router and everything else are as without it.  The tokens must
        vary over ``expert_axis`` (split the batch over it, as over a data axis: ``P(("data",
        "expert"))``), so the router's and the other replicated parameters' gradients are summed
        over it.  ``None``: the plan's ``ep_dispatch_experts`` / ``grouped_gemm`` strings are an
        error.
      sequence_parallel: Megatron sequence parallelism over ``axis``: the norms of each decoder
        layer (its children whose class name has ``Norm``) join the plan as ``"sequence_parallel"``,
        as a plan would name them (a plan's own rule for a module wins).  From the first decoder
        layer on the hidden states are each device's block of the sequence (dim 1, which the axis
        size must divide); attention and MLP gather it, row-parallel layers reduce-scatter.

    Returns:
      ``(apply_fn, params, specs)``: ``apply_fn(params, *args, **kwargs)`` is the per-device
      function (a ``TensorParallelFn``) returning what the module returns, with column- and
      vocab-parallel outputs left split; ``params`` is ``{name: global tensor}`` (on a real mesh
      put them with ``fpar.device_put(params, mesh, specs)``: ``apply_fn`` refuses a tensor that is
      not its device's block); ``specs`` is ``{name: fpar.P}``.  Pass ``use_cache=False`` to HF decoders when training (else the
      forward builds a KV cache the out_specs must cover).  A padding mask goes in 4-D additive
      form (HF's helpers for a 2-D mask test its values, which vmap cannot).

    Raises:
      TypeError: ``model`` is not a module, ``mesh`` not a ``fpar.Mesh``, a bad plan value, or a
        plan splitting a module type it cannot split.
      ValueError: an unknown axis, an unrecognised model with ``plan="auto"``, a pattern (or a whole
        model plan) naming no module, a plan string fpar does not implement, or head/feature/
        vocabulary sizes the axis size does not fit (the error lists the tensor sizes that work).

    Example:
      >>> model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64)).eval()
      >>> mesh = fpar.make_mesh((2, 2), ("data", "tensor"))
      >>> apply_fn, params, specs = fpar.ops.tensor_parallel(model, mesh)
      >>> def loss(p, ids):
      ...     return fpar.pmean(apply_fn(p, ids, labels=ids, use_cache=False).loss, "data")
      >>> params = fpar.device_put(params, mesh, specs)  # a real mesh's blocks; in-process: params
      >>> fpar.shard(loss, mesh, (specs, P("data")), P())(params, ids)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"{_API}: model must be a torch.nn.Module, got {type(model).__name__}.")
    if not isinstance(mesh, Mesh):
        raise TypeError(f"{_API}: mesh must be a fpar.Mesh (from fpar.make_mesh), got {mesh!r}.")
    if not isinstance(axis, str) or axis not in mesh.axis_names:
        raise ValueError(f"{_API}: axis {axis!r} is not an axis of {mesh}; name one of {mesh.axis_names}.")
    n = mesh.shape[axis]
    expert = None
    if expert_axis is not None:
        if not isinstance(expert_axis, str) or expert_axis not in mesh.axis_names or expert_axis == axis:
            raise ValueError(
                f"{_API}: expert_axis {expert_axis!r} must be an axis of {mesh} other than the "
                f"tensor axis {axis!r}; name one of {[a for a in mesh.axis_names if a != axis]}."
            )
        expert = (expert_axis, mesh.shape[expert_axis])
    if not isinstance(sequence_parallel, bool):
        raise TypeError(f"{_API}: sequence_parallel must be True or False, got {sequence_parallel!r}.")
    modules = dict(model.named_modules())
    params = {name: p.detach() for name, p in model.named_parameters()}
    sp_norms = _sequence_norms(model) if sequence_parallel else None
    layers, rules = resolve(model, modules, params, plan, n, experts=expert is not None, extra=sp_norms)
    for name, layer in layers.items():
        check_layer(name, modules[name], layer, rules)
    if expert is not None and not any(layer.kind == "ep_experts" for layer in layers.values()):
        raise ValueError(
            f"{_API}: expert_axis={expert[0]!r}, but no module of {type(model).__name__} is "
            f"'ep_dispatch_experts' in its plan (a model whose layers are all dense: no experts to "
            f"split); leave expert_axis=None."
        )
    found = layouts(model, modules, layers, rules, axis, n, expert)
    specs, sources, tied = {}, {}, {}
    for name in params:
        spec, dim, segments = found[name]
        specs[name] = spec
        if segments is None:
            continue
        index, rows, group = layout_index(segments, n)
        if index is not None:
            params[name] = params[name].index_select(dim, index.to(params[name].device))
            sources[name] = (dim, index)
        if rows is not None:
            tied[name] = (dim, rows, n // group, group)
    # In-process the devices are a vmap, which a data-dependent expert loop cannot run under:
    # there the experts run transformers' batched_mm.  A real mesh keeps the model's own.
    own_experts = mesh.backend == "dist" and not mesh.abstract
    local = _local_copy(model, modules, layers, rules, n, axis, expert, own_experts)
    buffers = {name: b.detach() for name, b in local.named_buffers()}
    run = _stateless(local, frozenset(params), buffers)
    fn = TensorParallelFn(run, local, axis, n, layers, sources, tied, frozenset(params))
    fn._blocks = {
        name: (tuple(t.shape), block_shape(specs[name], t.shape, mesh.shape)) for name, t in params.items()
    }
    if expert is not None:
        fn.expert_axis = expert[0]
        fn.experts = {name: spec for name, spec in specs.items() if expert[0] in spec.axes()}
    return fn, params, specs


class TensorParallelFn:
    """The per-device function of ``tensor_parallel``: ``apply_fn(params, *args, **kwargs)``.

    Attributes:
      module: the private local copy whose forward runs on this device's blocks.
      axis: the tensor-parallel mesh axis; ``n`` its size.
      plan: ``{module name: kind}`` of every non-replicated layer.
      regrouped: ``{parameter name: dim}`` of the fused weights whose rows (columns of a
        ``Conv1D``) ``params`` holds regrouped per device (GPT-2's ``c_attn``, Phi-3's fused ones).
      replicated: ``{parameter name: replicas}`` of the kv weights whose heads ``params`` holds
        repeated (fewer kv heads than tensor devices).
      expert_axis: the axis the experts are split over (``expert_axis=``), or ``None``;
        ``experts``: ``{parameter name: spec}`` of the expert weights split over it.
    """

    expert_axis: str | None = None
    experts: Mapping[str, Any] = {}
    _blocks: Mapping[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}

    def __init__(
        self,
        run: Callable,
        module: nn.Module,
        axis: str,
        n: int,
        layers: dict,
        sources: dict,
        tied: dict,
        names,
    ):
        self._run, self.module, self.axis, self.n = run, module, axis, n
        self.plan = {name: layer.kind for name, layer in layers.items() if layer.kind != "replicate"}
        self.regrouped = {
            name: dim for name, (dim, index) in sources.items() if index.numel() == len(set(index.tolist()))
        }
        self.replicated = {name: group for name, (_, _, _, group) in tied.items()}
        self._sources, self._tied = sources, tied
        self._names_of_params = frozenset(names)
        self._names = {id(m): name for name, m in module.named_modules()}
        self.__name__ = f"{type(module).__name__}_tensor_parallel"

    def __call__(self, params: Mapping[str, Tensor], *args: Any, **kwargs: Any) -> Any:
        if isinstance(params, Mapping):
            self._check_blocks(params)
        if self._tied and isinstance(params, Mapping):
            params = dict(params)
            for name, (dim, rows, kv, group) in self._tied.items():
                if name in params:
                    params[name] = tl.tie_replicas(params[name], self.axis, dim, rows, kv, group)
        try:
            return self._run(params, *args, **kwargs)
        except RuntimeError as e:
            better = self.explain(e)
            if better is None:
                raise
            raise better from e

    def _check_blocks(self, params: Mapping[str, Tensor]) -> None:
        # Each device's block, before the forward: on a real mesh fpar.shard passes each process
        # what it is given, and a whole tensor of a Linear stack would run (with a sum over the
        # axis too many) rather than fail.
        for name, t in params.items():
            shapes = self._blocks.get(name)
            if shapes is None or not isinstance(t, Tensor) or t.shape == shapes[1]:
                continue
            whole, block = shapes
            hint = (
                "the whole tensor: on a real mesh fpar.shard passes each process the value it is "
                "given, so put the global tensors with fpar.device_put(params, mesh, specs) first "
                "(in one process device_put returns them as they are)"
                if t.shape == whole
                else f"neither this device's block {block} nor the whole tensor {whole}: pass the blocks "
                f"fpar.device_put(params, mesh, specs) makes of the global tensors, once"
            )
            raise ValueError(f"{_API}: params[{name!r}] has shape {tuple(t.shape)}, {hint}.")

    def explain(self, e: RuntimeError) -> ValueError | None:
        """The error to raise for ``e``, raised by a module of the model on this device's blocks.

        A shape error in a module's forward (a global head count in a ``view``) or a value tested in
        Python becomes a ``ValueError`` naming the module and the fix; ``None`` for anything else.
        ``fpar.hf.pipeline_stages``' stages, which run the same modules, explain their errors so too.
        """
        where = _failing_module(e, self._names)
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        if where is None:
            return None
        name, module = where
        head = f"{_API}: the forward of {name or '<root>'!r} ({type(module).__name__})"
        if "data-dependent control flow" in first:
            return ValueError(
                f"{head} tests a tensor's values in Python, which fpar.shard's vmap levels cannot: "
                f"{first} Hugging Face's attention-mask helpers do this with a 2-D padding mask: "
                f"pass the mask already in 4-D additive form [B, 1, T or 1, S] (0 where attended, "
                f"torch.finfo(dtype).min elsewhere; add the causal triangle for a decoder)."
            )
        if not any(word in first for word in _SHAPE_WORDS):
            return None
        return ValueError(
            f"{head} failed on this device's blocks ({self.n}-way split over {self.axis!r}): {first} "
            f"Its forward probably reshapes with a global size: use -1 for the head count in "
            f"view/reshape, or keep the count in an attribute named one of {list(QUERY_ATTRS + KV_ATTRS)} "
            f"(which tensor_parallel sets to per-device counts), or mark its layers 'replicate' in the plan."
        )

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
                    dim, inverse(index).to(out[prefix + name].device)
                )
        return out


def _failing_module(error: BaseException, names: dict[int, str]) -> tuple[str, nn.Module] | None:
    """The innermost module of the local copy whose forward is on the error's traceback."""
    found, tb = None, error.__traceback__
    while tb is not None:
        obj = tb.tb_frame.f_locals.get("self")
        if isinstance(obj, nn.Module) and id(obj) in names:
            found = (names[id(obj)], obj)
        tb = tb.tb_next
    return found
