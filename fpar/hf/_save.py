"""``fpar.hf.save_pretrained``: a directory ``transformers`` loads, from every process's blocks.

Every tensor has one writer process (the tensors are dealt out by size, largest first, to the
least loaded process) and goes to one of that writer's shard files.  The tensors are taken one
at a time in file order: the processes holding its blocks put it together (an all-gather over
the tensor axis, one tensor at a time), the writer undoes fpar's regrouping or kv replication
(``apply_fn.export``) and keeps it until its file is complete, then writes the file.  No process
ever holds more than its own blocks, one whole tensor and the file it is writing.

Atomic: each file is written under a temporary name and fsynced; when every process has written
its files, process 0 removes the old index, renames the files into place, writes
``config.json`` and then the index (the commit), and removes weight files of an earlier save.
A crash leaves the previous checkpoint or, after the old index is gone, a directory that
``from_pretrained`` refuses, never a mixture.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping

import torch

from .._global import gather
from .._mesh import Mesh
from .._spec import PartitionSpec
from ._files import INDEX, SINGLE
from ._layout import process_index, source, spec_of_block

__all__ = ["save_pretrained"]

Tensor = torch.Tensor
_API = "fpar.hf.save_pretrained"
_TMP = ".fpar-tmp"


def save_pretrained(
    path: str | os.PathLike,
    apply_fn,
    params: Mapping[str, Tensor],
    mesh: Mesh,
    *,
    max_shard_size: int | None = None,
) -> None:
    """Write ``params`` as a Hugging Face checkpoint directory that ``from_pretrained`` loads.

    Tensors get their Hugging Face names and layout back (fused weights un-regrouped, replicated
    kv heads taken once); ``config.json`` is the model's, with ``dtype`` set to the parameters'.
    Each process writes its own shard files, ``model.safetensors.index.json`` lists them all
    (one file and no index where a single process writes everything fitting ``max_shard_size``).
    Files already in ``path`` that are not weights (a tokenizer) are kept.

    Args:
      path: the directory (created if missing); the same on every process.
      apply_fn: from ``fpar.hf.from_pretrained`` or ``fpar.ops.tensor_parallel``.
      params: ``{name: tensor}`` with its names: global tensors in-process, this process's blocks
        on a real mesh (as ``from_pretrained`` returns them, or after training).
      mesh: the mesh the params live on; on a real mesh every process calls this.
      max_shard_size: the most bytes per file (a tensor larger than it gets a file of its own);
        ``None``: one file per writing process.

    Raises:
      TypeError: ``apply_fn`` is not a tensor-parallel function, ``params`` not a dict of tensors,
        ``mesh`` not a ``fpar.Mesh``.
      ValueError: names missing from or foreign to the model, a tensor that is neither the
        global tensor nor this process's block of it (before any communication).

    Example:
      >>> fpar.hf.save_pretrained("finetuned", apply_fn, params, mesh)
      >>> transformers.AutoModelForCausalLM.from_pretrained("finetuned")
    """
    specs, shapes = _check(apply_fn, params, mesh, max_shard_size)
    path = os.fspath(path)
    me, writers = process_index(mesh), (mesh.size if mesh.backend != "local" else 1)
    files = _deal(shapes, params, writers, max_shard_size)
    names = _file_names(len(files))
    if me == 0:
        os.makedirs(path, exist_ok=True)
    _agree(mesh, None)  # the directory exists for every writer
    error = None
    for f, (writer, members) in enumerate(files):
        out: dict[str, Tensor] = {}
        for name in members:
            t = params[name]
            if specs[name].axes():
                t = gather(t.detach(), mesh, specs[name])
            if writer == me and error is None:
                out[name] = apply_fn.export({name: t.detach()})[name].contiguous()
            del t
        if writer == me and error is None:
            try:
                _write(os.path.join(path, names[f] + _TMP), out)
            except Exception as e:  # noqa: BLE001 -- every process must reach _agree, then raise
                error = e
        del out
    _agree(mesh, error)
    if me == 0:
        _commit(path, names, files, apply_fn, params)
    _agree(mesh, None)


# Checks ------------------------------------------------------------------------------------------


def _check(apply_fn, params, mesh, max_shard_size) -> tuple[dict, dict]:
    """Every name's spec (how ``params`` is split) and its Hugging Face shape; errors up front."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"{_API}: mesh must be a fpar.Mesh (from fpar.make_mesh), got {mesh!r}.")
    module = getattr(apply_fn, "module", None)
    if not (callable(getattr(apply_fn, "export", None)) and isinstance(module, torch.nn.Module)):
        raise TypeError(
            f"{_API}: apply_fn must be the function fpar.hf.from_pretrained or fpar.ops.tensor_parallel "
            f"returned (it knows the model's names and layout), got {apply_fn!r}."
        )
    if not isinstance(params, Mapping) or not all(isinstance(v, Tensor) for v in params.values()):
        raise TypeError(
            f"{_API}: params must be the dict of tensors from_pretrained returned, got {type(params)}."
        )
    if max_shard_size is not None and (not isinstance(max_shard_size, int) or max_shard_size <= 0):
        raise ValueError(
            f"{_API}: max_shard_size must be a positive number of bytes, got {max_shard_size!r}."
        )
    model = dict(module.named_parameters())
    missing, extra = sorted(set(model) - set(params)), sorted(set(params) - set(model))
    if missing or extra:
        raise ValueError(
            f"{_API}: params do not match {type(module).__name__}'s parameters: missing {missing[:5]}, "
            f"unexpected {extra[:5]}; pass the params dict from_pretrained / tensor_parallel returned."
        )
    given = getattr(apply_fn, "specs", None)
    specs, shapes = {}, {}
    for name, t in params.items():
        hf_shape = tuple(model[name].shape)
        rows = source(apply_fn, name, hf_shape)
        whole = list(hf_shape)
        if rows is not None:
            whole[rows[0]] = len(rows[1])
        if given is not None:
            spec = given[name]
        elif mesh.backend == "local":
            spec = PartitionSpec()
        elif name in getattr(apply_fn, "experts", {}):  # split over the expert axis, not the tensor one
            spec = apply_fn.experts[name]
        else:
            spec = spec_of_block(name, tuple(t.shape), tuple(whole), apply_fn.axis, apply_fn.n, _API)
        expected = list(whole)
        if mesh.backend != "local":
            for d, entry in enumerate(spec.normalized()):
                for a in entry:
                    expected[d] //= mesh.shape[a]
        if tuple(t.shape) != tuple(expected):
            raise ValueError(
                f"{_API}: params[{name!r}] has shape {tuple(t.shape)}, expected {tuple(expected)} "
                f"({'the global tensor' if mesh.backend == 'local' else 'this process block'} of "
                f"{tuple(whole)}); pass the params from_pretrained / tensor_parallel returned."
            )
        specs[name], shapes[name] = spec, hf_shape
    return specs, shapes


