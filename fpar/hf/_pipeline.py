"""A Hugging Face decoder cut into pipeline stages where its ``base_model_pp_plan`` says.

``base_model_pp_plan`` names the base model's pieces in order; one of them is the decoder layers
(a ``ModuleList``).  ``pipeline_stages`` turns a tensor-parallel model (``from_pretrained`` /
``tensor_parallel``) into the three functions ``fpar.pipeline.pipeline`` runs: ``first`` (what
comes before the layers, on stage 0), ``stage`` (a chunk of consecutive decoder layers) and
``loss`` (what comes after them, the head and the next-token cross-entropy, on the last stage).
Each is an ``fpar.shard`` over the mesh's other axes, so each stage is tensor (and data)
parallel inside.

Each piece runs **the model's own forward**, not a rebuilt copy of it: a *shell* of the model
shares every module but has its decoder-layer list replaced by slots.  ``first`` runs the forward
up to a slot standing where layer 0 stands, which ends it with the hidden state it receives; a
chunk runs it with a slot that feeds in the received hidden state, the chunk's layers (each the
model's layer module with its row of the stacked weights) and a slot that ends it; ``loss`` runs
it with a slot that feeds in the hidden state, through the final norm and the causal LM's head to
the logits.  So whatever the model's forward does between the pieces (embedding multipliers,
logit scales and soft-caps, masks for each kind of layer, rotary embeddings) is done as the model
does it; the chunk's placeholder input embeddings are zeros and discarded.

Chunks are stacked: ``params["stages"][name]`` is ``[p * v, K, ...]`` (``K`` layers per chunk) in
stage-major order (``fpar.pipeline.stage_major``), split over the pipe axis.  Layers whose
parameters differ are cut by their pattern (``_cut``): the layers that repeat a *unit* of ``U``
consecutive layers are stacked unit by unit (``params["stages"]["{j}.{name}"]`` is the unit's
``j``-th layer's, when ``U > 1``), and the layers before the repetition (DeepSeek's dense first
layers) run with the embedding in ``first``, those after it (a partial unit) with the head in
``last``.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from .._collectives import pmean
from .._global import device_put, gather
from .._mesh import Mesh
from .._shard import shard
from .._spec import PartitionSpec as P
from ..ops._megatron import vocab_cross_entropy
from ..pipeline._layout import model_major, stage_major
from ._shell import _after_layers, _last_only, _parameters, _reached, _Shell, _Start, _Step, _Stop

__all__ = ["Stages", "pipeline_stages"]

Tensor = torch.Tensor
_API = "fpar.hf.pipeline_stages"


# config fields that count a model's decoder layers (the first that equals their number is the one)
_LAYER_COUNTS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers")


def pipeline_stages(
    apply_fn, specs: Mapping[str, P], mesh: Mesh, *, pipe: str = "pipe", chunks: int = 1
) -> Stages:
    """Cut a tensor-parallel Hugging Face causal LM into pipeline stages by its ``base_model_pp_plan``.

    The layers are split into ``p * chunks`` chunks of equal length (``p`` = the pipe axis' size),
    chunk ``k`` on stage ``k % p``; the embedding runs before chunk 0 and the final norm, head
    and loss after the last, each as the model's own forward code runs it (its scalings and
    soft-caps included).  Layers whose parameters differ in name or shape are cut by their
    pattern: where the layers repeat a unit of a few kinds (MiniMax's linear and full attention
    layers, OLMo-Hybrid's three linear to one full), each chunk holds whole units; layers before
    the repetition (the dense first layers of DeepSeek-style MoE models) run on stage 0 with the
    embedding (in ``"first"``), and a partial unit after it on the last stage with the head (in
    ``"last"``); ``.lead``, ``.unit`` and ``.trail`` say how many.  ``.stage`` is a list of one
    function per chunk (each runs its own layers' modules: their buffers and attributes, such as
    an attention kind or a decay by depth, with their weights), which ``fpar.pipeline.pipeline``
    takes as it is.  The loss is the mean next-token cross-entropy over the microbatch's tokens (``targets`` are the next ids), averaged (``pmean``) over the mesh axes
    other than ``pipe`` and the tensor axis, which split the batch rows.

    A module with parameters that the plan's pieces leave out, registered after the decoder layers
    (DeepSeek-V4's and HY-V4's hyper-connection head, which merges the residual streams before the
    norm), is held by the last stage and runs there as the model's forward runs it; one the forward
    runs before the layers is refused when it runs.  A stage's hidden state may have more dims than
    the embedding's output (hyper-connections' streams).

    A sequence-parallel model (its norms ``sequence_parallel`` in the plan) is cut so too: chunk 0
    takes the whole sequence and cuts it at its first layer, every chunk sends its sequence block
    on, and the head gathers it.

    Tied input and output embeddings (Llama 3.2, Qwen3's small sizes, Gemma) are held once, in
    ``"first"`` under the embedding's name (``first`` and ``last`` are on every stage: replicated
    over the pipe axis); ``.loss`` takes it too and carries the pair as ``.tied``, so
    ``fpar.pipeline.pipeline`` passes it to the loss and returns one gradient, the sum of both
    uses, as the unpipelined tied model's (one optimizer state, counted once by a global norm).

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
      ValueError: no ``base_model_pp_plan``, or one that names not exactly one layer list; a ``pipe``
        axis missing or the tensor axis; layers (or units of layers) that do not divide into
        ``p * chunks`` chunks; layers whose parameters differ with no repeating pattern; parameters
        in none of the plan's pieces registered before the layers (they are named); decoder layers
        that take ``input_ids`` (DeepSeek-V4's hash routing).  At the first forward: layers whose
        output the model's forward takes apart (state for the next layer: GLM-DSA's, HY-V4's top-k
        indices), a module held by the last stage that runs before the layers.

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
        if not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"{_API}: chunks must be a positive int, got {chunks!r}.")
        self._find_pieces(module, type(module).__name__, specs)
        self.k = self._units // (self.p * chunks)  # units per chunk
        self._data = tuple(a for a in mesh.axis_names if a not in (pipe, self.axis))
        self._split_logits = apply_fn.plan.get(self._head_name) in ("vocab", "colwise")
        self._explain = getattr(apply_fn, "explain", lambda e: None)
        # sequence parallelism: from the first layer on, stages send sequence blocks
        self._sp = apply_fn.n if "sequence_parallel" in apply_fn.plan.values() else 0
        self._build_specs(specs)
        self._build_fns(module)

    # The pieces -----------------------------------------------------------------------------

    def _find_pieces(self, module: torch.nn.Module, cls: str, specs: Mapping[str, P]) -> None:
        """The layers, and which parameters run before them (stage 0) and after them (the last stage).

        Only the decoder layers' list is taken from the plan's pieces: everything else the model's
        forward does (embedding multipliers, norms, logit scales and soft-caps, masks, rotary
        embeddings) runs as the model's own forward code, so nothing between the pieces is dropped.
        """
        config: Any = module.config
        if not getattr(config, "base_model_pp_plan", None):
            raise ValueError(
                f"{_API}: {cls} has no base_model_pp_plan (its config class names no pipeline pieces); "
                f"write the stages by hand with fpar.pipeline.pipeline (docs/layouts/pipelines.md)."
            )
        base, layers_attr = decoder_layers(module, _API)
        names = list(config.base_model_pp_plan)
        head = module.get_output_embeddings()
        embed = module.get_input_embeddings()
        if head is None:
            raise ValueError(f"{_API}: {cls} has no output embeddings (get_output_embeddings() is None).")
        dotted = {id(m): n for n, m in module.named_modules()}
        # Tied input and output embeddings: held once, in first; the pipeline passes it to the loss
        # too and sums the two uses' gradients (``Stages.tied``).
        tied_key = f"{dotted[id(embed)]}.weight".lstrip(".") if head.weight is embed.weight else None
        if tied_key is not None and tied_key not in specs:
            raise ValueError(
                f"{_API}: {cls}'s tied embedding {tied_key!r} is not among the model's parameters."
            )
        self.tied: tuple[tuple[str, str], ...] = () if tied_key is None else ((tied_key, tied_key),)
        self._module, self._base, self._layers_attr = module, base, layers_attr
        self._layers = getattr(base, layers_attr)
        self._layers_name = dotted[id(self._layers)]
        self._head_name = dotted[id(head)]
        before = [getattr(base, n) for n in names[: names.index(layers_attr)]]
        after = [getattr(base, n) for n in names[names.index(layers_attr) + 1 :]]
        # Modules with parameters that the plan's pieces leave out but that are registered after
        # the decoder layers (DeepSeek-V4's and HY-V4's hyper-connection head, which merges the
        # residual streams before the norm): the last stage holds them, and the model's own forward
        # runs them there.  One that the forward runs before the layers is refused when it runs.
        self._after_pieces = _after_layers(module, base, layers_attr, [*before, *after, head])
        after += [*self._after_pieces.values(), head]

        def own(ms: list) -> list[str]:
            return [f"{dotted[id(m)]}.{k}".lstrip(".") for m in ms for k, _ in m.named_parameters()]

        self._first_keys, self._last_keys = own(before), own(after)
        if tied_key is not None:  # the head's weight is the embedding's: the loss takes it under that name
            head_key = f"{dotted[id(head)]}.weight".lstrip(".")
            self._last_keys = [tied_key if k == head_key else k for k in self._last_keys]
        layer_keys = {
            f"{self._layers_name}.{i}.{k}"
            for i, m in enumerate(self._layers)
            for k, _ in m.named_parameters()
        }
        left = sorted(set(specs) - set(self._first_keys) - set(self._last_keys) - layer_keys)
        if left:
            raise ValueError(
                f"{_API}: {cls}'s parameters {left[:4]} belong to none of its pp plan's pieces {names} nor "
                f"the output head, so no stage would hold them; this model cannot be cut by its pp plan."
            )
        reads_ids = sorted({type(m).__name__ for m in self._layers if "input_ids" in _parameters(m.forward)})
        if reads_ids:
            raise ValueError(
                f"{_API}: {cls}'s decoder layers ({', '.join(reads_ids)}) take the token ids (input_ids=: "
                f"DeepSeek-V4's hash-routed experts pick them by token), but a pipeline stage receives only "
                f"the hidden state from the one before it; this model cannot be cut by its pp plan."
            )
        self.lead, self.unit, self.trail = _cut(
            layer_kinds(self._layers), self.p, self.v, cls, self._layers_name
        )
        self._units = (len(self._layers) - self.lead - self.trail) // self.unit
        n = len(self._layers)
        self._first_keys += self._keys_of(range(self.lead))
        self._last_keys = self._keys_of(range(n - self.trail, n)) + self._last_keys
        # the config's lists of one entry a layer (layer_types, layer_rope_theta, mlp_layer_types, ...),
        # which the model's forward reads by a layer's position: a shell's are its slots' layers'
        self._per_layer = {
            k: v
            for k, v in vars(config).items()
            if isinstance(v, (list, tuple)) and len(v) == n and ("layer" in k or k.endswith("_types"))
        }

    def _keys_of(self, layers: range) -> list[str]:
        """The flat parameter names of decoder layers ``layers``."""
        return [f"{self._layers_name}.{i}.{k}" for i in layers for k, _ in self._layers[i].named_parameters()]

    def _slots(self) -> list[tuple[str, int, str]]:
        """``(stacked name, position in the unit, the layer's own name)`` of each stacked leaf."""
        out = []
        for j in range(self.unit):
            for k, _ in self._layers[self.lead + j].named_parameters():
                out.append((k if self.unit == 1 else f"{j}.{k}", j, k))
        return out

    def _build_specs(self, specs: Mapping[str, P]) -> None:
        self._layer_specs = {
            key: specs[f"{self._layers_name}.{self.lead + j}.{k}"] for key, j, k in self._slots()
        }
        self.first_specs = {k: specs[k] for k in self._first_keys}
        self.last_specs = {k: specs[k] for k in self._last_keys}
        chunk = {k: P(None, *s) for k, s in self._layer_specs.items()}
        self.chunk_specs = chunk
        tied = {b for _, b in self.tied}
        self.specs = {
            "stages": {k: P(self.pipe, *s) for k, s in chunk.items()},
            "first": self.first_specs,
            "last": {k: s for k, s in self.last_specs.items() if k not in tied},  # held in first
        }

    def _build_fns(self, module: torch.nn.Module) -> None:
        sub = self.mesh.submesh(tuple(a for a in self.mesh.axis_names if a != self.pipe))
        rows = P(self._data) if self._data else P()
        n_chunks, layers, lead, unit = self.p * self.v, self._layers, self.lead, self.unit
        n, k = len(layers), self.k * unit  # k: layers per chunk
        body = range(lead, n - self.trail)  # the stacked layers
        tail = range(n - self.trail, n)
        first_shell = self._shell(
            [*(_Step(layers[i]) for i in range(lead)), _Stop(layers[min(lead, n - 1)])], [*range(lead), lead]
        )
        last_at = tail[0] if self.trail else n - 1
        last_shell = self._shell(
            [_Start(layers[last_at]), *(_Step(layers[i]) for i in tail)], [last_at, *tail]
        )
        prefix = f"{self._layers_name}."

        def own_layers(w, at: range) -> tuple[dict, list[dict]]:
            """``w`` without the layers ``at``'s weights, and those weights, a dict a layer."""
            names = [f"{prefix}{i}." for i in at]
            rest = {key: x for key, x in w.items() if not any(key.startswith(m) for m in names)}
            return rest, [{key[len(m) :]: x for key, x in w.items() if key.startswith(m)} for m in names]

        def first(w, ids_BT):
            rest, steps = own_layers(w, range(lead))
            hidden = first_shell.run(rest, {"input_ids": ids_BT, "use_cache": False}, weights=steps)
            return _reached(hidden, f"its decoder layer {lead}")

        def inputs_like(h_BTD: Tensor, whole: bool = False) -> Tensor:
            """Zeros of the embedding's shape over the whole sequence, for the model's own masks.

            A stage's hidden state may have more dims (hyper-connections' streams) than the embedding.
            """
            t = h_BTD.shape[1] if not self._sp or whole else h_BTD.shape[1] * self._sp
            return h_BTD.new_zeros(h_BTD.shape[0], t, h_BTD.shape[-1])

        slots = self._slots()
        whole0 = lead == 0  # chunk 0 takes the whole sequence under SP (its first layer cuts it)

        def make_chunk(c: int):
            at = body[c * k : c * k + k]
            after = min(at[-1] + 1, n - 1)
            shell = self._shell(
                [_Start(layers[at[0]]), *(_Step(layers[i]) for i in at), _Stop(layers[after])],
                [at[0], *at, after],
            )

            def chunk(w, h_BTD):
                steps: list[dict] = [{} for _ in at]
                for key, j, name in slots:
                    for u in range(self.k):
                        steps[u * unit + j][name] = w[key][u]
                kwargs = {"inputs_embeds": inputs_like(h_BTD, whole=c == 0 and whole0), "use_cache": False}
                return _reached(shell.run({}, kwargs, h_BTD, steps), f"the end of chunk {c}'s layers")

            return chunk

        def last(w, h_BTD, targets_BT):
            whole = inputs_like(h_BTD)
            rest, steps = own_layers(w, tail)
            out = last_shell.run(rest, {"inputs_embeds": whole, "use_cache": False}, h_BTD, steps)
            logits = out.logits if hasattr(out, "logits") else out[0]
            if logits.shape[:2] != whole.shape[:2]:
                raise RuntimeError(
                    f"{_API}: the model's forward gave logits of shape {tuple(logits.shape)} for a hidden state "
                    f"of shape {tuple(h_BTD.shape)}; its head cannot run as the last pipeline stage."
                )
            if self._split_logits:
                tok = vocab_cross_entropy(logits, targets_BT, axis=self.axis)
            else:
                wide = logits.to(torch.promote_types(logits.dtype, torch.float32))  # float64 stays float64
                tok = F.cross_entropy(wide.flatten(0, 1), targets_BT.flatten(), reduction="none")
            return pmean(tok.mean(), self._data) if self._data else tok.mean()

        # One function a chunk, each running its own layers' modules: a layer's module may hold more
        # than its parameters (MiniMax's linear attention keeps a decay by its layer's depth as a
        # buffer; Gemma's layers their attention kind), so one chunk's modules cannot run another's
        # weights.  Under sequence parallelism chunk 0 takes the whole sequence (its first layer
        # cuts it) and every chunk sends its block on.
        block = P(self._data or None, self.axis) if self._sp else rows

        def wrap(c: int):
            return shard(make_chunk(c), sub, (self.chunk_specs, rows if c == 0 and whole0 else block), block)

        for name, m in self._after_pieces.items():
            if "_fpar_last_only" not in m.__dict__:  # once a module, however many times it is cut
                m.__dict__["_fpar_last_only"] = m.register_forward_pre_hook(
                    functools.partial(_last_only, f"{type(module).__name__}'s {name!r}")
                )
        self.stage = [wrap(c) for c in range(n_chunks)]
        self.first = shard(first, sub, (self.first_specs, rows), rows if whole0 else block)
        self.loss = shard(last, sub, (self.last_specs, block, rows), P())
        self.loss.tied = self.tied  # type: ignore[attr-defined]  # read by fpar.pipeline.pipeline

    def _shell(self, slots: list, at: list[int]) -> _Shell:
        """The model with its decoder layers replaced by ``slots``, sharing every other module.

        Its config is a copy that counts ``len(slots)`` layers, whose lists of one entry a layer
        (kinds, rotary bases, ...) are those of the model's layers ``at`` (slot ``i`` stands where
        layer ``at[i]`` stands).
        """
        config: Any = copy.copy(self._base.config)
        # the count of decoder layers the forward loops over: num_hidden_layers, or the field that
        # counts the model's layers where that one counts sublayers (LongCat-Flash: num_layers, its
        # num_hidden_layers twice that)
        counts = [k for k in _LAYER_COUNTS if getattr(config, k, None) == len(self._layers)]
        for key in counts or ["num_hidden_layers"]:
            setattr(config, key, len(slots))
        for key, values in self._per_layer.items():
            setattr(config, key, type(values)(values[i] for i in at))
        base = copy.copy(self._base)
        base._modules = dict(self._base._modules)
        base._modules[self._layers_attr] = torch.nn.ModuleList(slots)
        base.config = config
        if self._base is self._module:
            return _Shell(base, slots, self._explain)
        outer = copy.copy(self._module)
        outer._modules = {n: (base if m is self._base else m) for n, m in self._module._modules.items()}
        return _Shell(outer, slots, self._explain)

    # Between from_pretrained's params and the pipeline's -------------------------------------------

    def split(self, params: Mapping[str, Tensor]) -> dict:
        """``{"stages", "first", "last"}`` from the flat params (this process's blocks on a real mesh).

        On a real mesh each process keeps the rows of its own stage's chunks.
        """
        at = lambda u, j: self.lead + u * self.unit + j  # noqa: E731  (unit u's j-th layer)
        stacked = {
            key: torch.stack(
                [params[f"{self._layers_name}.{at(u, j)}.{k}"] for u in range(self._units)]
            ).unflatten(0, (-1, self.k))
            for key, j, k in self._slots()
        }
        stacked = stage_major(stacked, self.p, self.v)
        if self.mesh.backend != "local":
            stacked = device_put(stacked, self.mesh, P(self.pipe))
        return {
            "stages": stacked,
            "first": {k: params[k] for k in self.first_specs},
            "last": {k: params[k] for k in self.specs["last"]},  # a tied weight: in first only
        }

    def merge(self, pipelined: Mapping) -> dict[str, Tensor]:
        """The flat params (``save_pretrained``'s form) from the pipeline's (or its gradients)."""
        stacked = pipelined["stages"]
        if self.mesh.backend != "local":
            stacked = gather(stacked, self.mesh, P(self.pipe))
        stacked = model_major(stacked, self.p, self.v)
        out = {**pipelined["first"]}
        for key, j, k in self._slots():
            for u, layer in enumerate(stacked[key].flatten(0, 1)):
                out[f"{self._layers_name}.{self.lead + u * self.unit + j}.{k}"] = layer
        out.update(pipelined["last"])
        return out


