"""``fpar.hf.from_pretrained``: a checkpoint directory onto a mesh, each process reading its blocks.

The model is built on the ``meta`` device from its config (no memory), made tensor parallel by
``fpar.ops.tensor_parallel`` (which gives every parameter's global shape and spec), and then
each parameter's block is read from the safetensors files: on a real mesh only this process's
block (``fpar.device_put``'s block, as a contiguous tensor), in-process the global tensor.  A
fused weight that ``tensor_parallel`` regroups, or a kv weight whose heads it replicates, is
read as the runs of stored rows its ``apply_fn.source`` names.  Buffers the model needs
(rotary ``inv_freq``) are loaded when the checkpoint holds them and recomputed by the model's
own ``_init_weights`` otherwise: none is left on ``meta``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from .._mesh import Mesh
from ..ops._tensor_parallel import tensor_parallel
from ._convert import Entry, entries
from ._files import Checkpoint, CheckpointFormatError
from ._layout import block_ranges, source

__all__ = ["from_pretrained"]

Tensor = torch.Tensor
_API = "fpar.hf.from_pretrained"
_FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


# API ----------------------------------------------------------------------------------------


def from_pretrained(
    path: str | os.PathLike,
    mesh: Mesh,
    *,
    axis: str = "tensor",
    plan: Any = "auto",
    dtype=None,
    expert_axis: str | None = None,
    sequence_parallel: bool = False,
) -> tuple:
    """Load a Hugging Face causal LM checkpoint onto ``mesh``, tensor parallel, shard by shard.

    Each process reads only its own block of each tensor (``safetensors`` slices); the whole
    model never exists in one process.  Peak host memory per process: its blocks, plus at most
    one whole tensor's pages while that tensor is read, plus the interpreter.

    Args:
      path: a local directory as ``save_pretrained`` writes it (``transformers``' or
        ``fpar.hf.save_pretrained``): ``config.json`` and ``model.safetensors``, or shards named
        by ``model.safetensors.index.json``.
      mesh: the mesh, from ``fpar.make_mesh``; on a real mesh every process calls this.
      axis: the tensor-parallel mesh axis (as ``fpar.ops.tensor_parallel``).
      plan: ``"auto"`` (the model's own Hugging Face plan) or a plan dict, as ``tensor_parallel``.
      dtype: the floating dtype of the parameters (each tensor is cast as it is read); ``None``:
        the config's ``dtype``, else the checkpoint's.  Modules the model keeps in float32 stay so.
      expert_axis: a mixture-of-experts model's experts split over this mesh axis (expert
        parallelism from the model's ``base_model_ep_plan``, as ``tensor_parallel``): each process
        reads only its own experts.
      sequence_parallel: Megatron sequence parallelism over ``axis`` (as ``tensor_parallel``).

    Returns:
      ``(apply_fn, params, specs)`` as ``fpar.ops.tensor_parallel``: in-process ``params`` are the
      global tensors; on a real mesh this process's blocks, as ``fpar.device_put(params, mesh,
      specs)`` would give them, ready for ``fpar.shard(..., in_specs=(specs, ...))``.

    Raises:
      TypeError: ``mesh`` is not a ``fpar.Mesh``, ``dtype`` not a ``torch.dtype``.
      ValueError: an unknown axis; ``dtype`` not floating; a directory not of this form, a shard
        the index names missing or not holding its tensors, a tensor the model needs missing
        from the checkpoint, of another shape than the config's model, or stored in a dtype that
        cannot be cast (all before any tensor is read); what ``tensor_parallel`` refuses.

    Example:
      >>> mesh = fpar.make_mesh((2, 2), ("data", "tensor"))
      >>> apply_fn, params, specs = fpar.hf.from_pretrained("qwen3-checkpoint", mesh)
      >>> loss = fpar.shard(lambda p, ids: fpar.pmean(apply_fn(p, ids, labels=ids, use_cache=False).loss,
      ...     "data"), mesh, (specs, P("data")), P())
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"{_API}: mesh must be a fpar.Mesh (from fpar.make_mesh), got {mesh!r}.")
    if not isinstance(axis, str) or axis not in mesh.axis_names:
        raise ValueError(f"{_API}: axis {axis!r} is not an axis of {mesh}; name one of {mesh.axis_names}.")
    _check_dtype(dtype)
    ckpt = Checkpoint(path, _API)
    model = meta_model(ckpt, dtype)
    loads = _plan_loads(model, ckpt)
    _materialize_buffers(model, loads)
    apply_fn, meta_params, specs = tensor_parallel(
        model, mesh, axis=axis, plan=plan, expert_axis=expert_axis, sequence_parallel=sequence_parallel
    )
    params = {}
    for name, meta in meta_params.items():
        params[name] = _read(loads[name], apply_fn, name, meta, specs[name], mesh)
    apply_fn.config = model.config
    return apply_fn, params, specs


# The model on meta ---------------------------------------------------------------------------------


def _check_dtype(dtype) -> None:
    if dtype is None:
        return
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{_API}: dtype must be a torch.dtype (e.g. torch.bfloat16) or None, got {dtype!r}.")
    if dtype not in _FLOATS:
        raise ValueError(
            f"{_API}: dtype {dtype} cannot hold a model's weights; pass one of "
            f"{', '.join(str(d) for d in _FLOATS)} (or None for the checkpoint's)."
        )