# Files -------------------------------------------------------------------------------------------


def _deal(shapes: dict, params: Mapping, writers: int, max_size: int | None) -> list[tuple[int, list[str]]]:
    """``[(writer, names)]`` per file: tensors dealt by size to the least loaded writer, in order."""
    size = {n: _numel(shapes[n]) * params[n].element_size() for n in shapes}
    load, mine = [0] * writers, [[] for _ in range(writers)]
    for name in sorted(shapes, key=lambda n: -size[n]):
        w = min(range(writers), key=lambda i: (load[i], i))
        load[w] += size[name]
        mine[w].append(name)
    order = {n: i for i, n in enumerate(shapes)}
    files = []
    for w in range(writers):
        current, used = [], 0
        for name in sorted(mine[w], key=order.get):
            if current and max_size is not None and used + size[name] > max_size:
                files.append((w, current))
                current, used = [], 0
            current.append(name)
            used += size[name]
        if current:
            files.append((w, current))
    return files


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _file_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def _write(path: str, tensors: dict[str, Tensor]) -> None:
    from safetensors.torch import save_file

    save_file({k: v.cpu() for k, v in tensors.items()}, path, metadata={"format": "pt"})
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_text(path: str, text: str) -> None:
    tmp = path + _TMP
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _commit(path: str, names: list[str], files: list, apply_fn, params: Mapping) -> None:
    """Process 0: the new files into place, config, then the index; old weight files removed."""
    index = os.path.join(path, INDEX)
    if os.path.exists(index):
        os.remove(index)
    for name in names:
        os.replace(os.path.join(path, name + _TMP), os.path.join(path, name))
    _write_text(os.path.join(path, "config.json"), _config(apply_fn, params).to_json_string())
    if len(names) > 1:
        weight_map = {t: names[f] for f, (_, members) in enumerate(files) for t in members}
        total = sum(_numel(params[t].shape) * params[t].element_size() for t in weight_map)
        _write_text(
            index, json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )
    keep = set(names)
    for f in os.listdir(path):
        if f.endswith(".safetensors") and f.startswith("model") and f not in keep:
            os.remove(os.path.join(path, f))
    from ..checkpoint._io import fsync_dir

    fsync_dir(path)


def _config(apply_fn, params: Mapping):
    """The model's config, with its class and the parameters' dtype (copied: the model's stays)."""
    config = copy.deepcopy(getattr(apply_fn, "config", None) or apply_fn.module.config)
    config.architectures = [type(apply_fn.module).__name__]
    floats = [t.dtype for t in params.values() if t.dtype.is_floating_point]
    if floats:
        config.dtype = max(set(floats), key=floats.count)
    return config


def _agree(mesh: Mesh, error: BaseException | None) -> None:
    """A barrier on a real mesh that raises on every process when one failed."""
    if mesh.backend == "local":
        if error is not None:
            raise error
        return
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int64)
    every = gather(flag, mesh, PartitionSpec(tuple(mesh.axis_names)))
    if error is not None:
        raise error
    if int(every.sum()):
        raise OSError(f"{_API}: another process failed to write its shard files (its own error says why).")
