"""Published training runs, held against ``fpar.plan``'s prediction (docs/plan.md's table).

Each run: the model, the layout the paper reports, the hardware, and the figure it published
(TFLOP/s per GPU as the paper counts it).  ``bench/plan.py published`` estimates every run and
stores the predictions in ``bench/plan_published.json``; ``render`` makes the table from them
(``tests/plan/test_plan_scale.py`` checks the page shows that table, and re-derives a row from
the code).  Nothing here is fit: the hardware presets and the time model are the same for
every row.
"""

from __future__ import annotations

import dataclasses

from ._models import MODELS, Layout, Model

__all__ = ["BEGIN", "END", "RUNS", "Run", "predicted_tflops", "render"]

BEGIN, END = "<!-- plan-published:begin -->", "<!-- plan-published:end -->"

_MEGATRON = "Narayanan et al. 2021 (Megatron-LM), Table 1"
_LLAMA3 = "Llama 3 paper (Dubey et al. 2024), Table 4"


@dataclasses.dataclass(frozen=True)
class Run:
    """One published run: what it trained, how it was laid out, what it reached."""

    name: str
    model: Model
    layout: Layout
    hardware: str
    published_tflops: float  # per GPU, as the paper counts it
    counts: str  # "executed": recomputation's FLOPs included (Megatron); "model": not (MFU)
    source: str
    note: str = ""


# Llama 3 405B has 126 layers; Meta balanced its 16 stages by taking one layer from the first and
# the last.  model_step puts the same number of layers on every stage, so the rows use 128.
_LLAMA_405B_128 = dataclasses.replace(MODELS["llama-405b"], name="llama-405b (128 layers)", n_layers=128)

RUNS = (
    Run(
        "Megatron GPT 1.7B, 32 A100",
        MODELS["gpt-1.7b"],
        Layout(data=32, zero=0, microbatches=4, batch=512, remat=True, sequence_parallel=False),
        "a100-80g",
        137.0,
        "executed",
        _MEGATRON,
        "microbatch size not published: 4 assumed",
    ),
    Run(
        "Megatron GPT 18B, 256 A100",
        MODELS["gpt-18b"],
        Layout(data=32, tensor=8, zero=0, microbatches=4, batch=1024, remat=True, sequence_parallel=False),
        "a100-80g",
        135.0,
        "executed",
        _MEGATRON,
        "microbatch size not published: 8 assumed",
    ),
    Run(
        "Megatron GPT 39B, 512 A100",
        MODELS["gpt-39b"],
        Layout(
            pipeline=2,
            data=32,
            tensor=8,
            zero=0,
            microbatches=48,
            batch=1536,
            remat=True,
        ),
        "a100-80g",
        138.0,
        "executed",
        _MEGATRON,
        "microbatch size 1 assumed; 1F1B; sequence parallel on (the same bytes as Megatron's "
        "all-reduces: fpar.optim.remat inside a pipeline cannot recompute them without it yet)",
    ),
    Run(
        "Llama 3 405B, 8,192 H100",
        _LLAMA_405B_128,
        Layout(pipeline=16, data=64, tensor=8, zero=1, microbatches=32, batch=2048, remat=True, virtual=2),
        "h100-sxm",
        430.0,
        "model",
        _LLAMA3,
        "128 layers for 126; microbatch size 1, 2 virtual stages and recomputation assumed",
    ),
    Run(
        "Llama 3 405B, 16,384 H100",
        _LLAMA_405B_128,
        Layout(pipeline=16, data=128, tensor=8, zero=1, microbatches=16, batch=2048, remat=True, virtual=2),
        "h100-sxm",
        400.0,
        "model",
        _LLAMA3,
        "as above",
    ),
)


def predicted_tflops(est, counts: str) -> float:
    """TFLOP/s per device of an estimate, counted as the paper counts them."""
    flops = est.flops if counts == "executed" else est.model_flops
    return flops / est.step_time / est.mesh.size / 1e12


def render(records: dict) -> str:
    """The docs table from ``{run name: {"predicted_tflops", "step_time", ...}}``."""
    lines = [
        "| run | layout | published TFLOP/s per GPU | fpar.plan | ratio | step (s) | fpar's peak GiB | source |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in RUNS:
        got = records.get(run.name)
        if got is None:
            continue
        pred = got["predicted_tflops"]
        lines.append(
            f"| {run.name} | {run.layout.describe()} | {run.published_tflops:g} ({run.counts}) | "
            f"{pred:.0f} | {pred / run.published_tflops:.2f} | {got['step_time']:.2f} | "
            f"{got['peak_gib']:.0f}{'' if got['fits'] else ' (over 80)'} | {run.source}; "
            f"{run.note} |"
        )
    return "\n".join(lines)