def decoder_layers(module: torch.nn.Module, api: str) -> tuple[torch.nn.Module, str]:
    """The base model and the name of its decoder layers' ``ModuleList``.

    The one list its config's ``base_model_pp_plan`` names; without a plan, the base model's one
    ``ModuleList`` child.
    """
    cls = type(module).__name__
    prefix = getattr(module, "base_model_prefix", "")
    base = getattr(module, prefix, None) if prefix else None
    base = base if isinstance(base, torch.nn.Module) else module
    plan = getattr(getattr(module, "config", None), "base_model_pp_plan", None)
    if plan:
        names = list(plan)
        lists = [n for n in names if isinstance(getattr(base, n, None), torch.nn.ModuleList)]
        if len(lists) != 1:
            raise ValueError(
                f"{api}: {cls}'s base_model_pp_plan {names} does not name exactly one list of decoder layers."
            )
        return base, lists[0]
    lists = [n for n, m in base.named_children() if isinstance(m, torch.nn.ModuleList)]
    if len(lists) != 1:
        raise ValueError(
            f"{api}: {cls} has no base_model_pp_plan and {len(lists)} ModuleList children of "
            f"{type(base).__name__} ({lists}), not one: which are its decoder layers is not known."
        )
    return base, lists[0]


def layer_kinds(layers: torch.nn.ModuleList) -> list[int]:
    """Each layer's kind: the index of the first layer whose parameters have its names and shapes."""
    shapes = [tuple((k, tuple(t.shape)) for k, t in m.named_parameters()) for m in layers]
    first = {sig: i for i, sig in reversed(list(enumerate(shapes)))}
    return [first[sig] for sig in shapes]


