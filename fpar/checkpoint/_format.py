"""The on-disk description of a checkpoint: JSON for structure and metadata, never pickle.

A tree is stored as a JSON description of its containers (dict, list, tuple, NamedTuple) with
``{"leaf": i}`` at each leaf, plus one record per leaf: its dotted name, pytree path, and either
a tensor's dtype, global shape, spec and blocks, or a Python scalar's value.  Everything read
back is validated here before any tensor is touched, so a malformed or hostile index fails with
a ``CheckpointError`` rather than reaching anything that executes code.
"""

from __future__ import annotations

import collections
import math
import re
from typing import Any

import torch

from .._spec import PartitionSpec
from .._tree import keystr, tree_flatten_with_path, tree_unflatten

__all__ = ["CheckpointError"]

FORMAT = "fpar.checkpoint"
VERSION = 1
INDEX = "metadata.json"
ROOT_NAME = "<root>"  # the name of a tree that is a single tensor
SCALARS = (bool, int, float, str)
BLOCK_FILE = re.compile(r"g(\d{6})-p(\d{5})\.safetensors")


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, malformed, or not an fpar checkpoint."""


# Trees -----------------------------------------------------------------------------------------


def flatten(tree: Any, api: str) -> tuple[list[tuple], list[Any], dict]:
    """Return the paths, the leaves and the JSON description of ``tree``.

    Raises:
      TypeError: a container other than dict/list/tuple/NamedTuple, a dict key that is not a
        str or int, or a leaf that is neither a tensor, ``None`` nor a Python scalar.
    """
    paths, leaves, _ = tree_flatten_with_path(tree)
    for path, leaf in zip(paths, leaves):
        if not (isinstance(leaf, torch.Tensor) or leaf is None or isinstance(leaf, SCALARS)):
            raise TypeError(
                f"fpar.checkpoint.{api}: tree{keystr(path)} is a {type(leaf).__name__}; a checkpoint holds "
                f"tensors, None and Python scalars (bool, int, float, str) only."
            )
    index = {tuple(p): i for i, p in enumerate(paths)}
    return paths, leaves, _describe(tree, (), index, api)


def _describe(node: Any, path: tuple, index: dict, api: str) -> dict:
    if path in index:
        return {"leaf": index[path]}
    if isinstance(node, dict):
        for k in node:
            if isinstance(k, bool) or not isinstance(k, (str, int)):
                raise TypeError(
                    f"fpar.checkpoint.{api}: dict key {k!r} at tree{keystr(path)} must be a str or int."
                )
        return {"dict": [[k, _describe(v, (*path, k), index, api)] for k, v in node.items()]}
    if isinstance(node, tuple) and hasattr(type(node), "_fields"):
        items = [_describe(v, (*path, i), index, api) for i, v in enumerate(node)]
        return {"namedtuple": type(node).__name__, "fields": list(node._fields), "items": items}
    if isinstance(node, (list, tuple)):
        kind = "list" if isinstance(node, list) else "tuple"
        return {kind: [_describe(v, (*path, i), index, api) for i, v in enumerate(node)]}
    raise TypeError(
        f"fpar.checkpoint.{api}: tree{keystr(path)} is a {type(node).__name__} pytree node; checkpoints "
        f"hold dicts, lists, tuples and NamedTuples (rebuildable without unpickling)."
    )


def rebuild(desc: dict, leaves: list[Any]) -> Any:
    """Rebuild a tree from its JSON description (NamedTuples come back as same-named NamedTuples)."""
    if "leaf" in desc:
        return leaves[desc["leaf"]]
    if "dict" in desc:
        return {k: rebuild(v, leaves) for k, v in desc["dict"]}
    if "list" in desc:
        return [rebuild(v, leaves) for v in desc["list"]]
    if "tuple" in desc:
        return tuple(rebuild(v, leaves) for v in desc["tuple"])
    cls = collections.namedtuple(desc["namedtuple"], desc["fields"])
    return cls(*(rebuild(v, leaves) for v in desc["items"]))


def like_structure(like: Any, stored_paths: list[tuple], leaves: list[Any], api: str) -> Any:
    """Put ``leaves`` into the structure (and exact node types) of ``like``."""
    paths, _, treedef = tree_flatten_with_path(like)
    paths = [tuple(p) for p in paths]
    if paths != stored_paths:
        missing = [keystr(p) for p in stored_paths if p not in set(paths)][:10]
        extra = [keystr(p) for p in paths if p not in set(stored_paths)][:10]
        raise CheckpointError(
            f"fpar.checkpoint.{api}: like= has a different structure from the checkpoint: leaves only in "
            f"the checkpoint {missing}, only in like= {extra}."
        )
    return tree_unflatten(treedef, leaves)


def leaf_name(path: tuple) -> str:
    """The dotted name of a leaf (its tensor name in files): ``('params', 'w1')`` -> ``params.w1``."""
    return ".".join(str(k) for k in path) if path else ROOT_NAME


# Specs and dtypes --------------------------------------------------------------------------------


def spec_to_json(spec: PartitionSpec) -> list:
    """``P('data', None, ('a', 'b'))`` -> ``["data", null, ["a", "b"]]``."""
    return [list(e) if isinstance(e, tuple) else e for e in spec]


def spec_from_json(entries: list) -> PartitionSpec:
    """The inverse of ``spec_to_json``."""
    return PartitionSpec(*(tuple(e) if isinstance(e, list) else e for e in entries))


def dtype_to_json(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_json(name: Any, where: str) -> torch.dtype:
    """The inverse of ``dtype_to_json``, accepting only names of torch dtypes."""
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"{where}: {name!r} is not a torch dtype.")
    return dtype


# Validating what was read ------------------------------------------------------------------------


def check_index(meta: Any, where: str, *, merged: bool = False) -> dict:
    """Validate a checkpoint index (``metadata.json`` or a merged file's header) read from disk.

    Raises:
      CheckpointError: anything malformed, naming the field.
    """
    kind = FORMAT + (".merged" if merged else "")
    _need(isinstance(meta, dict) and meta.get("format") == kind, where, f"format is not {kind!r}")
    version = meta.get("version")
    if isinstance(version, int) and not isinstance(version, bool) and version > VERSION:
        raise CheckpointError(
            f"{where}: its {'header' if merged else INDEX} says format version {version}, written by a newer "
            f"fpar; this fpar reads version {VERSION}. Upgrade fpar to load it (nothing was read)."
        )
    _need(version == VERSION, where, f"version {version!r} (this fpar reads {VERSION})")
    _need(isinstance(meta.get("tree"), dict), where, "no tree description")
    leaves = meta.get("leaves")
    _need(isinstance(leaves, list), where, "no leaves")
    for i, leaf in enumerate(leaves):
        _check_leaf(leaf, f"{where}: leaves[{i}]", merged)
    _check_tree(meta["tree"], len(leaves), where)
    return meta


def _check_leaf(leaf: Any, where: str, merged: bool) -> None:
    _need(isinstance(leaf, dict), where, "not an object")
    _need(isinstance(leaf.get("name"), str), where, "no name")
    path = leaf.get("path")
    _need(isinstance(path, list) and all(isinstance(k, (str, int)) for k in path), where, "bad path")
    if leaf.get("kind") == "value":
        _need(leaf.get("value") is None or isinstance(leaf.get("value"), SCALARS), where, "bad value")
        return
    _need(leaf.get("kind") == "tensor", where, "kind is neither 'tensor' nor 'value'")
    dtype_from_json(leaf.get("dtype"), where)
    shape = leaf.get("shape")
    _need(_is_dims(shape), where, "bad shape")
    _need(isinstance(leaf.get("spec"), list), where, "bad spec")
    if merged:
        return
    blocks = leaf.get("blocks")
    _need(isinstance(blocks, list), where, "no blocks")
    for b in blocks:
        _need(isinstance(b, dict) and isinstance(b.get("file"), str), where, "a block without a file")
        check_file_name(b["file"], where)
        off, size = b.get("offsets"), b.get("shape")
        _need(_is_dims(off) and _is_dims(size) and len(off) == len(size) == len(shape), where, "bad block")
        _need(all(o + s <= n for o, s, n in zip(off, size, shape)), where, "a block outside the tensor")


def _check_tree(desc: Any, n: int, where: str) -> None:
    _need(isinstance(desc, dict) and len(desc) >= 1, where, "bad tree description")
    if "leaf" in desc:
        _need(isinstance(desc["leaf"], int) and 0 <= desc["leaf"] < n, where, "leaf index out of range")
        return
    for kind in ("list", "tuple"):
        if kind in desc:
            _need(isinstance(desc[kind], list), where, f"bad {kind}")
            for v in desc[kind]:
                _check_tree(v, n, where)
            return
    if "dict" in desc:
        _need(isinstance(desc["dict"], list), where, "bad dict")
        for item in desc["dict"]:
            _need(
                isinstance(item, list) and len(item) == 2 and isinstance(item[0], (str, int)),
                where,
                "bad dict",
            )
            _check_tree(item[1], n, where)
        return
    _need("namedtuple" in desc, where, f"unknown node {sorted(desc)}")
    name, fields, items = desc["namedtuple"], desc.get("fields"), desc.get("items")
    ok = (
        isinstance(name, str) and name.isidentifier() and isinstance(fields, list) and isinstance(items, list)
    )
    _need(
        ok and len(fields) == len(items) and all(isinstance(f, str) and f.isidentifier() for f in fields),
        where,
        "bad namedtuple",
    )
    for v in items:
        _check_tree(v, n, where)


def check_file_name(name: str, where: str) -> None:
    """A block file must be a plain ``.safetensors`` name inside the checkpoint directory."""
    plain = name == name.strip() and "/" not in name and "\\" not in name and not name.startswith(".")
    if not (plain and name.endswith(".safetensors")):
        raise CheckpointError(
            f"{where}: block file {name!r} is not a plain .safetensors file name in the checkpoint "
            f"directory; fpar reads only safetensors block files (never pickles) from there."
        )


def _is_dims(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in v)


def _need(ok: bool, where: str, what: str) -> None:
    if not ok:
        raise CheckpointError(f"{where}: malformed checkpoint metadata ({what}).")


def numel(shape) -> int:
    """Number of elements of ``shape``."""
    return math.prod(shape)
