"""fpar.checkpoint errors that teach: like= is checked, keep= never deletes the new step, an
interrupted save is cleaned up and reported as such, --resume from another model says so."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

import fpar
from fpar import P
from fpar.checkpoint import _core

MESH = fpar.make_mesh((2,), ("data",))
TREE = {"w": torch.arange(32.0).reshape(8, 4), "n": 3}


class Killed(BaseException):
    """A save stopped between writing its blocks and its commit (as by SIGKILL)."""


def test_load_like_checks_shapes_and_dtypes(tmp_path):
    fpar.checkpoint.save(tmp_path, TREE, MESH, P())
    where = f"fpar.checkpoint.load({str(tmp_path)!r})"
    with pytest.raises(fpar.checkpoint.CheckpointError) as info:
        fpar.checkpoint.load(tmp_path, MESH, P(), like={"w": torch.zeros(3, 3), "n": 0})
    assert str(info.value) == (
        f"{where}: like= has a tensor float32[3, 3] at ['w'], but the checkpoint stores a tensor "
        f"float32[8, 4] there: it was saved from another model or configuration. Load it with a "
        f"matching like= (or without like=)."
    )
    with pytest.raises(
        fpar.checkpoint.CheckpointError, match=r"like= has a tensor bfloat16\[8, 4\] at \['w'\]"
    ):
        fpar.checkpoint.load(tmp_path, MESH, P(), like={"w": torch.zeros(8, 4, dtype=torch.bfloat16), "n": 0})
    with pytest.raises(
        fpar.checkpoint.CheckpointError,
        match=r"like= has a tensor float32\[1\] at \['n'\], but the checkpoint stores 3 there",
    ):
        fpar.checkpoint.load(tmp_path, MESH, P(), like={"w": torch.zeros(8, 4), "n": torch.zeros(1)})
    got = fpar.checkpoint.load(tmp_path, MESH, P(), like={"w": torch.zeros(8, 4), "n": None})
    assert torch.equal(got["w"], TREE["w"]) and got["n"] == 3


def test_keep_never_deletes_the_step_just_written(tmp_path):
    for step in (9, 10):
        fpar.checkpoint.save(tmp_path, TREE, MESH, P(), step=step, keep=2)
    written = fpar.checkpoint.save(tmp_path, TREE, MESH, P(), step=5, keep=2)
    assert os.path.isfile(os.path.join(written, "metadata.json"))
    assert sorted(os.listdir(tmp_path)) == ["step_00000005", "step_00000009", "step_00000010"]
    assert fpar.checkpoint.load(tmp_path, MESH, P(), step=5)["n"] == 3
    fpar.checkpoint.save(tmp_path, TREE, MESH, P(), step=11, keep=2)  # then pruning resumes
    assert sorted(os.listdir(tmp_path)) == ["step_00000010", "step_00000011"]


def _interrupted_save(tmp_path, monkeypatch, step):
    def killed(*args):
        raise Killed("killed before the commit")

    monkeypatch.setattr(_core._io, "write_json", killed)
    with pytest.raises(Killed):
        fpar.checkpoint.save(tmp_path, TREE, MESH, P(), step=step)
    monkeypatch.undo()


def test_interrupted_save_is_reported_and_cleaned_up(tmp_path, monkeypatch):
    fpar.checkpoint.save(tmp_path, TREE, MESH, P(), step=1)
    _interrupted_save(tmp_path, monkeypatch, step=2)
    half = tmp_path / "step_00000002"
    assert sorted(os.listdir(half)) == ["g000000-p00000.safetensors"]  # blocks, no metadata.json
    with pytest.raises(fpar.checkpoint.CheckpointError) as info:
        fpar.checkpoint.load(half, MESH, P())
    assert str(info.value) == (
        f"fpar.checkpoint.load({str(half)!r}): an incomplete fpar checkpoint: block files "
        f"['g000000-p00000.safetensors'] but no metadata.json, so the save that wrote them was "
        f"interrupted before its commit. Load an earlier step; the next save with step= to the run "
        f"directory removes it."
    )
    assert "not an fpar checkpoint" not in str(info.value)
    assert fpar.checkpoint.load(tmp_path, MESH, P())["n"] == 3  # the newest complete step: 1
    fpar.checkpoint.save(tmp_path, TREE, MESH, P(), step=3)
    assert sorted(os.listdir(tmp_path)) == ["step_00000001", "step_00000003"]  # step 2's garbage is gone


def test_only_interrupted_steps_say_so(tmp_path, monkeypatch):
    _interrupted_save(tmp_path, monkeypatch, step=4)
    with pytest.raises(FileNotFoundError, match=r"\['step_00000004'\] are incomplete fpar checkpoints"):
        fpar.checkpoint.load(tmp_path, MESH, P())


def test_cleanup_never_touches_foreign_files(tmp_path, monkeypatch):
    mine = tmp_path / "step_00000007"
    mine.mkdir()
    (mine / "notes.txt").write_text("not fpar's")
    _interrupted_save(tmp_path, monkeypatch, step=8)
    fpar.checkpoint.save(tmp_path, TREE, MESH, P(), step=9)
    assert sorted(os.listdir(tmp_path)) == ["step_00000007", "step_00000009"]


def test_resume_from_another_models_checkpoint_says_so(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    try:
        import _common
    finally:
        sys.path.pop(0)
    params, opt = {"w": torch.zeros(4, 4)}, {"mu": {"w": torch.zeros(4, 4)}}
    specs = {"w": P()}
    _common.save(str(tmp_path), 3, params, opt, [1.0, 0.5], MESH, specs, {"mu": specs})
    step, p, o, losses = _common.restore(str(tmp_path), params, opt, MESH, specs, {"mu": specs})
    assert step == 3 and losses == [1.0, 0.5]
    other = {"w": torch.zeros(8, 4)}
    with pytest.raises(SystemExit) as info:
        _common.restore(str(tmp_path), other, {"mu": other}, MESH, specs, {"mu": specs})
    msg = str(info.value)
    assert msg.startswith(
        f"--resume: the checkpoint of step 3 in {tmp_path} was written by another model or configuration"
    )
    assert (
        "like= has a tensor float32[8, 4] at ['opt']['mu']['w'], but the checkpoint stores a tensor float32[4, 4]"
        in msg
    )
