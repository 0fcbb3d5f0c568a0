"""The flagship examples (examples/train_gpt.py, examples/train_vit.py), run in-process on tiny sizes.

Each example's ``main(argv)`` returns its per-step losses.  The parallel run (pipeline=2 x
data=2 x tensor=2 on 8 in-process devices) must train exactly like ``--single-device`` (float
tolerance), and resuming from a checkpoint must reproduce the uninterrupted run bit for bit.
The torchrun path of every file in examples/ is the examples tier, tests/test_examples_torchrun.py
(marked ``multiprocess``): each runs under ``torchrun`` at 2 and 4 processes (train_gpt.py also
at 8) and must print the same per-step losses and held-out figures as its in-process run with
``--devices N``.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

import train_gpt  # noqa: E402
import train_vit  # noqa: E402

MODULES = {"gpt": train_gpt, "vit": train_vit}
STEPS = 4


def run(name: str, tmp_path: Path, *extra: str, steps: int = STEPS, sub: str = "run"):
    argv = ["--tiny", "--steps", str(steps), "--warmup", "1", "--quiet", "--plot", "none", "--threads", "0"]
    argv += ["--ckpt-dir", str(tmp_path / sub), "--ckpt-every", "0", *extra]
    return MODULES[name].main(argv)


def assert_close(a: list, b: list, rtol: float = 1e-4, msg: str | None = None) -> None:
    torch.testing.assert_close(
        torch.tensor(a, dtype=torch.float64),
        torch.tensor(b, dtype=torch.float64),
        rtol=rtol,
        atol=1e-6,
        msg=msg,
    )


@pytest.mark.parametrize("name", ["gpt", "vit"])
def test_parallel_equals_single_device(name, tmp_path):
    # without dropout: the executor does not yet give each microbatch its own key (fpar.random)
    par = run(name, tmp_path, "--dropout", "0", sub="par")
    one = run(name, tmp_path, "--single-device", "--dropout", "0", sub="one")
    assert len(par.losses) == len(one.losses) == STEPS
    assert_close(par.losses, one.losses)
    assert par.losses[-1] < par.losses[0]  # it learns
    # bytes moved: tensor and data collectives, and the pipeline's sends; none on one device
    assert par.comm["tensor"] > 0 and par.comm["data"] > 0 and par.comm["pipeline p2p"] > 0
    assert sum(one.comm.values()) == 0
    assert par.mfu > 0 and math.isfinite(par.mfu)


@pytest.mark.parametrize("name", ["gpt", "vit"])
def test_resume_reproduces_the_uninterrupted_run_exactly(name, tmp_path):
    straight = run(name, tmp_path, sub="straight")
    half = STEPS // 2
    first = run(name, tmp_path, "--ckpt-every", str(half), "--stop-after", str(half), sub="resumed")
    assert len(first.losses) == half
    resumed = run(name, tmp_path, "--resume", sub="resumed")
    assert resumed.losses == straight.losses  # bit for bit: data order is a function of the step


def test_resume_on_another_layout(tmp_path):
    # the checkpoint holds the model's layout (layers stacked, split over "pipeline"), so a run
    # saved on pipeline=2 x data=2 x tensor=2 continues on one device, and on tensor=4
    straight = run("gpt", tmp_path, sub="straight")
    run("gpt", tmp_path, "--ckpt-every", "2", "--stop-after", "2", sub="ckpt")
    for i, layout in enumerate((["--single-device"], ["--parallel", "pipeline=1,data=2,tensor=2"])):
        d = tmp_path / f"copy{i}"
        import shutil

        shutil.copytree(tmp_path / "ckpt", d)
        resumed = run("gpt", tmp_path, "--resume", *layout, sub=f"copy{i}")
        assert_close(resumed.losses, straight.losses)


def test_config_and_schedules_are_the_same_model(tmp_path):
    ref = run("gpt", tmp_path, steps=2, sub="ref")
    config = run(
        "gpt", tmp_path, "--config", "dict(pipeline=2, tensor=dict(size=2, mode='1d'))", steps=2, sub="c"
    )
    assert config.losses == ref.losses  # the same mesh, from fpar.mesh_from_config
    for schedule in ("gpipe", "zb"):
        assert_close(run("gpt", tmp_path, "--schedule", schedule, steps=2, sub=schedule).losses, ref.losses)
    assert_close(
        run("vit", tmp_path, "--parallel", "pipeline=1,data=4,tensor=2", steps=2, sub="v").losses,
        run("vit", tmp_path, "--single-device", steps=2, sub="v1").losses,
    )


def test_parse_parallel_and_config():
    import _common

    assert _common.parse_parallel("pipeline=2,data=-1, tensor=4") == {"pipeline": 2, "data": -1, "tensor": 4}
    assert _common.parse_parallel("pp=1,dp=2,tp=2") == {"pipeline": 1, "data": 2, "tensor": 2}
    with pytest.raises(SystemExit, match="--parallel"):
        _common.parse_parallel("pipe=two")
    assert _common.parse_config("dict(pipeline=2, tensor=dict(size=4, mode='1d'))") == {
        "pipeline": 2,
        "tensor": {"size": 4, "mode": "1d"},
    }
    assert _common.parse_config("parallel = {'tensor': 2}") == {"tensor": 2}
    with pytest.raises(ValueError):
        _common.parse_config("dict(pipeline=__import__('os').getpid())")


def test_parallel_flags_fill_the_devices_as_a_user_reads_them():
    import argparse

    import _common

    ap = argparse.ArgumentParser()
    _common.add_args(ap, steps=1, batch=8, lr=1e-3, warmup=0)

    def sizes(argv: str, devices: int) -> tuple:
        got = _common.flag_sizes(ap.parse_args(argv.split()), devices)
        return tuple(got[a] for a in _common.AXES)

    assert _common.AXES == ("pipeline", "data", "tensor")
    assert sizes("--pp 2 --dp 2", 4) == (2, 2, 1)  # tensor takes what is left (it was 2: no mesh)
    assert sizes("--pp 2 --dp 2", 8) == (2, 2, 2)
    assert sizes("--dp 4", 8) == (2, 4, 1)
    assert sizes("--pp 2", 8) == (2, -1, 2)  # data is what is left, make_mesh infers it
    assert sizes("--tp 4", 8) == (2, -1, 4)
    assert sizes("--pp 2 --dp 2 --tp 1", 8) == (2, 2, 1)  # given: kept, make_mesh says it does not fit
    assert sizes("--pp 3 --dp 2", 8) == (3, 2, 2)  # 6 does not divide 8: left to make_mesh's error
    assert sizes("--parallel pipeline=1,data=4", 8) == (1, 4, 2)
    assert sizes("--parallel pipeline=1,data=4,tensor=1", 8) == (1, 4, 1)


def test_verbose_run_prints_meters_and_writes_the_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "loss.png"
    argv = ["--tiny", "--steps", "3", "--warmup", "1", "--threads", "0", "--log-every", "1", "--sample", "8"]
    train_gpt.main(argv + ["--ckpt-dir", str(tmp_path / "run"), "--plot", str(png)])
    out = capsys.readouterr().out
    for text in (
        "tok/s",
        "MFU",
        "bytes sent per step",
        "pipeline p2p",
        "held-out loss",
        "sample",
        "loss curve",
    ):
        assert text in out
    assert png.stat().st_size > 0
    assert train_vit.main(argv[:-2] + ["--ckpt-dir", str(tmp_path / "vit"), "--plot", "none"]).accuracy > 0


def test_the_error_file_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """A rank killed while it writes torchrun's error file must not leave a torn file.

    torchrun's agent parses every failed rank's file; an empty one crashed it with a
    JSONDecodeError instead of restarting the job (seen in CI's kill-and-resume test).
    """
    import json

    import _common

    final = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(final))
    handler = _common._whole_error_file()

    def killed(data, fp):  # the process dies after open(), before the JSON is out
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(json, "dump", killed)
        with pytest.raises(KeyboardInterrupt):
            try:
                raise ValueError("lost a peer")
            except ValueError as e:
                handler.record_exception(e)
    assert not final.exists()

    try:
        raise ValueError("lost a peer")
    except ValueError as e:
        handler.record_exception(e)
    assert json.loads(final.read_text())["message"]["message"] == "ValueError: lost a peer"
    assert [p.name for p in tmp_path.iterdir()] == ["error.json"]


def test_finetune_hf_tied_pipeline_with_zero1_equals_one_stage(tmp_path):
    # The combination a user reaches first with a small HF model: tied embeddings (the random Qwen3
    # ties them, as Qwen3-0.6B does), a pipeline, data and tensor parallelism and ZeRO-1; its losses
    # against the same model on one stage (tensor=2, plain data-parallel AdamW).
    pytest.importorskip("transformers")
    import finetune_hf

    common = ["--tiny", "--steps", "4", "--quiet", "--threads", "0"]
    piped = finetune_hf.main([*common, "--devices", "8", "--pp", "2", "--dp", "2", "--tp", "2", "--zero", "1",
                              "--out", str(tmp_path / "piped")])  # fmt: skip
    one = finetune_hf.main([*common, "--devices", "2", "--pp", "1", "--dp", "1", "--tp", "2", "--zero", "0",
                            "--out", str(tmp_path / "one")])  # fmt: skip
    # FSDP x pipeline: ZeRO-3 inside each stage, the parameters gathered once a step
    fsdp = finetune_hf.main([*common, "--devices", "4", "--pp", "2", "--dp", "2", "--tp", "1", "--zero", "3",
                             "--out", str(tmp_path / "fsdp")])  # fmt: skip
    # each decoder layer recomputed in the backward (fpar.hf.remat), in the pipeline
    remat = finetune_hf.main([*common, "--devices", "4", "--pp", "2", "--dp", "1", "--tp", "2", "--zero", "1",
                              "--remat", "--out", str(tmp_path / "remat")])  # fmt: skip
    # Megatron sequence parallelism over tensor, in the pipeline (stages send sequence blocks)
    sp = finetune_hf.main([*common, "--devices", "4", "--pp", "2", "--dp", "1", "--tp", "2", "--zero", "1",
                           "--sp", "--out", str(tmp_path / "sp")])  # fmt: skip
    assert len(piped) == len(one) == len(fsdp) == len(remat) == len(sp) == 4
    assert_close(piped, one, rtol=1e-5)
    assert_close(fsdp, one, rtol=1e-5)
    assert_close(remat, one, rtol=1e-5)
    assert_close(sp, one, rtol=1e-5)
    assert piped[-1] < piped[0]


def test_finetune_hf_expert_parallel_equals_the_moe_on_one_stage(tmp_path):
    # --ep: the random model is a tied Qwen3-MoE whose experts the model's own base_model_ep_plan
    # splits over an expert axis; its losses against the same model with every expert on every
    # device (tensor=2, plain data-parallel AdamW): beside tensor parallelism, in a pipeline with
    # FSDP, and over data x expert with ZeRO-3.
    pytest.importorskip("transformers")
    import finetune_hf

    common = ["--tiny", "--steps", "4", "--quiet", "--threads", "0"]
    one = finetune_hf.main([*common, "--moe", "--devices", "2", "--pp", "1", "--dp", "1", "--tp", "2", "--zero", "0",
                            "--out", str(tmp_path / "one")])  # fmt: skip
    layouts = {
        "expert=2 x tensor=2": ["--devices", "4"],
        "pipeline=2 x expert=2, ZeRO-3": [
            "--devices",
            "4",
            "--pp",
            "2",
            "--dp",
            "1",
            "--tp",
            "1",
            "--zero",
            "3",
        ],
        "data=2 x expert=2, ZeRO-3": ["--devices", "4", "--pp", "1", "--dp", "2", "--tp", "1", "--zero", "3"],
    }
    for name, flags in layouts.items():
        got = finetune_hf.main([*common, "--ep", "2", *flags, "--out", str(tmp_path / "ep")])
        assert_close(got, one, rtol=1e-5, msg=name)
    assert one[-1] < one[0]
    with pytest.raises(SystemExit, match=r"--ep 3 does not divide the 4 devices"):
        finetune_hf.main([*common, "--ep", "3", "--devices", "4", "--out", str(tmp_path / "bad")])
