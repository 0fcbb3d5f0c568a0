"""Files: atomic writes, finding a checkpoint, and reading slices of safetensors blocks.

Atomicity: every file is written under a temporary name in its final directory, flushed and
fsynced, then ``os.replace``d into place, and the directory is fsynced.  A checkpoint is
committed by replacing its ``metadata.json`` last, which names the block files of that save;
the block files of the previous save are deleted only after the commit.  So a crash at any
point leaves either the previous checkpoint or the new one, never a mixture.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from typing import Any

import torch

from ._format import BLOCK_FILE, INDEX, CheckpointError, check_file_name, check_index

STEP_DIR = re.compile(r"step_(\d+)")


# Writing -----------------------------------------------------------------------------------------


def write_json(path: str, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` atomically."""
    data = json.dumps(obj, indent=1).encode()
    tmp = _tmp_name(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        _remove_quietly(tmp)
    fsync_dir(os.path.dirname(path))


def write_safetensors(path: str, tensors: dict[str, torch.Tensor], header: dict[str, Any]) -> None:
    """Write ``tensors`` to a safetensors file at ``path`` atomically, ``header`` as its fpar metadata."""
    from safetensors.torch import save_file

    tmp = _tmp_name(path)
    try:
        save_file(_storable(tensors), tmp, metadata={"fpar": json.dumps(header)})
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    finally:
        _remove_quietly(tmp)
    fsync_dir(os.path.dirname(path))


def _storable(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors that share no storage (safetensors refuses shared storage)."""
    out, seen = {}, set()
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen and t.numel():
            t = t.clone()
        seen.add(ptr)
        out[name] = t
    return out


def fsync_dir(path: str) -> None:
    """Make a directory's entries (a rename) durable; a no-op where directories cannot be opened."""
    try:
        fd = os.open(path or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _tmp_name(path: str) -> str:
    head, tail = os.path.split(path)
    return os.path.join(head, f".{tail}.tmp-{os.getpid()}")


def _remove_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


def next_generation(directory: str) -> int:
    """One more than any save already in ``directory`` (committed or not), so no file is overwritten."""
    gens = [-1]
    if os.path.isdir(directory):
        gens += [int(m.group(1)) for m in map(BLOCK_FILE.fullmatch, os.listdir(directory)) if m]
    committed = committed_generation(directory)
    return max([*gens, -1 if committed is None else committed]) + 1


def committed_generation(directory: str) -> int | None:
    """The generation that ``directory``'s ``metadata.json`` names (``None``: none, or unreadable)."""
    with contextlib.suppress(OSError, ValueError, TypeError, AttributeError, KeyError):
        with open(os.path.join(directory, INDEX), "rb") as f:
            return int(json.load(f)["generation"])
    return None


def collect_garbage(directory: str, keep_files: set[str]) -> None:
    """Remove block files of other saves and temporary files left by crashed ones."""
    for name in os.listdir(directory):
        stale_block = BLOCK_FILE.fullmatch(name) and name not in keep_files
        if stale_block or (name.startswith(".") and ".tmp-" in name):
            _remove_quietly(os.path.join(directory, name))


def _interrupted(directory: str) -> bool:
    """Whether ``directory`` is what a save killed before its commit leaves.

    That is: no index, and only fpar block files and temporary files (so nothing of anyone
    else's is ever removed).
    """
    if not os.path.isdir(directory) or os.path.exists(os.path.join(directory, INDEX)):
        return False
    names = os.listdir(directory)
    return all(_ours(n) for n in names)


def _ours(name: str) -> bool:
    return bool(BLOCK_FILE.fullmatch(name)) or (name.startswith(".") and ".tmp-" in name)


def remove_interrupted_steps(root: str, keep: str) -> None:
    """Remove the ``step_N`` directories of interrupted saves under a run directory (not ``keep``)."""
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if (
            STEP_DIR.fullmatch(name)
            and os.path.normpath(path) != os.path.normpath(keep)
            and _interrupted(path)
        ):
            shutil.rmtree(path, ignore_errors=True)


# Finding a checkpoint ------------------------------------------------------------------------------


def steps(path: str) -> list[int]:
    """The steps of the complete checkpoints (``step_N/metadata.json``) under ``path``, ascending."""
    if not os.path.isdir(path):
        return []
    found = []
    for name in os.listdir(path):
        m = STEP_DIR.fullmatch(name)
        if m and os.path.isfile(os.path.join(path, name, INDEX)):
            found.append(int(m.group(1)))
    return sorted(found)


def step_dir(path: str, step: int) -> str:
    """The directory of step ``step`` under a run directory."""
    return os.path.join(path, f"step_{step:08d}")


def find(path: str, step: int | None, api: str) -> tuple[str, dict, str | None]:
    """Resolve ``path`` (a checkpoint, a run directory of steps, or a merged file) and read its index.

    Returns:
      ``(directory of the block files, validated index, merged file name or None)``.

    Raises:
      FileNotFoundError: nothing there, or no complete checkpoint (of that step).
      CheckpointError: not an fpar checkpoint (e.g. a pickle), or malformed.
    """
    where = f"fpar.checkpoint.{api}({path!r})"
    if os.path.isfile(path):
        if not path.endswith(".safetensors"):
            raise CheckpointError(_not_ours(where, [os.path.basename(path)]))
        return os.path.dirname(path) or ".", _merged_index(path, where), os.path.basename(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{where}: no such file or directory.")
    if not os.path.isfile(os.path.join(path, INDEX)):
        done = steps(path)
        if step is None and not done:
            _no_checkpoint(path, where)
        if step is not None and step not in done:
            raise FileNotFoundError(
                f"{where}: no complete checkpoint for step {step}; complete steps: {done}."
            )
        path = step_dir(path, done[-1] if step is None else step)
    meta = _read_index(path, where)
    if step is not None and meta.get("step") != step:
        raise FileNotFoundError(f"{where}: the checkpoint there is step {meta.get('step')}, not {step}.")
    return path, meta, None


def _read_index(directory: str, where: str) -> dict:
    try:
        with open(os.path.join(directory, INDEX), "rb") as f:
            meta = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{where}: {INDEX} is not valid JSON ({e}).") from None
    return check_index(meta, where)


def _merged_index(path: str, where: str) -> dict:
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            header = (f.metadata() or {}).get("fpar")
    except Exception as e:  # safetensors raises its own error types for a bad header
        raise CheckpointError(f"{where}: not a readable safetensors file ({e}).") from None
    if header is None:
        raise CheckpointError(
            f"{where}: a safetensors file without fpar metadata; only fpar.checkpoint.merge output loads."
        )
    try:
        meta = json.loads(header)
    except ValueError as e:
        raise CheckpointError(f"{where}: its fpar metadata is not valid JSON ({e}).") from None
    return check_index(meta, where, merged=True)


def _no_checkpoint(path: str, where: str) -> None:
    names = sorted(os.listdir(path))
    interrupted = [n for n in names if STEP_DIR.fullmatch(n) and _interrupted(os.path.join(path, n))]
    if _interrupted(path) and names:
        raise CheckpointError(
            f"{where}: an incomplete fpar checkpoint: block files {names[:4]} but no {INDEX}, so the "
            f"save that wrote them was interrupted before its commit. Load an earlier step; the "
            f"next save with step= to the run directory removes it."
        )
    if interrupted and len(interrupted) == len([n for n in names if not n.startswith(".")]):
        raise FileNotFoundError(
            f"{where}: no complete checkpoint: {interrupted[:10]} are incomplete fpar checkpoints "
            f"(saves interrupted before their commit; the next save with step= removes them)."
        )
    foreign = [n for n in names if not n.startswith(".") and os.path.isfile(os.path.join(path, n))]
    if foreign:
        raise CheckpointError(_not_ours(where, foreign[:10]))
    raise FileNotFoundError(
        f"{where}: no complete checkpoint (no {INDEX}, no step_N/{INDEX}); it holds {names[:10]}."
    )


def _not_ours(where: str, names: list[str]) -> str:
    return (
        f"{where}: not an fpar checkpoint (found {names}). fpar.checkpoint reads only its own format, "
        f"safetensors blocks plus JSON metadata, and never unpickles (torch.load / pickle files are "
        f"refused because unpickling can run arbitrary code). Convert with "
        f"fpar.checkpoint.save after loading the file yourself from a trusted source."
    )


# Reading -------------------------------------------------------------------------------------------


class BlockFiles:
    """Open safetensors files lazily, once each, and read slices of their tensors (mmap-backed)."""

    def __init__(self, directory: str, where: str):
        self.directory, self.where = directory, where
        self._stack = contextlib.ExitStack()
        self._open: dict[str, Any] = {}

    def __enter__(self) -> BlockFiles:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def read(
        self, file: str, name: str, src: tuple[slice, ...], expect: dict[str, Any] | None
    ) -> torch.Tensor:
        """``file[name][src]``, after checking the file's own metadata against ``expect``."""
        f, header = self._handle(file)
        if expect is not None and header.get(name) != expect:
            raise CheckpointError(
                f"{self.where}: block file {file} describes {name!r} as {header.get(name)}, but the "
                f"checkpoint index says {expect}; the directory mixes files of different saves."
            )
        try:
            return f.get_slice(name)[src]
        except Exception as e:  # a missing key or a truncated file
            raise CheckpointError(f"{self.where}: cannot read {name!r} from {file} ({e}).") from None

    def _handle(self, file: str):
        if file not in self._open:
            from safetensors import safe_open

            check_file_name(file, self.where)
            path = os.path.join(self.directory, file)
            if not os.path.isfile(path):
                raise CheckpointError(
                    f"{self.where}: block file {file} is missing; the checkpoint is incomplete."
                )
            try:
                f = self._stack.enter_context(safe_open(path, framework="pt", device="cpu"))
                header = json.loads((f.metadata() or {}).get("fpar", "{}")).get("tensors", {})
            except CheckpointError:
                raise
            except Exception as e:
                raise CheckpointError(
                    f"{self.where}: block file {file} is not a readable safetensors file ({e})."
                ) from None
            self._open[file] = (f, header)
        return self._open[file]