def _cut(kinds: list[int], p: int, v: int, cls: str, layers: str) -> tuple[int, int, int]:
    """``(lead, unit, trail)``: how layers of kinds ``kinds`` stack into ``p`` stages x ``v`` chunks.

    The stacked body repeats a unit of ``unit`` consecutive layers as often as it can (it could
    not start a unit earlier nor end one later); the ``lead`` layers before it and the ``trail``
    after it are left out.  Of the cuts whose count of units ``p * v`` divides: the one that leaves
    the fewest layers out, then the shortest unit, then the fewest before it.  A uniform model is
    ``(0, 1, 0)``.
    """
    n, chunks = len(kinds), p * v
    fits: list[tuple[int, int, int]] = []
    others: list[tuple[int, int, int]] = []  # (lead, unit, units) that ``chunks`` does not divide
    for unit in range(1, n + 1):
        for lead in range(n - unit + 1):
            pattern = kinds[lead : lead + unit]
            if lead >= unit and kinds[lead - unit : lead] == pattern:
                continue  # the body could start a unit earlier
            units = 1
            while kinds[lead + units * unit : lead + (units + 1) * unit] == pattern:
                units += 1
            (others if units % chunks else fits).append((lead, unit, units))
    out = lambda c: n - c[1] * c[2]  # noqa: E731  (the layers a cut leaves out)
    if fits:
        lead, unit, units = min(fits, key=lambda c: (out(c), c[1], c[0]))
        return lead, unit, n - lead - unit * units
    if len(set(kinds)) == 1:
        raise ValueError(
            f"{_API}: {n} decoder layers do not divide into {p} stages x {v} chunks; "
            f"choose a pipe size and chunks whose product divides {n}."
        )
    lead, unit, units = min(others, key=lambda c: (-c[2], out(c), c[1]))  # the most units
    letters = "".join(chr(ord("A") + sorted(set(kinds)).index(x)) for x in kinds)
    raise ValueError(
        f"{_API}: {cls}'s decoder layers ({layers}, one letter a layer, a letter a parameter layout: "
        f"{letters}) do not cut into {p} stages x {v} chunks of whole repeating units: at "
        f"best layers {lead} to {lead + unit * units - 1} repeat a unit of {unit} layer(s) {units} "
        f"times, which {p} x {v} chunks do not divide. Choose a pipe size and chunks whose product "
        f"divides {units}."
    )
