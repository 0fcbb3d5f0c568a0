"""A Hugging Face checkpoint directory: finding its tensors, checking them, reading slices.

A directory as ``save_pretrained`` writes it holds ``config.json`` and either one
``model.safetensors`` or shard files named by ``model.safetensors.index.json``'s ``weight_map``.
Only the files' headers are read here to check the directory (names, shapes, dtypes), so every
error is raised before a tensor is read or a message is sent.  Slices are read with
``safetensors.safe_open(...).get_slice``: one open per tensor, so that the pages of one tensor
are mapped at a time (a process's memory stays its own blocks plus at most one whole tensor).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence

import torch

__all__ = ["SINGLE", "INDEX", "Checkpoint", "CheckpointFormatError", "DTYPES"]

Tensor = torch.Tensor
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
# safetensors' dtype names (the header's "dtype") and torch's
DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_MAX_HEADER = 100_000_000  # as safetensors itself: a larger header is a corrupt file


class CheckpointFormatError(ValueError):
    """A checkpoint directory that is not as ``save_pretrained`` writes it (missing or bad files)."""


class Checkpoint:
    """The tensors of a checkpoint directory: ``{name: (file, shape, dtype)}``, from the headers.

    Args:
      path: the directory.
      api: the calling function's name, for messages.

    Raises:
      CheckpointFormatError: not a directory, no ``config.json``, no weights file, an index that
        names a missing file or a tensor its file does not hold, a file that is not safetensors.
    """

    def __init__(self, path: str | os.PathLike, api: str):
        self.api, self.path = api, os.fspath(path)
        where = f"{api}: {self.path!r}"
        fix = "pass a directory written by save_pretrained (transformers' or fpar.hf's)"
        if not os.path.isdir(self.path):
            what = "does not exist" if not os.path.exists(self.path) else "is not a directory"
            raise CheckpointFormatError(f"{where} {what}; {fix}.")
        if not os.path.isfile(os.path.join(self.path, CONFIG)):
            raise CheckpointFormatError(f"{where} has no {CONFIG}; {fix}.")
        index = os.path.join(self.path, INDEX)
        self.weight_map: dict[str, str] | None
        if os.path.isfile(index):
            self.weight_map = _read_index(index, where)
        elif os.path.isfile(os.path.join(self.path, SINGLE)):
            self.weight_map = None
        else:
            raise CheckpointFormatError(
                f"{where} has neither {SINGLE} nor {INDEX} (a .bin checkpoint cannot be read in slices: "
                f"load it once with transformers and save it again with safe_serialization=True); {fix}."
            )
        self.tensors: dict[str, tuple[str, tuple[int, ...], str]] = {}
        files = sorted(set(self.weight_map.values())) if self.weight_map else [SINGLE]
        for file in files:
            full = os.path.join(self.path, file)
            if not os.path.isfile(full):
                names = sorted(k for k, f in (self.weight_map or {}).items() if f == file)
                shown = ", ".join(names[:3]) + (" ..." if len(names) > 3 else "")
                raise CheckpointFormatError(
                    f"{where}: {INDEX} names the shard {file!r} (for {shown}), which is missing: copy "
                    f"every shard the index lists into the directory, or save the checkpoint again."
                )
            for name, (dtype, shape) in read_header(full, where).items():
                self.tensors[name] = (file, shape, dtype)
        if self.weight_map:
            for name, file in self.weight_map.items():
                entry = self.tensors.get(name)
                if entry is None or entry[0] != file:
                    raise CheckpointFormatError(
                        f"{where}: {INDEX} says {name!r} is in {file!r}, which does not hold it: the shards "
                        f"and the index are from different saves; save the checkpoint again."
                    )

    def file(self, name: str) -> str:
        return os.path.join(self.path, self.tensors[name][0])

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name][1]

    def dtype(self, name: str) -> torch.dtype | None:
        """The stored dtype (``None`` for one torch cannot hold, e.g. an fp8 variant)."""
        return DTYPES.get(self.tensors[name][2])

    def read(self, name: str, ranges: Sequence[tuple[int, int]], rows: tuple[int, Tensor] | None) -> Tensor:
        """The block ``[start, stop)`` per dim of the stored tensor, ``rows`` picked along one dim.

        ``rows=(dim, index)``: along ``dim`` the block is ``stored.index_select(dim, index)`` (the
        range of ``dim`` is ignored); the index is read as its contiguous runs.
        """
        from safetensors import safe_open

        with safe_open(self.file(name), framework="pt") as f:
            part = f.get_slice(name)
            if rows is None:
                return part[tuple(slice(a, b) for a, b in ranges)] if ranges else part[:]
            dim, index = rows
            pieces = []
            for a, b in _runs(index.tolist()):
                sl = [slice(lo, hi) for lo, hi in ranges]
                sl[dim] = slice(a, b)
                pieces.append(part[tuple(sl)])
            if not pieces:
                shape = [hi - lo for lo, hi in ranges]
                shape[dim] = 0
                return torch.empty(shape, dtype=DTYPES[self.tensors[name][2]])
            return torch.cat(pieces, dim) if len(pieces) > 1 else pieces[0]


def _runs(rows: list[int]) -> list[tuple[int, int]]:
    """``[3, 4, 5, 0, 1, 1]`` -> ``[(3, 6), (0, 2), (1, 2)]``: maximal runs of consecutive rows."""
    out: list[list[int]] = []
    for r in rows:
        if out and out[-1][1] == r:
            out[-1][1] = r + 1
        else:
            out.append([r, r + 1])
    return [(a, b) for a, b in out]


def _read_index(path: str, where: str) -> dict[str, str]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        weight_map = data["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("weight_map must map tensor names to file names")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointFormatError(
            f"{where}: {INDEX} is not a safetensors index ({type(e).__name__}: {e}); save the checkpoint again."
        ) from e
    for file in weight_map.values():
        if os.path.basename(file) != file or file.startswith("."):
            raise CheckpointFormatError(
                f"{where}: {INDEX} names {file!r}, not a file name inside the directory; save it again."
            )
    return weight_map


def read_header(path: str, where: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{name: (dtype, shape)}`` of a safetensors file, from its header alone."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > _MAX_HEADER:
                raise ValueError(f"a header of {n} bytes")
            header = json.loads(f.read(n))
        out = {}
        for name, entry in header.items():
            if name != "__metadata__":
                out[name] = (entry["dtype"], tuple(int(s) for s in entry["shape"]))
        return out
    except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
        raise CheckpointFormatError(
            f"{where}: {os.path.basename(path)!r} is not a safetensors file ({type(e).__name__}: {e}); "
            f"replace it with the file save_pretrained wrote."
        ) from e
