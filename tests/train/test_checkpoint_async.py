"""fpar.checkpoint.save(..., blocking=False): a host snapshot written and committed in the background.

In-process: values round-trip; an in-place update right after the call does not reach the
checkpoint; a second save waits for the first; an error in the background surfaces on the next
call (and on ``wait``), never lost; ``keep=`` removes older steps only after a newer one
committed, and a save still being written is never loaded.  A real 2-process mesh
(``dist_workers_ckpt_async``) checks the filesystem agreement.  Kill tests
(``checkpoint_kill.py``): the saver is SIGKILLed at random points of its background saves, and
every load afterwards gets the newest complete checkpoint.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import checkpoint_kill
import dist_workers_ckpt_async as W
import pytest
import torch

import fpar
from fpar import P
from fpar.checkpoint import CheckpointError, _core

F64 = torch.float64
SPECS = {"params": {"w": P("data"), "b": P()}, "step": None, "name": None}


def _tree(k: float) -> dict:
    return {
        "params": {"w": torch.arange(12, dtype=F64).reshape(4, 3) * k, "b": torch.full((3,), k)},
        "step": int(k),
        "name": "run",
    }


def _equal(a: dict, b: dict) -> bool:
    return (
        a["step"] == b["step"]
        and a["name"] == b["name"]
        and all(torch.equal(a["params"][n], b["params"][n]) for n in ("w", "b"))
    )


@pytest.fixture
def mesh():
    return fpar.make_mesh((2,), ("data",))


@pytest.fixture(autouse=True)
def _no_save_left():
    yield
    fpar.checkpoint.wait()  # a test that failed must not leave its save to the next test


def _held(monkeypatch, target: str):
    """Make ``target`` of ``_core`` wait for the returned event before it runs (in the thread)."""
    go, real = threading.Event(), getattr(_core, target)

    def held(*a, **kw):
        assert go.wait(60), "the test never released the background save"
        return real(*a, **kw)

    monkeypatch.setattr(_core, target, held)
    return go


def test_round_trip_and_handle(tmp_path, mesh):
    handle = fpar.checkpoint.save(tmp_path, _tree(2.0), mesh, SPECS, step=7, blocking=False)
    assert isinstance(handle, fpar.checkpoint.PendingSave)
    assert handle.wait() == handle.path == str(tmp_path / "step_00000007") and handle.done()
    assert fpar.checkpoint.wait() is None  # nothing left pending
    assert _equal(fpar.checkpoint.load(tmp_path, mesh, SPECS), _tree(2.0))
    # the same files a blocking save writes
    fpar.checkpoint.save(tmp_path / "b", _tree(2.0), mesh, SPECS, step=7)
    assert sorted(os.listdir(tmp_path / "step_00000007")) == sorted(
        os.listdir(tmp_path / "b" / "step_00000007")
    )


def test_an_update_right_after_the_call_does_not_leak(tmp_path, mesh, monkeypatch):
    go = _held(monkeypatch, "_write_blocks")  # the write starts only after the update below
    tree = _tree(1.0)
    handle = fpar.checkpoint.save(tmp_path, tree, mesh, SPECS, blocking=False)
    tree["params"]["w"].mul_(-5.0)  # in place, as an optimizer step (or donate=True) would
    tree["params"]["b"].zero_()
    assert not handle.done()
    go.set()
    handle.wait()
    assert _equal(fpar.checkpoint.load(tmp_path, mesh, SPECS), _tree(1.0))


def test_keep_removes_older_steps_only_after_the_newer_commit(tmp_path, mesh, monkeypatch):
    for k in (1, 2):
        fpar.checkpoint.save(tmp_path, _tree(k), mesh, SPECS, step=k, keep=1, blocking=False)
    fpar.checkpoint.wait()
    assert sorted(os.listdir(tmp_path)) == ["step_00000002"]
    go = _held(monkeypatch, "_commit")  # step 3's blocks are written, its commit held
    handle = fpar.checkpoint.save(tmp_path, _tree(3), mesh, SPECS, step=3, keep=1, blocking=False)
    block = tmp_path / "step_00000003" / "g000000-p00000.safetensors"
    for _ in range(6000):
        if block.exists() or handle.done():
            break
        threading.Event().wait(0.01)
    assert block.exists()  # half-written: blocks, no commit
    assert sorted(os.listdir(tmp_path)) == ["step_00000002", "step_00000003"]  # step 2 not removed yet
    assert fpar.checkpoint.latest_step(tmp_path) == 2  # the partial step is never the latest
    assert _equal(fpar.checkpoint.load(tmp_path, mesh, SPECS), _tree(2))
    go.set()
    handle.wait()
    assert sorted(os.listdir(tmp_path)) == ["step_00000003"]
    assert _equal(fpar.checkpoint.load(tmp_path, mesh, SPECS), _tree(3))


def test_a_second_save_waits_for_the_first(tmp_path, mesh, monkeypatch):
    go = _held(monkeypatch, "_commit")
    first = fpar.checkpoint.save(tmp_path, _tree(1), mesh, SPECS, step=1, blocking=False)
    threading.Timer(0.2, go.set).start()
    second = fpar.checkpoint.save(tmp_path, _tree(2), mesh, SPECS, step=2)  # blocking: waits, then writes
    assert first.done() and second == str(tmp_path / "step_00000002")
    assert (
        fpar.checkpoint.latest_step(tmp_path) == 2 and (tmp_path / "step_00000001" / "metadata.json").exists()
    )


def test_a_background_error_surfaces_on_the_next_call(tmp_path, mesh, monkeypatch):
    fpar.checkpoint.save(tmp_path, _tree(1), mesh, SPECS, step=1)

    def full(*a, **kw):
        raise OSError("No space left on device (injected)")

    monkeypatch.setattr(_core._io, "write_safetensors", full)
    handle = fpar.checkpoint.save(tmp_path, _tree(2), mesh, SPECS, step=2, blocking=False)
    with pytest.raises(OSError, match="No space left on device"):  # the next save raises it
        fpar.checkpoint.save(tmp_path, _tree(3), mesh, SPECS, step=3, blocking=False)
    assert handle.done() and handle.wait() == handle.path  # reported once
    assert fpar.checkpoint.latest_step(tmp_path) == 1
    fpar.checkpoint.save(tmp_path, _tree(3), mesh, SPECS, step=3, blocking=False)
    with pytest.raises(OSError, match="No space left on device"):  # and wait() raises it
        fpar.checkpoint.wait()
    assert fpar.checkpoint.wait() is None
    assert not os.listdir(tmp_path / "step_00000003")  # nothing written, nothing committed
    monkeypatch.undo()
    fpar.checkpoint.save(tmp_path, _tree(4), mesh, SPECS, step=4, blocking=False).wait()
    assert sorted(os.listdir(tmp_path)) == ["step_00000001", "step_00000004"]  # failed saves cleaned up
    assert _equal(fpar.checkpoint.load(tmp_path, mesh, SPECS), _tree(4))


def test_bad_input_is_rejected_on_the_calling_thread(tmp_path, mesh):
    with pytest.raises(TypeError, match=r"tree\['x'\] is a object"):
        fpar.checkpoint.save(tmp_path, {"x": object()}, mesh, {"x": None}, blocking=False)
    assert not os.listdir(tmp_path)


# Real mesh -----------------------------------------------------------------------------------------------


@pytest.mark.multiprocess
def test_real_mesh_background_saves(tmp_path):
    results = fpar.launch(W.background_saves, 2, str(tmp_path), timeout=120.0)
    for rank, out in enumerate(results):
        assert out["first"] == str(tmp_path / "step_00000001") and out["wait"] == str(
            tmp_path / "step_00000002"
        )
        got = out["step1"]
        want = W.global_tree(1)
        assert got["step"] == 1 and torch.equal(got["w"], want["w"]) and torch.equal(got["b"], want["b"])
        # keep=1: step 1 is removed after step 2 committed (process 0 removes it after its commit,
        # which is all that process 1 waits for)
        assert out["after_two"][-1] == "step_00000002" and (rank == 1 or len(out["after_two"]) == 1)
        if rank == 1:
            assert out["next_save"] == "OSError: disk full (injected)"
        else:  # process 0 learnt of process 1's failure in the save's own all-gather
            assert out["next_save"].startswith("CheckpointError: fpar.checkpoint.save(")
            assert "process 1 failed in its write of its blocks" in out["next_save"]
        assert out["latest_after_failure"] == 2
        assert out["last"] == str(tmp_path / "step_00000005") and out["final"][-1] == "step_00000005"
        assert rank == 1 or out["final"] == ["step_00000005"]  # the failed step 3 and step 4 removed
        want = W.global_tree(5)
        assert torch.equal(out["loaded"]["w"], want["w"]) and out["loaded"]["step"] == 5


# Kill tests ------------------------------------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.skipif(not os.sys.platform.startswith("linux"), reason="finds the victim's processes in /proc")
def test_killed_at_random_points_every_load_gets_the_newest_complete_checkpoint(tmp_path):
    counts = checkpoint_kill.kill_and_check(Path(tmp_path) / "run", 3, seed=1)
    assert counts["kills"] == counts["loads_checked"] == 3


# Bad input ---------------------------------------------------------------------------------------------


def test_a_checkpoint_of_a_newer_format_names_the_file_and_the_fix(tmp_path, mesh):
    fpar.checkpoint.save(tmp_path, _tree(1), mesh, SPECS, step=1, blocking=False).wait()
    index = tmp_path / "step_00000001" / "metadata.json"
    meta = json.loads(index.read_text())
    meta["version"] = 99
    index.write_text(json.dumps(meta))
    with pytest.raises(
        CheckpointError, match=r"metadata.json says format version 99, written by a newer fpar"
    ):
        fpar.checkpoint.load(tmp_path, mesh, SPECS)
    with pytest.raises(CheckpointError, match="Upgrade fpar to load it"):
        fpar.checkpoint.merge(tmp_path, tmp_path / "merged.safetensors")


def test_a_checkpoint_of_another_model_is_refused_whole(tmp_path, mesh):
    fpar.checkpoint.save(tmp_path, _tree(1), mesh, SPECS, step=1, blocking=False).wait()
    other = _tree(1)
    other["params"]["w"] = torch.zeros(4, 5, dtype=F64)  # another width
    with pytest.raises(CheckpointError, match=r"saved from another model or configuration"):
        fpar.checkpoint.load(tmp_path, mesh, SPECS, like=other)
