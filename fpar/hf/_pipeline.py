"""A Hugging Face decoder cut into pipeline stages where its ``base_model_pp_plan`` says.

``base_model_pp_plan`` names the base model's pieces in order: the token embedding, the decoder
layers (a ``ModuleList``) and the final norm.  ``pipeline_stages`` turns a tensor-parallel model
(``from_pretrained`` / ``tensor_parallel``) into the three functions ``fpar.pipeline.pipeline``
runs: ``first`` (the embedding, on stage 0), ``stage`` (a chunk of consecutive decoder layers)
and ``loss`` (final norm, ``lm_head`` and the next-token cross-entropy, on the last stage).
Each is an ``fpar.shard`` over the mesh's other axes, so each stage is tensor (and data)
parallel inside, with the model's own module code: a layer runs its TP local copy through
``torch.func.functional_call`` with the chunk's parameters, the rotary embeddings and an additive
causal mask made per stage (cheap, and nothing but the hidden state crosses a stage boundary).

Chunks are stacked: ``params["stages"][name]`` is ``[p * v, K, ...]`` (``K`` layers per chunk) in
stage-major order (``fpar.pipeline.stage_major``), split over the pipe axis.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from .._collectives import pmean
from .._global import device_put, gather
from .._mesh import Mesh
from .._shard import shard
from .._spec import PartitionSpec as P
from ..ops._megatron import vocab_cross_entropy
from ..pipeline._layout import model_major, stage_major

__all__ = ["Stages", "pipeline_stages"]

Tensor = torch.Tensor
_API = "fpar.hf.pipeline_stages"


def pipeline_stages(
    apply_fn, specs: Mapping[str, P], mesh: Mesh, *, pipe: str = "pipe", chunks: int = 1
) -> Stages:
    """Cut a tensor-parallel Hugging Face causal LM into pipeline stages by its ``base_model_pp_plan``.

    The layers are split into ``p * chunks`` chunks of equal length (``p`` = the pipe axis' size),
    chunk ``k`` on stage ``k % p``; the embedding runs before chunk 0 and the final norm, head
    and loss after the last.  The loss is the mean next-token cross-entropy over the
    microbatch's tokens (``targets`` are the next ids), averaged (``pmean``) over the mesh axes
    other than ``pipe`` and the tensor axis, which split the batch rows.

    Args:
      apply_fn: from ``fpar.hf.from_pretrained`` or ``fpar.ops.tensor_parallel`` on a mesh that has
        the ``pipe`` axis (so its tensor axis is the same mesh's).
      specs: the ``specs`` that came with it.
      mesh: the whole mesh (``pipe`` x the tensor axis x optional data axes).
      pipe: the pipeline mesh axis.
      chunks: chunks per stage (``v``; 2 or more for ``interleaved_1f1b``).

    Returns:
      A ``Stages``: ``.stage``, ``.first``, ``.loss`` for ``fpar.pipeline.pipeline(stages.stage,
      schedule, mesh, loss=stages.loss, first=stages.first, axis=pipe)``; ``.specs`` of the
      pipeline's params; ``.split(params)`` / ``.merge(pipeline_params)`` between
      ``from_pretrained``'s flat dict and the pipeline's ``{"stages", "first", "last"}``.

    Raises:
      TypeError: ``apply_fn`` is not a tensor-parallel HF model, ``mesh`` not a ``fpar.Mesh``.
      ValueError: no ``base_model_pp_plan``; a ``pipe`` axis missing or the tensor axis; layers
        that do not divide into ``p * chunks`` chunks; layers of different kinds (sliding-window
        and full attention alternating), tied input/output embeddings (they would live on two
        stages), or a final logit soft-cap (not in the plan's pieces).

    Example:
      >>> mesh = fpar.make_mesh((2, 2), ("pipe", "tensor"))
      >>> apply_fn, params, specs = fpar.hf.from_pretrained("llama-checkpoint", mesh)
      >>> stages = fpar.hf.pipeline_stages(apply_fn, specs, mesh)
      >>> step = fpar.pipeline.pipeline(stages.stage, fpar.pipeline.one_f_one_b(2, 4), mesh,
      ...                               loss=stages.loss, first=stages.first)
      >>> result = step(stages.split(params), ids_MBT, targets_MBT)   # loss and gradients
    """
    return Stages(apply_fn, specs, mesh, pipe, chunks)


class Stages:
    """The pipeline pieces of one model; see ``pipeline_stages``."""

    def __init__(self, apply_fn, specs: Mapping[str, P], mesh: Mesh, pipe: str, chunks: int):
        module = getattr(apply_fn, "module", None)
        if not isinstance(module, torch.nn.Module) or not hasattr(module, "config"):
            raise TypeError(
                f"{_API}: apply_fn must come from fpar.hf.from_pretrained or fpar.ops.tensor_parallel of a "
                f"Hugging Face model, got {apply_fn!r}."
            )
        if not isinstance(mesh, Mesh):
            raise TypeError(f"{_API}: mesh must be a fpar.Mesh, got {mesh!r}.")
        for a, what in ((pipe, "pipe"), (apply_fn.axis, "tensor")):
            if a not in mesh.axis_names:
                raise ValueError(f"{_API}: the {what} axis {a!r} is not an axis of {mesh}.")
        self.mesh, self.pipe, self.v, self.axis = mesh, pipe, chunks, apply_fn.axis
        self.p = mesh.shape[pipe]
        self._find_pieces(module, type(module).__name__)
        n_layers = len(self._layers)
        if chunks < 1 or n_layers % (self.p * chunks):
            raise ValueError(
                f"{_API}: {n_layers} decoder layers do not divide into {self.p} stages x {chunks} chunks; "
                f"choose a pipe size and chunks whose product divides {n_layers}."
            )
        self.k = n_layers // (self.p * chunks)
        self._data = tuple(a for a in mesh.axis_names if a not in (pipe, self.axis))
        self._split_logits = apply_fn.plan.get(self._head_name) in ("vocab", "colwise")
        self._build_specs(specs)
        self._build_fns(module)

    # The pieces -----------------------------------------------------------------------------

    def _find_pieces(self, module: torch.nn.Module, cls: str) -> None:
        config = module.config
        plan = getattr(config, "base_model_pp_plan", None)
        if not plan:
            raise ValueError(
                f"{_API}: {cls} has no base_model_pp_plan (its config class names no pipeline pieces); "
                f"write the stages by hand with fpar.pipeline.pipeline (docs/layouts/pipelines.md)."
            )
        prefix = getattr(module, "base_model_prefix", "")
        base = getattr(module, prefix, module) if prefix else module
        names = list(plan)
        lists = [n for n in names if isinstance(getattr(base, n, None), torch.nn.ModuleList)]
        if len(names) != 3 or len(lists) != 1 or names[1] != lists[0]:
            raise ValueError(
                f"{_API}: {cls}'s base_model_pp_plan {names} is not (embedding, layers, norm); only that "
                f"shape of plan is cut into stages."
            )
        kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
        if len(kinds) > 1:
            raise ValueError(
                f"{_API}: {cls}'s layers are of different kinds {sorted(kinds)} (layer_types); a chunk "
                f"function runs one kind of layer. Use a config whose layers are all one kind."
            )
        if getattr(config, "final_logit_softcapping", None):
            raise ValueError(f"{_API}: {cls} soft-caps its logits, which its pp plan's pieces leave out.")
        head = module.get_output_embeddings()
        embed = module.get_input_embeddings()
        if head is None or head.weight is embed.weight:
            raise ValueError(
                f"{_API}: {cls} ties its input and output embeddings, which would live on the first and "
                f"the last stage; load it with config.tie_word_embeddings=False (a copy each)."
            )
        dotted = {id(m): n for n, m in module.named_modules()}
        self._embed, self._norm, self._head = getattr(base, names[0]), getattr(base, names[2]), head
        self._embed_name, self._norm_name = dotted[id(self._embed)], dotted[id(self._norm)]
        self._head_name = dotted[id(head)]
        self._layers = getattr(base, names[1])
        self._layers_name = dotted[id(self._layers)]
        self._rotary = getattr(base, "rotary_emb", None)

    def _build_specs(self, specs: Mapping[str, P]) -> None:
        own = lambda m, name: {f"{name}.{k}": specs[f"{name}.{k}"] for k, _ in m.named_parameters()}  # noqa: E731
        layer0 = f"{self._layers_name}.0."
        self._layer_specs = {k[len(layer0) :]: s for k, s in specs.items() if k.startswith(layer0)}
        self.first_specs = own(self._embed, self._embed_name)
        self.last_specs = {**own(self._norm, self._norm_name), **own(self._head, self._head_name)}
        chunk = {k: P(None, *s) for k, s in self._layer_specs.items()}
        self.chunk_specs = chunk
        self.specs = {
            "stages": {k: P(self.pipe, *s) for k, s in chunk.items()},
            "first": self.first_specs,
            "last": self.last_specs,
        }

    def _build_fns(self, module: torch.nn.Module) -> None:
        sub = self.mesh.submesh(tuple(a for a in self.mesh.axis_names if a != self.pipe))
        rows = P(self._data) if self._data else P()
        template, k = self._layers[0], self.k
        rotary, embed, norm, head = self._rotary, self._embed, self._norm, self._head
        strip = lambda d, name: {key[len(name) + 1 :]: t for key, t in d.items()}  # noqa: E731

        def chunk(w, h_BTD):
            t = h_BTD.shape[1]
            pos = torch.arange(t, device=h_BTD.device).unsqueeze(0)
            extra = {"position_ids": pos, "use_cache": False, "attention_mask": _causal(t, h_BTD)}
            if rotary is not None:
                extra["position_embeddings"] = rotary(h_BTD, pos)
            for i in range(k):
                out = torch.func.functional_call(template, {n: x[i] for n, x in w.items()}, (h_BTD,), extra)
                h_BTD = out[0] if isinstance(out, tuple) else out
            return h_BTD

        def first(w, ids_BT):
            return torch.func.functional_call(embed, strip(w, self._embed_name), (ids_BT,))

        def last(w, h_BTD, targets_BT):
            h_BTD = torch.func.functional_call(
                norm, strip({n: w[n] for n in self._norm_keys}, self._norm_name), (h_BTD,)
            )
            logits = torch.func.functional_call(
                head, strip({n: w[n] for n in self._head_keys}, self._head_name), (h_BTD,)
            )
            if self._split_logits:
                tok = vocab_cross_entropy(logits, targets_BT, axis=self.axis)
            else:
                tok = F.cross_entropy(logits.flatten(0, 1).float(), targets_BT.flatten(), reduction="none")
            return pmean(tok.mean(), self._data) if self._data else tok.mean()

        self._norm_keys = [n for n in self.last_specs if n.startswith(self._norm_name + ".")]
        self._head_keys = [n for n in self.last_specs if n.startswith(self._head_name + ".")]
        self.stage = shard(chunk, sub, (self.chunk_specs, rows), rows)
        self.first = shard(first, sub, (self.first_specs, rows), rows)
        self.loss = shard(last, sub, (self.last_specs, rows, rows), P())

    # Between from_pretrained's params and the pipeline's -------------------------------------------

    def split(self, params: Mapping[str, Tensor]) -> dict:
        """``{"stages", "first", "last"}`` from the flat params (this process's blocks on a real mesh).

        On a real mesh each process keeps the rows of its own stage's chunks.
        """
        n = len(self._layers)
        stacked = {
            k: torch.stack([params[f"{self._layers_name}.{i}.{k}"] for i in range(n)]).unflatten(
                0, (-1, self.k)
            )
            for k in self._layer_specs
        }
        stacked = stage_major(stacked, self.p, self.v)
        if self.mesh.backend != "local":
            stacked = device_put(stacked, self.mesh, P(self.pipe))
        return {
            "stages": stacked,
            "first": {k: params[k] for k in self.first_specs},
            "last": {k: params[k] for k in self.last_specs},
        }

    def merge(self, pipelined: Mapping) -> dict[str, Tensor]:
        """The flat params (``save_pretrained``'s form) from the pipeline's (or its gradients)."""
        stacked = pipelined["stages"]
        if self.mesh.backend != "local":
            stacked = gather(stacked, self.mesh, P(self.pipe))
        stacked = model_major(stacked, self.p, self.v)
        out = {**pipelined["first"]}
        for k, t in stacked.items():
            for i, layer in enumerate(t.flatten(0, 1)):
                out[f"{self._layers_name}.{i}.{k}"] = layer
        out.update(pipelined["last"])
        return out


def _causal(t: int, like: Tensor) -> Tensor:
    """``[1, 1, t, t]``: 0 where a position attends (itself and earlier), the dtype's min elsewhere."""
    upper = torch.ones(t, t, dtype=torch.bool, device=like.device).triu(1)
    return torch.zeros(1, 1, t, t, dtype=like.dtype, device=like.device).masked_fill(
        upper, torch.finfo(like.dtype).min
    )