def meta_model(ckpt: Checkpoint, dtype) -> nn.Module:
    """The causal LM of ``ckpt``'s config on ``meta``, in ``dtype`` (default: config, then stored)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(ckpt.path)
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointFormatError(
            f"{_API}: {ckpt.path!r}/config.json is not a transformers config ({type(e).__name__}: {e}); "
            f"write it with config.save_pretrained(path)."
        ) from e
    if dtype is None:
        dtype = config.dtype if isinstance(config.dtype, torch.dtype) else _stored_float(ckpt)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def _stored_float(ckpt: Checkpoint) -> torch.dtype:
    counts: dict[torch.dtype, int] = {}
    for name in ckpt.tensors:
        d = ckpt.dtype(name)
        if d in _FLOATS:
            counts[d] = counts.get(d, 0) + 1
    return max(counts, key=counts.get) if counts else torch.float32


def _plan_loads(model: nn.Module, ckpt: Checkpoint) -> dict[str, Entry]:
    """``{model tensor name: where it is stored}`` for parameters and persistent buffers, all checked.

    A tied parameter is found under any of its names (HF writes a tied ``lm_head`` once).
    """
    aliases: dict[int, list[str]] = {}
    tensors: dict[str, Tensor] = {}
    for name, t in (
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ):
        aliases.setdefault(id(t), []).append(name)
        tensors[name] = t
    persistent = set(model.state_dict())
    stored = entries(model, ckpt)
    loads: dict[str, Entry] = {}
    for name, t in tensors.items():
        found = next((a for a in [name, *aliases[id(t)]] if a in stored), None)
        if found is None:
            if isinstance(t, nn.Parameter):
                raise CheckpointFormatError(
                    f"{_API}: {ckpt.path!r} has no tensor {name!r}, which {type(model).__name__} needs "
                    f"(its config.json describes another model than its weights, or a shard is "
                    f"incomplete); save the checkpoint again from the model."
                )
            continue  # a buffer: recomputed below
        if name not in persistent and not isinstance(t, nn.Parameter):
            continue  # a non-persistent buffer an old checkpoint still carries: recomputed
        _check_tensor(stored[found], name, t)
        loads[name] = stored[found]
    return loads


def _check_tensor(entry: Entry, name: str, t: Tensor) -> None:
    where = f"{_API}: {entry.where}"
    if tuple(entry.shape) != tuple(t.shape):
        raise CheckpointFormatError(
            f"{where} has shape {entry.shape}, but the model config.json describes has "
            f"{tuple(t.shape)} for {name!r}: the config and the weights are from different models; "
            f"use the config.json saved with these weights."
        )
    have = entry.dtype
    if have is None or (t.dtype.is_floating_point and not have.is_floating_point):
        shown = have or entry.stored_dtype
        raise CheckpointFormatError(
            f"{where} is stored as {shown}, which cannot be cast to the model's {t.dtype}; convert the "
            f"checkpoint to a floating dtype with transformers first."
        )


def _materialize_buffers(model: nn.Module, loads: dict[str, Entry]) -> None:
    """Every buffer off ``meta``: read from the checkpoint, or recomputed by ``_init_weights``."""
    owners: dict[str, nn.Module] = {}
    for mname, module in model.named_modules():
        for bname, b in list(module._buffers.items()):
            if b is None or not b.is_meta:
                continue
            full = f"{mname}.{bname}" if mname else bname
            if full in loads:
                module._buffers[bname] = loads[full].read([], None).to(b.dtype)
                continue
            fill = float("nan") if b.dtype.is_floating_point else _sentinel(b.dtype)
            module._buffers[bname] = torch.full(b.shape, fill, dtype=b.dtype)
            owners[full] = module
    init = getattr(model, "_init_weights", None)
    with torch.no_grad():
        for module in {id(m): m for m in owners.values()}.values():
            if init is not None:
                init(module)
    for full, module in owners.items():
        b = module._buffers[full.rpartition(".")[2]]
        unset = b.isnan().any() if b.dtype.is_floating_point else (b == _sentinel(b.dtype)).any()
        if b.is_meta or (b.dtype != torch.bool and bool(unset)):
            raise ValueError(
                f"{_API}: the buffer {full!r} of {type(model).__name__} is not in the checkpoint and the "
                f"model's _init_weights does not compute it; save the checkpoint with it (a persistent "
                f"buffer) or load the model with transformers."
            )


def _sentinel(dtype: torch.dtype):
    return False if dtype == torch.bool else torch.iinfo(dtype).min


# Reading blocks ------------------------------------------------------------------------------------


def _read(entry: Entry, apply_fn, name: str, meta: Tensor, spec, mesh: Mesh) -> Tensor:
    """``name``'s global tensor in-process, this process's block on a real mesh, in ``meta.dtype``."""
    hf_shape = tuple(entry.shape)
    rows = source(apply_fn, name, hf_shape)
    want = list(hf_shape)
    if rows is not None:
        want[rows[0]] = len(rows[1])
    if tuple(want) != tuple(meta.shape):
        raise RuntimeError(
            f"{_API}: tensor_parallel holds {name!r} as {tuple(meta.shape)}, but the checkpoint's "
            f"{hf_shape} read through its source gives {tuple(want)}: an inconsistency inside fpar, "
            f"please report it."
        )
    ranges = block_ranges(tuple(meta.shape), spec, mesh)
    if rows is not None:
        dim, index = rows
        start, stop = ranges[dim]
        rows = (dim, index[start:stop])
        ranges[dim] = (0, hf_shape[dim])
    return entry.read(ranges, rows).to(meta.dtype).contiguous()
