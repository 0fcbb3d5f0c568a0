"""``save``, ``load``, ``merge``: checkpoints of sharded pytrees that reshard on load."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from typing import Any

import torch

from .._errors import SpecError
from .._mesh import Mesh
from .._spec import PartitionSpec, check_spec, global_shape
from .._tree import describe, keystr, tree_flatten_with_path, tree_leaves
from . import _async, _io
from ._async import PendingSave
from ._format import (
    FORMAT,
    INDEX,
    VERSION,
    CheckpointError,
    dtype_from_json,
    dtype_to_json,
    flatten,
    leaf_name,
    like_structure,
    numel,
    rebuild,
    spec_to_json,
)
from ._layout import Block, all_coords, blocks, plan, region, writes

__all__ = ["latest_step", "load", "merge", "save"]


# API ----------------------------------------------------------------------------------------


def save(
    path: str | os.PathLike,
    tree: Any,
    mesh: Mesh,
    specs: Any,
    *,
    step: int | None = None,
    keep: int | None = None,
    blocking: bool = True,
) -> str | PendingSave:
    """Save a sharded pytree: each process writes its own blocks, then the save commits atomically.

    A collective on a real mesh: every process calls it with its blocks (as ``fpar.shard``
    returns them) and the same specs; a block replicated over some mesh axes is written once,
    by the process at coordinate 0 along them.  In-process the tree holds global tensors and
    this one process writes them whole.  A crash (or an error on any process) before the commit
    leaves the previous checkpoint at ``path`` intact and loadable.  On a real mesh the
    processes agree on the tree and wait for each other with three tiny all-gathers (they
    show in ``fpar.comm_stats``).

    With ``blocking=False`` the save does not stop the step: after the first agreement, this
    process's blocks are copied to host memory (so a later in-place or ``donate=True`` update
    cannot change what is written) and a background thread writes them and commits; the
    processes then agree through the filesystem only (no collective leaves the calling thread).
    The checkpoint becomes the latest when process 0 writes its ``metadata.json``, once every
    process's block file exists.  A later ``save`` first waits for this one, and raises its
    error on every process; ``fpar.checkpoint.wait()`` or the handle's ``.wait()`` waits for the
    commit; a process does not exit before it.

    Args:
      path: the checkpoint directory; with ``step``, a run directory that gets ``step_<step>/``.
      tree: a pytree (dict, list, tuple, NamedTuple) of tensors, ``None`` and Python scalars,
        e.g. ``{"params": params, "opt": opt_state, "step": 10}``.
      mesh: the mesh the blocks live on (the whole mesh on a real one).
      specs: a pytree prefix of ``tree`` of ``fpar.P`` (``None`` or ``P()`` for scalars).
      step: the training step; stored, and names the subdirectory.
      keep: with ``step``, keep only the newest ``keep`` complete steps under ``path`` (and
        always the step just written, even beside newer ones).  Step directories that an
        interrupted save left without its commit are removed by the next save with ``step``;
        older steps go only after the newer one committed.
      blocking: ``False``: snapshot the blocks and write them in the background (see above).

    Returns:
      The checkpoint directory written; with ``blocking=False`` a ``PendingSave`` (``.path``,
      ``.done()``, ``.wait()`` -> the directory, once committed).

    Raises:
      TypeError: an unsupported node or leaf, or a spec that is not a ``fpar.P``.
      fpar.SpecError: a spec that does not fit the mesh or its tensor.
      ValueError: a negative ``step``, or ``keep`` without ``step``.
      CheckpointError: two leaves with the same dotted name, or processes that disagree on the
        tree (every process raises).
    """
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ValueError(f"fpar.checkpoint.save: step must be a non-negative int, got {step!r}.")
    target = _io.step_dir(os.fspath(path), step) if step is not None else os.fspath(path)
    if keep is not None and (step is None or keep < 1):
        raise ValueError(f"fpar.checkpoint.save: keep={keep} needs step= and must be at least 1.")
    proc, coords = _process(mesh, "save")
    err, leaves, gen, desc = _async.settle(), [], 0, {}  # the previous background save's error
    try:
        if err is None:
            paths, values, desc = flatten(tree, "save")
            leaves = _describe_leaves(paths, values, _specs_for(specs, paths, "save"), mesh)
            gen = _io.next_generation(target)
    except Exception as e:  # reported to every process before anything is written
        err = e
    _agree(mesh, err, _digest(leaves, gen, (step, bool(blocking))), "save")
    if not blocking:
        return _save_in_background(target, path, leaves, desc, mesh, proc, coords, gen, step, keep)
    err = _try(lambda: _write_blocks(target, leaves, mesh, proc, coords, gen, step))
    _agree(mesh, err, 0, "save")
    if proc == 0:
        err = _try(lambda: _commit(target, path, leaves, desc, mesh, gen, step, keep))
    _agree(mesh, err, 0, "save")
    return target


def load(
    path: str | os.PathLike,
    mesh: Mesh,
    specs: Any,
    *,
    step: int | None = None,
    like: Any = None,
    device: torch.device | str | None = None,
) -> Any:
    """Load a checkpoint onto ``mesh`` laid out by ``specs``, whatever mesh and specs saved it.

    Each process reads from the block files only the slices that overlap its own block (the
    files are memory-mapped) and assembles it.  No process talks to another.  Only JSON and
    safetensors are read; nothing is unpickled, and any other file is refused.

    Args:
      path: a checkpoint directory, a run directory of ``step_N`` checkpoints (the newest
        complete one, or ``step``), or a file written by ``merge``.
      mesh: the mesh to load onto (any shape; in-process: global tensors come back).
      specs: a pytree prefix of the stored tree of ``fpar.P``, the new layout.
      step: which step of a run directory.
      like: a tree with the stored structure; the result takes its node types (e.g. your own
        NamedTuple optimizer state).  Its tensor leaves must have the stored dtypes and the
        stored global shapes or block shapes of them (same rank, each dim dividing the stored
        one: blocks of any layout); other leaves (e.g. ``None``) only give the structure.  Without it dicts, lists, tuples come back as such and
        NamedTuples as same-named NamedTuples.
      device: where to put the tensors (default CPU).

    Returns:
      The tree: global tensors in-process, this process's blocks on a real mesh.

    Raises:
      FileNotFoundError: no complete checkpoint there.
      CheckpointError: not an fpar checkpoint, a malformed or incomplete one, or ``like`` of another
        structure.
      fpar.SpecError: ``specs`` that do not cover the stored leaves, or do not fit the mesh.
    """
    directory, meta, merged = _io.find(os.fspath(path), step, "load")
    proc, coords = _process(mesh, "load")
    stored = meta["leaves"]
    paths = [tuple(leaf["path"]) for leaf in stored]
    leaf_specs = _specs_for(specs, paths, "load")
    where = f"fpar.checkpoint.load({os.fspath(path)!r})"
    out = []
    with _io.BlockFiles(directory, where) as files:
        for leaf, spec in zip(stored, leaf_specs):
            out.append(_load_leaf(leaf, spec, mesh, coords, files, merged, where))
    if device is not None:
        out = [t.to(device) if isinstance(t, torch.Tensor) else t for t in out]
    if like is None:
        return rebuild(meta["tree"], out)
    result = like_structure(like, paths, out, "load")
    _check_like(like, stored, out, where)
    return result


def _fits(block: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """Whether ``block`` can be the global ``shape`` or a block of it under some layout."""
    return len(block) == len(shape) and all(b == s if b == 0 else s % b == 0 for b, s in zip(block, shape))


def _check_like(like: Any, stored: list[dict], out: list, where: str) -> None:
    """Every tensor leaf of ``like`` has the stored dtype, and the stored global shape or a block of it."""
    for record, want, got in zip(stored, tree_leaves(like), out):
        if not isinstance(want, torch.Tensor):
            continue  # a non-tensor leaf of like= only gives the structure
        name = keystr(tuple(record["path"]))
        if record.get("kind") != "tensor":
            raise CheckpointError(
                f"{where}: like= has {describe(want)} at {name}, but the checkpoint stores "
                f"{record.get('value')!r} there (a Python value): it was saved from another tree."
            )
        shape = tuple(record["shape"])
        if not _fits(tuple(want.shape), shape) or want.dtype != got.dtype:
            raise CheckpointError(
                f"{where}: like= has {describe(want)} at {name}, but the checkpoint stores a tensor "
                f"{record['dtype']}[{', '.join(map(str, shape))}] there: it was saved from another "
                f"model or configuration. Load it with a matching like= (or without like=)."
            )


def merge(
    path: str | os.PathLike, out_file: str | os.PathLike, *, step: int | None = None, transform=None
) -> str:
    """Merge a checkpoint's blocks into ONE safetensors file of full tensors (like OSLO's merge).

    The file's tensor names are the leaves' dotted names (``params.w1``; for a tree that is the
    ``params`` dict of ``fpar.functionalize``, exactly the module's ``state_dict`` keys), and its
    metadata holds the tree structure, so ``load`` reads it back onto any mesh.  Not a
    collective: call it on one process, or offline.

    Args:
      path: as for ``load``.
      out_file: the file to write (atomically).
      step: which step of a run directory.
      transform: optional ``{name: full tensor} -> {name: full tensor}`` applied before writing,
        keeping every name and dtype (e.g. ``apply_fn.export`` of ``fpar.ops.tensor_parallel``,
        which undoes GPT-2's per-device ``c_attn`` regrouping and keeps one copy of replicated kv
        heads).  A tensor whose shape it changes is recorded with its new shape: the file holds
        what the transform gave, and ``load`` reads it back so.

    Returns:
      ``out_file``.
    """
    directory, meta, merged = _io.find(os.fspath(path), step, "merge")
    where = f"fpar.checkpoint.merge({os.fspath(path)!r})"
    tensors, leaves = {}, []
    with _io.BlockFiles(directory, where) as files:
        for leaf in meta["leaves"]:
            record = {k: v for k, v in leaf.items() if k != "blocks"}
            if leaf["kind"] == "tensor":
                tensors[leaf["name"]] = _load_leaf(leaf, PartitionSpec(), None, None, files, merged, where)
            leaves.append(record)
    if transform is not None:
        tensors = _transformed(transform, tensors, where)
        for record in leaves:  # a transform may change shapes (replicated kv heads kept once)
            if record["kind"] == "tensor":
                record["shape"] = list(tensors[record["name"]].shape)
    header = _header(FORMAT + ".merged", meta.get("step"), meta.get("mesh"))
    header.update(tree=meta["tree"], leaves=leaves)
    out_file = os.fspath(out_file)
    _io.write_safetensors(out_file, tensors, header)
    return out_file


def _transformed(transform, tensors: dict, where: str) -> dict:
    out = transform(dict(tensors))
    same = isinstance(out, dict) and set(out) == set(tensors)
    if not same or any(
        not isinstance(out[k], torch.Tensor) or out[k].dtype != t.dtype for k, t in tensors.items()
    ):
        raise ValueError(
            f"{where}: transform must return a tensor of the same dtype for each name it was given."
        )
    return out


def latest_step(path: str | os.PathLike) -> int | None:
    """The newest step with a complete checkpoint under the run directory ``path`` (``None`` if none)."""
    found = _io.steps(os.fspath(path))
    return found[-1] if found else None


# Saving ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Leaf:
    name: str
    path: tuple
    spec: PartitionSpec | None
    value: Any  # this process's block (a tensor) or a Python scalar
    shape: tuple[int, ...] = ()  # global shape

    @property
    def is_tensor(self) -> bool:
        return isinstance(self.value, torch.Tensor)

    def record(self) -> dict:
        out = {"name": self.name, "path": list(self.path)}
        if not self.is_tensor:
            return {**out, "kind": "value", "value": self.value}
        return {
            **out,
            "kind": "tensor",
            "dtype": dtype_to_json(self.value.dtype),
            "shape": list(self.shape),
            "spec": spec_to_json(self.spec),
        }


def _describe_leaves(paths, values, specs, mesh: Mesh) -> list[_Leaf]:
    out, names = [], {}
    for path, value, spec in zip(paths, values, specs):
        name = leaf_name(path)
        if name in names:
            raise CheckpointError(
                f"fpar.checkpoint.save: tree{keystr(path)} and tree{keystr(names[name])} have the same dotted "
                f"name {name!r}, which names tensors in the files; rename one of the keys."
            )
        names[name] = path
        leaf = _Leaf(name, tuple(path), spec, value)
        if leaf.is_tensor:
            _check_tensor_spec(spec, f"fpar.checkpoint.save: tree{keystr(path)}")
            where = f"fpar.checkpoint.save: tree{keystr(path)}"
            dist = mesh.backend == "dist"
            check_spec(spec, tuple(value.shape), mesh.shape, where=where, blocks=dist)
            leaf.shape = global_shape(spec, tuple(value.shape), mesh.shape) if dist else tuple(value.shape)
        out.append(leaf)
    return out


def _write_blocks(target: str, leaves: list[_Leaf], mesh: Mesh, proc: int, coords, gen: int, step) -> None:
    mine = [leaf for leaf in leaves if leaf.is_tensor and writes(leaf.spec, coords)]
    if not mine:
        return
    os.makedirs(target, exist_ok=True)
    tensors = {leaf.name: leaf.value for leaf in mine}
    header = {
        **_header(FORMAT + ".blocks", step, _mesh_json(mesh)),
        "generation": gen,
        "process": proc,
        "tensors": {leaf.name: _expect(leaf, coords, mesh) for leaf in mine},
    }
    _io.write_safetensors(os.path.join(target, _file(gen, proc)), tensors, header)


def _save_in_background(target, root, leaves, desc, mesh: Mesh, proc: int, coords, gen: int, step, keep):
    """Snapshot this process's blocks, then write and commit them in a thread (see ``_async``)."""
    snap = [
        dataclasses.replace(leaf, value=_host_copy(leaf.value))
        if leaf.is_tensor and writes(leaf.spec, coords)
        else leaf
        for leaf in leaves
    ]
    group = _async.side_group() if mesh.backend == "dist" else None

    def settle(err: BaseException | None, what: str) -> None:
        if group is None:
            if err is not None:
                raise err
            return
        _async.agree(group, proc, err, what, target)

    def work() -> None:
        settle(
            _try(lambda: _write_blocks(target, snap, mesh, proc, coords, gen, step)), "write of its blocks"
        )
        err = _try(lambda: _commit(target, root, snap, desc, mesh, gen, step, keep)) if proc == 0 else None
        settle(err, "commit")

    return _async.start(target, work)


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy in host memory that later updates of ``t`` (in place, donated) cannot reach."""
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu")
    return out.copy_(t.detach())


def _files(leaves: list[_Leaf], mesh: Mesh, gen: int) -> set[str]:
    """The block files a save writes (each process that holds a written block writes one)."""
    dist = mesh.backend == "dist"
    return {
        _file(gen, b.process)
        for leaf in leaves
        if leaf.is_tensor
        for b in blocks(leaf.shape, leaf.spec, mesh.shape, dist)
    }


def _commit(target: str, root, leaves: list[_Leaf], desc: dict, mesh: Mesh, gen: int, step, keep) -> None:
    os.makedirs(target, exist_ok=True)
    records, files = [], _files(leaves, mesh, gen)
    for leaf in leaves:
        record = leaf.record()
        if leaf.is_tensor:
            stored = blocks(leaf.shape, leaf.spec, mesh.shape, mesh.backend == "dist")
            record["blocks"] = [_block_json(b, gen) for b in stored]
        records.append(record)
    meta = {
        **_header(FORMAT, step, _mesh_json(mesh)),
        "generation": gen,
        "tree": desc,
        "leaves": records,
    }
    _io.write_json(os.path.join(target, INDEX), meta)  # the commit point
    _io.collect_garbage(target, files)
    if step is not None:
        _io.remove_interrupted_steps(os.fspath(root), keep=target)
    if keep is not None:
        _prune(os.fspath(root), keep, step)


def _prune(root: str, keep: int, step: int) -> None:
    """Keep the newest ``keep`` complete steps, and always ``step``, the one just written."""
    done = _io.steps(root)
    for old in done[:-keep]:
        if old != step:
            shutil.rmtree(_io.step_dir(root, old), ignore_errors=True)


def _expect(leaf: _Leaf, coords, mesh: Mesh) -> dict:
    """What a block file says about one of its tensors (checked again when it is read)."""
    offsets, _ = region(leaf.shape, leaf.spec, mesh.shape, coords)
    return {"global_shape": list(leaf.shape), "spec": spec_to_json(leaf.spec), "offsets": list(offsets)}


def _block_json(b: Block, gen: int) -> dict:
    return {"file": _file(gen, b.process), "offsets": list(b.offsets), "shape": list(b.shape)}


def _file(gen: int, proc: int) -> str:
    return f"g{gen:06d}-p{proc:05d}.safetensors"


def _header(kind: str, step, mesh_json) -> dict:
    return {"format": kind, "version": VERSION, "step": step, "mesh": mesh_json}


def _mesh_json(mesh: Mesh) -> dict:
    processes = mesh.size if mesh.backend == "dist" else 1
    return {"axis_names": list(mesh.axis_names), "axis_sizes": list(mesh.axis_sizes), "processes": processes}


def _try(fn) -> BaseException | None:
    try:
        fn()
    except Exception as e:
        return e
    return None


# Loading --------------------------------------------------------------------------------------


def _load_leaf(leaf: dict, spec, mesh: Mesh | None, coords, files: _io.BlockFiles, merged, where: str):
    if leaf["kind"] == "value":
        return leaf["value"]
    here = f"{where}: {leaf['name']!r}"
    _check_tensor_spec(spec, here)
    shape = tuple(leaf["shape"])
    if mesh is not None:
        check_spec(spec, shape, mesh.shape, where=here)
    start, size = region(shape, spec, mesh.shape if mesh else {}, coords)
    stored = _stored_blocks(leaf, merged)
    out = torch.empty(size, dtype=dtype_from_json(leaf["dtype"], here))
    covered = 0
    for r in plan(start, size, stored):
        file = merged or leaf["blocks"][r.block]["file"]
        expect = None if merged else _expect_json(leaf, stored[r.block])
        out[r.dst] = files.read(file, leaf["name"], r.src, expect)
        covered += r.numel
    if covered != numel(size):
        raise CheckpointError(
            f"{here}: the stored blocks cover {covered} of the {numel(size)} elements needed."
        )
    return out


def _stored_blocks(leaf: dict, merged) -> list[Block]:
    if merged:
        return [Block(0, (0,) * len(leaf["shape"]), tuple(leaf["shape"]))]
    return [Block(-1, tuple(b["offsets"]), tuple(b["shape"])) for b in leaf["blocks"]]


def _expect_json(leaf: dict, b: Block) -> dict:
    return {"global_shape": leaf["shape"], "spec": leaf["spec"], "offsets": list(b.offsets)}


# Specs and processes ---------------------------------------------------------------------------


def _specs_for(specs: Any, paths: list[tuple], api: str) -> list:
    """One spec per leaf path: the spec whose path in ``specs`` is a prefix of it.

    Matching is by path (dict keys, sequence indices), so a spec tree made of the user's own
    NamedTuple matches a stored one read back from JSON.
    """
    spec_paths, spec_leaves, _ = tree_flatten_with_path(specs)
    table = {tuple(p): s for p, s in zip(spec_paths, spec_leaves)}
    used, out = set(), []
    for path in paths:
        hits = [path[:k] for k in range(len(path) + 1) if path[:k] in table]
        if not hits:
            raise SpecError(
                f"fpar.checkpoint.{api}: specs {specs!r} are not a pytree prefix of the tree: nothing "
                f"covers the leaf at {keystr(path)}."
            )
        used.add(hits[0])
        out.append(table[hits[0]])
    unused = [keystr(p) for p in table if p not in used]
    if unused:
        raise SpecError(
            f"fpar.checkpoint.{api}: specs at {unused[:10]} match no leaf of the tree (leaves: "
            f"{[keystr(p) for p in paths[:10]]}); the specs must be a pytree prefix of the tree."
        )
    return out


def _check_tensor_spec(spec: Any, where: str) -> None:
    if not isinstance(spec, PartitionSpec):
        raise TypeError(f"{where}: its spec {spec!r} must be a fpar.P (P() for a replicated tensor).")


def _process(mesh: Mesh, api: str) -> tuple[int, dict[str, int] | None]:
    """This process's number and mesh coordinates (``0, None`` in-process)."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"fpar.checkpoint.{api}: mesh must be a fpar.Mesh, got {mesh!r}.")
    if mesh.backend == "local":
        return 0, None
    from .. import _dist

    if mesh.size != _dist.world_size():
        raise ValueError(
            f"fpar.checkpoint.{api}: {mesh} covers {mesh.size} of the {_dist.world_size()} processes; "
            f"pass the whole mesh (not a submesh), so that every process takes part."
        )
    coords = {a: mesh._dist.coords[a] for a in mesh.axis_names}
    proc = all_coords(mesh.shape).index(coords)
    return proc, coords


def _digest(leaves: list[_Leaf], gen: int, step) -> int:
    described = [leaf.record() for leaf in leaves]
    data = json.dumps([described, gen, step], sort_keys=True, default=str).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=7).digest(), "little")


def _agree(mesh: Mesh, err: BaseException | None, digest: int, api: str) -> None:
    """Raise on every process if any failed or they disagree (a barrier on a real mesh)."""
    if mesh.backend == "local":
        if err is not None:
            raise err
        return
    from .. import _dist
    from .._global import gather

    device = torch.device("cuda", torch.cuda.current_device()) if _dist.device_type() == "cuda" else None
    mine = torch.tensor([[0 if err is None else 1, digest]], dtype=torch.int64, device=device)
    every = gather(mine, mesh, PartitionSpec(tuple(mesh.axis_names))).cpu()
    if err is not None:
        raise err
    failed = [p for p in range(every.shape[0]) if every[p, 0]]
    if failed:
        raise CheckpointError(
            f"fpar.checkpoint.{api}: process {failed[0]} failed (its own error says why); a save that fails "
            f"before its commit leaves the previous checkpoint in place."
        )
    if len(set(every[:, 1].tolist())) > 1:
        raise CheckpointError(
            f"fpar.checkpoint.{api}: the processes disagree on the tree (names, shapes, dtypes, specs or "
            f"step); every process must save the same structure with the same specs."
        )
