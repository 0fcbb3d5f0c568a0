"""The model's tensors as the checkpoint stores them: plain, renamed, or converted by transformers.

``transformers`` 5 keeps some families' checkpoints in an older layout and converts them while
loading (Mixtral: ``block_sparse_moe.experts.N.w1/w2/w3`` become ``mlp.experts.gate_up_proj`` /
``down_proj`` stacked over the experts).  Its own conversion mapping (renamings, then at most one
converter per stored key) says which stored tensors make each model tensor; a converted tensor
is read whole (its stored parts one by one, then ``transformers``' ops), so it costs one whole
model tensor while it is read, and then this process's block is cut from it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ._files import Checkpoint

__all__ = ["Entry", "entries"]

Tensor = torch.Tensor


@dataclass
class Entry:
    """One model tensor in the checkpoint: its shape and dtype as stored, where, and how to read it."""

    shape: tuple[int, ...]
    dtype: torch.dtype | None
    stored_dtype: str
    where: str  # for messages: the stored name and file
    read: Callable[[Sequence[tuple[int, int]], tuple[int, Tensor] | None], Tensor]


def entries(model: torch.nn.Module, ckpt: Checkpoint) -> dict[str, Entry]:
    """``{model tensor name: Entry}`` for every stored tensor the model's names (after conversion) cover."""
    renamings, converters = _mapping(model)
    out: dict[str, Entry] = {}
    if not renamings and not converters:
        for name in ckpt.tensors:
            out[name] = _plain(ckpt, name)
        return out
    from transformers.core_model_loading import dot_natural_key, rename_source_key

    meta = model.state_dict()
    groups: dict[str, list[tuple[str, str | None]]] = {}
    for name in sorted(ckpt.tensors, key=dot_natural_key):
        target, pattern = rename_source_key(name, renamings, converters, model.base_model_prefix, meta)
        groups.setdefault(target, []).append((name, pattern))
    for target, parts in groups.items():
        pattern = parts[0][1]
        if pattern is None and len(parts) == 1:
            out[target] = _plain(ckpt, parts[0][0])
            continue
        converter = next((c for c in converters if pattern in c.source_patterns), None)
        if converter is None:
            continue  # several stored tensors renamed onto one name: not the model's, left out
        out[target] = _converted(ckpt, converter, parts)
    return out


def _mapping(model) -> tuple[list, list]:
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:  # an older transformers: checkpoints are stored as the model names them
        return [], []
    transforms = get_model_conversion_mapping(model)
    return (
        [t for t in transforms if isinstance(t, WeightRenaming)],
        [t for t in transforms if isinstance(t, WeightConverter)],
    )


def _plain(ckpt: Checkpoint, name: str) -> Entry:
    where = f"{name!r} in {os.path.basename(ckpt.file(name))!r}"
    return Entry(
        tuple(ckpt.shape(name)),
        ckpt.dtype(name),
        ckpt.tensors[name][2],
        where,
        lambda ranges, rows: ckpt.read(name, ranges, rows),
    )


def _converted(ckpt: Checkpoint, converter, parts: list[tuple[str, str | None]]) -> Entry:
    names = [n for n, _ in parts]

    def build(load: Callable[[str], Tensor]) -> Tensor:
        inputs: dict[str, list[Tensor]] = {}
        for name, pattern in parts:
            inputs.setdefault(pattern, []).append(load(name))
        for op in converter.operations:
            inputs = op.convert(inputs, converter.source_patterns, converter.target_patterns)
        (tensor,) = inputs.values()
        return tensor

    def read(ranges, rows) -> Tensor:
        whole = build(lambda n: ckpt.read(n, [], None))
        skip = None
        if rows is not None:
            skip, whole = rows[0], whole.index_select(rows[0], rows[1])
        return whole[
            tuple(slice(None) if d == skip else slice(a, b) for d, (a, b) in enumerate(ranges))
        ].clone()

    shape = build(lambda n: torch.empty(ckpt.shape(n), device="meta")).shape
    where = f"{names[0]!r} and {len(names) - 1} more stored tensors (converted by transformers)"
    first = names[0]
    return Entry(tuple(shape), ckpt.dtype(first), ckpt.tensors[first][2], where, read)
