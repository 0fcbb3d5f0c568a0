"""Workers for the real-mesh background-save test (spawned processes import them by module name).

One launch of 2 gloo processes: a background save that an in-place update follows at once, a
second save that waits for the first, then a save whose write fails on process 1 (its error
surfaces on both processes at the next save, and the previous checkpoint stays the latest).
"""

from __future__ import annotations

import os

import torch

import fpar
from fpar import P
from fpar.checkpoint import _io

F64 = torch.float64
SPECS = {"w": P("data"), "b": P(), "step": None}


def global_tree(step: int) -> dict:
    return {
        "w": torch.arange(16, dtype=F64).reshape(8, 2) + 100 * step,
        "b": torch.full((3,), float(step)),
        "step": step,
    }


def _blocks(tree: dict, mesh) -> dict:
    return {
        **fpar.device_put({"w": tree["w"], "b": tree["b"]}, mesh, {"w": P("data"), "b": P()}),
        "step": tree["step"],
    }


def background_saves(run: str) -> dict:
    mesh = fpar.make_mesh((2,), ("data",))
    rank = torch.distributed.get_rank()
    out = {}
    tree = _blocks(global_tree(1), mesh)
    handle = fpar.checkpoint.save(run, tree, mesh, SPECS, step=1, keep=1, blocking=False)
    tree["w"].add_(1000.0)  # in place, at once: must not reach the checkpoint
    tree["b"].zero_()
    out["first"] = handle.wait()
    out["step1"] = fpar.checkpoint.load(run, mesh, {"w": P(), "b": P(), "step": None}, step=1)
    fpar.checkpoint.save(run, _blocks(global_tree(2), mesh), mesh, SPECS, step=2, keep=1, blocking=False)
    out["wait"] = fpar.checkpoint.wait()  # the second save's commit
    out["after_two"] = sorted(os.listdir(run))

    real = _io.write_safetensors

    def broken(path, tensors, header):
        raise OSError("disk full (injected)")

    if rank == 1:
        _io.write_safetensors = broken
    try:
        fpar.checkpoint.save(run, _blocks(global_tree(3), mesh), mesh, SPECS, step=3, keep=1, blocking=False)
        try:  # the failure surfaces at the next save, on every process, before it writes anything
            fpar.checkpoint.save(
                run, _blocks(global_tree(4), mesh), mesh, SPECS, step=4, keep=1, blocking=False
            )
            out["next_save"] = "no error"
        except Exception as e:
            out["next_save"] = f"{type(e).__name__}: {e}"
    finally:
        _io.write_safetensors = real
    out["latest_after_failure"] = fpar.checkpoint.latest_step(run)
    handle = fpar.checkpoint.save(
        run, _blocks(global_tree(5), mesh), mesh, SPECS, step=5, keep=1, blocking=False
    )
    out["last"] = handle.wait()
    out["final"] = sorted(os.listdir(run))
    out["loaded"] = fpar.checkpoint.load(run, mesh, {"w": P(), "b": P(), "step": None})
    return out
